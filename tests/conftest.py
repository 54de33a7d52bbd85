"""Shared fixtures: every test gets its own spool under tmp_path.

`run_myq(...)` runs myq.py as a real subprocess (the way an operator or a shell
script would); `myq` is the module imported in-process, for library tests.
The helpers themselves live in _core.py (`_core.call_myq`: a quick command
in this process).
"""
import os
import sys

import pytest

import _core
from _core import ROOT

sys.path.insert(0, ROOT)

import myq as _myq  # noqa: E402


# The files that take longest, longest first: `make test` (--dist loadfile
# --no-loadscope-reorder) hands files out in collection order, so these
# start first, and the short ones fill in around them instead of one long
# file starting last and running alone.  Serial wall seconds (`-p
# no:xdist`) and CPU seconds (self + children), measured for issue 24 on a
# machine that other runs loaded ~10 (an idle one takes about half the
# wall); a file not listed runs after these, in name order.
LONG_FIRST = [
    "test_security.py",         # ~130 s wall, 29 s CPU: root's and the owner's commands
    "test_security_swaps.py",   # ~130 s, 25 s: its part 1, symlinks and FIFOs
    "test_policy.py",           # ~100 s, 17 s: a 20,000-job depth, rates, pickups
    "test_intake.py",           # ~115 s, 14 s: HTTP and MQTT intake, brokers, kills
    "test_initd.py",            # 50-120 s, 27 s: init script life cycles
    "test_outage.py",           # ~50 s, 12 s: a 20 s outage, then 20 s at the rate
    "test_crashpoints.py",      # ~45 s, 11 s: a kill at every step
    "test_clock.py",            # ~30 s, 5 s: clock jumps, each waits its delays
    "test_matrix.py",           # ~28 s, 20 s: every interpreter
    "test_light.py",            # ~25 s, 16 s: every interpreter, python3-light
    "test_procd.py",            # 24-60 s, 10 s
    "test_chaos.py",            # ~21 s, 25 s: the chaos soak
    "test_storage_faults.py",   # 19-45 s, 6 s
    "test_liveness.py",         # ~14 s, 8 s: leases
    "test_handlers_exec.py",    # ~11 s, 6 s
]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "files_only: a test of the file store's own files "
        "(runs once, on files, in a file of BOTH_STORES)")
    config.addinivalue_line(
        "markers", "slow: a long test (soak, big scan, every interpreter); "
        "`make test` runs it, `make test-fast` (-m 'not slow') leaves it out")


@pytest.fixture
def myq():
    return _myq


# The stores (myq-spool(5) SQLITE STORE): the test files named here run
# every test that takes `spool` once per store, the same test against both
# (issue 26); MYQ_TEST_STORE=sqlite makes the SQLite store every other
# file's default too (`make test-sqlite`: what else holds there).
BOTH_STORES = {
    "test_enqueue", "test_retry_dlq", "test_export",
}
STORE = os.environ.get("MYQ_TEST_STORE", "files")


def pytest_generate_tests(metafunc):
    """A test of those files that is about the files of a spool (marked
    files_only: a job file's mode, the claim's rename) runs on files alone."""
    if "store" in metafunc.fixturenames and \
            metafunc.module.__name__.rpartition(".")[2] in BOTH_STORES:
        only = metafunc.definition.get_closest_marker("files_only")
        metafunc.parametrize("store", ["files"] if only else ["files", "sqlite"],
                             indirect=True)


@pytest.fixture
def store(request):
    """The store of the `spool` fixture: "files" or "sqlite"."""
    return getattr(request, "param", STORE)


@pytest.fixture
def spool(tmp_path, store):
    path = str(tmp_path / "spool")
    _myq.main(["--spool", path, "init", "--store", store])
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
