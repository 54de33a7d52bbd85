"""Intake: jobs taken in over a local HTTP endpoint and MQTT
subscriptions, each acknowledged only once its job is durable.

`myq intake` runs as a real process (its log read for the port it got:
--listen 127.0.0.1:0); HTTP requests are made here with raw sockets or
http.client, MQTT messages published with a QoS 1 publisher of the tests'
own to a real Mosquitto (tests/_mosquitto.py).  The crash points are real
kill -9s: the intake runs under a hook (myq._hook, as test_crashpoints
uses it) that exits 137 right after the spool's commit of incoming/, i.e.
between the durable write and the 202 or the PUBACK.
"""
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from _core import MYQ, ROOT, call_myq, clean_env, ls, one_line_error, run_myq, \
    cmdline, free_port, myq_argv, stop, wait_for
from _mosquitto import MOSQUITTO, Broker, _enc_len, _s

# The enqueue's durable step: incoming/'s fsync (files), or the commit of
# its transaction (the SQLite store).
CRASH_AFTER_COMMIT = (
    "import os, sys\n"
    "sys.path.insert(0, %r)\n"
    "import myq\n"
    "def hook(op, path, when):\n"
    "    if when == 'after' and (op == 'fsync' and "
    "path.rstrip('/').endswith('/incoming') or op == 'commit'):\n"
    "        os._exit(137)\n"
    "myq._hook = hook\n"
    "sys.exit(myq.main(sys.argv[1:]))\n" % ROOT)


class Intake(object):
    """`myq --spool SPOOL intake ARGS --log FILE` in the background."""

    def __init__(self, spool, tmp_path, *args, crash=False, env=None):
        self.log = str(tmp_path / ("intake-%d.log" % time.monotonic_ns()))
        args = list(args)
        if "--listen" in args and not args[args.index("--listen") + 1].startswith(
                "unix:") and not {"--listen-token-file", "--listen-open"} & set(args):
            # (these tests post without a token: a port needs one by default,
            # test_intake_access.py tests that)
            args.append("--listen-open")
        argv = ["--spool", spool, "intake", "--log", self.log] + args
        head = [sys.executable, "-c", CRASH_AFTER_COMMIT] if crash \
            else myq_argv()     # (its cached code: no compile at each start)
        self.proc = subprocess.Popen(head + argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE,
                                     env=clean_env(env), start_new_session=True)
        self.port = None

    def started(self, listen=True):
        def up():
            if self.proc.poll() is not None:
                raise AssertionError("intake exited %s: %s" % (
                    self.proc.returncode, self.proc.stderr.read().decode()))
            m = re.search(r"event=intake_start .*?listen=(\S+)", self.text())
            return m and m.group(1)
        got = wait_for(up, what="the intake to start")
        if listen:
            self.port = int(got.rpartition(":")[2])
        return self

    def text(self):
        try:
            with open(self.log) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self, sig=signal.SIGTERM):
        code = stop(self.proc, sig)
        self.proc.stderr.close()
        return code


@pytest.fixture
def intake(spool, tmp_path):
    started = []

    def start(*args, **kw):
        i = Intake(spool, tmp_path, *args, **kw)
        started.append(i)
        return i
    yield start
    for i in started:
        if i.proc.poll() is None:
            i.stop()


def post(port, type_, body, headers=None, path=None):
    """-> (status, headers dict, the answer parsed as JSON)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("POST", path or "/jobs/" + type_, body=body,
                  headers=headers or {})
        r = c.getresponse()
        data = r.read()
        try:
            answer = json.loads(data)
        except ValueError:
            answer = data.decode()
        return r.status, dict((k.lower(), v) for k, v in r.getheaders()), answer
    finally:
        c.close()


def get(port, path, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def auth(spool):
    """The header of the spool's token (myq init made it)."""
    with open(os.path.join(spool, "intake.token")) as f:
        return {"Authorization": "Bearer " + f.read().strip()}


def jobs(spool, state=None):
    cp = call_myq("--spool", spool, "list", *([state] if state else []), "--json")
    assert cp.returncode == 0, cp.stderr
    return [json.loads(line) for line in cp.stdout.splitlines()]


def payload_of(spool, jid):
    cp = call_myq("--spool", spool, "show", jid)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def stats(spool):
    cp = call_myq("--spool", spool, "stats", "--json")
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


NDJSON = {"Content-Type": "application/x-ndjson"}


# 1. HTTP: what is taken, what is answered ######################################

