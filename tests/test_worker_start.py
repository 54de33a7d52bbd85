"""A worker's start on a deep spool (bench/flow.py --start-n): what it reads of the
waiting jobs is per start, not three times over, and after a stop that
left nothing changed, nothing.

- `worker --drain` made three passes over a deep incoming/ (its first
  claim, the "fresh look" that followed, the end's "is any ready?"), each
  a stat of every entry: 100,000 jobs not due cost 3.8 G instructions.  A
  look at a lane whose key did not change since its pass (_current) takes
  the pass's result.  A running worker's first poll tick did another pass
  (its key of incoming/ was not known yet): the pass records it.
- A stop notes each lane's soonest job (locks/scanned, files only: a
  directory's key means the same to the next process) and the next start
  trusts it while the key is the same: no pass at all.  What changes the
  key (a job in, out), a schedule changed in place (a hold's release:
  Claims.due), the clock gone back, a kill (the note is taken at the
  start) each bring the pass back.
- SQLite's idx_jobs_ready has the id: the scan's ORDER BY available_at,
  id is the index's order, not a sort of the rows that share a time; a
  database made before gets it at a worker's start.
"""
import json
import os
import signal
import threading
import time

import pytest

from _core import count_ticks, quiet_log, sql, wait_for

DAY = 86400.0


def _worker(myq, spool, seen, scan_cache=4, **kw):
    def noop(job):
        seen.append(job["id"])
    kw.setdefault("log", quiet_log())
    return myq.Worker(spool, handlers={"noop": noop}, scan_cache=scan_cache,
                      poll=0.05, jitter=0, **kw)


def _passes(w):
    """Count the passes over incoming/ of worker w (a scan that starts one:
    no directory iterator open) in the list it returns."""
    claims = w.spool.claims
    real, n = claims.scan, []

    def scan(L, n_, tick):
        if L.sweep is None and L.sub == "incoming":
            n.append(L.sub)
        return real(L, n_, tick)
    claims.scan = scan
    return n


def _deep(myq, spool, n=40, delay=DAY):
    """n jobs not due for `delay` (scan_cache 4: a directory of more than
    16 is deep), put a while ago: incoming/'s time is not so recent that
    it proves nothing (Claims.change_key's racy)."""
    sp = myq.open_store(spool)
    try:
        return sp.enqueue_many([{"type": "noop", "payload": i, "delay": delay}
                                for i in range(n)])
    finally:
        sp.close()
        _settled(spool)


def _settled(spool):
    t = time.time() - 10
    os.utime(os.path.join(spool, "incoming"), (t, t))


def _drain(myq, spool, seen=None):
    """A `worker --drain` here: (its passes, the jobs it ran)."""
    seen = [] if seen is None else seen
    w = _worker(myq, spool, seen)
    n = _passes(w)
    assert w.run(drain=True) == 0
    w.spool.close()
    return len(n), seen


def _note(spool):
    return os.path.join(spool, "locks", "scanned")


def test_a_drain_reads_a_deep_spool_once(myq, spool):
    """Nothing due among 40 (a deep directory): one pass, not three (its
    first claim, the fresh look after it, the end's look)."""
    _deep(myq, spool)
    assert os.path.exists(os.path.join(spool, "locks")) and \
        not os.path.exists(_note(spool))
    passes, seen = _drain(myq, spool)
    assert seen == []
    assert passes == 1


def test_the_first_poll_tick_makes_no_second_pass(myq, spool):
    """A running worker on the same spool: its poll ticks find incoming/
    unchanged since its pass (the pass read the key): no pass again."""
    _deep(myq, spool)
    w = _worker(myq, spool, [])
    n = _passes(w)
    ticks = count_ticks(w)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(ticks) >= 4, timeout=20, what="four poll ticks")
    finally:
        w._on_stop(signal.SIGTERM, None)
        t.join(15)
    assert not t.is_alive()
    w.spool.close()
    assert len(n) == 1, n


@pytest.mark.files_only
def test_a_start_after_a_stop_that_changed_nothing_makes_no_pass(myq, spool):
    """The stop notes the soonest job; the next start takes it (and removes
    it: a worker killed leaves none), and notes it again at its stop."""
    jobs = _deep(myq, spool)
    assert _drain(myq, spool)[0] == 1
    with open(_note(spool)) as f:
        note = json.load(f)
    soonest = min(os.stat(os.path.join(spool, "incoming", j + ".json")).st_mtime
                  for j in jobs)
    assert note["lanes"]["incoming"][1] == pytest.approx(soonest, abs=1e-3)
    assert _drain(myq, spool) == (0, [])
    assert os.path.exists(_note(spool))


@pytest.mark.files_only
def test_a_job_in_after_the_stop_is_found(myq, spool):
    _deep(myq, spool)
    _drain(myq, spool)
    sp = myq.open_store(spool)
    jid = sp.enqueue("noop", "new")
    sp.close()
    _settled(spool)
    passes, seen = _drain(myq, spool)
    assert seen == [jid] and passes >= 1


@pytest.mark.files_only
def test_a_schedule_changed_in_place_is_found(myq, spool):
    """A hold's release makes its jobs due where they lie (Claims.due, a
    utime: the directory's key stays): the note goes, a pass finds it."""
    sp = myq.open_store(spool)
    jid = sp.enqueue("noop", "held")      # parked by a hold: its time is
    sp.close()                            # the file's, not the job's
    t = time.time() + DAY
    os.utime(os.path.join(spool, "incoming", jid + ".json"), (t, t))
    _deep(myq, spool)
    assert _drain(myq, spool) == (1, [])
    sp = myq.open_store(spool)
    sp.claims.due("incoming/%s.json" % jid, time.time())
    sp.close()
    assert not os.path.exists(_note(spool))
    passes, seen = _drain(myq, spool)
    assert seen == [jid] and passes >= 1


