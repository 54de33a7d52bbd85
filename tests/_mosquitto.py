"""A real MQTT broker for the tests: Debian's mosquitto, started
with a config file of its own in the test's tmp directory, on a free
loopback port, logging every packet to a file; and a small QoS 1 subscriber
written here (its own code, not myq's) to receive what the broker delivers.

`needs_mosquitto` skips a test, naming the package, where mosquitto is not
installed (CI installs it: .ci/run).  Waiting is "poll a condition until a
deadline": the broker is up once its port accepts, a subscriber once its
SUBACK came.
"""
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time

import pytest

from _core import free_port, wait_for

MOSQUITTO = shutil.which("mosquitto") or next(
    (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")
     if os.access(p, os.X_OK)), None)
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")

needs_mosquitto = pytest.mark.skipif(
    MOSQUITTO is None, reason="needs the mosquitto MQTT broker "
    "(apt-get install mosquitto mosquitto-clients)")


class Broker(object):
    """mosquitto -c DIR/mosquitto.conf on 127.0.0.1:PORT.  `users` (a dict
    user -> password) turns anonymous access off; `persistence` keeps the
    sessions of clean_session=0 clients and their messages across a
    restart (a SIGTERM'd broker saves them); `extra` adds config lines."""

    def __init__(self, directory, users=None, persistence=False, extra=()):
        self.dir = str(directory)
        os.makedirs(self.dir, exist_ok=True)
        self.port = free_port()
        self.conf = os.path.join(self.dir, "mosquitto.conf")
        self.log = os.path.join(self.dir, "mosquitto.log")
        self.proc = None
        self.starts = 0
        lines = ["log_dest file %s" % self.log,
                 "log_type all", "connection_messages true",
                 "log_timestamp false"]
        if os.geteuid() == 0:
            lines.append("user root")   # else it becomes `mosquitto`: no tmp/ access
        if users:
            if MOSQUITTO_PASSWD is None:
                pytest.skip("needs mosquitto_passwd (apt-get install mosquitto)")
            pw = os.path.join(self.dir, "passwords")
            for user, password in users.items():
                subprocess.run([MOSQUITTO_PASSWD, "-b"] + (
                    [] if os.path.exists(pw) else ["-c"]) + [pw, user, password],
                    check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.chmod(pw, 0o600)
            lines += ["allow_anonymous false", "password_file %s" % pw]
        else:
            lines.append("allow_anonymous true")
        if persistence:
            lines += ["persistence true",
                      "persistence_location %s/" % self.dir]
        else:
            lines.append("persistence false")
        self.lines = lines + list(extra)

    def url(self, user=None, scheme="mqtt"):
        return "%s://%s127.0.0.1:%d" % (scheme, user + "@" if user else "",
                                        self.port)

    def start(self):
        """Start (or restart, on the same port) and wait until the port
        accepts.  A first start whose free port was taken meanwhile (tests
        run in parallel) tries another."""
        for tries in range(3, 0, -1):
            with open(self.conf, "w") as f:
                f.write("\n".join(["listener %d 127.0.0.1" % self.port]
                                  + self.lines) + "\n")
            try:
                return self._start()
            except AssertionError:
                if self.starts > 1 or tries == 1 or \
                        "Address already in use" not in self.log_text():
                    raise
                self.port = free_port()
                self.starts = 0

    def _start(self):
        self.proc = subprocess.Popen([MOSQUITTO, "-c", self.conf],
                                     stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.starts += 1

        def accepting():
            if self.proc.poll() is not None:
                raise AssertionError("mosquitto exited %s: %s" % (
                    self.proc.returncode, self.proc.stderr.read().decode()
                    + self.log_text()[-2000:]))
            # "running" is logged once the listeners are open (the port
            # alone could be someone else's)
            if sum(line.startswith("mosquitto version") and line.endswith(" running")
                   for line in self.log_text().splitlines()) < self.starts:
                return False
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return True
            except OSError:
                return False
        wait_for(accepting, timeout=15, what="mosquitto to accept on %d" % self.port)
        return self

    def stop(self, sig=signal.SIGTERM):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.proc.stderr.close()
        self.proc = None

    def log_text(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def connections(self, client_prefix=""):
        """Clients the broker accepted (with ids starting so)."""
        return sum(1 for line in self.log_text().splitlines()
                   if line.startswith("New client connected from ")
                   and (" as " + client_prefix) in line)

    def count(self, what):
        """Log lines containing `what` (e.g. 'Received PINGREQ')."""
        return sum(what in line for line in self.log_text().splitlines())


@pytest.fixture
def broker(tmp_path):
    """A started anonymous broker, stopped at the test's end."""
    if MOSQUITTO is None:
        pytest.skip("needs the mosquitto MQTT broker "
                    "(apt-get install mosquitto mosquitto-clients)")
    b = Broker(tmp_path / "broker").start()
    yield b
    b.stop()


# --------------------------------------------------------------------------
# a subscriber (MQTT 3.1.1, QoS 1), independent of myq's client

def _enc_len(n):
    out = bytearray()
    while True:
        n, b = n >> 7, n & 127
        out.append(b | 128 if n else b)
        if not n:
            return bytes(out)


def _s(b):
    return struct.pack(">H", len(b)) + b


class Subscriber(object):
    """Subscribes to `topic` at QoS 1 and keeps every message delivered:
    `messages` is a list of (topic, payload bytes, retain, dup).  With
    `clean=False` it has a persistent session (a fixed client id) and
    reconnects whenever the connection drops, so that a broker restart
    loses nothing queued for it."""

    def __init__(self, port, topic="#", clean=True, client_id=None):
        self.port, self.topic, self.clean = port, topic, clean
        self.client_id = client_id or "sub-%d-%d" % (os.getpid(), id(self) % 10000)
        self.messages = []
        self.subscribed = threading.Event()
        self.stopped = False
        self.sock = None
        self.connects = 0
        self.thread = threading.Thread(target=self._main, daemon=True)

    def start(self):
        self.thread.start()
        if not self.subscribed.wait(15):
            raise AssertionError("the subscriber did not get its SUBACK")
        return self

    def stop(self):
        self.stopped = True
        sock = self.sock
        if sock is not None:
            try:
                sock.sendall(b"\xe0\x00")
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.thread.join(10)

    def wait_count(self, n, timeout=30):
        wait_for(lambda: len(self.messages) >= n, timeout=timeout,
                 what="%d messages (have %d)" % (n, len(self.messages)))
        return self.messages

    def payloads(self, topic=None):
        return [m[1] for m in self.messages if topic is None or m[0] == topic]

    def _main(self):
        while not self.stopped:
            try:
                self._session()
            except (OSError, EOFError):
                pass
            if self.clean or self.stopped:
                return
            time.sleep(0.05)        # the broker is restarting: try again

    def _recv_packet(self, f):
        head = f.read(1)
        if not head:
            raise EOFError()
        n = shift = 0
        while True:
            b = f.read(1)
            if not b:
                raise EOFError()
            n |= (b[0] & 127) << shift
            shift += 7
            if not b[0] & 128:
                break
        body = f.read(n)
        if len(body) < n:
            raise EOFError()
        return head[0], body

    def _session(self):
        sock = socket.create_connection(("127.0.0.1", self.port), 5)
        sock.settimeout(None)
        self.sock = sock
        f = sock.makefile("rb")
        try:
            vh = _s(b"MQTT") + bytes([4, 0x02 if self.clean else 0]) + \
                struct.pack(">H", 0)
            pl = _s(self.client_id.encode())
            sock.sendall(b"\x10" + _enc_len(len(vh) + len(pl)) + vh + pl)
            kind, body = self._recv_packet(f)
            assert kind == 0x20 and body[1] == 0, (kind, body)
            self.connects += 1
            sub = struct.pack(">H", 1) + _s(self.topic.encode()) + b"\x01"
            sock.sendall(b"\x82" + _enc_len(len(sub)) + sub)
            while True:
                kind, body = self._recv_packet(f)
                if kind >> 4 == 9:          # SUBACK
                    assert body[2:] == b"\x01", body
                    self.subscribed.set()
                elif kind >> 4 == 3:        # PUBLISH
                    qos = (kind >> 1) & 3
                    tlen = struct.unpack(">H", body[:2])[0]
                    topic = body[2:2 + tlen].decode()
                    rest = body[2 + tlen:]
                    if qos:
                        pid, rest = rest[:2], rest[2:]
                    self.messages.append((topic, rest, bool(kind & 1),
                                          bool(kind & 8)))
                    if qos:
                        sock.sendall(b"\x40\x02" + pid)
        finally:
            self.sock = None
            f.close()
            sock.close()
