"""Setting a device up: `check` knows when no
worker runs and when the logs go nowhere, and names an unreadable file as
such; a change of MYQ_USER gives the whole layout to the new owner; `import
myq` works after every documented install; export/import carry the policy
and the queue's name; workers under MYQ_USER look and weigh as root's.

The installs are tried the way a user would: into a tree under tmp_path,
then run by "the system's python3" -- a venv of a plain interpreter stands
for it (its own prefix, its default sys.path, no PYTHONPATH), as installing
into this machine's real site directory is not a test's to do.
"""
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from _core import ROOT, MYQ
from _pythons import pyenv_root

DIST = os.path.join(ROOT, "build", "dist.py")
BUSYBOX = shutil.which("busybox")
MAKE = shutil.which("make")


def _run(args, cwd=None, env=None, timeout=120):
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("MYQ_", "PYTHON"))}
    full.update(env or {})
    return subprocess.run([str(a) for a in args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True,
                          env=full, cwd=cwd, timeout=timeout)


def _ok(r):
    assert r.returncode == 0, "%s\n%s%s" % (r.args, r.stdout, r.stderr)
    return r.stdout


# 3. `import myq` after an install ###########################################

def _plain_python():
    """A plain CPython (not the test venv's), to make a venv of."""
    root = pyenv_root()
    for v in ("3.11.7", "3.12.1", "3.10.13", "3.9.18"):
        exe = os.path.join(root or "", "versions", v, "bin", "python3")
        if root and os.access(exe, os.X_OK):
            return exe
    base = getattr(sys, "_base_executable", None) or sys.executable
    return base


@pytest.fixture
def system_python(tmp_path):
    """A venv of a plain interpreter, standing for the system's python3:
    its prefix is tmp_path/sys, its site directory the one it reads."""
    prefix = tmp_path / "sys"
    _ok(_run([_plain_python(), "-m", "venv", "--without-pip", prefix]))
    return str(prefix), str(prefix / "bin" / "python3")


def _imports_myq(python, prefix, cwd):
    """`python3 -c 'import myq'` as a user types it: another directory, no
    PYTHONPATH, then under -I too; the module is the installed one."""
    for flags in ([], ["-I"]):
        r = _run([python] + flags + ["-c", "import myq, sys; "
                                     "sys.stdout.write(myq.__file__)"],
                 cwd=str(cwd))
        assert r.returncode == 0, "import myq failed (%s): %s" % (flags, r.stderr)
        assert r.stdout == os.path.join(prefix, "lib", "myq", "myq.py")


def _land(dest, prefix):
    """The tree staged under DESTDIR copied to where it names itself (as an
    image is flashed)."""
    staged = os.path.join(str(dest), prefix.lstrip("/"))
    for dirpath, _, files in os.walk(staged):
        rel = os.path.relpath(dirpath, staged)
        os.makedirs(os.path.join(prefix, rel), exist_ok=True)
        for f in files:
            shutil.copy2(os.path.join(dirpath, f), os.path.join(prefix, rel, f))


def _repo_copy(dst):
    for rel in ("Makefile", "myq.py", "build/dist.py", "init.d/myq",
                "init.d/myq.default", "init.d/myq.procd", "init.d/myq.config",
                "LICENSE", "build/myq.1", "build/myq-spool.5"):
        os.makedirs(os.path.join(str(dst), os.path.dirname(rel)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(str(dst), rel))
    return str(dst)


def test_import_myq_after_myq_install(tmp_path, system_python):
    """`python3 myq.py install` (the one file, run by the system's python3)
    then `python3 -c 'import myq'` anywhere: it imports the installed
    module, with no sys.path edit."""
    prefix, python = system_python
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(MYQ, str(one / "myq.py"))
    dest = tmp_path / "dest"
    dest.mkdir()
    out = _ok(_run([python, one / "myq.py", "install", "--destdir", dest,
                    "--prefix", prefix]))
    assert "myq.pth" in out
    _land(dest, prefix)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _imports_myq(python, prefix, elsewhere)


def test_import_myq_after_make_install_and_uninstall(tmp_path, system_python):
    """`make install PYTHON=python3 PREFIX=…`: `import myq` works in that
    python3; `make uninstall` takes it away again."""
    prefix, python = system_python
    repo = _repo_copy(tmp_path / "repo")
    dest = tmp_path / "dest"
    if MAKE:
        args = [MAKE, "-C", repo, "install", "DESTDIR=%s" % dest,
                "PREFIX=" + prefix, "PYTHON=" + python]
    else:
        args = [python, os.path.join(repo, "build", "dist.py"), "--install",
                dest, "--prefix", prefix]
    _ok(_run(args))
    _land(dest, prefix)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _imports_myq(python, prefix, elsewhere)
    _ok(_run([python, os.path.join(repo, "build", "dist.py"), "--uninstall",
              dest, "--prefix", prefix]))
    pth = [os.path.join(d, f) for d, _, fs in os.walk(str(dest)) for f in fs
           if f == "myq.pth"]
    assert pth == []


@pytest.mark.skipif(not BUSYBOX, reason="busybox not installed")
def test_ipk_postinst_makes_myq_importable(tmp_path):
    """The OpenWrt package's postinst writes myq.pth (naming /usr/lib/myq)
    into the device's python3.X/site-packages, whatever X is, also while a
    firmware image is built (IPKG_INSTROOT); prerm removes it."""
    _ok(_run([sys.executable, DIST, "--out", tmp_path / "dist"]))
    ipk = [f for f in os.listdir(str(tmp_path / "dist")) if f.endswith(".ipk")][0]
    with open(str(tmp_path / "dist" / ipk), "rb") as f:
        data = f.read()
    # ar: "!<arch>\n", then 60-byte headers
    pos, parts = 8, {}
    while pos < len(data):
        name = data[pos:pos + 16].decode().strip().rstrip("/")
        size = int(data[pos + 48:pos + 58].decode())
        parts[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
    scripts = {}
    with tarfile.open(fileobj=io.BytesIO(parts["control.tar.gz"])) as t:
        for name in ("postinst", "prerm"):
            path = str(tmp_path / name)
            with open(path, "wb") as f:
                f.write(t.extractfile("./" + name).read())
            scripts[name] = path
    root = tmp_path / "root"
    site = root / "usr" / "lib" / "python3.11"
    site.mkdir(parents=True)
    env = {"IPKG_INSTROOT": str(root)}
    _ok(_run([BUSYBOX, "sh", scripts["postinst"], "configure"], env=env))
    pth = site / "site-packages" / "myq.pth"
    assert pth.read_text() == "/usr/lib/myq\n"
    # that line is what a site directory's .pth means: the path is added
    lib = tmp_path / "usr-lib-myq"
    lib.mkdir()
    shutil.copy(MYQ, str(lib / "myq.py"))
    check = tmp_path / "check"
    check.mkdir()
    (check / "myq.pth").write_text(str(lib) + "\n")
    r = _ok(_run([sys.executable, "-c", "import site, sys; site.addsitedir(%r); "
                  "import myq; sys.stdout.write(myq.__file__)" % str(check)],
                 cwd=str(tmp_path)))
    assert r == str(lib / "myq.py")
    _ok(_run([BUSYBOX, "sh", scripts["prerm"], "remove"], env=env))
    assert not pth.exists()
    # on the device: beside the python3 in PATH (BIN/python3 -> LIB/python3.X)
    dev = tmp_path / "dev"
    (dev / "bin").mkdir(parents=True)
    (dev / "lib" / "python3.12").mkdir(parents=True)
    os.symlink(sys.executable, str(dev / "bin" / "python3"))
    env = {"PATH": "%s:%s" % (dev / "bin", os.path.dirname(BUSYBOX))}
    _ok(_run([BUSYBOX, "sh", scripts["postinst"], "configure"], env=env))
    pth = dev / "lib" / "python3.12" / "site-packages" / "myq.pth"
    assert pth.read_text() == "/usr/lib/myq\n"
    _ok(_run([BUSYBOX, "sh", scripts["prerm"], "remove"], env=env))
    assert not pth.exists()


# 1. check: no worker, logs that go nowhere, an unreadable file ##############

import glob  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from _core import clean_env, cmdline, start_worker, wait_for, kill_quiet, world_python, sql  # noqa: E402
from _core import myq_argv  # noqa: E402
from _sec import make_user, is_root  # noqa: E402

sys.path.insert(0, ROOT)
import myq  # noqa: E402


def _import_waiting(run_myq, spool, jid, age=120):
    """A ready job that has waited `age` seconds (both stores)."""
    r = run_myq("--spool", spool, "enqueue", "t", "--id", jid)
    assert r.returncode == 0, r.stderr
    _backdate(spool, jid, age)


def _backdate(spool, jid, age):
    t = time.time() - age
    if sql(spool, "UPDATE jobs SET available_at=?, created_at=? WHERE id=?",
           (t, t, jid)) is None:
        for p in glob.glob(os.path.join(spool, "incoming", "**", jid + ".json"),
                           recursive=True):
            os.utime(p, (t, t))


def _check(run_myq, spool):
    r = run_myq("--spool", spool, "check")
    return r.returncode, r.stdout + r.stderr


def _live_record(spool):
    return glob.glob(os.path.join(spool, "locks", "workers", "w-*.json"))


def test_check_says_no_worker_runs_while_jobs_wait(spool, run_myq, tmp_path):
    """A ready job waiting over a minute and no live worker: check exits 1
    and says how to start one; a living worker silences it; killed with -9 (its record left), it is back."""
    _import_waiting(run_myq, spool, "waits-1")
    code, out = _check(run_myq, spool)
    assert code == 1, out
    assert "no worker runs" in out and "/etc/init.d/myq start" in out \
        and "myq --spool %s worker" % spool in out, out
    # a fresh job (under a minute) with no worker is not yet a problem
    fresh = str(tmp_path / "fresh")
    myq.main(["--spool", fresh, "init"])
    _import_waiting(run_myq, fresh, "fresh-1", age=5)
    assert "no worker runs" not in _check(run_myq, fresh)[1]
    # a living worker (the type paused: it leaves the job as it is)
    assert run_myq("--spool", spool, "pause", "t").returncode == 0
    hdir = tmp_path / "h"
    hdir.mkdir()
    w = start_worker(spool, "--handlers", str(hdir), "--poll", "0.05")
    try:
        wait_for(lambda: _live_record(spool), what="the worker's record")
        code, out = _check(run_myq, spool)
        assert "no worker runs" not in out, out
    finally:
        kill_quiet(w.pid)
        w.wait()
    assert _live_record(spool)          # (left behind by kill -9)
    _backdate(spool, "waits-1", 120)    # (its lane took the job's own time)
    code, out = _check(run_myq, spool)
    assert code == 1 and "no worker runs" in out, out


def _stale_socket(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.close()                   # the file stays; nobody listens
    return path


def test_syslog_problem_tells_a_listener_from_none(tmp_path, monkeypatch):
    """A missing socket and a stale one (a syslogd that died) both lose
    every line: said, by Log(syslog=True) on its stream too; a socket that
    a daemon reads is fine."""
    missing = str(tmp_path / "none")
    stale = _stale_socket(str(tmp_path / "stale"))
    assert "there is no %s" % missing in myq._syslog_problem(missing)
    said = myq._syslog_problem(stale)
    assert "nothing listens on %s" % stale in said and "MYQ_LOG=" in said
    live = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    live.bind(str(tmp_path / "live"))
    try:
        assert myq._syslog_problem(str(tmp_path / "live")) is None
    finally:
        live.close()
    monkeypatch.setattr(myq, "_DEV_LOG", stale)
    out = io.StringIO()
    log = myq.Log(syslog=True, stream=out)
    assert log.problem and "logs go nowhere" in out.getvalue()


def _syslogd_listens():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.connect("/dev/log")
        return True
    except OSError:
        return False
    finally:
        s.close()


needs_no_syslogd = pytest.mark.skipif(
    _syslogd_listens(), reason="a syslogd listens on /dev/log here: logs go "
    "somewhere")


@needs_no_syslogd
def test_check_says_the_workers_logs_go_nowhere(spool, run_myq, tmp_path):
    """A worker started with --syslog where no syslogd listens: it says so
    at its start, and check (which cannot see its options) learns it from
    the worker's record and says so too, with the fix."""
    err = open(str(tmp_path / "err"), "w+")
    w = start_worker(spool, "--syslog", "--poll", "0.05", stderr=err)
    try:
        wait_for(lambda: _live_record(spool), what="the worker's record")
        code, out = _check(run_myq, spool)
        assert code == 1 and "logs go nowhere" in out \
            and "MYQ_LOG=/var/log/myq/myq.log" in out, out
    finally:
        w.send_signal(signal.SIGTERM)
        w.wait(15)
    err.seek(0)
    assert "logs go nowhere" in err.read()
    # the same worker logging to a file: nothing to say
    w = start_worker(spool, "--log", str(tmp_path / "w.log"), "--poll", "0.05")
    try:
        wait_for(lambda: _live_record(spool), what="the worker's record")
        assert "logs go nowhere" not in _check(run_myq, spool)[1]
    finally:
        w.send_signal(signal.SIGTERM)
        w.wait(15)


@needs_no_syslogd
@pytest.mark.skipif(not BUSYBOX, reason="busybox not installed")
def test_init_script_start_says_the_logs_go_nowhere(tmp_path):
    """`/etc/init.d/myq start` with the default MYQ_LOG=syslog and no
    syslogd: OK (it runs), and the warning on the terminal."""
    bb = tmp_path / "bb"
    bb.mkdir()
    subprocess.check_call([BUSYBOX, "--install", "-s", str(bb)])
    if os.path.lexists(str(bb / "python3")):
        os.unlink(str(bb / "python3"))
    os.symlink(sys.executable, str(bb / "python3"))
    pidfile = str(tmp_path / "run" / "myq.pid")
    defaults = tmp_path / "myq.default"
    defaults.write_text("MYQ_SPOOL='%s'\nMYQ_BIN='%s'\nMYQ_PIDFILE='%s'\n"
                        "MYQ_ARGS='--handlers %s'\n" % (
                            tmp_path / "spool", MYQ, pidfile, tmp_path))
    env = {"PATH": str(bb), "MYQ_DEFAULTS": str(defaults)}
    script = os.path.join(ROOT, "init.d", "myq")
    r = subprocess.run([BUSYBOX, "sh", script, "start"], env=env, timeout=60,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, cwd=str(tmp_path))
    try:
        assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
        assert "logs go nowhere" in r.stderr, r.stderr
    finally:
        subprocess.run([BUSYBOX, "sh", script, "stop"], env=env, timeout=60,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# 2. a change of MYQ_USER: the whole layout to the new owner ##################

@pytest.fixture(scope="module")
def user():
    for pw in make_user():
        yield pw


@pytest.fixture
def base():
    """A directory another user can reach (tmp_path is root's 0700), with a
    copy of myq.py that user can read."""
    d = tempfile.mkdtemp(prefix="myq-op4-")
    os.chmod(d, 0o755)
    shutil.copy(MYQ, os.path.join(d, "myq.py"))
    os.chmod(os.path.join(d, "myq.py"), 0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as(pw, python, me, *args, cached=False, **kw):
    """`python me ARGS` as `pw` (None: root); `cached`: from its cached
    code (_core.BOOT: no compile at each start), not as the script."""
    def drop():
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
    argv = myq_argv(python, me) if cached else [python, me]
    return subprocess.run(argv + [str(a) for a in args], env=clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=60, cwd="/",
                          preexec_fn=drop if pw else None, **kw)


def _not_owned(spool, uid):
    out = []
    for d, dirs, files in os.walk(spool):
        for n in dirs + files:
            p = os.path.join(d, n)
            if os.lstat(p).st_uid != uid:
                out.append(os.path.relpath(p, spool))
    return sorted(out)


@pytest.mark.parametrize("store", ["files", "sqlite"])
def test_a_spool_of_roots_given_to_myq_user(user, base, store):
    """A spool first run as root (policy, lanes, a held type, done files),
    then the old init's chown of the directories alone: a worker as the
    user refuses to run without the type's rules (78, naming the chown),
    check names the unreadable file (never "does not parse"), pause fails
    naming the chown.  `init --owner USER` (every start does it) gives the
    whole layout over: then pause, check and a worker under the user work,
    and the type's rules hold."""
    python = world_python()
    if python is None:
        pytest.skip("no python3 that another user may run")
    me = os.path.join(base, "myq.py")
    spool = os.path.join(base, "spool")
    hdir = os.path.join(base, "h")
    os.mkdir(hdir, 0o755)
    with open(os.path.join(hdir, "t"), "w") as f:
        f.write("#!/bin/sh\nexit 0\n")
    os.chmod(os.path.join(hdir, "t"), 0o755)
    root = lambda *a: _as(None, sys.executable, me, "--spool", spool, *a,  # noqa: E731
                          cached=True)
    for args in (["init", "--store", store], ["policy", "t", "max_queued=2"],
                 ["enqueue", "t", "1"], ["enqueue", "u", "2", "--priority", "3"],
                 ["worker", "--handlers", hdir, "--drain"]):
        r = root(*args)
        assert r.returncode == 0, (args, r.stderr)
    # what init --owner did before: the directories alone
    for d in myq.SUBDIRS + ("locks/ok", "locks/workers", ""):
        os.chown(os.path.join(spool, d), user.pw_uid, user.pw_gid)
    as_user = lambda *a: _as(user, python, me, "--spool", spool, *a,  # noqa: E731
                             cached=True)
    r = as_user("worker", "--handlers", hdir, "--drain")
    assert r.returncode == 78, r.stderr
    unreadable = "policy.json cannot be read" if store == "files" else \
        "queue.db cannot be used"
    # (on SQLite both stand in the way: whichever the worker meets first)
    assert (unreadable in r.stderr or "policy.json cannot be read" in
            r.stderr) and "chown -R %s %s" % (user.pw_name, spool) in r.stderr, \
        r.stderr
    r = as_user("check")
    assert r.returncode == 1
    assert "does not parse" not in r.stdout + r.stderr
    said = r.stdout + r.stderr
    for name in ("policy.json cannot be read", "locks/room cannot be used",
                 "policy.lock cannot be used", unreadable):
        assert name in said, said
    assert "chown -R %s %s" % (user.pw_name, spool) in said, said
    r = as_user("pause", "t")
    assert r.returncode == 78 and "chown -R %s" % user.pw_name in r.stderr, r.stderr
    # the fix: what every start runs
    r = root("init", "--owner", user.pw_name)
    assert r.returncode == 0, r.stderr
    assert _not_owned(spool, user.pw_uid) == []
    r = as_user("pause", "t")
    assert r.returncode == 0, r.stderr
    r = as_user("resume", "t")
    assert r.returncode == 0, r.stderr
    for i in range(2):
        r = as_user("enqueue", "t", str(i))
        assert r.returncode == 0, r.stderr
    r = as_user("enqueue", "t", "3")
    assert r.returncode == 75, r.stderr         # max_queued=2 holds
    r = as_user("worker", "--handlers", hdir, "--drain")
    assert r.returncode == 0, r.stderr
    r = as_user("check")
    assert "cannot be" not in r.stdout and "does not parse" not in r.stdout, r.stdout


def test_init_owner_gives_only_what_was_the_old_owners(user, base):
    """The walk takes the former owner's (and root's) files only: a
    producer's file stays the producer's, a symlink is not followed, a file
    with a second hard link is not given away."""
    spool = os.path.join(base, "spool")
    myq.main(["--spool", spool, "init"])
    myq.main(["--spool", spool, "policy", "t", "max_queued=5"])
    outside = os.path.join(base, "outside")
    with open(outside, "w") as f:
        f.write("root's\n")
    os.symlink(outside, os.path.join(spool, "done", "link.json"))
    os.link(outside, os.path.join(spool, "done", "hard.json"))
    prod = os.path.join(spool, "incoming", "p.json")
    with open(prod, "w") as f:
        f.write('{"type": "t"}')
    os.chown(prod, 4242, 4242)
    assert myq.main(["--spool", spool, "init", "--owner", user.pw_name]) == 0
    assert os.stat(os.path.join(spool, "policy.json")).st_uid == user.pw_uid
    assert os.stat(outside).st_uid == 0
    assert os.lstat(os.path.join(spool, "done", "link.json")).st_uid == 0
    assert os.stat(prod).st_uid == 4242


# 5. export/import: the policy and the queue's name; producers' modes ########

def _lines(text):
    return [json.loads(l) for l in text.splitlines()]


@pytest.mark.parametrize("src", ["files", "sqlite"])
def test_export_carries_the_policy_and_the_name(tmp_path, src, store, run_myq):
    """A spool of either store with a name of its own and a policy: export's
    first line carries both; import into a new spool of either store
    applies the policy (every type's rules, the pause too) and keeps the
    name; --no-policy leaves the policy out."""
    a, b, c = (str(tmp_path / n) for n in "abc")
    for args in (["init", "--store", src, "--name", "router7"],
                 ["policy", "telemetry", "max_queued=20000",
                  "overflow=drop-oldest", "ttl=7d", "rate=20/s"],
                 ["pause", "alarm"], ["enqueue", "telemetry", "1"]):
        r = run_myq("--spool", a, *args)
        assert r.returncode == 0, (args, r.stderr)
    assert " queue=router7 " in run_myq("--spool", a, "stats").stdout
    exp = run_myq("--spool", a, "export")
    assert exp.returncode == 0, exp.stderr
    rows = _lines(exp.stdout)
    assert rows[0] == {"spool": {"queue": "router7", "policy": {
        "alarm": {"paused": True}, "telemetry": {
            "max_queued": 20000, "overflow": "drop-oldest", "rate": "20/s",
            "ttl": 604800}}}}
    assert [r["type"] for r in rows[1:]] == ["telemetry"]
    myq.open_store(b).init(store=store)
    imp = run_myq("--spool", b, "import", "-", input=exp.stdout)
    assert imp.returncode == 0, imp.stderr
    assert "imported 1" in imp.stderr
    assert run_myq("--spool", b, "policy").stdout == \
        run_myq("--spool", a, "policy").stdout
    assert " queue=router7 " in run_myq("--spool", b, "stats").stdout
    st = json.loads(run_myq("--spool", b, "stats", "--json").stdout)
    assert st["queue"] == "router7" and st["paused"] == ["alarm"]
    # --no-policy
    myq.open_store(c).init(store=store)
    imp = run_myq("--spool", c, "import", "--no-policy", "-", input=exp.stdout)
    assert imp.returncode == 0, imp.stderr
    assert run_myq("--spool", c, "policy").stdout == ""
    # a second import of the same lines: the policy again, the jobs refused
    imp = run_myq("--spool", b, "import", "-", input=exp.stdout)
    assert imp.returncode == 73 and "duplicate 1" in imp.stderr


def test_import_keeps_a_spools_own_name_and_type_rules(tmp_path, run_myq):
    """A spool that has a name of its own, or holds jobs, keeps its name;
    the export's rules replace those of their types only."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for sp, name in ((a, "src"), (b, "dst")):
        assert run_myq("--spool", sp, "init", "--name", name).returncode == 0
    run_myq("--spool", a, "policy", "t", "max_queued=5")
    run_myq("--spool", b, "policy", "t", "rate=1/s")
    run_myq("--spool", b, "policy", "u", "priority=3")
    imp = run_myq("--spool", b, "import", "-",
                  input=run_myq("--spool", a, "export").stdout)
    assert imp.returncode == 0, imp.stderr
    assert run_myq("--spool", b, "policy").stdout.splitlines() == [
        "t max_queued=5", "u priority=3"]
    assert json.loads(run_myq("--spool", b, "stats", "--json").stdout)[
        "queue"] == "dst"


def test_init_name(tmp_path, run_myq):
    """init --name: checked (64), kept by later inits; an SQLite spool that
    holds jobs refuses a new one (its rows carry the name) naming export |
    import."""
    sp = str(tmp_path / "q")
    r = run_myq("--spool", sp, "init", "--name", "bad name")
    assert r.returncode == 64 and "bad queue name" in r.stderr
    assert run_myq("--spool", sp, "init", "--name", "edge-7").returncode == 0
    assert run_myq("--spool", sp, "init").returncode == 0
    assert json.loads(run_myq("--spool", sp, "stats", "--json").stdout)[
        "queue"] == "edge-7"
    db = str(tmp_path / "db")
    assert run_myq("--spool", db, "init", "--store", "sqlite",
                   "--name", "one").returncode == 0
    assert run_myq("--spool", db, "enqueue", "t", "1").returncode == 0
    r = run_myq("--spool", db, "init", "--name", "two")
    assert r.returncode == 78 and "export" in r.stderr and "import" in r.stderr
    assert json.loads(run_myq("--spool", db, "list", "--json").stdout)["type"] == "t"


def test_init_owner_with_a_group_gives_producers_their_modes(user, tmp_path):
    """init --owner USER:GROUP (MYQ_USER=myq:producers): tmp/ and incoming/
    are group-writable, setgid and sticky, at every init (a new spool made
    for an import, a chmod undone)."""
    sp = str(tmp_path / "q")
    grp = str(user.pw_gid)
    assert myq.main(["--spool", sp, "init", "--owner",
                     "%s:%s" % (user.pw_name, grp)]) == 0
    for sub in ("tmp", "incoming"):
        mode = os.stat(os.path.join(sp, sub)).st_mode
        assert mode & 0o3070 == 0o3070, (sub, oct(mode))
        os.chmod(os.path.join(sp, sub), 0o750)
    assert myq.main(["--spool", sp, "init", "--owner",
                     "%s:%s" % (user.pw_name, grp)]) == 0
    for sub in ("tmp", "incoming"):
        assert os.stat(os.path.join(sp, sub)).st_mode & 0o3070 == 0o3070
    for sub in ("processing", "done", "locks"):
        assert os.stat(os.path.join(sp, sub)).st_mode & 0o7077 == 0o050


# 6. workers under MYQ_USER: root's ps line, root's memory ###################

from _procs import children, alive, wait_gone  # noqa: E402


def _pss(pid):
    try:
        with open("/proc/%d/smaps_rollup" % pid) as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _service(base, python, spool, user, n=2):
    """supervise --daemon (as the init script starts it), with --user or
    not; its pid."""
    me = os.path.join(base, "myq.py")
    pidfile = spool + ".pid"
    r = _as(None, python, me, "--spool", spool, "init",
            *(["--owner", user] if user else []))
    assert r.returncode == 0, r.stderr
    args = ["--spool", spool, "supervise", "--daemon", "--pidfile", pidfile,
            "--log", spool + ".log", "--workers", str(n), "--handlers", base]
    r = _as(None, python, me, *(args + (["--user", user] if user else [])))
    assert r.returncode == 0, r.stderr
    with open(pidfile) as f:
        return int(f.read())


def _roots_files_it_writes(pid):
    out = []
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            st = os.stat("/proc/%d/fd/%s" % (pid, fd))
            with open("/proc/%d/fdinfo/%s" % (pid, fd)) as f:
                flags = [int(l.split()[1], 8) for l in f if l.startswith("flags:")][0]
        except (OSError, IndexError):
            continue
        if st.st_uid == 0 and os.path.stat.S_ISREG(st.st_mode) and flags & 3:
            out.append(os.readlink("/proc/%d/fd/%s" % (pid, fd)))
    return out


def _workers(sup, n):
    def found():
        kids = [p for p in children([sup]) if cmdline(p).count("worker")]
        return kids if len(kids) == n else None
    return wait_for(found, what="%d workers" % n)


def test_workers_under_myq_user_look_and_weigh_as_roots(user, base):
    """supervise --user (MYQ_USER): every worker's command line is
    `python3 myq.py --spool SPOOL worker ...` as under root (not the -c
    text of a new interpreter), and the supervisor and its workers cost
    no more memory (PSS) than root's, give or take a tenth (before: 1.7
    times: every worker a new interpreter)."""
    python = world_python()
    if python is None:
        pytest.skip("no python3 that another user may run")
    try:
        import _ctypes  # noqa: F401
    except ImportError:
        pytest.skip("no ctypes: a supervisor that became the user cannot "
                    "fork retitled workers (see _dumpable)")
    me = os.path.join(base, "myq.py")
    totals = {}
    for who in ("root", user.pw_name):
        spool = os.path.join(base, "spool-" + who)
        sup = _service(base, python, spool, None if who == "root" else who)
        try:
            ws = _workers(sup, 2)
            for w in ws:
                cmd = cmdline(w)
                assert cmd[:5] == [python, me, "--spool", spool, "worker"], cmd
                assert sum(len(c) + 1 for c in cmd) < 400, cmd
            wait_for(lambda: len(_live_record(spool)) == 2,
                     what="both workers started")
            if who != "root":
                # dumpable again, it holds no descriptor that writes a file
                # of root's (the pidfile's lock is read-only)
                assert _roots_files_it_writes(sup) == []
            totals[who] = sum(_pss(p) or 0 for p in [sup] + ws)
        finally:
            os.kill(sup, signal.SIGTERM)
            wait_gone(sup, 30)
    assert totals[user.pw_name] <= totals["root"] * 1.1, totals


def test_a_worker_started_as_a_new_interpreter_shows_its_command(spool):
    """Where a worker cannot be forked (python3-light has no ctypes, another
    interpreter): the exec'd one rewrites its ps line from the -c text to
    `python3 myq.py --spool SPOOL worker ...`."""
    argv = myq._worker_start(sys.executable) + ["--spool", spool, "worker",
                                                "--poll", "0.05"]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=clean_env())
    try:
        wait_for(lambda: _live_record(spool), what="the worker's record")
        cmd = cmdline(p.pid)
        assert cmd[:4] == [sys.executable, MYQ, "--spool", spool], cmd
        assert cmd[4:7] == ["worker", "--poll", "0.05"], cmd
    finally:
        p.terminate()
        p.wait(15)


# 4. the README: the flash figure, the recipe, the table ####################

def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_readme_flash_figure_is_myq_py_within_5_percent():
    """The first screen's flash figure (`make bench-device`, KB = 1024
    bytes: myq.py, and its byte code for CPython 3.11) is within 5 % of
    what it is now; update it with `make bench-device
    DEVICE_ARGS=--skip=memory,cpu,start,arm` (a second)."""
    import re
    m = re.search(r"^\| flash \| ([\d.]+) KB `myq\.py` \+ ([\d.]+) KB cached "
                  r"byte code \|$", _readme(), re.M)
    assert m, "no flash row on the README's first screen"
    src = os.path.getsize(MYQ) / 1024.0
    assert abs(float(m.group(1)) - src) <= 0.05 * src, (m.group(1), src)
    root = pyenv_root()
    py311 = sorted(glob.glob(os.path.join(root or "/nonexistent", "versions",
                                          "3.11.*", "bin", "python3")))
    if not py311:
        pytest.skip("no CPython 3.11 to compile the byte code the figure is of")
    pyc = os.path.join(tempfile.mkdtemp(prefix="myq-op4-pyc-"), "m.pyc")
    try:
        _ok(_run([py311[-1], "-c", "import py_compile, sys; py_compile.compile("
                  "sys.argv[1], cfile=sys.argv[2], doraise=True)", MYQ, pyc]))
        code = os.path.getsize(pyc) / 1024.0
    finally:
        shutil.rmtree(os.path.dirname(pyc))
    assert abs(float(m.group(2)) - code) <= 0.05 * code, (m.group(2), code)


def test_readme_has_the_device_recipe_and_when_jobs_do_not_move():
    """Install gives the device's steps in the order they are needed (the
    user and producers' group, the handlers, the log, the settings, start,
    check), and Operating a table of why jobs do not move, each with the
    command that tells it apart."""
    text = _readme()
    install = text[text.index("## Install"):text.index("### Settings and boot")]
    steps = ["adduser", "/etc/myq/handlers", "/var/log/myq", "MYQ_USER=myq:producers",
             "/etc/init.d/myq start", "check"]
    at = [install.find(s) for s in steps]
    assert -1 not in at and at == sorted(at), dict(zip(steps, at))
    table = text[text.index("**When jobs do not move**"):]
    table = table[:table.index("\n\n", table.index("|"))]
    for cause, tells in (("no worker runs", "/etc/init.d/myq status"),
                         ("paused", "myq resume"), ("held", "resume --dest"),
                         ("no handler", "myq list held"),
                         ("disk guard", "exits 75"),
                         ("permissions", "chown -R")):
        row = [l for l in table.splitlines() if cause in l]
        assert row and tells in row[0], (cause, table)


def test_a_running_worker_says_when_the_policy_goes_bad(spool, tmp_path):
    """A policy file spoiled while a worker runs: it keeps the last good
    rules and logs a warning that says so, once."""
    myq.main(["--spool", spool, "policy", "t", "max_queued=5"])
    log = str(tmp_path / "w.log")
    w = start_worker(spool, "--log", log, "--poll", "0.05")
    try:
        wait_for(lambda: _live_record(spool), what="the worker's record")
        with open(os.path.join(spool, "policy.json"), "w") as f:
            f.write("{not json")

        def said():
            with open(log) as f:
                return [l for l in f if "event=warning" in l
                        and "policy.json does not parse" in l]
        wait_for(said, what="the warning")
    finally:
        w.send_signal(signal.SIGTERM)
        w.wait(15)
    assert len(said()) == 1
