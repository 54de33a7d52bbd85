"""Attack tests of `myq supervise`, its workers and the init scripts'
stop. Each test performs the attack.

1. Secrets given to supervise (MYQ_HTTP_HEADER, an --mqtt URL with a user)
   reach the workers through their environment, never their command line,
   which every user reads (ps, /proc/PID/cmdline).
2. `supervise --user U --log FILE` never hands an existing non-empty file
   of root's (MYQ_LOG=/var/log/messages) to U.
3. A pidfile with another hard link (or another user's) is refused, never
   truncated nor written.
4. A bad --mqtt URL is echoed without its password; a bad http header line
   by its line number and name only.
5. procd's stop waits for (and kills) only processes of root or the service
   user: anyone can put "--spool SPOOL worker" in a command line. Likewise
   `supervise --stop` and init.d/myq's status never take another user's
   process for the supervisor of the pidfile.
6. Workers import myq from __pycache__/ only where the script's re-exec
   would trust it: a cache of another user, or writable by others, is
   never run.
"""
import importlib.util
import json
import marshal
import os
import pwd
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

import pytest

from _core import MYQ, call_myq, clean_env, one_line_error, run_myq, wait_for
from _core import cmdline, environ, world_python
from _http import Server, answer
from _procs import alive, children
from _sec import SECRET, become, make_user

BUSYBOX = shutil.which("busybox")

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root: the attacks are on what root does (CI runs as root)")
needs_busybox = pytest.mark.skipif(
    not BUSYBOX, reason="busybox not installed (apt-get install busybox)")

# The store plays no part in what these prove: `make test-sqlite` leaves them out.
pytestmark = pytest.mark.store_free("secrets, pidfiles and stops of supervise and the init scripts")


@pytest.fixture(scope="module")
def owner():
    for pw in make_user():
        yield pw


def other_user(owner):
    """A third user: neither root nor the service user (`owner`)."""
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody'")
    if pw.pw_uid in (0, owner.pw_uid):
        pytest.skip("'nobody' is not a user of its own here")
    return pw


def the_python():
    python = world_python()
    if not python:
        pytest.skip("no python3 that another user may run")
    return python


