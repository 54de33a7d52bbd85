"""The usual enqueue's steps, each asked only where it can say something:
what each must still do.  The depth of a payload is walked only where its
text is long enough to hold that many brackets and their closers; a deeper
one is still refused, the limit itself still taken, on both stores.  The
wake-up is sent where a worker may listen: one that sleeps is woken by
each job."""

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


@STORES
def test_a_worker_asleep_for_an_hour_is_woken_by_each_usual_enqueue(
        myq, spool, store):
    """The usual enqueue pokes where a worker may listen: a worker whose
    --poll is an hour, idle, takes each job as it comes, one after the
    other (a producer that has not looked for a listener yet: a new
    process's)."""
    import signal
    import threading
    from _core import listening, wait_for
    done = []
    w = myq.Worker(myq.open_store(spool), handlers={"t": done.append},
                   log=lambda ev, **kv: None, poll=3600.0, stats_interval=0)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: listening(spool), what="the worker listening")
        for k in list(myq._UNHEARD):
            del myq._UNHEARD[k]
        producer = myq.open_store(spool)
        for i in range(3):
            producer.enqueue("t", {"n": i})
            wait_for(lambda: len(done) == i + 1, what="job %d taken" % i)
        assert [j["payload"] for j in done] == [{"n": 0}, {"n": 1}, {"n": 2}]
        producer.close()
    finally:
        w._on_stop(signal.SIGTERM, None)
        myq.open_store(spool).poke()    # (it sleeps: told to look again)
        t.join(30)
    assert not t.is_alive()
