"""The operator's commands and the status line."""
import calendar
import json
import os
import shutil
import re
import signal
import subprocess
import sys
import time

import pytest

from _core import (FAST, STATUS_RE, blocking_handler, enqueue, kill_quiet, ls,
                   one_line_error, show, start_worker, stop, wait_for, worker,
                   write_incoming)
from _core import MYQ, call_myq


def populate(run_myq, spool, handlers_dir):
    """done: ok1; dead: bad1; then ready: r1 r2; scheduled: s1."""
    h = handlers_dir("ok", "exit 0")
    handlers_dir("bad", "echo 'bad-reason' >&2; exit 65")
    enqueue(call_myq, spool, "ok", "--id", "ok1")
    enqueue(call_myq, spool, "bad", "--id", "bad1")
    cp = worker(run_myq, spool, handlers=h)
    assert cp.returncode == 0, cp.stderr
    enqueue(call_myq, spool, "ok", "--id", "r1")
    enqueue(call_myq, spool, "ok", "--id", "r2")
    enqueue(call_myq, spool, "ok", "--id", "s1", "--delay", "300")
    return h


def stats_fields(line):
    return dict(kv.split("=", 1) for kv in line.split()[1:])


def test_stats_line_format_and_counts(run_myq, spool, handlers_dir):
    populate(run_myq, spool, handlers_dir)
    cp = call_myq("--spool", spool, "stats")
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    assert len(lines) == 1, cp.stdout
    line = lines[0]
    assert STATUS_RE.match(line), line
    ts = calendar.timegm(time.strptime(line.split()[0], "%Y-%m-%dT%H:%M:%SZ"))
    assert abs(ts - time.time()) < 30
    f = stats_fields(line)
    assert f["queue"] == "spool"
    assert (f["ready"], f["processing"], f["done"], f["dead"]) == ("2", "0", "1", "1")
    assert int(f["oldest_ready_s"]) < 30
    assert f["retries_1m"] == "0"
    assert line.split()[1:8] == [
        "queue=spool", "ready=2", "processing=0", "done=1", "dead=1",
        "oldest_ready_s=" + f["oldest_ready_s"], "retries_1m=0"]


def test_stats_json(run_myq, spool, handlers_dir):
    populate(run_myq, spool, handlers_dir)
    cp = call_myq("--spool", spool, "stats", "--json")
    assert cp.returncode == 0, cp.stderr
    assert len(cp.stdout.strip().splitlines()) == 1
    d = json.loads(cp.stdout)
    assert d["queue"] == "spool"
    for k in ("ready", "processing", "done", "dead", "oldest_ready_s", "retries_1m"):
        assert type(d[k]) is int, (k, d[k])
    assert (d["ready"], d["processing"], d["done"], d["dead"]) == (2, 0, 1, 1)


def test_queue_is_the_spool_basename(tmp_path):
    spool = str(tmp_path / "edge-box.q_1")
    assert call_myq("--spool", spool, "init").returncode == 0
    cp = call_myq("--spool", spool + "/", "stats", "--json")
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)["queue"] == "edge-box.q_1"


def test_oldest_ready_s(spool):
    old = time.time() - 100
    p = write_incoming(spool, "old.json", {"type": "t", "available_at": old,
                                           "created_at": old})
    os.utime(p, (old, old))
    enqueue(call_myq, spool, "t")
    d = json.loads(call_myq("--spool", spool, "stats", "--json").stdout)
    assert 100 <= d["oldest_ready_s"] < 130, d
    assert d["ready"] == 2


def test_retries_1m_counts_scheduled_retries(run_myq, spool, handlers_dir):
    h = handlers_dir("f", "exit 1")
    enqueue(call_myq, spool, "f")
    enqueue(call_myq, spool, "f")
    handlers_dir("p", "exit 65")
    enqueue(call_myq, spool, "p")  # permanent: not a retry
    cp = worker(run_myq, spool, handlers=h)
    assert cp.returncode == 0, cp.stderr
    d = json.loads(call_myq("--spool", spool, "stats", "--json").stdout)
    assert d["retries_1m"] == 2, d
    assert d["dead"] == 1 and d["ready"] == 0


