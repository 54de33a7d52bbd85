"""The usual enqueue: the SQLite store's usual enqueue asks its type's
rules once per type and policy and spells out the disk guard, the budget,
the wake-up and the arrival for one job (_SqlProducer.usual, insert_usual).
What it must still do as the general way does: refuse on a real full disk
at the point where the guard's figure runs out, and within a second of
another writer filling it; see a policy change; charge a budget; wake a
worker."""

import os

import pytest

from _core import fill_disk, ls

STORES = pytest.mark.parametrize("store", ["files", "sqlite"])


def _free(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_frsize


def _queued(myq, spool):
    sp = myq.open_store(spool)
    try:
        return sorted(j["id"] for j in sp.list("ready"))
    finally:
        sp.close()


def _guarded(myq, small_tmpfs, store, monkeypatch):
    """(mnt, spool, clock, store): a spool of `store` on a 4 MiB tmpfs
    of its own, open with --min-free 1 MiB, on a monotonic clock that
    moves only when the test moves clock[0]."""
    mnt = small_tmpfs("4m")
    spool = os.path.join(mnt, "spool")
    myq.main(["--spool", spool, "init", "--store", store])
    clock = [1000.0]
    monkeypatch.setattr(myq, "_mono", lambda: clock[0])
    return mnt, spool, clock, myq.open_store(spool, min_free=1 << 20)


@STORES
def test_the_guard_refuses_where_its_figure_runs_out_on_a_real_tmpfs(
        myq, small_tmpfs, store, monkeypatch):
    """A 4 MiB tmpfs, --min-free 1 MiB, the clock stopped (no second
    passes: statvfs is asked again only when the jobs since could have
    used what it saw free): jobs are taken until the guard refuses, and
    it refuses where the disk really has no room for one more beyond the
    reserve -- not before, and not in a SQLite error."""
    mnt, spool, clock, sp = _guarded(myq, small_tmpfs, store, monkeypatch)
    payload = "x" * 300
    first = sp.enqueue("t", payload)            # (the database's files made)
    free, block = _free(spool)
    # the rest taken by another writer: room for a few jobs beyond the reserve
    room = (1 << 20) + 3 * (400 + block)
    with open(os.path.join(mnt, "filler"), "wb") as f:
        f.write(b"\0" * ((free - room) // block * block))
    clock[0] += 1.0                             # (the filler seen)
    ids = [first]
    with pytest.raises(myq.SpoolFull) as e:
        for i in range(100):
            ids.append(sp.enqueue("t", payload))
    assert "free on the spool's filesystem" in str(e.value), e.value
    size = len(myq.dumps(myq.new_job("t", payload)))
    left = _free(spool)[0] - (1 << 20)
    assert left < size + block + 8             # no room for one more: refused
    assert len(ids) - 1 >= 3                    # ... after those that fitted
    # and the reserve kept but for a block: the guard counts the jobs (their
    # bytes and a block each), not the producer's line in locks/rates
    assert left >= -block
    assert _queued(myq, spool) == sorted(ids)
    sp.close()


@STORES
def test_another_writer_filling_the_disk_is_seen_within_a_second(
        myq, small_tmpfs, store, monkeypatch):
    """The guard's figure says there is room (read a moment ago), and
    another writer takes the disk below the reserve: the next job may go
    (the reserve holds it), within the second; once a second has passed,
    the guard reads the disk again and refuses; the filler gone, it
    takes jobs again at once (a refusal keeps no figure)."""
    mnt, spool, clock, sp = _guarded(myq, small_tmpfs, store, monkeypatch)
    ids = [sp.enqueue("t", i) for i in range(3)]        # figure: ~2 MiB room
    free, block = _free(spool)
    filler = os.path.join(mnt, "filler")
    with open(filler, "wb") as f:                       # half the reserve left
        f.write(b"\0" * ((free - (1 << 19)) // block * block))
    ids.append(sp.enqueue("t", 3))              # within the second: its figure
    clock[0] += 1.0
    with pytest.raises(myq.SpoolFull, match="free on the spool's filesystem"):
        sp.enqueue("t", 4)
    os.unlink(filler)
    ids.append(sp.enqueue("t", 5))              # the same second: read again
    assert _queued(myq, spool) == sorted(ids)
    # a disk full to the last block: refused, never a job half-written
    fill_disk(filler)
    clock[0] += 1.0
    with pytest.raises(myq.SpoolFull):
        sp.enqueue("t", 6)
    os.unlink(filler)
    assert _queued(myq, spool) == sorted(ids)
    assert ls(spool, "tmp") == []
    sp.close()


@STORES
def test_a_policy_set_after_the_first_job_holds_for_the_next(
        myq, spool, store, monkeypatch):
    """What the usual enqueue learnt of a type (no bound, no budget) holds
    until the policy changes: another process's budget and bound are
    obeyed once the policy is looked at again (a second later, as ever)."""
    from _core import call_myq
    clock = [1000.0]
    monkeypatch.setattr(myq, "_mono", lambda: clock[0])
    sp = myq.open_store(spool)
    sp.enqueue("t", 1)
    sp.enqueue("b", 1)
    for args in (("--budget", "300K"), ("b", "max_queued=1")):
        cp = call_myq("--spool", spool, "policy", *args)
        assert cp.returncode == 0, cp.stderr
    clock[0] += 1.0
    sp.enqueue("b", 2)                          # (in its lane now)
    with pytest.raises(myq.SpoolFull, match="max_queued"):
        sp.enqueue("b", 3)
    n = 0
    with pytest.raises(myq.SpoolFull, match="budget"):
        while n < 300:                          # 300 * 3 KB: far past it
            sp.enqueue("t", "x" * 3000)
            n += 1
    assert 0 < n < 300
    sp.close()


def test_the_length_of_a_times_repr_without_repr(myq):
    """_time_repr_len (the usual enqueue's size of its job's file) is
    len(repr(t)) for every time: random ones of these years, ones of few
    decimals (whole seconds, ms, us), the ends of its range and beyond."""
    import random
    rnd = random.Random(42)
    times = [rnd.uniform(2.0 ** 30, 2.0 ** 31) for _ in range(20000)]
    for d in (1, 10, 1000, 10 ** 6, 10 ** 7, 2 ** 22):
        times += [rnd.randrange(2 ** 30 * d, 2 ** 31 * d) / d for _ in range(3000)]
    times += [2.0 ** 30, 2.0 ** 31 - 2.0 ** -22, 2.0 ** 31, 2.0 ** 30 - 1e-7,
              1765090000.9999999, 0.0, -1.5, 1e-9, 123.456, 1e10 + 0.1, 9.5e10]
    assert [t for t in times if myq._time_repr_len(t) != len(repr(t))] == []
