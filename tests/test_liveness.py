"""Claims and time: liveness of claims, with real processes killed.

A claim whose worker is gone (SIGKILL, pid reused, other boot) is taken back
at once - by `myq reap` or by another worker - without waiting for its lease
(the workers here run with --lease 3600), counting the attempt; a live,
heartbeating owner is never robbed, even with a tiny lease; a hung owner
(SIGSTOP) is robbed once its heartbeat is older than its lease; the handler
of a dead owner (its whole process group) is killed by whoever takes the
claim back.
"""
import json
import os
import signal
import uuid

import pytest

from _core import FAST, enqueue, ls, show, sql, stop, wait_for, worker
from _core import call_myq
from _procs import (alive, holding_handler, lines, mono, proc_start,
                    read_pid, reap, wait_gone)



@pytest.fixture
def hold(tmp_path, handlers_dir):
    """The `hold` handler (see _procs.holding_handler); returns the dir."""
    return handlers_dir("hold", holding_handler(tmp_path))


def runs(tmp_path):
    return lines(tmp_path / "runs")


def effects(tmp_path):
    return lines(tmp_path / "effects")


def start_holding(procs, run_myq, spool, hold, tmp_path, *opts, jid="j1",
                  log=None):
    """A worker that has claimed job `jid` and whose handler is running.
    Returns (worker Popen, handler pid, grandchild pid)."""
    enqueue(call_myq, spool, "hold", None, "--id", jid)
    w = procs.worker(spool, "--handlers", hold, *(FAST + tuple(opts)), log=log)
    wait_for(lambda: len(runs(tmp_path)) >= 1, what="the handler to start")
    hpid = read_pid(tmp_path / (jid + ".pid"))
    gpid = read_pid(tmp_path / (jid + ".gc"))
    assert alive(hpid) and alive(gpid)

    def recorded():         # the worker wrote the handler's pid down
        return any(n.endswith(".run")
                   for n in os.listdir(os.path.join(spool, "locks", "workers")))
    wait_for(recorded, what="the handler record in locks/workers/")
    return w, hpid, gpid


def end_lease(spool, jid, t):
    """Make job `jid`'s claim's wall-clock lease end at `t`, through its
    store: the claim file's mtime in processing/, or its row's
    leased_until."""
    n = sql(spool, "UPDATE jobs SET leased_until=? WHERE id=? AND "
            "status='processing'", (t, jid))
    if n is None:
        names = [n for n in ls(spool, "processing") if n.startswith(jid + "+")]
        assert len(names) == 1, names
        os.utime(os.path.join(spool, "processing", names[0]), (t, t))
    else:
        assert n == 1, (jid, n)


def sigkill(p):
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)


def worker_record(spool, pid):
    d = os.path.join(spool, "locks", "workers")
    for name in os.listdir(d):
        if not name.endswith(".json"):
            continue            # TOKEN.run: a handler's record
        path = os.path.join(d, name)
        with open(path) as f:
            rec = json.load(f)
        if rec.get("pid") == pid:
            return path, rec
    raise AssertionError("no worker record for pid %d in %s" % (pid, os.listdir(d)))


# Dead owners ################################################################

def test_killed_worker_claim_is_requeued_at_once_by_reap(
        run_myq, spool, hold, tmp_path, procs):
    w, hpid, gpid = start_holding(procs, run_myq, spool, hold, tmp_path,
                                  "--lease", "3600")
    assert show(call_myq, spool, "j1")["state"] == "processing"
    sigkill(w)
    assert show(call_myq, spool, "j1")["state"] == "processing"
    # The lease has an hour to go: only liveness can justify this.
    assert reap(run_myq, spool) == 1
    job = show(call_myq, spool, "j1")
    assert job["state"] == "ready", job
    assert job["attempts"] == 1, job
    assert "died" in job["last_error"], job
    assert ls(spool, "processing") == []
    assert reap(run_myq, spool) == 0            # nothing left to take back


def test_reaper_kills_the_orphaned_handler_process_group(
        run_myq, spool, hold, tmp_path, procs):
    w, hpid, gpid = start_holding(procs, run_myq, spool, hold, tmp_path,
                                  "--lease", "3600")
    sigkill(w)
    # The handler runs in its own session: killing the worker orphans it.
    assert alive(hpid) and alive(gpid), "the orphan should still run"
    assert reap(run_myq, spool) == 1
    wait_gone(hpid, what="the orphaned handler to be killed")
    wait_gone(gpid, what="the orphaned handler's grandchild to be killed")
    (tmp_path / "release").touch()
    assert effects(tmp_path) == []


