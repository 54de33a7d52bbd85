"""The slow flow costs what it sends (bench/flow.py): what a
worker does at a producer's poke while a batch waits out its batch_wait,
and what its start costs on a deep spool.  Mechanisms, never timings:
scans counted through the worker's _rescan, checks through the SQLite
store's _quick_check; bench/flow.py measures the CPU."""
import os
import signal
import threading

import pytest

import myq as _myq
from _core import wait_for


@pytest.fixture(params=["files", "sqlite"])
def flow_spool(tmp_path, request):
    path = str(tmp_path / "spool")
    _myq.main(["--spool", path, "init", "--store", request.param])
    return path


def _counting(w):
    """Count the worker's scans and its looks at a poke (_sync_lanes)."""
    n = {"scans": 0, "looks": 0}
    s = w.sched
    rescan, sync = s._rescan, s._sync_lanes

    def counted_rescan(lane=None):
        n["scans"] += 1
        n.setdefault("lanes", []).append((lane or s._top).sub)
        return rescan(lane)

    def counted_sync(fresh=False):
        n["looks"] += 1
        return sync(fresh)
    s._rescan, s._sync_lanes = counted_rescan, counted_sync
    return n


def _run(w):
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    return t


def _stop(w, t):
    w._on_stop(signal.SIGTERM, None)
    sp = _myq.open_store(w.spool.path)
    sp.poke()
    t.join(15)
    assert not t.is_alive(), "the worker did not stop"


def test_pokes_while_a_batch_waits_are_not_sent_nor_scanned(flow_spool):
    """A steady producer while the type's batch waits out batch_wait: the
    worker hushes the lane (locks/quiet/LANE), its producers send no poke
    and it makes no scan until the batch starts; the old worker woke and
    scanned incoming/ at each arrival (9.6 scans a delivered
    reading).  Another type's job (priority 9) is still poked for and
    starts at once; the batch, when it starts, has every job that came
    without a poke; a stopped worker leaves no mark."""
    import time
    sp = _myq.open_store(flow_spool)
    sp.set_policy("fwd", {"batch": 100, "batch_wait": 8.0})
    sp.set_policy("alarm", {"priority": 9})
    got, alarms = [], []
    w = _myq.Worker(flow_spool, handlers={"fwd": lambda jobs: got.append(jobs),
                                          "alarm": lambda job: alarms.append(job)},
                    log=_myq.Log(path=os.devnull), poll=3600.0)
    n = _counting(w)
    mark = os.path.join(flow_spool, "locks", "quiet", "fwd@0")
    t0 = time.monotonic()
    sp.enqueue("fwd", {"n": 0})
    t = _run(w)
    try:
        assert wait_for(lambda: os.path.exists(mark), what="the lane hushed")
        before = dict(n)
        for i in range(1, 21):
            sp.enqueue("fwd", {"n": i})
        sp.enqueue("alarm", {"fire": True})
        assert wait_for(lambda: alarms, timeout=20, what="the alarm started")
        if time.monotonic() - t0 < 8.0:
            assert not got, "the batch did not wait out its batch_wait"
        # (the alarm's lane is new: the lanes looked at again, a scan or
        # two of it and of incoming/, which changed within the kernel's
        # granularity when the lane was made)
        assert n["looks"] - before["looks"] <= 4, (before, n)
        assert n["scans"] - before["scans"] <= 4, (before, n)
        assert wait_for(lambda: got, timeout=30, what="the batch")
        assert [len(b) for b in got] == [21]
    finally:
        _stop(w, t)
    assert not os.path.exists(mark)


def _checks(monkeypatch):
    n = [0]
    real = _myq.SqlStore._quick_check

    def counted(self):
        n[0] += 1
        return real(self)
    monkeypatch.setattr(_myq.SqlStore, "_quick_check", counted)
    return n


def test_sqlite_checks_the_database_after_an_unclean_stop_only(tmp_path, monkeypatch):
    """PRAGMA quick_check reads every page (308 M instructions at 100,000
    rows): a worker runs it at its start only when the last stop was not
    clean (no locks/db-clean: a first start, a kill -9, a power cut); a
    worker that stops cleanly leaves the mark, and the next start skips
    the check.  A damaged database is still found there (test_sqlite)."""
    path = str(tmp_path / "s")
    _myq.main(["--spool", path, "init", "--store", "sqlite"])
    sp = _myq.open_store(path)
    sp.enqueue_many([{"type": "noop", "payload": i} for i in range(20)])
    n = _checks(monkeypatch)
    mark = os.path.join(path, "locks", "db-clean")

    def drain():
        w = _myq.Worker(path, handlers={"noop": lambda job: None},
                        log=_myq.Log(path=os.devnull))
        assert w.run(drain=True) == 0

    drain()                                 # never stopped cleanly: checked
    assert n[0] == 1 and os.path.exists(mark)
    sp.enqueue("noop", {})
    drain()                                 # a clean stop before: not checked
    assert n[0] == 1 and os.path.exists(mark)
    # a worker killed (its start removed the mark; its record stays)
    import subprocess

    from _core import myq_argv, clean_env
    proc = subprocess.Popen(myq_argv() + ["--spool", path, "worker"],
                            env=clean_env(), stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: os.listdir(os.path.join(path, "locks", "workers")),
                 what="the worker's record")
        assert not os.path.exists(mark)
    finally:
        proc.kill()
        proc.wait()
    drain()                                 # after the kill: checked again
    assert n[0] == 2, n


def test_sqlite_finds_claimed_rows_without_a_pass_over_the_table(tmp_path):
    """The start's reap and the heartbeat ask for the claimed rows: a
    partial index of them (idx_jobs_claimed), not a pass over every row
    (15 ms at 100,000 waiting); a database made before it gets it at a
    worker's start."""
    import sqlite3
    path = str(tmp_path / "s")
    _myq.main(["--spool", path, "init", "--store", "sqlite"])
    db = sqlite3.connect(os.path.join(path, "queue.db"))
    db.execute("DROP INDEX idx_jobs_claimed")
    db.commit()
    db.close()
    w = _myq.Worker(path, handlers={}, log=_myq.Log(path=os.devnull))
    assert w.run(drain=True) == 0
    db = sqlite3.connect(os.path.join(path, "queue.db"))
    try:
        plan = db.execute("EXPLAIN QUERY PLAN SELECT id, worker_id, token FROM "
                          "jobs WHERE status='processing'").fetchall()
        assert "idx_jobs_claimed" in str(plan), plan
    finally:
        db.close()
