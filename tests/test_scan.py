"""The scan cache: how a worker finds ready jobs in incoming/.

A directory of up to 4 × --scan-cache entries is scanned whole (the N
earliest first, the next due time exact); a deeper one is worked through in
passes of a directory iterator, and the first job starts after 4 × N
entries, not the whole directory.  Small scan caches make small directories
"deep" here.  On the SQLite store a lane's cache is its N earliest rows:
what a worker must do (every job once, the earliest first, future jobs
left, due ones woken for) holds there too; the passes of a directory
iterator are the file store's own (files_only).
"""
import os
import signal
import threading

import pytest

from _core import ls, sql, wait_for


def _worker(myq, spool, seen, scan_cache, **kw):
    def noop(job):
        seen.append(job["id"])
    kw.setdefault("log", myq.Log(path=os.devnull))
    return myq.Worker(spool, handlers={"noop": noop}, scan_cache=scan_cache, **kw)


def _ids(myq, spool, n, delay=0):
    sp = myq.open_store(spool)
    return sp.enqueue_many([{"type": "noop", "payload": i, "delay": delay}
                            for i in range(n)])


def _names(spool, state):
    """The ids of the jobs in `state` (_core.ls: either store)."""
    return sorted(n[:-5] for n in ls(spool, state) if n.endswith(".json"))


def _schedule(spool, jid, t):
    """Make waiting job `jid` available at `t` through its store: the
    mtime of its file in incoming/, or its row's available_at."""
    n = sql(spool, "UPDATE jobs SET available_at=? WHERE id=? AND "
            "status='ready'", (t, jid))
    if n is None:
        os.utime(os.path.join(spool, "incoming", jid + ".json"), (t, t))
    else:
        assert n == 1, (jid, n)


@pytest.mark.parametrize("n,scan_cache", [(5, 4), (16, 4), (17, 4), (203, 4),
                                          (50, 1)])
def test_every_job_runs_exactly_once_at_any_depth(myq, spool, n, scan_cache):
    ids = _ids(myq, spool, n)
    seen = []
    assert _worker(myq, spool, seen, scan_cache).run(drain=True) == 0
    assert sorted(seen) == sorted(ids)
    assert len(seen) == n
    assert _names(spool, "done") == sorted(ids)
    assert ls(spool, "incoming") == []


@pytest.mark.parametrize("n", [4, 16, 17, 40])
def test_the_first_refill_is_the_n_earliest_by_available_at(myq, spool, n):
    """The schedule (the mtime in incoming/, a row's available_at); given
    in reverse of the ids, it alone decides.  Up to 4N entries the first N
    are the N earliest of the directory; deeper, the N earliest of the
    first 4N+1 entries."""
    ids = _ids(myq, spool, n)
    past = myq._now() - 1000
    mtime = {}
    for i, jid in enumerate(ids):       # the last id is the most overdue
        mtime[jid] = past - i
        _schedule(spool, jid, past - i)
    seen = []
    _worker(myq, spool, seen, 4).run(drain=True)
    assert sorted(seen) == sorted(ids)
    assert seen[:4] == sorted(seen[:4], key=mtime.get)
    if n <= 16:
        assert seen[:4] == ids[::-1][:4]


@pytest.mark.files_only("counts the entries a directory iterator reads")
def test_a_deep_backlog_starts_before_reading_the_whole_directory(
        myq, spool, monkeypatch):
    _ids(myq, spool, 300)
    read = [0]
    at_first_job = []
    real = myq._scandir

    def counting(path):
        for e in real(path):
            read[0] += 1
            yield e

    class Iter(object):             # _scandir's result is closed by myq
        def __init__(self, path):
            self.g = counting(path)

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.g)

        def close(self):
            self.g.close()

    monkeypatch.setattr(myq, "_scandir", Iter)
    seen = []
    w = _worker(myq, spool, seen, 4)
    w.handlers["noop"] = lambda job: (at_first_job.append(read[0])
                                      if not at_first_job else None,
                                      seen.append(job["id"]))
    w.run(drain=True)
    assert len(seen) == 300
    assert at_first_job[0] <= 4 * 4 + 1, at_first_job   # not all 300


