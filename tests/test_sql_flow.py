"""The SQLite store's slow flow (a batch under batch_wait): a batch's jobs are
claimed in one statement and finished in one transaction, not two
transactions a job (each a commit: its locks and the log's frames, ~25
syscalls a job); the poll tick learns the lanes again only when a lane
could have changed, not at every producer's commit.

What is cut is counted (statements and transactions through sqlite3's
trace callback, lane lookups), never timed; each new step is cut by a
kill -9 of a real worker before and after its commit, and every job is
delivered after it (at least once; a batch finished in part or not at all
goes again under its key).
"""
import os
import sqlite3

import pytest

from _core import (FAST, call_myq, ls, run_myq, sql_traced,
                   sql_transactions, states)
from _http import http_servers  # noqa: F401  (a fixture)
from _procs import worker_killed_around

import myq

pytestmark = pytest.mark.skipif(
    sqlite3.sqlite_version_info < (3, 35, 0),
    reason="a batch's claims are one statement with UPDATE ... RETURNING "
    "(SQLite 3.35); this one is %s" % sqlite3.sqlite_version)


def _spool(tmp_path, url, n):
    sp = str(tmp_path / "s")
    assert call_myq("--spool", sp, "init", "--store", "sqlite").returncode == 0
    p = call_myq("--spool", sp, "policy", "t", "handler=http", "url=" + url,
                 "batch=%d" % n, "batch_wait=0")
    assert p.returncode == 0, p.stderr
    return sp



def _sent(srv):
    """(Idempotency-Key, X-Myq-Ids as a list) of each request."""
    with srv.lock:
        return [(r["headers"]["Idempotency-Key"],
                 r["headers"]["X-Myq-Ids"].split(","))
                for r in srv.requests]




def test_a_batch_is_claimed_in_one_statement_and_done_in_one_transaction(
        tmp_path, http_servers, monkeypatch):
    """batch=20, 20 waiting: the first job claimed alone (the scheduler's
    claim), the 19 others in one statement; the 20 successes in one
    transaction (before: 20 claims and 20 finishes, each its own)."""
    srv = http_servers()
    sp = _spool(tmp_path, srv.url("/in"), 20)
    ids = ["j%02d" % i for i in range(20)]
    for i in ids:
        myq.enqueue(sp, "t", {"n": i}, id=i)
    seen = sql_traced(monkeypatch)
    myq.Worker(sp, poll=0.05, jitter=0, log=myq.Log(
        stream=open(os.devnull, "w"))).run(drain=True)
    assert states(sp, ids) == ["done"] * 20
    assert [s[1] for s in _sent(srv)] == [ids]
    claims = [s for s in seen if s.startswith("UPDATE jobs SET status="
                                              "'processing'")]
    assert len(claims) == 2, claims
    assert sql_transactions(seen, "SET status='done'") == 1, [
        s for s in seen if "status='done'" in s or s in ("BEGIN IMMEDIATE",
                                                         "COMMIT")]


def _cut(spool, step, when):
    """A worker killed at a batch's new step: its claims of the jobs after
    the first (step "claim": one statement), or their successes ("done":
    one transaction), before or after its commit."""
    worker_killed_around("_sql_claim_many" if step == "claim" else
                         "_SqlClaims.complete_many", when, spool, *FAST)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_kill_at_the_batch_s_done_commit(tmp_path, http_servers, when):
    """The receiver answered the batch 200; the worker is killed at the
    transaction that marks its six jobs done.  Before its commit none is
    done, and the six go again under the batch's key (a receiver that
    de-duplicates on it stores them once); after it all six are, and
    nothing goes again."""
    srv = http_servers()
    sp = _spool(tmp_path, srv.url("/in"), 6)
    ids = ["j%d" % i for i in range(6)]
    for i in ids:
        myq.enqueue(sp, "t", {"n": i}, id=i)
    _cut(sp, "done", when)
    assert states(sp, ids).count("done") == (0 if when == "before" else 6)
    cp = run_myq("--spool", sp, "worker", "--drain", *FAST)
    assert cp.returncode == 0, cp.stderr
    assert states(sp, ids) == ["done"] * 6
    sent = _sent(srv)
    assert sent[0] == (myq._ids_key(ids), ids), sent
    assert sent[1:] == ([sent[0]] if when == "before" else []), sent
    assert ls(sp, "processing") == []


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_kill_at_the_batch_s_claim(tmp_path, http_servers, when):
    """The worker is killed at the statement that claims the batch's jobs
    after its first: before it, the first alone is claimed; after it, all
    six, none sent.  The next worker takes them back and sends each
    once."""
    srv = http_servers()
    sp = _spool(tmp_path, srv.url("/in"), 6)
    ids = ["j%d" % i for i in range(6)]
    for i in ids:
        myq.enqueue(sp, "t", {"n": i}, id=i)
    _cut(sp, "claim", when)
    assert states(sp, ids).count("processing") == (1 if when == "before" else 6), \
        states(sp, ids)
    assert _sent(srv) == []
    cp = run_myq("--spool", sp, "worker", "--drain", *FAST)
    assert cp.returncode == 0, cp.stderr
    assert states(sp, ids) == ["done"] * 6
    assert sorted(i for _, got in _sent(srv) for i in got) == ids
    assert ls(sp, "processing") == []


def _lane_keys(claims, sub):
    """(the lanes' key, incoming/'s, lane `sub`'s), looked at now."""
    L = myq._Lane(sub)
    return (claims.lanes_key(True), claims.change_key()[0],
            claims.lane_key(L)[0])


def test_a_producer_s_rows_change_their_lane_s_key_alone(tmp_path):
    """A producer's commit (rows added to a lane that has some) changes
    that lane's key, not the lanes' (learnt again: two queries and the
    policy's lanes) nor incoming/'s (its drop box read again and its rows
    scanned) at the worker's next tick (before: PRAGMA data_version was
    every key, so every arrival changed them all); a commit that changes
    rows without adding one changes them all, as a rowid used again
    does."""
    sp = str(tmp_path / "s")
    assert call_myq("--spool", sp, "init", "--store", "sqlite").returncode == 0
    assert call_myq("--spool", sp, "policy", "fwd", "batch=100",
                    "batch_wait=1h").returncode == 0
    producer = myq.Spool(sp)
    producer.enqueue("fwd", {"n": 0})
    worker = myq.Spool(sp).store
    (sub,) = [s for _, t, s in worker.lanes() if t == "fwd"]
    _lane_keys(worker.claims, sub)
    producer.enqueue("fwd", {"n": 0.5})     # (a name new since the first look)
    before = _lane_keys(worker.claims, sub)
    producer.enqueue("fwd", {"n": 1})
    after = _lane_keys(worker.claims, sub)
    assert after[0] == before[0] and after[1] == before[1], (before, after)
    assert after[2] != before[2]
    producer.enqueue("other", {"n": 2})     # (a lane of its own: incoming)
    third = _lane_keys(worker.claims, sub)
    assert third[0] != after[0] and third[1] != after[1]
    assert third[2] == after[2]
    # another process's change that adds no row: every key
    jid = producer.enqueue("fwd", {"n": 3}, delay=3600)
    fourth = _lane_keys(worker.claims, sub)
    assert call_myq("--spool", sp, "delete", jid).returncode == 0
    fifth = _lane_keys(worker.claims, sub)
    assert all(a != b for a, b in zip(fourth, fifth)), (fourth, fifth)
