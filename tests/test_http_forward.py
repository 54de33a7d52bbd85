"""Forwarding over slow and metered links, the `http` side:
kept connections, TLS with --http-ca and session reuse, gzip bodies, the
batch request, User-Agent.

The test server is the suite's (_http.Server), speaking HTTP/1.1
keep-alive; it counts connections (one handler instance is one connection),
requests, requests per connection, TLS handshakes and resumed sessions, and
notifies its Condition when it sees a client close a connection.  Its routes decide
the behaviour per path, some by the request's number on its connection
(a server that drops a kept connection just as the next request comes).
"""
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from _core import ROOT, call_myq, wait_for
from _http import (answer, client_gone, http_server, http_servers,  # noqa: F401
                   self_signed, tls_context)

from test_http import NOT_IN_LIGHT


# --------------------------------------------------------------------------
# the test server (_http.Server; its default route is _http.answer)

def drop(h):
    """Read the request, close without a byte of answer."""
    h.close_connection = True


def drop_reused(h):
    """A server that closed a kept connection as the next request came."""
    if h.n > 1:
        drop(h)
    else:
        answer(h)


def partial_on_reuse(h):
    """On a reused connection: the start of an answer, then close."""
    if h.n > 1:
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nxx")
        h.wfile.flush()
        h.close_connection = True
    else:
        answer(h)


def slow_for_b(h):
    """Job b gets no answer; the server waits until the client gives up."""
    if h.headers["Idempotency-Key"] != "b":
        return answer(h)
    deadline = time.monotonic() + 10
    while not client_gone(h.connection) and time.monotonic() < deadline:
        h.server.release.wait(0.02)
    h.close_connection = True


def slow(h):
    h.server.release.wait(10)
    answer(h)


def close_after(h):
    answer(h, headers=[("Connection", "close")])
    h.close_connection = True


@pytest.fixture
def server(http_server):
    return http_server


@pytest.fixture
def cert(tmp_path):
    """A self-signed certificate for 127.0.0.1: (cert.pem, key.pem)."""
    return self_signed(tmp_path)


@pytest.fixture
def tls_server(http_servers, cert):
    return http_servers(tls=tls_context(*cert))


def job(jid, url, body=None, **payload):
    payload["url"] = url
    if body is not None:
        payload["body"] = body
    return {"id": jid, "type": "http", "payload": payload}


def enqueue_many(myq, spool, url, n, prefix="j", **kw):
    return [myq.enqueue(spool, "http", {"url": url, "body": {"n": i}},
                        id="%s%03d" % (prefix, i), **kw) for i in range(n)]


def states(myq, spool, ids):
    sp = myq.open_store(spool)
    return [sp.show(i)["state"] for i in ids]


# --------------------------------------------------------------------------
# keep-alive

def test_jobs_share_one_connection_per_worker_slot(myq, spool, server):
    ids = enqueue_many(myq, spool, server.url("/ev"), 20)
    w = myq.Worker(spool, jitter=0)
    w.run(drain=True)
    assert states(myq, spool, ids) == ["done"] * 20
    assert len(server.requests) == 20
    assert server.connections == 1, server.connections
    assert sorted(server.keys()) == ids
    # the worker closed its kept connection when it stopped
    assert server.wait_closed(1), "the kept connection outlived the worker"
    assert w.http_pool.waiting() == 0


def test_concurrent_slots_never_share_a_connection(myq, spool, server):
    """--concurrency 3: at most 3 connections, and never two requests at
    once on one (the server would see a request while one is answered)."""
    inflight, overlap = {}, []
    lock = threading.Lock()

    def traced(h):
        with lock:
            if inflight.get(h.conn_no):
                overlap.append(h.conn_no)
            inflight[h.conn_no] = True
        time.sleep(0.01)
        with lock:
            inflight[h.conn_no] = False
        answer(h)
    server.routes["/ev"] = traced
    ids = enqueue_many(myq, spool, server.url("/ev"), 30)
    myq.Worker(spool, jitter=0, concurrency=3).run(drain=True)
    assert states(myq, spool, ids) == ["done"] * 30
    assert len(server.requests) == 30
    assert 1 <= server.connections <= 3, server.connections
    assert overlap == []


