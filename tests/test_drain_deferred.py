"""A plain drain's claims made ahead and what it writes per job,
counted (statements and transactions through sqlite3's trace callback),
never timed; each new step cut by a kill -9 of a real worker before and
after it, and every job delivered after it (at least once; one done is
not run again).
"""
import json
import os
import sqlite3

import pytest

from _core import (FAST, ROOT, call_myq, ls, run_myq, sql_traced,
                   sql_transactions, states)
from _procs import worker_killed_around, worker_killed_by_its_hook

import myq

sql_only = pytest.mark.skipif(
    sqlite3.sqlite_version_info < (3, 35, 0),
    reason="a claim is one statement with UPDATE ... RETURNING (SQLite "
    "3.35); this one is %s" % sqlite3.sqlite_version)

HANDLER = """import os
def t(job):
    fd = os.open(%r, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (job["id"] + "\\n").encode())
    os.close(fd)
"""


def _spool(tmp_path, n, store="sqlite"):
    """A spool of `store` holding jobs j00.. (n), and a --module file whose
    handler of type t notes each run's id in tmp_path/ran."""
    sp = str(tmp_path / "s")
    assert call_myq("--spool", sp, "init", "--store", store).returncode == 0
    ids = ["j%02d" % i for i in range(n)]
    for i in ids:
        myq.enqueue(sp, "t", {"n": i}, id=i)
    mod = tmp_path / "h.py"
    mod.write_text(HANDLER % str(tmp_path / "ran"))
    return sp, ids, str(mod)


def _ran(tmp_path):
    p = tmp_path / "ran"
    return p.read_text().split() if p.exists() else []





@sql_only
def test_a_drain_claims_sixteen_a_statement_and_commits_each_success(
        tmp_path, monkeypatch):
    """30 jobs drained one by one: claimed 16 a statement (_Ahead.AHEAD:
    2 claim transactions, not 30), each success a transaction of its own
    (a kill after it must not run the job again); every job done once."""
    sp, ids, mod = _spool(tmp_path, 30)
    seen = sql_traced(monkeypatch)
    myq.Worker(sp, module=mod, poll=0.05, jitter=0, log=myq.Log(
        stream=open(os.devnull, "w"))).run(drain=True)
    assert states(sp, ids) == ["done"] * 30
    assert sorted(_ran(tmp_path)) == ids
    assert sql_transactions(seen, "SET status='processing'") == 2
    assert sql_transactions(seen, "SET status='done'") == 30


@sql_only
def test_a_kill_after_a_success_does_not_run_its_job_again(tmp_path):
    """Killed right after the first job's success: it is done, the five
    claimed with it are the dead worker's claims; the next worker takes
    them back and runs each, the first not again (a success is never
    left to a later commit that a kill would lose)."""
    sp, ids, mod = _spool(tmp_path, 6)
    worker_killed_around("_SqlClaims.complete", "after", sp, "--module", mod,
                         *FAST)
    assert len(_ran(tmp_path)) == 1
    now = states(sp, ids)
    assert now.count("done") == 1 and now.count("processing") == 5
    cp = run_myq("--spool", sp, "worker", "--drain", "--module", mod, *FAST)
    assert cp.returncode == 0, cp.stderr
    assert states(sp, ids) == ["done"] * 6
    assert sorted(_ran(tmp_path)) == ids
    assert ls(sp, "processing") == []


@sql_only
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_kill_at_the_claims_made_ahead(tmp_path, when):
    """Killed at the one statement that claims six jobs of a plain drain:
    before it none is claimed; after it all six are the dead worker's,
    none run.  The next worker takes them back and runs each once."""
    sp, ids, mod = _spool(tmp_path, 6)
    worker_killed_around("_sql_claim_many", when, sp, "--module", mod, *FAST)
    assert _ran(tmp_path) == []
    assert states(sp, ids) == ["ready" if when == "before" else
                                "processing"] * 6
    cp = run_myq("--spool", sp, "worker", "--drain", "--module", mod, *FAST)
    assert cp.returncode == 0, cp.stderr
    assert states(sp, ids) == ["done"] * 6
    assert sorted(_ran(tmp_path)) == ids
    assert ls(sp, "processing") == []


