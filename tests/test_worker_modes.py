"""`myq worker`: its modes and options, at-least-once, its log lines."""
import json
import os
import shutil
import signal
import time

import pytest

from _core import (FAST, LOG_RE, STATUS_RE, blocking_handler, enqueue,
                   kill_quiet, ls, show, start_worker, stop, wait_for, worker)
from _core import call_myq


def counting_handler(handlers_dir, tmp_path, name="t", code=0):
    runs = tmp_path / "runs"
    h = handlers_dir(name, 'echo "$MYQ_JOB_ID" >> "%s"\nexit %d' % (runs, code))
    return h, runs


def runs_of(runs):
    return runs.read_text().split() if runs.exists() else []


def test_once_on_empty_queue_exits_0(run_myq, spool):
    cp = worker(run_myq, spool, mode="--once", timeout=15)
    assert cp.returncode == 0, cp.stderr


def test_once_runs_at_most_one_job(run_myq, spool, handlers_dir, tmp_path):
    h, runs = counting_handler(handlers_dir, tmp_path)
    ids = [enqueue(call_myq, spool, "t") for _ in range(3)]
    cp = worker(run_myq, spool, handlers=h, mode="--once")
    assert cp.returncode == 0, cp.stderr
    assert len(runs_of(runs)) == 1
    assert runs_of(runs)[0] in ids
    assert len(ls(spool, "done")) == 1
    assert len(ls(spool, "incoming")) == 2


def test_drain_runs_ready_jobs_and_leaves_scheduled(run_myq, spool, handlers_dir, tmp_path):
    h, runs = counting_handler(handlers_dir, tmp_path)
    ids = [enqueue(call_myq, spool, "t") for _ in range(3)]
    later = enqueue(call_myq, spool, "t", "null", "--delay", "300")
    cp = worker(run_myq, spool, handlers=h)
    assert cp.returncode == 0, cp.stderr
    assert sorted(runs_of(runs)) == sorted(ids)
    assert show(call_myq, spool, later)["state"] == "scheduled"
    for i in ids:
        assert show(call_myq, spool, i)["state"] == "done"


def run_concurrently(run_myq, spool, handlers_dir, tmp_path, n, opts, env=None):
    body, started, release = blocking_handler(tmp_path)
    h = handlers_dir("block", body)
    for i in range(n):
        enqueue(call_myq, spool, "block", "--id", "c%d" % i)
    w = start_worker(spool, "--drain", "--handlers", h, *(FAST + tuple(opts)), env=env)
    try:
        wait_for(lambda: len(os.listdir(str(started))) >= 2 * n, timeout=15,
                 what="%d handlers running at once" % n)
        assert len(ls(spool, "processing")) == n
        js = json.loads(call_myq("--spool", spool, "stats", "--json").stdout)
        assert js["processing"] == n
    finally:
        release.touch()
        rc = w.wait(30)
    assert rc == 0
    assert len(ls(spool, "done")) == n


def test_concurrency_flag(run_myq, spool, handlers_dir, tmp_path):
    run_concurrently(run_myq, spool, handlers_dir, tmp_path, 4, ("--concurrency", "4"))


def test_concurrency_env(run_myq, spool, handlers_dir, tmp_path):
    run_concurrently(run_myq, spool, handlers_dir, tmp_path, 4, (),
                     env={"MYQ_CONCURRENCY": "4"})


def test_concurrency_flag_wins_over_env(run_myq, spool, handlers_dir, tmp_path):
    run_concurrently(run_myq, spool, handlers_dir, tmp_path, 4, ("--concurrency", "4"),
                     env={"MYQ_CONCURRENCY": "1"})


