"""Executable handlers under --handlers DIR."""
import gc
import json
import os
import subprocess
import sys
import time

import pytest

from _core import (MYQ, enqueue, ls, procs_with_cmdline, show, start_worker, state,
                   stop, wait_for, worker,
                   write_incoming)
from _core import call_myq, sql


def run_one(run_myq, spool, handlers_dir, body, *enqueue_opts, worker_opts=(),
            env=None, payload="{}"):
    handlers_dir("h", body)
    job_id = enqueue(call_myq, spool, "h", payload, *enqueue_opts)
    cp = worker(run_myq, spool, *worker_opts, handlers=handlers_dir.path, env=env)
    assert cp.returncode == 0, cp.stderr
    return show(call_myq, spool, job_id)


def test_exit_0_is_done(run_myq, spool, handlers_dir):
    job = run_one(run_myq, spool, handlers_dir, "exit 0")
    assert job["state"] == "done"
    assert job["attempts"] == 1


@pytest.mark.parametrize("code", [75, 71, 1, 2, 70 + 30, 255])
def test_temporary_failures_retry(run_myq, spool, handlers_dir, code):
    job = run_one(run_myq, spool, handlers_dir, "exit %d" % code)
    assert job["state"] == "scheduled", job
    assert job["attempts"] == 1
    # backoff-base 60; a destination failure (75, 71) waits --probe-max (30 s)
    assert job["available_at"] > time.time() + (20 if code in (75, 71) else 30)


@pytest.mark.parametrize("code", [64, 65, 66, 70, 73, 74, 76, 77, 78])
def test_sysexits_other_than_71_75_are_dead_at_once(run_myq, spool, handlers_dir, code):
    job = run_one(run_myq, spool, handlers_dir, "exit %d" % code)
    assert job["state"] == "dead", job
    assert job["attempts"] == 1
    assert isinstance(job["failed_at"], (int, float))


@pytest.mark.parametrize("code", [1, 75, 71])
def test_retryable_failure_on_last_attempt_is_dead(run_myq, spool, handlers_dir, code):
    job = run_one(run_myq, spool, handlers_dir, "exit %d" % code,
                  "--max-attempts", "1")
    assert job["state"] == "dead", job
    assert job["attempts"] == 1


@pytest.mark.parametrize("sig", ["KILL", "TERM", "SEGV"])
def test_death_by_signal_retries(run_myq, spool, handlers_dir, sig):
    job = run_one(run_myq, spool, handlers_dir, "kill -%s $$" % sig)
    assert job["state"] == "scheduled", job
    assert job["attempts"] == 1
    assert job["last_error"]


def test_stderr_tail_becomes_last_error(run_myq, spool, handlers_dir):
    body = ("i=0; while [ $i -lt 20000 ]; do echo \"noise line $i\" >&2; "
            "i=$((i+1)); done\necho 'the-real-reason-42' >&2\nexit 1")
    job = run_one(run_myq, spool, handlers_dir, body)
    assert job["state"] == "scheduled"
    assert "the-real-reason-42" in job["last_error"]
    assert "noise line 0\n" not in job["last_error"]  # the tail, not the head


def test_permanent_failure_keeps_stderr_in_dlq(run_myq, spool, handlers_dir):
    job = run_one(run_myq, spool, handlers_dir, "echo 'bad payload xyz' >&2; exit 65")
    assert job["state"] == "dead"
    assert "bad payload xyz" in job["last_error"]
    assert ls(spool, "dlq") == [job["id"] + ".json"]


def test_environment(run_myq, spool, handlers_dir, tmp_path):
    envf = tmp_path / "env"
    job = run_one(run_myq, spool, handlers_dir, 'env > "%s"' % envf,
                  "--id", "env-job", "--max-attempts", "3",
                  env={"FOO": "bar", "SECRET_TOKEN": "s3"})
    assert job["state"] == "done"
    env = dict(l.split("=", 1) for l in envf.read_text().splitlines() if "=" in l)
    assert env["MYQ_JOB_ID"] == "env-job"
    assert env["MYQ_JOB_TYPE"] == "h"
    assert env["MYQ_ATTEMPT"] == "1"
    assert env["MYQ_MAX_ATTEMPTS"] == "3"
    assert os.path.realpath(env["MYQ_SPOOL"]) == os.path.realpath(spool)
    assert env["PATH"]
    assert "FOO" not in env
    assert "SECRET_TOKEN" not in env


