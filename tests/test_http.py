"""The built-in `http` handler, against a real HTTP server.

Each test starts the suite's test server (_http.Server, 127.0.0.1, port 0)
in a thread; its routes decide the behaviour (status, Retry-After, slow,
reset, close mid-response, redirect) and it records every request it
receives.
Jobs are run one at a time, in process (`myq.Worker(...).run(once=True)`) or
through the CLI (`worker --once`) where a worker option is under test.
The python3-light tests run myq in a child interpreter whose import system
refuses the modules OpenWrt's python3-light does not ship.
"""
import email.utils
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from _core import ROOT, call_myq, free_port, has
from _http import answer, http_server, http_servers  # noqa: F401 (fixtures)

SECRET = "s3cret-TOKEN-7f3a"


# --------------------------------------------------------------------------
# the test server (_http.Server): every answer closes its connection

def reply(h, status, body=b"", headers=()):
    answer(h, status, body, headers, close=True, ctype="text/plain; charset=utf-8")


def status(code, body=None, headers=()):
    return lambda h: reply(h, code, "status %d: body of the reply" % code
                           if body is None else body, headers)


@pytest.fixture
def server(http_server):
    http_server.default = status(200, "ok")
    return http_server


def slow(h):
    h.server.release.wait(10)   # far past the job's timeout
    reply(h, 200, "too late")


def reset(h):
    """Read the request, then drop the connection with a TCP RST."""
    h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    h.wfile.close()
    h.rfile.close()
    h.connection.close()
    h.close_connection = True


def close_before_status(h):
    h.connection.shutdown(socket.SHUT_RDWR)
    h.close_connection = True


def close_mid_body(h):
    """A 200 whose body stops after 10 of the 1000 announced bytes."""
    h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b"x" * 10)
    h.wfile.flush()
    h.connection.shutdown(socket.SHUT_RDWR)
    h.close_connection = True


# --------------------------------------------------------------------------
# helpers

def run_once(myq, spool, **kw):
    kw.setdefault("jitter", 0)
    myq.Worker(spool, **kw).run(once=True)


def enqueue_run(myq, spool, payload, max_attempts=5, **kw):
    jid = myq.enqueue(spool, "http", payload, max_attempts=max_attempts)
    run_once(myq, spool, **kw)
    return jid, myq.open_store(spool).show(jid)


def spool_files_containing(spool, needle):
    found = []
    for d, _, files in os.walk(spool):
        for f in files:
            p = os.path.join(d, f)
            if not os.path.isfile(p) or os.path.islink(p):
                continue            # locks/wake is a FIFO: opening it blocks
            try:
                with open(p, "rb") as fh:
                    if needle.encode() in fh.read():
                        found.append(os.path.relpath(p, spool))
            except OSError:
                pass
    return found


def assert_retried(job, attempts=1):
    assert job["state"] == "scheduled", job
    assert job["attempts"] == attempts, job
    assert job["last_error"], job


# --------------------------------------------------------------------------
# the request

def test_default_post_json_body_and_idempotency_key(myq, spool, server):
    body = {"event": "door", "open": True, "n": [1, 2], "name": "caf\u00e9"}
    jid, job = enqueue_run(myq, spool, {"url": server.url("/ev"), "body": body})
    assert job["state"] == "done", job
    (req,) = server.hits("/ev")
    assert req["method"] == "POST"
    assert req["headers"]["Content-Type"].split(";")[0].strip() == "application/json"
    assert json.loads(req["body"].decode("utf-8")) == body
    assert req["headers"]["Idempotency-Key"] == jid


def test_string_body_sent_as_utf8_text_with_method_and_headers(myq, spool, server):
    text = "temp=21.5 \u00b0C \u2603"
    jid, job = enqueue_run(myq, spool, {"url": server.url("/t"), "method": "PUT",
                                        "headers": {"X-Device": "dev-7"}, "body": text})
    assert job["state"] == "done", job
    (req,) = server.hits("/t")
    assert req["method"] == "PUT"
    assert req["body"] == text.encode("utf-8")
    ctype = req["headers"].get("Content-Type", "").lower()
    assert ctype.startswith("text/plain"), ctype
    assert req["headers"]["X-Device"] == "dev-7"
    assert req["headers"]["Idempotency-Key"] == jid


