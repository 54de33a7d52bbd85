"""A batch keeps its Idempotency-Key across a kill -9 of its worker (myq(1)
"Batches"): what goes again of a batch that a dead worker had in
flight goes under the key it first went under, so that a receiver that
de-duplicates on the key stores nothing twice.

Both kills are of a real worker process (SIGKILL): one while its request
is in flight (the receiver has it and has not answered), one after the
receiver answered 200 while the worker moved the batch's jobs to done/ one
by one (the soak: 47 of 100 done, the 53 left went again under a key of
their own, and the receiver stored them twice).
"""
import json
import os
import signal

from _core import FAST, ROOT, call_myq, ls, run_myq, start_worker
from _http import answer, http_servers  # noqa: F401  (a fixture)
from _procs import worker_killed_by_its_hook

import myq


def _policy(spool, url, n):
    p = call_myq("--spool", spool, "policy", "t", "handler=http", "url=" + url,
                 "batch=%d" % n)
    assert p.returncode == 0, p.stderr


def _sent(srv):
    """(Idempotency-Key, X-Myq-Ids as a list, status) of each request."""
    with srv.lock:
        return [(r["headers"]["Idempotency-Key"],
                 r["headers"]["X-Myq-Ids"].split(","), r["status"])
                for r in srv.requests]


def _states(spool, ids):
    return [json.loads(call_myq("--spool", spool, "show", i).stdout)["state"]
            for i in ids]


def test_a_batch_in_flight_at_a_kill_goes_again_under_its_key(spool,
                                                               http_servers):
    """The receiver holds the first request unanswered; the worker is
    killed (-9); the next worker sends the same ids under the same key."""
    def hold_first(h):
        if len(h.server.requests) == 1:
            h.server.release.wait(30)       # never answered: the kill comes
            return
        answer(h)
    srv = http_servers(default=hold_first)
    _policy(spool, srv.url("/in"), 5)
    ids = ["j%d" % i for i in range(5)]
    for i in ids:
        myq.enqueue(spool, "t", {"n": i}, id=i)
    w = start_worker(spool, *FAST)
    try:
        assert srv.wait_requests(1, timeout=30), "no request came"
        os.killpg(w.pid, signal.SIGKILL)
        w.wait(10)
    finally:
        if w.poll() is None:
            os.killpg(w.pid, signal.SIGKILL)
            w.wait(10)
    cp = run_myq("--spool", spool, "worker", "--drain", *FAST)
    assert cp.returncode == 0, cp.stderr
    assert _states(spool, ids) == ["done"] * 5
    sent = _sent(srv)
    assert len(sent) == 2, sent
    assert sent[0][:2] == sent[1][:2] == (myq._ids_key(ids), ids), sent
    assert ls(spool, "processing") == []


# A worker that kills itself (-9) at its Nth job finished as done: the
# receiver has answered the batch's request, and the worker dies while it
# moves the batch's jobs to done/ (a finish is a step per job on both
# stores).
KILL_AT_DONE = r"""
import os, signal, sys
sys.path.insert(0, %(root)r)
import myq
n, real = [0], myq._Finishing._complete
def _complete(self, c, kv, ok=None):
    n[0] += 1
    if n[0] > %(at)d:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, c, kv, ok)
myq._Finishing._complete = _complete
# (one job at a time: the SQLite store finishes a batch in one transaction,
# which no kill cuts in part: test_sql_flow cuts that one)
myq._Finishing._complete_many = lambda self, claims: None
sys.exit(myq.main(sys.argv[1:]))
"""


def _cut_while_it_finished(spool, url, ids, at):
    """A worker that runs one batch of `ids`, answered 200, and is killed
    (-9) after `at` of them are done."""
    _policy(spool, url, len(ids))
    for i in ids:
        myq.enqueue(spool, "t", {"n": i}, id=i)
    worker_killed_by_its_hook(KILL_AT_DONE % {"root": ROOT, "at": at},
                              spool, *FAST)
    assert _states(spool, ids).count("done") == at, _states(spool, ids)


def test_a_batch_cut_while_it_finished_goes_again_under_its_key(
        spool, http_servers):
    """batch=6: the receiver answers the batch 200 (it stored all six
    under the key); the worker is killed after two of them are done.  The
    four left go again under the batch's first key, and the receiver,
    de-duplicating on it, stores them once (before: under the key of
    their four ids, so a receiver that de-duplicates on the key stored
    them twice)."""
    srv = http_servers()
    ids = ["j%d" % i for i in range(6)]
    _cut_while_it_finished(spool, srv.url("/in"), ids, 2)
    cp = run_myq("--spool", spool, "worker", "--drain", *FAST)
    assert cp.returncode == 0, cp.stderr
    assert _states(spool, ids) == ["done"] * 6
    sent = _sent(srv)
    assert len(sent) == 2 and sent[0][1] == ids, sent
    assert sent[1][1] == ids[2:], sent
    assert sent[1][0] == sent[0][0] == myq._ids_key(ids), sent
    assert ls(spool, "processing") == []


def test_what_is_left_lacking_a_job_not_done_goes_under_its_own_key(
        spool, http_servers):
    """The same cut, then one of the four left is deleted: the three go
    under the key of their own ids, not the batch's: a job the batch lacks
    that is not done may still go (a straggler that another worker takes
    back later), and under the batch's key a receiver that has it would
    drop it unstored."""
    srv = http_servers()
    ids = ["j%d" % i for i in range(6)]
    _cut_while_it_finished(spool, srv.url("/in"), ids, 2)
    assert run_myq("--spool", spool, "reap").returncode == 0
    cp = run_myq("--spool", spool, "delete", "j5")
    assert cp.returncode == 0, cp.stderr
    cp = run_myq("--spool", spool, "worker", "--drain", *FAST)
    assert cp.returncode == 0, cp.stderr
    assert _states(spool, ids[:5]) == ["done"] * 5
    sent = _sent(srv)
    assert len(sent) == 2 and sent[1][1] == ids[2:5], sent
    assert sent[1][0] == myq._ids_key(ids[2:5]), sent
