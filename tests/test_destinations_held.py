"""A held destination and a type's destinations, each on both stores:

- a held destination gets none of its jobs but its probe, the last of a
  type's `url` list too (a failure at A went on to a held B);
- `myq policy TYPE url=...` changed while the old destination is held:
  the jobs go to the new one at once, not after the old hold's probes.

The receivers are the suite's HTTP server (_http.Server, on 127.0.0.1);
waiting is on a worker's --drain ending or on what a server received.
"""
import json
import os

import pytest

from _core import call_myq, drain, listed, policy, wait_for
from _http import down, http_servers  # noqa: F401 (a fixture)
from _mosquitto import Broker, needs_mosquitto

both_stores = pytest.mark.parametrize("store", ["files", "sqlite"],
                                      indirect=True)


def enqueue(spool, type_, body):
    cp = call_myq("--spool", spool, "enqueue", type_, body)
    assert cp.returncode == 0, cp.stderr
    return cp.stdout.strip()


def stats(spool):
    return json.loads(call_myq("--spool", spool, "stats", "--json").stdout)


@both_stores
def test_a_failure_at_a_never_sends_the_job_to_a_held_b(
        spool, http_servers, tmp_path):
    """B is held (another type's failures): a job of `url=A B` that fails
    at A waits for the holds; B, the last, gets nothing of it (before:
    it was sent to B, held, because B was the last)."""
    a, b = http_servers(default=down), http_servers(default=down)
    policy(spool, "other", "url=" + b.url("/x"))
    for i in range(3):
        enqueue(spool, "other", '{"n": %d}' % i)
    drain(spool)
    assert len(b.requests) == 3
    assert [h["dest"] for h in stats(spool)["held"]] == [b.origin()]
    policy(spool, "tele", "url=%s %s" % (a.url("/in"), b.url("/in")))
    jid = enqueue(spool, "tele", '{"t": 1}')
    log = tmp_path / "w.log"
    drain(spool, log=log)
    assert len(a.requests) == 1
    assert len(b.requests) == 3, [r["path"] for r in b.requests]
    assert "event=failover" not in log.read_text()
    job = json.loads(call_myq("--spool", spool, "show", jid).stdout)
    assert job["state"] != "done" and job["attempts"] <= 1, job


@both_stores
def test_both_destinations_failing_cost_a_job_one_attempt_at_most(
        spool, http_servers, tmp_path):
    """A and B both answer 503: every job is tried at A then B until both
    are held; no job spends more than one attempt, none is dead, both
    destinations are held and stats say so."""
    a, b = http_servers(default=down), http_servers(default=down)
    policy(spool, "tele", "url=%s %s" % (a.url("/in"), b.url("/in")),
           "breaker=3")
    ids = [enqueue(spool, "tele", '{"n": %d}' % i) for i in range(8)]
    drain(spool, "--max-attempts", "2", log=tmp_path / "w.log")
    assert len(a.requests) == len(b.requests) == 3
    assert listed(spool, "dead") == []
    for jid in ids:
        job = json.loads(call_myq("--spool", spool, "show", jid).stdout)
        assert job["attempts"] <= 1, job
    st = stats(spool)
    assert [d["state"] for d in st["destinations"]["tele"]] == ["held", "held"]


@both_stores
def test_a_url_changed_while_its_destination_is_held_goes_there_at_once(
        spool, http_servers, procs, tmp_path):
    """A is down and held (its next probe a minute away) with jobs
    waiting; `myq policy tele url=B`: a running worker sends them all to
    B within a poll or two, and A's hold, no type's destination any
    more, ends (before: they waited for A's probes, one at a time)."""
    a, b = http_servers(default=down), http_servers()
    policy(spool, "tele", "url=" + a.url("/in"))
    ids = [enqueue(spool, "tele", '{"n": %d}' % i) for i in range(6)]
    log = tmp_path / "w.log"
    procs.worker(spool, "--poll", "0.05", "--jitter", "0", "--backoff-base",
                 "60", "--probe-max", "60", log=log)
    wait_for(lambda: "event=hold" in log.read_text(), what="A held")
    policy(spool, "tele", "url=" + b.url("/in"))
    wait_for(lambda: len(b.requests) >= 6, timeout=20,
             what="the jobs at B")
    wait_for(lambda: len(listed(spool, "done")) == 6, what="all done")
    assert sorted(r["headers"]["Idempotency-Key"] for r in b.requests) \
        == sorted(ids)
    assert len(a.requests) == 3
    assert stats(spool)["held"] == []
    assert "event=release dest=%s" % a.origin() in log.read_text()


# --------------------------------------------------------------------------
# The uplink's budget (--uplink-rate): what waits for it

class _Run(object):
    """What Uplink.wait looks at of a run."""
    timed_out = released = False
    deadline = float("inf")