STOP_AT_FIRST = """import os, signal
def t(job):
    fd = os.open(%r, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (job["id"] + "\\n").encode())
    os.close(fd)
    if job["id"] == "j00":
        os.kill(os.getpid(), signal.SIGTERM)
"""


@sql_only
def test_a_stop_gives_the_claims_made_ahead_back_untouched(tmp_path):
    """SIGTERM while the first of six runs, the five others claimed with
    it: it finishes, and the five wait again as they were: ready, no
    attempt spent, no error noted."""
    sp, ids, mod = _spool(tmp_path, 6)
    with open(mod, "w") as f:
        f.write(STOP_AT_FIRST % str(tmp_path / "ran"))
    cp = run_myq("--spool", sp, "worker", "--module", mod, *FAST)
    assert cp.returncode == 0, cp.stderr
    assert _ran(tmp_path) == ["j00"]
    assert states(sp, ids) == ["done"] + ["ready"] * 5
    for i in ids[1:]:
        job = json.loads(call_myq("--spool", sp, "show", i).stdout)
        assert job["attempts"] == 0 and job.get("last_error") is None, job


KILL_IN_THIRD = """import os, signal
def t(job):
    if job["id"] == "j02":
        os.kill(os.getpid(), signal.SIGKILL)
    fd = os.open(%r, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (job["id"] + "\\n").encode())
    os.close(fd)
"""


@sql_only
def test_a_kill_with_claims_made_ahead_loses_none(tmp_path):
    """kill -9 in the third of six jobs claimed together (the first two'
    successes not written yet): every job is taken back by the next
    worker and done, at least once."""
    sp, ids, mod = _spool(tmp_path, 6)
    with open(mod, "w") as f:
        f.write(KILL_IN_THIRD % str(tmp_path / "ran"))
    worker_killed_by_its_hook("import sys; sys.path.insert(0, %r); import myq;"
                              " sys.exit(myq.main(sys.argv[1:]))" % ROOT, sp,
                              "--module", mod, *FAST)
    assert _ran(tmp_path) == ["j00", "j01"]
    with open(mod, "w") as f:
        f.write(HANDLER % str(tmp_path / "ran"))
    cp = run_myq("--spool", sp, "worker", "--drain", "--module", mod, *FAST)
    assert cp.returncode == 0, cp.stderr
    assert states(sp, ids) == ["done"] * 6
    assert sorted(set(_ran(tmp_path))) == ids
    assert ls(sp, "processing") == []


MV_ONE_IN = """import json, os
def t(job):
    fd = os.open(%(ran)r, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (job["id"] + "\\n").encode())
    os.close(fd)
    if job["id"] == "j00":      # a shell producer's mv, no poke
        tmp = os.path.join(%(spool)r, "tmp", "x.json")
        with open(tmp, "w") as f:
            json.dump({"type": "t", "payload": 1}, f)
        os.rename(tmp, os.path.join(%(spool)r, "incoming", "late.json"))
"""


def test_a_drain_asks_incoming_s_key_when_it_runs_dry_not_at_every_claim(
        tmp_path, monkeypatch):
    """Files: 30 jobs due in incoming/, drained: incoming/'s change key
    (an fstat) is not asked before and after every claim (60 times) but
    when the lane's next job is not due; a file a shell producer moved in
    meanwhile, unpoked, still runs."""
    sp, ids, mod = _spool(tmp_path, 30, store="files")
    with open(mod, "w") as f:
        f.write(MV_ONE_IN % {"ran": str(tmp_path / "ran"), "spool": sp})
    asked = []
    real = myq.FileClaims.change_key

    def change_key(self):
        asked.append(1)
        return real(self)
    monkeypatch.setattr(myq.FileClaims, "change_key", change_key)
    myq.Worker(sp, module=mod, poll=0.05, jitter=0, log=myq.Log(
        stream=open(os.devnull, "w"))).run(drain=True)
    assert sorted(_ran(tmp_path)) == sorted(ids + ["late"])
    assert len(asked) < 15, len(asked)