def test_list_and_list_state(run_myq, spool, handlers_dir):
    populate(run_myq, spool, handlers_dir)

    def ids(*args):
        cp = call_myq("--spool", spool, "list", *args)
        assert cp.returncode == 0, cp.stderr
        return sorted(l.split()[0] for l in cp.stdout.splitlines())

    assert ids() == ["bad1", "ok1", "r1", "r2", "s1"]
    assert ids("ready") == ["r1", "r2"]
    assert ids("scheduled") == ["s1"]
    assert ids("done") == ["ok1"]
    assert ids("dead") == ["bad1"]
    assert ids("processing") == []
    assert ids("failed") == []


def test_list_json(run_myq, spool, handlers_dir):
    populate(run_myq, spool, handlers_dir)
    cp = call_myq("--spool", spool, "list", "--json")
    assert cp.returncode == 0, cp.stderr
    rows = {}
    for line in cp.stdout.splitlines():
        d = json.loads(line)
        for k in ("id", "type", "state", "attempts", "available_at", "last_error"):
            assert k in d, (k, d)
        rows[d["id"]] = d
    assert {k: v["state"] for k, v in rows.items()} == {
        "ok1": "done", "bad1": "dead", "r1": "ready", "r2": "ready",
        "s1": "scheduled"}
    assert rows["bad1"]["type"] == "bad"
    assert rows["bad1"]["attempts"] == 1
    assert "bad-reason" in rows["bad1"]["last_error"]
    assert rows["r1"]["attempts"] == 0 and rows["r1"]["last_error"] is None
    cp = call_myq("--spool", spool, "list", "dead", "--json")
    assert [json.loads(l)["id"] for l in cp.stdout.splitlines()] == ["bad1"]


def test_list_unknown_state_is_64(spool):
    cp = call_myq("--spool", spool, "list", "bogus")
    assert cp.returncode == 64, (cp.returncode, cp.stderr)
    one_line_error(cp)


def test_show(run_myq, spool, handlers_dir):
    populate(run_myq, spool, handlers_dir)
    cp = call_myq("--spool", spool, "show", "bad1")
    assert cp.returncode == 0, cp.stderr
    d = json.loads(cp.stdout)
    assert (d["id"], d["type"], d["state"]) == ("bad1", "bad", "dead")
    assert "failed_at" in d
    assert show(call_myq, spool, "s1")["state"] == "scheduled"
    cp = call_myq("--spool", spool, "show", "nope")
    assert cp.returncode == 66, (cp.returncode, cp.stderr)
    one_line_error(cp)
    assert cp.stdout == ""


def test_delete(run_myq, spool, handlers_dir):
    populate(run_myq, spool, handlers_dir)
    cp = call_myq("--spool", spool, "delete", "r1", "bad1", "ok1", "s1")
    assert cp.returncode == 0, cp.stderr
    for i in ("r1", "bad1", "ok1", "s1"):
        assert call_myq("--spool", spool, "show", i).returncode == 66, i
    assert show(call_myq, spool, "r2")["state"] == "ready"
    cp = call_myq("--spool", spool, "delete", "missing")
    assert cp.returncode == 66, (cp.returncode, cp.stderr)
    one_line_error(cp)


def test_delete_processing_needs_force(spool, handlers_dir, tmp_path):
    body, started, release = blocking_handler(tmp_path)
    handlers_dir("block", body)
    enqueue(call_myq, spool, "block", "--id", "busy")
    w = start_worker(spool, "--drain", "--handlers", handlers_dir.path, *FAST)
    try:
        wait_for(lambda: (started / "busy").exists(), what="handler start")
        assert show(call_myq, spool, "busy")["state"] == "processing"
        cp = call_myq("--spool", spool, "delete", "busy")
        assert cp.returncode == 75, (cp.returncode, cp.stderr)
        one_line_error(cp)
        assert show(call_myq, spool, "busy")["state"] == "processing"
        cp = call_myq("--spool", spool, "delete", "--force", "busy")
        assert cp.returncode == 0, cp.stderr
        assert call_myq("--spool", spool, "show", "busy").returncode == 66
    finally:
        release.touch()
        assert w.wait(30) == 0
    cp = call_myq("--spool", spool, "list", "--json")
    states = [json.loads(l)["state"] for l in cp.stdout.splitlines()]
    assert not set(states) & {"ready", "scheduled", "processing"}, states