def test_max_attempts_env_falls_back_to_worker_default(run_myq, spool, handlers_dir, tmp_path):
    envf = tmp_path / "env"
    job = run_one(run_myq, spool, handlers_dir, 'env > "%s"' % envf,
                  worker_opts=("--max-attempts", "7"))
    assert job["state"] == "done"
    assert "MYQ_MAX_ATTEMPTS=7\n" in envf.read_text()


def test_pass_env(run_myq, spool, handlers_dir, tmp_path):
    envf = tmp_path / "env"
    job = run_one(run_myq, spool, handlers_dir, 'env > "%s"' % envf,
                  worker_opts=("--pass-env", "FOO", "--pass-env", "BAZ"),
                  env={"FOO": "bar", "BAZ": "q x", "OTHER": "no"})
    assert job["state"] == "done"
    text = envf.read_text().splitlines()
    assert "FOO=bar" in text
    assert "BAZ=q x" in text
    assert not any(l.startswith("OTHER=") for l in text)


def test_attempt_counts_up(run_myq, spool, handlers_dir, tmp_path):
    log = tmp_path / "attempts"
    handlers_dir("h", 'echo "$MYQ_ATTEMPT" >> "%s"\n[ "$MYQ_ATTEMPT" -ge 3 ]' % log)
    job_id = enqueue(call_myq, spool, "h")

    def finished():
        cp = worker(run_myq, spool, "--backoff-base", "0.01",
                    handlers=handlers_dir.path)
        assert cp.returncode == 0, cp.stderr
        return show(call_myq, spool, job_id)["state"] == "done"

    wait_for(finished, timeout=30, what="job done")
    assert log.read_text().split() == ["1", "2", "3"]
    assert show(call_myq, spool, job_id)["attempts"] == 3


def test_payload_on_stdin(run_myq, spool, handlers_dir, tmp_path):
    out = tmp_path / "stdin"
    payload = {"a": [1, 2.5, "é"], "b": None, "c": {"d": True}}
    job = run_one(run_myq, spool, handlers_dir, 'cat > "%s"' % out,
                  payload=json.dumps(payload))
    assert job["state"] == "done"
    assert json.loads(out.read_text(encoding="utf-8")) == payload


@pytest.mark.parametrize("where", ["worker", "job"])
def test_timeout_kills_the_process_group(run_myq, spool, handlers_dir, tmp_path, where):
    secs = "30.%d%d" % (os.getpid() % 1000, 1 if where == "worker" else 2)
    pidf = tmp_path / "sh.pid"
    body = 'echo $$ > "%s"\nsleep %s\necho survived' % (pidf, secs)
    if where == "worker":
        job = run_one(run_myq, spool, handlers_dir, body,
                      worker_opts=("--timeout", "0.5"))
    else:
        job = run_one(run_myq, spool, handlers_dir, body, "--timeout", "0.5")
    assert job["state"] == "scheduled", job
    assert job["attempts"] == 1
    assert "time" in (job["last_error"] or "").lower(), job["last_error"]
    try:
        wait_for(lambda: not procs_with_cmdline(["sleep", secs]), timeout=5,
                 what="the handler's sleep to be gone")
    finally:
        for pid in procs_with_cmdline(["sleep", secs]):
            os.kill(pid, 9)
    assert pidf.read_text().strip().isdigit()  # the handler did start