@pytest.fixture
def base():
    """A directory of root's (or ours), 0755: traversable by every user."""
    d = tempfile.mkdtemp(prefix="myq-supsec-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def spawn(argv, **kw):
    kw.setdefault("stdout", subprocess.DEVNULL)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(argv, start_new_session=True,
                            universal_newlines=True, **kw)


def end(p):
    """Stop a process started by spawn() and its session; its stderr."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except OSError:
            pass
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait(5)
    return p.stderr.read() if p.stderr else ""


def outcome(p, timeout=10):
    """(exit status or None while it still runs, stderr so far)."""
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        return None, ""
    return p.returncode, p.stderr.read()


def workers_of(sup):
    return sorted(p for p in children([sup.pid]) if "worker" in cmdline(p))


def handlers(base):
    d = os.path.join(base, "handlers")
    os.mkdir(d, 0o755)
    with open(os.path.join(d, "t"), "w") as f:
        f.write("#!/bin/sh\ncat >/dev/null\n")
    os.chmod(os.path.join(d, "t"), 0o755)
    return d


def state(spool, jid):
    cp = call_myq("--spool", spool, "show", jid)
    return cp.returncode == 0 and json.loads(cp.stdout)["state"]


# 1. secrets on the workers' command line ###################################

def test_supervise_gives_secrets_to_workers_through_the_environment(spool, tmp_path):
    """MYQ_HTTP_HEADER (a bearer token) and MYQ_MQTT (a broker URL with a
    user) given to supervise: no worker has them in its command line; the
    worker has them in its environment (owner-only), and the header still
    goes with an http job.  Fails on 5f3026f: the worker's command line
    holds `--http-header 'Authorization: Bearer SECRET'`."""
    srv = Server(default=lambda h: answer(h, 200, b""), protocol="HTTP/1.0").start()
    token = "Bearer " + SECRET
    user = "dev-" + SECRET[:12]
    sup = spawn([sys.executable, MYQ, "--spool", spool, "supervise", "--workers",
                 "1", "--handlers", handlers(str(tmp_path)), "--poll", "0.05"],
                env=clean_env({"MYQ_HTTP_HEADER": "Authorization: " + token,
                               "MYQ_MQTT": "mqtt://%s@127.0.0.1:1" % user}))
    try:
        pid = wait_for(lambda: workers_of(sup) and workers_of(sup)[0],
                       timeout=30, what="a worker")
        line = cmdline(pid, text=True)
        assert SECRET not in line and SECRET[:12] not in line, line
        env = environ(pid)
        assert env.get("MYQ_HTTP_HEADER") == "Authorization: " + token
        assert env.get("MYQ_MQTT") == "mqtt://%s@127.0.0.1:1" % user
        url = srv.url("/x")
        cp = call_myq("--spool", spool, "enqueue", "http",
                      json.dumps({"url": url, "method": "GET"}), "--id", "h1")
        assert cp.returncode == 0, cp.stderr
        wait_for(lambda: state(spool, "h1") == "done", timeout=30,
                 what="the http job")
        assert [r["headers"].get("Authorization") for r in srv.requests] == [token]
        for p in workers_of(sup):       # nor any later worker
            assert SECRET not in cmdline(p, text=True)
    finally:
        err = end(sup)
        srv.stop()
    assert SECRET not in err


def test_option_argv_skips_the_secret_options(myq):
    o = {"http_header": ["Authorization: Bearer " + SECRET], "mqtt": "mqtt://u@h",
         "concurrency": 2}
    argv = myq._option_argv(o, myq.WORKER_OPTIONS, skip=myq._SECRET_OPTIONS)
    assert argv == ["--concurrency", "2"]
    assert myq._secret_env(o) == {"MYQ_HTTP_HEADER": "Authorization: Bearer " + SECRET,
                                  "MYQ_MQTT": "mqtt://u@h"}


# 2. --log chowns an existing root file ####################################

def supervise_as(owner, base, *args):
    python = the_python()
    prog = os.path.join(base, "myq.py")
    if not os.path.exists(prog):
        shutil.copy(MYQ, prog)
        os.chmod(prog, 0o644)
    spool = os.path.join(base, "spool")
    if not os.path.isdir(spool):
        cp = run_myq("--spool", spool, "init", "--owner", owner.pw_name)
        assert cp.returncode == 0, cp.stderr
    return spawn([python, prog, "--spool", spool, "supervise", "--workers", "1",
                  "--user", owner.pw_name] + list(args), env=clean_env(), cwd="/")


@needs_root
def test_log_never_hands_an_existing_root_file_to_the_user(owner, base):
    """MYQ_LOG names an existing, non-empty file of root's (as
    /var/log/messages): supervise --user refuses (exit 78, a clear
    message) and the file stays root's, 0600, unchanged.  Fails on
    5f3026f: it is chowned to the service user."""
    log = os.path.join(base, "messages")
    with open(log, "w") as f:
        f.write("kernel: root's log " + SECRET + "\n")
    os.chmod(log, 0o600)
    before = os.stat(log)
    p = supervise_as(owner, base, "--log", log)
    try:
        code, err = outcome(p)
        st = os.stat(log)
    finally:
        end(p)
    assert (st.st_uid, st.st_gid, st.st_mode) == \
        (before.st_uid, before.st_gid, before.st_mode), "the log was handed over"
    assert open(log).read() == "kernel: root's log " + SECRET + "\n"
    assert code == 78, err
    assert "log file %s belongs to uid 0 and is not empty" % log in err, err
    assert len(err.strip().splitlines()) == 1, err


@needs_root
def test_log_an_empty_or_new_file_is_handed_to_the_user(owner, base):
    """What still works: a log file that is missing (created) or empty (an
    operator's touch) becomes the service user's."""
    os.mkdir(os.path.join(base, "log"), 0o755)
    for name in ("touched.log", "new.log"):
        log = os.path.join(base, "log", name)
        if name == "touched.log":
            open(log, "w").close()
        p = supervise_as(owner, base, "--log", log)
        try:
            wait_for(lambda: os.path.exists(log) and os.stat(log).st_uid == owner.pw_uid
                     and "event=supervise " in open(log).read(), timeout=20,
                     what="the supervisor's start in %s" % name)
        finally:
            end(p)
        assert p.returncode == 0, open(log).read()


# 3. the pidfile's hard links ##############################################

def test_pidfile_with_another_hard_link_is_refused(spool, tmp_path):
    """The pidfile's name is a hard link to another file (an attacker's
    link to /etc/shadow in a directory it may write to): refused (exit
    78), the file is neither truncated nor written.  Fails on 5f3026f:
    the file becomes the supervisor's pid."""
    victim = tmp_path / "shadow"
    victim.write_text("root:$6$secret:19000:0:99999:7:::\n")
    victim.chmod(0o600)
    pidfile = tmp_path / "run" / "myq.pid"
    pidfile.parent.mkdir()
    os.link(str(victim), str(pidfile))
    p = spawn([sys.executable, MYQ, "--spool", spool, "supervise", "--workers",
               "1", "--pidfile", str(pidfile)], env=clean_env())
    try:
        code, err = outcome(p)
    finally:
        end(p)
    assert victim.read_text() == "root:$6$secret:19000:0:99999:7:::\n"
    assert code == 78, err
    assert "pidfile %s has 2 hard links" % pidfile in err, err