def test_without_keep_alive_a_connection_per_request(myq, server):
    """A pool of size 0 (and http_handler without a pool): today's
    behaviour, a fresh connection per request, closed after it."""
    pool = myq.HttpPool(0)
    for i in range(3):
        myq.http_handler(job("n%d" % i, server.url("/x"), {"i": i}), pool=pool)
    myq.http_handler(job("n3", server.url("/x"), 1))
    assert len(server.requests) == 4 and server.connections == 4
    assert server.wait_closed(4)
    assert pool.waiting() == 0


def test_connection_close_answer_is_not_kept(myq, server):
    server.routes["/c"] = close_after
    pool = myq.HttpPool(1)
    for i in range(3):
        myq.http_handler(job("c%d" % i, server.url("/c"), i), pool=pool)
    assert server.connections == 3
    assert pool.waiting() == 0


def test_idle_connection_closed_after_http_idle(myq, server, monkeypatch):
    monkeypatch.setattr(myq, "HTTP_IDLE", 0.3)
    pool = myq.HttpPool(1)
    t0 = time.monotonic()
    myq.http_handler(job("i1", server.url("/x"), 1), pool=pool)
    assert pool.waiting() == 1
    assert server.wait_closed(1, timeout=10), "the idle connection stayed open"
    idle = time.monotonic() - t0
    assert idle >= 0.3, idle
    assert pool.waiting() == 0
    myq.http_handler(job("i2", server.url("/x"), 2), pool=pool)
    assert server.connections == 2


def test_idle_close_in_a_running_worker(myq, spool, server, monkeypatch):
    """A worker that waits for work closes its kept connection after
    HTTP_IDLE, and opens a new one for the next job."""
    monkeypatch.setattr(myq, "HTTP_IDLE", 0.3)
    w = myq.Worker(spool, jitter=0, poll=0.05)
    a = myq.enqueue(spool, "http", {"url": server.url("/x")})
    t = threading.Thread(target=w.run)
    t.start()
    try:
        wait_for(lambda: states(myq, spool, [a]) == ["done"], what="job a")
        assert server.wait_closed(1), "the idle connection stayed open"
        assert w.http_pool.waiting() == 0
        b = myq.enqueue(spool, "http", {"url": server.url("/x")})
        wait_for(lambda: states(myq, spool, [b]) == ["done"], what="job b")
        assert server.connections == 2
    finally:
        w._on_stop(signal.SIGTERM, None)
        t.join(15)
    assert not t.is_alive()


def test_kept_connection_reused_across_idle_gaps_shorter_than_http_idle(myq, server):
    pool = myq.HttpPool(1, idle=30)
    for i in range(3):
        myq.http_handler(job("g%d" % i, server.url("/x"), i), pool=pool)
        time.sleep(0.2)     # the gap under test, not a synchronisation
    assert server.connections == 1 and len(server.requests) == 3


# --------------------------------------------------------------------------
# a kept connection that fails

def test_reused_connection_closed_by_server_is_retried_once_on_a_fresh_one(
        myq, spool, server):
    server.routes["/d"] = drop_reused
    ids = enqueue_many(myq, spool, server.url("/d"), 2)
    myq.Worker(spool, jitter=0, backoff_base=60).run(drain=True)
    sp = myq.open_store(spool)
    for jid in ids:
        j = sp.show(jid)
        assert j["state"] == "done", j
        assert j["attempts"] == 1 and not j.get("last_error"), j
    # job 0 on connection 1; job 1 on connection 1 (dropped), then on 2
    assert server.connections == 2
    assert [(r["conn"], r["n"]) for r in server.requests] == [(1, 1), (1, 2), (2, 1)]
    assert server.keys() == [ids[0], ids[1], ids[1]]


def test_fresh_connection_that_fails_too_is_not_tried_again(myq, server):
    pool = myq.HttpPool(1)
    myq.http_handler(job("f1", server.url("/x"), 1), pool=pool)
    server.routes["/x"] = drop
    with pytest.raises(myq.DestinationDown):
        myq.http_handler(job("f2", server.url("/x"), 2), pool=pool)
    assert server.keys() == ["f1", "f2", "f2"]      # the reused one, one fresh


