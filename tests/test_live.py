"""Live data first (myq(1) "Live
data first"): policy `order=live-first`, `live=`,
`backlog_share=`.  After an outage, jobs made within `live` of now start
before the backlog, which drains completely, in created_at order, in what
the live jobs leave, with at most `backlog_share` percent of the starts
while live jobs wait; a backlog job is marked for its receiver (header
`X-Myq-Backlog: 1`, the MQTT envelope's `"backlog": true`).

The backlog is what a shell producer's files say it is: jobs made an hour
ago (`created_at`), waiting since (`available_at`, in another order than
created_at, so that the order tested is created_at's), with ids of the form
myq makes (ids sort by creation: the file store reads a job's age in its
id).  Every worker runs --drain, one run at a time (concurrency 1), so the
receiver sees the starts in their order; no sleeps.
"""
import json
import os
import time

from _core import FAST, call_myq, start_worker, stop, write_incoming
from _http import http_servers  # noqa: F401 (a fixture)
from _mosquitto import Broker, Subscriber, needs_mosquitto
from test_destinations import drain, listed, policy


def backlog(spool, n, type_="tele", age=3600.0):
    """n jobs made `age` seconds ago, 1 s apart (created_at order: b0, b1,
    ...), waiting in the reverse order (b<n-1>'s available_at first);
    their ids as myq makes them.  Returns the ids in created_at order."""
    now = time.time()
    ids = []
    for k in range(n):
        created = now - age + k
        jid = "%013d-%08x" % (int(created * 1000), k)
        due = now - age + n + 10 - k
        path = write_incoming(spool, jid + ".json", {
            "id": jid, "type": type_, "payload": {"b": k},
            "created_at": created, "updated_at": created,
            "available_at": due})
        os.utime(path, (due, due))
        ids.append(jid)
    return ids


def live(spool, n, type_="tele"):
    return [call_myq("--spool", spool, "enqueue", type_, '{"l": %d}' % k
                     ).stdout.strip() for k in range(n)]


def sent(srv):
    """The bodies in the order they came, each with its backlog mark."""
    return [(json.loads(r["body"]), r["headers"].get("X-Myq-Backlog"))
            for r in srv.requests]


def test_live_jobs_start_first_and_the_backlog_takes_its_share(
        spool, http_servers):
    """backlog_share=25: while live jobs wait, one start in four is the
    backlog's; then the backlog drains, all of it, in created_at order;
    each backlog request is marked, no live one is."""
    srv = http_servers()
    policy(spool, "tele", "url=" + srv.url("/in"), "order=live-first",
           "backlog_share=25")
    old = backlog(spool, 6)
    new = live(spool, 4)
    drain(spool)
    got = sent(srv)
    assert [b for b, _ in got] == [
        {"l": 0}, {"l": 1}, {"l": 2}, {"b": 0}, {"l": 3},
        {"b": 1}, {"b": 2}, {"b": 3}, {"b": 4}, {"b": 5}], got
    assert [m for _, m in got] == [
        None, None, None, "1", None, "1", "1", "1", "1", "1"], got
    assert sorted(j["id"] for j in listed(spool, "done")) == sorted(old + new)


def test_the_default_share_alternates_and_share_0_waits_for_live(
        spool, http_servers):
    """backlog_share defaults to 50 (live, backlog, live, ...); with 0
    the backlog starts only when no live job waits, and still drains."""
    srv = http_servers()
    policy(spool, "tele", "url=" + srv.url("/in"), "order=live-first")
    backlog(spool, 3)
    live(spool, 3)
    drain(spool)
    assert [b for b, _ in sent(srv)] == [
        {"l": 0}, {"b": 0}, {"l": 1}, {"b": 1}, {"l": 2}, {"b": 2}]
    del srv.requests[:]
    policy(spool, "tele", "backlog_share=0")
    backlog(spool, 3)
    live(spool, 2)
    drain(spool)
    assert [b for b, _ in sent(srv)] == [
        {"l": 0}, {"l": 1}, {"b": 0}, {"b": 1}, {"b": 2}]


