"""The OpenWrt procd init script (init.d/myq.procd, the ipk's
/etc/init.d/myq) and its UCI settings file (init.d/myq.config, the ipk's
/etc/config/myq).

The script runs under BusyBox sh through a stand-in for OpenWrt's
/etc/rc.common (FAKE_RC below): the same dispatch of start, stop, reload
and restart as rc.common does with USE_PROCD=1, procd's functions stubbed
to record their calls, and config_load/config_get reading a UCI file of
`config`/`option` lines from UCI_CONFIG_DIR. The real python3 and myq.py
run `myq init`, `myq supervise --dry-run` and `myq reap`, through a wrapper
that records their arguments and environment. Where a test needs the
service running, it plays procd: it starts the command that start_service
gave procd_set_param, and the procd_kill stub sends it SIGTERM.

What is proved: the command line procd runs (spool, workers, stop-timeout,
--user, --log or --syslog, args split on blanks and never globbed), the
defaults of an empty configuration, no `user` param (supervise switches
user itself) and no reload_signal (procd would then only signal a changed
instance, never restart it), a term_timeout above stop_timeout, the reload
trigger on the `myq` config, reload (SIGHUP, then start; wrong settings
leave the service alone), the stop hook that waits for supervise and its
workers and runs `myq reap` (the job and handler of a killed worker are
taken back), wrong settings refused with a message, and that starting
never writes, touches or chowns the log path (a symlink there to a
root-only file leaves that file as it was). And shellcheck.
"""
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys

import pytest

from _core import ROOT, myq_argv, wait_for
from _procs import alive

SCRIPT = os.path.join(ROOT, "init.d", "myq.procd")
CONFIG = os.path.join(ROOT, "init.d", "myq.config")
MYQ = os.path.join(ROOT, "myq.py")
BUSYBOX = shutil.which("busybox")
SHELLCHECK = shutil.which("shellcheck")
OPTIONS = ["spool", "python", "bin", "user", "args", "workers", "log",
           "stop_timeout", "listen", "listen_token_file", "subscribe", "store"]

pytestmark = pytest.mark.skipif(
    not BUSYBOX, reason="busybox not installed (apt-get install busybox)")

# OpenWrt's /etc/rc.common for a USE_PROCD script, reduced to what the
# script uses: its defaults, the start/stop/reload/restart of the procd
# block, procd's and UCI's functions as stubs that record their calls in
# $CALLS (one line a call, each argument in <>).
FAKE_RC = r'''
initscript=$1
action=$2
shift 2

rec() {
	{
		printf '%s' "$1"
		shift
		for _a in "$@"; do printf ' <%s>' "$_a"; done
		echo
	} >>"$CALLS"
}

unquote() {
	case $1 in
	\'*\') _u=${1#\'} && _u=${_u%\'} ;;
	\"*\") _u=${1#\"} && _u=${_u%\"} ;;
	*) _u=$1 ;;
	esac
	printf '%s' "$_u"
}

config_load() {
	rec config_load "$@"
	_uci=$UCI_CONFIG_DIR/$1
}

# config_get VAR SECTION OPTION [DEFAULT]: the last such option of the
# section, or DEFAULT when it is missing or empty (as OpenWrt's)
config_get() {
	_sec= _val=
	while read -r _kw _name _rest; do
		case $_kw in
		config) _sec=$(unquote "$_rest") ;;
		option) [ "$_sec" != "$2" ] || [ "$_name" != "$3" ] || _val=$(unquote "$_rest") ;;
		esac
	done <"$_uci"
	eval "$1=\${_val:-\$4}"
}

procd_open_service() { rec procd_open_service "$@"; }
procd_close_service() {
	service_triggers
	rec procd_close_service "$@"
}
procd_open_instance() { rec procd_open_instance "$@"; }
procd_close_instance() { rec procd_close_instance "$@"; }
procd_set_param() {
	rec procd_set_param "$@"
	if [ "$1" = command ]; then
		shift
		printf '%s\n' "$@" >"$COMMAND"
	fi
}
procd_add_reload_trigger() { rec procd_add_reload_trigger "$@"; }
procd_send_signal() {
	rec procd_send_signal "$@"
	[ ! -s "$PROCD_PID" ] || kill -s "$3" "$(cat "$PROCD_PID")" 2>/dev/null
}
procd_kill() {
	rec procd_kill "$@"
	[ ! -s "$PROCD_PID" ] || kill -s TERM "$(cat "$PROCD_PID")" 2>/dev/null
	return 0
}

start_service() { return 0; }
stop_service() { return 0; }
service_triggers() { return 0; }

. "$initscript"

start() {
	procd_open_service myq "$initscript"
	start_service "$@"
	procd_close_service set
}
stop() {
	stop_service "$@"
	procd_kill myq "$1"
	if type service_stopped >/dev/null 2>&1; then
		service_stopped
	fi
	rec stopped
}
reload() {
	if type reload_service >/dev/null 2>&1; then
		reload_service "$@"
	else
		start
	fi
}
restart() {
	stop "$@"
	start "$@"
}
"$action" "$@"
'''


