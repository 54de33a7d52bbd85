"""Helpers of the attack tests: a throwaway spool owner, a spool
that belongs to it, root-only victims beside it, root commands that must
neither hang nor reach the victims.

The spool's owner is the attacker: it controls every entry of the spool.
Root (the test process, an operator, cron, the init script) runs myq on it.
Root runs myq with an interpreter and a copy of myq.py that the owner may
run and read: myq may switch to the owner for a command (the design of the
fix), and after that it must still be able to import what it imports.
"""
import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import time

import pytest

from _core import MYQ, clean_env, myq_argv, world_python  # noqa: F401 (the tests' import)
from _procs import alive as proc_alive, proc_start  # noqa: F401 (the tests' import)

USER = "myqsec1"
SECRET = "SECRET-d41d8cd98f00-must-never-leak"
CMD_TIMEOUT = 10        # a root command that runs longer hangs: a failure


def is_root():
    return hasattr(os, "geteuid") and os.geteuid() == 0




def make_user():
    """The throwaway owner, a system user without a home, created once and
    kept (test processes running in parallel share it: deleting it at the
    end of one would pull it from under another).  Yields its pwd entry;
    skips when not root or no useradd."""
    import fcntl
    if not is_root():
        pytest.skip("needs root: the attacks are on what root does")
    with open("/tmp/.myq-test-user.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            pw = pwd.getpwnam(USER)
        except KeyError:
            useradd = shutil.which("useradd") or (
                "/usr/sbin/useradd" if os.path.exists("/usr/sbin/useradd") else None)
            if not useradd:
                pytest.skip("no useradd on this machine (to make the spool's owner)")
            r = subprocess.run([useradd, "-M", "-r", "-s", "/bin/sh", USER],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               universal_newlines=True)
            if r.returncode != 0:
                pytest.skip("useradd %s failed: %s" % (USER, r.stderr.strip()))
            pw = pwd.getpwnam(USER)
    yield pw


def become(pw):
    """preexec_fn: become the user (no supplementary groups)."""
    def drop():
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
    return drop


def entry_state(path):
    """What an outsider sees of a path, never following a link, never
    opening a FIFO: (kind, uid, gid, mode, size, mtime_ns, content)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    content = None
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            content = f.read()
    elif stat.S_ISLNK(st.st_mode):
        content = os.readlink(path)
    elif stat.S_ISDIR(st.st_mode):
        content = sorted(os.listdir(path))
    return (stat.S_IFMT(st.st_mode), st.st_uid, st.st_gid,
            stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns, content)


class Box(object):
    """base/ (0755, root): spool/ (the owner's), victim/ (0700 root: a
    secret file and a job-like secret.json), rootonly (0600 root), myq.py
    (a copy the owner can read), mod/ and out/ for tests."""

    def __init__(self, pw, python):
        self.pw, self.python = pw, python
        self.base = tempfile.mkdtemp(prefix="myq-sec-")
        os.chmod(self.base, 0o755)
        self.myq = os.path.join(self.base, "myq.py")
        shutil.copy(MYQ, self.myq)
        os.chmod(self.myq, 0o644)
        self.victim_dir = os.path.join(self.base, "victim")
        os.mkdir(self.victim_dir, 0o700)
        self.secret = os.path.join(self.victim_dir, "secret")
        self.secret_json = os.path.join(self.victim_dir, "secret.json")
        self.victim = os.path.join(self.base, "rootonly")
        for p, data in ((self.secret, SECRET + "\n"),
                        (self.secret_json, json.dumps(
                            {"type": "t", "payload": SECRET}) + "\n"),
                        (self.victim, "rootonly " + SECRET + "\n")):
            with open(p, "w") as f:
                f.write(data)
            os.chmod(p, 0o600)
        # a job-like file in the victim dir under every name a command
        # may look for (ID.json, ID, a claim name)
        for name in ("J.json", "J+w-1-abc.1.json", "J"):
            with open(os.path.join(self.victim_dir, name), "w") as f:
                f.write(json.dumps({"id": "J", "type": "t", "payload": SECRET}))
            os.chmod(os.path.join(self.victim_dir, name), 0o600)
        past = time.time() - 3 * 86400       # old enough for any retention
        for name in os.listdir(self.victim_dir):
            os.utime(os.path.join(self.victim_dir, name), (past, past))
        os.utime(self.victim, (past, past))
        self.spool = os.path.join(self.base, "spool")
        r = self.root("init", "--owner", pw.pw_name)
        assert r.returncode == 0, r.stderr
        self.before = self.victims()

    def victims(self):
        out = {}
        for p in (self.victim_dir, self.victim):
            out[p] = entry_state(p)
        for name in sorted(os.listdir(self.victim_dir)):
            p = os.path.join(self.victim_dir, name)
            out[p] = entry_state(p)
        return out

    def changed(self, before=None):
        """Human-readable list of what changed in the victims."""
        before = self.before if before is None else before
        now = self.victims()
        diffs = []
        for p in sorted(set(before) | set(now)):
            a, b = before.get(p), now.get(p)
            if a == b:
                continue
            if a is None or b is None:
                diffs.append("%s: %s -> %s" % (p, _short(a), _short(b)))
                continue
            fields = ("kind", "uid", "gid", "mode", "size", "mtime", "content")
            diffs.append("%s: %s" % (p, ", ".join(
                "%s %s -> %s" % (f, _fmt(f, x), _fmt(f, y))
                for f, x, y in zip(fields, a, b) if x != y)))
        return diffs

    def restore_victims(self):
        """After a command damaged them: back to root, 0600/0700."""
        for p in (self.victim_dir, self.victim):
            try:
                os.chown(p, 0, 0)
            except OSError:
                pass
        os.chmod(self.victim_dir, 0o700)
        self.before = self.victims()

    def d(self, *parts):
        return os.path.join(self.spool, *parts)

    def root(self, *args, timeout=CMD_TIMEOUT, input=None, env=None):
        """myq run by root (the world interpreter, the readable copy);
        raises AssertionError on a hang."""
        try:
            return subprocess.run(
                myq_argv(self.python, self.myq) + ["--spool", self.spool]
                + [str(a) for a in args],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                universal_newlines=True, env=clean_env(env), cwd="/",
                timeout=timeout, input=input)
        except subprocess.TimeoutExpired:
            raise AssertionError("root's `myq %s` hung (> %ss)"
                                 % (" ".join(map(str, args)), timeout))

    def owner(self, *args, timeout=30, env=None):
        """myq run by the spool's owner."""
        return subprocess.run(
            myq_argv(self.python, self.myq) + ["--spool", self.spool]
            + [str(a) for a in args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            universal_newlines=True, env=clean_env(env), cwd="/",
            timeout=timeout, preexec_fn=become(self.pw))

    def give(self, path):
        """What the owner made: hand it to the owner (never following)."""
        os.lchown(path, self.pw.pw_uid, self.pw.pw_gid)

    def owner_file(self, rel, data, mode=0o640):
        p = self.d(rel)
        with open(p, "w" if isinstance(data, str) else "wb") as f:
            f.write(data)
        os.chmod(p, mode)
        self.give(p)
        return p

    def replace(self, rel, kind, target=None):
        """The owner replaces spool entry REL by a symlink to TARGET or a
        FIFO (a directory is moved aside first, as the owner could)."""
        p = self.d(rel)
        if os.path.isdir(p) and not os.path.islink(p):
            os.rename(p, p + ".moved")
        elif os.path.lexists(p):
            os.unlink(p)
        if kind == "symlink":
            os.symlink(target, p)
        else:
            os.mkfifo(p, 0o660)
        self.give(p)

    def cleanup(self):
        # FIFOs and symlinks: rmtree never follows a link
        shutil.rmtree(self.base, ignore_errors=True)


def _short(v):
    if v is None:
        return None
    kind, uid, gid, mode, size, mtime, content = v
    if isinstance(content, bytes) and len(content) > 60:
        content = content[:60] + b"..."
    return ("uid=%d gid=%d mode=%o size=%d mtime=%d content=%r"
            % (uid, gid, mode, size, mtime, content))


def _fmt(field, v):
    if field == "mode":
        return "%o" % v
    if isinstance(v, bytes) and len(v) > 60:
        return repr(v[:60] + b"...")
    return repr(v)


def traceback_in(text):
    return "Traceback (most recent call last)" in text


class Victim(object):
    """A root process that nobody in the spool may signal: `sleep 1000`
    in its own session (so its pid is also its process group)."""

    def __init__(self):
        self.proc = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        self.pid = self.proc.pid
        self.start = None
        deadline = time.monotonic() + 5
        while self.start is None and time.monotonic() < deadline:
            self.start = proc_start(self.pid)
        assert self.pid > 1

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)




# A handler's daemon: fork, the parent exits, setsid, writes its pid.
DAEMON = r'''import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write("%d\n" % os.getpid())
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(1000)
'''


# What test_security.py and test_security_swaps.py share ###################

needs_root = pytest.mark.skipif(not is_root(), reason="needs root: the "
                                "attacks are on what root does (CI runs as root)")


@pytest.fixture(scope="module")
def owner():
    for pw in make_user():
        yield pw


@pytest.fixture
def box(owner):
    python = world_python()
    if python is None:
        pytest.skip("no python3 that the spool's owner may run")
    b = Box(owner, python)
    yield b
    b.cleanup()


def one_error_line(r, codes):
    """An error exit in `codes`, ONE line on stderr starting `myq: `."""
    assert r.returncode in codes, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip("\n")
    assert err.startswith("myq: ") and "\n" not in err, r.stderr
