"""Destinations, failover, live data first, the uplink's budget (myq(1)
"Destinations and failover"), rule by rule: the rules no other test file proves.  Where each
rule is proven:

- Where a type goes (`url=`, `topic=`; a job naming its own refused, 65,
  or quarantined): test_destinations.py (policy, CLI, a shell's file),
  and here through the Python API (enqueue, enqueue_many), both stores.
- Failover (`url=A B`, `--mqtt "A B"`; no attempt counted; new starts back
  at A after its probe; ids and keys kept; stats and check):
  test_destinations.py, test_destinations_held.py for HTTP; here MQTT's
  (the envelope's id on both brokers, stats and check, back to A).
- Live data first: test_live.py, test_live3h.py, test_backlog_order.py
  (created_at order at any depth, a retry's place); here the default
  `live` (60 s).
- The uplink's budget: test_destinations.py, test_destinations_held.py,
  test_live3h.py; here any 10 s window, a probe's bytes, gzip's bytes,
  and an mqtt backlog's payloads behind live ones (as http's).
- Kafka: test_destinations.py.
- The README's forwarding example: here (its policy line is taken).
"""
import gzip as _gzip
import json
import os
import random
import re
import signal
import threading

import pytest

from _core import (ROOT, call_myq, drain, listed, policy, run_myq,
                   start_worker, stop, wait_for)
from _http import answer, http_servers  # noqa: F401 (a fixture)
from _mosquitto import Broker, Subscriber, needs_mosquitto


def _enq(spool, type_, body):
    cp = call_myq("--spool", spool, "enqueue", type_, body)
    assert cp.returncode == 0, cp.stderr
    return cp.stdout.strip()


# --------------------------------------------------------------------------
# Where a type goes

def test_the_api_refuses_a_job_that_names_its_own_destination(myq, spool):
    """Spool.enqueue, enqueue_many and myq.enqueue refuse it (InvalidJob,
    which `myq enqueue` exits 65 with), for url= and topic= alike, and
    store nothing; the body alone goes in."""
    policy(spool, "tele", "url=http://127.0.0.1:9/in")
    policy(spool, "temp", "topic=site/7/temp")
    sp = myq.Spool(spool)
    own = [("tele", {"url": "http://elsewhere/", "body": {"t": 1}}),
           ("temp", {"topic": "x/y", "message": 1})]
    for type_, payload in own:
        for call in (lambda: sp.enqueue(type_, payload),
                     lambda: sp.enqueue_many([{"type": type_,
                                               "payload": payload}]),
                     lambda: myq.enqueue(spool, type_, payload)):
            with pytest.raises(myq.InvalidJob, match="own"):
                call()
    assert listed(spool, "ready") == []
    assert sp.enqueue("tele", {"t": 1}) and sp.enqueue("temp", "hot")


# --------------------------------------------------------------------------
# Failover, MQTT: a second broker

def _dest_states(spool, type_):
    st = json.loads(call_myq("--spool", spool, "stats", "--json").stdout)
    return [(d["dest"], d["state"]) for d in st["destinations"][type_]]