def test_one_json_payload_is_a_job_answered_202_with_its_id(spool, intake):
    i = intake("--listen", "127.0.0.1:0").started()
    status, _, answer = post(i.port, "reading", json.dumps({"t": 21.5}))
    assert status == 202, answer
    [jid] = answer["ids"]
    job = payload_of(spool, jid)
    assert (job["type"], job["payload"], job["state"]) == ("reading", {"t": 21.5}, "ready")
    assert ls(spool, "tmp") == []


def test_ndjson_is_many_jobs_in_order_with_their_own_ids(spool, intake):
    i = intake("--listen", "127.0.0.1:0").started()
    body = '{"id": "r-1", "v": 1}\n{"v": 2}\n\n{"v": 3}\n'
    status, _, answer = post(i.port, "r", body, NDJSON)
    assert status == 202, answer
    assert len(answer["ids"]) == 3 and answer["ids"][0] == "r-1"
    assert [payload_of(spool, j)["payload"]["v"] for j in answer["ids"]] == [1, 2, 3]


def test_idempotency_key_gives_the_id_and_a_repeat_the_same_answer(spool, intake):
    i = intake("--listen", "127.0.0.1:0").started()
    key = {"Idempotency-Key": "order-7"}
    first = post(i.port, "o", '{"n": 7}', key)
    again = post(i.port, "o", '{"n": 7}', key)
    assert first[0] == again[0] == 202
    assert first[2] == again[2] == {"ids": ["order-7"]}
    assert [j["id"] for j in jobs(spool)] == ["order-7"]       # not twice
    # the same id for another job is a conflict, and changes nothing
    status, _, answer = post(i.port, "o", '{"n": 8}', key)
    assert status == 409, answer
    assert payload_of(spool, "order-7")["payload"] == {"n": 7}


def test_a_conflicting_line_refuses_the_whole_request(spool, intake):
    i = intake("--listen", "127.0.0.1:0").started()
    assert post(i.port, "o", '{"id": "a", "v": 1}')[0] == 202
    status, _, answer = post(i.port, "o", '{"id": "b"}\n{"id": "a", "v": 2}\n', NDJSON)
    assert status == 409, answer
    assert [j["id"] for j in jobs(spool)] == ["a"]             # b not kept


@pytest.mark.parametrize("path,body,headers,why", [
    ("/jobs/t", "{bad", {}, "not JSON"),
    ("/jobs/t", '{"a": 1}\n{bad\n', NDJSON, "line 2"),
    ("/jobs/.hidden", "1", {}, "type"),
    ("/jobs/t", '{"id": "no spaces"}', {}, "id"),
    ("/jobs/t", "1", {"Idempotency-Key": "a/b"}, "Idempotency-Key"),
    ("/jobs/t", b"\xff\xfe", {}, "UTF-8"),
    ("/jobs/t", "", NDJSON, "no job"),
    ("/jobs/t", '{"id": "x"}\n{"id": "x"}\n', NDJSON, "repeats"),
])
def test_bad_json_type_or_id_is_400_and_nothing_kept(spool, intake, path, body,
                                                      headers, why):
    i = intake("--listen", "127.0.0.1:0").started()
    status, _, answer = post(i.port, None, body, headers, path=path)
    assert status == 400, answer
    assert why in answer["error"], answer
    assert jobs(spool) == [] and ls(spool, "tmp") == []


def test_too_large_is_413_before_the_body_is_read(spool, intake):
    i = intake("--listen", "127.0.0.1:0", "--listen-max-bytes", "64K",
               "--max-job-bytes", "16K").started()
    # a Content-Length over --listen-max-bytes: answered on the head alone
    s = socket.create_connection(("127.0.0.1", i.port), 10)
    s.sendall(b"POST /jobs/t HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n")
    head = s.recv(4096)
    s.close()
    assert head.startswith(b"HTTP/1.1 413 "), head
    # within --listen-max-bytes but larger than a job may be
    status, _, answer = post(i.port, "t", json.dumps("x" * 20000))
    assert status == 413, answer
    assert "--max-job-bytes" in answer["error"]
    # an over-long head
    s = socket.create_connection(("127.0.0.1", i.port), 10)
    s.sendall(b"GET /health HTTP/1.1\r\nX: " + b"a" * 10000 + b"\r\n\r\n")
    assert s.recv(4096).startswith(b"HTTP/1.1 431 ")
    s.close()
    assert jobs(spool) == []


