"""The built-in `mqtt` type (and what a destination failure is), against a real broker: Debian's mosquitto (tests/_mosquitto.py
starts one per test on a free loopback port; the tests skip, naming the
package, without it).  What the broker delivers is read by a subscriber of
the tests' own (QoS 1), what it received from its log.

Jobs go in with `myq enqueue` (in this process: call_myq) and out through
`myq worker --mqtt URL` as a real process, except where the client's own
behaviour (keep-alive, reconnect) or the batch API is under test.
"""
import json
import os
import signal
import socket
import subprocess
import threading

import pytest

from _core import (FAST, call_myq, ls, one_line_error, run_myq, show,
                   start_worker, stop, wait_for)
from _mosquitto import Broker, Subscriber, broker, needs_mosquitto  # noqa: F401

pytestmark = needs_mosquitto


def enqueue(spool, payload, *opts):
    cp = call_myq("--spool", spool, "enqueue", "mqtt", json.dumps(payload), *opts)
    assert cp.returncode == 0, cp.stderr
    return cp.stdout.strip()


def work(spool, broker_url, *opts, timeout=120):
    """myq worker --drain --mqtt URL, a real process -> CompletedProcess."""
    return run_myq("--spool", spool, "worker", "--drain", "--mqtt", broker_url,
                   *(FAST + opts), timeout=timeout)


def stats(spool):
    cp = call_myq("--spool", spool, "stats", "--json")
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


# 1. delivery ###################################################################

def test_qos1_200_jobs_each_received_once_in_order_per_topic(spool, broker):
    sub = Subscriber(broker.port, "t/#").start()
    for i in range(200):
        enqueue(spool, {"topic": "t/%s" % "ab"[i % 2], "message": {"n": i}})
    cp = work(spool, broker.url())
    assert cp.returncode == 0, cp.stderr
    st = stats(spool)
    assert (st["done"], st["dead"], st["ready"], st["scheduled"]) == (200, 0, 0, 0), st
    sub.wait_count(200)
    sub.stop()
    assert len(sub.messages) == 200, "duplicates: %d" % (len(sub.messages) - 200)
    for topic, first in (("t/a", 0), ("t/b", 1)):
        got = [json.loads(p)["n"] for p in sub.payloads(topic)]
        assert got == list(range(first, 200, 2)), (topic, got)
    # QoS 1 on the wire, and one connection for the whole run
    assert broker.count("Sending PUBACK to myq-") == 200
    assert broker.connections("myq-") == 1


def test_qos0_retain_and_string_versus_json_messages(spool, broker):
    sub = Subscriber(broker.port, "m/#").start()
    enqueue(spool, {"topic": "m/text", "message": "plain text, ü", "qos": 0})
    enqueue(spool, {"topic": "m/json", "message": {"a": [1, 2.5, None], "b": "x"}})
    enqueue(spool, {"topic": "m/str-json", "message": '{"not": "parsed"}'})
    enqueue(spool, {"topic": "m/number", "message": 42})
    enqueue(spool, {"topic": "m/empty"})
    enqueue(spool, {"topic": "m/kept", "message": "retained", "retain": True})
    cp = work(spool, broker.url())
    assert cp.returncode == 0, cp.stderr
    assert stats(spool)["done"] == 6
    msgs = {t: (p, retain) for t, p, retain, _ in sub.wait_count(6)}
    assert msgs["m/text"] == ("plain text, ü".encode(), False)
    assert msgs["m/json"] == (b'{"a":[1,2.5,null],"b":"x"}', False)
    assert msgs["m/str-json"] == (b'{"not": "parsed"}', False)
    assert msgs["m/number"] == (b"42", False)
    assert msgs["m/empty"] == (b"", False)
    # a subscriber that comes later gets the retained message, flagged so
    late = Subscriber(broker.port, "m/#").start()
    late.wait_count(1)
    assert late.messages == [("m/kept", b"retained", True, False)]
    late.stop()
    sub.stop()
    log = broker.log_text()
    assert "(d0, q0, r0, m0, 'm/text'" in log        # QoS 0 as asked
    assert "q1, r1, m" in log and "'m/kept'" in log  # QoS 1 (default), retained


