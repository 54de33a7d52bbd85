"""Process helpers for the tests that kill real processes (liveness,
timeouts and shutdown, clocks, chaos): /proc inspection, a handler that
holds its job until the test releases it, and a registry that cleans up
every process a test started, whatever happened.

Waiting is always "poll a condition until a deadline" (`_core.wait_for`).
"""
import json
import os
import signal
import subprocess
import time

from _core import (ROOT, call_myq, clean_env, enqueue, kill_quiet, myq_argv,
                   state, wait_for)


def proc_stat(pid):
    """(state, ppid, pgid, start) from /proc/PID/stat, or None."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(b")") + 2:].split()
    return rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[19])


def proc_start(pid):
    st = proc_stat(pid)
    return st and st[3]


def alive(pid):
    """True while the process exists and is not a zombie."""
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def wait_gone(pid, timeout=10.0, what=None):
    wait_for(lambda: not alive(pid), timeout=timeout,
             what=what or "pid %d to be gone" % pid)


def children(ppids):
    """{pid: ppid} of the processes whose parent is in `ppids`."""
    ppids = set(ppids)
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = proc_stat(int(name))
        if st and st[1] in ppids and st[0] not in ("Z", "X"):
            out[int(name)] = st[1]
    return out


def job_of(pid):
    """MYQ_JOB_ID from a handler's environment, or None."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"MYQ_JOB_ID="):
            return kv[len(b"MYQ_JOB_ID="):].decode()
    return None


def read_pid(path, timeout=15.0):
    """A pid written by a handler (wait until the file has a whole line)."""
    def get():
        try:
            with open(str(path)) as f:
                text = f.read()
        except OSError:
            return None
        return int(text) if text.endswith("\n") and text.strip() else None
    return wait_for(get, timeout=timeout, what="pid file %s" % path)


def lines(path):
    try:
        with open(str(path)) as f:
            return f.read().split("\n")[:-1]
    except FileNotFoundError:
        return []


def holding_handler(tmp):
    """sh body of a handler that holds its job: it writes $$ to
    T/ID.pid, starts a `sleep 1000` grandchild (pid in T/ID.gc), appends
    "ID ATTEMPT" to T/runs, waits for T/release (60 s cap, then exit 1),
    then kills its grandchild and appends ID to T/effects."""
    return r'''T='%s'
echo $$ > "$T/$MYQ_JOB_ID.pid"
sleep 1000 >/dev/null 2>&1 </dev/null &
echo $! > "$T/$MYQ_JOB_ID.gc"
echo "$MYQ_JOB_ID $MYQ_ATTEMPT" >> "$T/runs"
i=0
while [ ! -e "$T/release" ]; do
  sleep 0.05; i=$((i+1)); [ $i -gt 1200 ] && exit 1
done
kill $! 2>/dev/null
echo "$MYQ_JOB_ID" >> "$T/effects"
exit 0''' % tmp