def test_a_bound_is_429_a_guard_503_with_retry_after_and_counted(spool, intake):
    assert call_myq("--spool", spool, "policy", "t", "max_queued=2").returncode == 0
    i = intake("--listen", "127.0.0.1:0").started()
    assert post(i.port, "t", "1")[0] == 202
    # 2 lines where 1 fits: refused whole, nothing of it kept
    status, headers, answer = post(i.port, "t", "2\n3\n", NDJSON)
    assert status == 429, answer
    assert int(headers["retry-after"]) > 0
    assert len(jobs(spool)) == 1
    assert post(i.port, "t", "2")[0] == 202
    assert post(i.port, "t", "3")[0] == 429
    st = stats(spool)
    assert st["refused"] == 3, st          # the two lines, then the one
    i.stop()
    # the disk-free guard
    j = intake("--listen", "127.0.0.1:0", "--min-free", "1000000G").started()
    status, headers, answer = post(j.port, "u", "1")
    assert status == 503, answer
    assert int(headers["retry-after"]) > 0 and "free" in answer["error"]
    assert [x["type"] for x in jobs(spool)] == ["t", "t"]


def test_health_answers_as_check_and_metrics_as_stats(spool, intake):
    i = intake("--listen", "127.0.0.1:0").started()
    status, text = get(i.port, "/health")
    assert status == 200 and json.loads(text) == {
        "ok": True, "spool": spool, "problems": []}
    post(i.port, "t", "1")
    status, text = get(i.port, "/metrics")
    assert status == 200
    assert 'myq_jobs{queue="spool",state="ready"} 1' in text.splitlines()
    assert get(i.port, "/nothing")[0] == 404
    i.stop()
    j = intake("--listen", "127.0.0.1:0", "--min-free", "1000000G").started()
    status, text = get(j.port, "/health")
    assert status == 503 and json.loads(text)["ok"] is False


def test_keep_alive_pipelining_and_expect_100_continue(spool, intake):
    i = intake("--listen", "127.0.0.1:0").started()
    s = socket.create_connection(("127.0.0.1", i.port), 10)
    req = b"POST /jobs/t HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n1"
    s.sendall(req * 3)              # three at once, on one connection
    got = b""
    while got.count(b"HTTP/1.1 202 ") < 3:
        data = s.recv(4096)
        assert data, got
        got += data
    s.sendall(b"POST /jobs/t HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
              b"Expect: 100-continue\r\n\r\n")
    assert s.recv(4096).startswith(b"HTTP/1.1 100 Continue")
    s.sendall(b"1")
    assert s.recv(4096).startswith(b"HTTP/1.1 202 ")
    s.close()
    assert len(jobs(spool)) == 4


# 2. HTTP: tokens, slow and hostile clients ####################################

def test_a_token_is_required_off_loopback(spool, tmp_path):
    cp = run_myq("--spool", spool, "intake", "--listen", "0.0.0.0:0",
                 "--listen-open")
    assert cp.returncode == 64
    assert "--listen-open" in one_line_error(cp)


def test_with_a_token_every_request_needs_it(spool, intake, tmp_path):
    tok = tmp_path / "token"
    tok.write_text("s3cret-token\n")
    i = intake("--listen", "0.0.0.0:0", "--listen-token-file", str(tok)).started()
    assert post(i.port, "t", "1")[0] == 401
    assert post(i.port, "t", "1", {"Authorization": "Bearer s3cret-tokex"})[0] == 401
    assert get(i.port, "/health")[0] == 401
    assert get(i.port, "/metrics", {"Authorization": "Bearer wrong"})[0] == 401
    assert jobs(spool) == []
    auth = {"Authorization": "Bearer s3cret-token"}
    assert post(i.port, "t", "1", auth)[0] == 202
    assert get(i.port, "/health", auth)[0] == 200


def test_a_slow_client_never_delays_another(spool, intake):
    """Slowloris: one byte a second.  Another client's 202 comes while the
    slow one is still sending its head; the slow one is cut at
    --listen-timeout."""
    i = intake("--listen", "127.0.0.1:0", "--listen-timeout", "4").started()
    slow = socket.create_connection(("127.0.0.1", i.port), 10)
    sent = []
    done = threading.Event()

    def drip():
        try:
            for b in b"POST /jobs/slow HTTP/1.1\r\nContent-Length: 1\r\n\r\n1":
                if done.is_set():
                    return
                slow.sendall(bytes([b]))
                sent.append(b)
                time.sleep(1.0)
        except OSError:
            pass
    t = threading.Thread(target=drip, daemon=True)
    t.start()
    wait_for(lambda: len(sent) >= 2, what="the slow client to start")
    status, _, answer = post(i.port, "quick", "1")
    at = len(sent)
    assert status == 202, answer
    assert at < 5, "the quick client waited for %d bytes of the slow one" % at
    # the slow client is cut at --listen-timeout with a 408
    slow.settimeout(15)
    answer = slow.recv(4096)
    done.set()
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    t.join(5)
    slow.close()
    assert [j["type"] for j in jobs(spool)] == ["quick"]


