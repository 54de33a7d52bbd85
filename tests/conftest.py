"""Shared fixtures: every test gets its own spool under tmp_path.

`run_myq(...)` runs myq.py as a real subprocess (the way an operator or a shell
script would); `myq` is the module imported in-process, for library tests.
The helpers themselves live in _core.py (`_core.call_myq`: a quick command
in this process).
"""
import os
import sys

# `make test` starts pytest without PYTHONDONTWRITEBYTECODE, so that each
# of its processes loads the tests' assert-rewritten modules from
# __pycache__, and passes the caller's value in TESTS_DONTWRITEBYTECODE:
# the process that runs the tests (an xdist worker, or the only one) puts
# it back, so that what the tests start sees it as the caller set it, and
# myq.py's byte code (a script's start from its cache) is as it left it.
_DONT_WRITE = os.environ.get("TESTS_DONTWRITEBYTECODE")


def _caller_dont_write():
    if _DONT_WRITE:
        os.environ["PYTHONDONTWRITEBYTECODE"] = _DONT_WRITE


if os.environ.get("PYTEST_XDIST_WORKER"):
    _caller_dont_write()

import pytest  # noqa: E402

import _core  # noqa: E402
from _core import ROOT  # noqa: E402

sys.path.insert(0, ROOT)

_writes, sys.dont_write_bytecode = sys.dont_write_bytecode, bool(
    _DONT_WRITE or os.environ.get("PYTHONDONTWRITEBYTECODE"))
import myq as _myq  # noqa: E402
sys.dont_write_bytecode = _writes


# The files that take longest, longest first (`make test` hands the files
# out in this order: tests/README.md, "How `make test` is spread"): the
# seconds of their tests in one `make test` on 2 idle cores (the tests'
# files on a tmpfs; many of them wait rather than compute).  A file not
# listed runs after these, in name order.
LONG_FIRST = [
    "test_clock.py",             #  60 s: clock jumps, each waits its delays
    "test_intake.py",            #  48 s: HTTP and MQTT intake
    "test_outage.py",            #  41 s: a 20 s outage, then 20 s at the rate
    "test_idle_writes.py",       #  35 s
    "test_initd.py",             #  34 s: init script life cycles
    "test_security.py",          #  32 s: root's and the owner's commands
    "test_security_swaps.py",    #  25 s: symlinks and FIFOs
    "test_destinations.py",      #  21 s
    "test_mqtt.py",              #  21 s
    "test_breaker.py",           #  21 s
    "test_scheduler.py",         #  21 s
    "test_destinations_held.py",  #  20 s
    "test_intake_access.py",     #  17 s
    "test_idle.py",              #  17 s
    "test_flow.py",              #  16 s
    "test_dist.py",              #  16 s
    "test_chaos.py",             #  14 s: the chaos soak
    "test_field.py",             #  14 s
    "test_operator_setup.py",    #  13 s: installs, a change of owner
    "test_sqlite.py",            #  13 s: kills at every commit
    "test_security_producer.py",  #  13 s
    "test_storage_faults.py",    #  13 s
    "test_crashpoints.py",       #  12 s: a kill at every step
    "test_policy.py",            #  12 s
    "test_procd.py",             #  12 s
    "test_matrix.py",            #  11 s: every interpreter
    "test_ram.py",               #  11 s
    "test_liveness.py",          #  11 s
    "test_export.py",            #  10 s
    "test_http_forward.py",      #   9 s
    "test_operator.py",          #   9 s
    "test_holdwear.py",          #   9 s
    "test_operator_cli.py",      #   8 s
    "test_light.py",             #   8 s: every interpreter, python3-light
    "test_call_myq.py",          #   7 s
    "test_fast_cli.py",          #   7 s: hypothesis, both parsers
    "test_timeouts_shutdown.py",  #   7 s
]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if STORE != "files":
        # `make test-sqlite`: the tests whose spool this changes, alone (the
        # others would run as `make test` ran them: on files, or on both)
        keep = [item for item in items if _store_follows_env(item)]
        config.hook.pytest_deselected(
            items=[item for item in items if item not in keep])
        items[:] = keep


def _store_follows_env(item):
    callspec = getattr(item, "callspec", None)
    return ("store" in getattr(item, "fixturenames", ())
            and not item.get_closest_marker("files_only")
            and not item.get_closest_marker("store_free")
            and not (callspec and "store" in callspec.params))


def pytest_configure(config):
    if not getattr(config.option, "numprocesses", None):
        _caller_dont_write()        # no workers: this process runs the tests
    config.addinivalue_line(
        "markers", "files_only(why): a test of the file store's own files "
        "(its layout, a job file's bytes, a directory's entries): runs on "
        "files alone, in a file of BOTH_STORES and under MYQ_TEST_STORE=sqlite")
    config.addinivalue_line(
        "markers", "store_free(why): a test whose spool only gives it jobs "
        "(the process image, supervise --daemon, what every user can read "
        "of a command line): `make test-sqlite` leaves it out")
    config.addinivalue_line(
        "markers", "slow: a long test (soak, big scan, every interpreter); "
        "`make test` runs it, `make test-fast` (-m 'not slow') leaves it out")


@pytest.fixture
def myq():
    return _myq


