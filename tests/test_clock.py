"""Claims and time: wall-clock jumps of a year each way.

A clock that jumps never makes a job wait longer than the delay it was given
and never starts a job twice at once.  The jumps are made with libfaketime
(LD_PRELOAD) on myq's processes only, so the kernel keeps stamping files with
the real time - which is exactly what a machine whose clock went back sees:
files written before the jump carry times in the future.  A real jump moves
CLOCK_REALTIME only, so CLOCK_MONOTONIC is left alone
(FAKETIME_DONT_FAKE_MONOTONIC=1) and stat() shows the kernel's times
(NO_FAKE_STAT=1).  Handlers get a clean environment (no LD_PRELOAD): they
run on the real clock, and their files' mtimes say when they ran.

Where libfaketime cannot reproduce the disk state (files written AFTER the
jump would get real, not faked, ctimes), the state is built by hand, as the
clock effect would leave it.
"""
import json
import os
import subprocess
import time

import pytest

from _core import FAST, clean_env, enqueue, ls, show, wait_for, write_incoming
from _core import call_myq, faketime_missing, ft_env, needs_faketime
from _procs import holding_handler, lines, read_pid, reap

YEAR = 365 * 86400


@pytest.fixture
def stamp(handlers_dir, tmp_path):
    """Handler `stamp`: creates T/ran.ID; its mtime (real clock) says when.
    T/runs first, so that a test that saw T/ran.ID finds its line there."""
    return handlers_dir("stamp", 'echo "$MYQ_JOB_ID" >> "%s/runs"\n'
                        ': > "%s/ran.$MYQ_JOB_ID"' % (tmp_path, tmp_path))


def started_worker(procs, tmp_path, spool, *opts, env=None):
    """A worker logging to tmp/w.log, once it has logged its start."""
    log = tmp_path / "w.log"
    w = procs.worker(spool, *opts, env=env, log=log)
    wait_for(lambda: log.exists() and "event=start worker=" in log.read_text(),
             what="the worker to start")
    return w, log


def ran_at(tmp_path, jid, spool=None, latest=None, timeout=25):
    """When job `jid` ran (the mtime of its T/ran.ID).  With `latest`: fail
    as soon as incoming/ shows it rescheduled (mtime = available_at) to
    after that time, rather than wait for it."""
    path = tmp_path / ("ran." + jid)
    queued = os.path.join(spool or "", "incoming", jid + ".json")

    def check():
        if path.exists():
            return True
        if latest is not None:
            try:
                due = os.stat(queued).st_mtime
            except OSError:
                return False
            assert due < latest, (
                "job %s rescheduled to %.2fs from now, %.2fs too late"
                % (jid, due - time.time(), due - latest))
        return False
    wait_for(check, timeout=timeout, what="job %s to run" % jid)
    return os.stat(str(path)).st_mtime


def assert_runs_after_its_delay(spool, tmp_path, jid, t0, delay, t_upper=None):
    """Not before t0 + delay (the kernel's coarse file times may lag a few
    ms), and not a year later: well before (t_upper or t0) + twice the delay."""
    latest = (t0 if t_upper is None else t_upper) + 1.75 * delay
    ran = ran_at(tmp_path, jid, spool, latest)
    assert ran >= t0 + delay - 0.1, "ran %.2fs early" % (t0 + delay - ran)
    assert ran < latest, "ran %.2fs too late" % (ran - latest)


# The clock goes back ###########################################################

DELAY = 3.0

# libfaketime fakes myq's clock, not the kernel's: a file the worker itself
# touches after the jump gets a REAL ctime, which its faked clock sees a
# year ahead, so a second rescan would take the file for one more victim of
# the jump (and run it early).  On a real machine utime() stamps the new
# clock and a rescan is harmless.  So these tests keep the worker from
# rescanning between its first look after the jump and the due time: a long
# --poll when it starts behind, and a jump only after its first status line
# (by then it has polled incoming/ at least once and cached the job).