def test_type_without_handler_is_held_until_the_handler_is_there(
        run_myq, spool, handlers_dir, tmp_path):
    """A missing handler is a deployment not finished, not a bad job:
    the type is held, its jobs wait without spending an attempt, check
    says so; once the handler is there, a worker runs them at once."""
    handlers_dir("other", "exit 0")
    job_id = enqueue(call_myq, spool, "nohandler")
    cp = worker(run_myq, spool, "--backoff-base", "60", handlers=handlers_dir.path)
    assert cp.returncode == 0, cp.stderr
    assert "event=hold dest=nohandler" in cp.stderr, cp.stderr
    job = show(call_myq, spool, job_id)
    # show says held, until when and why (not "scheduled" an hour out)
    assert job["state"] == "held" and job["attempts"] == 0, job
    assert job["held"]["dest"] == "nohandler" and job["held"]["until"], job
    assert job["last_error"].startswith("held: no handler for type nohandler")
    chk = call_myq("--spool", spool, "check")
    assert chk.returncode == 1 and "type nohandler is held" in chk.stdout, chk.stdout
    st = json.loads(call_myq("--spool", spool, "stats", "--json").stdout)
    assert [h["dest"] for h in st["held"]] == ["nohandler"], st
    # the handler arrives; a running worker releases the hold and runs it
    w = start_worker(spool, "--handlers", handlers_dir.path, "--poll", "0.05",
                     "--backoff-base", "60")
    try:
        wait_for(lambda: state(call_myq, spool, job_id) == "held",
                 what="the job held again")
        handlers_dir("nohandler", 'echo ran > "%s"' % (tmp_path / "ran"))
        wait_for(lambda: state(call_myq, spool, job_id) == "done",
                 what="the job run once its handler is there")
    finally:
        stop(w)
    assert (tmp_path / "ran").read_text() == "ran\n"
    assert show(call_myq, spool, job_id)["attempts"] == 1
    assert call_myq("--spool", spool, "check").returncode == 0


def test_non_executable_file_or_directory_is_not_a_handler(run_myq, spool, handlers_dir, tmp_path):
    d = handlers_dir("ok", "exit 0")
    marker = tmp_path / "ran"
    p = os.path.join(d, "plain")
    with open(p, "w") as f:
        f.write('#!/bin/sh\ntouch "%s"\n' % marker)
    os.chmod(p, 0o644)
    os.mkdir(os.path.join(d, "adir"))
    a = enqueue(call_myq, spool, "plain")
    b = enqueue(call_myq, spool, "adir")
    cp = worker(run_myq, spool, handlers=d)
    assert cp.returncode == 0, cp.stderr
    for jid in (a, b):      # held: waiting, no attempt spent
        job = show(call_myq, spool, jid)
        assert job["state"] == "held" and job["attempts"] == 0, job
    assert "not executable" in show(call_myq, spool, a)["last_error"]
    assert not marker.exists()


@pytest.mark.parametrize("type_", ["../evil", "..", "sub/../../evil", "/bin/true"])
def test_type_never_resolves_outside_handlers_dir(run_myq, spool, handlers_dir, tmp_path, type_):
    marker = tmp_path / "evil-ran"
    evil = tmp_path / "evil"
    evil.write_text('#!/bin/sh\ntouch "%s"\n' % marker)
    evil.chmod(0o755)
    d = handlers_dir("ok", "exit 0")
    os.mkdir(os.path.join(d, "sub"))
    write_incoming(spool, "evil-job.json", {"type": type_, "payload": None})
    cp = worker(run_myq, spool, handlers=d)
    assert cp.returncode == 0, cp.stderr
    assert not marker.exists()
    assert ls(spool, "done") == []
    assert ls(spool, "incoming") == []
    # quarantined as invalid (failed/) or dead: never run
    assert ls(spool, "failed") or ls(spool, "dlq")


def _fds():
    out = {}
    for f in os.listdir("/proc/self/fd"):
        try:
            out[int(f)] = os.readlink("/proc/self/fd/" + f)
        except OSError:
            pass
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.parametrize("concurrency", [1, 4])
def test_exec_handlers_leave_no_descriptor_open(myq, spool, handlers_dir,
                                                concurrency):
    """The worker makes the handlers' pipes and its /dev/null itself: after
    run() nothing of them is left, whatever the handlers did."""
    handlers_dir("ok", "cat >/dev/null")
    handlers_dir("early", "exit 0")                     # never reads stdin
    handlers_dir("noisy", "cat >/dev/null; head -c 300000 /dev/zero >&2; exit 1")
    hd = handlers_dir("slow", "sleep 5")
    sp = myq.open_store(spool)
    big = {"x": "y" * 200000}
    missing = []
    for t, payload, timeout in (("ok", big, None), ("early", big, None),
                                ("noisy", {}, None), ("slow", {}, 0.3),
                                ("missing", {}, None)):
        for _ in range(3):
            jid = sp.enqueue(t, payload, max_attempts=1, timeout=timeout)
            if t == "missing":
                missing.append(jid)
    # (an SQLite spool's connection: the worker's own cannot close its
    # descriptor of queue.db while another of this process holds the file)
    sp.close()
    before = _fds()
    w = myq.Worker(spool, handlers_dir=hd, concurrency=concurrency,
                   log=myq.Log(path=os.devnull), stats_interval=0)
    assert w.run(drain=True) == 0
    w.log = None
    del w
    gc.collect()        # (its parts refer to one another)
    after = _fds()
    assert {k: v for k, v in after.items() if before.get(k) != v} == {}
    assert len(ls(spool, "done")) == 6
    # no handler: the type is held, its jobs wait in its lane
    assert sorted(_in_lane(spool, "missing@0")) == sorted(missing)
    assert len(ls(spool, "dlq")) == 6