def calls(path):
    """The recorded calls: [[name, arg, ...]]."""
    try:
        text = open(str(path)).read()
    except FileNotFoundError:
        return []
    return [[line.split(" ", 1)[0]] + re.findall(r"<(.*?)>", line)
            for line in text.splitlines()]


class OpenWrt(object):
    """An installation of the procd script under tmp_path: /etc/config/myq
    (UCI_CONFIG_DIR), a python3 wrapper, a spool, handlers, a log path."""

    def __init__(self, tmp_path):
        self.base = tmp_path
        self.rc = tmp_path / "rc.common"
        self.rc.write_text(FAKE_RC)
        self.uci = tmp_path / "config"
        self.uci.mkdir()
        self.calls_file = tmp_path / "calls"
        self.command_file = tmp_path / "command"
        self.pidfile = tmp_path / "procd.pid"
        self.argv_log = tmp_path / "python-argv"
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        # python3 in PATH: records its arguments and any MYQ_* variable,
        # then runs this Python
        self.python = self.bin / "python3"
        self.python.write_text(
            '#!/bin/sh\n{ printf "%%s|" "$@"; echo; env | grep "^MYQ_" || :; } >>"%s"\n'
            'exec "%s" "$@"\n' % (self.argv_log, sys.executable))
        self.python.chmod(0o755)
        for name in ("chown", "chmod", "touch", "ln", "mkdir", "cp", "mv"):
            # recorded, then done: the log path must never be among them
            stub = self.bin / name
            stub.write_text('#!/bin/sh\necho "%s $*" >>"%s"\nexec "%s" %s "$@"\n'
                            % (name, tmp_path / "tools", BUSYBOX, name))
            stub.chmod(0o755)
        self.spool = str(tmp_path / "spool")
        self.handlers = tmp_path / "handlers"
        self.handlers.mkdir()
        self.log = str(tmp_path / "log" / "myq.log")
        self.procd = None

    def configure(self, text=None, **options):
        """/etc/config/myq: text, or the section with these options."""
        if text is None:
            text = "config myq 'main'\n" + "".join(
                "\toption %s '%s'\n" % kv for kv in options.items())
        (self.uci / "myq").write_text(text)

    def settings(self, **kw):
        opts = {"spool": self.spool, "bin": MYQ, "workers": "2",
                "log": self.log, "stop_timeout": "7",
                "args": "--handlers %s --poll 0.2 --grace 1" % self.handlers}
        opts.update(kw)
        self.configure(**{k: v for k, v in opts.items() if v is not None})

    def run(self, action, env=None, timeout=90):
        full = {"PATH": "%s:%s" % (self.bin, os.path.dirname(BUSYBOX)),
                "CALLS": str(self.calls_file), "COMMAND": str(self.command_file),
                "PROCD_PID": str(self.pidfile), "UCI_CONFIG_DIR": str(self.uci)}
        full.update(env or {})
        return subprocess.run([BUSYBOX, "sh", str(self.rc), SCRIPT, action],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, env=full, timeout=timeout)

    def ok(self, action, **kw):
        r = self.run(action, **kw)
        assert r.returncode == 0, "%s: %s%s" % (action, r.stdout, r.stderr)
        return r

    def calls(self):
        return calls(self.calls_file)

    def params(self):
        """{param: [values]} of the last instance start_service opened."""
        out = {}
        for c in self.calls():
            if c[0] == "procd_open_instance":
                out = {}
            elif c[0] == "procd_set_param":
                out[c[1]] = c[2:]
        return out

    def python_runs(self):
        """[(argv, [MYQ_* lines])] of every python3 run by the script."""
        out = []
        for line in open(str(self.argv_log)).read().splitlines():
            if line.startswith("MYQ_"):
                out[-1][1].append(line)
            else:
                out.append((line.rstrip("|").split("|"), []))
        return out

    def tools(self):
        try:
            return open(str(self.base / "tools")).read().splitlines()
        except FileNotFoundError:
            return []

    def start_like_procd(self):
        """Run the command start_service handed to procd, as procd does
        (as root, stdout and stderr to a pipe it reads)."""
        argv = open(str(self.command_file)).read().splitlines()
        self.procd = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL,
                                      env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        self.pidfile.write_text("%d\n" % self.procd.pid)
        return self.procd

    def procs(self):
        """pids of this spool's supervise and workers."""
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                cmd = open("/proc/%s/cmdline" % d, "rb").read().replace(b"\0", b" ")
            except OSError:
                continue
            for what in (b"supervise", b"worker"):
                if (b" --spool %s %s " % (self.spool.encode(), what)) in cmd:
                    out.append(int(d))
        return out

    def myq(self, *args):
        r = subprocess.run(myq_argv() + ["--spool", self.spool] + list(args),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           universal_newlines=True, timeout=60,
                           env={"PATH": os.environ.get("PATH", "")})
        assert r.returncode == 0, r.stderr
        return r.stdout

    def cleanup(self):
        for p in self.procs():
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.procd is not None:
            self.procd.wait()