def test_a_delete_leaves_a_job_a_worker_took_meanwhile(spool, monkeypatch):
    """A worker claims a job between a delete's look and its removal: a
    bulk delete leaves it and deletes the rest (SQLite: exit 75 part-way,
    once); `delete ID` says it runs now (75), not deleted=1 (files,
    once).  Neither touches the claim."""
    import myq
    sp = myq.open_store(spool)
    ids = [sp.enqueue("t", {"n": i}) for i in range(3)]
    me, race = myq.Identity(sp, 60.0), [ids[0]]
    real = type(sp.upkeep)._delete_one

    def racing(self, jid, *a, **kw):
        if jid in race:         # a worker, in between
            race.remove(jid)
            assert self.store.claims.claim(jid + ".json", me, 5, True) is not None
        return real(self, jid, *a, **kw)
    monkeypatch.setattr(type(sp.upkeep), "_delete_one", racing)
    assert sp.delete_where("ready") == 2
    assert show(call_myq, spool, ids[0])["state"] == "processing"
    assert [call_myq("--spool", spool, "show", i).returncode
            for i in ids[1:]] == [66, 66]
    race.append(sp.enqueue("t", None, id="one"))
    cp = call_myq("--spool", spool, "delete", "one")
    assert cp.returncode == 75 and "running" in cp.stderr, (cp.returncode,
                                                            cp.stdout)
    assert show(call_myq, spool, "one")["state"] == "processing"


def test_reap_and_check_after_a_worker_died(spool, handlers_dir, tmp_path):
    body, started, release = blocking_handler(tmp_path)
    handlers_dir("block", body)
    enqueue(call_myq, spool, "block", "--id", "orphan")
    cp = call_myq("--spool", spool, "reap")
    assert (cp.returncode, cp.stdout.strip()) == (0, "requeued=0")
    w = start_worker(spool, "--drain", "--handlers", handlers_dir.path, *FAST)
    try:
        wait_for(lambda: (started / "orphan").exists(), what="handler start")
        w.kill()
        w.wait(10)
        kill_quiet(int((started / "orphan.pid").read_text()))
        assert show(call_myq, spool, "orphan")["state"] == "processing"
        cp = call_myq("--spool", spool, "check")
        assert cp.returncode == 1, (cp.returncode, cp.stdout, cp.stderr)
        cp = call_myq("--spool", spool, "reap")
        assert cp.returncode == 0, cp.stderr
        assert cp.stdout.strip() == "requeued=1"
        assert show(call_myq, spool, "orphan")["state"] == "ready"
        assert ls(spool, "processing") == []
        cp = call_myq("--spool", spool, "check")
        assert cp.returncode == 0, (cp.stdout, cp.stderr)
    finally:
        release.touch()
        stop(w, signal.SIGKILL)


def done_jobs(run_myq, spool, handlers_dir, n):
    h = handlers_dir("ok", "exit 0")
    ids = [enqueue(call_myq, spool, "ok", "--id", "j%02d" % i) for i in range(n)]
    cp = worker(run_myq, spool, handlers=h)
    assert cp.returncode == 0, cp.stderr
    assert len(ls(spool, "done")) == n
    return ids


def prune_counts(cp):
    assert cp.returncode == 0, cp.stderr
    out = cp.stdout.strip()
    assert re.match(r"^\w+=\d+( \w+=\d+)*$", out), out
    return {k: int(v) for k, v in (kv.split("=") for kv in out.split())}


def test_prune_keep_done_max(run_myq, spool, handlers_dir):
    done_jobs(run_myq, spool, handlers_dir, 5)
    counts = prune_counts(call_myq("--spool", spool, "prune", "--keep-done-max", "2"))
    assert counts.get("done") == 3, counts
    assert len(ls(spool, "done")) == 2
    assert ls(spool, "done") == ["j03.json", "j04.json"]  # the newest are kept


def test_prune_keep_done_age(run_myq, spool, handlers_dir):
    done_jobs(run_myq, spool, handlers_dir, 3)
    counts = prune_counts(call_myq("--spool", spool, "prune", "--keep-done", "3600"))
    assert counts.get("done", 0) == 0, counts
    assert len(ls(spool, "done")) == 3
    counts = prune_counts(call_myq("--spool", spool, "prune", "--keep-done", "0.001"))
    assert counts.get("done") == 3, counts
    assert ls(spool, "done") == []


