"""Where a type's jobs go: a type's own destination (policy `url`,
`topic`), failover between destinations in order, and the Kafka REST body
(`format=kafka`).

The receivers are the suite's HTTP server (_http.Server, on 127.0.0.1),
one per destination, and for MQTT a real mosquitto (_mosquitto).  Waiting
is on the server's Condition or on a worker's --drain ending, never a
sleep.
"""
import json
import os

import pytest

from _core import (FAST, call_myq, drain, listed, policy, run_myq, wait_for,
                   write_incoming)
from _http import answer, down, http_servers  # noqa: F401 (a fixture)


# --------------------------------------------------------------------------
# 1. A type's destination

def test_policy_url_topic_and_format_are_checked(spool):
    cp = call_myq("--spool", spool, "policy", "tele",
                  "url=http://a.example/in  https://B.example:8443/in",
                  "format=kafka")
    assert cp.returncode == 0, cp.stderr
    pol = json.loads(call_myq("--spool", spool, "policy", "--json").stdout)
    assert pol["tele"]["url"] == "http://a.example/in https://B.example:8443/in"
    assert pol["tele"]["format"] == "kafka"
    for bad in ("url=ftp://x/", "url=http:///nohost", "url=http://h:99999/",
                "url=", "topic=a/+/b", "topic=a/#", "format=xml"):
        if bad == "url=":
            continue        # (an empty value removes the key)
        cp = call_myq("--spool", spool, "policy", "tele", bad)
        assert cp.returncode == 64, (bad, cp.stderr)
        assert bad.partition("=")[0] in cp.stderr
    assert call_myq("--spool", spool, "policy", "m", "topic=site/7/temp"
                    ).returncode == 0
    # a type goes to a url or a topic, not both; `policy` prints a line
    # that a shell takes back
    cp = call_myq("--spool", spool, "policy", "tele", "topic=a/b")
    assert cp.returncode == 64 and "url and topic" in cp.stderr
    line = call_myq("--spool", spool, "policy").stdout.splitlines()
    assert 'm topic=site/7/temp' in line
    assert 'tele format=kafka url="http://a.example/in ' \
        'https://B.example:8443/in"' in line


def test_a_job_that_names_its_own_destination_is_refused_at_enqueue(spool):
    policy(spool, "tele", "url=http://127.0.0.1:9/in")
    cp = call_myq("--spool", spool, "enqueue", "tele",
                  '{"url": "http://elsewhere/", "body": {"t": 1}}')
    assert cp.returncode == 65, cp.stderr
    assert "own url" in cp.stderr and "body" in cp.stderr
    policy(spool, "alarm", "topic=site/alarm")
    cp = call_myq("--spool", spool, "enqueue", "alarm",
                  '{"topic": "x/y", "message": 1}')
    assert cp.returncode == 65, cp.stderr
    # the body alone is fine
    assert call_myq("--spool", spool, "enqueue", "tele", '{"t": 1}'
                    ).returncode == 0
    assert call_myq("--spool", spool, "enqueue", "alarm", '"hot"'
                    ).returncode == 0


def test_the_type_url_gets_the_body_with_the_id_as_key(spool, http_servers):
    srv = http_servers()
    policy(spool, "tele", "url=" + srv.url("/in"))
    a = call_myq("--spool", spool, "enqueue", "tele", '{"t": 21.5}').stdout.strip()
    b = call_myq("--spool", spool, "enqueue", "tele", '"text"').stdout.strip()
    drain(spool)
    assert srv.wait_requests(2)
    got = dict((r["headers"]["Idempotency-Key"], r) for r in srv.requests)
    assert set(got) == {a, b}
    assert json.loads(got[a]["body"]) == {"t": 21.5}
    assert got[a]["headers"]["Content-Type"] == "application/json"
    assert got[a]["path"] == "/in" and got[a]["method"] == "POST"
    assert got[b]["body"] == b"text"
    assert [j["id"] for j in listed(spool, "done")] == sorted([a, b]) or \
        set(j["id"] for j in listed(spool, "done")) == {a, b}


def test_a_shell_producers_file_with_its_own_url_is_quarantined(
        spool, http_servers):
    srv = http_servers()
    policy(spool, "tele", "url=" + srv.url("/in"))
    write_incoming(spool, "own.json", {"type": "tele", "payload": {
        "url": srv.url("/other"), "body": {"t": 1}}})
    write_incoming(spool, "good.json", {"type": "tele", "payload": {"t": 2}})
    drain(spool)
    failed = listed(spool, "failed")
    assert [f["id"] for f in failed] == ["own"], failed
    assert "own url" in json.dumps(failed)
    assert [j["id"] for j in listed(spool, "done")] == ["good"]
    assert [json.loads(r["body"]) for r in srv.requests] == [{"t": 2}]