def test_many_idle_connections_do_not_lock_others_out(spool, intake):
    i = intake("--listen", "127.0.0.1:0", "--listen-timeout", "30").started()
    idle = [socket.create_connection(("127.0.0.1", i.port), 10) for _ in range(80)]
    for s in idle:
        s.sendall(b"P")
    try:
        assert post(i.port, "t", "1")[0] == 202
    finally:
        for s in idle:
            s.close()


def test_garbage_is_answered_400_and_the_endpoint_goes_on(spool, intake):
    i = intake("--listen", "127.0.0.1:0").started()
    for junk in (b"\x16\x03\x01\x02\x00\r\n\r\n", b"GET /\r\n\r\n",
                 b"POST /jobs/t HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                 b"POST /jobs/t HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                 b"POST /jobs/t HTTP/1.1\r\nbad header\r\n\r\n",
                 # ('\xb2' is '²', a digit to str.isdigit, not to int():
                 # the whole intake died of it)
                 b"POST /jobs/t HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n"):
        s = socket.create_connection(("127.0.0.1", i.port), 10)
        s.sendall(junk)
        head = s.recv(4096)
        s.close()
        assert re.match(rb"HTTP/1.1 4(00|11) ", head), (junk, head)
    assert post(i.port, "t", "1")[0] == 202
    assert i.proc.poll() is None


# 3. HTTP: durability before the 202 (the crash point) ##########################

@pytest.mark.parametrize("how", ["key", "ndjson"])
def test_killed_between_the_commit_and_the_202_the_retry_makes_no_second_job(
        spool, intake, how):
    if how == "key":
        args = ("t", '{"n": 1}', {"Idempotency-Key": "k-1"})
        want = ["k-1"]
    else:
        args = ("t", '{"id": "a", "n": 1}\n{"id": "b", "n": 2}\n', NDJSON)
        want = ["a", "b"]
    i = intake("--listen", "127.0.0.1:0", crash=True).started()
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        post(i.port, *args)             # no answer: killed at the commit
    assert i.proc.wait(10) == 137
    assert sorted(j["id"] for j in jobs(spool)) == want    # durable already
    j = intake("--listen", "127.0.0.1:0").started()
    status, _, answer = post(j.port, *args)             # the client's retry
    assert (status, answer) == (202, {"ids": want})
    assert sorted(j["id"] for j in jobs(spool)) == want    # once each


# 4. MQTT ######################################################################

needs_mosquitto = pytest.mark.skipif(
    MOSQUITTO is None, reason="needs the mosquitto MQTT broker "
    "(apt-get install mosquitto mosquitto-clients)")


def publish(port, messages, qos=1):
    """Publish (topic, bytes) at QoS 1 and wait for each PUBACK (a
    publisher of the tests' own)."""
    sock = socket.create_connection(("127.0.0.1", port), 10)
    try:
        vh = _s(b"MQTT") + bytes([4, 0x02]) + (0).to_bytes(2, "big")
        pl = _s(("pub-%d" % os.getpid()).encode())
        sock.sendall(b"\x10" + _enc_len(len(vh) + len(pl)) + vh + pl)
        assert sock.recv(4)[:1] == b"\x20"
        for n, (topic, data) in enumerate(messages, 1):
            body = _s(topic.encode()) + (n.to_bytes(2, "big") if qos else b"") + data
            sock.sendall(bytes([0x30 | qos << 1]) + _enc_len(len(body)) + body)
            if qos:
                got = b""
                while len(got) < 4:
                    got += sock.recv(4 - len(got))
                assert got == b"\x40\x02" + n.to_bytes(2, "big"), got
        sock.sendall(b"\xe0\x00")
    finally:
        sock.close()