def test_reused_connection_failing_after_the_answer_began_is_not_resent(
        myq, spool, server):
    server.routes["/p"] = partial_on_reuse
    ids = enqueue_many(myq, spool, server.url("/p"), 2)
    myq.Worker(spool, jitter=0, backoff_base=60).run(drain=True)
    assert sorted(states(myq, spool, ids)) == ["done", "scheduled"]
    assert len(server.requests) == 2
    assert sorted(server.keys()) == ids


@pytest.mark.parametrize("concurrency", [1, 2], ids=["inline", "thread"])
def test_time_out_closes_the_connection_and_never_resends(myq, spool, server,
                                                          concurrency):
    """A request that times out: its connection is closed (the server sees
    the client go) and not kept, the handler does not send it again, the
    job is retried later.  Inline (SIGALRM; b reuses a's connection) and
    threaded (the worker cuts run.conn) runs alike."""
    server.routes["/s"] = slow_for_b
    a = myq.enqueue(spool, "http", {"url": server.url("/s")}, id="a")
    b = myq.enqueue(spool, "http", {"url": server.url("/s")}, id="b",
                    timeout=0.5)
    w = myq.Worker(spool, jitter=0, backoff_base=60, concurrency=concurrency)
    t0 = time.monotonic()
    w.run(drain=True)
    assert time.monotonic() - t0 < 10       # slow_for_b gives up at 10 s
    assert states(myq, spool, [a, b]) == ["done", "scheduled"]
    assert "timed out" in myq.open_store(spool).show(b)["last_error"]
    assert sorted(server.keys()) == ["a", "b"]
    (rb,) = [r for r in server.requests if r["headers"]["Idempotency-Key"] == "b"]
    if concurrency == 1:
        assert rb["n"] == 2, "b did not reuse a's connection"
    assert server.wait_closed(1)
    assert server.wait(lambda: rb["conn"] in server.closed, 10), \
        "the timed-out connection was not closed"
    assert w.http_pool.waiting() == 0


@pytest.mark.parametrize("concurrency", [1, 2], ids=["inline", "thread"])
def test_a_time_out_is_the_destinations_failure_inline_too(myq, spool, server,
                                                          concurrency):
    """A destination that never answers: the run's time limit ends it, and
    that is the destination's failure (a streak of the breaker, no attempt
    spent past the first), inline as in a thread.  Inline, the worker's
    own timer (armed at the run's start: it ends the run right at its
    limit, before the socket's) made it the job's: an outage spent all
    its attempts and put it in dlq/."""
    server.routes["/s"] = slow_for_b
    b = myq.enqueue(spool, "http", {"url": server.url("/s")}, id="b",
                    timeout=0.5)
    myq.Worker(spool, jitter=0, backoff_base=60,
               concurrency=concurrency).run(drain=True)
    assert states(myq, spool, [b]) == ["scheduled"]
    held = os.path.join(spool, "locks", "held")
    assert [n for n in os.listdir(held) if n.endswith(".streak")], \
        os.listdir(held)


def test_payload_timeout_bounds_the_whole_request_without_a_worker(myq, server):
    """A server that trickles its answer a byte at a time: the time limit
    covers the whole answer, not each read."""
    def trickle(h):
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n")
        for _ in range(50):
            if h.server.release.wait(0.1):
                break
            h.wfile.write(b"x")
            h.wfile.flush()
    server.routes["/t"] = trickle
    t0 = time.monotonic()
    with pytest.raises(myq.DestinationDown):
        myq.http_handler(job("t", server.url("/t"), timeout=1), pool=myq.HttpPool(1))
    assert time.monotonic() - t0 < 5        # the trickle: 50 bytes, >= 0.1 s each


# --------------------------------------------------------------------------
# https

def test_https_verified_with_http_ca_and_one_handshake(myq, spool, tls_server,
                                                       cert, run_myq):
    ids = [call_myq("--spool", spool, "enqueue", "http", json.dumps(
        {"url": tls_server.url("/s"), "body": {"i": i}})).stdout.strip()
        for i in range(8)]
    p = run_myq("--spool", spool, "worker", "--drain", "--jitter", "0",
                "--http-ca", cert[0])
    assert p.returncode == 0, p.stderr
    assert states(myq, spool, ids) == ["done"] * 8
    assert len(tls_server.requests) == 8
    assert tls_server.handshakes == 1 < len(tls_server.requests)


