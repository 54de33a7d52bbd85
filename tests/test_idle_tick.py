"""The idle worker's poll tick: it does the cheap looks alone (an idle
worker is to cost at most 0.05 % of a core), and keeps every promise of
a tick.

- The door's descriptors are not closed and opened again at each tick
  (three closes, three opens, four fstats): each is looked at by one
  stat of its name (_Door.recheck), and a directory replaced, or whose
  owner or mode changed, is opened and checked again as before.
"""
import os
import shutil
import signal
import threading

from _core import count_ticks, quiet_log, wait_for, write_incoming


def _door(myq, spool):
    sp = myq.open_store(spool)
    sp.fs.kept += 1         # (a worker's: kept between calls)
    return sp, sp.fs


def test_a_tick_keeps_the_descriptors_of_directories_unchanged(myq, spool):
    sp, door = _door(myq, spool)
    fds = dict((sub, door(sub)) for sub in ("", "incoming", "locks"))
    assert door.recheck() and door.recheck()
    assert door.fds == fds
    door.kept -= 1
    sp.close()


def test_a_directory_no_tick_uses_is_opened_again_after_a_tick(myq, spool):
    """done/ (a tick does not look into it: not rechecked) replaced while
    its descriptor was kept: after the tick, the new one is used."""
    sp, door = _door(myq, spool)
    door("incoming")
    old = os.fstat(door("done")).st_ino
    done = os.path.join(spool, "done")
    os.rename(done, done + ".old")
    os.mkdir(done, 0o750)
    assert door.recheck()
    assert "done" not in door.fds and "incoming" in door.fds
    assert os.fstat(door("done")).st_ino == os.stat(done).st_ino != old
    door.kept -= 1
    sp.close()


def test_a_directory_replaced_is_opened_again_at_the_next_tick(myq, spool):
    sp, door = _door(myq, spool)
    old = os.fstat(door("locks")).st_ino
    inc = os.path.join(spool, "locks")
    os.rename(inc, inc + ".old")
    shutil.copytree(inc + ".old", inc, symlinks=True, ignore=lambda d, n: [
        x for x in n if x == "wake"])
    assert not door.recheck()
    assert door.fds == {}
    assert os.fstat(door("locks")).st_ino == os.stat(inc).st_ino != old
    door.kept -= 1
    sp.close()


def test_the_spool_replaced_is_opened_again_at_the_next_tick(myq, spool):
    sp, door = _door(myq, spool)
    door("incoming")
    os.rename(spool, spool + ".old")
    os.mkdir(spool, 0o750)
    assert not door.recheck()
    assert door.fds == {}
    door.kept -= 1
    sp.close()


def test_a_mode_made_writable_by_others_is_checked_again(myq, spool):
    """locks/ made writable by others under a kept descriptor: the tick
    sees the change, the next use checks it again (and, the owner's,
    takes the others' write bit away)."""
    sp, door = _door(myq, spool)
    locks = os.path.join(spool, "locks")
    door("locks")
    os.chmod(locks, 0o777)
    assert not door.recheck()
    door("locks")
    assert os.stat(locks).st_mode & 0o022 == 0
    assert door.recheck()
    door.kept -= 1
    sp.close()


def _idle_worker(myq, spool, seen):
    def t(job):
        seen.append(job["id"])
    w = myq.Worker(spool, handlers={"t": t}, poll=0.05, jitter=0,
                   stats_interval=0, log=quiet_log())
    ticks = count_ticks(w)
    th = threading.Thread(target=w.run, daemon=True)
    th.start()
    return w, th, ticks


def _stop(w, th):
    w._on_stop(signal.SIGTERM, None)
    th.join(15)
    assert not th.is_alive()
    w.spool.close()


def test_incoming_replaced_under_an_idle_worker_is_looked_into(myq, spool):
    """incoming/ moved away and made again while the worker idles, then a
    shell producer's file dropped there (no poke): the worker's tick
    finds the new directory and runs the job (through the old
    descriptor it would never see it)."""
    seen = []
    w, th, ticks = _idle_worker(myq, spool, seen)
    try:
        wait_for(lambda: len(ticks) >= 3, what="three poll ticks")
        inc = os.path.join(spool, "incoming")
        os.rename(inc, inc + ".old")
        os.mkdir(inc, 0o750)
        os.mkdir(os.path.join(inc, "lanes"), 0o750)
        write_incoming(spool, "j1.json", {"type": "t", "payload": 1})
        wait_for(lambda: seen == ["j1"], what="the job dropped in the new incoming/")
    finally:
        _stop(w, th)


# No held/ yet: locks/'s key says so (a stat, not a failed open) ##############

def _hold(myq, dest):
    now = myq._now()
    return {"dest": dest, "why": "test", "since": round(now, 3),
            "until": round(now + 3600, 3), "probes": 0, "boot": myq.boot_id()}


def test_a_hold_written_after_looks_that_found_none_is_read(myq, spool):
    """records() found no locks/held/ (twice: the second by locks/'s key
    alone); another process's first hold then is read at the next look."""
    sp = myq.open_store(spool)
    other = myq.open_store(spool)
    os.utime(os.path.join(spool, "locks"), (1e9, 1e9))   # (not racy)
    assert sp.breaker.records() == () and sp.breaker.records() == ()
    other.breaker.write(_hold(myq, "http://down:80"))
    assert [h["dest"] for h in sp.breaker.records()] == ["http://down:80"]
    other.close()
    sp.close()


def test_another_workers_hold_is_seen_by_an_idle_worker_within_a_tick(myq, spool):
    seen = []
    w, th, ticks = _idle_worker(myq, spool, seen)
    try:
        wait_for(lambda: len(ticks) >= 3, what="three poll ticks")
        other = myq.open_store(spool)
        other.breaker.write(_hold(myq, "http://down:80"))
        other.close()
        wait_for(lambda: "http://down:80" in w.holds.until,
                 what="the other worker's hold")
    finally:
        _stop(w, th)


def test_a_run_after_one_that_ended_at_rest_claims_at_once(myq, spool):
    """The same Worker run again (--once) after a run that ended idle, at
    rest: its first look claims, as a fresh worker's would."""
    seen = []
    w, th, ticks = _idle_worker(myq, spool, seen)
    wait_for(lambda: len(ticks) >= 3 and w._rest, what="a worker at rest")
    w._on_stop(signal.SIGTERM, None)
    th.join(15)
    assert not th.is_alive()
    w.stopping = False
    w.spool.enqueue("t", 1, id="j1")
    assert w.run(once=True) == 0
    assert seen == ["j1"]
    w.spool.close()
