"""The usual enqueue's steps, each asked only where it can say something:
what each must still do.  The depth of a payload is walked only where its
text is long enough to hold that many brackets and their closers; a deeper
one is still refused, the limit itself still taken, on both stores."""

import pytest

STORES = pytest.mark.parametrize("store", ["files", "sqlite"])


@STORES
def test_a_payload_nested_past_the_limit_is_refused_by_the_usual_enqueue(
        myq, spool, store):
    """The job object is level 1: a payload of MAX_DEPTH - 1 levels is the
    limit (taken), one of MAX_DEPTH (128 characters: the shortest text that
    deep) is refused, and so is anything deeper; brackets inside a string
    are no nesting (taken, however many)."""
    sp = myq.open_store(spool)
    n = myq.MAX_DEPTH - 1
    ok = sp.enqueue("t", myq._decode("[" * n + "]" * n))
    for n in (myq.MAX_DEPTH, myq.MAX_DEPTH + 1, 500):
        deep = myq._decode("[" * n + "]" * n)
        with pytest.raises(myq.InvalidJob, match="nested deeper"):
            sp.enqueue("t", deep)
        with pytest.raises(myq.InvalidJob, match="nested deeper"):
            sp.enqueue("t", {"k": deep})
    text = sp.enqueue("t", "[" * 100 + "{" * 100)
    assert sorted(j["id"] for j in sp.list("ready")) == sorted([ok, text])
    sp.close()
