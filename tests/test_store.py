"""The store contract: Store names every operation a store has (Claims
its claims', Budget its budget's); the file store and the SQLite store
each implement it, neither inheriting the other; the SQLite store's drop box (a producer that may not write
queue.db) places its files as the file store does, by either way of
writing them."""
import os

import pytest

import _core


_abstract = compile("", "", "exec")      # (what has no code calls nothing)


def _unimplemented(contract, cls):
    """The contract's abstract operations (those that call _abstract) that
    `cls` leaves as they are."""
    return [m for m, f in vars(contract).items()
            if "_abstract" in getattr(getattr(f, "__func__", f), "__code__",
                                      _abstract).co_names
            and getattr(cls, m, f) is f]


def test_each_store_implements_the_contract_and_neither_inherits_the_other(myq):
    """Store's and Claims' every operation, implemented by each store
    _STORES knows (a third one registers there), the worker's calls
    (spool.claims.X) among them."""
    assert len(myq._STORES) >= 2 and len(_unimplemented(myq.Store, object)) > 25
    assert len(_unimplemented(myq.Upkeep, object)) == 3
    for name, cls in myq._STORES.items():
        assert issubclass(cls, myq.Store) and cls.store == name
        assert not _unimplemented(myq.Store, cls), name
        assert issubclass(cls.READER, myq.Reader)
        assert issubclass(cls.UPKEEP, myq.Upkeep)
        assert not _unimplemented(myq.Upkeep, cls.UPKEEP), name
        assert issubclass(cls.CLAIMS, myq.Claims)
        assert not _unimplemented(myq.Claims, cls.CLAIMS), name
        assert issubclass(cls.BUDGET, myq.Budget)
        assert not _unimplemented(myq.Budget, cls.BUDGET), name
    assert not issubclass(myq.SqlStore, myq.FileStore)
    assert not issubclass(myq.FileStore, myq.SqlStore)
    assert not issubclass(myq._SqlClaims, myq.FileClaims)
    assert not issubclass(myq.SqlBudget, myq.FileBudget)


def test_the_contract_raises_for_what_a_store_leaves_out(myq):
    class Half(myq.Store):
        store = "half"
    with pytest.raises(NotImplementedError):
        Half().enqueue("t")
    with pytest.raises(NotImplementedError):
        myq.Claims(Half()).scan(None, 1, 0)


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
    sp = myq.Spool(path).store
    sp.rows._writer = False     # (as a producer that may not write queue.db)
    jid = sp.enqueue("t", {"a": 1}, id="j1")
    assert jid == "j1" and os.path.exists(os.path.join(path, "incoming",
                                                       "j1.json"))
    assert sp.show("j1")["state"] == "ready"