def test_get_without_body(myq, spool, server):
    _, job = enqueue_run(myq, spool, {"url": server.url("/g"), "method": "GET"})
    assert job["state"] == "done", job
    (req,) = server.hits("/g")
    assert req["method"] == "GET" and req["body"] == b""


# --------------------------------------------------------------------------
# outcomes by status

@pytest.mark.parametrize("code", [200, 201, 202, 204])
def test_2xx_is_done(myq, spool, server, code):
    server.routes["/s"] = status(code, "" if code == 204 else None)
    _, job = enqueue_run(myq, spool, {"url": server.url("/s")})
    assert job["state"] == "done", job
    assert job["attempts"] == 1


@pytest.mark.parametrize("code", [408, 425, 429, 500, 502, 503, 504])
def test_retryable_status_is_scheduled_with_status_and_body_in_last_error(myq, spool,
                                                                         server, code):
    server.routes["/s"] = status(code, "upstream says %d-WHY" % code)
    _, job = enqueue_run(myq, spool, {"url": server.url("/s")}, backoff_base=30)
    assert_retried(job)
    assert str(code) in job["last_error"], job
    assert "%d-WHY" % code in job["last_error"], job


@pytest.mark.parametrize("code", [400, 401, 403, 404, 405, 410, 422])
def test_other_status_is_dead_with_status_and_body_in_last_error(myq, spool, server, code):
    server.routes["/s"] = status(code, "client error %d-WHY" % code)
    _, job = enqueue_run(myq, spool, {"url": server.url("/s")}, max_attempts=5)
    assert job["state"] == "dead", job
    assert job["attempts"] == 1
    assert str(code) in job["last_error"] and "%d-WHY" % code in job["last_error"], job


def test_last_error_holds_only_the_start_of_a_big_body(myq, spool, server):
    big = "START-" + "y" * (1 << 20)
    server.routes["/big"] = status(400, big)
    _, job = enqueue_run(myq, spool, {"url": server.url("/big")})
    assert job["state"] == "dead", job
    assert "400" in job["last_error"] and "START-" in job["last_error"]
    assert len(job["last_error"]) < 8192, len(job["last_error"])


def test_retryable_status_on_last_attempt_is_dead(myq, spool, server):
    server.routes["/s"] = status(503, "busy")
    _, job = enqueue_run(myq, spool, {"url": server.url("/s")}, max_attempts=1)
    assert job["state"] == "dead", job
    assert "503" in job["last_error"]


def test_retry_then_success_sends_the_same_idempotency_key(myq, spool, server):
    server.routes["/s"] = status(503, "busy")
    jid, job = enqueue_run(myq, spool, {"url": server.url("/s")}, backoff_base=0.2)
    assert_retried(job)
    server.routes["/s"] = status(200, "ok")
    deadline = time.time() + 10
    while myq.open_store(spool).show(jid)["state"] != "ready" and time.time() < deadline:
        time.sleep(0.05)
    run_once(myq, spool, backoff_base=0.2)
    job = myq.open_store(spool).show(jid)
    assert job["state"] == "done", job
    assert job["attempts"] == 2
    keys = [r["headers"]["Idempotency-Key"] for r in server.hits("/s")]
    assert keys == [jid, jid]


# --------------------------------------------------------------------------
# network errors: retry

def test_connection_refused_is_retried(myq, spool):
    _, job = enqueue_run(myq, spool, {"url": "http://127.0.0.1:%d/x" % free_port()},
                         backoff_base=30)
    assert_retried(job)


def test_connection_reset_is_retried(myq, spool, server):
    server.routes["/r"] = reset
    _, job = enqueue_run(myq, spool, {"url": server.url("/r")}, backoff_base=30)
    assert server.hits("/r")
    assert_retried(job)


def test_close_before_the_status_line_is_retried(myq, spool, server):
    server.routes["/c"] = close_before_status
    _, job = enqueue_run(myq, spool, {"url": server.url("/c")}, backoff_base=30)
    assert server.hits("/c")
    assert_retried(job)


def test_close_in_the_middle_of_the_body_is_retried(myq, spool, server):
    """A 200 whose body is cut off is not a delivered request: retry."""
    server.routes["/m"] = close_mid_body
    _, job = enqueue_run(myq, spool, {"url": server.url("/m")}, backoff_base=30)
    assert server.hits("/m")
    assert_retried(job)


