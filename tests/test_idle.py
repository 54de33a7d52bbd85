"""An idle worker's work with thousands of waiting jobs of types it has no
handler for (8,000 such jobs once cost an idle worker 3-6 % of a core;
bench/idle.py measures the CPU itself).

Not a timing: the work of an idle poll is counted between two of the
worker's waits, in its thread, once every job was taken in and its type
held: the Python lines it runs (sys.settrace; a directory read through
_scandir is a line an entry), the names it lists (os.listdir, through
_listdir) and the SQLite store's virtual machine steps (a progress
handler), for a spool of a few such types and
for one of more than the 1,024 held types whose holds are recorded.  An
idle poll must cost the same whatever the number of waiting jobs.
"""
import os
import signal
import statistics
import sys
import threading
import time

import pytest

from _core import wait_for

STORES = ["files", "sqlite"]
POLLS = 40


def idle_poll_work(myq, path, n_types):
    """{what: (median, most)} of a real worker's idle polls (POLLS of
    them): "lines" run, names "listed", SQLite "steps" (in tens), with
    one job of each of `n_types` types waiting, none of which it has a
    handler for."""
    sp = myq.open_store(path)
    sp.enqueue_many([{"type": "u%05d" % i} for i in range(n_types)],
                    sync=False)
    held = [0]
    # backoff_base: the first probe of a held type 5 minutes away (none
    # while counted); stats_interval=0: no status line
    w = myq.Worker(sp, handlers={}, log=lambda ev, **kv: None, poll=0.02,
                   stats_interval=0, backoff_base=600, jitter=0)
    real_hold, real_wait, real_listdir = w.finish._hold, w._wait, myq._listdir

    def hold(run, why):
        held[0] += 1
        return real_hold(run, why)

    counting, polls = [None], []
    work = {"lines": 0, "listed": 0, "steps": 0}

    def tracer(frame, event, arg):
        if event == "line":
            work["lines"] += 1
        return tracer

    def listdir(path):
        names = real_listdir(path)
        if counting[0] == threading.get_ident():
            work["listed"] += len(names)
        return names

    def step():
        if counting[0] == threading.get_ident():
            work["steps"] += 1
        return 0

    def wait(busy):
        if counting[0] is True:
            counting[0] = threading.get_ident()
            sys.settrace(tracer)        # (the worker's thread only)
            if sp.store == "sqlite":
                sp._db().set_progress_handler(step, 10)
        elif counting[0]:
            polls.append(dict(work))
        for k in work:
            work[k] = 0
        return real_wait(busy)
    w.finish._hold, w._wait, myq._listdir = hold, wait, listdir
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: held[0] >= n_types, timeout=120,
                 what="every type held")
        # settled: no hold for 1.5 s (the holds' records are read again
        # until a look comes a second after their directory's last change)
        last = [None, 0.0]

        def settled():
            if held[0] != last[0]:
                last[0], last[1] = held[0], time.monotonic()
            return time.monotonic() - last[1] >= 1.5
        wait_for(settled, timeout=30, interval=0.05, what="an idle worker")
        assert held[0] == n_types, "a type held twice while idle"
        counting[0] = True
        wait_for(lambda: len(polls) >= POLLS, timeout=60,
                 what="%d idle polls" % POLLS)
        counting[0] = None
    finally:
        myq._listdir = real_listdir
        w._on_stop(signal.SIGTERM, None)
        t.join(30)
    assert not t.is_alive()
    sp.close()
    return dict((k, (statistics.median(p[k] for p in polls),
                     max(p[k] for p in polls))) for k in work)


@pytest.mark.parametrize("store", STORES, indirect=True)
def test_an_idle_polls_work_does_not_grow_with_jobs_of_types_without_a_handler(
        myq, spool, store, tmp_path):
    """70 types without a handler (past Worker.LANED, so some wait in their
    lanes and some parked in the queue's own directory or rows), then
    1,100 (past the 1,024 held types whose holds are recorded): an idle
    poll of the second costs what one of the first does, give or take
    (before: a pass over every held type at each poll, 3-6 % of a core
    with 8,000 of them)."""
    few = idle_poll_work(myq, spool, myq._Holds.LANED + 6)
    big = str(tmp_path / "big")
    myq.main(["--spool", big, "init", "--store", store])
    many = idle_poll_work(myq, big, 1100)
    for k in few:
        assert many[k][0] <= few[k][0] * 1.5 + 50, \
            "%s per idle poll (median, most): %s with 70 held types, %s " \
            "with 1,100" % (k, few[k], many[k])
    assert few["lines"][0] > 0