@pytest.mark.parametrize("payload, words", [
    ({"message": "x"}, "no topic"),
    ({"topic": "", "message": "x"}, "no topic"),
    ({"topic": "a/+/c", "message": "x"}, "wildcard"),
    ({"topic": "a/#", "message": "x"}, "wildcard"),
    ({"topic": "a", "message": "x", "qos": 2}, "qos 2 is not supported"),
    ({"topic": "a", "message": "x", "retain": "yes"}, "retain must be true or false"),
    ("just a string", "must be an object"),
])
def test_bad_payload_is_dead_with_a_clear_error_and_others_go(spool, broker,
                                                              payload, words):
    sub = Subscriber(broker.port, "ok/#").start()
    before = enqueue(spool, {"topic": "ok/1", "message": 1})
    bad = enqueue(spool, payload)
    after = enqueue(spool, {"topic": "ok/2", "message": 2})
    cp = work(spool, broker.url())
    assert cp.returncode == 0, cp.stderr
    job = show(run_myq, spool, bad)
    assert job["state"] == "dead", job
    assert job["attempts"] == 1
    assert job["last_error"].startswith("PermanentError: mqtt: "), job["last_error"]
    assert words in job["last_error"], job["last_error"]
    assert [show(run_myq, spool, j)["state"] for j in (before, after)] == ["done"] * 2
    sub.wait_count(2)
    assert sorted(sub.payloads()) == [b"1", b"2"]
    sub.stop()


# 2. the broker fails ###########################################################

def test_broker_restarted_mid_run_loses_nothing(spool, tmp_path, procs):
    """The broker stops (SIGTERM: it saves the subscriber's persistent
    session, so what it acknowledged is not lost on its side) while the
    worker publishes, and comes back on the same port: every job ends done,
    each message arrives (at least once: QoS 1), nothing is dead, and the
    failed publishes were retried as DestinationDown."""
    b = Broker(tmp_path / "broker", persistence=True).start()
    try:
        sub = Subscriber(b.port, "r/#", clean=False, client_id="restart-sub").start()
        n = 600
        import myq
        myq.open_store(spool).enqueue_many(
            [{"type": "mqtt", "payload": {"topic": "r/x", "message": i}}
             for i in range(n)])
        log = tmp_path / "worker.log"
        w = start_worker(spool, "--mqtt", b.url(), "--poll", "0.05", "--jitter", "0",
                         "--backoff-base", "0.1", "--backoff-max", "0.3",
                         "--max-attempts", "100", "--timeout", "5",
                         "--log", str(log))
        procs.track(w.pid)
        sub.wait_count(50)
        b.stop(signal.SIGTERM)
        retried = lambda: "DestinationDown: mqtt: " in log.read_text()  # noqa: E731
        wait_for(retried, what="a publish to fail while the broker is down")
        b.start()
        try:
            wait_for(lambda: stats(spool)["done"] == n, timeout=60,
                     what="all jobs done")
        except AssertionError as e:     # what a flake needs to be understood
            held = os.path.join(spool, "locks", "held")
            raise AssertionError("%s; stats now: %s; locks/held: %s; worker log "
                                 "tail:\n%s" % (e, stats(spool), sorted(
                                     os.listdir(held)) if os.path.isdir(held)
                                     else "-", log.read_text()[-3000:]))
        stop(w)
        wait_for(lambda: len(set(sub.payloads())) == n, timeout=30,
                 what="every message at the subscriber")
        sub.stop()
        assert sorted(set(int(p) for p in sub.payloads())) == list(range(n))
        st = stats(spool)
        assert (st["dead"], st["failed"]) == (0, 0), st
        assert ls(spool, "dlq") == []
        text = log.read_text()
        assert "event=retry" in text and "DestinationDown: mqtt: " in text
        assert b.starts == 2 and b.connections("myq-") >= 2
    finally:
        b.stop()


@pytest.mark.parametrize("user, password", [("dev", "wrong"), (None, None)])
def test_refused_credentials_are_a_configuration_error_not_dead_jobs(
        spool, tmp_path, user, password):
    """mosquitto answers a wrong password and a missing user alike: CONNACK
    5 (not authorised)."""
    words = "not authorised (CONNACK 5)"
    b = Broker(tmp_path / "broker", users={"dev": "right"}).start()
    try:
        opts = ()
        if password is not None:
            pw = tmp_path / "pw"
            pw.write_text(password + "\n")
            opts = ("--mqtt-password-file", str(pw))
        ids = [enqueue(spool, {"topic": "c/x", "message": i}) for i in range(3)]
        cp = work(spool, b.url(user), *opts)
        assert cp.returncode == 0, cp.stderr
        assert [show(run_myq, spool, j)["state"] == "dead" for j in ids] == [False] * 3
        first = show(run_myq, spool, ids[0])
        assert "configuration error" in first["last_error"], first
        assert stats(spool)["dead"] == 0
        assert "configuration error" in cp.stderr and words in cp.stderr, cp.stderr
        assert "--mqtt-password-file" in cp.stderr
        assert b.connections() == 0
    finally:
        b.stop()