@pytest.fixture
def openwrt(tmp_path):
    o = OpenWrt(tmp_path)
    yield o
    o.cleanup()


def nobody():
    import pwd
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


def service_user():
    """A user other than root when this runs as root, else this user."""
    if os.geteuid() == 0:
        pw = nobody()
        if pw is None:
            pytest.skip("no user 'nobody'")
        return pw
    import pwd
    return pwd.getpwuid(os.geteuid())


def test_start_service_command_line(openwrt):
    """The instance: "myq --spool SPOOL supervise" with the UCI settings,
    args split on blanks (a glob stays a word), --user, --log; run as root
    (no user param), term_timeout above stop_timeout, respawn, stdout and
    stderr to logd, no reload_signal; the spool belongs to the user; the
    reload trigger watches the myq config."""
    pw = service_user()
    (openwrt.base / "a-file").write_text("")
    openwrt.settings(user=pw.pw_name, args="  --handlers %s   --poll 0.2 "
                     "--pass-env %s/*  " % (openwrt.handlers, openwrt.base))
    r = openwrt.ok("start")
    assert r.stderr == ""
    expect = [str(openwrt.python), MYQ, "--spool", openwrt.spool, "supervise",
              "--workers", "2", "--stop-timeout", "7",
              "--handlers", str(openwrt.handlers), "--poll", "0.2",
              "--pass-env", "%s/*" % openwrt.base]
    if pw.pw_uid != 0:
        expect += ["--user", pw.pw_name]
    expect += ["--log", openwrt.log]
    p = openwrt.params()
    assert p["command"] == expect
    assert open(str(openwrt.command_file)).read().splitlines() == expect
    assert "user" not in p and "group" not in p      # supervise switches
    assert "reload_signal" not in p
    assert int(p["term_timeout"][0]) > 7
    assert p["respawn"] == ["3600", "5", "0"]
    assert p["stdout"] == ["1"] and p["stderr"] == ["1"]
    names = [c[0] for c in openwrt.calls()]
    assert names == ["procd_open_service", "config_load", "procd_open_instance"]\
        + ["procd_set_param"] * 5 + ["procd_close_instance",
                                     "procd_add_reload_trigger",
                                     "procd_close_service"]
    assert ["procd_add_reload_trigger", "myq"] in openwrt.calls()
    assert ["config_load", "myq"] in openwrt.calls()
    # the spool, for the user; init and a dry run of the same command,
    # with none of the caller's MYQ_* variables
    assert os.stat(os.path.join(openwrt.spool, "incoming")).st_uid == pw.pw_uid
    runs = openwrt.python_runs()
    assert [a for a, _ in runs] == [
        [MYQ, "--spool", openwrt.spool, "init", "--owner", pw.pw_name],
        expect[1:] + ["--dry-run"]]
    # the log is supervise's to create: nothing of it exists yet
    assert not os.path.lexists(os.path.dirname(openwrt.log))