def test_dns_failure_is_retried(myq, spool):
    t = time.time()
    try:
        socket.getaddrinfo("myq-test.invalid", 80)
        pytest.skip("this resolver answers for .invalid names")
    except socket.gaierror:
        pass
    if time.time() - t > 3:
        pytest.skip("the resolver is too slow to test DNS failure")
    _, job = enqueue_run(myq, spool, {"url": "http://myq-test.invalid/x", "timeout": 3},
                         backoff_base=30)
    assert_retried(job)


def test_server_slower_than_payload_timeout_is_retried(myq, spool, server):
    server.routes["/slow"] = slow
    _, job = enqueue_run(myq, spool, {"url": server.url("/slow"), "timeout": 0.5},
                         backoff_base=30)
    assert server.hits("/slow")
    assert_retried(job)   # had the timeout been ignored, the 200 would make it done


def test_server_slower_than_job_timeout_is_retried(myq, spool, server):
    """The job's own `timeout` field bounds the request too."""
    server.routes["/slow"] = slow
    jid = myq.enqueue(spool, "http", {"url": server.url("/slow")}, timeout=0.5)
    run_once(myq, spool, backoff_base=30)
    job = myq.open_store(spool).show(jid)
    assert server.hits("/slow")
    assert_retried(job)


# --------------------------------------------------------------------------
# Retry-After

def _delay(myq, spool, jid, t0, t1):
    avail = myq.open_store(spool).show(jid)["available_at"]
    return avail - t1, avail - t0


def test_retry_after_seconds_is_honoured(myq, spool, server):
    server.routes["/s"] = status(503, "later", [("Retry-After", "30")])
    jid = myq.enqueue(spool, "http", {"url": server.url("/s")})
    t0 = time.time()
    run_once(myq, spool, backoff_base=1, backoff_max=3600)
    t1 = time.time()
    assert_retried(myq.open_store(spool).show(jid))
    lo, hi = _delay(myq, spool, jid, t0, t1)
    assert 28.5 <= lo and hi <= 31.5, (lo, hi)


def test_retry_after_http_date_is_honoured(myq, spool, server):
    target = int(time.time()) + 40
    server.routes["/s"] = status(429, "slow down",
                                 [("Retry-After", email.utils.formatdate(target, usegmt=True))])
    jid = myq.enqueue(spool, "http", {"url": server.url("/s")})
    run_once(myq, spool, backoff_base=1, backoff_max=3600)
    job = myq.open_store(spool).show(jid)
    assert_retried(job)
    assert abs(job["available_at"] - target) <= 2, job["available_at"] - target


def test_retry_after_seconds_capped_by_backoff_max(myq, spool, server):
    server.routes["/s"] = status(503, "later", [("Retry-After", "86400")])
    jid = myq.enqueue(spool, "http", {"url": server.url("/s")})
    t0 = time.time()
    run_once(myq, spool, backoff_base=1, backoff_max=20)
    t1 = time.time()
    lo, hi = _delay(myq, spool, jid, t0, t1)
    assert 18.5 <= lo and hi <= 21.5, (lo, hi)


def test_retry_after_date_capped_by_cli_backoff_max(myq, spool, server, run_myq):
    far = email.utils.formatdate(time.time() + 86400, usegmt=True)
    server.routes["/s"] = status(503, "later", [("Retry-After", far)])
    jid = myq.enqueue(spool, "http", {"url": server.url("/s")})
    t0 = time.time()
    p = run_myq("--spool", spool, "worker", "--once", "--jitter", "0",
                "--backoff-base", "1", "--backoff-max", "20")
    t1 = time.time()
    assert p.returncode == 0, p.stderr
    shown = call_myq("--spool", spool, "show", jid)
    job = json.loads(shown.stdout)
    assert_retried(job)
    assert 18.5 <= job["available_at"] - t1 and job["available_at"] - t0 <= 21.5, \
        (job["available_at"] - t1, job["available_at"] - t0)