def test_kafka_format_sends_rest_v2_records_keyed_by_id(spool, http_servers):
    srv = http_servers()
    policy(spool, "k", "url=" + srv.url("/topics/tele"), "format=kafka")
    policy(spool, "kb", "url=" + srv.url("/topics/batch"), "format=kafka",
           "batch=10")
    one = call_myq("--spool", spool, "enqueue", "k", '{"t": 1}').stdout.strip()
    ids = [call_myq("--spool", spool, "enqueue", "kb", '{"n": %d}' % i
                    ).stdout.strip() for i in range(3)]
    drain(spool)
    r = srv.hits("/topics/tele")[0]
    assert r["headers"]["Content-Type"] == "application/vnd.kafka.json.v2+json"
    assert json.loads(r["body"]) == {"records": [{"key": one, "value": {"t": 1}}]}
    assert r["headers"]["Idempotency-Key"] == one
    rs = srv.hits("/topics/batch")
    assert len(rs) == 1, [x["body"] for x in rs]
    assert rs[0]["headers"]["Content-Type"] == KAFKA
    assert json.loads(rs[0]["body"]) == {"records": [
        {"key": i, "value": {"n": n}} for n, i in enumerate(ids)]}
    assert rs[0]["headers"]["X-Myq-Ids"] == ",".join(ids)
    # a type whose jobs say their own url (no url= policy) too
    policy(spool, "kown", "handler=http", "format=kafka")
    own = call_myq("--spool", spool, "enqueue", "kown", json.dumps(
        {"url": srv.url("/topics/own"), "body": [1, 2]})).stdout.strip()
    drain(spool)
    r = srv.hits("/topics/own")[0]
    assert json.loads(r["body"]) == {"records": [{"key": own, "value": [1, 2]}]}
    assert r["headers"]["Content-Type"] == KAFKA


KAFKA = "application/vnd.kafka.json.v2+json"


# --------------------------------------------------------------------------
# 2. Failover

def test_a_failing_first_destination_sends_each_job_on_to_the_second(
        spool, http_servers, tmp_path):
    """A answers 503: each job goes on to B in the same run, no attempt
    counted; after `breaker` failures A is held and jobs go to B at once;
    B sees each id once, under the job's own Idempotency-Key."""
    a, b = http_servers(default=down), http_servers()
    policy(spool, "tele", "url=%s %s" % (a.url("/in"), b.url("/in")))
    ids = [call_myq("--spool", spool, "enqueue", "tele", '{"n": %d}' % i
                    ).stdout.strip() for i in range(8)]
    log = tmp_path / "w.log"
    cp = run_myq("--spool", spool, "worker", "--drain", "--log", str(log),
                 *FAST)
    assert cp.returncode == 0, cp.stderr
    done = listed(spool, "done")
    assert sorted(j["id"] for j in done) == sorted(ids)
    assert all(j["attempts"] == 1 for j in done), done
    keys = [r["headers"]["Idempotency-Key"] for r in b.requests]
    assert sorted(keys) == sorted(ids), keys
    assert len(a.requests) == 3, "A is held after the breaker's 3 failures"
    text = log.read_text()
    assert text.count("event=failover") == 3
    assert "event=hold dest=%s" % a.origin() in text
    st = json.loads(call_myq("--spool", spool, "stats", "--json").stdout)
    assert [(d["dest"], d["state"]) for d in st["destinations"]["tele"]] == [
        (a.origin(), "held"), (b.origin(), "ok")]
    cp = call_myq("--spool", spool, "check")
    assert cp.returncode == 1
    assert "type tele fails over: %s held, %s ok; its jobs go to %s" % (
        a.origin(), b.origin(), b.origin()) in cp.stdout + cp.stderr


def test_a_batch_fails_over_whole_with_its_key(spool, http_servers):
    a, b = http_servers(default=down), http_servers()
    policy(spool, "tele", "url=%s %s" % (a.url("/in"), b.url("/in")),
           "batch=5")
    ids = [call_myq("--spool", spool, "enqueue", "tele", '{"n": %d}' % i
                    ).stdout.strip() for i in range(5)]
    drain(spool)
    assert len(a.requests) == len(b.requests) == 1
    ra, rb = a.requests[0], b.requests[0]
    assert ra["headers"]["X-Myq-Ids"] == rb["headers"]["X-Myq-Ids"] == ",".join(ids)
    assert ra["headers"]["Idempotency-Key"] == rb["headers"]["Idempotency-Key"]
    assert ra["body"] == rb["body"]
    assert all(j["attempts"] == 1 for j in listed(spool, "done"))