# The stores (myq-spool(5) SQLITE STORE): the test files named here run
# every test that takes `spool` once per store, the same test against
# both; MYQ_TEST_STORE=sqlite makes the SQLite store every other
# file's default too (`make test-sqlite`: what else holds there).
BOTH_STORES = {
    "test_enqueue", "test_retry_dlq", "test_export", "test_clock",
    "test_handlers_module", "test_worker_modes", "test_operator",
}
# ... and these tests of other files: every handler kind, forwarding,
# intake, the policy keys, the breaker (the rest of those files inspects
# the spool's files, or would double a long file's time).
BOTH_STORES_TESTS = {
    "test_http_forward": {
        "test_worker_batches_http_jobs_gzipped_over_one_connection",
        "test_worker_batches_as_http_group_key_says"},
    "test_mqtt": {
        "test_qos1_200_jobs_each_received_once_in_order_per_topic",
        "test_bad_payload_is_dead_with_a_clear_error_and_others_go",
        "test_broker_restarted_mid_run_loses_nothing"},
    "test_intake": {
        "test_ndjson_is_many_jobs_in_order_with_their_own_ids",
        "test_idempotency_key_gives_the_id_and_a_repeat_the_same_answer",
        "test_a_conflicting_line_refuses_the_whole_request",
        "test_a_bound_is_429_a_guard_503_with_retry_after_and_counted",
        "test_killed_between_the_commit_and_the_202_the_retry_makes_no_second_job",
        "test_killed_before_the_puback_the_message_comes_again_as_the_same_job",
        "test_a_full_spool_withholds_the_puback_until_there_is_room"},
    "test_policy": {
        "test_paused_type_does_not_start_drain_exits_stats_and_check_show_it",
        "test_max_queued_reject_counts_waiting_jobs_only",
        "test_shell_producer_files_past_the_bound_are_rejected_at_scan",
        "test_drop_oldest_removes_lowest_priority_then_earliest"},
    "test_scheduler": {
        "test_expired_job_is_never_started",
        "test_priority_then_available_at_then_id",
        "test_priority_9_is_next_to_start_at_depth",
        "test_rate_holds_across_two_workers",
        "test_concurrency_slots_come_back_after_kill_9"},
    "test_breaker": {
        "test_destination_failures_of_different_jobs_hold_it",
        "test_missing_handler_holds_at_once_and_releases_when_it_appears",
        "test_http_4xx_never_trips_and_a_4xx_answer_releases"},
}
STORE = os.environ.get("MYQ_TEST_STORE", "files")


def pytest_generate_tests(metafunc):
    """A test of those files that is about the files of a spool (marked
    files_only: a job file's mode, the claim's rename) runs on files alone."""
    module = metafunc.module.__name__.rpartition(".")[2]
    if "store" in metafunc.fixturenames and (
            module in BOTH_STORES or metafunc.definition.name in
            BOTH_STORES_TESTS.get(module, ())):
        only = metafunc.definition.get_closest_marker("files_only")
        metafunc.parametrize("store", ["files"] if only else ["files", "sqlite"],
                             indirect=True)


@pytest.fixture
def store(request):
    """The store of the `spool` fixture: "files" or "sqlite" (a test marked
    files_only, or in a module so marked: files, whatever MYQ_TEST_STORE
    says)."""
    if request.node.get_closest_marker("files_only"):
        return "files"
    return getattr(request, "param", STORE)


@pytest.fixture
def spool(tmp_path, store):
    path = str(tmp_path / "spool")
    _myq.main(["--spool", path, "init", "--store", store])
    return path


@pytest.fixture
def small_tmpfs(tmp_path):
    """small_tmpfs(size, nr_inodes=None) -> the path of a tmpfs of that
    size (a real full disk, too few inodes, a read-only remount), unmounted
    at the test's end; root only:
    the test is skipped, saying why, where it cannot be had."""
    import shutil
    import subprocess
    mounted = []

    def make(size, nr_inodes=None):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        if not shutil.which("mount") or not shutil.which("umount"):
            pytest.skip("mount/umount not found")
        mnt = tmp_path / ("mnt%d" % len(mounted))
        mnt.mkdir()
        opts = "size=%s,mode=0755" % size + (
            ",nr_inodes=%d" % nr_inodes if nr_inodes else "")
        cp = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "myq-test",
                             str(mnt)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True)
        if cp.returncode != 0:
            pytest.skip("cannot mount a tmpfs here: %s" % cp.stdout.strip())
        mounted.append(str(mnt))
        return str(mnt)
    yield make
    for mnt in mounted:
        if subprocess.run(["umount", mnt]).returncode != 0:
            subprocess.run(["umount", "-l", mnt])


@pytest.fixture
def ram(tmp_path, small_tmpfs):
    """A RAM filesystem for a spool's RAM tier (init --ram): a tmpfs of
    our own (root), else /dev/shm's."""
    try:
        return os.path.join(small_tmpfs("16m"), "ram")
    except pytest.skip.Exception:
        if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
            raise
        import tempfile
        return os.path.join(tempfile.mkdtemp(dir="/dev/shm"), "ram")


@pytest.fixture
def small_fs(request, small_tmpfs):
    """A small tmpfs to fill: the test module's SMALL_FS bytes ("1m" where it
    names none)."""
    return small_tmpfs(getattr(request.module, "SMALL_FS", "1m"))


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