def test_the_holds_due_a_probe_are_the_others_and_none_is_missed(myq):
    """_Holds.until (a _HoldTimes) answers which held destinations have a
    probe due without a pass over the worker's own held types at each
    poll; a destination held, moved or released in place is seen."""
    own = dict(("t%d" % i, None) for i in range(2000))
    h = myq._HoldTimes((t, 100.0) for t in own)
    h["http://a/"] = 50.0
    assert list(h.due(10.0, own)) == []
    assert list(h.due(60.0, own)) == ["http://a/"]
    assert list(h.due(60.0, own)) == ["http://a/"]    # not probed: due again
    h["http://a/"] = 80.0                       # probed: due later
    assert list(h.due(70.0, own)) == []
    h["http://b/"] = 20.0                       # a new hold, due sooner
    assert list(h.due(70.0, own)) == ["http://b/"]
    h.pop("http://b/")
    assert list(h.due(90.0, own)) == ["http://a/"]
    h.pop("t5")
    del own["t5"]
    h["t5"] = 30.0                              # its own again: never here
    own["t5"] = None
    assert list(h.due(1000.0, own)) == ["http://a/"]
    del h["http://a/"]
    assert list(h.due(1000.0, own)) == []
    h["mqtt://c"] = 5.0
    assert list(h.due(1000.0, own)) == ["mqtt://c"]
    assert dict(h) == dict(myq._HoldTimes(h))


@pytest.mark.parametrize("store", STORES, indirect=True)
def test_a_held_types_probe_puts_its_job_back_unwritten(myq, spool, store):
    """A probe of a type held for its missing handler that finds it still
    missing puts the job back as it was (a hold writes nothing per
    waiting job): before, each probe wrote and fsync'd a new version of
    it, 64 lanes' worth every 5 s, 10 s, ... (most of an idle worker's
    work once its pass over the holds was gone)."""
    import glob
    import sqlite3
    sp = myq.open_store(spool)
    jid = sp.enqueue("nohandler", {"n": 1})
    held = [0]
    w = myq.Worker(sp, handlers={}, log=lambda ev, **kv: None, poll=0.05,
                   stats_interval=0, backoff_base=0.01, jitter=0)
    real_hold = w.finish._hold

    def hold(run, why):
        real_hold(run, why)
        held[0] += 1
    w.finish._hold = hold

    def looks():
        if store == "sqlite":
            db = sqlite3.connect(os.path.join(spool, "queue.db"))
            try:
                return db.execute(
                    "SELECT status, lane, attempts, last_error, updated_at, "
                    "extra FROM jobs WHERE id=?", (jid,)).fetchall()
            finally:
                db.close()
        paths = glob.glob(os.path.join(spool, "incoming", "lanes", "*",
                                       jid + ".json"))
        assert len(paths) == 1, paths
        with open(paths[0], "rb") as f:
            return paths[0], os.stat(paths[0]).st_ino, f.read()
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: held[0] >= 1, timeout=15, what="the type held")
        first = looks()
        # its probes: 1 s, then 2 s after
        wait_for(lambda: held[0] >= 3, timeout=15, what="two probes")
        again = looks()
    finally:
        w._on_stop(signal.SIGTERM, None)
        t.join(10)
    assert not t.is_alive()
    assert again == first
    assert sp.show(jid)["attempts"] == 0


@pytest.mark.parametrize("store", STORES, indirect=True)
def test_the_rates_of_thousands_of_types_are_not_compacted_at_every_turn(
        myq, spool, store):
    """locks/rates with an arrival of each of 5,000 types stays past 64 KiB
    once compacted (a line per 10 s, kind and type): it was compacted
    again at each of the worker's turns (every 10 s), for nothing; now
    again only once it doubled, or a minute later."""
    sp = myq.open_store(spool)
    path = os.path.join(spool, "locks", "rates")
    now = int(time.time())
    with open(path, "ab") as f:
        for i in range(5000):
            f.write(b"%d a u%05d 1 100\n" % (now - i % 7, i))
    sp.budget.compact_rates()
    first = os.stat(path)
    assert first.st_size > 65536, first.st_size
    sp.budget.compact_rates()
    assert os.stat(path).st_ino == first.st_ino, "compacted again at once"
    sp.budget.compact_rates(now=time.time() + 61)
    assert os.stat(path).st_ino != first.st_ino, "expired lines kept for ever"
