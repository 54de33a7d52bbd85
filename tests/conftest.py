"""Shared fixtures: every test gets its own spool under tmp_path.

`run_myq(...)` runs myq.py as a real subprocess (the way an operator or a shell
script would); `myq` is the module imported in-process, for library tests.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MYQ = os.path.join(ROOT, "myq.py")
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


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYQ_")}
    env.update(extra or {})
    return env


@pytest.fixture
def run_myq():
    """run_myq(*args, input=None, env=None, timeout=60) -> CompletedProcess (text)."""

    def run(*args, input=None, env=None, timeout=60, python=None):
        return subprocess.run(
            [python or sys.executable, MYQ] + [str(a) for a in args],
            input=input, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            universal_newlines=True, env=_env(env), timeout=timeout)

    return run


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