def test_a_run_released_while_it_waits_for_the_uplink_sends_nothing(
        http_servers):
    """A shutdown's grace ran out while a thread's run waited for its
    turn: the worker put its job back; the request must not go out after
    that (before: the wait just ended and the body was sent, a second
    delivery of a job that was back in the queue)."""
    import threading
    import myq
    srv = http_servers()
    pool = myq.HttpPool(1, uplink=100.0)            # 1,000 B in any 10 s
    job = {"id": "j1", "type": "t", "payload": {"url": srv.url("/in"),
                                                "body": "x" * 900}}
    myq.http_handler(job, pool=pool, timeout=5)     # goes at once
    run = _Run()
    timer = threading.Timer(0.3, lambda: setattr(run, "released", True))
    timer.start()
    try:
        with pytest.raises(myq.RetryLater) as e:
            myq.http_handler(dict(job, id="j2"), pool=pool, timeout=5,
                             run=run)
        assert "not sent" in str(e.value)
    finally:
        timer.cancel()
    assert [r["headers"]["Idempotency-Key"] for r in srv.requests] == ["j1"]


def test_a_large_send_is_not_passed_for_ever_by_small_ones():
    """Runs wait their turns in order: a send larger than what a stream of
    small ones leaves goes once the window is empty, before the small
    ones that came after it (before: they kept the window busy and it
    never went while they flowed)."""
    import threading
    import myq
    up = myq.Uplink(100.0, window=1.0)              # 100 B in any 1 s
    order = []
    up.wait(10)

    def big():
        up.wait(150)
        order.append("big")

    t = threading.Thread(target=big)
    t.start()
    while not up._turns:            # (the big one waits its turn)
        threading.Event().wait(0.01)
    for i in range(15):
        up.wait(10)
        order.append(i)
    t.join(30)
    assert "big" in order and order.index("big") < 5, order


@needs_mosquitto
def test_an_mqtt_run_waiting_for_the_uplink_keeps_no_other_from_the_broker(
        spool, tmp_path, monkeypatch):
    """Two runs publish through one broker connection under a cap: the
    one that waits for the uplink does not hold the connection while it
    waits, so the other is not failed ("no turn on the connection", a
    destination failure of the pacing's making)."""
    import threading
    import myq
    monkeypatch.setattr(myq, "UPLINK_WINDOW", 3.0)
    b = Broker(tmp_path / "b").start()
    try:
        w = myq.Worker(spool, mqtt=b.url(), uplink_rate=100.0, timeout=1,
                       log=myq.Log(stream=open(os.devnull, "w")))
        job = {"id": "j", "payload": {"topic": "t", "message": "x" * 250}}
        assert w.mqtt_batch([job]) == [None]
        got = {}

        def first():
            got["k"] = w.mqtt_batch([dict(job, id="k")])     # waits ~3 s

        t = threading.Thread(target=first)
        t.start()
        while not w.http_pool.uplink._turns:
            threading.Event().wait(0.01)
        small = {"id": "s", "payload": {"topic": "t", "message": "y"}}
        got["s"] = w.mqtt_batch([small])
        t.join(30)
        assert got == {"k": [None], "s": [None]}, got
        w.resolver.mqtt.client.close()
    finally:
        b.stop()


# --------------------------------------------------------------------------
# Bad values of `url`

def test_a_url_that_no_job_could_be_sent_to_is_refused(spool):
    """A path or host that is not ASCII (every job of the type would be
    unsendable, dead; or its host never found), port 0, more than 8
    URLs: 64 and nothing changes (before: the first three were taken)."""
    for bad in ("http://h/\u00e4", "http://b\u00fccher.example/in",
                "http://h/in?q=\u00fc", "http://h:0/in",
                " ".join("http://h%d/" % i for i in range(50))):
        cp = call_myq("--spool", spool, "policy", "tele", "url=" + bad)
        assert cp.returncode == 64, (bad, cp.stdout)
        assert "ASCII" in cp.stderr and "url" in cp.stderr
    assert call_myq("--spool", spool, "policy", "--json").stdout.strip() \
        in ("{}", "")
    policy(spool, "tele", "url=http://xn--bcher-kva.example/%C3%A4")