def test_max_attempts_env_and_flag_wins(run_myq, spool, handlers_dir, tmp_path):
    h, _ = counting_handler(handlers_dir, tmp_path, code=1)
    a = enqueue(call_myq, spool, "t")
    cp = worker(run_myq, spool, handlers=h, env={"MYQ_MAX_ATTEMPTS": "1"})
    assert cp.returncode == 0, cp.stderr
    assert show(call_myq, spool, a)["state"] == "dead"
    b = enqueue(call_myq, spool, "t")
    cp = worker(run_myq, spool, "--max-attempts", "3", handlers=h,
                env={"MYQ_MAX_ATTEMPTS": "1"})
    assert cp.returncode == 0, cp.stderr
    job = show(call_myq, spool, b)
    assert (job["state"], job["attempts"]) == ("scheduled", 1)


def test_other_worker_options_from_env(run_myq, spool, handlers_dir, tmp_path):
    h, runs = counting_handler(handlers_dir, tmp_path, code=1)
    j = enqueue(call_myq, spool, "t")
    t0 = time.time()
    cp = run_myq("--spool", spool, "worker", "--drain",
                 env={"MYQ_HANDLERS": h, "MYQ_BACKOFF_BASE": "40",
                      "MYQ_JITTER": "0", "MYQ_POLL": "0.05"})
    t1 = time.time()
    assert cp.returncode == 0, cp.stderr
    assert runs_of(runs) == [j]
    job = show(call_myq, spool, j)
    assert job["state"] == "scheduled"
    assert t0 + 40 - 0.05 <= job["available_at"] <= t1 + 40 + 0.05


@pytest.mark.files_only
def test_success_record_prevents_a_second_run(run_myq, spool, handlers_dir, tmp_path):
    h, runs = counting_handler(handlers_dir, tmp_path)
    j = enqueue(call_myq, spool, "t", '{"side": "effect"}', "--id", "once-only")
    assert worker(run_myq, spool, handlers=h).returncode == 0
    assert runs_of(runs) == ["once-only"]
    # the job shows up again (e.g. a crash between the handler and the move to
    # done/, then a re-claim): it must be marked done without a second run.
    src = os.path.join(spool, "done", j + ".json")
    tmp = os.path.join(spool, "tmp", "again")
    shutil.copy(src, tmp)
    os.rename(tmp, os.path.join(spool, "incoming", j + ".json"))
    cp = worker(run_myq, spool, handlers=h)
    assert cp.returncode == 0, cp.stderr
    assert runs_of(runs) == ["once-only"]
    assert show(call_myq, spool, j)["state"] == "done"
    assert ls(spool, "incoming") == []