def test_the_password_file_authenticates(spool, tmp_path):
    b = Broker(tmp_path / "broker", users={"dev": "right pw"}).start()
    try:
        pw = tmp_path / "pw"
        pw.write_text("right pw\n")
        jid = enqueue(spool, {"topic": "p/x", "message": 1})
        cp = work(spool, b.url("dev"), "--mqtt-password-file", str(pw))
        assert cp.returncode == 0, cp.stderr
        assert show(run_myq, spool, jid)["state"] == "done"
        assert b.connections() == 1 and " u'dev'" in b.log_text()
    finally:
        b.stop()


@pytest.mark.parametrize("code, words", [
    (1, "does not speak MQTT 3.1.1"), (2, "--mqtt-client-id"),
    (4, "bad user name or password (CONNACK 4); check the user in --mqtt"),
])
def test_every_refusal_says_what_to_do(myq, code, words):
    """A broker of the test's own that refuses with `code`."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def refuse():
        conn, _ = srv.accept()
        conn.recv(1024)
        conn.sendall(bytes([0x20, 2, 0, code]))
        conn.close()
    t = threading.Thread(target=refuse, daemon=True)
    t.start()
    try:
        c = myq.MqttClient("mqtt://u@127.0.0.1:%d" % srv.getsockname()[1],
                           password=b"pw")
        [e] = myq.mqtt_publish(c, [{"id": "x", "payload": {"topic": "t"}}], 5)
        assert isinstance(e, myq.DestinationDown), e
        assert str(e).startswith("mqtt: configuration error: mqtt://127.0.0.1:")
        assert words in str(e), str(e)
        assert c.sock is None
    finally:
        t.join(5)
        srv.close()


def test_a_broker_that_never_answers_times_out_and_retries(spool):
    """A port that accepts but never sends CONNACK: the job's time limit
    ends the attempt, which is a destination failure (retried), and the
    worker does not hang."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    try:
        jid = enqueue(spool, {"topic": "x", "message": 1}, "--timeout", "1")
        cp = work(spool, "mqtt://127.0.0.1:%d" % srv.getsockname()[1], timeout=30)
        assert cp.returncode == 0, cp.stderr
        job = show(run_myq, spool, jid)
        assert job["state"] == "scheduled", job
        assert job["last_error"].startswith("DestinationDown: mqtt: "), job
        assert "CONNACK" in job["last_error"]
    finally:
        srv.close()


def test_no_broker_configured_holds_the_type_not_dead(spool):
    jid = enqueue(spool, {"topic": "x", "message": 1})
    cp = run_myq("--spool", spool, "worker", "--drain", *FAST)
    assert cp.returncode == 0, cp.stderr
    job = show(run_myq, spool, jid)
    assert job["state"] != "dead", job
    assert "no --mqtt broker configured" in job["last_error"], job


# 3. the connection ##############################################################

def test_keepalive_pings_keep_an_idle_connection(broker, myq):
    """keepalive 4 s: the broker drops a client silent for 6 s.  Idle for
    longer than that, the client pings, and the next publish goes on the
    same connection.  (At keepalive 1 s, then 2 s, a loaded machine stalled
    the pinger past the broker's 1.5 x keepalive: a reconnect, not a bug in
    the client; at 4 s a stall must last ~3 s to do that.)"""
    c = myq.MqttClient(broker.url(), client_id="myq-keepalive", keepalive=4)
    sub = Subscriber(broker.port, "k/#").start()
    try:
        job = {"id": "k1", "payload": {"topic": "k/1", "message": "a"}}
        assert myq.mqtt_publish(c, [job], 5) == [None]
        # pings every ~2 s while idle: four of them span more than 6 s
        wait_for(lambda: broker.count("Received PINGREQ from myq-keepalive") >= 4,
                 timeout=30, what="the client's PINGREQs")
        assert myq.mqtt_publish(c, [dict(job, id="k2")], 5) == [None]
        assert sub.wait_count(2) and sub.payloads() == [b"a", b"a"]
        assert c.connects == 1 and broker.connections("myq-keepalive") == 1
        assert broker.count("Sending PINGRESP to myq-keepalive") >= 4
    finally:
        c.close()
        sub.stop()
    wait_for(lambda: broker.count("Received DISCONNECT from myq-keepalive") == 1,
             what="the client's DISCONNECT at close()")