@needs_mosquitto
def test_a_second_broker_gets_the_envelope_id_and_a_first_back_gets_new_starts(
        spool, tmp_path):
    """--mqtt "A B", A down: the jobs go to B, each message's envelope
    carrying its job's id (a consumer that stores by id stores once on
    either broker); stats show A held and B ok, check says the type fails
    over.  A comes back: once its probe succeeds, new starts go to A."""
    a = Broker(tmp_path / "a")              # (its port, nothing on it yet)
    b = Broker(tmp_path / "b").start()
    sub_b = Subscriber(b.port, "site/#").start()
    sub_a = w = None
    try:
        policy(spool, "temp", "topic=site/7/temp", "envelope=true")
        ids = [_enq(spool, "temp", '{"n": %d}' % i) for i in range(4)]
        w = start_worker(spool, "--mqtt", "%s %s" % (a.url(), b.url()),
                         "--poll", "0.05", "--jitter", "0", "--backoff-base",
                         "0.2", "--probe-max", "0.5")
        msgs = sub_b.wait_count(4)
        assert sorted(json.loads(p)["id"] for _, p, _, _ in msgs) == sorted(ids)
        assert all(json.loads(p)["message"] == {"n": ids.index(
            json.loads(p)["id"])} for _, p, _, _ in msgs)
        wait_for(lambda: _dest_states(spool, "temp") == [
            (a.url(), "held"), (b.url(), "ok")], what="A held in stats")
        cp = call_myq("--spool", spool, "check")
        assert cp.returncode == 1 and "type temp fails over" in cp.stdout + \
            cp.stderr, (cp.stdout, cp.stderr)
        a.start()
        sub_a = Subscriber(a.port, "site/#").start()
        n = 4
        while not sub_a.messages:
            n += 1
            assert n < 80, "A's probe never came"
            _enq(spool, "temp", '{"n": %d}' % n)
            total = n
            wait_for(lambda: len(sub_a.messages) + len(sub_b.messages) >= total,
                     what="job %d delivered" % n)
        on_b = len(sub_b.messages)
        last = [_enq(spool, "temp", '{"m": %d}' % i) for i in range(5)]
        wait_for(lambda: set(last) <= set(
            json.loads(p)["id"] for _, p, _, _ in list(sub_a.messages)),
            what="new starts at A")
        assert len(sub_b.messages) == on_b
        wait_for(lambda: [s for _, s in _dest_states(spool, "temp")] ==
                 ["ok", "ok"], what="both ok in stats")
        assert all(j["attempts"] == 1 for j in listed(spool, "done"))
    finally:
        if w is not None:
            stop(w)
        for s in (sub_a, sub_b):
            if s is not None:
                s.stop()
        a.stop()
        b.stop()


# --------------------------------------------------------------------------
# Live data first: the default window

def test_live_defaults_to_a_minute(spool, http_servers):
    """order=live-first alone: a job made 30 s ago is live (first, not
    marked), one made 2 minutes ago the backlog (marked)."""
    from test_live import backlog
    srv = http_servers()
    policy(spool, "tele", "url=" + srv.url("/in"), "order=live-first",
           "backlog_share=0")
    old = backlog(spool, 1, age=120.0)
    young = backlog(spool, 1, age=30.0)
    drain(spool)
    got = [(r["headers"]["Idempotency-Key"], r["headers"].get("X-Myq-Backlog"))
           for r in srv.requests]
    assert got == [(young[0], None), (old[0], "1")], got


# --------------------------------------------------------------------------
# The uplink's budget

def test_any_ten_seconds_hold_the_budget(myq):
    """The default window (10 s), sends of random sizes as fast as the
    uplink lets them go (a clock of our own): in any 10 s at most rate x
    10 s went, but a single send larger than that, which goes alone."""
    up = myq.Uplink(1000.0)
    assert up.window == 10.0
    rnd, now, sent = random.Random(41), 1000.0, []
    for _ in range(400):
        n = rnd.choice([rnd.randrange(1, 3000), rnd.randrange(1, 300),
                        12000])
        while True:
            d = up._delay(n, now)
            if not d:
                break
            now += d
        sent.append((now, n))
        now += rnd.choice([0.0, 0.0, 0.01, 0.5])
    for i, (t, n) in enumerate(sent):
        window = [m for u, m in sent[i:] if u - t < 10.0]
        if n > 10000:
            assert len(window) == 1 or sum(window) - n <= 0, (t, window)
        else:
            assert sum(window) <= 10000 or window[0] > 10000, (t, window)


def _booked(myq, monkeypatch):
    """The bytes each send booked on the uplink, in order."""
    got = []
    wait = myq.Uplink.wait

    def counted(self, n, run=None, later=False):
        got.append(n)
        return wait(self, n, run, later)
    monkeypatch.setattr(myq.Uplink, "wait", counted)
    return got