def test_failover_under_the_uplink_cap_is_not_cut_by_its_waits(
        spool, http_servers, monkeypatch):
    """A job waits for the uplink, then A answers 503: it goes on to B in
    the same run; the waits are not the job's time, so they do not use
    up what failover leaves B (before: the time looked spent, and the
    job ended with A's failure, B never tried)."""
    import myq
    monkeypatch.setattr(myq, "UPLINK_WINDOW", 2.0)
    a, b, other = http_servers(default=down), http_servers(), http_servers()
    policy(spool, "other", "url=" + other.url("/o"))
    policy(spool, "tele", "url=%s %s" % (a.url("/in"), b.url("/in")))
    enqueue(spool, "other", json.dumps("o" * 190))
    jid = enqueue(spool, "tele", json.dumps("t" * 150))
    # 100 B/s: 200 B in any 2 s; the job's 1 s limit is shorter than its
    # waits (concurrency 1: in this thread, under the worker's SIGALRM)
    w = myq.Worker(spool, uplink_rate=100.0, poll=0.05, timeout=1,
                   log=myq.Log(stream=open(os.devnull, "w")))
    w.run(drain=True)
    assert len(a.requests) == 1
    assert [r["headers"]["Idempotency-Key"] for r in b.requests] == [jid]
    assert [(j["id"], j["attempts"]) for j in listed(spool, "done")
            if j["type"] == "tele"] == [(jid, 1)]


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_sigterm_while_a_job_waits_for_the_uplink_puts_it_back_uncounted(
        spool, http_servers, procs, tmp_path, concurrency):
    """SIGTERM while a job waits its turn on the uplink (~10 s): the
    worker ends at its grace (1 s), the job back, ready, no attempt
    spent, nothing sent of it; the next worker sends it."""
    import time
    from _core import stop
    srv = http_servers()
    policy(spool, "tele", "url=" + srv.url("/in"))
    first = enqueue(spool, "tele", json.dumps("a" * 900))
    second = enqueue(spool, "tele", json.dumps("b" * 900))
    log = tmp_path / "w.log"
    p = procs.worker(spool, "--poll", "0.05", "--grace", "1",
                     "--uplink-rate", "100/s", "--concurrency", concurrency,
                     log=log)
    assert srv.wait_requests(1)
    wait_for(lambda: "event=start" in log.read_text(), what="the start")
    t0 = time.monotonic()
    assert stop(p) == 0, log.read_text()
    assert time.monotonic() - t0 < 6, "the grace (1 s) was not kept"
    assert [r["headers"]["Idempotency-Key"] for r in srv.requests] == [first]
    job = json.loads(call_myq("--spool", spool, "show", second).stdout)
    assert job["state"] in ("ready", "pending", "queued"), job
    assert job["attempts"] == 0, job
    drain(spool)
    assert [r["headers"]["Idempotency-Key"] for r in srv.requests] == [
        first, second]


def test_url_and_topic_go_with_their_own_handler_only(spool):
    """url= with handler=mqtt (or topic= with handler=http) would send
    bodies to a handler that wants a topic (a url): every job dead.  64,
    nothing changed (before: taken)."""
    for args in (("handler=mqtt", "url=http://h/in"),
                 ("handler=http", "topic=a/b")):
        cp = call_myq("--spool", spool, "policy", "t", *args)
        assert cp.returncode == 64, (args, cp.stdout)
        assert "goes with handler=" in cp.stderr
    policy(spool, "t", "handler=http", "url=http://h/in")
    cp = call_myq("--spool", spool, "policy", "t", "handler=mqtt")
    assert cp.returncode == 64
    policy(spool, "m", "handler=mqtt", "topic=a/b")
    pol = json.loads(call_myq("--spool", spool, "policy", "--json").stdout)
    assert pol == {"t": {"handler": "http", "url": "http://h/in"},
                   "m": {"handler": "mqtt", "topic": "a/b"}}


@both_stores
def test_a_body_with_a_url_field_among_its_data_is_a_body(
        spool, http_servers):
    """Under url=, a payload in the http job's own form ({"url", "body",
    ...}) is refused, but a body that has a "url" field among other data
    (a page view, a link) is the body, and is sent (before: refused, 65;
    the same for a message with a "topic" field under topic=)."""
    srv = http_servers()
    policy(spool, "view", "url=" + srv.url("/in"))
    body = {"url": "https://example.com/page", "t": 3, "ms": 120}
    jid = enqueue(spool, "view", json.dumps(body))
    cp = call_myq("--spool", spool, "enqueue", "view", json.dumps(
        {"url": srv.url("/x"), "body": {"t": 1}, "method": "PUT"}))
    assert cp.returncode == 65
    policy(spool, "chat", "topic=site/chat")
    assert call_myq("--spool", spool, "enqueue", "chat", json.dumps(
        {"topic": "weather", "text": "rain"})).returncode == 0
    assert call_myq("--spool", spool, "enqueue", "chat", json.dumps(
        {"topic": "x/y", "message": "m", "qos": 1})).returncode == 65
    drain(spool)
    r = srv.hits("/in")
    assert [json.loads(x["body"]) for x in r] == [body]
    assert r[0]["headers"]["Idempotency-Key"] == jid


def test_policy_prints_a_url_line_that_a_shell_takes_back_as_it_was(
        spool, tmp_path):
    """`myq policy`'s line of a url with a query (& ?), a $ or quotes,
    given back to sh, sets the same value (before: only blanks were
    quoted: `&` sent the command to the background, `$x` was expanded)."""
    import subprocess
    from _core import myq_argv
    url = 'http://h/in?a=1&b=$HOME http://g/"x`id`'
    policy(spool, "t", "url=" + url)
    policy(spool, "m", "topic=site/7/temp")
    lines = call_myq("--spool", spool, "policy").stdout.splitlines()
    assert "m topic=site/7/temp" in lines
    line = [x for x in lines if x.startswith("t ")][0]
    argv = " ".join("'%s'" % a.replace("'", "'\\''") for a in myq_argv())
    cp = subprocess.run(["sh", "-c", "%s --spool '%s' policy t2 %s" % (
        argv, spool, line[2:])], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, universal_newlines=True, cwd=str(tmp_path))
    assert cp.returncode == 0, cp.stderr
    pol = json.loads(call_myq("--spool", spool, "policy", "--json").stdout)
    assert pol["t2"] == {"url": url}