def test_caller_environment_does_not_reach_myq(openwrt):
    """MYQ_* variables of whoever runs /etc/init.d/myq reach no myq
    command (myq would read them as options)."""
    openwrt.settings()
    openwrt.ok("start", env={"MYQ_WORKERS": "9", "MYQ_CONCURRENCY": "0"})
    runs = openwrt.python_runs()
    assert runs and all(env == [] for _, env in runs)
    assert openwrt.params()["command"][6] == "2"


def test_syslog_and_root(openwrt):
    """log 'syslog' gives --syslog; user root gives no --user."""
    openwrt.settings(log="syslog", user="root", args=None)
    openwrt.ok("start")
    cmd = openwrt.params()["command"]
    assert cmd[-1] == "--syslog" and "--log" not in cmd
    assert "--user" not in cmd
    assert cmd[4:] == ["supervise", "--workers", "2", "--stop-timeout", "7",
                       "--syslog"]


def test_shipped_config_means_the_defaults(openwrt):
    """The shipped /etc/config/myq sets nothing: every option is its
    default (bin aside: there is no /usr/bin/myq here)."""
    openwrt.configure(open(CONFIG).read() + "\toption bin '%s'\n" % MYQ)
    # no spool at /var/spool/myq here: python3 records and succeeds
    openwrt.python.write_text('#!/bin/sh\nprintf "%%s|" "$@" >>"%s"; echo >>"%s"\n'
                              % (openwrt.argv_log, openwrt.argv_log))
    openwrt.ok("start")
    p = openwrt.params()
    assert p["command"] == [str(openwrt.python), MYQ, "--spool", "/var/spool/myq",
                            "supervise", "--workers", "1", "--stop-timeout",
                            "10", "--syslog"]
    assert int(p["term_timeout"][0]) > 10
    assert openwrt.python_runs()[0][0][3:] == ["init", "--owner", "root"]


def test_shipped_config_documents_every_option():
    """init.d/myq.config: one `config myq 'main'` section, every option
    commented, with the script's default; the options are the SysV
    settings of init.d/myq.default, lower case, without MYQ_ (but the
    pidfile, procd's business)."""
    text = open(CONFIG).read()
    assert re.findall(r"^config .*$", text, re.M) == ["config myq 'main'"]
    assert not re.findall(r"^\s*(option|list)\s", text, re.M)
    commented = re.findall(r"^\s*#option (\w+) '([^']*)'$", text, re.M)
    script = open(SCRIPT).read()
    defaults = dict(re.findall(r"config_get (\w+) main \1 (\S+)", script))
    defaults = {k: "" if v == "''" else v for k, v in defaults.items()}
    assert sorted(defaults) == sorted(OPTIONS)
    assert sorted(set(k for k, _ in commented)) == sorted(OPTIONS)
    for k, v in commented:
        if k != "args" or v == "":
            assert defaults[k] == v, k
    sysv = re.findall(r"^#MYQ_(\w+)=", open(os.path.join(ROOT, "init.d",
                                                       "myq.default")).read(), re.M)
    assert sorted(v.lower() for v in set(sysv) if v != "PIDFILE") == sorted(OPTIONS)