class Procs(object):
    """Starts workers and other processes; kills whatever is left at the end
    (process groups of workers, and pids the handlers wrote down)."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.procs = []
        self.pids = []

    def worker(self, spool, *opts, env=None, log=None, prefix=()):
        """`myq worker` in its own session; stderr to `log` (a path) if
        given.  `prefix` is put before the interpreter (e.g. faketime)."""
        err = open(str(log), "ab") if log else subprocess.DEVNULL
        try:
            p = subprocess.Popen(
                list(prefix) + myq_argv() + ["--spool", spool, "worker"]
                + [str(o) for o in opts],
                stdout=subprocess.DEVNULL, stderr=err, env=clean_env(env),
                start_new_session=True)
        finally:
            if log:
                err.close()
        self.procs.append(p)
        return p

    def spawn(self, argv, **kw):
        p = subprocess.Popen(argv, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def track(self, pid):
        self.pids.append(pid)

    def cleanup(self):
        for p in self.procs:
            if p.poll() is None:
                kill_quiet(p.pid, signal.SIGCONT)
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    kill_quiet(p.pid)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        # Handlers and their grandchildren: every pid a handler wrote down.
        for name in os.listdir(str(self.tmp)):
            if name.endswith((".pid", ".gc")):
                try:
                    pid = int(open(os.path.join(str(self.tmp), name)).read())
                except (OSError, ValueError):
                    continue
                self.pids.append(pid)
        for pid in self.pids:
            if alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
                kill_quiet(pid)


def reap(run_myq, spool, env=None, prefix=None):
    """`myq reap` -> number requeued (asserting exit 0 and the format)."""
    cp = run_myq("--spool", spool, "reap", env=env)
    assert cp.returncode == 0, cp.stderr
    out = cp.stdout.strip()
    assert out.startswith("requeued="), out
    return int(out.split("=", 1)[1])


def job_file(spool, sub, jid):
    with open(os.path.join(spool, sub, jid + ".json"), "rb") as f:
        return json.loads(f.read().split(b"\n", 1)[0])


def mono():
    return time.monotonic()


# A recording handler: each start of its runs written down

def rec_handler(handlers_dir, tmp_path, name, body="exit 0"):
    """Exec handler `name`: appends `ID ATTEMPT EPOCH` to T/starts when it
    starts, then runs `body`."""
    return handlers_dir(name, 'echo "$MYQ_JOB_ID $MYQ_ATTEMPT $(date +%%s.%%N)"'
                        ' >> "%s/starts"\n%s' % (tmp_path, body))


def starts(tmp_path):
    """[(id, attempt, epoch)] in the order the handler runs started."""
    out = []
    for l in lines(tmp_path / "starts"):
        jid, att, ts = l.split()
        out.append((jid, int(att), float(ts)))
    return out


def started_ids(tmp_path):
    return [s[0] for s in starts(tmp_path)]


def bg_worker(procs, tmp_path, spool, *opts, name="w"):
    """A worker in the background logging to T/NAME.log, once it started."""
    log = tmp_path / (name + ".log")
    w = procs.worker(spool, *opts, log=log)
    wait_for(lambda: log.exists() and "event=start worker=" in log.read_text(),
             what="worker %s to start" % name)
    return w, log


def run_sentinel(spool, tmp_path, timeout=15):
    """Enqueue a job of type `sentinel` (its handler must exist) and wait
    until it is done: proof that the worker scanned incoming/ since."""
    jid = enqueue(call_myq, spool, "sentinel")
    wait_for(lambda: state(call_myq, spool, jid) == "done", timeout=timeout,
             what="the sentinel job to run")
    return jid


def worker_killed_by_its_hook(code, spool, *opts):
    """A worker started as `python -c code --spool SPOOL worker OPTS` (the
    code sets myq._hook to SIGKILL itself at a step): waited for, killed
    for good after 60 s, and it must have died by that SIGKILL."""
    import sys
    w = subprocess.Popen(
        [sys.executable, "-c", code, "--spool", spool, "worker"] + list(opts),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=clean_env(),
        start_new_session=True)
    try:
        w.wait(60)
    finally:
        if w.poll() is None:
            os.killpg(w.pid, signal.SIGKILL)
            w.wait(10)
    assert w.returncode == -signal.SIGKILL, w.stderr.read()


# A worker whose myq.NAME, or myq.CLASS.NAME, kills it (-9) before its
# call or after it returns (worker_killed_around).
_KILL_AROUND = r"""
import os, signal, sys
sys.path.insert(0, %(root)r)
import myq
owner = getattr(myq, %(cls)r) if %(cls)r else myq
real = getattr(owner, %(name)r)
def cut(*a, **kw):
    if %(when)r == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    out = real(*a, **kw)
    os.kill(os.getpid(), signal.SIGKILL)
    return out
setattr(owner, %(name)r, cut)
sys.exit(myq.main(sys.argv[1:]))
"""


def worker_killed_around(what, when, spool, *opts):
    """worker_killed_by_its_hook of a worker that kills itself at myq's
    `what` ("_sql_claim_many", "_SqlClaims.complete"): "before" its call
    or "after" it returns."""
    cls, _, name = what.rpartition(".")
    worker_killed_by_its_hook(_KILL_AROUND % {
        "root": ROOT, "cls": cls, "name": name, "when": when}, spool, *opts)
