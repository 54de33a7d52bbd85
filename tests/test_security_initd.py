"""Attack tests of init.d/myq, under `busybox sh` with the
helpers of test_initd.py.

- The log file lives in a directory of MYQ_USER; that user replaces the log
  by a symlink to a root-only file: `start` (root) must not hand the file to
  the user, nor write into it (today: `: >>"$LOG"` and `chown USER "$LOG"`
  by path).
- A handler leaves a daemon behind (fork, setsid: out of every session and
  process tree of the service): `stop` must not return with it alive
  (today it survives).
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from _core import wait_for
from _core import kill_quiet
from _sec import DAEMON, entry_state, make_user, proc_alive, SECRET
from test_initd import BUSYBOX, MYQ, Service, read, world_executable_python

needs_busybox = pytest.mark.skipif(
    not BUSYBOX, reason="busybox not installed (apt-get install busybox)")
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root: the attacks are on what root does (CI runs as root)")


@pytest.fixture(scope="module")
def owner():
    for pw in make_user():
        yield pw


@pytest.fixture(scope="module")
def bbpath(tmp_path_factory):
    """A PATH of BusyBox applets (start-stop-daemon included) and python3,
    as test_initd's `bindirs`."""
    if not BUSYBOX:
        pytest.skip("busybox not installed (apt-get install busybox)")
    d = tmp_path_factory.mktemp("bb-sec")
    subprocess.check_call([BUSYBOX, "--install", "-s", str(d)])
    if os.path.lexists(str(d / "python3")):
        os.unlink(str(d / "python3"))
    os.symlink(sys.executable, str(d / "python3"))
    return str(d)


@pytest.fixture
def base():
    d = tempfile.mkdtemp(prefix="myq-sec-initd-")   # traversable by the user
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@needs_busybox
@needs_root
def test_start_does_not_follow_a_symlinked_log(bbpath, base, owner):
    """MYQ_USER owns the log directory and puts a symlink to a root-only
    file in place of myq.log; `init.d/myq start` (root) must leave that
    file root's, 0600, unchanged.  Fails today: `chown USER "$LOG"` hands
    it to the user (who then writes the service's log into it)."""
    python = world_executable_python()
    if not python:
        pytest.skip("no python3 that the user may run")
    shutil.copy(MYQ, os.path.join(base, "myq"))
    victim = os.path.join(base, "rootonly")
    with open(victim, "w") as f:
        f.write("root only " + SECRET + "\n")
    os.chmod(victim, 0o600)
    logdir = os.path.join(base, "logdir")
    os.mkdir(logdir, 0o755)
    os.chown(logdir, owner.pw_uid, owner.pw_gid)
    log = os.path.join(logdir, "myq.log")
    os.symlink(victim, log)                 # what the user did
    os.lchown(log, owner.pw_uid, owner.pw_gid)
    before = entry_state(victim)
    s = Service(os.path.join(base, "svc"), bbpath, settings={
        "MYQ_USER": owner.pw_name, "MYQ_PYTHON": python,
        "MYQ_BIN": os.path.join(base, "myq"), "MYQ_LOG": log})
    os.chmod(s.base, 0o755)
    os.chmod(s.handlers, 0o755)
    try:
        r = s.run("start")
        after = entry_state(victim)
        s.run("stop")
    finally:
        s.cleanup()
    assert after[1:4] == before[1:4], (
        "start changed the victim's owner/mode: %r -> %r\n%s"
        % (before[1:4], after[1:4], r.stdout + r.stderr))
    assert after[6] == before[6], "start wrote into the victim"
    assert entry_state(victim)[1:4] == before[1:4]




@needs_busybox
def test_stop_kills_a_handlers_daemon(tmp_path, bbpath):
    """A handler that daemonises a child (fork + setsid) and keeps
    running; `init.d/myq stop` returns with the child gone.  Fails today
    (the child is in no session or process tree of the service)."""
    s = Service(tmp_path / "svc", bbpath)
    script = os.path.join(s.base, "daemon.py")
    with open(script, "w") as f:
        f.write(DAEMON)
    pidfile = os.path.join(s.base, "daemon.pid")
    s.handler("d", '"%s" "%s" "%s" </dev/null >/dev/null 2>&1\nsleep 1000'
              % (sys.executable, script, pidfile))
    pid = None
    try:
        r = s.run("start")
        assert r.returncode == 0, r.stdout + r.stderr
        s.myq("enqueue", "d", "null", "--id", "dj")
        pid = wait_for(lambda: read(pidfile).endswith("\n")
                       and int(read(pidfile)), what="the daemon's pid")
        r = s.run("stop")
        assert r.returncode == 0, r.stdout + r.stderr
        alive = proc_alive(pid)
    finally:
        s.cleanup()
        if pid:
            kill_quiet(pid)
    assert not alive, "the handler's daemon %d survived init.d/myq stop" % pid
