"""Who may give the intake jobs, and what it holds: the token of a port, the
mode of a socket, /health, an oversized or duplicate message, a flood of
one type at its bound, bounded memory, the intake's log events.

Acted as the attacker would: another local account (a real second uid,
tests/_sec.py) posting to the intake's port or socket; a real Mosquitto
(tests/_mosquitto.py) delivering an oversized message, a flood of one type
held at its bound, a message under a taken id.  The tests that concern
the store run on both.
"""
import json
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from _core import MYQ, ROOT, call_myq, clean_env, myq_argv, run_myq, stop, \
    wait_for, world_python
from _mosquitto import MOSQUITTO, Broker
from _sec import become, is_root, make_user
from test_intake import Intake, auth, get, jobs, payload_of, post, publish, \
    stats, subscribe_args, subscribed
from test_intake import intake  # noqa: F401 (a fixture)

BOTH = pytest.mark.parametrize("store", ["files", "sqlite"], indirect=True)
needs_root = pytest.mark.skipif(not is_root(), reason="needs root: another "
                                "local account posts (CI runs as root)")


@pytest.fixture(scope="module")
def other():
    """A local account in none of the spool's groups (the attacker)."""
    for pw in make_user():
        yield pw


@pytest.fixture
def pbroker(tmp_path):
    if MOSQUITTO is None:
        pytest.skip("needs the mosquitto MQTT broker (apt-get install mosquitto)")
    b = Broker(tmp_path / "broker", persistence=True,
               extra=["max_inflight_messages 10"]).start()
    yield b
    b.stop()