@needs_root
def test_pidfile_of_another_user_is_refused(spool, tmp_path, owner):
    """A pidfile that another user made (it could write the pid of its
    choice there later): refused, left as it was."""
    run = tmp_path / "run"          # root's: the file was left there
    run.mkdir()
    pidfile = run / "myq.pid"
    pidfile.write_text("theirs\n")
    os.chown(str(pidfile), owner.pw_uid, owner.pw_gid)
    p = spawn([sys.executable, MYQ, "--spool", spool, "supervise", "--workers",
               "1", "--pidfile", str(pidfile)], env=clean_env())
    try:
        code, err = outcome(p)
    finally:
        end(p)
    got = pidfile.read_text() if pidfile.exists() else None
    assert got == "theirs\n", "the pidfile was written (%r)" % got
    assert code == 78 and "belongs to uid %d" % owner.pw_uid in err, err


# 4. secrets in error messages ##############################################

@pytest.mark.parametrize("command", [["supervise", "--dry-run"], ["worker", "--drain"]])
def test_bad_mqtt_url_is_echoed_without_its_password(spool, command):
    """Fails on 5f3026f: the whole URL, password included."""
    cp = call_myq("--spool", spool, *command, "--mqtt",
                  "mqtt://dev:%s@broker/topic" % SECRET)
    assert cp.returncode == 64, cp.stderr
    err = one_line_error(cp)
    assert "not an MQTT broker URL" in err and "mqtt://dev:***@broker/topic" in err, err
    assert SECRET not in err


@pytest.mark.parametrize("line,name", [
    ("Authorization Bearer %s" % SECRET, None),     # the ':' forgotten
    ("X Token: %s" % SECRET, "X Token"),            # a blank in the name
    ("%s" % SECRET, None),                          # the value alone
])
def test_bad_header_line_names_its_number_not_its_value(spool, tmp_path, line, name):
    """A bad line of --http-headers-file: its line number (and its name
    when it has one), never the line.  Fails on 5f3026f: the line is
    echoed, token included."""
    f = tmp_path / "headers"
    f.write_text("# credentials\nX-Fleet: north\n%s\n" % line)
    f.chmod(0o600)
    for command in (["supervise", "--dry-run"], ["worker", "--drain"]):
        cp = call_myq("--spool", spool, *command, "--http-headers-file", str(f))
        assert cp.returncode == 64, cp.stderr
        err = one_line_error(cp)
        assert SECRET not in err, err
        assert "line 3" in err and str(f) in err, err
        if name:
            assert repr(name) in err, err