@pytest.fixture
def pbroker(tmp_path):
    """A broker that keeps sessions across its restarts."""
    if MOSQUITTO is None:
        pytest.skip("needs the mosquitto MQTT broker (apt-get install mosquitto)")
    b = Broker(tmp_path / "broker", persistence=True).start()
    yield b
    b.stop()


def subscribe_args(b, *subs):
    out = ["--mqtt", b.url(), "--mqtt-client-id", "myq-intake-test"]
    for s in subs:
        out += ["--subscribe", s]
    return out


def wait_jobs(spool, n, what="jobs"):
    return wait_for(lambda: len(jobs(spool)) >= n and jobs(spool), timeout=30,
                    what="%d %s (have %d)" % (n, what, len(jobs(spool))))


def subscribed(b, i):
    wait_for(lambda: b.count("Received SUBSCRIBE from myq-intake-test") >= 1
             and "event=intake_connected" in i.text(), what="the subscription")


@needs_mosquitto
def test_messages_become_jobs_of_their_type_with_their_own_ids(spool, intake, pbroker):
    i = intake(*subscribe_args(pbroker, "sensors/+/temp=temp", "alarms/#=alarm"))
    i.started(listen=False)
    subscribed(pbroker, i)
    # (a session a type: the second's SUBSCRIBE may come after the first's,
    # and a message before it is not that session's)
    wait_for(lambda: pbroker.count("sensors/+/temp (QoS 1)") and
             pbroker.count("alarms/# (QoS 1)"), what="both subscriptions")
    publish(pbroker.port, [("sensors/k1/temp", b'{"id": "m-1", "c": 4}'),
                           ("sensors/k1/temp", b"21.5"),
                           ("alarms/door", b"open"),
                           ("sensors/k2/temp", b'{"id": "m-1", "c": 4}')])  # again
    # (another type's session may take its message first: the repeat is
    # sent to the same type's, where the order is kept)
    got = wait_jobs(spool, 4)       # 3, and the other m-1 in failed/
    wait_for(lambda: pbroker.count("Received PUBACK from myq-intake-test") >= 4,
             what="4 PUBACKs")
    got = [j for j in got if j["state"] != "failed"]
    by_id = dict((j["id"], j) for j in got)
    assert len(got) == 3, got       # the other m-1 kept in failed/ (test_intake_access)
    m1 = payload_of(spool, "m-1")
    assert (m1["type"], m1["payload"]) == (
        "temp", {"topic": "sensors/k1/temp", "message": {"id": "m-1", "c": 4}})
    others = sorted((payload_of(spool, j)["type"], json.dumps(
        payload_of(spool, j)["payload"], sort_keys=True)) for j in by_id if j != "m-1")
    assert others == [("alarm", '{"message": "open", "topic": "alarms/door"}'),
                      ("temp", '{"message": 21.5, "topic": "sensors/k1/temp"}')]


@needs_mosquitto
def test_killed_before_the_puback_the_message_comes_again_as_the_same_job(
        spool, intake, pbroker):
    i = intake(*subscribe_args(pbroker, "s/#=reading"), crash=True)
    i.started(listen=False)
    subscribed(pbroker, i)
    publish(pbroker.port, [("s/1", b'{"id": "r-1", "v": 1}')])
    assert i.proc.wait(15) == 137               # killed after the commit
    assert [j["id"] for j in jobs(spool)] == ["r-1"]
    assert pbroker.count("Received PUBACK from myq-intake-test") == 0
    publish(pbroker.port, [("s/1", b'{"v": 2}')])       # while myq is down
    j = intake(*subscribe_args(pbroker, "s/#=reading"))
    j.started(listen=False)
    wait_for(lambda: pbroker.count("Received PUBACK from myq-intake-test") >= 2,
             what="the redelivered message's PUBACK")
    got = wait_jobs(spool, 2)
    assert len(got) == 2, got                   # r-1 once, and the other
    assert sorted(payload_of(spool, x["id"])["payload"]["message"]["v"]
                  for x in got) == [1, 2]


@needs_mosquitto
def test_a_bad_message_behind_good_ones_drops_itself_alone(spool, intake, pbroker):
    """Messages that come together are taken in as one batch; one too
    large refused the batch, and the batch's first -- a good one -- was
    dropped and acknowledged in its place: its job lost."""
    args = subscribe_args(pbroker, "in/#=t") + ["--max-job-bytes", "2K"]
    i = intake(*args)
    i.started(listen=False)
    subscribed(pbroker, i)
    i.stop()                # the session stays: these wait at the broker
    publish(pbroker.port, [("in/ok1", b'{"id": "good1"}'), ("in/big", b"a" * 5000),
                           ("in/ok2", b'{"id": "good2"}')])
    j = intake(*args)
    j.started(listen=False)
    wait_for(lambda: pbroker.count("Received PUBACK from myq-intake-test") >= 3,
             what="3 PUBACKs")
    assert sorted(x["id"] for x in jobs(spool)) == ["good1", "good2"]
    drops = [x for x in j.text().splitlines() if "message dropped" in x]
    assert len(drops) == 1 and "topic=in/big" in drops[0], drops