def test_batch_api_outcomes_and_a_clean_reconnect(tmp_path, spool, myq):
    """Worker.mqtt_batch: all in flight, one outcome per job in order; the
    broker gone: DestinationDown for each; back: a fresh connection."""
    b = Broker(tmp_path / "broker").start()
    try:
        w = myq.Worker(spool, mqtt=b.url(), mqtt_client_id="myq-batch", timeout=5)
        jobs = [{"id": "b%d" % i, "payload": {"topic": "b/%d" % i, "message": i}}
                for i in range(100)]
        jobs[50] = {"id": "bad", "payload": {"topic": "b/#"}}
        out = w.mqtt_batch(jobs)
        assert len(out) == 100
        assert isinstance(out[50], myq.PermanentError)
        assert out[:50] + out[51:] == [None] * 99
        b.stop()
        out = w.mqtt_batch(jobs[:3])
        assert all(isinstance(e, myq.DestinationDown) for e in out), out
        assert all(e.dest == "mqtt://127.0.0.1:%d" % b.port for e in out)
        b.start()
        assert w.mqtt_batch(jobs[:3]) == [None] * 3
        assert b.connections("myq-batch") == 2
        w.resolver.mqtt.client.close()
    finally:
        b.stop()


def test_threads_share_one_connection(spool, broker):
    sub = Subscriber(broker.port, "c/#").start()
    for i in range(60):
        enqueue(spool, {"topic": "c/%d" % (i % 3), "message": i})
    cp = work(spool, broker.url(), "--concurrency", "4")
    assert cp.returncode == 0, cp.stderr
    assert stats(spool)["done"] == 60
    sub.wait_count(60)
    sub.stop()
    assert sorted(int(p) for p in sub.payloads()) == list(range(60))
    assert broker.connections("myq-") == 1


def test_client_id_option_and_variable(spool, broker):
    enqueue(spool, {"topic": "i/x", "message": 1})
    cp = run_myq("--spool", spool, "worker", "--drain", *FAST,
                 env={"MYQ_MQTT": broker.url(), "MYQ_MQTT_CLIENT_ID": "edge-17"})
    assert cp.returncode == 0, cp.stderr
    assert stats(spool)["done"] == 1
    assert broker.connections("edge-17") == 1


def test_default_client_ids_are_short_and_unique(myq):
    a = myq.MqttClient("mqtt://h").client_id
    b = myq.MqttClient("mqtt://h").client_id
    assert a != b and len(a) <= 23 and a.startswith("myq-"), (a, b)
    assert str(os.getpid()) in a


# 4. mqtts ######################################################################

def _make_certs(d):
    """A CA, a server certificate for 127.0.0.1 and a client certificate,
    with the openssl command."""
    def ossl(*args):
        subprocess.run(["openssl"] + list(args), cwd=str(d), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=myq test CA")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"),
                      ("client", "extendedKeyUsage=clientAuth")):
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", name + ".key",
             "-out", name + ".csr", "-subj", "/CN=" + name)
        (d / (name + ".ext")).write_text(ext + "\n")
        ossl("x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey",
             "ca.key", "-CAcreateserial", "-days", "2", "-out", name + ".pem",
             "-extfile", name + ".ext")


@pytest.mark.skipif(not any(os.access(os.path.join(p, "openssl"), os.X_OK)
                            for p in os.environ.get("PATH", "").split(":")),
                    reason="needs the openssl command to make test certificates")
def test_mqtts_with_a_ca_and_a_client_certificate(spool, tmp_path):
    d = tmp_path / "pki"
    d.mkdir()
    _make_certs(d)
    b = Broker(tmp_path / "broker", extra=[
        "cafile %s/ca.pem" % d, "certfile %s/server.pem" % d,
        "keyfile %s/server.key" % d, "require_certificate true"]).start()
    try:
        url = "mqtts://127.0.0.1:%d" % b.port
        jid = enqueue(spool, {"topic": "s/x", "message": "over tls"})
        # without the CA the broker is not trusted: a configuration error, retried
        cp = work(spool, url, "--mqtt-cert", str(d / "client.pem"),
                  "--mqtt-key", str(d / "client.key"))
        assert cp.returncode == 0, cp.stderr
        job = show(run_myq, spool, jid)
        assert job["state"] == "scheduled", job
        assert "not trusted" in job["last_error"] and "--mqtt-ca" in job["last_error"]
        assert call_myq("--spool", spool, "retry", "--now", jid).returncode == 0
        cp = work(spool, url, "--mqtt-ca", str(d / "ca.pem"),
                  "--mqtt-cert", str(d / "client.pem"),
                  "--mqtt-key", str(d / "client.key"))
        assert cp.returncode == 0, cp.stderr
        assert show(run_myq, spool, jid)["state"] == "done"
        assert "Received PUBLISH from myq-" in b.log_text()
        assert "'s/x', ... (8 bytes)" in b.log_text()
    finally:
        b.stop()