def test_unparsable_retry_after_falls_back_to_backoff(myq, spool, server):
    server.routes["/s"] = status(503, "later", [("Retry-After", "soon-ish")])
    jid = myq.enqueue(spool, "http", {"url": server.url("/s")})
    t0 = time.time()
    run_once(myq, spool, backoff_base=7, backoff_max=3600)
    t1 = time.time()
    assert_retried(myq.open_store(spool).show(jid))
    lo, hi = _delay(myq, spool, jid, t0, t1)
    assert 5.5 <= lo and hi <= 8.5, (lo, hi)


# --------------------------------------------------------------------------
# redirects

@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_redirect_not_followed_for_non_idempotent_method(myq, spool, server, code, method):
    server.routes["/from"] = status(code, "moved", [("Location", server.url("/to"))])
    _, job = enqueue_run(myq, spool, {"url": server.url("/from"), "method": method,
                                      "body": {"a": 1}})
    assert server.hits("/from")
    assert server.hits("/to") == [], "a %s was re-sent to the redirect target" % method
    assert job["state"] == "dead", job
    assert str(code) in job["last_error"], job


def test_redirect_for_get_is_consistent(myq, spool, server):
    """GET may follow: if it did, the target answered 200 (done); if not, 302 is dead."""
    server.routes["/from"] = status(302, "moved", [("Location", server.url("/to"))])
    _, job = enqueue_run(myq, spool, {"url": server.url("/from"), "method": "GET"})
    if server.hits("/to"):
        assert job["state"] == "done", job
        assert server.hits("/to")[0]["method"] == "GET"
    else:
        assert job["state"] == "dead" and "302" in job["last_error"], job


# --------------------------------------------------------------------------
# configured headers

def _check_merge(server, spool, jid, secret):
    (req,) = server.hits("/h")
    h = req["headers"]
    assert h.get_all("Authorization") == ["Bearer " + secret], h.get_all("Authorization")
    assert h["X-Job"] == "job-own"
    assert h["Idempotency-Key"] == jid
    assert has(spool, "done", jid)
    assert spool_files_containing(spool, secret) == []


def test_cli_http_header_merged_and_wins_and_not_stored(myq, spool, server, run_myq):
    jid = myq.enqueue(spool, "http", {"url": server.url("/h"), "headers": {
        "Authorization": "Bearer job-value", "X-Job": "job-own"}})
    p = run_myq("--spool", spool, "worker", "--once", "--jitter", "0",
                "--http-header", "Authorization: Bearer " + SECRET,
                "--http-header", "X-Fleet: north")
    assert p.returncode == 0, p.stderr
    assert json.loads(call_myq("--spool", spool, "show", jid).stdout)["state"] == "done"
    _check_merge(server, spool, jid, SECRET)
    assert server.hits("/h")[0]["headers"]["X-Fleet"] == "north"


def test_cli_http_headers_file(myq, spool, server, run_myq, tmp_path):
    f = tmp_path / "headers"
    f.write_text("# central server credentials\nAuthorization: Bearer %s\n\n"
                 "X-Fleet: south\n" % SECRET)
    f.chmod(0o600)
    jid = myq.enqueue(spool, "http", {"url": server.url("/h"), "headers": {
        "authorization": "Bearer job-value", "X-Job": "job-own"}})
    p = run_myq("--spool", spool, "worker", "--once", "--jitter", "0",
                "--http-headers-file", str(f))
    assert p.returncode == 0, p.stderr
    assert SECRET not in p.stderr
    _check_merge(server, spool, jid, SECRET)
    assert server.hits("/h")[0]["headers"]["X-Fleet"] == "south"


def test_python_api_http_headers_case_insensitive_override(myq, spool, server):
    """Header names are case-insensitive: a job's `authorization` is the same header."""
    jid = myq.enqueue(spool, "http", {"url": server.url("/h"), "headers": {
        "authorization": "Bearer job-value", "x-job": "job-own"}})
    run_once(myq, spool, http_headers={"Authorization": "Bearer " + SECRET})
    assert myq.open_store(spool).show(jid)["state"] == "done"
    _check_merge(server, spool, jid, SECRET)


def test_secret_not_stored_when_the_job_fails(myq, spool, server):
    server.routes["/h"] = status(401, "unauthorized")
    jid = myq.enqueue(spool, "http", {"url": server.url("/h")})
    run_once(myq, spool, http_headers={"Authorization": "Bearer " + SECRET})
    job = myq.open_store(spool).show(jid)
    assert job["state"] == "dead" and "401" in job["last_error"], job
    assert spool_files_containing(spool, SECRET) == []