@needs_mosquitto
def test_a_broker_restart_is_reconnected(spool, intake, pbroker):
    i = intake(*subscribe_args(pbroker, "s/#=reading"))
    i.started(listen=False)
    subscribed(pbroker, i)
    publish(pbroker.port, [("s/1", b"1")])
    wait_jobs(spool, 1)
    # its PUBACK at the broker before the restart (else the broker sends
    # it again, at least once: a second job of message 1)
    wait_for(lambda: pbroker.count("Received PUBACK from myq-intake-test") >= 1,
             what="the PUBACK")
    pbroker.stop()
    pbroker.start()
    wait_for(lambda: i.text().count("event=intake_connected") >= 2, timeout=60,
             what="the intake to connect again")
    publish(pbroker.port, [("s/1", b"2")])
    got = wait_jobs(spool, 2)
    assert sorted(payload_of(spool, x["id"])["payload"]["message"] for x in got) == [1, 2]
    assert i.proc.poll() is None


@needs_mosquitto
def test_a_full_spool_withholds_the_puback_until_there_is_room(spool, intake, pbroker):
    assert call_myq("--spool", spool, "policy", "r", "max_queued=2").returncode == 0
    i = intake(*subscribe_args(pbroker, "s/#=r"))
    i.started(listen=False)
    subscribed(pbroker, i)
    publish(pbroker.port, [("s/1", b'{"n": %d}' % n) for n in range(5)])
    wait_jobs(spool, 2)
    wait_for(lambda: "event=intake_held" in i.text(), what="the intake to wait")
    # (the broker logs a PUBACK a moment after the intake sent it)
    wait_for(lambda: pbroker.count("Received PUBACK from myq-intake-test") >= 2,
             what="2 PUBACKs")
    time.sleep(1.5)     # two more tries of the held message (0.5 s, 1 s)
    assert pbroker.count("Received PUBACK from myq-intake-test") == 2
    assert len(jobs(spool)) == 2
    assert stats(spool)["refused"] == 1, stats(spool)     # once, not per retry
    # room again: the rest come, in order, none lost
    assert call_myq("--spool", spool, "policy", "r", "max_queued=").returncode == 0
    got = wait_jobs(spool, 5)
    wait_for(lambda: pbroker.count("Received PUBACK from myq-intake-test") >= 5,
             what="5 PUBACKs")
    assert sorted(payload_of(spool, x["id"])["payload"]["message"]["n"]
                  for x in got) == [0, 1, 2, 3, 4]


@needs_mosquitto
def test_a_message_too_large_for_a_job_is_said_and_acknowledged(spool, intake,
                                                                  pbroker):
    i = intake(*subscribe_args(pbroker, "s/#=r") + ["--max-job-bytes", "1K"])
    i.started(listen=False)
    subscribed(pbroker, i)
    publish(pbroker.port, [("s/big", b'"%s"' % (b"x" * 4000)), ("s/small", b"1")])
    got = wait_jobs(spool, 1)
    wait_for(lambda: pbroker.count("Received PUBACK from myq-intake-test") >= 2,
             what="both PUBACKs")
    assert [payload_of(spool, x["id"])["payload"]["topic"] for x in got] == ["s/small"]
    assert re.search(r"event=intake_refused .*topic=s/big .*message dropped.*--max-job-bytes",
                     i.text()), i.text()


@needs_mosquitto
@pytest.mark.skipif(shutil.which("openssl") is None,
                    reason="needs the openssl command to make test certificates")
