"""Small helpers shared by the black-box tests: the one
home of ROOT, MYQ and the helpers more than one test file uses.

Everything here drives myq from the outside: the CLI as a subprocess
(`run_myq`), the CLI in this process (`call_myq`, for a quick command whose
process proves nothing more), or the files of the spool. Waiting is always
"poll a condition until a deadline".
"""
import errno
import contextlib
import io
import json
import locale
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MYQ = os.path.join(ROOT, "myq.py")

STATES = ("ready", "scheduled", "processing", "done", "dead", "failed")
STATUS_RE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ queue=\S+ ready=\d+ processing=\d+"
    r" done=\d+ dead=\d+ oldest_ready_s=\d+ retries_1m=\d+( \w+=\S+)*$")
LOG_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z( [\w.-]+=\S*)+")

# Fast, deterministic worker defaults: a failed job stays scheduled (backoff
# 60 s, no jitter) unless a test says otherwise.
FAST = ("--poll", "0.05", "--jitter", "0", "--backoff-base", "60")


# Starting myq.py.  `python myq.py` compiles its ~9,000 lines at every start
# (a script's byte code is never cached): ~0.1 s of CPU of the ~0.17 s a
# quick command costs, and the suite starts thousands.  MYQ_ARGV starts it
# the same way -- a fresh interpreter, argv[0] myq.py, sys.path[0] its
# directory, run as __main__ with __file__ set -- but from the code object
# the first start compiled (from the same source, under the same file name,
# so tracebacks are the same), kept per interpreter version and source
# checksum in a directory of this user's alone.  What it does not give is
# the path only a script takes (the body as the outermost frame: the
# `_COMPILED_AT_START` heap give-back); tests about the process image itself
# (test_script_start, test_dist, the init scripts) start the real script.
# TESTS_AS_SCRIPT=1 makes every start `python myq.py` again.
CODE_DIR = os.path.join("/tmp", "myq-tests-code-%d" % os.getuid())
# _myq_tests_code(path, dir) -> the code object of myq.py (source text, for
# BOOT and test_light's prelude): from dir's cache when dir is a directory
# of this user's alone (0700, no symlink), else compiled (and cached there:
# one file per interpreter version and source text; a copy elsewhere gets
# its file name put in, as its compile would; files unused for an hour go
# at the next compile).
CODE = r"""def _myq_tests_code(me, d):
    import os, marshal, sys, time, zlib
    with open(me, "rb") as f:
        src = f.read()
    tag = sys.implementation.cache_tag
    path = os.path.join(d, "%s-%08x-%d" % (tag, zlib.crc32(src), len(src)))

    def ours():
        try:
            st = os.lstat(d)
        except OSError:
            return False
        return st.st_uid == os.getuid() and st.st_mode & 0o177777 == 0o40700

    def named(code):            # co_filename, as compile(src, me) sets it
        return code.replace(co_filename=me, co_consts=tuple(
            named(c) if isinstance(c, type(code)) else c
            for c in code.co_consts))
    if ours():
        try:
            with open(path, "rb") as f:
                code = marshal.load(f)
            os.utime(path)
            if code.co_filename == me:
                return code
            if hasattr(code, "replace"):            # 3.8+
                return named(code)
        except (OSError, EOFError, ValueError, TypeError):
            pass
    code = compile(src, me, "exec", dont_inherit=True)
    try:
        os.mkdir(d, 0o700)
    except OSError:
        pass
    if ours():
        tmp = "%s.%d" % (path, os.getpid())
        try:
            for name in os.listdir(d):
                old = os.path.join(d, name)
                if os.lstat(old).st_mtime < time.time() - 3600:
                    os.unlink(old)
            with open(tmp, "wb") as f:
                marshal.dump(code, f)
            os.replace(tmp, path)
        except OSError:
            pass
    return code
"""
BOOT = CODE + r"""import sys, os
sys.argv[:2] = sys.argv[1:2]
if sys.path[:1] == [""]:
    sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
__file__, __cached__ = sys.argv[0], None
exec(_myq_tests_code(__file__, %r), globals())
""" % CODE_DIR


def myq_argv(python=None, path=MYQ):
    """The command that starts myq.py (or a copy at `path`; see BOOT):
    append its arguments."""
    if os.environ.get("TESTS_AS_SCRIPT"):
        return [python or sys.executable, path]
    return [python or sys.executable, "-c", BOOT, path]


def clean_env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYQ_")}
    env.update(extra or {})
    return env