# --------------------------------------------------------------------------
# python3-light: urllib/ssl imported only when an http job runs

LIGHT = textwrap.dedent("""
    import sys
    BLOCK = set(sys.argv[1].split(","))
    class Light:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCK:
                raise ImportError("No module named %r (python3-light)" % name)
            return None
    for m in list(sys.modules):
        if m.split(".")[0] in BLOCK:
            del sys.modules[m]
    sys.meta_path.insert(0, Light())
    sys.path.insert(0, sys.argv[2])
    import myq
    sys.exit(myq.main(sys.argv[3:]))
""")

NOT_IN_LIGHT = ("logging uuid urllib http email ssl _ssl _hashlib sqlite3 _sqlite3 ctypes "
                "_ctypes multiprocessing asyncio concurrent decimal _decimal xml pyexpat "
                "unittest lzma _lzma dbm unicodedata curses readline venv pydoc").split()


def run_light(block, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYQ_")}
    return subprocess.run([sys.executable, "-c", LIGHT, ",".join(block), ROOT]
                          + [str(a) for a in args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, env=env, timeout=60)


@pytest.mark.files_only("python3-light has no sqlite3: SQLite is refused")
def test_python3_light_http_job_is_held_naming_python3_urllib(spool, server):
    """Without Python's http modules the http type is held (its
    jobs wait, no attempt spent), not dead."""
    p = run_light(NOT_IN_LIGHT, "--spool", spool, "enqueue", "http",
                  json.dumps({"url": server.url("/x")}), "--max-attempts", "5")
    assert p.returncode == 0, p.stderr
    jid = p.stdout.strip()
    p = run_light(NOT_IN_LIGHT, "--spool", spool, "worker", "--once", "--jitter", "0")
    assert "Traceback" not in p.stderr, p.stderr
    p = run_light(NOT_IN_LIGHT, "--spool", spool, "show", jid)
    assert p.returncode == 0, p.stderr
    job = json.loads(p.stdout)
    assert job["state"] == "held" and job["attempts"] == 0, job
    assert "python3-urllib" in job["last_error"], job
    assert server.requests == []


def test_https_without_ssl_is_dead_naming_python3_openssl(spool):
    block = ["ssl", "_ssl", "_hashlib"]
    p = run_light(block, "--spool", spool, "enqueue", "http",
                  json.dumps({"url": "https://127.0.0.1:%d/x" % free_port()}))
    assert p.returncode == 0, p.stderr
    jid = p.stdout.strip()
    p = run_light(block, "--spool", spool, "worker", "--once", "--jitter", "0")
    assert "Traceback" not in p.stderr, p.stderr
    job = json.loads(run_light(block, "--spool", spool, "show", jid).stdout)
    assert job["state"] == "dead", job
    assert "python3-openssl" in job["last_error"], job


def test_urllib_imported_only_when_an_http_job_runs(spool, handlers_dir, server):
    """`import myq` and a non-http job leave urllib.request/http/ssl/email unloaded."""
    hdir = handlers_dir("noop", "cat >/dev/null")
    code = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        NET = ("urllib.request", "http", "http.client", "ssl", "email")
        loaded = lambda: sorted(m for m in NET if m in sys.modules)
        out = {"start": loaded()}
        import myq
        out["import"] = loaded()
        myq.enqueue(sys.argv[2], "noop", {"x": 1})
        myq.Worker(sys.argv[2], handlers_dir=sys.argv[3], jitter=0).run(once=True)
        out["noop_job"] = loaded()
        jid = myq.enqueue(sys.argv[2], "http", {"url": sys.argv[4]})
        myq.Worker(sys.argv[2], jitter=0).run(once=True)
        out["http_state"] = myq.open_store(sys.argv[2]).show(jid)["state"]
        print(json.dumps(out))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYQ_")}
    p = subprocess.run([sys.executable, "-c", code, ROOT, spool, hdir, server.url("/x")],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    # (compared with what the interpreter itself loaded before `import myq`)
    assert set(out["import"]) - set(out["start"]) == set(), out
    assert set(out["noop_job"]) - set(out["start"]) == set(), out
    assert out["http_state"] == "done", out
