"""The backlog of a live-first type drains in created_at order, however
deep (myq(1) "Live data first": the backlog "drains in created_at order
with what the live jobs leave").

The SQLite store reads its backlog by created_at (its index).  The file
store read a lane of more than --scan-cache jobs by mtime (the N earliest
of a directory of up to 4N) or in the directory's order (a pass over a
deeper one, N at a time): a backlog of 100,000 drained in the order of
its directory's slices, not of its age.  It now reads the N oldest by
the age a job's name tells (myq's ids begin with the millisecond they
were made; another name is dated by its mtime), so only the names that
could be among them are stat'ed.

The backlog here is made as the 3-hour soak's faketime producer makes it:
through the API, under a clock set to each job's making (an hour ago, in
a shuffled order, one enqueue a job, as from many producers), so that
the files' mtimes (the kernel's clock) and the directory's order are not
created_at's.
"""
import os
import random
import time

import pytest

from _core import drain_here, listed, policy
from _http import http_servers  # noqa: F401 (a fixture)


def _made_then(myq, spool, monkeypatch, n, seed=41, age=3600.0):
    """n jobs of `tele` made an hour ago, 0.25 s apart, enqueued in a
    shuffled order, each under a clock that says when it was made, each as
    by a producer of its own (ids count up within a process: one that
    went on after a later job would name it after that one); their ids
    in created_at order."""
    sp = myq.Spool(spool)
    base = time.time() - age
    order = list(range(n))
    random.Random(seed).shuffle(order)
    made = {}
    clock = [0.0]
    last = list(myq._LAST_ID)
    monkeypatch.setattr(myq, "_now", lambda: clock[0])
    try:
        for k, i in enumerate(order):
            clock[0] = base + i * 0.25
            myq._LAST_ID[:] = [0, 0]        # a producer of its own
            made[i] = sp.enqueue("tele", {"b": i}, sync=k == n - 1)
    finally:
        monkeypatch.undo()
        myq._LAST_ID[:] = last
    assert sorted(made.values()) == [made[i] for i in range(n)]
    return [made[i] for i in range(n)]


def _worker_order(myq, spool, **kw):
    """The jobs' ids in the order a worker of concurrency 1 ran them."""
    ran = []
    drain_here(spool, {"tele": lambda job: ran.append(job["id"])},
               concurrency=1, **kw)
    return ran


@pytest.mark.parametrize("scan_cache", [None, 64])
def test_a_deep_backlog_drains_in_created_at_order_after_the_live_jobs(
        myq, spool, monkeypatch, scan_cache):
    """3,000 backlog jobs: more than the scan cache's 2,048 (the old file
    store took the 2,048 earliest by mtime), and with a cache of 64 a
    deep lane (the old pass's order); 5 live jobs, backlog_share=0: the
    live ones first, then the backlog, every job once, oldest first."""
    policy(spool, "tele", "order=live-first", "backlog_share=0")
    old = _made_then(myq, spool, monkeypatch, 3000)
    new = [myq.enqueue(spool, "tele", {"l": k}) for k in range(5)]
    kw = {} if scan_cache is None else {"scan_cache": scan_cache}
    ran = _worker_order(myq, spool, **kw)
    assert ran[:5] == new
    assert len(ran) == 3005 and set(ran[5:]) == set(old)
    firsts = [i for i, (a, b) in enumerate(zip(ran[5:], old)) if a != b]
    assert not firsts, "backlog out of created_at order from job %d" % firsts[0]


def test_the_backlog_keeps_created_at_order_beside_live_jobs(
        myq, spool, monkeypatch):
    """The default share (50): live and backlog alternate while live jobs
    wait, and the backlog's own order is still its age."""
    policy(spool, "tele", "order=live-first")
    old = _made_then(myq, spool, monkeypatch, 400, seed=7)
    new = [myq.enqueue(spool, "tele", {"l": k}) for k in range(20)]
    ran = _worker_order(myq, spool, scan_cache=16)
    assert [j for j in ran if j in set(new)] == new
    assert [j for j in ran if j not in set(new)] == old
    # alternating while live jobs waited: the first 40 starts half live
    assert sum(1 for j in ran[:40] if j in set(new)) == 20


def test_a_retried_backlog_job_keeps_its_place(myq, spool, monkeypatch):
    """The oldest backlog job fails once and waits its backoff (0.4 s);
    the next job holds the worker until then.  When it is due again it
    is the oldest of the backlog and goes next (its created_at is kept
    across the retry: the file store reads it in its name), not after the
    jobs made later; with a scan cache of 4 the lane is deep."""
    policy(spool, "tele", "order=live-first")
    old = _made_then(myq, spool, monkeypatch, 40, seed=3)
    ran, failed = [], []

    def handler(job):
        ran.append(job["id"])
        if job["id"] == old[0] and not failed:
            failed.append(time.time())
            raise RuntimeError("once")
        if len(ran) == 2:
            # wait for the clock, not for a thread: the retry comes due
            while time.time() < failed[0] + 0.6:
                time.sleep(0.01)
    drain_here(spool, {"tele": handler}, concurrency=1, scan_cache=4,
               backoff_base=0.4)
    assert ran[:3] == [old[0], old[1], old[0]], ran[:4]
    assert ran[3:] == old[2:]


