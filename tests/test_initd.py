"""init.d/myq under BusyBox: the service as an operator (and a boot) runs it.

Every test runs the script with `busybox sh`, its PATH holding only BusyBox
applets (`busybox --install -s`) and a python3 symlink; the settings file,
pidfile, spool and log live under tmp_path (never /etc or /var). The main
life cycle runs twice: with BusyBox's start-stop-daemon in PATH and without.
"""
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from _core import MYQ, ROOT, clean_env, cmdline, environ, myq_argv, wait_for
from _procs import alive

SCRIPT = os.path.join(ROOT, "init.d", "myq")
BUSYBOX = shutil.which("busybox")

needs_busybox = pytest.mark.skipif(
    not BUSYBOX, reason="busybox not installed (apt-get install busybox)")


# Helpers #####################################################################

def read(path, binary=False):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return b"" if binary else ""
    return data if binary else data.decode("utf-8", "replace")


def proc_stat(pid):
    """(state, ppid, sid, uid) of a live process, None when gone or zombie."""
    s = read("/proc/%d/stat" % pid)
    if not s:
        return None
    f = s[s.rindex(")") + 2:].split()
    if f[0] in "ZX":
        return None
    uid = None
    for line in read("/proc/%d/status" % pid).splitlines():
        if line.startswith("Uid:"):
            uid = int(line.split()[1])
    return f[0], int(f[1]), int(f[3]), uid


def all_pids():
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def children(pid):
    return [p for p in all_pids() if (proc_stat(p) or (0, 0))[1] == pid]


@pytest.fixture(scope="module")
def bindirs(tmp_path_factory):
    """{"ssd": dir with start-stop-daemon, "plain": dir without}: BusyBox
    applets and python3, nothing else."""
    if not BUSYBOX:
        pytest.skip("busybox not installed (apt-get install busybox)")
    out = {}
    for kind in ("ssd", "plain"):
        d = tmp_path_factory.mktemp("bb-" + kind)
        subprocess.check_call([BUSYBOX, "--install", "-s", str(d)])
        for name in ("python3",):
            if os.path.lexists(str(d / name)):
                os.unlink(str(d / name))
        os.symlink(sys.executable, str(d / "python3"))
        ssd = d / "start-stop-daemon"
        if kind == "plain" and os.path.lexists(str(ssd)):
            ssd.unlink()
        out[kind] = str(d)
    return out


