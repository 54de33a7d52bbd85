"""The test HTTP server of the suite: one recording, scriptable server.

`Server` is a stdlib ThreadingHTTPServer on 127.0.0.1 (port 0), HTTP/1.1
keep-alive (or `protocol="HTTP/1.0"`: a connection per request), optionally
TLS (`tls=` an ssl server context; the handshake runs in the connection's
thread).  Its routes decide the behaviour: `routes[path]` (the path without
its query) or else `default`, each a function of the request handler `h`
that answers (`answer(h, ...)`), stays silent, or misbehaves on purpose
through `h.wfile` / `h.connection`.  A route sees `h.n` (the request's
number on its connection), `h.conn_no`, `h.record` (what is recorded of
this request) and `h.server.release` (an Event set when the server stops,
for routes that hang).

What it records, under `lock` (an RLock; its Condition is `cond`,
notified at each change):
- `requests`: one dict per request in arrival order: method, path, target
  (the path with its query), headers (an email.message.Message), body
  (bytes, as read by Content-Length), conn (the connection's number, from
  1), n (the request's number on that connection), time (time.time()) and
  mono (time.monotonic()) when it was read, status (the status the route
  sent, None before it or if it wrote none), end (time.monotonic() when
  the route returned);
- `connections` (opened; for TLS: handshakes that succeeded), `closed`
  (the numbers of the connections that ended, in order), `handshakes`,
  `resumed` (session_reused per handshake), `tls_failures`.

Waiting is on the Condition, never a sleep: `wait(pred)`,
`wait_requests(n)`, `wait_closed(n)` return pred's value (false after the
timeout).

    with Server(default=lambda h: answer(h, 503)) as srv:
        ... srv.url("/x") ...

Fixtures (import them into a test module): `http_server` (one started
server, default route `answer`), `http_servers` (make(**Server options) ->
a started server; all stopped at the end of the test).
"""
import http.server
import select
import shutil
import socket
import ssl
import subprocess
import threading
import time

import pytest


def answer(h, status=200, body=b"ok", headers=(), close=False, ctype=None):
    """A whole answer: status, headers, Content-Type if ctype,
    Content-Length, `Connection: close` (and the connection closed after
    it) if close; no body to a HEAD."""
    if isinstance(body, str):
        body = body.encode("utf-8")
    h.send_response(status)
    for k, v in headers:
        h.send_header(k, v)
    if ctype is not None:
        h.send_header("Content-Type", ctype)
    h.send_header("Content-Length", str(len(body)))
    if close:
        h.send_header("Connection", "close")
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)
    if close:
        h.close_connection = True