def test_killed_worker_claim_is_taken_by_a_running_worker(
        run_myq, spool, hold, tmp_path, procs):
    a, hpid, gpid = start_holding(procs, run_myq, spool, hold, tmp_path,
                                  "--lease", "3600")
    # B is idle and already running; its own lease only sets how often it
    # reaps (every lease/2).  A's claim has an hour to go.
    log = tmp_path / "b.log"
    b = procs.worker(spool, "--handlers", hold, "--lease", "2", *FAST, log=log)
    wait_for(lambda: "event=start worker=" in log.read_text()
             if log.exists() else False, what="worker B to start")
    sigkill(a)
    wait_for(lambda: len(runs(tmp_path)) == 2, timeout=20,
             what="B to take back and rerun j1")
    # B killed A's orphaned handler before running j1 again.
    wait_gone(hpid)
    wait_gone(gpid)
    (tmp_path / "release").touch()
    wait_for(lambda: show(call_myq, spool, "j1")["state"] == "done",
             what="B to finish j1")
    assert runs(tmp_path) == ["j1 1", "j1 2"]
    assert effects(tmp_path) == ["j1"]
    text = log.read_text()
    assert "event=requeued id=j1" in text and "died" in text, text
    assert stop(b) == 0


def test_killed_worker_claim_is_taken_by_a_starting_worker(
        run_myq, spool, hold, tmp_path, procs):
    a, hpid, gpid = start_holding(procs, run_myq, spool, hold, tmp_path,
                                  "--lease", "3600")
    sigkill(a)
    b = procs.worker(spool, "--drain", "--handlers", hold, *FAST)
    wait_for(lambda: len(runs(tmp_path)) == 2, timeout=20,
             what="B to take back and rerun j1")
    wait_gone(hpid)
    wait_gone(gpid)
    (tmp_path / "release").touch()
    assert b.wait(30) == 0
    job = show(call_myq, spool, "j1")
    assert job["state"] == "done", job
    assert runs(tmp_path) == ["j1 1", "j1 2"]
    assert effects(tmp_path) == ["j1"]


# Live owners ################################################################

SLOW_MODULE = '''
import os, time
def slow(job):
    with open(job["payload"]["runs"], "a") as f:
        f.write(job["id"] + "\\n")
    for _ in range(1200):               # until the test releases it (60 s cap)
        if os.path.exists(job["payload"]["release"]):
            break
        time.sleep(0.05)
    with open(job["payload"]["effects"], "a") as f:
        f.write(job["id"] + "\\n")
'''


@pytest.mark.parametrize("kind", ["exec", "module"])
@pytest.mark.slow
def test_live_worker_with_tiny_lease_is_never_robbed(
        run_myq, spool, handlers_dir, tmp_path, procs, kind):
    """Lease 1 s; the handler runs until the test releases it: after at
    least 3 reaps AND 3 leases since a second worker (lease 1 s, reaping
    every 0.5 s) started.  Meanwhile `myq reap` never takes the job, and it
    runs exactly once.  (Before, the handler slept 3 s and the test counted
    the reaps that fit in them: a loaded machine fitted one, not 2.)"""
    runs_f, eff_f = tmp_path / "runs", tmp_path / "effects"
    release = tmp_path / "release"
    if kind == "exec":
        h = handlers_dir("slow", 'echo "$MYQ_JOB_ID" >> "%s"\n'
                         'i=0; while [ ! -e "%s" ] && [ $i -lt 1200 ]; do '
                         'sleep 0.05; i=$((i+1)); done\n'
                         'echo "$MYQ_JOB_ID" >> "%s"' % (runs_f, release, eff_f))
        opts = ("--handlers", h)
    else:
        mod = tmp_path / "slowmod.py"
        mod.write_text(SLOW_MODULE)
        opts = ("--module", str(mod))
    payload = json.dumps({"runs": str(runs_f), "effects": str(eff_f),
                          "release": str(release)})
    enqueue(call_myq, spool, "slow", payload, "--id", "s1")
    a = procs.worker(spool, "--lease", "1", *(FAST + opts))
    wait_for(lambda: lines(runs_f), what="the handler to start")
    log = tmp_path / "b.log"
    b = procs.worker(spool, "--lease", "1", *(FAST + opts), log=log)
    wait_for(lambda: log.exists() and "event=start worker=" in log.read_text(),
             what="worker B to start")
    t0 = mono()
    reaps = 0
    while reaps < 3 or mono() - t0 < 3 * 1.0:   # 3 leases: a lower bound
        assert reap(run_myq, spool) == 0, "a live owner was robbed"
        reaps += 1
        assert a.poll() is None and b.poll() is None
        assert show(call_myq, spool, "s1")["state"] == "processing"
        assert lines(eff_f) == [], "the handler ended before its release"
    release.touch()
    wait_for(lambda: show(call_myq, spool, "s1")["state"] == "done",
             what="s1 to be done")
    assert reaps >= 2
    assert lines(runs_f) == ["s1"] and lines(eff_f) == ["s1"]
    assert stop(a) == 0 and stop(b) == 0
    assert lines(runs_f) == ["s1"]
    assert "event=requeued" not in log.read_text()


# Forged owners: pid reuse, another boot #####################################