@pytest.mark.files_only
def test_drain_first_requeues_claims_of_dead_workers(run_myq, spool, handlers_dir, tmp_path):
    body, started, release = blocking_handler(tmp_path)
    h = handlers_dir("block", body)
    enqueue(call_myq, spool, "block", "--id", "crashy")
    w = start_worker(spool, "--drain", "--handlers", h, *FAST)
    try:
        wait_for(lambda: (started / "crashy").exists(), what="handler start")
        # the lease, for cat: the claim's name names the worker, whose
        # record has its pid (the claim's mtime: the lease's end)
        [claim] = ls(spool, "processing")
        wid = claim.partition("+")[2].rpartition(".")[0].rpartition(".")[0]
        text = open(os.path.join(spool, "locks", "workers", wid + ".json")).read()
        assert '"pid": %d' % w.pid in text or '"pid":%d' % w.pid in text, text
        w.kill()
        w.wait(10)
        kill_quiet(int((started / "crashy.pid").read_text()))
    finally:
        release.touch()
        stop(w, signal.SIGKILL)
    assert show(call_myq, spool, "crashy")["state"] == "processing"
    cp = worker(run_myq, spool, "--lease", "3600", handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert show(call_myq, spool, "crashy")["state"] == "done"
    assert ls(spool, "processing") == []


def test_worker_log_lines(run_myq, spool, handlers_dir, tmp_path):
    h = handlers_dir("ok", "exit 0")
    handlers_dir("bad", "echo oops >&2; exit 1")
    enqueue(call_myq, spool, "ok", "--id", "log-ok")
    enqueue(call_myq, spool, "bad", "--id", "log-bad")
    cp = worker(run_myq, spool, handlers=h)
    assert cp.returncode == 0, cp.stderr
    lines = [l for l in cp.stderr.splitlines() if l.strip()]
    assert lines, "the worker logged nothing"
    for l in lines:
        assert LOG_RE.match(l), l
    assert any("log-ok" in l for l in lines), lines
    assert any("log-bad" in l for l in lines), lines


def test_a_done_line_is_the_line_log_makes_of_its_fields(spool):
    """The worker formats a job's done line at once (its usual line, the
    one of every job): the bytes Log makes of the same fields, apart from
    the time."""
    import io
    import myq
    sp = myq.open_store(spool)
    ids = [sp.enqueue("t", {"n": 1}), sp.enqueue("t.x-y_z", None, id="a.b-c_d")]
    out = io.StringIO()
    myq.Worker(spool, handlers={"t": lambda p: None, "t.x-y_z": lambda p: None},
               log=myq.Log(stream=out)).run(drain=True)
    done = [l for l in out.getvalue().splitlines() if " event=done " in l]
    assert len(done) == 2, out.getvalue()
    for line in done:
        assert LOG_RE.match(line), line
        fields = dict(kv.split("=", 1) for kv in line.split()[2:])
        assert fields["id"] in ids
        general = io.StringIO()
        myq.Log(stream=general)("done", id=fields["id"], type=fields["type"],
                                attempt=1, ms=int(fields["ms"]))
        assert line.split(" ", 1)[1] == general.getvalue().split(" ", 1)[1].rstrip("\n")


def test_status_line_in_worker_log(spool, handlers_dir, tmp_path):
    body, started, release = blocking_handler(tmp_path)
    h = handlers_dir("block", body)
    enqueue(call_myq, spool, "block", "--id", "st")
    logf = tmp_path / "worker.log"
    with open(str(logf), "w") as log:
        w = start_worker(spool, "--drain", "--handlers", h, "--stats-interval",
                         "0.1", *FAST, stderr=log)
    try:
        wait_for(lambda: (started / "st").exists(), what="handler start")

        def status_lines():
            return [l for l in logf.read_text().splitlines()
                    if " queue=" in l and " retries_1m=" in l]

        def busy_status():
            return [l for l in status_lines() if " processing=1 " in l]

        found = wait_for(busy_status, timeout=10, what="a status line in the log")
    finally:
        release.touch()
        rc = w.wait(30)
    assert rc == 0
    for l in status_lines():
        assert STATUS_RE.match(l), l
    assert " queue=spool " in found[0]
    for l in logf.read_text().splitlines():
        if l.strip():
            assert LOG_RE.match(l), l


def test_worker_options_are_made_once_of_the_keywords_or_given(myq, spool):
    """Worker(spool, **keywords) and Worker(spool, options=...)
    are the same worker: the keywords make a WorkerOptions, checked and in
    their types once; the worker's state is all set by its __init__."""
    o = myq.WorkerOptions(concurrency=3, lease="9", poll=0, pass_env=("TZ",))
    given = myq.Worker(spool, options=o)
    made = myq.Worker(spool, concurrency=3, lease="9", poll=0, pass_env=("TZ",),
                      min_free=0)       # (a Spool option: the Spool's)
    assert given.options is o
    for name, _ in myq.WorkerOptions.KEYS:
        assert getattr(given, name) == getattr(made, name) == getattr(o, name), name
    assert (o.lease, o.poll, o.reap_interval, o.pass_env) == (9.0, 0.01, 4.5, ["TZ"])
    assert made.spool.opt["min_free"] == 0
    assert (made._started, made.sched._wake_fds, made._next_poll) == (0, [], float("inf"))
    with pytest.raises(TypeError):
        myq.Worker(spool, options=o, lease=3)
    with pytest.raises(TypeError):
        myq.WorkerOptions(lese=3)
    with pytest.raises(myq.UsageError):
        myq.Worker(spool, concurrency=0)