class Service(object):
    """One init-script installation under a temporary directory."""

    def __init__(self, base, path, settings=None, env=None):
        self.base = str(base)
        self.path = path
        self.spool = os.path.join(self.base, "spool")
        self.pidfile = os.path.join(self.base, "run", "myq.pid")
        self.logfile = os.path.join(self.base, "log", "myq.log")
        self.handlers = os.path.join(self.base, "handlers")
        self.out = os.path.join(self.base, "out")
        self.defaults = os.path.join(self.base, "myq.default")
        os.makedirs(self.handlers)
        self.handler("ok", 'cat >> "%s"; echo >> "%s"' % (self.out, self.out))
        self.settings = {
            "MYQ_SPOOL": self.spool, "MYQ_BIN": MYQ,
            "MYQ_PIDFILE": self.pidfile, "MYQ_LOG": self.logfile,
            "MYQ_WORKERS": "1", "MYQ_STOP_TIMEOUT": "10",
            "MYQ_ARGS": "--handlers %s --poll 0.2 --grace 1" % self.handlers,
        }
        self.settings.update(settings or {})
        self.env = env or {}
        self.write_defaults()

    def write_defaults(self, extra=""):
        with open(self.defaults, "w") as f:
            f.write("# written by tests/test_initd.py\n")
            for k, v in sorted(self.settings.items()):
                if v is not None:
                    f.write("%s='%s'\n" % (k, v))
            f.write(extra)

    def handler(self, name, body):
        p = os.path.join(self.handlers, name)
        with open(p, "w") as f:
            f.write("#!/bin/sh\n" + body + "\n")
        os.chmod(p, 0o755)

    def run(self, action, timeout=60, script=SCRIPT):
        env = {"PATH": self.path, "MYQ_DEFAULTS": self.defaults}
        env.update(self.env)
        return subprocess.run(
            [BUSYBOX, "sh", script, action], env=env, timeout=timeout,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            universal_newlines=True, cwd=self.base)

    def myq(self, *args, **kw):
        """Run myq on the spool; user=PW: as that user (a producer must be
        the user the workers run as: they append to the job file).  From
        its cached code (_core.BOOT): a test polls `show` with it while a
        job runs, and a script's start compiles myq.py (0.18 s of CPU, 0.04
        s cached); the service itself starts myq as the script it is."""
        pw = kw.get("user")
        python = kw.get("python", sys.executable)

        def become():
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)

        r = subprocess.run(myq_argv(python, MYQ) + ["--spool", self.spool]
                           + list(args), env=clean_env(), timeout=30,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           universal_newlines=True, cwd="/",
                           preexec_fn=become if pw else None)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def pid(self):
        return int(read(self.pidfile).strip())

    def workers(self):
        return sorted(p for p in children(self.pid())
                      if " worker " in cmdline(p, text=True))

    def wait_workers(self, n, exclude=()):
        return wait_for(lambda: (lambda w: len(w) == n and not set(w) & set(exclude)
                                 and w)(self.workers()),
                        what="%d workers" % n)

    def state(self, jid):
        return json.loads(self.myq("show", jid))["state"]

    def done(self, jid):
        return self.state(jid) == "done"

    def leftovers(self):
        """Every live process that belongs to this spool: by its command
        line (supervisor, workers) or its environment (handlers)."""
        found = []
        for p in all_pids():
            if p == os.getpid() or not alive(p):
                continue
            if (self.spool in cmdline(p, text=True)
                    or environ(p).get("MYQ_SPOOL") == self.spool):
                if alive(p):
                    found.append(p)
        return found

    def cleanup(self):
        for p in self.leftovers():
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def service(tmp_path, bindirs):
    made = []

    def make(kind="ssd", base=None, **kw):
        s = Service(base or tmp_path / ("svc%d" % len(made)), bindirs[kind], **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.cleanup()


# The life cycle ##############################################################

@needs_busybox
@pytest.mark.parametrize("kind", ["ssd", "plain"])
@pytest.mark.slow
def test_life_cycle(service, kind):
    """start, status, a job, a killed worker comes back, reload reopens the
    log, stop leaves nothing running; with and without start-stop-daemon."""
    # MYQ_* variables in the caller's environment and exported by the
    # settings file must not reach myq (they would be worker options).
    s = service(kind, settings={"MYQ_WORKERS": "2"},
                env={"MYQ_CONCURRENCY": "bogus", "MYQ_SPOOL": "/nonexistent"})
    s.write_defaults("export MYQ_TIMEOUT=bogus\n")
    r = s.run("status")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "not running" in r.stdout

    r = s.run("start")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout
    pid = s.pid()
    assert " supervise --workers 2 " in cmdline(pid, text=True)
    assert "--log %s" % s.logfile in cmdline(pid, text=True)
    assert proc_stat(pid)[2] == pid, "the supervisor leads its own session"
    r = s.run("status")
    assert r.returncode == 0 and str(pid) in r.stdout, r.stdout + r.stderr

    r = s.run("start")                          # idempotent
    assert r.returncode == 0 and "already running" in r.stdout
    assert s.pid() == pid

    w1, w2 = s.wait_workers(2)
    for p in (pid, w1, w2):
        leaked = [k for k in environ(p) if k.startswith("MYQ_")]
        assert not leaked, "MYQ_* variables leaked into pid %d: %s" % (p, leaked)

    s.myq("enqueue", "ok", '"first"', "--id", "first")
    wait_for(lambda: s.done("first"), what="the first job to be done")
    assert "first" in read(s.out)

    # a worker killed with SIGKILL is started again by the supervisor
    os.kill(w1, signal.SIGKILL)
    again = s.wait_workers(2, exclude=[w1])
    assert w2 in again
    s.myq("enqueue", "ok", '"second"', "--id", "second")
    wait_for(lambda: s.done("second"), what="a job after the restart")
    assert s.run("status").returncode == 0 and s.pid() == pid

    # logrotate's way: move the log aside, reload; the new file gets written
    # by the workers (their job lines), not only by the supervisor
    os.rename(s.logfile, s.logfile + ".1")
    r = s.run("reload")
    assert r.returncode == 0, r.stdout + r.stderr
    n = [0]

    def worker_wrote_new_log():
        n[0] += 1
        jid = "after-reload-%d" % n[0]
        s.myq("enqueue", "ok", "null", "--id", jid)
        wait_for(lambda: s.done(jid), what="job " + jid)
        return "id=" + jid in read(s.logfile)

    wait_for(worker_wrote_new_log, what="a worker to write the new log")
    assert "event=supervise " in read(s.logfile + ".1")

    r = s.run("stop")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    assert s.leftovers() == [], "stop returned with processes left"
    assert not os.path.exists(s.pidfile)
    r = s.run("status")
    assert r.returncode == 3, r.stdout + r.stderr
    r = s.run("stop")                           # idempotent
    assert r.returncode == 0 and "not running" in r.stdout

    r = s.run("restart")                        # restart of a stopped service
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    pid2 = s.pid()
    assert pid2 != pid and s.run("status").returncode == 0
    r = s.run("restart")
    assert r.returncode == 0, r.stdout + r.stderr
    assert s.pid() != pid2 and not alive(pid2)
    assert s.run("stop").returncode == 0
    assert s.leftovers() == []


@needs_busybox
@pytest.mark.slow
def test_stop_takes_back_running_jobs_and_orphaned_handlers(service):
    """A worker killed with SIGKILL leaves its handler running in the
    handler's own session; stop still ends it (its claim names it) and every
    job is back in incoming/."""
    s = service("ssd", settings={"MYQ_WORKERS": "2"})
    s.handler("slow", 'echo $$ > "%s/started.$MYQ_JOB_ID"; sleep 300; echo x'
              % s.base)
    assert s.run("start").returncode == 0
    s.wait_workers(2)
    for jid in ("slow1", "slow2"):
        s.myq("enqueue", "slow", "null", "--id", jid)
    started = os.path.join(s.base, "started.")
    hpids = wait_for(lambda: all(read(started + j).strip() for j in ("slow1", "slow2"))
                     and [int(read(started + j)) for j in ("slow1", "slow2")],
                     what="both handlers to start")
    victim = proc_stat(hpids[0])[1]             # the worker running slow1
    assert victim in s.workers()
    proc = os.path.join(s.spool, "processing")

    def recorded():     # the worker wrote its handler's pid down
        tokens = [n[len("slow1+"):-len(".json")] for n in os.listdir(proc)
                  if n.startswith("slow1+")]
        return any(os.path.lexists(os.path.join(s.spool, "locks", "workers",
                                                t + ".run")) for t in tokens)
    wait_for(recorded, what="the handler record of slow1")
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not alive(victim), what="the worker to die")
    assert alive(hpids[0]), "the orphaned handler should still run"

    r = s.run("stop")
    assert r.returncode == 0, r.stdout + r.stderr
    assert s.leftovers() == [], "stop returned with processes left"
    assert not any(alive(p) for p in hpids)
    for jid in ("slow1", "slow2"):
        assert s.state(jid) in ("ready", "scheduled")
    # slow2's worker was stopped: its job went back without counting the
    # attempt; slow1's worker died: that attempt counts
    assert json.loads(s.myq("show", "slow2"))["attempts"] == 0
    assert json.loads(s.myq("show", "slow1"))["attempts"] == 1


