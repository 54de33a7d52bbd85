"""A store is objects, not mixins: it holds its producer, reader, upkeep,
claims, budget and holds' records (the SQLite store its database too), each
making its own state in its own __init__; a file store object keeps few
enough attributes that CPython shares its dict's keys (the worker reads
the store at every turn)."""
import os

import pytest


def test_a_store_inherits_only_the_contract(myq):
    assert myq.FileStore.__mro__ == (myq.FileStore, myq._DirStore, myq.Store,
                                     object)
    assert myq.SqlStore.__mro__ == (myq.SqlStore, myq._DirStore, myq.Store,
                                    object)
    for part in (myq.Producer, myq.Reader, myq.Upkeep, myq._SqlDb):
        assert part.__mro__[-1] is object and myq.Store not in part.__mro__


@pytest.mark.parametrize("store", ["files", "sqlite"])
def test_each_part_is_its_own_object_given_the_store(myq, tmp_path, store):
    path = str(tmp_path / "s")
    myq.open_store(path).init(store=store)
    sp = myq.open_store(path)
    parts = [sp.producer, sp.reader, sp.upkeep, sp.claims, sp.budget,
             sp.breaker] + ([sp.db] if store == "sqlite" else [])
    assert len(set(map(id, parts))) == len(parts)
    for part in (sp.producer, sp.reader, sp.upkeep) + (
            (sp.db,) if store == "sqlite" else ()):
        assert part.store is sp and part is not sp
    assert isinstance(sp.reader, sp.READER) and isinstance(sp.upkeep, sp.UPKEEP)
    jid = sp.enqueue("t", {"n": 1})
    assert sp.show(jid)["state"] == "ready"
    assert sp.delete([jid]) == 1


def test_a_file_store_keeps_at_most_30_attributes(myq, tmp_path):
    """Past 30, CPython 3.11+ stops sharing the keys of an instance's dict
    and every attribute the worker reads of its store costs more (0.7 %
    more instructions a drained job, make bench-cpu)."""
    path = str(tmp_path / "s")
    myq.open_store(path).init()
    mod = tmp_path / "h.py"
    mod.write_text("def t(job):\n    pass\n")
    myq.enqueue(path, "t", 1)
    w = myq.Worker(path, module=str(mod), log=myq.Log(
        path=os.path.join(path, "log")))
    assert w.run(drain=True) == 0
    assert len(vars(w.spool)) <= 30, sorted(vars(w.spool))
    assert len(vars(myq.open_store(path))) <= 30