@pytest.mark.parametrize("option,value,message", [
    ("workers", "0", "workers must be a number >= 1"),
    ("workers", "two", "workers must be a number >= 1"),
    ("stop_timeout", "5s", "stop_timeout must be whole seconds"),
    ("log", "myq.log", "log must be 'syslog' or an absolute path"),
    ("spool", "spool", "spool must be an absolute path"),
    ("bin", "/nonexistent/myq", "bin: cannot read /nonexistent/myq"),
    ("python", "no-such-python", "python: no 'no-such-python' in PATH"),
    ("user", "no-such-user", "user: no user 'no-such-user'"),
    ("args", "--concurency 2", "--concurency"),
])
def test_wrong_settings_start_nothing(openwrt, option, value, message):
    openwrt.settings(**{option: value})
    r = openwrt.run("start")
    # rc.common's start does not pass start_service's status on
    assert message in r.stderr
    assert "procd_open_instance" not in [c[0] for c in openwrt.calls()]


def test_reload(openwrt):
    """reload: SIGHUP to the instance (the log is reopened), then start
    (procd restarts an instance whose command changed). Wrong settings:
    said, and neither signal nor start."""
    openwrt.settings()
    openwrt.ok("reload")
    names = [c[0] for c in openwrt.calls()]
    assert ["procd_send_signal", "myq", "*", "HUP"] in openwrt.calls()
    assert names.index("procd_send_signal") < names.index("procd_open_service")
    assert "procd_open_instance" in names
    # init and the dry run ran once, not again for start
    assert len(openwrt.python_runs()) == 2
    os.unlink(str(openwrt.calls_file))
    openwrt.settings(workers="0")
    r = openwrt.run("reload")
    assert r.returncode != 0 and "workers must be" in r.stderr
    assert [c[0] for c in openwrt.calls()] == ["config_load"]


def test_start_never_touches_the_log_path(openwrt, tmp_path):
    """The log path (or its directory) replaced by a symlink to a root-only
    file or directory: start, reload, restart and stop leave the victim as
    it was (content, mode, owner, time); no chown, chmod, touch, ln,
    mkdir, cp or mv names the log; the symlink is still there."""
    pw = service_user()
    victim = tmp_path / "shadow"
    victim.write_text("root:secret:1:0:99999:7:::\n")
    victim.chmod(0o600)
    os.utime(str(victim), (1e9, 1e9))
    logdir = os.path.dirname(openwrt.log)
    os.makedirs(logdir)
    os.symlink(str(victim), openwrt.log)
    vdir = tmp_path / "etc"
    vdir.mkdir(mode=0o700)
    os.utime(str(vdir), (1e9, 1e9))
    other_log = str(tmp_path / "log2" / "myq.log")
    os.symlink(str(vdir), os.path.dirname(other_log))

    def snapshot(path):
        st = os.stat(str(path))
        data = open(str(path), "rb").read() if os.path.isfile(str(path)) \
            else sorted(os.listdir(str(path)))
        return (data, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime)

    before = snapshot(victim), snapshot(vdir)
    for log in (openwrt.log, other_log):
        openwrt.settings(user=pw.pw_name, log=log)
        for action in ("start", "reload", "restart", "stop"):
            openwrt.ok(action)
            assert (snapshot(victim), snapshot(vdir)) == before, action
        assert "--log" in openwrt.params()["command"]
        assert os.readlink(openwrt.log) == str(victim)
        assert os.readlink(os.path.dirname(other_log)) == str(vdir)
    assert not [t for t in openwrt.tools() if "log" in t], openwrt.tools()


def wait_workers(openwrt, n):
    return wait_for(lambda: len(openwrt.procs()) == n + 1 and openwrt.procs(),
                    timeout=30, what="%d workers" % n)