@needs_busybox
@pytest.mark.slow
def test_stop_kills_after_stop_timeout(service):
    """A handler that ignores SIGTERM and a worker grace longer than
    MYQ_STOP_TIMEOUT: stop sends SIGKILL after MYQ_STOP_TIMEOUT seconds."""
    s = service("plain", settings={"MYQ_STOP_TIMEOUT": "1"})
    s.settings["MYQ_ARGS"] = "--handlers %s --poll 0.2 --grace 60" % s.handlers
    s.write_defaults()
    s.handler("stubborn", "trap '' TERM; echo $$ > \"%s/h.pid\"; "
              "while :; do sleep 1; done" % s.base)
    assert s.run("start").returncode == 0
    s.myq("enqueue", "stubborn", "null", "--id", "stubborn")
    hpid = wait_for(lambda: read(os.path.join(s.base, "h.pid")).strip(),
                    what="the handler to start")
    t0 = time.monotonic()
    r = s.run("stop")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert s.leftovers() == [] and not alive(int(hpid))
    assert 1 <= took < 15, took


@needs_busybox
def test_dead_supervisor_status_1_and_its_workers_are_stopped(service):
    s = service("ssd", settings={"MYQ_WORKERS": "2"})
    assert s.run("start").returncode == 0
    pid = s.pid()
    workers = s.wait_workers(2)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), what="the supervisor to die")
    r = s.run("status")
    assert r.returncode == 1, r.stdout + r.stderr
    # the workers see their supervisor gone and stop by themselves
    wait_for(lambda: not any(alive(w) for w in workers),
             what="the orphaned workers to stop")
    assert "event=supervisor_gone" in read(s.logfile)
    # start cleans up what the dead supervisor left, then starts afresh
    r = s.run("start")
    assert r.returncode == 0, r.stdout + r.stderr
    pid2 = s.pid()
    new = s.wait_workers(2)
    os.kill(pid2, signal.SIGKILL)
    wait_for(lambda: not alive(pid2), what="the supervisor to die")
    r = s.run("stop")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not any(alive(w) for w in new)
    assert s.leftovers() == [] and s.run("status").returncode == 3