def test_https_without_the_ca_is_not_trusted(myq, spool, tls_server, run_myq):
    jid = call_myq("--spool", spool, "enqueue", "http", json.dumps(
        {"url": tls_server.url("/s")})).stdout.strip()
    p = run_myq("--spool", spool, "worker", "--once", "--jitter", "0",
                "--backoff-base", "60")
    assert p.returncode == 0, p.stderr
    j = myq.open_store(spool).show(jid)
    assert j["state"] == "scheduled", j
    assert "CERTIFICATE_VERIFY_FAILED" in j["last_error"] \
        or "certificate verify failed" in j["last_error"], j
    assert tls_server.requests == []


def test_myq_http_ca_variable(myq, spool, tls_server, cert, run_myq):
    jid = call_myq("--spool", spool, "enqueue", "http", json.dumps(
        {"url": tls_server.url("/s")})).stdout.strip()
    p = run_myq("--spool", spool, "worker", "--once", "--jitter", "0",
                env={"MYQ_HTTP_CA": cert[0]})
    assert p.returncode == 0, p.stderr
    assert myq.open_store(spool).show(jid)["state"] == "done"


@pytest.mark.parametrize("content", [None, "not a certificate\n"])
def test_bad_http_ca_is_a_config_error(spool, run_myq, tmp_path, content):
    path = tmp_path / "ca.pem"
    if content is not None:
        path.write_text(content)
    p = run_myq("--spool", spool, "worker", "--once", "--http-ca", str(path))
    assert p.returncode == 78, p.stderr
    assert "--http-ca" in p.stderr and str(path) in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_tls_session_resumed_on_a_new_connection(myq, tls_server, cert):
    """After its kept connection is gone, the next connection to the same
    server resumes the TLS session (no certificate exchange)."""
    pool = myq.HttpPool(1, ca=cert[0])
    myq.http_handler(job("r1", tls_server.url("/x"), 1), pool=pool)
    pool.close()
    assert tls_server.wait_closed(1)
    myq.http_handler(job("r2", tls_server.url("/x"), 2), pool=pool)
    assert tls_server.handshakes == 2
    assert tls_server.resumed == [False, True]


# --------------------------------------------------------------------------
# gzip