@pytest.mark.slow
def test_stop_waits_for_the_supervisor(openwrt):
    """stop: procd_kill SIGTERMs the supervisor; service_stopped returns
    once it and its workers are gone (then runs myq reap); a job runs in
    between."""
    (openwrt.handlers / "ok").write_text("#!/bin/sh\ncat >>%s\n" % (openwrt.base / "out"))
    (openwrt.handlers / "ok").chmod(0o755)
    openwrt.settings()
    openwrt.ok("start")
    openwrt.start_like_procd()
    wait_workers(openwrt, 2)
    openwrt.myq("enqueue", "ok", '"hi"', "--id", "j1")
    wait_for(lambda: json.loads(openwrt.myq("show", "j1"))["state"] == "done",
             timeout=30, what="the job")
    openwrt.ok("stop")
    assert openwrt.procs() == []
    assert openwrt.procd.wait(timeout=5) == 0
    assert [a[3] for a, _ in openwrt.python_runs()][-1] == "reap"
    names = [c[0] for c in openwrt.calls()]
    assert names[-3:] == ["procd_kill", "config_load", "stopped"]
    assert os.path.isfile(openwrt.log)      # supervise created it


@pytest.mark.slow
def test_stop_after_procd_killed_everything_takes_back_the_job(openwrt):
    """procd's SIGKILL (term_timeout ran out) hits the supervisor, and its
    worker was killed too: the claim and the handler are left over. stop's
    service_stopped runs myq reap: the job is back, its handler ended."""
    started = openwrt.base / "started"
    (openwrt.handlers / "slow").write_text(
        '#!/bin/sh\necho $$ > "%s"\nsleep 300\n' % started)
    (openwrt.handlers / "slow").chmod(0o755)
    openwrt.settings(workers="1")
    openwrt.ok("start")
    sup = openwrt.start_like_procd()
    wait_workers(openwrt, 1)
    openwrt.myq("enqueue", "slow", "null", "--id", "slow1")
    hpid = wait_for(lambda: started.exists() and started.read_text().strip()
                    and int(started.read_text()), timeout=30, what="the handler")
    proc = os.path.join(openwrt.spool, "processing")

    def recorded():     # the worker wrote its handler's pid down
        tokens = [n[len("slow1+"):-len(".json")] for n in os.listdir(proc)
                  if n.startswith("slow1+")]
        return any(os.path.lexists(os.path.join(openwrt.spool, "locks", "workers",
                                                t + ".run")) for t in tokens)
    wait_for(recorded, what="the handler record of slow1")
    pids = openwrt.procs()
    for p in pids:
        os.kill(p, signal.SIGKILL)
    sup.wait(timeout=10)
    # gone for good: a zombie (re-parented to init, which has not waited
    # for it yet) would still count as a live worker
    wait_for(lambda: not any(os.path.exists("/proc/%d" % p) for p in pids),
             timeout=60, what="the workers to be gone")
    assert alive(hpid)
    assert json.loads(openwrt.myq("show", "slow1"))["state"] == "processing"
    openwrt.pidfile.write_text("")          # procd has no instance left
    openwrt.ok("stop")
    wait_for(lambda: not alive(hpid), what="the orphaned handler to end")
    assert json.loads(openwrt.myq("show", "slow1"))["state"] in ("ready", "scheduled")


def test_stop_with_nothing_running(openwrt):
    """stop when nothing runs and there is no spool: no error, no reap."""
    openwrt.settings()
    r = openwrt.ok("stop")
    assert r.stdout == "" and r.stderr == ""
    assert not os.path.exists(str(openwrt.argv_log))


@pytest.mark.skipif(not SHELLCHECK, reason="shellcheck not installed")
def test_shellcheck():
    text = open(SCRIPT).read()
    assert text.startswith("#!/bin/sh /etc/rc.common\n")
    assert "# shellcheck shell=sh" in text
    r = subprocess.run([SHELLCHECK, "-s", "sh", SCRIPT], stdout=subprocess.PIPE,
                       universal_newlines=True)
    assert r.returncode == 0, r.stdout


def test_script_touches_no_file_by_path():
    """No chown, chmod, touch or redirection into a file in the script:
    whatever a file needs is done by myq (init, supervise)."""
    code = "\n".join(line for line in open(SCRIPT).read().splitlines()
                     if not line.lstrip().startswith("#"))
    assert not re.search(r"\b(chown|chmod|touch|mkdir)\b", code)
    assert not re.search(r">>?\s*\"?\$(?!\{?_?[0-9]|/dev/null)", code.replace(
        ">/dev/null", "").replace("2>&1", ""))
    assert "procd_set_param user" not in code
    assert "/etc/default/myq" not in code