def test_live_is_the_window_and_batches_are_all_live_or_all_backlog(
        spool, http_servers):
    """live=2h: jobs made an hour ago are live (no mark, first come first);
    with live=10m they are the backlog.  A batch never mixes the two: the
    live jobs go as one request, the backlog as others, each in order."""
    srv = http_servers()
    policy(spool, "tele", "url=" + srv.url("/in"), "order=live-first",
           "live=2h")
    backlog(spool, 2)
    drain(spool)
    # (available_at order: b1 then b0; nothing is backlog, none marked)
    assert sent(srv) == [({"b": 1}, None), ({"b": 0}, None)]
    del srv.requests[:]
    policy(spool, "tele", "live=10m", "batch=3", "backlog_share=0")
    backlog(spool, 4)
    live(spool, 2)
    drain(spool)
    assert sent(srv) == [
        ([{"l": 0}, {"l": 1}], None),
        ([{"b": 0}, {"b": 1}, {"b": 2}], "1"),
        ([{"b": 3}], "1")], sent(srv)


def test_a_live_batch_waits_its_batch_wait_while_the_backlog_goes(
        spool, http_servers):
    """A running worker (batch_wait holds; --drain does not wait): with
    backlog_share=0 live jobs would go first, but a live batch short of
    `batch` waits its batch_wait as it does without a backlog, and the
    backlog's full batch goes meanwhile; then the live batch, unmarked."""
    srv = http_servers()
    policy(spool, "tele", "url=" + srv.url("/in"), "order=live-first",
           "backlog_share=0", "batch=3", "batch_wait=1s")
    backlog(spool, 3)
    live(spool, 1)
    w = start_worker(spool, *FAST)
    try:
        assert srv.wait_requests(2, timeout=30)
    finally:
        stop(w)
    assert sent(srv)[:2] == [([{"b": 0}, {"b": 1}, {"b": 2}], "1"),
                             ([{"l": 0}], None)], sent(srv)


def test_without_live_first_the_order_and_the_bodies_are_as_before(
        spool, http_servers):
    srv = http_servers()
    policy(spool, "tele", "url=" + srv.url("/in"))
    backlog(spool, 2)
    live(spool, 1)
    drain(spool)
    assert sent(srv) == [({"b": 1}, None), ({"b": 0}, None), ({"l": 0}, None)]


def test_live_first_keys_are_checked(spool):
    assert call_myq("--spool", spool, "policy", "tele", "order=live-first",
                    "live=90s", "backlog_share=20%").returncode == 0
    pol = json.loads(call_myq("--spool", spool, "policy", "--json").stdout)
    assert pol["tele"] == {"order": "live-first", "live": 90,
                           "backlog_share": 20}
    line = call_myq("--spool", spool, "policy").stdout
    assert "tele backlog_share=20% live=1m30s order=live-first" in line or \
        "backlog_share=20%" in line and "order=live-first" in line, line
    for bad in ("order=newest", "order=", "live=0", "live=-5", "live=soon",
                "backlog_share=101", "backlog_share=-1", "backlog_share=half",
                "envelope=maybe"):
        if bad == "order=":
            continue            # (an empty value removes the key)
        cp = call_myq("--spool", spool, "policy", "tele", bad)
        assert cp.returncode == 64, (bad, cp.stderr)
        assert bad.partition("=")[0] in cp.stderr, cp.stderr
    pol2 = json.loads(call_myq("--spool", spool, "policy", "--json").stdout)
    assert pol2 == pol          # nothing changed


@needs_mosquitto
def test_the_mqtt_envelope_marks_the_backlog(spool, tmp_path):
    """envelope=true: {"id", "type", "created_at", "message"}, and
    "backlog": true on the backlog's messages only; live first."""
    b = Broker(tmp_path / "b").start()
    sub = Subscriber(b.port, "site/#").start()
    try:
        policy(spool, "temp", "topic=site/7/temp", "envelope=true",
               "order=live-first", "backlog_share=0")
        old = backlog(spool, 2, "temp")
        new = live(spool, 1, "temp")
        drain(spool, "--mqtt", b.url())
        msgs = [json.loads(p) for _, p, _, _ in sub.wait_count(3)]
        assert [m["id"] for m in msgs] == new + old, msgs
        assert [m.get("backlog") for m in msgs] == [None, True, True]
        assert msgs[0]["message"] == {"l": 0} and msgs[1]["message"] == {"b": 0}
        assert all(m["type"] == "temp" and m["created_at"] > 0 for m in msgs)
    finally:
        sub.stop()
        b.stop()