def test_prune_orphaned_tmp_files(spool):
    old = os.path.join(spool, "tmp", "orphan.part")
    new = os.path.join(spool, "tmp", "writing.part")
    for p in (old, new):
        with open(p, "w") as f:
            f.write("{")
    t = time.time() - 2 * 3600
    os.utime(old, (t, t))
    prune_counts(call_myq("--spool", spool, "prune"))
    assert ls(spool, "tmp") == ["writing.part"]


def test_check_healthy_and_unhealthy(spool):
    cp = call_myq("--spool", spool, "check")
    assert cp.returncode == 0, (cp.stdout, cp.stderr)
    cp = call_myq("--spool", spool, "check", "--min-free", "1000G")
    assert cp.returncode == 1, (cp.returncode, cp.stdout, cp.stderr)
    out = (cp.stdout + cp.stderr).strip().splitlines()
    assert len(out) == 1, out
    assert re.search(r"free|space|disk", out[0], re.I), out


def test_check_reports_a_missing_layout_dir(spool):
    shutil.rmtree(os.path.join(spool, "locks"))
    cp = call_myq("--spool", spool, "check", "--min-free", "1000G")
    assert cp.returncode in (1, 78), (cp.returncode, cp.stdout, cp.stderr)
    text = cp.stdout + cp.stderr
    assert "locks" in text
    if cp.returncode == 1:
        assert len(text.strip().splitlines()) >= 2, text  # one line per problem


def test_check_reports_an_unusable_dir(spool):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    d = os.path.join(spool, "done")
    os.chmod(d, 0)
    try:
        cp = call_myq("--spool", spool, "check")
    finally:
        os.chmod(d, 0o750)
    assert cp.returncode == 1, (cp.returncode, cp.stdout, cp.stderr)
    assert "done" in cp.stdout + cp.stderr


def test_version(myq):
    cp = call_myq("version")
    assert cp.returncode == 0, cp.stderr
    assert re.match(r"^myq \d+\.\d+\.\d+\n$", cp.stdout), cp.stdout
    assert cp.stdout.split()[1] == myq.__version__


@pytest.mark.parametrize("args", [
    ("frobnicate",),
    ("stats", "--bogus"),
    ("list", "--nope"),
    ("worker", "--lease", "abc"),
    ("worker", "--concurrency", "two"),
    ("worker", "--poll", "abc"),
    ("enqueue", "t", "{}", "--delay", "soon"),
    ("enqueue", "t", "{}", "--max-attempts", "x"),
    ("enqueue", "t", "{}", "--min-free", "12Q"),
    ("enqueue",),
    ("show",),
], ids=lambda a: "_".join(a))
def test_usage_errors_are_64_and_one_line(run_myq, spool, args):
    before = {d: ls(spool, d) for d in ("tmp", "incoming", "locks")}
    run = run_myq if args[0] == "worker" else call_myq
    cp = run("--spool", spool, *args, timeout=20)
    assert cp.returncode == 64, (cp.returncode, cp.stdout, cp.stderr)
    one_line_error(cp)
    assert {d: ls(spool, d) for d in ("tmp", "incoming", "locks")} == before


def test_no_command_is_64(spool):
    cp = call_myq("--spool", spool)
    assert cp.returncode == 64, (cp.returncode, cp.stderr)
    one_line_error(cp)


def test_a_command_builds_only_its_own_parser(myq):
    """`myq enqueue` builds the enqueue parser alone (all of them cost
    15-30 ms of a ~70 ms process); --help and errors see every command."""
    import argparse

    def commands(p):
        sub = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        return sorted(sub[0].choices)
    assert commands(myq._parser("enqueue")) == ["enqueue"]
    assert commands(myq._parser()) == sorted(myq._COMMAND_TABLE)