def test_gzip_body_round_trip(myq, server):
    body = {"event": "door", "n": list(range(200)), "name": "caf\u00e9"}
    myq.http_handler(job("z1", server.url("/z"), body), gzip=True,
                     pool=myq.HttpPool(1))
    myq.http_handler(job("z2", server.url("/z"), "plain text " * 50), gzip=True)
    (r1, r2) = server.requests
    assert r1["headers"]["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(r1["body"]).decode("utf-8")) == body
    assert r1["headers"]["Content-Type"] == "application/json"
    assert len(r1["body"]) < len(json.dumps(body))
    assert gzip.decompress(r2["body"]) == b"plain text " * 50


def test_no_gzip_by_default_and_none_without_a_body(myq, server):
    myq.http_handler(job("z1", server.url("/z"), {"a": 1}))
    myq.http_handler(job("z2", server.url("/z"), method="GET"), gzip=True)
    (r1, r2) = server.requests
    assert "Content-Encoding" not in r1["headers"] and r1["body"] == b'{"a":1}'
    assert "Content-Encoding" not in r2["headers"] and r2["body"] == b""


# --------------------------------------------------------------------------
# batches

def batch_jobs(url):
    return [job("b1", url, {"t": 1}), job("b2", url, "text \u2603"),
            job("b3", url), job("b4", url, [1, 2])]


def test_http_batch_body_ids_and_key(myq, server):
    url = server.url("/batch")
    myq.http_batch(batch_jobs(url))
    (r,) = server.requests
    assert r["method"] == "POST"
    assert json.loads(r["body"].decode("utf-8")) == [{"t": 1}, "text \u2603", None, [1, 2]]
    assert r["headers"]["Content-Type"] == "application/json"
    assert r["headers"]["X-Myq-Ids"] == "b1,b2,b3,b4"
    key = r["headers"]["Idempotency-Key"]
    assert key not in ("b1", "b2", "b3", "b4") and len(key) >= 34, key
    assert r["headers"]["User-Agent"] == "myq/" + myq.__version__
    # the same ids: the same key; other ids or another order: another
    myq.http_batch(batch_jobs(url))
    myq.http_batch(batch_jobs(url)[:3])
    myq.http_batch(list(reversed(batch_jobs(url))))
    keys = server.keys()
    assert keys[0] == keys[1] and len(set(keys)) == 3, keys


def test_http_batch_key_is_sha256_of_the_ids(myq):
    ids = ["a", "b", "c"]
    assert myq._ids_key(ids) == "b-" + hashlib.sha256(b"a,b,c").hexdigest()[:32]


def test_http_batch_key_the_same_under_python3_light(myq, spool, tmp_path):
    """python3-light has no _hashlib (OpenSSL); hashlib's own SHA-256 is
    there, so a device computes the same keys.  (The modules that
    test_http's python3-light runs refuse, but hashlib.py itself.)"""
    code = ("import sys, json; sys.path.insert(0, %r); import myq; "
            "print(myq._ids_key(['x1', 'y2']))" % ROOT)
    blocked = [m for m in NOT_IN_LIGHT if m != "hashlib"]
    light = subprocess.run(
        [sys.executable, "-c", "import sys\nBLOCK=set(sys.argv[1].split(','))\n"
         "class L:\n def find_spec(self, n, p=None, t=None):\n"
         "  if n.split('.')[0] in BLOCK: raise ImportError(n)\n"
         "sys.meta_path.insert(0, L())\nexec(sys.argv[2])",
         ",".join(blocked), code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
        timeout=60)
    assert light.returncode == 0, light.stderr
    assert light.stdout.strip() == myq._ids_key(["x1", "y2"])


def test_http_batch_gzip_and_configured_headers(myq, server):
    url = server.url("/batch")
    myq.http_batch(batch_jobs(url), headers={"Authorization": "Bearer t"},
                   gzip=True, pool=myq.HttpPool(1))
    (r,) = server.requests
    assert r["headers"]["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(r["body"]))[0] == {"t": 1}
    assert r["headers"]["Authorization"] == "Bearer t"


@pytest.mark.parametrize("code,exc", [(503, "DestinationDown"), (429, "DestinationDown"),
                                      (400, "PermanentError")])
def test_http_batch_one_outcome(myq, server, code, exc):
    server.routes["/batch"] = lambda h: answer(h, code, b"why-%d" % code,
                                               [("Retry-After", "7")])
    with pytest.raises(getattr(myq, exc)) as e:
        myq.http_batch(batch_jobs(server.url("/batch")))
    assert "why-%d" % code in str(e.value)
    if exc == "DestinationDown":
        assert e.value.seconds == 7
    assert len(server.requests) == 1


def test_a_malformed_retry_after_is_no_delay_not_the_jobs_failure(myq, server):
    """'\u00b2' is a digit to str.isdigit, not to float(): a 503 carrying it
    in Retry-After raised ValueError, the job's own failure, which spent
    its attempts in an outage."""
    server.routes["/batch"] = lambda h: answer(h, 503, b"busy",
                                               [("Retry-After", "\u00b2")])
    with pytest.raises(myq.DestinationDown) as e:
        myq.http_batch(batch_jobs(server.url("/batch")))
    assert e.value.seconds is None
    assert myq._retry_after("\u00b2") is None and myq._retry_after(" 7 ") == 7.0


def test_http_batch_refuses_jobs_of_different_groups(myq, server):
    jobs = [job("a", server.url("/1"), 1), job("b", server.url("/2"), 2)]
    with pytest.raises(ValueError) as e:
        myq.http_batch(jobs)
    assert "http_group_key" in str(e.value)
    assert server.requests == []


def test_http_batch_with_a_bad_payload_fails_for_good(myq, server):
    jobs = [job("a", server.url("/1"), 1), {"id": "b", "type": "http",
                                            "payload": {"nourl": 1}}]
    with pytest.raises(myq.PermanentError):
        myq.http_batch(jobs)
    assert server.requests == []


def test_http_group_key(myq):
    k = myq.http_group_key
    u = "http://example.test/ev"
    base = k(job("1", u, {"a": 1}))
    assert k(job("2", u, "text")) == base               # bodies differ
    assert k(job("3", u)) == base
    assert k(job("4", u, 1, method="post")) == base
    assert k(job("5", u + "?x", 1)) != base
    assert k(job("6", u, 1, method="PUT")) != base
    h1 = k(job("7", u, 1, headers={"X-Dev": "a"}))
    assert h1 != base
    assert k(job("8", u, 1, headers={"x-dev": "a"})) == h1     # names: any case
    assert k(job("9", u, 1, headers={"X-Dev": "b"})) != h1
    assert k(job("10", u, 1, headers={"Content-Type": "text/csv"})) != base
    assert k(job("11", u, 1), {"Authorization": "x"}) != base
    bad = {"id": "12", "type": "http", "payload": "nope"}
    assert k(bad) != base and k(bad) != k(dict(bad, id="13"))
    hash(base)


# --------------------------------------------------------------------------
# User-Agent

def test_user_agent(myq, server):
    myq.http_handler(job("u1", server.url("/u"), 1))
    myq.http_handler(job("u2", server.url("/u"), 1, headers={"user-agent": "dev/2"}))
    myq.http_handler(job("u3", server.url("/u"), 1), headers={"User-Agent": "fleet/3"})
    agents = [r["headers"].get_all("User-Agent") for r in server.requests]
    assert agents == [["myq/" + myq.__version__], ["dev/2"], ["fleet/3"]]


# --------------------------------------------------------------------------
# through the worker: `myq policy TYPE batch=N gzip=true`

def test_worker_batches_http_jobs_gzipped_over_one_connection(myq, spool, server):
    p = call_myq("--spool", spool, "policy", "tele", "handler=http", "batch=10",
                 "gzip=true")
    assert p.returncode == 0, p.stderr
    ids = [myq.enqueue(spool, "tele", {"url": server.url("/b"), "body": {"n": i}},
                       id="t%02d" % i) for i in range(25)]
    myq.Worker(spool, jitter=0).run(drain=True)
    assert states(myq, spool, ids) == ["done"] * 25
    assert server.connections == 1
    sent = []
    for r in server.requests:
        assert r["headers"]["Content-Encoding"] == "gzip"
        bodies = json.loads(gzip.decompress(r["body"]).decode("utf-8"))
        got = r["headers"]["X-Myq-Ids"].split(",")
        assert [b["n"] for b in bodies] == [int(i[1:]) for i in got]
        assert r["headers"]["Idempotency-Key"] == myq._ids_key(got)
        sent += got
    assert sorted(sent) == ids and len(sent) == 25
    assert len(server.requests) < 25 and max(
        len(r["headers"]["X-Myq-Ids"].split(",")) for r in server.requests) <= 10


def test_worker_batches_as_http_group_key_says(myq, spool, server):
    """One rule for "which http jobs share a request": the worker's batch
    is http_group_key()'s (header names in any case are one header), and
    a job whose payload makes no request goes alone, not with the others
    (which would fail their batch and split it)."""
    p = call_myq("--spool", spool, "policy", "tele", "handler=http", "batch=10")
    assert p.returncode == 0, p.stderr
    u = server.url("/k")
    bad = myq.enqueue(spool, "tele", "nope", id="j0")
    ids = [myq.enqueue(spool, "tele", {"url": u, "body": i, "headers": {
        ("X-Dev" if i % 2 else "x-dev"): "a"}}, id="j%d" % i)
        for i in (1, 2, 3)]
    myq.Worker(spool, jitter=0).run(drain=True)
    assert states(myq, spool, [bad] + ids) == ["dead", "done", "done", "done"]
    assert [sorted(r["headers"]["X-Myq-Ids"].split(","))
            for r in server.requests] == [ids]


def test_policy_gzip_without_batch(myq, spool, server):
    p = call_myq("--spool", spool, "policy", "tele", "handler=http", "gzip=true")
    assert p.returncode == 0, p.stderr
    a = myq.enqueue(spool, "tele", {"url": server.url("/g"), "body": {"n": 1}})
    b = myq.enqueue(spool, "http", {"url": server.url("/g"), "body": {"n": 2}})
    myq.Worker(spool, jitter=0).run(drain=True)
    assert states(myq, spool, [a, b]) == ["done", "done"]
    by_key = dict((r["headers"]["Idempotency-Key"], r) for r in server.requests)
    assert by_key[a]["headers"]["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(by_key[a]["body"])) == {"n": 1}
    assert "Content-Encoding" not in by_key[b]["headers"]    # no policy: plain
    assert by_key[b]["body"] == b'{"n":2}'