@pytest.mark.parametrize("case", ["pid_reused", "other_boot", "alive"])
def test_owner_identity(run_myq, spool, hold, tmp_path, procs, case):
    """The record of a SIGKILLed worker is rewritten to point at a live
    process (a `sleep`): with the wrong start time (pid reused) or another
    boot id it is dead; with everything right (and a fresh heartbeat) it is
    alive and keeps its claim even though the claim's wall-clock lease is
    long past."""
    w, hpid, gpid = start_holding(procs, run_myq, spool, hold, tmp_path,
                                  "--lease", "3600")
    sigkill(w)
    path, rec = worker_record(spool, w.pid)
    other = procs.spawn(["sleep", "60"])
    start = wait_for(lambda: proc_start(other.pid), what="sleep to start")
    rec["pid"] = other.pid
    if case == "pid_reused":
        assert rec["start"] != start
    else:
        rec["start"] = start
    if case == "other_boot":
        rec["boot_id"] = str(uuid.uuid4())
    with open(path, "w") as f:
        json.dump(rec, f)
    beat = mono()                               # heartbeat: monotonic mtime
    os.utime(path, (beat, beat))
    end_lease(spool, "j1", 1000000000)          # wall-clock lease: 2001
    n = reap(run_myq, spool)
    job = show(call_myq, spool, "j1")
    if case == "alive":
        assert n == 0 and job["state"] == "processing", job
        assert alive(hpid)
        return
    assert n == 1
    assert job["state"] == "ready" and job["attempts"] == 1, job
    want = "died" if case == "pid_reused" else "reboot"
    assert want in job["last_error"], job
    assert alive(other.pid), "the innocent process was touched"
    wait_gone(hpid)


# A handler that kills its own worker #########################################

def test_poison_pill_ends_in_dlq_after_max_attempts(
        run_myq, spool, handlers_dir, tmp_path):
    runs_f = tmp_path / "runs"
    h = handlers_dir("pill", 'echo "$MYQ_ATTEMPT" >> "%s"\nkill -9 $PPID' % runs_f)
    enqueue(call_myq, spool, "pill", None, "--id", "p1", "--max-attempts", "3")
    codes = []
    while True:
        cp = worker(run_myq, spool, "--lease", "3600", handlers=h, timeout=30)
        codes.append(cp.returncode)
        if cp.returncode == 0:
            break
        assert cp.returncode == -signal.SIGKILL, cp.stderr
        assert len(codes) < 10, codes
    # Three workers died; the fourth found attempts exhausted: dead.
    assert codes == [-9, -9, -9, 0]
    assert lines(runs_f) == ["1", "2", "3"]
    job = show(call_myq, spool, "p1")
    assert job["state"] == "dead", job
    assert job["attempts"] == 3, job
    assert "died" in job["last_error"], job
    assert ls(spool, "processing") == []


# A hung owner #################################################################

@pytest.mark.slow
def test_hung_worker_is_robbed_after_its_lease(
        run_myq, spool, hold, tmp_path, procs):
    lease = 3.0
    log = tmp_path / "a.log"
    a, hpid, gpid = start_holding(procs, run_myq, spool, hold, tmp_path,
                                  "--lease", lease, log=log)
    t0 = mono()
    a.send_signal(signal.SIGSTOP)
    wait_for(lambda: open("/proc/%d/stat" % a.pid).read().split(") ")[1][0]
             == "T", what="the worker to stop")
    # Its last heartbeat was at most lease/3 before t0: it may be robbed
    # only once the heartbeat is older than the lease.
    while True:
        n = reap(run_myq, spool)
        t1 = mono()
        if n:
            break
        assert t1 - t0 < lease + 15, "the hung worker was never robbed"
    assert t1 >= t0 + lease * 2 / 3, "robbed before its lease ran out"
    job = show(call_myq, spool, "j1")
    assert job["state"] == "ready" and job["attempts"] == 1, job
    assert "hung" in job["last_error"] or "heartbeat" in job["last_error"], job
    wait_gone(hpid, what="the hung worker's handler to be killed")
    wait_gone(gpid)
    # The hung worker itself is killed first, as a watchdog would: a
    # handler in its process (--module, http) would go on beside the
    # job's next run once it woke; its supervisor starts another.
    assert a.wait(10) == -signal.SIGKILL and "killed" in job["last_error"]
    (tmp_path / "release").touch()
    b = procs.worker(spool, "--handlers", hold, *FAST)
    wait_for(lambda: show(call_myq, spool, "j1")["state"] == "done",
             timeout=20, what="j1 done by the next worker")
    assert stop(b) == 0
    assert runs(tmp_path) == ["j1 1", "j1 2"]
    assert effects(tmp_path) == ["j1"]
    assert ls(spool, "dlq") == [] and ls(spool, "incoming") == []


def test_claim_of_a_worker_whose_record_is_empty_is_taken_back_at_once(
        myq, spool):
    """A power cut before a worker's record was written leaves it empty
    (found by the UBIFS power cuts): it cannot say the worker lives, so its
    claims are taken back at once, not after their lease."""
    sp = myq.open_store(spool)
    jid = sp.enqueue("t", {"n": 1})
    me = myq.Identity(sp)
    me.register()
    c = sp.claims.claim(jid + ".json", me)
    assert c is not None
    sp.claims.close(c)
    open(me.path, "w").close()          # the record, as a cut left it
    assert sp.reap() == 1
    assert ls(spool, "processing") == []
    assert ls(spool, "incoming") == [jid + ".json"]