@pytest.mark.parametrize("name", ["myq.py", "queue_tool.py", "time.py"])
def test_supervised_workers_import_this_file_whatever_its_name_and_cwd(
        tmp_path, procs, name):
    """supervise starts its workers by importing the file it runs from (its
    cached .pyc): under another name too, and a module in the current
    directory named like one myq imports (heapq) must not shadow it."""
    import shutil
    import signal
    from _core import MYQ, clean_env, wait_for
    d = tmp_path / "bin"
    d.mkdir()
    prog = str(d / name)
    shutil.copy(MYQ, prog)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "heapq.py").write_text("raise ImportError('shadowed heapq')\n")
    spool = str(tmp_path / "spool")
    hd = tmp_path / "h"
    hd.mkdir()
    (hd / "t").write_text("#!/bin/sh\ncat >/dev/null\n")
    (hd / "t").chmod(0o755)
    run = lambda *a: subprocess.run([sys.executable, prog, "--spool", spool] + list(a),
                                    cwd=str(cwd), env=clean_env(), check=True,
                                    stdout=subprocess.PIPE)
    run("init")
    jid = run("enqueue", "t", "{}").stdout.decode().strip()
    log = str(tmp_path / "sup.log")
    p = procs.spawn([sys.executable, prog, "--spool", spool, "supervise",
                     "--workers", "1", "--handlers", str(hd), "--log", log],
                    cwd=str(cwd), env=clean_env())
    done = os.path.join(spool, "done", jid + ".json")
    try:
        wait_for(lambda: os.path.exists(done), timeout=20,
                 what="the supervised worker to run the job")
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(15)
    text = open(log).read()
    assert "shadowed" not in text and "Error" not in text, text


@pytest.mark.files_only
# Retention of dlq/ by count, the end of a pipe ###############################

def test_prune_keeps_at_most_keep_dead_max_dead_jobs(spool):
    """Jobs that keep failing must not fill the flash through dlq/: prune
    keeps the newest --keep-dead-max dead jobs."""
    import myq
    sp = myq.open_store(spool)
    now = time.time()
    for i in range(5):
        job = myq.new_job("t", i, id="d%d" % i, now=now)
        path = os.path.join(spool, "dlq", "d%d.json" % i)
        with open(path, "wb") as f:
            f.write(myq.dumps(job))
        time.sleep(0.01)            # distinct ctimes: oldest first
    cp = call_myq("--spool", spool, "prune", "--keep-dead-max", "2")
    assert cp.returncode == 0, cp.stderr
    assert "dead=3" in cp.stdout.split(), cp.stdout
    assert sorted(ls(spool, "dlq")) == ["d3.json", "d4.json"]
    assert sp.prune()["dead"] == 0      # the default (10000) keeps them


def test_list_into_a_closed_pipe_is_quiet(spool):
    """`myq list | head -1`: the reader is done; no error, exit 0."""
    import myq
    myq.open_store(spool).enqueue_many([{"type": "t", "payload": i} for i in range(3000)])
    r = subprocess.run("%s %s --spool %s list | head -1; echo \"rc=${PIPESTATUS[0]}\""
                       % (sys.executable, MYQ, spool), shell=True,
                       executable="/bin/bash", stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, universal_newlines=True, timeout=60)
    assert r.stdout.splitlines()[-1] == "rc=0", r.stdout
    assert r.stderr == "", r.stderr


# What needs an operator; how a run ended ####################################

def test_check_flags_what_needs_an_operator(run_myq, spool, handlers_dir):
    """Dead jobs, quarantined files and files in incoming/ that no worker
    takes: check says each (exit 1), also as JSON; once dealt with: ok."""
    populate(run_myq, spool, handlers_dir)          # bad1 is dead
    with open(os.path.join(spool, "incoming", "oops.txt"), "w") as f:
        f.write('{"type": "ok"}')
    write_incoming(spool, "bad name.json", {"type": "ok"})
    worker(run_myq, spool, handlers=handlers_dir("ok", "exit 0"))  # quarantines
    cp = call_myq("--spool", spool, "check")
    assert cp.returncode == 1, cp.stdout
    lines = cp.stdout.splitlines()
    assert any(l.startswith("1 dead job(s) in dlq/") for l in lines), lines
    assert any(l.startswith("1 file(s) quarantined in failed/") for l in lines), lines
    assert any("do not end in .json" in l and "oops.txt" in l for l in lines), lines
    cj = call_myq("--spool", spool, "check", "--json")
    assert cj.returncode == 1
    doc = json.loads(cj.stdout)
    assert doc["ok"] is False and len(doc["problems"]) == 3, doc
    os.unlink(os.path.join(spool, "incoming", "oops.txt"))
    assert call_myq("--spool", spool, "delete", "bad1").returncode == 0
    assert call_myq("--spool", spool, "delete", "bad name").returncode == 0
    cp = call_myq("--spool", spool, "check", "--json")
    assert cp.returncode == 0 and json.loads(cp.stdout)["ok"] is True, cp.stdout