def test_a_held_first_destination_gets_new_starts_after_its_probe(
        spool, http_servers, procs, tmp_path):
    """While A is held its jobs go to B; once A answers, its probe
    succeeds and new starts go to A again."""
    state = {"up": False}

    def flaky(h):
        answer(h, 200 if state["up"] else 503)

    a, b = http_servers(default=flaky), http_servers()
    policy(spool, "tele", "url=%s %s" % (a.url("/in"), b.url("/in")))
    for i in range(4):
        call_myq("--spool", spool, "enqueue", "tele", '{"n": %d}' % i)
    procs.worker(spool, "--poll", "0.05", "--jitter", "0", "--backoff-base",
                 "0.2", "--probe-max", "0.5", log=tmp_path / "w.log")
    wait_for(lambda: len(b.requests) >= 4, what="B to get the jobs")
    assert len(a.requests) == 3
    state["up"] = True
    # new jobs, one at a time: one of them is A's probe, and after it A
    # gets every start
    n = 4
    while not any(r["status"] == 200 for r in list(a.requests)):
        call_myq("--spool", spool, "enqueue", "tele", '{"n": %d}' % n)
        n += 1
        total = n
        wait_for(lambda: len(a.requests) + len(b.requests) >= total + 3,
                 what="job %d delivered" % n)
        assert n < 60, "A's probe never came"
    b_before = len(b.requests)
    for i in range(5):
        call_myq("--spool", spool, "enqueue", "tele", '{"m": %d}' % i)
    wait_for(lambda: sum(1 for r in a.requests if r["status"] == 200) >= 6,
             what="new starts at A")
    assert len(b.requests) == b_before
    st = json.loads(call_myq("--spool", spool, "stats", "--json").stdout)
    assert [d["state"] for d in st["destinations"]["tele"]] == ["ok", "ok"]


# --------------------------------------------------------------------------
# MQTT: the type's topic, and a second broker

from _core import free_port  # noqa: E402
from _mosquitto import Broker, Subscriber, needs_mosquitto  # noqa: E402


@needs_mosquitto
def test_the_type_topic_gets_the_payload_as_message(spool, tmp_path):
    b = Broker(tmp_path / "b").start()
    sub = Subscriber(b.port, "site/#").start()
    try:
        policy(spool, "temp", "topic=site/7/temp")
        call_myq("--spool", spool, "enqueue", "temp", '{"c": 21.5}')
        call_myq("--spool", spool, "enqueue", "temp", '"hot"')
        write_incoming(spool, "own.json", {"type": "temp", "payload": {
            "topic": "x/y", "message": 1}})
        drain(spool, "--mqtt", b.url())
        msgs = sub.wait_count(2)
        assert sorted((t, p) for t, p, _, _ in msgs) == [
            ("site/7/temp", b'hot'), ("site/7/temp", b'{"c":21.5}')]
        assert [f["id"] for f in listed(spool, "failed")] == ["own"]
    finally:
        sub.stop()
        b.stop()


@needs_mosquitto
def test_a_second_broker_takes_the_jobs_while_the_first_is_down(
        spool, tmp_path):
    """--mqtt "A B": A refuses connections (nothing listens), so each job
    goes on to B in its run, no attempt counted; A is held after the
    breaker's failures; stats show both brokers' states."""
    b = Broker(tmp_path / "b").start()
    sub = Subscriber(b.port, "site/#").start()
    a_url = "mqtt://127.0.0.1:%d" % free_port()
    try:
        policy(spool, "temp", "topic=site/7/temp")
        ids = [call_myq("--spool", spool, "enqueue", "temp", '{"n": %d}' % i
                        ).stdout.strip() for i in range(6)]
        log = tmp_path / "w.log"
        cp = run_myq("--spool", spool, "worker", "--drain", "--log", str(log),
                     "--mqtt", "%s %s" % (a_url, b.url()), *FAST)
        assert cp.returncode == 0, cp.stderr
        msgs = sub.wait_count(6)
        assert sorted(json.loads(p)["n"] for _, p, _, _ in msgs) == list(range(6))
        done = listed(spool, "done")
        assert sorted(j["id"] for j in done) == sorted(ids)
        assert all(j["attempts"] == 1 for j in done), done
        text = log.read_text()
        assert text.count("event=failover") == 3, text
        assert "event=hold dest=%s" % a_url in text
    finally:
        sub.stop()
        b.stop()