@needs_faketime
@pytest.mark.parametrize("offset", ["-365d", "@1970-01-02 00:00:00"])
@pytest.mark.slow
def test_worker_clock_behind_runs_job_after_its_delay(
        spool, stamp, tmp_path, procs, offset):
    """Enqueued on today's clock, then the clock is set back (a year, or to
    1970 as on a device before its first NTP sync) when the worker starts."""
    t0 = time.time()
    enqueue(call_myq, spool, "stamp", None, "--id", "d1", "--delay", DELAY)
    started_worker(procs, tmp_path, spool, "--handlers", stamp, *FAST,
                   "--poll", "30", env=ft_env(offset))
    t1 = time.time()
    assert_runs_after_its_delay(spool, tmp_path, "d1", t0, DELAY, t1)
    wait_for(lambda: show(call_myq, spool, "d1")["state"] == "done",
             what="d1 done")
    assert lines(tmp_path / "runs") == ["d1"]


@needs_faketime
@pytest.mark.slow
def test_clock_goes_back_a_year_while_the_job_waits(
        spool, stamp, tmp_path, procs):
    rc = tmp_path / "faketimerc"
    rc.write_text("+0\n")
    log = tmp_path / "w.log"
    t0 = time.time()
    enqueue(call_myq, spool, "stamp", None, "--id", "d2", "--delay", DELAY)
    procs.worker(spool, "--handlers", stamp, *FAST, "--stats-interval", "0.2",
                 env=ft_env(rcfile=rc), log=log)
    wait_for(lambda: log.exists() and " queue=" in log.read_text(),
             what="the worker's first status line")
    t1 = time.time()
    rc.write_text("-365d\n")                   # the jump
    assert_runs_after_its_delay(spool, tmp_path, "d2", t0, DELAY, t1)
    assert "event=clock_jump" in log.read_text()
    wait_for(lambda: show(call_myq, spool, "d2")["state"] == "done",
             what="d2 done")
    assert lines(tmp_path / "runs") == ["d2"]


@pytest.mark.parametrize("history", ["fresh", "retried"])
@pytest.mark.slow
def test_job_rescheduled_after_clock_went_back_is_not_deferred_again(
        run_myq, spool, stamp, tmp_path, procs, history):
    """The disk state a worker leaves when the clock went back a year: JSON
    times from the old timeline (a year ahead), the file's mtime moved to
    now + the delay, ctime now (the utime).  libfaketime cannot produce it
    (the kernel would stamp the real ctime), so it is written by hand.
    `fresh`: enqueued with a delay; `retried`: created an hour before, its
    second attempt failed a moment before the jump, backoff DELAY.  It must
    run after its delay, not be deferred again."""
    t0 = time.time()
    created = t0 + YEAR - (3600 if history == "retried" else 0)
    job = {"id": "d3", "type": "stamp", "payload": None,
           "attempts": 2 if history == "retried" else 0,
           "created_at": created, "available_at": t0 + YEAR + DELAY,
           "updated_at": t0 + YEAR, "last_error": None}
    tmp = os.path.join(spool, "tmp", "d3.part")
    with open(tmp, "w") as f:
        f.write(json.dumps(job) + "\n")
    os.utime(tmp, (t0 + DELAY, t0 + DELAY))
    os.rename(tmp, os.path.join(spool, "incoming", "d3.json"))
    procs.worker(spool, "--handlers", stamp, *FAST)
    assert_runs_after_its_delay(spool, tmp_path, "d3", t0, DELAY)


# The producer's clock is ahead ################################################

SHELL_PRODUCER = r'''
now=$(date +%%s)
printf '{"type":"stamp","payload":null,"created_at":%%s,"available_at":%%s}\n' \
    "$now" "$((now + %d))" > "$1/tmp/$2.part"
mv "$1/tmp/$2.part" "$1/incoming/$2.json"
echo "$now"
'''