def test_failures_history_and_how_the_run_ended(run_myq, spool, handlers_dir,
                                                tmp_path):
    """last_error keeps the exit status even when stderr is long; show has
    the last failures with time and attempt; a Python handler's failure
    carries the end of its traceback; a job that ends well shows no
    last_error."""
    flaky = tmp_path / "n"
    h = handlers_dir("noisy", 'n=$(cat "%s" 2>/dev/null || echo 0); '
                     'echo $((n+1)) > "%s"; [ "$n" -ge 6 ] && exit 0; '
                     'head -c 5000 /dev/zero | tr "\\0" x >&2; exit 3' % (flaky, flaky))
    jid = enqueue(call_myq, spool, "noisy", "--max-attempts", "10")
    for _ in range(7):
        worker(run_myq, spool, "--backoff-base", "0", "--jitter", "0", handlers=h)
    job = show(call_myq, spool, jid)
    assert job["state"] == "done", job
    assert job["last_error"] is None
    fails = job["failures"]
    assert [f["attempt"] for f in fails] == [2, 3, 4, 5, 6]
    assert all(f["error"].startswith("exit 3: xxx") for f in fails), fails
    assert all(isinstance(f["at"], float) for f in fails)

    mod = tmp_path / "m.py"
    mod.write_text("def boom(job):\n    helper(job)\n\n"
                   "def helper(job):\n    raise KeyError('k9')\n")
    jid = enqueue(call_myq, spool, "boom", "--max-attempts", "1")
    cp = run_myq("--spool", spool, "worker", "--drain", "--module", str(mod))
    assert cp.returncode == 0, cp.stderr
    job = show(call_myq, spool, jid)
    assert job["state"] == "dead" and job["last_error"] == "KeyError: 'k9'"
    tb = job["failures"][-1]["traceback"]
    assert "in helper" in tb and tb.endswith("KeyError: 'k9'"), tb


def test_last_error_keeps_the_exit_status(run_myq, spool, handlers_dir):
    h = handlers_dir("loud", 'head -c 9000 /dev/zero | tr "\\0" y >&2; exit 65')
    jid = enqueue(call_myq, spool, "loud")
    worker(run_myq, spool, handlers=h)
    job = show(call_myq, spool, jid)
    assert job["state"] == "dead"
    assert job["last_error"].startswith("exit 65: yyy"), job["last_error"][:40]
    assert job["last_error"].endswith("yyy") and len(job["last_error"]) <= 1000


def test_json_answers_for_monitoring_and_iso_times_in_show(run_myq, spool,
                                                            handlers_dir):
    """retry, reap and prune answer in JSON with --json (as check and delete
    do); show gives its epoch times in ISO 8601 too, as list does."""
    populate(run_myq, spool, handlers_dir)
    cp = call_myq("--spool", spool, "retry", "bad1", "--json")
    assert cp.returncode == 0 and json.loads(cp.stdout) == {"retried": 1}, cp.stdout
    cp = call_myq("--spool", spool, "reap", "--json")
    assert json.loads(cp.stdout) == {"requeued": 0}, cp.stdout
    cp = call_myq("--spool", spool, "prune", "--json")
    out = json.loads(cp.stdout)
    assert set(out) >= {"done", "dead", "failed", "tmp", "ok", "workers"}, out
    job = show(call_myq, spool, "s1")
    assert job["iso"]["available_at"] == myq_iso(job["available_at"])
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", job["iso"]["created_at"])


def myq_iso(t):
    import myq
    return myq.iso(t)


@pytest.mark.files_only
def test_show_follows_a_job_that_moves_while_it_looks(myq, spool, monkeypatch):
    """`show` between locate and read: the job moved on (a worker finished
    it); show finds it again instead of failing (exit 75, seen in CI)."""
    sp = myq.open_store(spool)
    jid = sp.enqueue("t", {"x": 1})
    real = sp.reader._describe
    moved = []

    def describe(state, path, *more):
        if not moved:
            moved.append(1)
            os.rename(path, os.path.join(spool, "done", jid + ".json"))
        return real(state, path, *more)
    monkeypatch.setattr(sp.reader, "_describe", describe)
    assert sp.show(jid)["state"] == "done"
