"""Handler time limits and stopping a worker, with real processes.

Time limit of an exec handler: SIGTERM to its process group, SIGKILL after a
moment (a handler that traps TERM does not escape, nor does a grandchild
that ignores it), counted as a transient failure (retry, or dead on the last
attempt).  An in-process (--module) handler is interrupted by SIGALRM even in
time.sleep.  SIGTERM: the running job may finish within --grace, then the
worker exits 0; past the grace its handler is killed and the job released to
incoming/ without counting the attempt; a second SIGTERM does that at once.
SIGHUP reopens --log FILE.
"""
import json
import os
import signal

import pytest

from _core import FAST, enqueue, ls, show, wait_for, worker
from _core import call_myq
from _procs import holding_handler, lines, read_pid, wait_gone



def stubborn_handler(tmp, trap=True):
    """sh body: pid in T/ID.pid; a `sleep 1000` grandchild that IGNORES
    SIGTERM (pid in T/ID.gc); with trap, the handler itself survives SIGTERM
    (noting it in T/term); then it waits ~60 s."""
    return r'''T='%s'
echo $$ > "$T/$MYQ_JOB_ID.pid"
%s
(trap '' TERM; exec sleep 1000) >/dev/null 2>&1 </dev/null &
echo $! > "$T/$MYQ_JOB_ID.gc"
echo "$MYQ_JOB_ID $MYQ_ATTEMPT" >> "$T/runs"
i=0
while [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
echo "$MYQ_JOB_ID" >> "$T/effects"''' % (
        tmp, """trap 'echo TERM >> "$T/term"' TERM""" if trap else "")


def log_text(path):
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


# Time limits ##################################################################