def run_myq(*args, input=None, env=None, timeout=60, python=None,
            script=False):
    """myq.py as a real subprocess (the way an operator or a shell script
    runs it), without the caller's MYQ_* variables -> CompletedProcess
    (text).  `script`: `python myq.py` itself, not myq_argv's cached code."""
    return subprocess.run(
        ([python or sys.executable, MYQ] if script else myq_argv(python))
        + [str(a) for a in args],
        input=input, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True, env=clean_env(env), timeout=timeout)


def _as_text(data):
    """Bytes the way run_myq's text mode reads them (locale encoding,
    universal newlines)."""
    return io.TextIOWrapper(io.BytesIO(data),
                            encoding=locale.getpreferredencoding(False)).read()


def call_myq(*args, timeout=None):
    """`myq.main(args)` in this process -> a CompletedProcess like
    run_myq's: the same exit status, stdout and stderr, without starting an
    interpreter.  For a quick command (enqueue, stats, list, show, retry,
    delete, reap, prune, check...) where the test is about what the command
    does, not about the process (signals, stdin, interpreter start, the
    environment): those keep run_myq.  The caller's MYQ_* variables are
    hidden, as run_myq does.  `timeout` is accepted for run_myq's signature
    and ignored."""
    import myq
    argv = [str(a) for a in args]
    saved_env = {k: v for k, v in os.environ.items() if k.startswith("MYQ_")}
    saved_io = sys.stdin, sys.stdout, sys.stderr
    out, err = io.BytesIO(), io.BytesIO()
    try:
        for k in saved_env:
            del os.environ[k]
        sys.stdin = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(err, encoding="utf-8",
                                      errors="backslashreplace",
                                      write_through=True)
        rc = myq.main(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        stdout, stderr = out.getvalue(), err.getvalue()
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved_io
        for k in [k for k in os.environ if k.startswith("MYQ_")]:
            del os.environ[k]
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["myq"] + argv, rc, _as_text(stdout),
                                       _as_text(stderr))


def under(path, sub):
    """Is `path` directly inside the spool's sub-directory `sub` (a test's
    tmp_path lives under /tmp too, so no substring tests)?"""
    return os.path.dirname(path).endswith("/" + sub)


# wait_for's polls after its first second: a condition that takes long
# (a delay, a lease, a worker's start) is asked 10 times a second, not 50:
# each ask may read a spool or start a process (5 files' waits took 2.1 s
# of CPU at 50 a second throughout).
SLOW_POLL = 0.1