def test_bad_header_variable_is_not_echoed(spool):
    """MYQ_HTTP_HEADER is one header a line: a bad one is named by its
    line, not shown."""
    cp = run_myq("--spool", spool, "supervise", "--dry-run",
                 env={"MYQ_HTTP_HEADER": "X-Fleet: a\nBearer " + SECRET})
    assert cp.returncode == 64, cp.stderr
    err = one_line_error(cp)
    assert SECRET not in err and "line 2" in err, err


# 5. stop finds the service's processes by their user, not their argv ######

def impostor(pw, spool, word, seconds=300):
    """A process of user `pw` whose command line says "--spool SPOOL WORD"
    (anyone may start one)."""
    return spawn([the_python(), "-c", "import time; time.sleep(%d)" % seconds,
                  "--spool", spool, word, "--handlers", "/x"],
                 preexec_fn=become(pw), cwd="/", stderr=subprocess.DEVNULL)


@needs_root
@needs_busybox
def test_procd_stop_is_not_held_by_another_users_process(tmp_path, owner):
    """procd's stop (service_stopped) with a process of the service user
    that says "--spool SPOOL worker" (waited for: it may be a worker) and
    one of a third user that says so too: stop returns once the first is
    gone, and leaves the third user's process alone.  Fails on 5f3026f:
    stop waits stop_timeout + 20 s for it, then SIGKILLs it as root."""
    from test_procd import OpenWrt
    o = OpenWrt(tmp_path)
    other = other_user(owner)
    theirs = ours = None
    try:
        o.settings(user=owner.pw_name, stop_timeout="1")
        theirs = impostor(other, o.spool, "worker")
        ours = impostor(owner, o.spool, "worker", seconds=2)
        wait_for(lambda: all(" --spool %s worker " % o.spool in cmdline(p.pid, text=True)
                             for p in (theirs, ours)),
                 what="the two processes")
        t0 = time.monotonic()
        r = o.run("stop", timeout=60)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stdout + r.stderr
        assert ours.poll() is not None, "stop did not wait for the user's worker"
        assert alive(theirs.pid), "stop killed another user's process"
        # the bug held it stop_timeout + 20 s = 21 s; ours takes ~2 s, and a
        # loaded machine may add a few (the bound was 8 s)
        assert took < 15, "stop was held %.1f s by another user's process" % took
    finally:
        for p in (theirs, ours):
            if p is not None:
                end(p)
        o.cleanup()


@needs_root
def test_supervise_stop_never_signals_another_users_process(spool, tmp_path, owner):
    """The pidfile names a pid now held by another user's process that
    says "--spool SPOOL supervise": `supervise --stop` (init.d/myq stop)
    signals nothing and returns at once.  Fails on 5f3026f: root SIGTERMs
    it."""
    other = other_user(owner)
    p = impostor(other, spool, "supervise")
    try:
        wait_for(lambda: " supervise " in cmdline(p.pid, text=True),
                 what="the impostor")
        pidfile = tmp_path / "myq.pid"
        pidfile.write_text("%d\n" % p.pid)
        t0 = time.monotonic()
        cp = run_myq("--spool", spool, "supervise", "--stop", "--pidfile",
                     str(pidfile), "--stop-timeout", "1")
        assert cp.returncode == 0, cp.stderr
        time.sleep(0.3)
        assert alive(p.pid), "root signalled another user's process"
        assert time.monotonic() - t0 < 10
    finally:
        end(p)


