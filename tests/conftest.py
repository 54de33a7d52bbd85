"""Shared fixtures: every test gets its own spool under tmp_path.

`run_myq(...)` runs myq.py as a real subprocess (the way an operator or a shell
script would); `myq` is the module imported in-process, for library tests.
The helpers themselves live in _core.py (`_core.call_myq`: a quick command
in this process).
"""
import sys

import pytest

import _core
from _core import ROOT

sys.path.insert(0, ROOT)

import myq as _myq  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a long test (soak, big scan, every interpreter); "
        "`make test` runs it, `make test-fast` (-m 'not slow') leaves it out")


@pytest.fixture
def myq():
    return _myq


@pytest.fixture
def spool(tmp_path):
    path = str(tmp_path / "spool")
    _myq.main(["--spool", path, "init"])
    return path


@pytest.fixture
def run_myq():
    """run_myq(*args, input=None, env=None, timeout=60, python=None) ->
    CompletedProcess (text): _core.run_myq, a real subprocess."""
    return _core.run_myq


@pytest.fixture
def handlers_dir(tmp_path):
    """make(name, body) writes an executable sh handler and returns the dir."""
    d = tmp_path / "handlers"
    d.mkdir()

    def make(name, body):
        p = d / name
        p.write_text("#!/bin/sh\n" + body + "\n")
        p.chmod(0o755)
        return str(d)

    make.path = str(d)
    return make


@pytest.fixture
def procs(tmp_path):
    """_procs.Procs: processes a test starts, all killed at its end."""
    from _procs import Procs
    p = Procs(tmp_path)
    yield p
    p.cleanup()
