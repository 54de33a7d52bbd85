"""The store contract: Store names every operation a store has; the file
store and the SQLite store each implement it, neither inheriting the
other; the SQLite store's drop box (a producer that may not write
queue.db) places its files as the file store does, by either way of
writing them."""
import os

import pytest

import _core


def test_each_store_implements_the_contract_and_neither_inherits_the_other(myq):
    for name, cls in myq._STORES.items():
        assert issubclass(cls, myq.Store) and cls.store == name
        missing = [m for m, f in vars(myq.Store).items()
                   if callable(f) and not m.startswith("__")
                   and m != "_abstract" and getattr(cls, m) is f]
        assert not missing, "%s does not implement %s" % (name, missing)
    assert not issubclass(myq.SqlStore, myq.FileStore)
    assert not issubclass(myq.FileStore, myq.SqlStore)


@pytest.mark.parametrize("tmpfile", [True, False])
def test_the_sqlite_drop_box_enqueues_by_either_way(myq, tmp_path, monkeypatch,
                                                    tmpfile):
    """A producer of the spool's group writes files into incoming/; where
    O_TMPFILE is refused they go through tmp/ and are checked as the file
    store checks them (the SQLite store's own _placed, of rows, once took
    that call and failed with a TypeError)."""
    path = str(tmp_path / "spool")
    myq.main(["--spool", path, "init", "--store", "sqlite"])
    if not tmpfile:
        monkeypatch.setattr(myq, "_TMPFILE", 0)
    sp = myq.Spool(path)
    sp._writer = False          # (as a producer that may not write queue.db)
    jid = sp.enqueue("t", {"a": 1}, id="j1")
    assert jid == "j1" and os.path.exists(os.path.join(path, "incoming",
                                                       "j1.json"))
    assert sp.show("j1")["state"] == "ready"