@pytest.fixture
def open_dir():
    """A directory every account may traverse (pytest's tmp_path is 0700:
    there the directory, not the file's mode, would keep others out)."""
    d = tempfile.mkdtemp(prefix="myq-intake4-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


CLIENT = r"""
import socket, sys
where, token = sys.argv[1], sys.argv[2]
try:
    if where.startswith("/"):
        s = socket.socket(socket.AF_UNIX)
        s.connect(where)
    else:
        s = socket.create_connection(("127.0.0.1", int(where)), 10)
    head = "POST /jobs/t HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
    if token:
        head += "Authorization: Bearer %s\r\n" % token
    s.sendall((head + "Connection: close\r\n\r\n1").encode())
    print(s.recv(4096).split(b" ")[1].decode())
except OSError as e:
    print(type(e).__name__)
"""


def post_as(pw, where, token=""):
    """POST /jobs/t as user `pw` (uid and its own group only): the status,
    or the name of the error (PermissionError: the socket's mode)."""
    python = world_python()
    if python is None:
        pytest.skip("no python3 that another user may run")
    r = subprocess.run([python, "-c", CLIENT, str(where), token],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, env=clean_env(), cwd="/",
                       preexec_fn=become(pw), timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def read_as(pw, path):
    """What user `pw` gets reading `path`: its text, or the error's name."""
    python = world_python()
    r = subprocess.run([python, "-c", "import sys\ntry:\n print(open(sys.argv[1])"
                        ".read().strip())\nexcept OSError as e:\n print(type(e)."
                        "__name__)", path], stdout=subprocess.PIPE,
                       universal_newlines=True, env=clean_env(), cwd="/",
                       preexec_fn=become(pw), timeout=30)
    return r.stdout.strip()


def started_at(log, what="the intake"):
    return wait_for(lambda: re.search(r"event=intake_start .*?listen=(\S+)",
                                      open(log).read() if os.path.exists(log)
                                      else ""), what=what).group(1)


# 1. Who may post: the token of a port, the mode of a socket ##################

@BOTH
def test_init_makes_a_token_the_owner_and_its_group_read(spool, store):
    p = os.path.join(spool, "intake.token")
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o640 and stat.S_ISREG(st.st_mode)
    token = open(p).read()
    assert re.match(r"\A[0-9a-f]{48}\n\Z", token), token
    assert call_myq("--spool", spool, "init").returncode == 0
    assert open(p).read() == token          # kept: producers hold it


@needs_root
def test_init_gives_the_token_to_the_owner_and_follows_no_link(other, open_dir):
    spool = os.path.join(open_dir, "spool")
    grp = "%s:%d" % (other.pw_name, other.pw_gid)
    assert run_myq("--spool", spool, "init", "--owner", grp).returncode == 0
    st = os.stat(os.path.join(spool, "intake.token"))
    assert (st.st_uid, st.st_gid) == (other.pw_uid, other.pw_gid)
    # the owner puts a link to a root file in its place: never followed,
    # never given to the owner
    victim = os.path.join(open_dir, "victim")
    with open(victim, "w") as f:
        f.write("root's\n")
    os.chmod(victim, 0o600)
    os.unlink(os.path.join(spool, "intake.token"))
    os.symlink(victim, os.path.join(spool, "intake.token"))
    os.lchown(os.path.join(spool, "intake.token"), other.pw_uid, other.pw_gid)
    r = run_myq("--spool", spool, "init", "--owner", grp)
    assert r.returncode == 78 and "intake.token" in r.stderr, r.stderr
    st = os.stat(victim)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
    assert open(victim).read() == "root's\n"


@needs_root
def test_a_port_takes_nothing_from_an_account_without_the_token(other, open_dir):
    """Once, a user in no group got 202 from the loopback port, and
    the worker then sent its credentials to that user's URL."""
    spool = os.path.join(open_dir, "spool")
    assert run_myq("--spool", spool, "init").returncode == 0
    log = os.path.join(open_dir, "intake.log")
    p = subprocess.Popen(myq_argv() + ["--spool", spool, "intake",
                          "--listen", "127.0.0.1:0", "--log", log],
                         env=clean_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port = int(started_at(log).rpartition(":")[2])
        assert read_as(other, os.path.join(spool, "intake.token")) == \
            "PermissionError"
        assert post_as(other, port) == "401"
        assert post_as(other, port, "0" * 48) == "401"
        assert jobs(spool) == []
        # a producer (here root, who can read the token) posts
        assert post(port, "t", "1", auth(spool))[0] == 202
    finally:
        stop(p)
    assert len(jobs(spool)) == 1


@needs_root
def test_listen_open_lets_every_local_account_post(other, open_dir):
    spool = os.path.join(open_dir, "spool")
    assert run_myq("--spool", spool, "init").returncode == 0
    log = os.path.join(open_dir, "intake.log")
    p = subprocess.Popen(myq_argv() + ["--spool", spool, "intake",
                          "--listen", "127.0.0.1:0", "--listen-open", "--log",
                          log], env=clean_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port = int(started_at(log).rpartition(":")[2])
        assert post_as(other, port) == "202"
    finally:
        stop(p)


@needs_root
def test_a_unix_socket_lets_the_spools_group_post_and_no_other_account(
        other, open_dir):
    """--listen unix:PATH: 0660, the spool's group (here the group of
    `other`, a producer); `nobody`, in neither, cannot connect."""
    nobody = pwd.getpwnam("nobody")
    spool = os.path.join(open_dir, "spool")
    assert run_myq("--spool", spool, "init", "--owner",
                   "root:%d" % other.pw_gid).returncode == 0
    sock = os.path.join(open_dir, "intake.sock")
    log = os.path.join(open_dir, "intake.log")
    p = subprocess.Popen(myq_argv() + ["--spool", spool, "intake",
                          "--listen", "unix:" + sock, "--log", log],
                         env=clean_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert started_at(log) == "unix:" + sock
        st = os.lstat(sock)
        assert stat.S_ISSOCK(st.st_mode)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, other.pw_gid)
        assert post_as(other, sock) == "202"          # no token: the mode decides
        assert post_as(nobody, sock) == "PermissionError"
    finally:
        assert stop(p) == 0
        p.stderr.close()
    assert len(jobs(spool)) == 1
    assert not os.path.lexists(sock)            # its own socket, removed


def test_a_second_intake_on_a_live_socket_is_refused(spool, intake, open_dir):
    sock = os.path.join(open_dir, "s.sock")
    intake("--listen", "unix:" + sock).started(listen=False)
    cp = run_myq("--spool", spool, "intake", "--listen", "unix:" + sock)
    assert cp.returncode == 78 and "another program listens" in cp.stderr, cp.stderr
    with open(os.path.join(open_dir, "plain"), "w"):
        pass
    cp = run_myq("--spool", spool, "intake", "--listen",
                 "unix:" + os.path.join(open_dir, "plain"))
    assert cp.returncode == 78 and "not a socket" in cp.stderr, cp.stderr


def test_a_squatted_port_is_said_at_once(spool):
    """A local user who binds the port first would get the producers'
    posts and their token: the intake and supervise say so (78), before
    anything starts."""
    squat = socket.socket()
    squat.bind(("127.0.0.1", 0))
    squat.listen(1)
    port = squat.getsockname()[1]
    try:
        for cmd in (["intake"], ["supervise", "--dry-run"]):
            cp = run_myq("--spool", spool, *cmd, "--listen", "127.0.0.1:%d" % port)
            assert cp.returncode == 78, (cmd, cp.stderr)
            err = cp.stderr.strip()
            assert "\n" not in err and "another program already listens" in err
            assert "ss -ltnp" in err
    finally:
        squat.close()


def low_port():
    """A free port below 1024 (only root may bind it)."""
    for port in range(990, 900, -1):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    pytest.skip("no free port below 1024")


@needs_root
def test_supervise_takes_the_port_as_root_and_holds_it_across_restarts(
        other, open_dir):
    """Under supervise --user the intake runs as the user: it could not
    bind a port below 1024, and while it restarted the port was free for
    any local account to take (and get the producers' posts and token).
    supervise takes it as root, before it drops root, and keeps it."""
    python = world_python()
    if python is None:
        pytest.skip("no python3 that another user may run")
    spool = os.path.join(open_dir, "spool")
    assert run_myq("--spool", spool, "init", "--owner", other.pw_name
                   ).returncode == 0
    port = low_port()
    log = os.path.join(open_dir, "sup.log")
    sup = subprocess.Popen([python, MYQ, "--spool", spool, "supervise", "--user",
                            other.pw_name, "--log", log, "--listen",
                            "127.0.0.1:%d" % port], env=clean_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    text = lambda: open(log).read() if os.path.exists(log) else ""  # noqa: E731
    try:
        wait_for(lambda: "event=intake_start" in text(), what="the intake")
        assert post(port, "t", "1", auth(spool))[0] == 202
        pid = int(re.findall(r"event=worker_start slot=intake pid=(\d+)", text())[0])
        uids = [line.split()[1:] for line in open("/proc/%d/status" % pid)
                if line.startswith("Uid:")][0]
        assert set(int(u) for u in uids) == {other.pw_uid}
        os.kill(pid, 9)
        wait_for(lambda: "event=worker_exit slot=intake pid=%d" % pid in text(),
                 what="the intake's death")
        squat = socket.socket()             # while no intake runs
        try:
            with pytest.raises(OSError):
                squat.bind(("127.0.0.1", port))
        finally:
            squat.close()
        wait_for(lambda: text().count("event=intake_start") == 2,
                 what="the intake again")
        assert post(port, "t", "2", auth(spool))[0] == 202
    finally:
        assert stop(sup) == 0
    # (run_myq: in this process, a command on the user's spool becomes
    # the user)
    cp = run_myq("--spool", spool, "list")
    assert cp.returncode == 0 and len(cp.stdout.splitlines()) == 2, cp


def test_listen_open_is_refused_where_it_would_open_the_network(spool):
    for args, want in ((["--listen", "0.0.0.0:0", "--listen-open"], "loopback"),
                       (["--listen", "unix:/tmp/x.sock", "--listen-open"],
                        "socket's mode"),
                       (["--listen-open"], "--listen")):
        cp = run_myq("--spool", spool, "intake", *args)
        assert cp.returncode == 64 and want in cp.stderr, (args, cp.stderr)


def test_a_spool_without_its_token_file_says_how_to_make_one(spool):
    os.unlink(os.path.join(spool, "intake.token"))
    cp = run_myq("--spool", spool, "intake", "--listen", "127.0.0.1:0")
    assert cp.returncode == 78
    assert "intake.token" in cp.stderr and "init" in cp.stderr, cp.stderr


# 2. /health: 200 while jobs can be taken ######################################

@BOTH
def test_health_is_200_with_a_dead_job_and_503_below_the_guard(
        spool, store, intake, tmp_path):
    handlers = tmp_path / "h"
    handlers.mkdir()
    (handlers / "t").write_text("#!/bin/sh\nexit 1\n")
    (handlers / "t").chmod(0o755)
    assert call_myq("--spool", spool, "enqueue", "t", "--max-attempts",
                    "1").returncode == 0
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers",
                 str(handlers))
    assert cp.returncode == 0, cp.stderr
    assert [j["state"] for j in jobs(spool)] == ["dead"]
    i = intake("--listen", "127.0.0.1:0").started()
    status, text = get(i.port, "/health")
    body = json.loads(text)
    assert status == 200, text          # a watchdog restarts nothing that works
    assert body["ok"] is False and any("dlq" in p or "dead" in p
                                       for p in body["problems"]), body
    assert post(i.port, "t", "1")[0] == 202
    i.stop()
    j = intake("--listen", "127.0.0.1:0", "--min-free", "1000000G").started()
    status, text = get(j.port, "/health")
    assert status == 503 and json.loads(text)["ok"] is False


# 3. MQTT: an oversized message, a held type, a taken id ######################

@BOTH
def test_an_oversized_message_is_acknowledged_counted_and_the_rest_flows(
        spool, store, intake, pbroker):
    """Past --max-job-bytes + 64K it was a protocol error: a reconnect, the
    broker sent it again, forever; nothing behind it came in."""
    i = intake(*subscribe_args(pbroker, "s/#=r") + ["--max-job-bytes", "1K"])
    i.started(listen=False)
    subscribed(pbroker, i)
    publish(pbroker.port, [("s/huge", b"x" * (300 << 10)), ("s/small", b"1")])
    wait_for(lambda: len(jobs(spool)) == 1, timeout=30, what="the small one")
    wait_for(lambda: pbroker.count("Received PUBACK from myq-intake-test") >= 2,
             what="both PUBACKs")
    assert [payload_of(spool, x["id"])["payload"]["topic"] for x in jobs(spool)] \
        == ["s/small"]
    text = i.text()
    assert re.search(r"event=intake_refused via=mqtt .*topic=s/huge bytes=30\d{4} ",
                     text), text
    assert text.count("event=intake_connected") == 1 and "event=error" not in text
    st = stats(spool)
    assert st["refused"] == 1, st
    # the broker does not send it again
    time.sleep(0.5)
    assert pbroker.count("Received PUBACK from myq-intake-test") == 2


@BOTH
def test_one_type_at_its_bound_holds_no_other_types_alarm(
        spool, store, intake, pbroker):
    """One session: the held type's unacknowledged messages filled the
    broker's window (max_inflight_messages) and the alarm behind them
    never came.  A session a type: it comes at once, and the held type's
    messages wait at the broker, none lost."""
    assert call_myq("--spool", spool, "policy", "tele", "max_queued=2"
                    ).returncode == 0
    i = intake(*subscribe_args(pbroker, "tele/#=tele", "alarm/#=alarm"))
    i.started(listen=False)
    wait_for(lambda: pbroker.count("tele/# (QoS 1)") and
             pbroker.count("alarm/# (QoS 1)"), what="both subscriptions")
    publish(pbroker.port, [("tele/%d" % n, b'{"n": %d}' % n) for n in range(30)])
    wait_for(lambda: "event=intake_held" in i.text(), what="tele held")
    publish(pbroker.port, [("alarm/door", b'{"id": "door-1"}')])
    wait_for(lambda: any(j["id"] == "door-1" for j in jobs(spool)), timeout=15,
             what="the alarm, while tele is held")
    assert sum(1 for j in jobs(spool) if j["type"] == "tele") == 2
    # room again: every telemetry message comes, once
    assert call_myq("--spool", spool, "policy", "tele", "max_queued="
                    ).returncode == 0
    got = wait_for(lambda: len(jobs(spool)) == 31 and jobs(spool), timeout=30,
                   what="all 30 tele jobs")
    assert sorted(payload_of(spool, j["id"])["payload"]["message"]["n"]
                  for j in got if j["type"] == "tele") == list(range(30))


@BOTH
def test_a_message_under_a_taken_id_is_kept_in_failed_and_logged(
        spool, store, intake, pbroker):
    i = intake(*subscribe_args(pbroker, "s/#=r"))
    i.started(listen=False)
    subscribed(pbroker, i)
    publish(pbroker.port, [("s/a", b'{"id": "x", "v": 1}'),
                           ("s/a", b'{"id": "x", "v": 2}'),     # another job
                           ("s/a", b'{"id": "x", "v": 1}')])    # the same again
    wait_for(lambda: pbroker.count("Received PUBACK from myq-intake-test") >= 3,
             what="3 PUBACKs")
    wait_for(lambda: i.text().count("event=duplicate") >= 2, what="2 duplicates")
    assert payload_of(spool, "x")["payload"]["message"] == {"id": "x", "v": 1}
    failed = [j for j in jobs(spool) if j["state"] == "failed"]
    assert len(failed) == 1, jobs(spool)
    assert failed[0]["id"].startswith("x.dup-"), failed
    kept = payload_of(spool, failed[0]["id"])
    assert "duplicate: job id x is taken" in kept["last_error"], kept
    assert json.loads(kept["content"])["payload"] == {
        "topic": "s/a", "message": {"id": "x", "v": 2}}, kept
    text = i.text()
    assert re.search(r"event=duplicate via=mqtt id=x type=r .*kept=failed/", text)
    assert re.search(r"event=duplicate via=mqtt id=x type=r kept=\"the same job", text)


def test_an_http_duplicate_is_409_and_logged(spool, intake):
    i = intake("--listen", "127.0.0.1:0").started()
    key = {"Idempotency-Key": "k-1"}
    assert post(i.port, "o", '{"n": 1}', key)[0] == 202
    assert post(i.port, "o", '{"n": 1}', key)[0] == 202
    assert post(i.port, "o", '{"n": 2}', key)[0] == 409
    text = i.text()
    assert re.search(r"event=duplicate via=http id=k-1 type=o kept=\"the same", text)
    assert re.search(r"event=duplicate via=http type=o kept=\"refused \(409\)\" "
                     r"error=\".*k-1", text), text


# 4. Bounded memory, no sync(2) (the lows) ####################################

def rss_kb(pid):
    for line in open("/proc/%d/status" % pid):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])


def drained(port):
    """Has the intake read every byte sent to its port (its receive
    queues and the clients' send queues empty: /proc/net/tcp)?"""
    hexport = ":%04X" % port
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    for r in rows:
        tx, rx = (int(x, 16) for x in r[4].split(":"))
        if (r[1].endswith(hexport) and rx) or (r[2].endswith(hexport) and tx):
            return False
    return True


def test_the_bodies_held_at_once_are_bounded(spool, intake):
    """64 local connections that each send most of a 1 MiB body held
    64 MiB; the bytes held across connections are bounded now."""
    i = intake("--listen", "127.0.0.1:0").started()
    before = rss_kb(i.proc.pid)
    conns = []
    chunk = b"x" * (900 << 10)
    try:
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", i.port), 10)
            conns.append(s)
            try:
                s.sendall(b"POST /jobs/t HTTP/1.1\r\nHost: x\r\nContent-Length: "
                          b"1000000\r\n\r\n" + chunk)
            except OSError:
                pass                # cut: the intake holds too much
        wait_for(lambda: drained(i.port), what="the intake to read it all")
        grown = rss_kb(i.proc.pid) - before
        assert grown < 16 << 10, "the intake grew by %d KiB" % grown
        assert post(i.port, "t", "1")[0] == 202     # and serves on
    finally:
        for s in conns:
            s.close()


SYNC_SPY = (
    "import os, sys\n"
    "sys.path.insert(0, %r)\n"
    "import myq\n"
    "def spy():\n"
    "    with open(os.environ['SYNC_LOG'], 'a') as f:\n"
    "        f.write('sync\\n')\n"
    "os.sync = spy\n"
    "sys.exit(myq.main(sys.argv[1:]))\n" % ROOT)


@BOTH
def test_a_repeated_request_syncs_only_its_own_jobs(spool, store, tmp_path):
    marks = str(tmp_path / "syncs")
    log = str(tmp_path / "intake.log")
    p = subprocess.Popen([sys.executable, "-c", SYNC_SPY, "--spool", spool,
                          "intake", "--listen", "127.0.0.1:0", "--listen-open",
                          "--log", log], env=clean_env({"SYNC_LOG": marks}),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        port = int(started_at(log).rpartition(":")[2])
        key = {"Idempotency-Key": "again"}
        assert post(port, "t", "1", key)[0] == 202
        assert post(port, "t", "1", key)[0] == 202      # finds it waiting
    finally:
        stop(p)
    assert not os.path.exists(marks), "sync(2) of every filesystem"
    assert [j["id"] for j in jobs(spool)] == ["again"]


# 5. The intake's log events are defined in myq-spool(5) ####################

def test_every_intake_log_event_is_in_myq_spool_5():
    src = open(MYQ).read()
    # the sections of intake (Intake: HTTP, Intake: MQTT), wherever they are
    parts = re.split(r"\n(?=# .+? #{5,}\n)", src)
    intake = "".join(p for p in parts if p.startswith("# Intake"))
    events = set(re.findall(r"\blog\(\s*\"(\w+)\"", intake))
    assert {"intake_start", "intake_refused", "duplicate"} <= events, events
    page = open(os.path.join(ROOT, "build", "myq-spool.5")).read()
    section = page[page.index(".SH LOG EVENTS"):page.index(".SH SEE ALSO")]
    defined = set(re.findall(r"\\fB(\w+)\\fR", section))
    assert events <= defined, sorted(events - defined)


# 6. import reads its lines bounded #############################################

LIMITED = (
    "import resource, sys\n"
    "resource.setrlimit(resource.RLIMIT_AS, (256 << 20, 256 << 20))\n"
    "sys.path.insert(0, %r)\n"
    "import myq\n"
    "sys.exit(myq.main(sys.argv[1:]))\n" % ROOT)


@BOTH
def test_import_skips_a_line_too_long_for_a_job_in_bounded_memory(
        spool, store, tmp_path):
    """A 64 MB line was a MemoryError under a 256 MB limit: now it is a
    bad line, said and counted, and the lines around it are imported."""
    src = tmp_path / "backlog.jsonl"
    with open(str(src), "wb") as f:
        f.write(b'{"id": "a", "type": "t", "payload": 1, "state": "ready"}\n')
        f.write(b'{"id": "big", "type": "t", "payload": "')
        for _ in range(64):
            f.write(b"x" * (1 << 20))
        f.write(b'", "state": "ready"}\n')
        f.write(b'{"id": "b", "type": "t", "payload": 2, "state": "ready"}\n')
    cp = subprocess.run([sys.executable, "-c", LIMITED, "--spool", spool,
                         "import", str(src)], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, universal_newlines=True,
                        env=clean_env(), timeout=120)
    assert cp.returncode == 65, cp.stderr
    assert "Traceback" not in cp.stderr and "MemoryError" not in cp.stderr
    assert re.search(r"line 2: a line of 671089\d\d bytes, longer than a job "
                     r"may be", cp.stderr), cp.stderr
    assert "imported 2, duplicate 0, bad 1" in cp.stderr
    assert sorted(j["id"] for j in jobs(spool)) == ["a", "b"]