@needs_busybox
def test_restart_after_the_settings_changed(service):
    """The operator edits the settings (another spool, another program
    path), then restarts: the old supervisor and its workers are stopped."""
    s = service("ssd")
    assert s.run("start").returncode == 0
    old_pid, old_spool = s.pid(), s.spool
    (w,) = s.wait_workers(1)
    s.spool = os.path.join(s.base, "spool2")
    shutil.copy(MYQ, os.path.join(s.base, "myq"))
    s.settings.update(MYQ_SPOOL=s.spool, MYQ_BIN=os.path.join(s.base, "myq"))
    s.write_defaults()
    r = s.run("restart")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not alive(old_pid) and not alive(w)
    assert s.pid() != old_pid and " --spool %s " % s.spool in cmdline(s.pid(), text=True)
    assert s.run("stop").returncode == 0
    assert s.leftovers() == []
    s.spool = old_spool
    assert s.leftovers() == []


@needs_busybox
def test_pidfile_of_another_program_is_not_killed(service):
    """A stale pidfile whose pid now belongs to someone else: status 1, and
    stop (or start) never signals that process."""
    s = service("ssd")
    other = subprocess.Popen(["sleep", "60"])
    try:
        os.makedirs(os.path.dirname(s.pidfile))
        with open(s.pidfile, "w") as f:
            f.write("%d\n" % other.pid)
        assert s.run("status").returncode == 1
        r = s.run("stop")
        assert r.returncode == 0, r.stdout + r.stderr
        assert other.poll() is None, "stop killed an unrelated process"
        assert s.run("status").returncode == 3
        with open(s.pidfile, "w") as f:
            f.write("%d\n" % other.pid)
        assert s.run("start").returncode == 0
        assert other.poll() is None and s.pid() != other.pid
        assert s.run("stop").returncode == 0
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def world_executable_python():
    """A python3 that any user may run: every directory on its path (and
    the file) executable by others."""
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(cand)
        if not os.path.isfile(real):
            continue
        parts, p = [], real
        while p != "/":
            parts.append(p)
            p = os.path.dirname(p)
        if all(os.stat(q).st_mode & stat.S_IXOTH for q in parts):
            return real
    return None


@needs_busybox
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to become MYQ_USER)")
def test_runs_as_myq_user(service):
    """MYQ_USER=nobody: the spool, the log and every process belong to it."""
    try:
        import pwd
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody'")
    python = world_executable_python()
    if not python:
        pytest.skip("no python3 that user nobody may run")
    base = tempfile.mkdtemp(prefix="myq-initd-")    # traversable by nobody
    try:
        os.chmod(base, 0o755)
        shutil.copy(MYQ, os.path.join(base, "myq"))
        s = service("ssd", base=os.path.join(base, "svc"), settings={
            "MYQ_USER": "nobody", "MYQ_PYTHON": python,
            "MYQ_BIN": os.path.join(base, "myq")})
        os.chmod(s.base, 0o755)
        os.chmod(s.handlers, 0o755)
        open(s.out, "w").close()
        os.chown(s.out, nobody.pw_uid, -1)
        r = s.run("start")
        assert r.returncode == 0, r.stdout + r.stderr
        pid = s.pid()
        (w,) = s.wait_workers(1)
        for p in (pid, w):
            assert proc_stat(p)[3] == nobody.pw_uid
        assert environ(w).get("HOME") == nobody.pw_dir
        for d in ("", "incoming", "processing", "done", "locks"):
            assert os.stat(os.path.join(s.spool, d)).st_uid == nobody.pw_uid
        assert os.stat(s.logfile).st_uid == nobody.pw_uid
        assert os.stat(s.pidfile).st_uid == 0
        s.myq("enqueue", "ok", '"as nobody"', "--id", "n1", user=nobody,
              python=python)
        wait_for(lambda: s.done("n1"), what="the job run as nobody")
        # the log directory is the user's: after a rotation, the
        # reopened log is created by the user
        os.rename(s.logfile, s.logfile + ".1")
        assert s.run("reload").returncode == 0
        wait_for(lambda: os.path.exists(s.logfile), what="the new log")
        assert os.stat(s.logfile).st_uid == nobody.pw_uid
        assert s.run("stop").returncode == 0
        assert s.leftovers() == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_busybox