def test_messages_over_mqtts_become_jobs(spool, intake, tmp_path):
    from test_mqtt import _make_certs
    d = tmp_path / "pki"
    d.mkdir()
    _make_certs(d)
    plain = free_port()
    b = Broker(tmp_path / "broker", extra=[
        "cafile %s/ca.pem" % d, "certfile %s/server.pem" % d,
        "keyfile %s/server.key" % d,
        "listener %d 127.0.0.1" % plain]).start()       # the publisher's
    try:
        i = intake("--mqtt", "mqtts://127.0.0.1:%d" % b.port, "--mqtt-ca",
                   str(d / "ca.pem"), "--mqtt-client-id", "myq-intake-test",
                   "--subscribe", "s/#=r")
        i.started(listen=False)
        subscribed(b, i)
        publish(plain, [("s/%d" % n, b'{"n": %d}' % n) for n in range(20)])
        got = wait_jobs(spool, 20)
        assert sorted(payload_of(spool, x["id"])["payload"]["message"]["n"]
                      for x in got) == list(range(20))
        wait_for(lambda: b.count("Received PUBACK from myq-intake-test") >= 20,
                 what="20 PUBACKs over TLS")
    finally:
        b.stop()


def hostile_broker(answers):
    """A TCP server that answers each connection's CONNECT with the next
    of `answers` (bytes) and counts the connections."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    seen = []

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            seen.append(c)
            try:
                c.recv(4096)
                c.sendall(answers[min(len(seen), len(answers)) - 1])
            except OSError:
                pass
    threading.Thread(target=serve, daemon=True).start()
    return srv, seen


@pytest.mark.parametrize("answer", [
    b"\x20\x02\x00\x00" + b"\x30\xff\xff\xff\xff\xff",        # a bad length
    b"\x20\x02\x00\x00" + b"\x90\xff\xff\xff\x7f",            # 256 MB, not a PUBLISH
    b"\x20\x02\x00\x00" + b"\x50\x02\x00\x01",                # PUBREC: not ours
    b"\x20\x02\x00\x00" + b"\x32\x03\x00\x09a",               # topic past the end
    b"\x20\x02\x00\x00" + b"\x90\x04\x00\x01\x01\x01",        # SUBACK: 2 codes
    b"\x40\x02\x00\x01",                                      # not a CONNACK
])
def test_a_hostile_broker_is_an_error_and_a_reconnect_never_a_crash(
        spool, intake, answer):
    srv, seen = hostile_broker([answer])
    try:
        i = intake("--mqtt", "mqtt://127.0.0.1:%d" % srv.getsockname()[1],
                   "--subscribe", "s/#=r")
        i.started(listen=False)
        wait_for(lambda: len(seen) >= 2, timeout=30, what="a reconnect")
        assert "event=error" in i.text()
        assert "protocol error" in i.text() or "CONNACK" in i.text(), i.text()
        assert i.proc.poll() is None
    finally:
        srv.close()
        for c in seen:
            c.close()
    assert jobs(spool) == []


# 5. Running it: supervise and the init scripts ################################

def intake_pids(log_text):
    return [int(p) for p in re.findall(r"event=worker_start slot=intake pid=(\d+)",
                                       log_text)]


def test_supervise_keeps_an_intake_running_beside_its_workers(spool, tmp_path):
    port = free_port()
    log = str(tmp_path / "sup.log")
    sup = subprocess.Popen([sys.executable, MYQ, "--spool", spool, "supervise",
                            "--log", log, "--listen", "127.0.0.1:%d" % port,
                            "--listen-timeout", "3s"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=clean_env(), start_new_session=True)
    text = lambda: open(log).read() if os.path.exists(log) else ""  # noqa: E731
    try:
        wait_for(lambda: "event=intake_start" in text(), what="the intake")
        first = intake_pids(text())[0]
        assert "--listen-timeout" in open("/proc/%d/cmdline" % first).read()
        assert post(port, "t", "1", auth(spool))[0] == 202
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: len(intake_pids(text())) == 2 and
                 text().count("event=intake_start") == 2, what="a new intake")
        assert post(port, "t", "2", auth(spool))[0] == 202
        second = intake_pids(text())[1]
    finally:
        assert stop(sup) == 0
    assert "event=intake_stop pid=%d" % second in text()
    assert not os.path.exists("/proc/%d/cmdline" % second) or \
        open("/proc/%d/stat" % second).read().split(") ")[1][0] in "ZX"
    assert len(jobs(spool)) == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a spool owned by nobody)")
def test_intake_runs_as_the_spools_owner(tmp_path):
    import pwd
    from _core import world_python
    python = world_python()
    if python is None:
        pytest.skip("no interpreter that user nobody may run")
    nobody = pwd.getpwnam("nobody")
    top = tempfile.mkdtemp(prefix="myq-intake-owner-")     # (tmp_path is 0700)
    os.chmod(top, 0o755)
    tmp_path = type(tmp_path)(top)
    spool = str(tmp_path / "spool")
    assert run_myq("--spool", spool, "init", "--owner", "nobody").returncode == 0
    os.mkdir(str(tmp_path / "log"))
    os.chown(str(tmp_path / "log"), nobody.pw_uid, nobody.pw_gid)
    log = str(tmp_path / "log" / "intake.log")
    p = subprocess.Popen([python, MYQ, "--spool", spool, "intake", "--listen",
                          "127.0.0.1:0", "--log", log], env=clean_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        port = int(wait_for(lambda: re.search(
            r"listen=127.0.0.1:(\d+)", open(log).read() if os.path.exists(log)
            else "") or (p.poll() is not None and pytest.fail(p.stderr.read().decode())),
            what="the intake").group(1))
        uids = [line.split()[1:] for line in open("/proc/%d/status" % p.pid)
                if line.startswith("Uid:")][0]
        assert set(int(u) for u in uids) == {nobody.pw_uid}
        status, _, answer = post(port, "t", "1", auth(spool))
        assert status == 202, answer
        assert os.stat(os.path.join(spool, "incoming", answer["ids"][0] + ".json")
                       ).st_uid == nobody.pw_uid
    finally:
        stop(p)
        p.stderr.close()
        shutil.rmtree(top, ignore_errors=True)


def test_supervise_refuses_bad_intake_options_at_once(spool):
    for args, want in ((["--listen", "0.0.0.0:1", "--listen-open"], "--listen-open"),
                       (["--subscribe", "a/#=t"], "--mqtt"),
                       (["--listen", "nowhere"], "[ADDR]:PORT"),
                       (["--subscribe", "a/#b=t", "--mqtt", "mqtt://h"], "filter")):
        cp = run_myq("--spool", spool, "supervise", "--dry-run", *args)
        assert cp.returncode == 64, (args, cp.stderr)
        assert want in one_line_error(cp)


def test_initd_passes_the_intake_settings(tmp_path):
    import test_initd
    if not test_initd.BUSYBOX:
        pytest.skip("busybox not installed (apt-get install busybox)")
    bindir = tmp_path / "bb"
    bindir.mkdir()
    subprocess.check_call([test_initd.BUSYBOX, "--install", "-s", str(bindir)])
    if os.path.lexists(str(bindir / "python3")):
        os.unlink(str(bindir / "python3"))
    os.symlink(sys.executable, str(bindir / "python3"))
    port = free_port()
    svc = test_initd.Service(tmp_path / "svc", str(bindir), settings={
        "MYQ_LISTEN": "127.0.0.1:%d" % port,
        "MYQ_SUBSCRIBE": "a/+/b=t1 c/#=t2", "MYQ_ARGS": "--mqtt mqtt://127.0.0.1:1"})
    try:
        r = svc.run("start")
        assert r.returncode == 0, r.stdout + r.stderr
        cmd = cmdline(svc.pid(), text=True)
        assert "--listen 127.0.0.1:%d --subscribe a/+/b=t1 --subscribe c/#=t2" \
            % port in cmd, cmd
        assert wait_for(lambda: post(port, "t", "1", auth(svc.spool))[0] == 202
                        if "event=intake_start" in test_initd.read(svc.logfile)
                        else False, what="the intake of the service")
        r = svc.run("stop")
        assert r.returncode == 0, r.stdout + r.stderr
        assert svc.leftovers() == []
    finally:
        svc.cleanup()


def test_procd_passes_the_intake_settings(tmp_path):
    import test_procd
    if not test_procd.BUSYBOX:
        pytest.skip("busybox not installed (apt-get install busybox)")
    o = test_procd.OpenWrt(tmp_path)
    try:
        o.settings(listen="127.0.0.1:8440", subscribe=" a/+/b=t1  c/#=t2 ",
                   args="--mqtt mqtt://127.0.0.1:1")
        o.ok("start")
        cmd = o.params()["command"]
        i = cmd.index("--listen")
        assert cmd[i:] == ["--listen", "127.0.0.1:8440", "--subscribe", "a/+/b=t1",
                           "--subscribe", "c/#=t2", "--log", o.log], cmd
        o.settings(listen="0.0.0.0:8440",           # no token: refused at start
                   args="--mqtt mqtt://127.0.0.1:1 --listen-open")
        r = o.run("reload")
        assert "--listen-open" in r.stderr
    finally:
        o.cleanup()