def wait_for(pred, timeout=15.0, interval=0.02, what="condition"):
    """pred()'s first true value, asked every `interval` for a second,
    then every SLOW_POLL (or `interval`, if longer) until `timeout`."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        value = pred()
        if value:
            return value
        now = time.monotonic()
        if now > deadline:
            raise AssertionError("timed out waiting for " + what)
        time.sleep(interval if now - start < 1.0 else max(interval, SLOW_POLL))


def count_ticks(w):
    """A Worker's poll ticks, counted: the list grows by one at each
    (_Scheduler._check_incoming, wrapped)."""
    ticks = []
    real = w.sched._check_incoming

    def tick():
        ticks.append(1)
        return real()
    w.sched._check_incoming = tick
    return ticks


def sql(spool, statement, args=()):
    """On a spool of the SQLite store: what `statement` returns (its rows;
    a write: committed, the rows it changed); on a spool of files: None."""
    db = os.path.join(spool, "queue.db")
    if not os.path.exists(db):
        return None
    import sqlite3
    con = sqlite3.connect(db, timeout=30)
    try:
        with con:
            cur = con.execute(statement, args)
            return cur.fetchall() if cur.description else cur.rowcount
    finally:
        con.close()



def sql_traced(monkeypatch):
    """The statements of every connection this process opens to a
    queue.db from now on, in order (sqlite3's trace callback)."""
    import myq
    seen = []
    real = myq._SqlDb._connect

    def connect(self, *a, **kw):
        db = real(self, *a, **kw)
        db.set_trace_callback(lambda s: seen.append(" ".join(s.split())))
        return db
    monkeypatch.setattr(myq._SqlDb, "_connect", connect)
    return seen


def sql_transactions(statements, what):
    """The write transactions among `statements` (sql_traced's) that hold
    a statement with `what` (a write alone is one; BEGIN ... COMMIT is
    one)."""
    n, open_, hit = 0, False, False
    for s in statements:
        word = s.split(" ", 1)[0].upper()
        if word == "BEGIN":
            open_, hit = True, False
        elif word in ("COMMIT", "END"):
            n += hit
            open_ = False
        elif word == "ROLLBACK":
            open_ = False
        elif word in ("UPDATE", "INSERT", "DELETE", "REPLACE") and what in s:
            if open_:
                hit = True
            else:
                n += 1
    return n


def states(spool, ids):
    """`myq show`'s state of each id."""
    return [json.loads(call_myq("--spool", spool, "show", i).stdout)["state"]
            for i in ids]


# A state's directory -> the status of its rows on an SQLite spool
STATUS_OF_DIR = {"incoming": "ready", "processing": "processing",
                 "done": "done", "dlq": "dead", "failed": "failed"}


def ls(spool, sub):
    """The names in SPOOL/SUB; on a spool of the SQLite store, a state's
    directory lists its rows as the files the file store would hold there
    (ID.json; incoming/: those of no lane, beside the drop box's files),
    so that a test that counts or names jobs runs on either store."""
    try:
        names = sorted(os.listdir(os.path.join(spool, sub)))
    except FileNotFoundError:
        names = []
    if sub == "incoming":           # (init makes incoming/lanes/: no job)
        names = [n for n in names if n != "lanes"]
    status = None if sub == "failed" else STATUS_OF_DIR.get(sub)
    rows = None if status is None else sql(
        spool, "SELECT id FROM jobs WHERE status=? AND (? OR lane='incoming')",
        (status, sub != "incoming"))
    return names if rows is None else sorted(names + [r[0] + ".json" for r in rows])


def has(spool, sub, jid):
    """Is job `jid` in SPOOL/SUB (ls's sense: on an SQLite spool, a row of
    that state)?"""
    return jid + ".json" in ls(spool, sub)


def read_job(spool, sub, jid):
    """The job `jid` of SPOOL/SUB as a dict (the file's first JSON value;
    on an SQLite spool, its row of that state as the file would hold it),
    or None where it is not."""
    import myq
    path = os.path.join(spool, sub, jid + ".json")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return myq.parse(f.read())[0]
    status = STATUS_OF_DIR.get(sub)
    rows = None if status is None else sql(
        spool, myq._SELECT + " WHERE id=? AND status=?", (jid, status))
    return myq._job_of_row(rows[0]) if rows else None


def one_line_error(cp):
    """Every error is ONE line on stderr."""
    err = cp.stderr.strip("\n")
    assert err, "expected an error message on stderr"
    assert "\n" not in err, "error is not one line: %r" % cp.stderr
    return err


def enqueue(run_myq, spool, type_, payload=None, *opts, **kw):
    args = ["--spool", spool, "enqueue", type_]
    if payload is not None:
        args.append(payload)
    cp = run_myq(*(args + list(opts)), **kw)
    assert cp.returncode == 0, (cp.returncode, cp.stderr)
    return cp.stdout.strip()


def show(run_myq, spool, job_id):
    cp = run_myq("--spool", spool, "show", job_id)
    assert cp.returncode == 0, (job_id, cp.returncode, cp.stderr)
    return json.loads(cp.stdout)


def state(run_myq, spool, job_id):
    return show(run_myq, spool, job_id)["state"]


def worker(run_myq, spool, *opts, handlers=None, mode="--drain", env=None,
           timeout=60, fast=True):
    args = ["--spool", spool, "worker"]
    if mode:
        args.append(mode)
    if handlers:
        args += ["--handlers", handlers]
    if fast:
        args += list(FAST)
    args += list(opts)
    return run_myq(*args, env=env, timeout=timeout)


def start_worker(spool, *opts, env=None, stderr=None, python=None):
    """A worker in the background (own session, so the test can kill it)."""
    return subprocess.Popen(
        myq_argv(python) + ["--spool", spool, "worker"] + list(opts),
        stdout=subprocess.DEVNULL,
        stderr=stderr if stderr is not None else subprocess.DEVNULL,
        env=clean_env(env), start_new_session=True)


def fill_disk(path):
    """Write path until the filesystem says ENOSPC."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (65536, 4096, 512, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)


def stop(proc, sig=signal.SIGTERM, timeout=15):
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def write_incoming(spool, name, obj, raw=None):
    """What a shell producer does: write in tmp/, then rename into incoming/."""
    tmp = os.path.join(spool, "tmp", name + ".part")
    data = raw if raw is not None else json.dumps(obj).encode()
    with open(tmp, "wb") as f:
        f.write(data)
    final = os.path.join(spool, "incoming", name)
    os.rename(tmp, final)
    return final


def blocking_handler(tmp_path):
    """sh body: touch started/$MYQ_JOB_ID, wait for the release file (deadline)."""
    started = tmp_path / "started"
    started.mkdir(exist_ok=True)
    release = tmp_path / "release"
    body = (
        'echo $$ > "%s/$MYQ_JOB_ID.pid"\n'
        'touch "%s/$MYQ_JOB_ID"\n'
        'i=0\n'
        'while [ ! -e "%s" ]; do\n'
        '  sleep 0.02; i=$((i+1))\n'
        '  if [ $i -gt 1500 ]; then exit 1; fi\n'
        'done\n'
        'echo "$MYQ_JOB_ID" >> "%s/finished"\n'
        'exit 0' % (started, started, release, tmp_path))
    return body, started, release


def procs_with_cmdline(argv):
    """pids whose argv is exactly `argv` (list of str)."""
    want = ("\0".join(argv) + "\0").encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                if f.read() == want:
                    found.append(int(pid))
        except OSError:
            pass
    return found


def kill_quiet(pid, sig=signal.SIGKILL):
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def world_python():
    """An interpreter that another user may run (pyenv's lives under /root)."""
    for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            real = os.path.realpath(p)
            if not os.stat(real).st_mode & 0o001:
                continue
            d = os.path.dirname(real)
            ok = True
            while d != "/":
                if not os.stat(d).st_mode & 0o001:
                    ok = False
                    break
                d = os.path.dirname(d)
            if ok:
                return p
        except OSError:
            pass
    return None


def free_port():
    """A TCP port of 127.0.0.1 that was free a moment ago (bound, closed)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def cmdline(pid, text=False):
    """The argv of a process ([] when it is gone); text=True: its words
    each followed by a space ("a b c "), for `" worker " in ...`."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            words = f.read().decode("utf-8", "replace").split("\0")[:-1]
    except OSError:
        words = []
    return "".join(w + " " for w in words) if text else words


# A clock that jumps for myq's processes: libfaketime preloaded into them.
# Realtime moves, monotonic does not, and files keep the times the kernel
# wrote (NO_FAKE_STAT), as after a real jump.
FT_BASE = {"FAKETIME_DONT_FAKE_MONOTONIC": "1", "NO_FAKE_STAT": "1"}


def _find_faketime():
    import glob
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1",
                    "/usr/lib/faketime/libfaketime.so.1",
                    "/usr/local/lib/faketime/libfaketime.so.1",
                    "/usr/lib64/faketime/libfaketime.so.1"):
        found = glob.glob(pattern)
        if found:
            return found[0]
    return None


FT_LIB = _find_faketime()


def ft_env(offset=None, rcfile=None):
    """The environment that moves a process's clock: by `offset` (libfaketime's
    "-365d", "@1970-01-02 01:00:00"), or as `rcfile` says at each call."""
    env = dict(FT_BASE, LD_PRELOAD=FT_LIB or "")
    if rcfile:
        env.update(FAKETIME_TIMESTAMP_FILE=str(rcfile), FAKETIME_NO_CACHE="1")
    else:
        env["FAKETIME"] = offset
    return env


_FT_WHY = []


def faketime_missing():
    """Why libfaketime cannot move a clock here (None: it can): not
    installed, or a year back not seen by a child's time.time() while its
    monotonic clock stays.  Checked once a process."""
    if not _FT_WHY:
        _FT_WHY.append(_faketime_check())
    return _FT_WHY[0]


def _faketime_check():
    import shutil
    if FT_LIB is None or shutil.which("faketime") is None:
        return "libfaketime is not installed (apt-get install faketime)"
    cp = subprocess.run(
        [sys.executable, "-c", "import time,select; select.select([],[],[],0.01);"
         "print(time.time(), time.monotonic())"],
        stdout=subprocess.PIPE, env=clean_env(ft_env("-365d")),
        universal_newlines=True, timeout=30)
    try:
        t, m = map(float, cp.stdout.split())
    except ValueError:
        return "libfaketime does not work here: %r" % cp.stdout
    if abs(time.time() - 365 * 86400 - t) > 60 or abs(time.monotonic() - m) > 60:
        return "libfaketime does not fake the clock as expected here"
    return None


def needs_faketime(test):
    """The test, skipped (saying why) where libfaketime cannot move a clock."""
    import pytest
    why = faketime_missing()
    return pytest.mark.skipif(why is not None, reason=why or "")(test)


def environ(pid):
    """The environment a process started with ({} when it is gone)."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode("utf-8", "replace").partition("=")[::2]
                for i in items if i)


def drain(spool, *opts, handlers=None, env=None, timeout=60, log=None):
    """`myq worker --drain` as a subprocess, FAST's settings then `opts`
    (and `--log log`), run to its end: it must exit 0."""
    if log:
        opts = ("--log", str(log)) + opts
    cp = worker(run_myq, spool, *opts, handlers=handlers, env=env,
                timeout=timeout)
    assert cp.returncode == 0, cp.stderr
    return cp


def quiet_log():
    """A myq.Log that writes nowhere, for a worker run in this process."""
    import myq
    return myq.Log(stream=open(os.devnull, "w"))


def drain_here(spool, handlers, **kw):
    """A worker in this process, with these Python handlers ({type: fn}),
    quiet, until nothing is ready (poll 0.05 s, no jitter; **kw: Worker's
    other keywords)."""
    import myq
    kw.setdefault("log", quiet_log())
    myq.Worker(spool, handlers=handlers, poll=0.05, jitter=0,
               **kw).run(drain=True)


# A running worker picks up a change of policy within a couple of seconds:
# PICKUP, and PICKUP_DEADLINE where the machine is loaded.
PICKUP = 2.0
PICKUP_DEADLINE = 4.5


def cli(spool, *args):
    """`myq --spool SPOOL ARGS...` in this process (call_myq)."""
    return call_myq("--spool", spool, *args)


def ok(cp):
    """cp, which must have exited 0 (its command and output in the failure)."""
    assert cp.returncode == 0, (cp.args, cp.returncode, cp.stdout, cp.stderr)
    return cp


def stats(spool):
    """`myq stats --json`, read."""
    return json.loads(ok(cli(spool, "stats", "--json")).stdout)


def waiting(spool, type_=None):
    """Ids of the waiting jobs (ready + scheduled) of `type_`."""
    out = []
    for st in ("ready", "scheduled"):
        cp = ok(cli(spool, "list", st, "--json", *(("--type", type_) if type_ else ())))
        out += [json.loads(l)["id"] for l in cp.stdout.splitlines() if l.strip()]
    return sorted(out)


def dead_error(spool, jid):
    """The last error of a job that must be dead."""
    job = show(call_myq, spool, jid)
    assert job["state"] == "dead", job
    return job["last_error"] or ""


def http_job(spool, url, *opts):
    """A job of the built-in http type to `url`; its id."""
    return enqueue(call_myq, spool, "http", json.dumps({"url": url}), *opts)


def policy(spool, *args):
    """`myq policy ARGS...` in this process; it must exit 0."""
    return ok(cli(spool, "policy", *args))


def listed(spool, state):
    """`myq list STATE --json`, read: one dict a job."""
    cp = ok(cli(spool, "list", state, "--json"))
    return [json.loads(line) for line in cp.stdout.splitlines()]


@contextlib.contextmanager
def ext4_image(tmp_path, size=64 << 20, block=4096):
    """A fresh ext4 filesystem in an image on a loop device (`block`: its
    block size, None: mkfs.ext4's for the size), mounted: (mount point,
    its device), unmounted at the end.  Root only: the test is skipped,
    saying why, where it cannot be had."""
    import shutil
    import pytest
    if os.geteuid() != 0:
        pytest.skip("mounting an ext4 image on a loop device needs root")
    if not shutil.which("mkfs.ext4"):
        pytest.skip("mkfs.ext4 is missing (apt-get install e2fsprogs)")
    img, mnt = str(tmp_path / "img"), str(tmp_path / "mnt")
    os.mkdir(mnt)
    with open(img, "wb") as f:
        f.truncate(size)
    subprocess.check_call(["mkfs.ext4", "-q", "-F"] + (
        ["-b", str(block)] if block else []) + [
        "-E", "lazy_itable_init=0,lazy_journal_init=0", img])
    cp = subprocess.run(["mount", "-o", "loop", img, mnt],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        universal_newlines=True)
    if cp.returncode:
        pytest.skip("cannot mount a loop device here: %s" % cp.stdout.strip())
    try:
        dev = subprocess.check_output(["findmnt", "-n", "-o", "SOURCE", mnt],
                                      universal_newlines=True).strip()
        assert dev.startswith("/dev/loop"), dev     # (not a stale mount)
        yield mnt, dev
    finally:
        subprocess.call(["umount", mnt])


def listening(spool):
    """Whether a worker listens on the spool's wake FIFO (locks/wake)."""
    try:
        fd = os.open(os.path.join(spool, "locks", "wake"),
                     os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    os.close(fd)
    return True