@pytest.mark.files_only
def test_the_clock_gone_back_since_the_stop_makes_a_pass(myq, spool):
    _deep(myq, spool)
    _drain(myq, spool)
    with open(_note(spool)) as f:
        note = json.load(f)
    note["at"] = time.time() + 3600       # the stop "an hour from now"
    with open(_note(spool), "w") as f:
        json.dump(note, f)
    assert _drain(myq, spool)[0] == 1


@pytest.mark.files_only
def test_a_running_worker_has_taken_the_note(myq, spool):
    """The note is the last stop's: taken at the start, so that a worker
    killed (which writes none) leaves none for the next."""
    _deep(myq, spool)
    _drain(myq, spool)
    seen = []
    w = _worker(myq, spool, seen)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: w.sched.me is not None, timeout=10, what="the start")
        assert not os.path.exists(_note(spool))
    finally:
        w._on_stop(signal.SIGTERM, None)
        t.join(15)
    w.spool.close()
    assert os.path.exists(_note(spool))


@pytest.mark.files_only
def test_a_bad_note_is_a_pass(myq, spool):
    _deep(myq, spool)
    _drain(myq, spool)
    for junk in (b"", b"{", b'{"at": 1, "lanes": {"incoming": 5}}', b"\x00" * 9):
        with open(_note(spool), "wb") as f:
            f.write(junk)
        assert _drain(myq, spool)[0] == 1


def test_the_ready_index_serves_the_scans_order(myq, spool, store):
    """(SQLite) idx_jobs_ready(queue, lane, available_at, id): no sort of
    the rows that share an available_at; an older database gets it at a
    worker's start."""
    if store != "sqlite":
        pytest.skip("the SQLite store's index")
    sp = myq.open_store(spool)
    sp.enqueue_many([{"type": "noop", "payload": i, "delay": DAY}
                     for i in range(30)])
    sp.close()
    sql(spool, "DROP INDEX idx_jobs_ready")
    sql(spool, "CREATE INDEX idx_jobs_ready ON jobs(queue, lane, "
        "available_at) WHERE status='ready'")

    def plan():
        import sqlite3
        db = sqlite3.connect(os.path.join(spool, "queue.db"))
        try:
            return " ".join(r[-1] for r in db.execute(
                "EXPLAIN QUERY PLAN SELECT available_at, id, updated_at FROM "
                "jobs WHERE queue=? AND status='ready' AND lane=? ORDER BY "
                "available_at, id LIMIT ?", ("spool", "incoming", 4)))
        finally:
            db.close()
    assert "TEMP B-TREE" in plan()
    assert _drain(myq, spool)[1] == []
    assert "TEMP B-TREE" not in plan() and "idx_jobs_ready" in plan()


def test_a_batchs_key_does_not_encode_the_body(myq, monkeypatch):
    """The slow flow's batches: http_group_key (twice a job in a batch:
    its claim, the send's check) reads the method, url and headers alone;
    the body is encoded once, in the batch's request."""
    calls = []
    real = myq.json.dumps

    def dumps(*a, **kw):
        calls.append(a)
        return real(*a, **kw)
    monkeypatch.setattr(myq.json, "dumps", dumps)
    job = {"id": "j1", "type": "fwd",
           "payload": {"url": "http://127.0.0.1:9/in", "body": {"n": 1}}}
    key = myq.http_group_key(job)
    assert calls == []
    assert key == myq.http_group_key(dict(job, id="j2"))
    assert myq.http_request(job)[2] == b'{"n":1}'
    with_type = dict(job, payload=dict(job["payload"], headers={
        "Content-Type": "text/csv"}))
    assert myq.http_group_key(with_type) != key


def test_no_holds_is_the_same_answer_at_each_poll_tick(myq, spool):
    """Without locks/held/ (no hold ever), the records are the same object
    at each look: a poll tick's _load_holds learns nothing new and lists
    nothing more (it listed held/ again for the streaks, an open each)."""
    sp = myq.open_store(spool)
    try:
        assert not os.path.exists(os.path.join(spool, "locks", "held"))
        first = sp.breaker.records()
        assert list(first) == [] and sp.breaker.records() is first
    finally:
        sp.close()


def test_a_batch_without_a_byte_limit_reads_no_sizes(myq, spool):
    """batch_bytes unset: a batch's jobs are claimed without asking each
    one's size first (a stat, or a query on SQLite: the slow flow's
    batches paid one a job for a limit they did not have); with it, the
    limit holds."""
    sp = myq.open_store(spool)
    sp.set_policy("b", {"batch": 10})
    sp.enqueue_many([{"type": "b", "payload": i} for i in range(10)])
    got = []
    w = myq.Worker(spool, handlers={"b": lambda jobs: got.append(len(jobs))},
                   log=quiet_log(), poll=0.05, jitter=0)
    sizes = []
    real = w.spool.claims.size

    def size(sub, name):
        sizes.append(name)
        return real(sub, name)
    w.spool.claims.size = size
    assert w.run(drain=True) == 0
    w.spool.close()
    assert got == [10] and sizes == []
    sp.set_policy("b", {"batch": 10, "batch_bytes": 300})
    sp.enqueue_many([{"type": "b", "payload": "x" * 100} for i in range(4)])
    sp.close()
    got[:] = []
    w = myq.Worker(spool, handlers={"b": lambda jobs: got.append(len(jobs))},
                   log=quiet_log(), poll=0.05, jitter=0)
    assert w.run(drain=True) == 0
    w.spool.close()
    assert sum(got) == 4 and max(got) < 4, got