@pytest.mark.parametrize("how", ["faketime", "forged"])
@pytest.mark.slow
def test_producer_clock_a_year_ahead_runs_after_its_delay(
        run_myq, spool, stamp, tmp_path, procs, how):
    """A shell producer whose clock is a year ahead drops a job whose
    created_at/available_at lie a year in the future (the file's mtime is
    the kernel's real time): it runs now + its intended delay."""
    delay = int(DELAY)
    w, log = started_worker(procs, tmp_path, spool, "--handlers", stamp, *FAST)
    t0 = time.time()
    if how == "faketime":
        if faketime_missing():
            pytest.skip(faketime_missing())
        cp = subprocess.run(["sh", "-c", SHELL_PRODUCER % delay, "sh", spool,
                             "a1"], env=clean_env(ft_env("+365d")),
                            stdout=subprocess.PIPE, universal_newlines=True,
                            timeout=30)
        assert cp.returncode == 0
        assert int(cp.stdout) > t0 + YEAR - 60, "the producer was not ahead"
    else:
        now = int(time.time()) + YEAR
        write_incoming(spool, "a1.json", {
            "type": "stamp", "payload": None, "created_at": now,
            "available_at": now + delay})
    assert_runs_after_its_delay(spool, tmp_path, "a1", t0, delay)
    assert w.poll() is None
    assert lines(tmp_path / "runs") == ["a1"]


# The clock jumps while a job runs ###############################################

@needs_faketime
@pytest.mark.parametrize("jump", ["+365d", "-365d"])
@pytest.mark.slow
def test_clock_jump_while_running_does_not_rob_the_live_owner(
        run_myq, spool, handlers_dir, tmp_path, procs, jump):
    """The owner's clock jumps a year (forward: other observers' leases all
    look expired; back: its heartbeats write leases that are a year old for
    everyone else).  `myq reap` on the jumped clock, `myq reap` on the real
    clock and a second worker (lease 1 s) on the jumped clock, all running
    for longer than the owner's lease: the job is never taken back, and it
    runs exactly once."""
    h = handlers_dir("hold", holding_handler(tmp_path))
    rc = tmp_path / "faketimerc"
    rc.write_text("+0\n")
    lease = 1.5
    enqueue(call_myq, spool, "hold", None, "--id", "r1")
    a = procs.worker(spool, "--handlers", h, "--lease", lease, *FAST,
                     env=ft_env(rcfile=rc))
    wait_for(lambda: lines(tmp_path / "runs"), what="r1 to start")
    read_pid(tmp_path / "r1.pid")
    rc.write_text(jump + "\n")                  # the owner's clock jumps
    b = procs.worker(spool, "--handlers", h, "--lease", "1", *FAST,
                     env=ft_env(jump))
    deadline = time.monotonic() + 2.5 * lease
    n = 0
    while time.monotonic() < deadline or n < 4:
        env = ft_env(jump) if n % 2 == 0 else None
        assert reap(run_myq, spool, env=env) == 0, (
            "the live owner was robbed (reap %s)" % ("jumped" if env else "real"))
        n += 1
        assert show(call_myq, spool, "r1")["state"] == "processing"
    assert a.poll() is None and b.poll() is None
    (tmp_path / "release").touch()
    wait_for(lambda: show(call_myq, spool, "r1")["state"] == "done",
             what="r1 done")
    assert lines(tmp_path / "runs") == ["r1 1"]
    assert lines(tmp_path / "effects") == ["r1"]
    assert ls(spool, "processing") == []


def test_a_record_being_written_is_no_stray_to_a_clock_a_year_ahead(spool):
    # A process whose clock jumped a year ahead sees every file as a year
    # old: a record's new version (.NAME.PID.N.tmp) that another process is
    # writing is pruned only once its writer is gone (before, `myq reap` on
    # the jumped clock took the other's file from under its rename: ENOENT).
    import myq
    sp = myq.open_store(spool)
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        locks = os.path.join(spool, "locks")
        for pid in (live.pid, dead.pid):
            with open(os.path.join(locks, ".r-x.json.%d.1.tmp" % pid), "w"):
                pass
        sp.upkeep._prune_strays(time.time() + YEAR)
        assert sorted(n for n in os.listdir(locks) if n.endswith(".tmp")) \
            == [".r-x.json.%d.1.tmp" % live.pid]
    finally:
        live.kill()
        live.wait()