def test_a_probe_and_a_gzip_body_count_as_what_is_sent(
        myq, spool, http_servers, monkeypatch):
    """What the uplink books is what goes: a gzip'd body's compressed
    bytes; a held destination's probe (a job sent to see whether it is
    back) is a send like any other, booked too: every request the
    receiver saw, the probe's among them, is in the budget."""
    state = {"up": False}

    def flaky(h):
        answer(h, 200 if state["up"] else 503)
    srv = http_servers(default=flaky)
    policy(spool, "tele", "url=" + srv.url("/in"), "gzip=true")
    booked = _booked(myq, monkeypatch)
    for i in range(3):
        _enq(spool, "tele", json.dumps({"n": i, "pad": "x" * 200}))
    w = myq.Worker(spool, uplink_rate=1e6, poll=0.05, jitter=0,
                   backoff_base=0.2, probe_max=0.3, concurrency=1,
                   log=myq.Log(stream=open(os.devnull, "w")))
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(srv.requests) >= 3, what="A held")
        state["up"] = True
        wait_for(lambda: len(listed(spool, "done")) == 3, timeout=30,
                 what="the probe, then the rest")
    finally:
        w._on_stop(signal.SIGTERM, None)
        myq.open_store(spool).poke()
        t.join(15)
    assert not t.is_alive()
    bodies = [r["body"] for r in srv.requests]
    assert len(bodies) >= 4             # 3 failures (held), a probe, ...
    assert all(json.loads(_gzip.decompress(b))["pad"] for b in bodies)
    assert booked == [len(b) for b in bodies], (booked, bodies)


@needs_mosquitto
def test_a_backlogs_mqtt_payloads_wait_behind_live_ones_for_the_uplink(
        myq, spool, tmp_path, monkeypatch):
    """As an http request marked X-Myq-Backlog does (test_live3h.py), a
    live-first mqtt type's backlog publishes wait for the uplink behind
    every live send (Uplink.wait's `later`); its live ones do not."""
    from test_live import backlog
    b = Broker(tmp_path / "b").start()
    w = None
    try:
        policy(spool, "temp", "topic=site/7/temp", "order=live-first",
               "backlog_share=0")
        backlog(spool, 2, "temp")
        for k in range(2):
            _enq(spool, "temp", '{"l": %d}' % k)
        flags = []
        wait = myq.Uplink.wait

        def counted(self, n, run=None, later=False):
            flags.append(later)
            return wait(self, n, run, later)
        monkeypatch.setattr(myq.Uplink, "wait", counted)
        w = myq.Worker(spool, mqtt=b.url(), uplink_rate=1e6, concurrency=1,
                       poll=0.05, jitter=0,
                       log=myq.Log(stream=open(os.devnull, "w")))
        w.run(drain=True)
        assert flags == [False, False, True, True], flags
        assert len(listed(spool, "done")) == 4
    finally:
        if w is not None and w.resolver.mqtt.client is not None:
            w.resolver.mqtt.client.close()
        b.stop()


# --------------------------------------------------------------------------
# The README's forwarding example

def test_the_readmes_forwarding_policy_is_taken(spool):
    """The telemetry type of README.md's "Over a cellular link": failover,
    batches, live first and (the worker's) a cap, as the README writes
    them."""
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"myq policy telemetry (.*?)\nMYQ_ARGS=\"([^\"]*)\"", text,
                  re.S)
    assert m, "the README's forwarding example"
    import shlex
    args = shlex.split(m.group(1).replace("\\\n", " "))
    policy(spool, "telemetry", *args)
    pol = json.loads(call_myq("--spool", spool, "policy", "--json").stdout)
    t = pol["telemetry"]
    assert len(t["url"].split()) == 2 and t["order"] == "live-first"
    assert "backlog_share" in t and "live" in t and t["batch"] > 1
    cap = m.group(2).split()
    assert cap[0] == "--uplink-rate"
    cp = run_myq("--spool", spool, "worker", "--drain", *cap)
    assert cp.returncode == 0, cp.stderr