def test_jobs_not_yet_due_in_a_deep_pass_run_when_due(myq, spool):
    """Every job is 1 s in the future and the directory is deeper than 4N:
    the pass's marker must wake the worker (polling and reaping are off:
    --poll 3600, a reap every hour)."""
    ids = _ids(myq, spool, 12, delay=1.0)
    seen = []
    w = _worker(myq, spool, seen, 2, poll=3600.0, reap_interval=3600.0,
                lease=600.0)           # heartbeats every 200 s

    def noop(job):
        seen.append(job["id"])
        if len(seen) == len(ids):
            os.kill(os.getpid(), signal.SIGTERM)
    w.handlers["noop"] = noop
    # A watchdog so that a missing wake-up fails the test instead of hanging.
    timer = threading.Timer(15.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        w.run()
    finally:
        timer.cancel()
    assert sorted(seen) == sorted(ids), "jobs due later were never run"


def test_drain_leaves_future_jobs_of_a_deep_directory_and_runs_the_ready(
        myq, spool):
    later = _ids(myq, spool, 10, delay=3600)
    ready = _ids(myq, spool, 5)
    seen = []
    _worker(myq, spool, seen, 2).run(drain=True)
    assert sorted(seen) == sorted(ready)
    assert _names(spool, "incoming") == sorted(later)


# A deep first chunk without a ready job, arrivals during a
# pass, and a pass of nothing claimable.  Directory order is the
# filesystem's, so the ready jobs hide among many future ones.

def test_once_and_drain_find_ready_jobs_anywhere_in_a_deep_directory(myq, spool):
    later = _ids(myq, spool, 200, delay=3600)
    ready = _ids(myq, spool, 3)
    seen = []
    for _ in ready:                     # --once: one ready job each time
        assert _worker(myq, spool, seen, 2).run(once=True) == 0
    assert sorted(seen) == sorted(ready)
    more = _ids(myq, spool, 3)
    _worker(myq, spool, seen, 2).run(drain=True)
    assert sorted(seen) == sorted(ready + more)
    assert _names(spool, "incoming") == sorted(later)


class _Snapshot(object):
    """A directory iterator that does not return files added after it was
    opened (POSIX leaves that unspecified; ext4's hash order often skips
    them)."""

    def __init__(self, it):
        self.rest = list(it)
        it.close()

    def __iter__(self):
        return self

    def __next__(self):
        if not self.rest:
            raise StopIteration
        return self.rest.pop(0)

    def close(self):
        self.rest = []


@pytest.mark.files_only("a pass of a directory iterator over incoming/")
@pytest.mark.parametrize("ready_before", [0, 3])
def test_a_job_enqueued_during_a_deep_pass_is_claimed_without_waiting(
        myq, spool, ready_before):
    """A pass is open over a deep directory (jobs due in an hour, maybe a
    few ready); a job arrives that the open iterator will not return: it
    must be claimed as soon as the pass ends, not when the pass's marker
    (an hour away) comes due."""
    _ids(myq, spool, 20, delay=3600)
    ready = _ids(myq, spool, ready_before)
    w = _worker(myq, spool, [], 2)
    w.me = w.sched.me = myq.Identity(w.spool)        # what run() would set up
    w.sched._rescan()                         # the first chunk: a pass opens
    assert w.sched._sweep is not None
    w.sched._sweep = _Snapshot(w.sched._sweep)
    arrived = myq.open_store(spool).enqueue("noop")
    w.sched.dirty = True                      # as the FIFO poke or a poll does
    claimed = []
    while True:
        c = w.sched._next_claim()
        if c is None:
            break
        claimed.append(c.jid)
        w.spool.claims.complete(c)
    assert sorted(claimed) == sorted(ready + [arrived])


@pytest.mark.slow
def test_a_pass_of_unclaimable_files_does_not_spin(myq, spool):
    """Bad names whose quarantine fails (failed/ gone): the worker must not
    rescan in a tight loop, must say why in its log, and must still stop
    on SIGTERM."""
    import shutil
    for i in range(10):
        with open(os.path.join(spool, "incoming", "bad name %d.json" % i), "w") as f:
            f.write('{"type": "noop"}')
    events = []
    w = _worker(myq, spool, [], 2, poll=1.0,
                log=lambda ev, **kv: events.append((ev, kv)))
    n = [0]
    real = w.sched._rescan

    def counting(lane=None):
        n[0] += 1
        if n[0] == 1:
            shutil.rmtree(os.path.join(spool, "failed"))
        return real(lane)
    w.sched._rescan = counting
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    wait_for(lambda: n[0] >= 2, timeout=5, what="two rescans")
    import time
    time.sleep(1.0)                     # the window in which rescans are counted
    w._on_stop(signal.SIGTERM, None)
    t.join(5)
    assert not t.is_alive(), "the worker did not stop"
    assert n[0] < 50, "%d rescans in about a second" % n[0]
    # and it says why: the quarantine failed (not silently)
    assert any(ev == "error" and kv.get("during") == "claim"
               for ev, kv in events), events


def test_a_pass_that_claims_nothing_still_wakes_the_worker_soon(
        myq, spool, monkeypatch):
    """One _next_claim call can end two passes without a claim (the job it
    saw came due meanwhile): it returns None, and must leave the worker a
    due time in a moment, not wait for a poll or heartbeat.  A slow
    directory iterator makes the job come due during the second pass."""
    import time
    sp = myq.open_store(spool)
    sp.enqueue("noop", id="0000-B", delay=1.0)
    sp.enqueue("noop", id="0001-F1")
    for _ in range(30):
        sp.enqueue("noop", delay=3600)
    real = myq._scandir

    class Slow(object):
        def __init__(self, path):
            # (an entry's stat() works while the scan runs: asked here, it
            # is cached by the entry)
            self.rest = sorted([(e.stat(follow_symlinks=False), e)[1]
                                for e in real(path)], key=lambda e: e.name)

        def __iter__(self):
            return self

        def __next__(self):
            if not self.rest:
                raise StopIteration
            time.sleep(0.02)
            return self.rest.pop(0)

        def close(self):
            self.rest = []
    monkeypatch.setattr(myq, "_scandir", Slow)
    w = _worker(myq, spool, [], 1, poll=3600.0)
    w.me = w.sched.me = myq.Identity(w.spool)
    c = w.sched._next_claim(force=True)
    assert c is not None and c.jid == "0001-F1"
    w.spool.claims.complete(c)
    w.sched.dirty = True                      # a poke between two calls
    c = w.sched._next_claim()
    if c is None:
        assert w.sched.next_due is not None and w.sched.next_due <= myq._now() + 1.0
    else:
        assert c.jid == "0000-B"


def test_a_change_within_the_directory_times_granularity_is_seen(
        myq, spool, monkeypatch):
    # incoming/'s time has the kernel's coarse granularity: a shell
    # producer's mv in the same jiffy as the change the poll tick saw leaves
    # the time as it was.  A time that recent proves nothing, so the next
    # tick looks again (before: it took the equal key for "no change", and
    # the job waited for the next change of incoming/, forever if none came).
    w = _worker(myq, spool, [], 4)
    inc = os.path.join(spool, "incoming")
    st = os.stat(inc)
    monkeypatch.setattr(myq, "_now", lambda: st.st_mtime + 0.004)  # that jiffy
    w.sched._check_incoming()
    w.sched._top.dirty = False
    with open(os.path.join(spool, "tmp", "j.json"), "w") as f:
        f.write('{"type": "noop"}')
    os.rename(os.path.join(spool, "tmp", "j.json"), os.path.join(inc, "j.json"))
    os.utime(inc, ns=(st.st_atime_ns, st.st_mtime_ns))      # the same jiffy
    w.sched._check_incoming()
    assert w.sched.dirty
    # a time long past (or ahead: a clock that jumped) is a time to trust
    monkeypatch.setattr(myq, "_now", lambda: st.st_mtime + 3.0)
    w.sched._check_incoming()
    w.sched._top.dirty = False
    w.sched._check_incoming()
    assert not w.sched.dirty