@pytest.mark.slow
def test_exec_timeout_term_then_kill_whole_group_then_retry(
        run_myq, spool, handlers_dir, tmp_path, procs):
    h = handlers_dir("stub", stubborn_handler(tmp_path, trap=True))
    enqueue(call_myq, spool, "stub", None, "--id", "t1", "--max-attempts", "2")
    cp = worker(run_myq, spool, "--timeout", "0.5", handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    procs.track(read_pid(tmp_path / "t1.gc"))
    # The handler trapped TERM, so only the SIGKILL that followed ended it.
    assert lines(tmp_path / "term") == ["TERM"]
    wait_gone(read_pid(tmp_path / "t1.pid"))
    wait_gone(read_pid(tmp_path / "t1.gc"),
              what="the grandchild (it ignores TERM) to be killed too")
    job = show(call_myq, spool, "t1")
    assert job["state"] == "scheduled", job       # a retry, backoff 60 s
    assert job["attempts"] == 1, job
    assert "timed out" in job["last_error"], job
    assert lines(tmp_path / "effects") == []
    assert "event=timeout id=t1" in cp.stderr


def test_per_job_timeout_on_last_attempt_is_dead(
        run_myq, spool, handlers_dir, tmp_path, procs):
    h = handlers_dir("stub", stubborn_handler(tmp_path, trap=False))
    enqueue(call_myq, spool, "stub", None, "--id", "t2", "--timeout", "0.5",
            "--max-attempts", "1")
    # The worker's own limit is 300 s: the job's 0.5 s applies.
    cp = worker(run_myq, spool, "--timeout", "300", handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    procs.track(read_pid(tmp_path / "t2.gc"))
    # The handler died of SIGTERM; its grandchild ignores TERM and must be
    # killed with the group all the same.
    wait_gone(read_pid(tmp_path / "t2.pid"))
    wait_gone(read_pid(tmp_path / "t2.gc"),
              what="the TERM-ignoring grandchild to be killed")
    job = show(call_myq, spool, "t2")
    assert job["state"] == "dead", job
    assert job["attempts"] == 1, job
    assert "timed out" in job["last_error"], job


NAP_MODULE = '''
import time
def nap(job):
    with open(job["payload"], "a") as f:
        f.write("%s %s\\n" % (job["id"], job["attempts"]))
    try:
        time.sleep(3600)
    except Exception:
        pass            # a broad except must not swallow the time limit
    time.sleep(3600)
'''


def test_module_time_limit_interrupts_sleep(run_myq, spool, tmp_path):
    mod = tmp_path / "napmod.py"
    mod.write_text(NAP_MODULE)
    runs = tmp_path / "runs"
    enqueue(call_myq, spool, "nap", json.dumps(str(runs)), "--id", "m1",
            "--max-attempts", "2")
    enqueue(call_myq, spool, "nap", json.dumps(str(runs)), "--id", "m2",
            "--max-attempts", "1", "--timeout", "0.3")
    # Inline (concurrency 1): a 3600 s sleep would outlast the 30 s budget.
    cp = worker(run_myq, spool, "--module", str(mod), "--timeout", "0.5",
                timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert sorted(lines(runs)) == ["m1 1", "m2 1"]
    m1, m2 = show(call_myq, spool, "m1"), show(call_myq, spool, "m2")
    assert m1["state"] == "scheduled" and m1["attempts"] == 1, m1
    assert "timed out" in m1["last_error"], m1
    assert m2["state"] == "dead" and m2["attempts"] == 1, m2
    assert "timed out" in m2["last_error"], m2


# Stopping #####################################################################

def start_held(procs, run_myq, spool, tmp_path, handlers_dir, kind, *opts,
               n=1):
    """A worker (logging to tmp/w.log) running job h1 in a handler that
    waits for tmp/release; jobs h2.. wait in incoming/."""
    log = tmp_path / "w.log"
    if kind == "exec":
        h = handlers_dir("hold", holding_handler(tmp_path))
        wopts = ("--handlers", h)
        payload = None
    else:
        mod = tmp_path / "holdmod.py"
        mod.write_text('''
import os, time
def hold(job):
    t = job["payload"]
    with open(os.path.join(t, "runs"), "a") as f:
        f.write("%s %s\\n" % (job["id"], job["attempts"]))
    while not os.path.exists(os.path.join(t, "release")):
        time.sleep(0.05)
    with open(os.path.join(t, "effects"), "a") as f:
        f.write(job["id"] + "\\n")
''')
        wopts = ("--module", str(mod))
        payload = json.dumps(str(tmp_path))
    for i in range(1, n + 1):
        enqueue(call_myq, spool, "hold", payload, "--id", "h%d" % i)
    w = procs.worker(spool, *(FAST + wopts + tuple(opts)), log=log)
    wait_for(lambda: lines(tmp_path / "runs"), what="h1 to start")
    assert lines(tmp_path / "runs") == ["h1 1"]
    return w, log


def sigterm_and_wait_stopping(w, log):
    w.send_signal(signal.SIGTERM)
    wait_for(lambda: "event=stopping" in log_text(log),
             what="the worker to log event=stopping")


def test_sigterm_lets_the_running_job_finish_within_grace(
        run_myq, spool, handlers_dir, tmp_path, procs):
    w, log = start_held(procs, run_myq, spool, tmp_path, handlers_dir, "exec",
                        "--grace", "30", n=2)
    sigterm_and_wait_stopping(w, log)
    assert w.poll() is None, "the worker left before its job was finished"
    (tmp_path / "release").touch()
    assert w.wait(20) == 0
    assert show(call_myq, spool, "h1")["state"] == "done"
    h2 = show(call_myq, spool, "h2")
    assert h2["state"] == "ready" and h2["attempts"] == 0, h2   # not claimed
    assert lines(tmp_path / "runs") == ["h1 1"]
    assert lines(tmp_path / "effects") == ["h1"]


@pytest.mark.parametrize("kind,sig", [("exec", "SIGTERM"), ("module", "SIGTERM"),
                                      ("exec", "SIGINT")])
def test_sigterm_past_grace_kills_and_releases_uncounted(
        run_myq, spool, handlers_dir, tmp_path, procs, kind, sig):
    w, log = start_held(procs, run_myq, spool, tmp_path, handlers_dir, kind,
                        "--grace", "0.5")
    if kind == "exec":
        hpid, gpid = read_pid(tmp_path / "h1.pid"), read_pid(tmp_path / "h1.gc")
    w.send_signal(getattr(signal, sig))
    assert w.wait(20) == 0
    if kind == "exec":
        wait_gone(hpid)
        wait_gone(gpid)
    job = show(call_myq, spool, "h1")
    assert job["state"] == "ready", job
    assert job["attempts"] == 0, job
    assert job.get("last_error") is None, job
    assert ls(spool, "processing") == []
    assert lines(tmp_path / "effects") == []
    assert "event=released id=h1" in log_text(log)


@pytest.mark.parametrize("kind", ["exec", "module"])
def test_second_sigterm_stops_at_once_still_releasing(
        run_myq, spool, handlers_dir, tmp_path, procs, kind):
    w, log = start_held(procs, run_myq, spool, tmp_path, handlers_dir, kind,
                        "--grace", "3600")
    if kind == "exec":
        hpid, gpid = read_pid(tmp_path / "h1.pid"), read_pid(tmp_path / "h1.gc")
    sigterm_and_wait_stopping(w, log)
    assert w.poll() is None
    w.send_signal(signal.SIGTERM)
    assert w.wait(20) == 0                      # not an hour
    if kind == "exec":
        wait_gone(hpid)
        wait_gone(gpid)
    job = show(call_myq, spool, "h1")
    assert job["state"] == "ready" and job["attempts"] == 0, job
    assert ls(spool, "processing") == []
    assert lines(tmp_path / "effects") == []
    assert "event=released id=h1" in log_text(log)


# Logs #########################################################################

def test_sighup_reopens_the_log_file(spool, handlers_dir, tmp_path,
                                     procs):
    h = handlers_dir("ok", "exit 0")
    log = tmp_path / "myq.log"
    w = procs.worker(spool, "--handlers", h, "--log", str(log), *FAST)
    wait_for(lambda: "event=start worker=" in log_text(log),
             what="the start line in the log")
    rotated = tmp_path / "myq.log.1"
    os.rename(str(log), str(rotated))
    enqueue(call_myq, spool, "ok", None, "--id", "before")
    wait_for(lambda: "event=done id=before" in log_text(rotated),
             what="the worker to keep writing to the renamed file")
    w.send_signal(signal.SIGHUP)
    wait_for(lambda: log.exists(), what="a new log file after SIGHUP")
    enqueue(call_myq, spool, "ok", None, "--id", "after")
    wait_for(lambda: "event=done id=after" in log_text(log),
             what="new lines in the new log file")
    w.send_signal(signal.SIGTERM)
    assert w.wait(20) == 0
    assert "id=after" not in log_text(rotated)
    assert "event=stop " in log_text(log)