@pytest.mark.skipif(not shutil.which("logrotate"),
                    reason="logrotate not installed (apt-get install logrotate)")
def test_logrotate_with_reload(service, tmp_path):
    """The README's logrotate stanza: rename, then "init.d/myq reload" in
    postrotate; the workers write the new file, the old one is compressed
    at the next rotation (delaycompress)."""
    s = service("ssd")
    assert s.run("start").returncode == 0
    s.wait_workers(1)
    conf = tmp_path / "logrotate.conf"
    conf.write_text(
        "%s {\n\tmissingok\n\tnotifempty\n\trotate 4\n\tcompress\n"
        "\tdelaycompress\n\tpostrotate\n\t\t%s sh %s reload >/dev/null\n"
        "\tendscript\n}\n" % (s.logfile, BUSYBOX, SCRIPT))
    env = {"PATH": s.path + ":/usr/sbin:/usr/bin:/sbin:/bin",
           "MYQ_DEFAULTS": s.defaults}
    for rotation in (1, 2):
        r = subprocess.run(["logrotate", "-f", "-s", str(tmp_path / "state"),
                            str(conf)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True,
                           timeout=60)
        assert r.returncode == 0, r.stdout
        n = [0]

        def worker_wrote_new_log():
            n[0] += 1
            jid = "rot%d-%d" % (rotation, n[0])
            s.myq("enqueue", "ok", "null", "--id", jid)
            wait_for(lambda: s.done(jid), what="job " + jid)
            return "id=" + jid in read(s.logfile)

        wait_for(worker_wrote_new_log, what="a worker to write the new log")
    assert os.path.exists(s.logfile + ".1")
    assert os.path.exists(s.logfile + ".2.gz")
    assert s.run("stop").returncode == 0
    assert s.leftovers() == []


@needs_busybox
def test_syslog_is_the_default_log(service):
    s = service("plain", settings={"MYQ_LOG": None})
    s.settings["MYQ_ARGS"] += " --syslog-facility local0 --syslog-tag myq-test"
    s.write_defaults()
    r = s.run("start")
    assert r.returncode == 0, r.stdout + r.stderr
    assert cmdline(s.pid(), text=True).rstrip().endswith(
        " --syslog-facility local0 --syslog-tag myq-test --syslog")
    s.wait_workers(1)
    assert s.run("stop").returncode == 0
    assert s.leftovers() == []


# Settings and exit codes #####################################################

@needs_busybox
def test_missing_settings_file_means_defaults(service):
    """No settings file: the defaults (pidfile /var/run/myq.pid, …); status
    only reads, so it is safe to ask here."""
    s = service("plain")
    os.unlink(s.defaults)
    r = s.run("status")
    if os.path.exists("/var/run/myq.pid"):
        pytest.skip("a real myq service runs on this machine")
    assert r.returncode == 3 and "not running" in r.stdout, r.stdout + r.stderr
    r = s.run("bogus")
    assert r.returncode == 2 and "Usage:" in r.stderr


@needs_busybox
@pytest.mark.parametrize("setting, value, code, message", [
    ("MYQ_WORKERS", "0", 6, "MYQ_WORKERS"),
    ("MYQ_WORKERS", "two", 6, "MYQ_WORKERS"),
    ("MYQ_LOG", "myq.log", 6, "MYQ_LOG"),
    ("MYQ_SPOOL", "spool", 6, "MYQ_SPOOL"),
    ("MYQ_STOP_TIMEOUT", "1.5", 6, "MYQ_STOP_TIMEOUT"),
    ("MYQ_PYTHON", "no-such-python", 5, "MYQ_PYTHON"),
    ("MYQ_BIN", "/nonexistent/myq", 5, "MYQ_BIN"),
    ("MYQ_USER", "no-such-user-x", 6, "MYQ_USER"),
    ("MYQ_ARGS", "--no-such-option", 1, "unrecognized arguments: --no-such-option"),
])
def test_bad_settings(service, setting, value, code, message):
    s = service("ssd", settings={setting: value})
    r = s.run("start")
    assert r.returncode == code, r.stdout + r.stderr
    assert message in r.stderr      # myq's own complaint, at once
    assert s.run("status").returncode == 3
    assert s.leftovers() == []


@needs_busybox
def test_bad_worker_option_with_syslog_says_why(service):
    """With syslog as the log, a bad option is still said on the terminal:
    supervise --daemon checks the command line before it forks."""
    s = service("plain", settings={"MYQ_LOG": None})
    s.settings["MYQ_ARGS"] += " --no-such-option"
    s.write_defaults()
    r = s.run("start")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL" in r.stdout
    assert r.stderr.startswith("myq: ") and "--no-such-option" in r.stderr, r.stderr
    assert s.run("status").returncode == 3 and s.leftovers() == []


@needs_busybox
def test_reload_when_stopped_is_7(service):
    s = service("plain")
    r = s.run("reload")
    assert r.returncode == 7, r.stdout + r.stderr


@needs_busybox
def test_buildroot_rcS_S50myq(service, tmp_path):
    """Buildroot/BusyBox init: /etc/init.d/S50myq, run by rcS as
    "S50myq start" (through its #! line) and by rcK as "S50myq stop"."""
    s = service("ssd")
    initd = tmp_path / "etc" / "init.d"
    initd.mkdir(parents=True)
    shutil.copy(SCRIPT, str(initd / "S50myq"))
    os.chmod(str(initd / "S50myq"), 0o755)
    rcs = ('for i in %s/S??* ; do [ ! -f "$i" ] && continue; "$i" "$1"; done'
           % initd)
    env = {"PATH": s.path, "MYQ_DEFAULTS": s.defaults}
    r = subprocess.run([BUSYBOX, "sh", "-c", rcs, "rcS", "start"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, timeout=60)
    assert r.returncode == 0 and "Starting myq: OK" in r.stdout, r.stdout + r.stderr
    s.wait_workers(1)
    r = subprocess.run([BUSYBOX, "sh", "-c", rcs, "rcK", "stop"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, timeout=60)
    assert r.returncode == 0 and "Stopping myq: OK" in r.stdout, r.stdout + r.stderr
    assert s.leftovers() == []


@needs_busybox
def test_openwrt_boot_and_shutdown(service):
    """OpenWrt's rc.d runs its S* links with "boot", and K* with "shutdown"."""
    s = service("ssd")
    assert s.run("boot").returncode == 0
    assert s.run("status").returncode == 0
    assert s.run("shutdown").returncode == 0
    assert s.run("status").returncode == 3
    assert s.leftovers() == []


def test_lsb_header_for_update_rc_d():
    """Debian's update-rc.d/insserv read the LSB header."""
    text = open(SCRIPT).read()
    head = text[text.index("### BEGIN INIT INFO"):text.index("### END INIT INFO")]
    fields = {}
    for line in head.splitlines()[1:]:
        k, sep, v = line.lstrip("#").strip().partition(":")
        if sep:
            fields[k] = v.split()
    assert fields["Provides"] == ["myq"]
    assert fields["Default-Start"] == ["2", "3", "4", "5"]
    assert fields["Default-Stop"] == ["0", "1", "6"]
    assert {"$local_fs", "$remote_fs", "$syslog"} <= set(fields["Required-Start"])
    assert text.startswith("#!/bin/sh\n")
    assert os.stat(SCRIPT).st_mode & stat.S_IXUSR


@pytest.mark.skipif(not shutil.which("shellcheck"),
                    reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck():
    scripts = [SCRIPT, os.path.join(ROOT, "init.d", "myq.default")]
    r = subprocess.run(["shellcheck", "-s", "sh"] + scripts,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       universal_newlines=True)
    assert r.returncode == 0, r.stdout


@needs_busybox
def test_a_service_without_handlers_warns(service):
    """The default settings have no --handlers and no --module: every job but
    http would die. The supervisor logs a warning and status says it."""
    s = service("plain")
    s.settings["MYQ_ARGS"] = "--poll 0.2 --grace 1"
    s.write_defaults()
    assert s.run("start").returncode == 0
    r = s.run("status")
    assert r.returncode == 0
    assert "no --handlers or --module" in r.stderr, r.stderr
    wait_for(lambda: "event=warning" in read(s.logfile), what="the warning")
    assert "no --handlers and no --module" in read(s.logfile)
    assert s.run("stop").returncode == 0
    s.settings["MYQ_ARGS"] = "--handlers %s" % s.handlers
    s.write_defaults()
    assert s.run("start").returncode == 0
    assert "warning" not in s.run("status").stderr
    assert s.run("stop").returncode == 0
    assert s.leftovers() == []
