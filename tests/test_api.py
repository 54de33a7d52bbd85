"""The Python API is what myq(1) PYTHON API says: every method it names on
Spool exists, Spool has no public method it does not name, every name it
gives as the module's API is in myq.__all__; and the thin Spool hands each
call to its store, on either store."""
import re

import pytest

from _core import ROOT

import os


def _api_section():
    with open(os.path.join(ROOT, "build", "myq.1")) as f:
        man = f.read()
    return man.split(".SH PYTHON API", 1)[1].split("\n.SH ", 1)[0]


def _spool_paragraph():
    sec = _api_section()
    return sec.split("\\fBSpool(", 1)[1].split("\n.TP", 1)[0]


def _documented_methods():
    return set(re.findall(r"\\fB\.([a-z_]+)\(", _spool_paragraph()))


def test_every_spool_method_myq1_documents_exists_and_none_is_missing(myq):
    documented = _documented_methods()
    assert {"enqueue", "show", "list", "retry"} <= documented
    public = set(n for n, v in vars(myq.Spool).items()
                 if not n.startswith("_") and callable(v))
    assert not documented - public, "myq(1) documents Spool.%s, which " \
        "does not exist" % sorted(documented - public)
    assert not public - documented, "Spool.%s is not in myq(1) PYTHON API" \
        % sorted(public - documented)
    attrs = set(re.findall(r"\\fB\.([a-z_]+)\\fR", _spool_paragraph()))
    assert {"path", "store"} <= attrs


def test_the_names_myq1_gives_as_the_api_are_all_of_it(myq):
    named = set()
    for run in re.findall(r"\\fB(.*?)\\f", _api_section(), re.S):
        named |= set(re.findall(r"[A-Za-z_]+", run))
    assert not set(myq.__all__) - named
    for name in myq.__all__:
        assert hasattr(myq, name)


def test_the_thin_spool_hands_every_call_to_its_store(myq, spool):
    sp = myq.Spool(spool)
    assert isinstance(sp.store, myq.Store) and sp.path == sp.store.path
    assert sp.init() is sp
    jid = sp.enqueue("t", {"n": 1})
    ids = sp.enqueue_many([{"type": "t", "payload": 2}])
    assert sp.show(jid)["state"] == "ready"
    assert sorted(j["id"] for j in sp.list("ready")) == sorted([jid] + ids)
    assert sp.stats()["ready"] == 2 and sp.status_line()
    assert sp.check() == [] or isinstance(sp.check(), list)
    sp.delete(ids)
    assert [j["id"] for j in sp.list()] == [jid]
    sp.reap()
    sp.prune()
    with pytest.raises(myq.NoSuchJob):
        sp.show(ids[0])
    sp.close()