# 5. options ######################################################################

@pytest.mark.parametrize("args, code, words", [
    (["--mqtt", "http://broker"], 64, "not an MQTT broker URL"),
    (["--mqtt", "mqtt://broker:99999"], 64, "not in 1-65535"),
    (["--mqtt", "mqtt://dev:secret@broker"], 64, "--mqtt-password-file"),
    (["--mqtt", "mqtt://broker", "--mqtt-password-file", "/nonexistent/pw"], 64,
     "needs a user"),
    (["--mqtt", "mqtt://dev@broker", "--mqtt-password-file", "/nonexistent/pw"], 78,
     "cannot read --mqtt-password-file /nonexistent/pw"),
    (["--mqtt-ca", "/etc/hostname"], 64, "without --mqtt"),
    (["--mqtt", "mqtt://broker", "--mqtt-ca", "/etc/hostname"], 64, "mqtts://"),
    (["--mqtt", "mqtts://broker", "--mqtt-ca", "/nonexistent/ca"], 78,
     "cannot read --mqtt-ca"),
])
def test_bad_mqtt_options_exit_with_a_clear_message(spool, args, code, words):
    cp = call_myq("--spool", spool, "worker", "--drain", *args)
    assert cp.returncode == code, (cp.returncode, cp.stderr)
    err = one_line_error(cp)
    assert words in err, err
    assert "secret" not in err


def test_supervise_passes_the_options_and_refuses_one_id_for_many(spool, tmp_path):
    cp = call_myq("--spool", spool, "supervise", "--dry-run", "--workers", "2",
                  "--mqtt", "mqtt://broker", "--mqtt-client-id", "same")
    assert cp.returncode == 64, cp.stderr
    assert "each worker needs its own client id" in one_line_error(cp)
    cp = call_myq("--spool", spool, "supervise", "--dry-run", "--workers", "2",
                  "--mqtt", "mqtt://broker")
    assert cp.returncode == 0, cp.stderr
    import myq
    o = {k: None for k in ("mqtt", "mqtt_password_file", "mqtt_client_id",
                           "mqtt_ca", "mqtt_cert", "mqtt_key")}
    o.update(mqtt="mqtt://dev@broker:1884", mqtt_password_file="/etc/pw")
    argv = myq._option_argv(o, [t for t in myq.WORKER_OPTIONS
                                if t[0].startswith("--mqtt")])
    assert argv == ["--mqtt", "mqtt://dev@broker:1884",
                    "--mqtt-password-file", "/etc/pw"]


def test_mqtt_dest_names_the_broker(myq):
    d = myq.mqtt_dest
    assert d("mqtt://Dev@Broker.LAN") == "mqtt://broker.lan:1883"
    assert d("mqtts://broker.lan/") == "mqtts://broker.lan:8883"
    assert d("mqtt://[::1]:1884") == "mqtt://[::1]:1884"
    with pytest.raises(myq.UsageError):
        d("mqtt://broker/topic")


# 6. python3-light ################################################################

@pytest.mark.files_only("python3-light has no sqlite3: SQLite is refused")
def test_mqtt_runs_under_python3_light(spool, broker, tmp_path):
    """socket and select are in python3-light: an mqtt job goes, and no
    import that python3-light lacks is tried."""
    from test_light import STDLIB_PROBES, attempts, runner
    light = runner(tmp_path)
    enqueue(spool, {"topic": "l/x", "message": "light"})
    sub = Subscriber(broker.port, "l/#").start()
    cp = light("--spool", spool, "worker", "--drain", "--mqtt", broker.url(), *FAST)
    assert cp.returncode == 0, cp.stderr
    assert stats(spool)["done"] == 1
    assert sub.wait_count(1) and sub.payloads() == [b"light"]
    sub.stop()
    assert attempts(light.log) <= STDLIB_PROBES, sorted(attempts(light.log))