# --------------------------------------------------------------------------
# 4. The uplink's budget

def _windows(times_sizes, window):
    """The most bytes received within any `window` seconds."""
    most = 0
    for i, (t, _) in enumerate(times_sizes):
        most = max(most, sum(n for u, n in times_sizes[i:] if u - t < window))
    return most


@pytest.mark.parametrize("concurrency", [1, 2])
def test_the_uplink_rate_caps_bytes_over_any_window_across_destinations(
        spool, http_servers, monkeypatch, concurrency):
    """--uplink-rate over every destination of the worker (two types, two
    servers): what the servers receive in any window (2 s here; 10 s in
    production) stays within rate x window; a job larger than that still
    goes, alone in its window."""
    import myq
    monkeypatch.setattr(myq, "UPLINK_WINDOW", 2.0)
    s1, s2 = http_servers(), http_servers()
    policy(spool, "a", "url=" + s1.url("/a"))
    policy(spool, "b", "url=" + s2.url("/b"))
    body = json.dumps("x" * 290)            # (sent as text: 290 bytes)
    for i in range(3):
        call_myq("--spool", spool, "enqueue", "a", body)
        call_myq("--spool", spool, "enqueue", "b", body)
    call_myq("--spool", spool, "enqueue", "a", json.dumps("y" * 900))
    # 300 B/s: 600 B in any 2 s window, so two bodies a window
    # (a 1 s time limit: the waits, up to 2 s, are not the jobs' time;
    # concurrency 1 runs them in this thread, under the worker's SIGALRM)
    w = myq.Worker(spool, uplink_rate=myq.parse_uplink("300/s"), poll=0.05,
                   concurrency=concurrency, timeout=1,
                   log=myq.Log(stream=open(os.devnull, "w")))
    w.run(drain=True)
    assert all(j["attempts"] == 1 for j in listed(spool, "done"))
    got = sorted((r["mono"], len(r["body"])) for r in s1.requests + s2.requests)
    assert len(got) == 7
    assert sum(n for _, n in got) == 6 * 290 + 900
    assert _windows(got, 2.0 - 0.3) <= 900, got     # (0.3 s: the way there)
    big = [t for t, n in got if n == 900][0]
    assert all(abs(t - big) >= 2.0 - 0.3 for t, n in got if n != 900), got
    assert w.http_pool.uplink.waited > 0


def test_uplink_rate_is_a_worker_option(spool):
    cp = run_myq("--spool", spool, "worker", "--drain", "--uplink-rate", "fast")
    assert cp.returncode == 64 and "--uplink-rate" in cp.stderr
    cp = run_myq("--spool", spool, "worker", "--drain", "--uplink-rate", "16K/s")
    assert cp.returncode == 0, cp.stderr


@needs_mosquitto
def test_the_uplink_rate_counts_mqtt_payloads(spool, tmp_path, monkeypatch):
    import myq
    monkeypatch.setattr(myq, "UPLINK_WINDOW", 1.0)
    b = Broker(tmp_path / "b").start()
    try:
        w = myq.Worker(spool, mqtt=b.url(), uplink_rate=100.0, timeout=10,
                       log=myq.Log(stream=open(os.devnull, "w")))
        job = {"id": "j", "payload": {"topic": "t", "message": "x" * 60}}
        assert w.mqtt_batch([job]) == [None]
        assert w.http_pool.uplink.waited == 0
        assert w.mqtt_batch([dict(job, id="k")]) == [None]     # 120 > 100
        assert w.http_pool.uplink.waited > 0.5
        w.resolver.mqtt.client.close()
    finally:
        b.stop()


def test_a_hung_first_destination_leaves_the_second_its_share_of_time(
        spool, http_servers):
    """A never answers: the run gives it half of the job's time limit, then
    sends the job on to B within the same run; no attempt counted."""
    def hang(h):
        h.server.release.wait(30)

    a, b = http_servers(default=hang), http_servers()
    policy(spool, "tele", "url=%s %s" % (a.url("/in"), b.url("/in")))
    jid = call_myq("--spool", spool, "enqueue", "tele", '{"n": 1}',
                   "--timeout", "4").stdout.strip()
    drain(spool)
    assert [r["headers"]["Idempotency-Key"] for r in b.requests] == [jid]
    assert len(a.requests) == 1
    done = listed(spool, "done")
    assert [(j["id"], j["attempts"]) for j in done] == [(jid, 1)]