def test_the_oldest_waiting_keep_no_due_backlog_back(myq, spool, monkeypatch):
    """The 6 oldest of the backlog are not due (a delay: as a retry's
    backoff), more than a scan cache of 4: the file store keeps its
    backlog's 4 oldest names and stats those alone; none due, the due
    ones after them are read too.  Every due job runs, oldest first; the
    6 still wait."""
    policy(spool, "tele", "order=live-first")
    sp = myq.Spool(spool)
    base = time.time() - 3600
    clock = [0.0]
    last = list(myq._LAST_ID)
    monkeypatch.setattr(myq, "_now", lambda: clock[0])
    try:
        ids = []
        for i in range(20):
            clock[0] = base + i
            ids.append(sp.enqueue("tele", {"b": i}, delay=7200 if i < 6 else 0))
    finally:
        monkeypatch.undo()
        myq._LAST_ID[:] = last
    ran = _worker_order(myq, spool, scan_cache=4)
    assert ran == ids[6:]
    assert sorted(j["id"] for j in listed(spool, "scheduled")) == ids[:6]


def test_a_hold_keeps_the_backlogs_order(myq, spool, monkeypatch,
                                          http_servers):
    """The destination answers 503: its breaker holds it (the jobs it
    failed wait again, their created_at kept: by name on the file store),
    its probes fail, then it answers: every job of the backlog is
    delivered once, oldest first (scan cache 4: a deep lane)."""
    import signal
    import threading
    from _core import wait_for
    from _http import answer
    state = {"up": False}

    def flaky(h):
        answer(h, 200 if state["up"] else 503)
    srv = http_servers(default=flaky)
    policy(spool, "tele", "url=" + srv.url("/in"), "order=live-first")
    old = _made_then(myq, spool, monkeypatch, 30, seed=5)
    w = myq.Worker(spool, poll=0.05, jitter=0, backoff_base=0.2,
                   probe_max=0.3, concurrency=1, scan_cache=4,
                   log=myq.Log(stream=open(os.devnull, "w")))
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        # (up only once held: a job failed before the hold waits out its
        # backoff, and one made after it may go first meanwhile)
        wait_for(lambda: len(srv.requests) >= 5 and myq.open_store(
            spool).breaker.records(), what="held, probes failing")
        state["up"] = True
        wait_for(lambda: len(listed(spool, "done")) == 30, timeout=30,
                 what="the backlog delivered")
    finally:
        w._on_stop(signal.SIGTERM, None)
        myq.open_store(spool).poke()
        t.join(15)
    ok = [r["headers"]["Idempotency-Key"] for r in srv.requests
          if r["status"] == 200]
    assert ok == old, (ok, old)


def _made_at(myq, spool, monkeypatch, idx, base):
    """Jobs `tele` {"b": i} for i in idx, each made at base + i / 2 s as
    by a producer of its own; {i: id}."""
    sp = myq.Spool(spool)
    made, clock, last = {}, [0.0], list(myq._LAST_ID)
    monkeypatch.setattr(myq, "_now", lambda: clock[0])
    try:
        for i in idx:
            clock[0] = base + i * 0.5
            myq._LAST_ID[:] = [0, 0]
            made[i] = sp.enqueue("tele", {"b": i})
    finally:
        monkeypatch.undo()
        myq._LAST_ID[:] = last
    return made


def test_a_backlog_across_the_ram_tier_and_the_spool_drains_by_age(
        myq, spool, monkeypatch, tmp_path, ram):
    """durable=outage: half the backlog waits in the spool (made before
    the RAM tier was), half in the tier (made while the type was paused),
    their ages interleaved: once resumed, one created_at order over both
    tiers (scan cache 16: deep lanes)."""
    from _core import cli, ok, wait_for
    from test_ram import Tier
    policy(spool, "tele", "order=live-first")
    base = time.time() - 3600
    order = list(range(200))
    random.Random(2).shuffle(order)
    made = _made_at(myq, spool, monkeypatch, [i for i in order if i % 2 == 0],
                    base)
    t = Tier(spool, ram, tmp_path, spill_after="10h")
    ok(cli(spool, "pause", "tele"))
    t.start("--scan-cache", "16")
    try:
        made.update(_made_at(myq, spool, monkeypatch,
                             [i for i in order if i % 2 == 1], base))
        assert len([i for i in made.values() if i in t.in_ram()]) == 100
        ok(cli(spool, "resume", "tele"))
        wait_for(lambda: len(t.delivered()) == 200, timeout=60,
                 what="the backlog delivered")
    finally:
        t.stop()
    assert [p["b"] for p in t.delivered()] == list(range(200))
