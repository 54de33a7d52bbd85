"""A SQLite worker's start on a full disk after a clean stop (the
start's own work met the reserve, locks/room): the start skips quick_check
after a clean stop (locks/db-clean), and so its first open of the
database -- the log's index, -shm, made again at the first open after the
last close -- moved to the worker record's registration, which swallowed
the full disk's error: the reserve was never given back and the worker
exited 75.  The first open is check_filesystem's again, where the worker
gives its reserve back (make_space) before any write that needs room; a
full disk's error is never swallowed on the way.  The drain itself on a
full disk: test_field's test_a_worker_starts_and_drains_on_a_full_disk."""
import errno
import os

import pytest

import myq
from _core import fill_disk


@pytest.fixture
def tiny_fs(small_tmpfs):
    return small_tmpfs("1m")


def _quiet_worker(path, min_free=0):
    return myq.Worker(path, handlers={"t": lambda job: None},
                      log=myq.Log(path=os.devnull), min_free=min_free)


def test_a_clean_stops_next_start_meets_the_full_disk_before_its_writes(tiny_fs):
    """After a clean stop (the mark), on a full disk: check_filesystem
    still opens the database (no row read) and says ENOSPC there, the
    reserve given back lets it open, and a worker then starts and drains
    with the reserve gone, the mark's removal and its record written after
    (it returned early, and the open failed later, in the record's mark)."""
    path = os.path.join(tiny_fs, "spool")
    assert myq.main(["--spool", path, "init", "--store", "sqlite"]) == 0
    sp = myq.open_store(path, min_free=0)
    try:
        sp.enqueue("t", 1, id="a1")
        w = _quiet_worker(path)
        assert w.run(drain=True) == 0
        w.spool.close()
        assert os.path.exists(os.path.join(path, "locks", "db-clean"))
        assert os.path.exists(os.path.join(path, "locks", "room"))
        sp.enqueue("t", 2, id="a2")
    finally:
        sp.close()
    fill_disk(os.path.join(tiny_fs, "filler"))
    assert os.statvfs(path).f_bavail == 0
    sp = myq.open_store(path)
    try:
        with pytest.raises(OSError) as e:
            sp.check_filesystem()
        assert e.value.errno == errno.ENOSPC, e.value
    finally:
        sp.close()
    assert os.path.exists(os.path.join(path, "locks", "room"))
    w = _quiet_worker(path, min_free=65536)
    try:
        assert w.run(drain=True) == 0
        assert not os.path.exists(os.path.join(path, "locks", "room"))
        assert w.spool.show("a2")["state"] == "done"
    finally:
        w.spool.close()


def test_the_start_s_mark_gives_back_a_full_disk_s_error(tmp_path, monkeypatch):
    """mark_clean(False), the start's removal of the mark (and the index
    it makes in an older database): a full disk's error goes to the
    worker's start, which gives the reserve back and tries again; it was
    swallowed as 'out of reach', the reserve kept."""
    path = str(tmp_path / "s")
    assert myq.main(["--spool", path, "init", "--store", "sqlite"]) == 0
    sp = myq.open_store(path)
    full = [2]

    def one(self, sql, args=()):
        if full[0]:
            full[0] -= 1
            raise myq._DbFull(errno.ENOSPC, "queue.db: database or disk is full")
        return real(self, sql, args)
    real = myq._SqlDb.one
    monkeypatch.setattr(myq._SqlDb, "one", one)
    sp = myq.open_store(path)       # (its handles on the patched statement)
    with pytest.raises(OSError) as e:
        sp.mark_clean(False)
    assert e.value.errno == errno.ENOSPC
    sp.close()
    # the worker's start: the reserve given back, the record made after
    assert os.path.exists(os.path.join(path, "locks", "room"))
    w = _quiet_worker(path)
    assert w.run(drain=True) == 0
    w.spool.close()
    assert full[0] == 0
    assert not os.path.exists(os.path.join(path, "locks", "room")) or \
        w.spool.free_problem() is None     # (set aside again: room enough)