@needs_root
@needs_busybox
def test_initd_status_does_not_take_another_users_process_for_the_supervisor(
        tmp_path, owner):
    """init.d/myq status with a pidfile whose pid is another user's
    process that says "--spool X supervise": not running (1), so that
    start does start.  Fails on 5f3026f: "running" (0)."""
    from test_initd import Service
    bb = tmp_path / "bb"
    bb.mkdir()
    subprocess.check_call([BUSYBOX, "--install", "-s", str(bb)])
    if os.path.lexists(str(bb / "python3")):
        os.unlink(str(bb / "python3"))
    os.symlink(sys.executable, str(bb / "python3"))
    s = Service(tmp_path / "svc", str(bb), settings={"MYQ_USER": owner.pw_name})
    other = other_user(owner)
    p = impostor(other, s.spool, "supervise")
    try:
        wait_for(lambda: " supervise " in cmdline(p.pid, text=True),
                 what="the impostor")
        os.makedirs(os.path.dirname(s.pidfile))
        with open(s.pidfile, "w") as f:
            f.write("%d\n" % p.pid)
        r = s.run("status")
        assert r.returncode == 1, r.stdout + r.stderr
        assert alive(p.pid)
    finally:
        end(p)


# 6. the workers' byte code cache ###########################################

EVIL = """import os
with open(%r, "a") as f:
    f.write("%%d\\n" %% os.geteuid())
exec(compile(open(__file__, "rb").read(), __file__, "exec"))
"""


def plant_pyc(src, mark):
    """A .pyc for `src` (valid for its mtime and size, so Python uses it)
    that leaves a mark, then runs myq as the real one would."""
    pyc = importlib.util.cache_from_source(src)
    code = compile(EVIL % mark, src, "exec")
    st = os.stat(src)
    with open(pyc, "wb") as f:
        f.write(importlib.util.MAGIC_NUMBER + struct.pack(
            "<III", 0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
            + marshal.dumps(code))
    os.chmod(pyc, 0o644)
    return pyc


@pytest.mark.parametrize("cache", ["root-or-ours", "world-writable", "another-user"])
def test_workers_use_only_a_trusted_byte_code_cache(base, spool, cache, request):
    """myq.py in a directory of ours (0755), its __pycache__/ holding a
    .pyc for it that another user could have put there (the directory is
    world-writable, or the other user's): the supervisor's workers never
    run it, they compile myq.py from its source.  A cache of our own is
    still used (the mark is there).  Fails on 5f3026f: the workers import
    the planted byte code."""
    if cache == "another-user":
        if os.geteuid() != 0:
            pytest.skip("needs root (a directory of another user's)")
        owner = request.getfixturevalue("owner")
    prog = os.path.join(base, "myq.py")
    shutil.copy(MYQ, prog)
    os.chmod(prog, 0o644)
    mark = os.path.join(base, "ran-the-pyc")
    os.mkdir(os.path.join(base, "__pycache__"), 0o755)
    pyc = plant_pyc(prog, mark)
    if cache == "world-writable":
        os.chmod(os.path.dirname(pyc), 0o777)
    elif cache == "another-user":
        os.chown(os.path.dirname(pyc), owner.pw_uid, owner.pw_gid)
        os.chown(pyc, owner.pw_uid, owner.pw_gid)
    env = clean_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    sup = spawn([sys.executable, prog, "--spool", spool, "supervise", "--workers",
                 "1", "--handlers", handlers(base), "--poll", "0.05"], env=env,
                cwd="/")
    try:
        cp = call_myq("--spool", spool, "enqueue", "t", "null", "--id", "j1")
        assert cp.returncode == 0, cp.stderr
        wait_for(lambda: state(spool, "j1") == "done", timeout=30,
                 what="the supervised worker to run the job")
    finally:
        end(sup)
    ran = os.path.exists(mark)
    if cache == "root-or-ours":
        assert ran, "a byte code cache of our own is no longer used"
    else:
        assert not ran, "a worker ran byte code that another user could " \
            "have written (%s)" % open(mark).read().split()


def test_a_worker_that_drops_root_needs_a_library_it_can_read(myq, monkeypatch):
    """A worker or supervisor that became the spool's user with a Python
    that user cannot read (one under /root) died importing its modules one
    by one, or restarted without a word: it says so (78)."""
    seen = []
    monkeypatch.setattr(myq.os, "access", lambda p, m: seen.append(p) and False)
    with pytest.raises(myq.ConfigError) as e:
        myq._readable_library(1234)
    assert "uid 1234 cannot read this Python's library" in str(e.value)
    assert seen == [os.path.dirname(os.__file__)]