def client_gone(sock):
    """True once the client closed its end of sock (no waiting)."""
    r, _, _ = select.select([sock], [], [], 0)
    if not r:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 20                # a connection the client forgot
    record = None

    def log_message(self, *args):
        pass

    def setup(self):
        srv = self.server
        self.protocol_version = srv.protocol
        if srv.tls is not None:
            self.request.settimeout(5)
            try:
                self.request.do_handshake()
            except (OSError, ssl.SSLError) as e:
                with srv.cond:
                    srv.tls_failures.append(str(e))
                    srv.cond.notify_all()
                raise
            with srv.cond:
                srv.handshakes += 1
                srv.resumed.append(self.request.session_reused)
            self.request.settimeout(None)
        http.server.BaseHTTPRequestHandler.setup(self)
        with srv.cond:
            srv.connections += 1
            self.conn_no = srv.connections
            srv.cond.notify_all()
        self.n = 0

    def finish(self):
        try:
            http.server.BaseHTTPRequestHandler.finish(self)
        finally:
            srv = self.server
            with srv.cond:
                srv.closed.append(getattr(self, "conn_no", None))
                srv.cond.notify_all()

    def send_response(self, code, message=None):
        if self.record is not None:
            with self.server.cond:
                self.record["status"] = code
                self.server.cond.notify_all()
        http.server.BaseHTTPRequestHandler.send_response(self, code, message)

    def _any(self):
        srv = self.server
        self.n += 1
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        path = self.path.split("?", 1)[0]
        rec = {"method": self.command, "path": path, "target": self.path,
               "headers": self.headers, "body": body, "conn": self.conn_no,
               "n": self.n, "time": time.time(), "mono": time.monotonic(),
               "status": None, "end": None}
        with srv.cond:
            srv.requests.append(rec)
            srv.cond.notify_all()
        self.record = rec
        try:
            srv.routes.get(path, srv.default)(self)
        finally:
            self.record = None
            with srv.cond:
                rec["end"] = time.monotonic()
                srv.cond.notify_all()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _any


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, default=answer, routes=None, tls=None,
                 protocol="HTTP/1.1"):
        http.server.ThreadingHTTPServer.__init__(self, ("127.0.0.1", 0), Handler)
        self.default = default
        self.routes = dict(routes or {})
        self.tls = tls
        self.protocol = protocol
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.requests, self.closed = [], []
        self.connections = self.handshakes = 0
        self.resumed, self.tls_failures = [], []
        self.release = threading.Event()   # lets hanging routes end at stop
        self.thread = None

    # -- life

    def start(self):
        self.thread = threading.Thread(target=self.serve_forever,
                                       kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()
        return self

    def stop(self):
        self.release.set()
        if self.thread is not None:
            self.shutdown()
            self.thread.join(5)
        self.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def get_request(self):
        sock, addr = self.socket.accept()
        if self.tls is not None:    # the handshake runs in the handler's thread
            sock = self.tls.wrap_socket(sock, server_side=True,
                                        do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request, client_address):
        pass  # resets and half-closed sockets are on purpose here

    # -- addresses

    @property
    def port(self):
        return self.server_address[1]

    def origin(self):
        return "%s://127.0.0.1:%d" % ("https" if self.tls else "http", self.port)

    def url(self, path="/"):
        return self.origin() + path

    # -- what it saw

    def hits(self, path):
        return [r for r in self.requests if r["path"] == path]

    def keys(self, path=None):
        return [r["headers"]["Idempotency-Key"] for r in self.requests
                if path is None or r["path"] == path]

    def answers(self):
        """(time, status, Idempotency-Key) of each request answered so far."""
        with self.cond:
            return [(r["time"], r["status"], r["headers"].get("Idempotency-Key"))
                    for r in self.requests if r["status"] is not None]

    def wait(self, pred, timeout=10):
        """pred() (called under the lock) once true, or false after timeout."""
        with self.cond:
            return self.cond.wait_for(pred, timeout)

    def wait_requests(self, n=1, timeout=10):
        """Until the server has read n requests."""
        return self.wait(lambda: len(self.requests) >= n, timeout)

    def wait_closed(self, n=1, timeout=10):
        """Until the server saw n connections end."""
        return self.wait(lambda: len(self.closed) >= n, timeout)


# --------------------------------------------------------------------------
# TLS

def self_signed(directory):
    """A self-signed certificate for 127.0.0.1 in directory: (cert.pem,
    key.pem); the test is skipped without a working openssl command."""
    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command to make a test certificate "
                    "(apt-get install openssl)")
    c, k = str(directory / "cert.pem"), str(directory / "key.pem")
    p = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                        "-keyout", k, "-out", c, "-days", "2", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    if p.returncode != 0:
        pytest.skip("openssl cannot make a certificate here: %s"
                    % p.stderr.decode(errors="replace")[-300:])
    return c, k


def tls_context(cert, key):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx


def down(h):
    """A route: 503, a destination that is down."""
    answer(h, 503, b"down")


# --------------------------------------------------------------------------
# fixtures

@pytest.fixture
def http_servers():
    """make(**Server options) -> a started Server; all stopped at the end."""
    made = []

    def make(**kw):
        srv = Server(**kw).start()
        made.append(srv)
        return srv
    yield make
    for srv in made:
        srv.stop()


@pytest.fixture
def http_server(http_servers):
    """One started Server, default route `answer` (200 "ok", kept)."""
    return http_servers()


@pytest.fixture
def status_servers(http_servers):
    """make(status) -> a started Server where status(handler) gives the
    status of every answer (200 by default; the connection closed after
    it); srv.answers() lists (time, status, Idempotency-Key)."""
    def make(status=lambda h: 200):
        def route(h):
            code = status(h)
            answer(h, code, b"status %d" % code, close=True)
        return http_servers(default=route)
    return make