def _in_lane(spool, lane):
    """The ids of the jobs waiting in lane `lane` (incoming/lanes/LANE/ of
    a spool of files; on an SQLite spool, the ready rows of that lane)."""
    sub = "incoming/lanes/" + lane
    rows = sql(spool, "SELECT id FROM jobs WHERE status='ready' AND lane=?",
               (sub,))
    if rows is None:
        return [n[:-5] for n in os.listdir(os.path.join(spool, sub))
                if n.endswith(".json")]
    return [r[0] for r in rows]


def test_out_of_descriptors_retries_the_job_and_the_worker_goes_on(
        tmp_path, handlers_dir):
    """EMFILE when making a handler's pipes: the job is retried later (not
    stranded in processing/), the worker does not crash.  The limit is
    tried a few descriptors above what the process holds (the worker's own
    come and go: its spool's door is opened again at each poll), until one
    of them runs out at a handler's start."""
    hd = handlers_dir("ok", "cat >/dev/null")
    code = r'''
import os, resource, sys, json
import heapq, itertools, fcntl, select, signal, threading, subprocess
sys.path.insert(0, %r)
import myq
sp = myq.open_store(%r); sp.init()
for i in range(3):
    sp.enqueue("ok", {}, max_attempts=3)
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE,
                   (used + %d, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
errors = []
w = myq.Worker(%r, handlers_dir=%r, stats_interval=0,
               log=lambda ev, **kv: errors.append(kv.get("error")))
rc = w.run(drain=True)
print(json.dumps({"rc": rc, "errors": [e for e in errors if e]}))
'''
    seen = []
    for extra in range(4, 16):
        spool = str(tmp_path / ("s%d" % extra))
        cp = subprocess.run([sys.executable, "-c", code % (
            os.path.dirname(MYQ), spool, extra, spool, hd)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            universal_newlines=True, timeout=60)
        if cp.returncode != 0 and "Too many open files" in cp.stderr and \
                "register" in cp.stderr:
            continue            # (too few even for the worker's own record)
        assert cp.returncode == 0, cp.stderr
        out = json.loads(cp.stdout.strip().splitlines()[-1])
        assert out["rc"] == 0
        assert os.listdir(os.path.join(spool, "processing")) == []
        states = {d: len(set(os.listdir(os.path.join(spool, d))) - {"lanes"})
                  for d in ("incoming", "done", "dlq")}     # (init's lanes/)
        assert states["incoming"] + states["done"] == 3, states
        if any("Too many open files" in e for e in out["errors"]):
            seen.append(extra)
            break
    assert seen, "no limit made a handler's start run out of descriptors"


def test_a_missing_interpreter_is_named(run_myq, spool, handlers_dir):
    """A handler whose #! interpreter is missing, or that has no #! line:
    last_error says which, not a bare "No such file or directory" that
    reads as if the handler itself were missing."""
    from _core import call_myq, enqueue, show
    d = handlers_dir("py9", "exit 0")
    with open(os.path.join(d, "py9"), "w") as f:
        f.write("#!/nonexistent/python9\nprint(1)\n")
    with open(os.path.join(d, "bare"), "w") as f:
        f.write("echo no shebang\n")
    os.chmod(os.path.join(d, "bare"), 0o755)
    a = enqueue(call_myq, spool, "py9", "--max-attempts", "1")
    b = enqueue(call_myq, spool, "bare", "--max-attempts", "1")
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", d)
    assert cp.returncode == 0, cp.stderr
    err = show(call_myq, spool, a)["last_error"]
    assert "interpreter is missing" in err and "/nonexistent/python9" in err, err
    err = show(call_myq, spool, b)["last_error"]
    assert "no #! line" in err, err
