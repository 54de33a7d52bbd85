#!/usr/bin/env python3
"""myq benchmark: every figure next to its floor, measured in the same run
on the same filesystem, as ratios; medians over --runs runs (at least 3).

    python3 bench/run.py [--quick] [--runs N] [--dir PATH] [--shm PATH]
                         [--fs ext4,tmpfs] [--json FILE] [--markdown]

`make bench` runs it.  Standard library only.  It runs on two filesystems:
a disk (`--dir`, default a directory under /var/tmp, /tmp or the repository,
whichever is on a disk) and tmpfs (`--shm`, default /dev/shm).  All its
files live under one temporary directory on each, removed at the end.

What is measured (per filesystem, per run; the floor is measured in the same
run, interleaved with the figure, so that a noisy machine hits both alike):

- enqueue, durable: `myq.enqueue()` and `Spool.enqueue()` against a bare
  loop doing only the protocol's syscalls (create in tmp/ O_EXCL, write,
  rename into incoming/, fsync, close, fsync incoming/); `Spool.enqueue_many`
  in batches of 100 against the same loop as a batch does it (each file's
  writeback started after its rename, the fsyncs after the batch's last
  rename, one directory fsync a batch).
- drain, no-op --module style handler (Worker(spool, handlers={"noop": fn})
  .run(drain=True) in a child process; the time is that of run()), 1,000 jobs,
  against a bare loop: listdir, then per job rename into processing/, read
  it, rename into done/; one fsync of done/ per 64 jobs.
- drain with 100,000 jobs queued: the per-job rate over the first K jobs
  (the child stops itself with SIGTERM after K), against the 1,000-job
  drain of the same run.  K (6,000; 3,000 with --quick) spans several
  refills of the worker's 2,048-entry scan cache; a second row leaves out
  the first K/6 jobs (and with them the worker's first scan).  A third row
  drains the bare floor loop over the first K of another 100,000-file
  spool, against its own 1,000-job rate: how much the filesystem itself
  slows down at that depth.
  The deep spools are prepared once and topped up to 100,000 between runs.
  Prepared job files are written without fsync, then os.sync() runs before
  any timing, so no drain pays for the preparation's writeback.
- claim rate with priorities in use (SPEC 9): one worker, no-op handler,
  100,000 jobs queued of which 1,000 carry a priority spread over -3..5
  (enqueued with Spool.enqueue_many, so that their priority counts from
  the start; the rest 0, written as above), the rate over the first K jobs
  (as above) against the same
  100,000 without priorities, the two drained in alternating order within
  each run.  The handler records the order; a run whose jobs did not start
  highest priority first is flagged.  --quick: 20,000 queued (200 with a
  priority), first 3,000.
- exec drain: a handlers dir whose `t` is /bin/true, against a bare loop of
  subprocess.Popen(["/bin/true"], stdin=PIPE), write the payload, wait (in a
  child process of the same interpreter), interleaved in 4 chunks because
  fork/exec time swings with the load; --concurrency 4 from one worker
  against the same loop with 4 in flight; 2 worker processes on one spool
  (no-op handler that records each id) against the 1-process drain, with a
  check that every job ran exactly once.
- memory: VmRSS/VmHWM of an idle `myq worker` (installed as `make install`
  lays it out: a launcher that imports myq.py and its .pyc) and of one with
  1,000 and 100,000 jobs queued (scheduled a day ahead, so the worker scans
  them but runs none), against a bare interpreter that imports the same
  modules, myq from the same .pyc (the list is read with -X importtime from
  a real worker); and an idle worker run from myq.py as a script (the
  one-file copy, compiled at every start) against an installed one started
  beside it on the same empty spool.  A script gives back the parser's
  memory as it starts (see "Run as a script" in myq.py); what stays is
  the fragmentation of pymalloc's arenas by the compile, ~1 MiB on Python
  3.7-3.9 and ~3-4 MiB on 3.10+ (1 MiB arenas).
- idle CPU: CPU seconds an idle `myq worker` uses (schedstat, ns) over 60 s
  (10 s with --quick, extrapolated to a minute); it runs in the background
  while the rest of the run goes on.
- latency from `myq.enqueue()` to the handler's start in an idle worker
  (woken through the FIFO locks/wake), p50 and p99; the floor column shows
  the enqueue() call itself (the durable write).
- `myq enqueue` process wall time against `python3 -I -c 'import json'`:
  installed (`make install`: launcher + cached .pyc) and as a copied script
  (the interpreter is sys.executable, never a shim).
- per job on the success path, counted through `myq._hook`: fsync calls,
  bytes written to spool files, how often the job body is written; checked
  once against `strace -f -c` when strace is installed.
"""

import argparse
import collections
import json
import os
import platform
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MYQ = os.path.join(ROOT, "myq.py")
PY = sys.executable
MiB = 1024.0 * 1024.0

FULL = dict(enq_disk=150, enq_mem=1500, many_disk=300, many_mem=3000,
            batch=100, drain=1000, deep=100000, take=6000,
            prio_deep=100000, prio_n=1000, prio_take=6000, exec_n=200,
            conc_n=240, two_n=2000, lat_n=60, wall_n=10, idle_window=60.0,
            count_bulk=100, count_trickle=10)
QUICK = dict(enq_disk=40, enq_mem=400, many_disk=200, many_mem=1000,
             batch=100, drain=300, deep=100000, take=3000,
             prio_deep=20000, prio_n=200, prio_take=3000, exec_n=60,
             conc_n=120, two_n=600, lat_n=20, wall_n=5, idle_window=10.0,
             count_bulk=40, count_trickle=5)

mono = time.monotonic
clock = time.perf_counter


def log(msg):
    sys.stderr.write("bench: %s\n" % msg)
    sys.stderr.flush()


def child_env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYQ_")}
    env.pop("PYTHONPATH", None)
    env.update(extra or {})
    return env


# Machine and filesystem ######################################################

def fstype(path):
    """(fstype, device, mountpoint) of the mount holding path."""
    path = os.path.realpath(path)
    best = ("?", "?", "")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) \
                        and len(mnt) >= len(best[2]):
                    best = (typ, dev, mnt)
    except OSError:
        pass
    return best


def pick_disk_dir():
    for cand in ("/var/tmp", "/tmp", ROOT):
        if os.path.isdir(cand) and os.access(cand, os.W_OK) and \
                fstype(cand)[0] not in ("tmpfs", "ramfs", "overlay", "?"):
            return cand
    return tempfile.gettempdir()


def machine():
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
        "python": "%s (%s)" % (platform.python_version(), PY),
        "date": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()),
        "loadavg": open("/proc/loadavg").read().split()[:3],
        "myq": myq_id(),
    }


def myq_id():
    """Which myq.py was measured: version, sha256 prefix, git commit."""
    import hashlib
    with open(MYQ, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              universal_newlines=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--",
                                "myq.py"], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL,
                               universal_newlines=True).stdout.strip()
    except OSError:
        head, dirty = "", ""
    return "myq %s, myq.py sha256 %s, git %s%s" % (
        getattr(myq(), "__version__", "?"), digest, head or "?",
        " (myq.py modified)" if dirty else "")


# /proc readings ##############################################################

def proc_status(pid="self"):
    out = {}
    with open("/proc/%s/status" % pid) as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


def cpu_ns(pid):
    """CPU time of every thread of pid, in ns (schedstat), or from the tick
    counters of /proc/PID/stat when schedstat is missing."""
    total, seen = 0, False
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            try:
                with open("/proc/%d/task/%s/schedstat" % (pid, tid)) as f:
                    total += int(f.read().split()[0])
                    seen = True
            except (OSError, ValueError, IndexError):
                pass
    except OSError:
        pass
    if seen:
        return total
    with open("/proc/%d/stat" % pid) as f:
        data = f.read()
    fields = data[data.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) * 1e9 / os.sysconf("SC_CLK_TCK")


def settle(pid, min_s=1.0, quiet=0.6, max_s=60.0):
    """Wait until the process has used (almost) no CPU for `quiet` s."""
    t0 = mono()
    last, last_busy = cpu_ns(pid), mono()
    while True:
        time.sleep(0.1)
        c, now = cpu_ns(pid), mono()
        if c - last > 3e6:
            last_busy = now
        last = c
        if now - t0 >= min_s and now - last_busy >= quiet:
            return now - t0
        if now - t0 > max_s:
            return now - t0


# Processes this bench started (ended by pid, never by name) ##################

PROCS = []


def start(cmd, **kw):
    kw.setdefault("env", child_env())
    p = subprocess.Popen(cmd, **kw)
    PROCS.append(p)
    return p


def stop(p, timeout=30):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if p in PROCS:
        PROCS.remove(p)


def stop_all():
    for p in list(PROCS):
        try:
            stop(p, 5)
        except Exception:
            pass


# Spools and jobs #############################################################

_myq = None


def myq():
    global _myq
    if _myq is None:
        sys.path.insert(0, ROOT)
        import myq as m
        _myq = m
    return _myq


_serial = [0]


def new_spool(base, name):
    _serial[0] += 1
    path = os.path.join(base, "%s-%d" % (name, _serial[0]))
    myq().Spool(path).init()
    return path


JOB_TPL = ('{"id":"%s","type":"%s","payload":{"n":%d},"attempts":0,'
           '"available_at":%r,"created_at":%r,"updated_at":%r,'
           '"last_error":null}\n')


def make_jobs(spool, n, type="noop", delay=0.0, into="incoming"):
    """Write n ready (or scheduled) job files straight into incoming/,
    as a fast producer would (no fsync); ids sort in creation order."""
    d = os.path.join(spool, into)
    now = time.time()
    at = now + delay
    ms = int(now * 1000)
    salt = random.getrandbits(20)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for i in range(n):
        jid = "%013d-%05x%07x" % (ms, salt, i)
        path = os.path.join(d, jid + ".json")
        fd = os.open(path, flags, 0o640)
        os.write(fd, (JOB_TPL % (jid, type, i, at, now, now)).encode())
        os.close(fd)
        if delay:
            os.utime(path, (at, at))


def count(path):
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


def count_jobs(path):
    """Job files under incoming/, in any sub-directory (lane, SPEC 9) too."""
    return sum(1 for _, _, fs in os.walk(path) for n in fs if n.endswith(".json"))


# Priorities (SPEC 9): a job's priority is in its id, `…-p5`, `…-pn3`, so
# that a spool can be topped up and an order checked without reading files.
PRIO_LEVELS = list(range(-3, 6))


def prio_tag(p):
    return "-pn%d" % -p if p < 0 else "-p%d" % p


def prio_of(jid):
    tag = jid.rsplit("-p", 1)[1]
    return -int(tag[1:]) if tag.startswith("n") else int(tag)


def make_prio_jobs(spool, prios):
    """One ready job per entry of `prios` (its priority), ids in creation
    order: priority 0 as make_jobs writes them (a producer's files), the
    others through Spool.enqueue_many (sync=False; os.sync() follows), so
    that their priority counts from the start (SPEC 9: a producer's file
    counts with its priority only once a worker has read it)."""
    d = os.path.join(spool, "incoming")
    now = time.time()
    ms = int(now * 1000)
    salt = random.getrandbits(20)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    specs = []
    for i, p in enumerate(prios):
        jid = "%013d-%05x%07x%s" % (ms, salt, i, prio_tag(p))
        if p:
            specs.append({"type": "noop", "payload": {"n": i}, "id": jid,
                          "priority": p})
            continue
        fd = os.open(os.path.join(d, jid + ".json"), flags, 0o640)
        os.write(fd, (JOB_TPL % (jid, "noop", i, now, now, now)).encode())
        os.close(fd)
    sp = myq().Spool(spool)
    for k in range(0, len(specs), 500):
        sp.enqueue_many(specs[k:k + 500], sync=False)


def clear_dir(path):
    for name in os.listdir(path):
        try:
            os.unlink(os.path.join(path, name))
        except OSError:
            pass


def percentile(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# Floors: bare loops of the protocol's syscalls ###############################

def floor_enqueue(d, n, data, batch=1, seq=[0]):
    """create tmp/ O_EXCL, write, rename into incoming/, fsync, close,
    fsync incoming/ (once per `batch`): myq's enqueue protocol (the file's
    fsync after its rename: one journal commit on ext4).  With batch > 1,
    as enqueue_many: each file's writeback started (posix_fadvise
    DONTNEED) after its rename, the fsyncs after the batch's last rename.
    Returns seconds."""
    tmp, inc = os.path.join(d, "tmp"), os.path.join(d, "incoming")
    dfd = os.open(inc, os.O_RDONLY | os.O_DIRECTORY)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    later = []
    t = clock()
    for i in range(n):
        seq[0] += 1
        name = "f%09d" % seq[0]
        p = os.path.join(tmp, name + ".new")
        fd = os.open(p, flags, 0o640)
        os.write(fd, data)
        os.rename(p, os.path.join(inc, name + ".json"))
        if batch > 1:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            later.append(fd)
        else:
            os.fsync(fd)
            os.close(fd)
        if (i + 1) % batch == 0 or i == n - 1:
            for fd in later:
                os.fsync(fd)
                os.close(fd)
            del later[:]
            os.fsync(dfd)
    t = clock() - t
    os.close(dfd)
    return t


def floor_drain(d, limit=None):
    """listdir incoming/; per job (the first `limit`): rename into
    processing/, open+read+close, rename into done/; fsync done/ every 64
    jobs and at the end."""
    inc, proc, done = (os.path.join(d, s) for s in ("incoming", "processing", "done"))
    dfd = os.open(done, os.O_RDONLY | os.O_DIRECTORY)
    t = clock()
    names = [n for n in os.listdir(inc) if n.endswith(".json")][:limit]
    for i, name in enumerate(names):
        p = os.path.join(proc, name)
        os.rename(os.path.join(inc, name), p)
        fd = os.open(p, os.O_RDONLY)
        os.read(fd, 65536)
        os.close(fd)
        os.rename(p, os.path.join(done, name))
        if i % 64 == 63:
            os.fsync(dfd)
    os.fsync(dfd)
    t = clock() - t
    os.close(dfd)
    return len(names), t


# Child processes (same interpreter): python3 bench/run.py _child MODE ARGS ####

def child_main(mode, args):
    a = json.loads(args)
    if mode == "drain":
        return child_drain(a)
    if mode == "spawn":
        return child_spawn(a)
    if mode == "count":
        return child_count(a)
    raise SystemExit("unknown child mode %s" % mode)


def child_drain(a):
    m = myq()
    done = [0]
    rec = open(a["record"], "a") if a.get("record") else None
    stop_after = a.get("stop_after") or 0
    mark_at = a.get("mark_at") or 0
    marks = {}

    def noop(job):
        done[0] += 1
        if rec is not None:
            rec.write(job["id"] + "\n")
        if done[0] == mark_at:
            marks["tM"] = mono()
        if stop_after and done[0] == stop_after:
            marks["tK"] = mono()
            os.kill(os.getpid(), signal.SIGTERM)

    w = m.Worker(a["spool"], handlers={"noop": noop},
                 handlers_dir=a.get("handlers_dir"),
                 concurrency=a.get("concurrency", 1),
                 log=m.Log(path=a["log"]))
    if a.get("go"):
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        sys.stdin.readline()
    t0 = mono()
    w.run(drain=True)
    t1 = mono()
    if rec is not None:
        rec.close()
    st = proc_status()
    sys.stdout.write(json.dumps(dict(t0=t0, t1=t1, done=done[0], rss=st["VmRSS"],
                                     hwm=st["VmHWM"], **marks)) + "\n")


def child_spawn(a):
    payload = json.dumps({"n": 1}).encode() + b"\n"
    n, conc = a["n"], a.get("conc", 1)
    active = []
    t = clock()
    for i in range(n):
        if len(active) >= conc:
            active.pop(0).wait()
        p = subprocess.Popen(["/bin/true"], stdin=subprocess.PIPE)
        try:
            p.stdin.write(payload)
            p.stdin.close()
        except BrokenPipeError:
            pass
        active.append(p)
    for p in active:
        p.wait()
    t = clock() - t
    sys.stdout.write(json.dumps({"n": n, "t": t}) + "\n")


def child_count(a):
    """Count the mutating steps of the success path through myq._hook."""
    m = myq()
    cur = {}
    sizes = {}

    def hook(op, path, when):
        if when == "before":
            if op == "append":
                try:
                    sizes[path] = os.stat(path).st_size
                except OSError:
                    sizes[path] = 0
            return
        cur[op] = cur.get(op, 0) + 1
        if op == "fsync":
            k = "fsync_dir" if path.endswith("/") else "fsync_file"
            cur[k] = cur.get(k, 0) + 1
        elif op == "write":
            n = os.stat(path).st_size
            cur["bytes"] = cur.get("bytes", 0) + n
            if os.path.basename(os.path.dirname(path)) == "tmp" and \
                    path.endswith(".new"):
                cur["body_writes"] = cur.get("body_writes", 0) + 1
        elif op == "append":
            try:
                n = os.stat(path).st_size - sizes.pop(path, 0)
            except OSError:
                n = 0
            cur["bytes"] = cur.get("bytes", 0) + n

    m._hook = hook
    out = {}

    def worker(sp, logpath):
        return m.Worker(sp, handlers={"noop": lambda job: None},
                        log=m.Log(path=logpath))

    def scenario(name, fn, jobs):
        cur.clear()
        logpath = os.path.join(a["base"], "count-%s.log" % name)
        fn(logpath)
        out[name] = dict(cur, jobs=jobs,
                         log_bytes=os.path.getsize(logpath) if os.path.exists(logpath) else 0)

    sp = getattr(m, 'open_store', m.Spool)(os.path.join(a["base"], "count-bulk")).init()

    def bulk(logpath):
        for i in range(a["bulk"]):
            sp.enqueue("noop", {"n": i})
        worker(sp, logpath).run(drain=True)
    scenario("bulk", bulk, a["bulk"])

    sp2 = getattr(m, 'open_store', m.Spool)(os.path.join(a["base"], "count-trickle")).init()

    def trickle(logpath):
        # One job at a time into an idle, long-running worker: each job is
        # committed alone (the worker runs in a thread; a test stops it).
        import threading
        w = worker(sp2, logpath)
        t = threading.Thread(target=w.run)
        t.start()
        # the worker is idle before the first job: what it fsyncs to start
        # (its record in locks/workers/) is not the jobs'
        workers = os.path.join(sp2.path, "locks", "workers")
        deadline = mono() + 30
        while not os.listdir(workers) and mono() < deadline:
            time.sleep(0.002)
        cur["start_fsync"] = cur.get("fsync", 0)    # (fsync'd, then named)
        done = os.path.join(sp2.path, "done")
        for i in range(a["trickle"]):
            sp2.enqueue("noop", {"n": i})
            deadline = mono() + 30
            while count(done) < i + 1 and mono() < deadline:
                time.sleep(0.002)
            deadline = mono() + 30      # and let it go idle (its commit)
            while w.finish._pending and mono() < deadline:
                time.sleep(0.002)
        w.stopping = True
        sp2.poke()
        t.join(30)
    scenario("trickle", trickle, a["trickle"])

    sp3 = getattr(m, 'open_store', m.Spool)(os.path.join(a["base"], "count-batch")).init()

    def batch(logpath):
        b = a["batch"]
        for k in range(0, a["bulk"], b):
            sp3.enqueue_many([{"type": "noop", "payload": {"n": i}}
                              for i in range(k, min(k + b, a["bulk"]))])
        worker(sp3, logpath).run(drain=True)
    scenario("batch", batch, a["bulk"])
    # the size of one job body as enqueued
    out["body_bytes"] = len(m.dumps(m.new_job("noop", {"n": 1})))
    sys.stdout.write(json.dumps(out) + "\n")


def run_child(mode, args, timeout=600, **kw):
    p = start([PY, os.path.abspath(__file__), "_child", mode, json.dumps(args)],
              stdout=subprocess.PIPE, universal_newlines=True, cwd=ROOT, **kw)
    out, _ = p.communicate(timeout=timeout)
    PROCS.remove(p)
    if p.returncode != 0:
        raise RuntimeError("child %s failed (exit %s)" % (mode, p.returncode))
    return json.loads(out.strip().splitlines()[-1])


# The bench ###################################################################

class Results(object):
    def __init__(self):
        self.data = {}          # (fs, key) -> {"value": [], "floor": [], "ratio": []}
        self.notes = []

    def add(self, fs, key, value, floor=None, ratio=None):
        d = self.data.setdefault((fs, key), {"value": [], "floor": [], "ratio": []})
        d["value"].append(value)
        if floor is not None:
            d["floor"].append(floor)
        if ratio is None and floor:
            ratio = value / floor
        if ratio is not None:
            d["ratio"].append(ratio)


class Bench(object):
    def __init__(self, opts, sizes):
        self.o, self.s = opts, sizes
        self.res = Results()
        self.bases = {}
        self.shared = {}         # per fs: spools kept across runs
        self.modules = None

    # helpers ------------------------------------------------------------

    def files(self, base):
        """Handler module files and the exec handlers dir under base."""
        noop = os.path.join(base, "noop.py")
        if not os.path.exists(noop):
            with open(noop, "w") as f:
                f.write("def noop(job):\n    pass\n")
            with open(os.path.join(base, "lat.py"), "w") as f:
                f.write("import os, time\n_fd = int(os.environ['BENCH_LAT_FD'])\n\n"
                        "def lat(job):\n    os.write(_fd, ('%s %.9f\\n' % (job['id'], "
                        "time.monotonic())).encode())\n")
            hd = os.path.join(base, "handlers")
            os.mkdir(hd)
            os.symlink("/bin/true", os.path.join(hd, "t"))
            os.mkdir(os.path.join(base, "logs"))
        return noop, os.path.join(base, "lat.py"), os.path.join(base, "handlers")

    def logf(self, base, name):
        return os.path.join(base, "logs", "%s-%d.log" % (name, _serial[0]))

    def install(self, base):
        """myq as `make install` lays it out, under base/inst: the launcher
        bin/myq imports lib/myq/myq.py and its cached .pyc.  Returns
        (launcher, lib dir)."""
        import importlib.util
        prefix = os.path.join(base, "inst")
        lib = os.path.join(prefix, "lib", "myq")
        launcher = os.path.join(prefix, "bin", "myq")
        if not os.path.exists(launcher):
            spec = importlib.util.spec_from_file_location(
                "myq_dist", os.path.join(ROOT, "build", "dist.py"))
            dist = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(dist)
            dist.write(os.path.join(lib, "myq.py"), dist.read("myq.py"), 0o644)
            dist.compile_pyc(os.path.join(lib, "myq.py"))
            dist.write(launcher, dist.launcher(prefix), 0o755)
        return launcher, lib

    def cli_worker(self, spool, base, module, extra_env=None, script=False, **kw):
        """A real `myq worker`: installed (launcher + .pyc), or myq.py run as
        a script: the one-file copy, a fresh one in its own directory, with
        Python's default of writing byte code (PYTHONDONTWRITEBYTECODE
        unset), as a user's copy runs: it compiles at start, and a worker
        then runs itself again from the byte code it cached."""
        prog = self.install(base)[0]
        if script:
            d = os.path.join(base, "onefile-%d" % len(os.listdir(base)))
            os.mkdir(d)
            prog = os.path.join(d, "myq.py")
            shutil.copyfile(MYQ, prog)
        cmd = [PY, prog, "--spool", spool, "worker", "--module", module,
               "--log", self.logf(base, "cli")]
        env = child_env(extra_env)
        if script:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
        return start(cmd, env=env, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, cwd=base, **kw)

    # one run -------------------------------------------------------------

    def run(self, r):
        idle = {}
        for fs, base in self.bases.items():
            noop, _, _ = self.files(base)
            sp = new_spool(base, "idle")
            p = self.cli_worker(sp, base, noop)
            idle[fs] = (p, None)
        for fs, base in self.bases.items():
            p, _ = idle[fs]
            settle(p.pid, min_s=1.0)
            idle[fs] = (p, (mono(), cpu_ns(p.pid)))
        for fs, base in self.bases.items():
            log("run %d/%d on %s (%s)" % (r + 1, self.o.runs, fs, base))
            self.one_fs(fs, base, r)
        # idle CPU over the window (the rest of the run went on meanwhile)
        window = self.s["idle_window"]
        for fs, (p, (t0, c0)) in idle.items():
            left = t0 + window - mono()
            if left > 0:
                log("waiting %.0f s for the idle-CPU window" % left)
                time.sleep(left)
            t1, c1 = mono(), cpu_ns(p.pid)
            self.res.add(fs, "idle_cpu", (c1 - c0) / 1e9 / (t1 - t0) * 60.0)
            st = proc_status(p.pid)
            self.res.add(fs, "idle_window", t1 - t0)
            bare = self.bare_rss(self.bases[fs])
            self.res.add(fs, "rss_idle", st["VmRSS"] / MiB, bare["VmRSS"] / MiB,
                         ratio=(st["VmRSS"] - bare["VmRSS"]) / MiB)
            self.res.add(fs, "hwm_idle", st["VmHWM"] / MiB, bare["VmHWM"] / MiB,
                         ratio=(st["VmHWM"] - bare["VmHWM"]) / MiB)
            stop(p)

    def one_fs(self, fs, base, r):
        s = self.s
        mem = fs == "tmpfs"
        flip = r % 2 == 1       # alternate which goes first
        steps = [
            ("enqueue", lambda: self.m_enqueue(fs, base, s["enq_mem" if mem else "enq_disk"], flip)),
            ("enqueue_many", lambda: self.m_many(fs, base, s["many_mem" if mem else "many_disk"], flip)),
            ("drain", lambda: self.m_drain(fs, base, flip)),
            ("deep", lambda: self.m_deep(fs, base)),
            ("prio", lambda: self.m_prio(fs, base, flip)),
            ("exec", lambda: self.m_exec(fs, base, flip)),
            ("two", lambda: self.m_two(fs, base)),
            ("rss", lambda: self.m_rss(fs, base)),
            ("latency", lambda: self.m_latency(fs, base)),
            ("wall", lambda: self.m_wall(fs, base, flip)),
            ("count", lambda: self.m_count(fs, base, r)),
        ]
        spent = []
        for name, fn in steps:
            t = mono()
            os.sync()       # no writeback left over from the step before
            fn()
            spent.append("%s %.1fs" % (name, mono() - t))
        log("  " + ", ".join(spent))

    # enqueue -------------------------------------------------------------

    def m_enqueue(self, fs, base, n, flip):
        m = myq()
        fdir = new_spool(base, "enq-floor")
        a_sp = new_spool(base, "enq-api")
        s_sp = new_spool(base, "enq-spool")
        spool = getattr(m, 'open_store', m.Spool)(s_sp)
        data = m.dumps(m.new_job("noop", {"n": 1}))
        chunks = 5
        per = max(1, n // chunks)
        tf = ta = ts = 0.0
        for c in range(chunks):
            order = ["f", "a", "s"]
            if (c + flip) % 2:
                order.reverse()
            for who in order:
                if who == "f":
                    tf += floor_enqueue(fdir, per, data)
                elif who == "a":
                    t = clock()
                    for i in range(per):
                        m.enqueue(a_sp, "noop", {"n": i})
                    ta += clock() - t
                else:
                    t = clock()
                    for i in range(per):
                        spool.enqueue("noop", {"n": i})
                    ts += clock() - t
        k = per * chunks
        self.res.add(fs, "enq_api", k / ta, k / tf)
        self.enq_rates = (k / ta, k / tf)
        self.res.add(fs, "enq_spool", k / ts, k / tf)

    def m_many(self, fs, base, n, flip):
        m = myq()
        b = self.s["batch"]
        fdir = new_spool(base, "many-floor")
        spool = getattr(m, 'open_store', m.Spool)(new_spool(base, "many"))
        data = m.dumps(m.new_job("noop", {"n": 1}))
        tf = tm = 0.0
        for k in range(0, n, b):
            order = [0, 1] if ((k // b) + flip) % 2 == 0 else [1, 0]
            for who in order:
                if who == 0:
                    tf += floor_enqueue(fdir, b, data, batch=b)
                else:
                    specs = [{"type": "noop", "payload": {"n": i}} for i in range(b)]
                    t = clock()
                    spool.enqueue_many(specs)
                    tm += clock() - t
        k = len(range(0, n, b)) * b
        self.res.add(fs, "enq_many", k / tm, k / tf)

    # drain ---------------------------------------------------------------

    def drain_child(self, spool, base, name, **a):
        a.update(spool=spool, log=self.logf(base, name))
        return run_child("drain", a)

    def m_drain(self, fs, base, flip):
        n = self.s["drain"]
        sp = new_spool(base, "drain")
        fl = new_spool(base, "drain-floor")
        make_jobs(sp, n)
        make_jobs(fl, n)
        os.sync()       # the prepared files' writeback is not part of a drain
        rate = frate = None
        for who in ([1, 0] if flip else [0, 1]):
            if who == 0:
                k, t = floor_drain(fl)
                frate = k / t
            else:
                out = self.drain_child(sp, base, "drain")
                rate = out["done"] / (out["t1"] - out["t0"])
                if out["done"] != n or count(os.path.join(sp, "done")) != n:
                    self.res.notes.append("%s: drain ran %d of %d jobs" % (fs, out["done"], n))
                self.res.add(fs, "hwm_drain1k", out["hwm"] / MiB)
        self.res.add(fs, "drain", rate, frate)
        self.drain_rate = rate
        self.drain_floor = frate
        # The whole durable path of a job, as the floor's durable rate counts
        # it: enqueue (file + directory fsync) then claim and done.
        ea, ef = getattr(self, "enq_rates", (None, None))
        if ea and rate and frate:
            self.res.add(fs, "e2e", 1 / (1 / ea + 1 / rate), 1 / (1 / ef + 1 / frate))

    def deep_spool(self, fs, base, name, n=None):
        """A spool with n (s["deep"]) jobs queued, kept across runs: topped
        up, done/ and ok/ emptied."""
        n = n or self.s["deep"]
        sp = self.shared.get((fs, name))
        if sp is None:
            sp = new_spool(base, name)
            log("preparing %d jobs on %s" % (n, fs))
            make_jobs(sp, n)
            self.shared[(fs, name)] = sp
        else:
            short = n - count_jobs(os.path.join(sp, "incoming"))
            if short > 0:
                make_jobs(sp, short)
            clear_dir(os.path.join(sp, "done"))
            clear_dir(os.path.join(sp, "locks", "ok"))
        return sp

    def m_deep(self, fs, base):
        s = self.s
        # The floor at the same depth: does the filesystem itself slow down
        # with 100k files (cold directory blocks and inodes)?
        fl = self.deep_spool(fs, base, "deep-floor")
        os.sync()
        k, t = floor_drain(fl, s["take"])
        self.res.add(fs, "deep_floor", k / t, self.drain_floor)
        sp = self.deep_spool(fs, base, "deep")
        os.sync()
        depth = count(os.path.join(sp, "incoming"))
        k1 = s["take"] // 6
        out = self.drain_child(sp, base, "deep", stop_after=s["take"], mark_at=k1)
        rate = out["done"] / (out["t1"] - out["t0"])
        self.res.add(fs, "deep", rate, self.drain_rate)
        steady = (s["take"] - k1) / (out["tK"] - out["tM"])
        self.res.add(fs, "deep_steady", steady, self.drain_rate)
        self.res.add(fs, "deep_depth", depth)
        self.res.add(fs, "hwm_deep", out["hwm"] / MiB)

    def prio_spool(self, fs, base):
        """s["prio_deep"] jobs queued, s["prio_n"] of them with a priority
        spread over -3..5 at random places, the rest 0; kept across runs
        and topped up to the same mix (the priority is in the id)."""
        s = self.s
        want = collections.Counter()
        for i in range(s["prio_n"]):
            want[PRIO_LEVELS[i % len(PRIO_LEVELS)]] += 1
        want[0] += s["prio_deep"] - s["prio_n"]
        sp = self.shared.get((fs, "prio"))
        if sp is None:
            sp = new_spool(base, "prio")
            log("preparing %d jobs with priorities on %s" % (s["prio_deep"], fs))
            prios = [0] * s["prio_deep"]
            for i, at in enumerate(random.sample(range(s["prio_deep"]),
                                                 s["prio_n"])):
                prios[at] = PRIO_LEVELS[i % len(PRIO_LEVELS)]
            make_prio_jobs(sp, prios)
            self.shared[(fs, "prio")] = sp
        else:
            have = collections.Counter()
            for _, _, files in os.walk(os.path.join(sp, "incoming")):
                for n in files:
                    if n.endswith(".json"):
                        have[prio_of(n[:-5])] += 1
            short = []
            for p, n in sorted(want.items()):
                short += [p] * max(0, n - have[p])
            random.shuffle(short)
            make_prio_jobs(sp, short)
            clear_dir(os.path.join(sp, "done"))
            clear_dir(os.path.join(sp, "locks", "ok"))
        return sp

    def m_prio(self, fs, base, flip):
        """Claim rate with priorities in use against the same depth without
        (the `deep` spool when it is as deep), first prio_take jobs each."""
        s = self.s
        try:
            myq().new_job("noop", priority=1)
        except TypeError:
            if not any("priorities" in n for n in self.res.notes):
                self.res.notes.append("this myq has no priorities: no "
                                      "priority row")
            return
        k = s["prio_take"]
        if s["prio_deep"] == s["deep"]:
            plain = self.deep_spool(fs, base, "deep")
        else:
            plain = self.deep_spool(fs, base, "prio-plain", s["prio_deep"])
        prio = self.prio_spool(fs, base)
        os.sync()
        rates = {}
        for which in (["prio", "plain"] if flip else ["plain", "prio"]):
            sp = prio if which == "prio" else plain
            rec = os.path.join(base, "logs", "prio-order-%d.txt" % _serial[0])
            out = self.drain_child(sp, base, "prio-" + which, stop_after=k,
                                   record=rec)
            rates[which] = out["done"] / (out["t1"] - out["t0"])
            if which == "prio":
                with open(rec) as f:
                    got = [prio_of(l.strip()) for l in f if l.strip()]
                bad = sum(1 for a, b in zip(got, got[1:]) if b > a)
                if bad:
                    self.res.notes.append(
                        "%s: priority order violated %d times in the first %d "
                        "jobs (expected %s first)" % (fs, bad, len(got),
                                                      max(PRIO_LEVELS)))
                self.res.add(fs, "prio_order_bad", bad)
            os.unlink(rec)
        self.res.add(fs, "deep_prio", rates["prio"], rates["plain"])

    def m_exec(self, fs, base, flip):
        """Interleaved in 4 chunks (floor, myq, floor, ...): fork/exec time
        swings with the machine's load."""
        s = self.s
        _, _, hd = self.files(base)
        chunks = 4
        for key, n, conc in (("exec", s["exec_n"], 1), ("exec4", s["conc_n"], 4)):
            per = max(conc, n // chunks)
            fn = ft = mn = mt = 0.0
            for c in range(chunks):
                sp = new_spool(base, key)
                make_jobs(sp, per, type="t")
                os.sync()
                for who in ([1, 0] if (c + flip) % 2 else [0, 1]):
                    if who == 0:
                        out = run_child("spawn", {"n": per, "conc": conc})
                        fn += out["n"]
                        ft += out["t"]
                    else:
                        out = self.drain_child(sp, base, key, handlers_dir=hd,
                                               concurrency=conc)
                        ok = count(os.path.join(sp, "done"))
                        mn += ok
                        mt += out["t1"] - out["t0"]
                        if ok != per:
                            self.res.notes.append("%s: %s drain finished %d of %d"
                                                  % (fs, key, ok, per))
            self.res.add(fs, key, mn / mt, fn / ft)

    def m_two(self, fs, base):
        n = self.s["two_n"]
        sp = new_spool(base, "two")
        make_jobs(sp, n)
        os.sync()
        procs = []
        for i in range(2):
            a = dict(spool=sp, log=self.logf(base, "two%d" % i), go=True,
                     record=os.path.join(base, "logs", "two-%d-%d.ids" % (_serial[0], i)))
            p = start([PY, os.path.abspath(__file__), "_child", "drain", json.dumps(a)],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      universal_newlines=True, cwd=ROOT)
            procs.append((p, a["record"]))
        for p, _ in procs:
            assert p.stdout.readline().strip() == "ready"
        for p, _ in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = []
        for p, _ in procs:
            out, _ = p.communicate(timeout=600)
            PROCS.remove(p)
            outs.append(json.loads(out.strip().splitlines()[-1]))
        span = max(o["t1"] for o in outs) - min(o["t0"] for o in outs)
        self.res.add(fs, "two", n / span, self.drain_rate)
        ids = []
        for _, rec in procs:
            with open(rec) as f:
                ids.extend(f.read().split())
        expected = set(os.listdir(os.path.join(sp, "done")))
        once = (len(ids) == n and len(set(ids)) == n and len(expected) == n
                and count(os.path.join(sp, "incoming")) == 0
                and count(os.path.join(sp, "processing")) == 0
                and count(os.path.join(sp, "dlq")) == 0)
        split = "/".join(str(o["done"]) for o in outs)
        self.res.add(fs, "two_once", 1.0 if once else 0.0)
        self.res.add(fs, "two_split", split)
        if not once:
            self.res.notes.append("%s: 2 workers ran %d handler calls for %d jobs "
                                  "(%d distinct), %d in done/"
                                  % (fs, len(ids), n, len(set(ids)), len(expected)))

    # memory --------------------------------------------------------------

    def import_list(self, base):
        """The modules a real idle worker imports (-X importtime)."""
        noop, _, _ = self.files(base)
        sp = new_spool(base, "imports")
        errf = os.path.join(base, "logs", "importtime.txt")
        with open(errf, "w") as err:
            p = start([PY, "-X", "importtime", self.install(base)[0], "--spool",
                       sp, "worker", "--module", noop], stdout=subprocess.DEVNULL, stderr=err,
                      stdin=subprocess.DEVNULL, cwd=base)
            settle(p.pid)
            stop(p)
        mods = []
        with open(errf) as f:
            for line in f:
                if line.startswith("import time:") and "|" in line:
                    name = line.rsplit("|", 1)[1].strip()
                    if name and name != "imported package" and \
                            not name.startswith("myq_handlers"):
                        mods.append(name)
        return sorted(set(mods) | {"myq"})

    def bare_rss(self, base):
        """A python3 that imports what the worker imports (myq from the
        installed .pyc, as the worker does) and does nothing else."""
        code = ("import sys\nsys.path.insert(0, %r)\nfor m in %r:\n    try:\n"
                "        __import__(m)\n    except Exception:\n        pass\n"
                "sys.stdout.write(open('/proc/self/status').read())\n"
                % (self.install(base)[1], self.modules))
        out = subprocess.run([PY, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                             universal_newlines=True, env=child_env()).stdout
        st = {}
        for line in out.splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                st[k] = int(v.split()[0]) * 1024
        return st

    def m_rss(self, fs, base):
        noop, _, _ = self.files(base)
        got = {}
        for depth in (1000, self.s["deep"]):
            sp = self.shared.get((fs, "sched", depth))
            if sp is None:
                sp = new_spool(base, "sched%d" % depth)
                log("preparing %d scheduled jobs on %s" % (depth, fs))
                make_jobs(sp, depth, delay=86400.0)
                self.shared[(fs, "sched", depth)] = sp
            p = self.cli_worker(sp, base, noop)
            settle(p.pid, min_s=1.5)
            got[depth] = proc_status(p.pid)
            stop(p)
        # idle, nothing queued: myq.py run as a script against the installed
        # layout, side by side (the same spool, the same handler module)
        sp = new_spool(base, "rss-script")
        ps = [self.cli_worker(sp, base, noop, script=True),
              self.cli_worker(sp, base, noop)]
        for p in ps:
            settle(p.pid, min_s=1.5)
        script, inst = [proc_status(p.pid) for p in ps]
        for p in ps:
            stop(p)
        self.res.add(fs, "rss_script", script["VmRSS"] / MiB, inst["VmRSS"] / MiB,
                     ratio=(script["VmRSS"] - inst["VmRSS"]) / MiB)
        bare = self.bare_rss(base)
        deep = got[self.s["deep"]]
        self.res.add(fs, "rss_deep", deep["VmRSS"] / MiB, bare["VmRSS"] / MiB,
                     ratio=(deep["VmRSS"] - bare["VmRSS"]) / MiB)
        self.res.add(fs, "hwm_deep_sched", deep["VmHWM"] / MiB, bare["VmHWM"] / MiB,
                     ratio=(deep["VmHWM"] - bare["VmHWM"]) / MiB)
        g = (deep["VmRSS"] - got[1000]["VmRSS"]) / MiB
        self.res.add(fs, "rss_growth", g, got[1000]["VmRSS"] / MiB, ratio=g)

    # latency -------------------------------------------------------------

    def m_latency(self, fs, base):
        m = myq()
        _, lat, _ = self.files(base)
        sp = new_spool(base, "lat")
        r, w = os.pipe()
        p = self.cli_worker(sp, base, lat, extra_env={"BENCH_LAT_FD": str(w)},
                            pass_fds=(w,))
        os.close(w)
        settle(p.pid, min_s=1.0)
        buf = b""
        from_call, from_ret, calls = [], [], []
        try:
            for i in range(self.s["lat_n"]):
                t0 = mono()
                jid = m.enqueue(sp, "lat", {"i": i})
                t1 = mono()
                while b"\n" not in buf:
                    ready, _, _ = select.select([r], [], [], 10.0)
                    if not ready:
                        raise RuntimeError("latency: no handler start in 10 s")
                    buf += os.read(r, 4096)
                line, _, buf = buf.partition(b"\n")
                got_id, th = line.decode().split()
                assert got_id == jid, (got_id, jid)
                th = float(th)
                from_call.append(th - t0)
                from_ret.append(th - t1)
                calls.append(t1 - t0)
                # let the worker finish and go idle again before the next job
                time.sleep(0.03 + random.random() * 0.02)
        finally:
            stop(p)
            os.close(r)
        ms = 1000.0
        self.res.add(fs, "lat_p50", percentile(from_call, 50) * ms,
                     percentile(calls, 50) * ms, ratio=float("nan"))
        self.res.add(fs, "lat_p99", percentile(from_call, 99) * ms,
                     percentile(calls, 99) * ms, ratio=float("nan"))
        self.res.add(fs, "lat_ret_p50", percentile(from_ret, 50) * ms)

    # process wall time ---------------------------------------------------

    def m_wall(self, fs, base, flip):
        """Three processes, interleaved: the floor; myq.py run as a script
        (`cp myq.py /usr/bin/myq`: compiled on every run); and the installed
        layout (`make install`: PREFIX/bin/myq imports PREFIX/lib/myq/myq.py
        and its .pyc, as build/dist.py writes them)."""
        import resource
        sp = new_spool(base, "wall")
        env = child_env()
        cmds = {
            "floor": ([PY, "-I", "-c", "import json"], env),
            "myq": ([PY, MYQ, "--spool", sp, "enqueue", "t", "{}"], env),
            "installed": ([PY, self.install(base)[0],
                           "--spool", sp, "enqueue", "t", "{}"], env),
        }
        times = {k: [] for k in cmds}
        cpu = {k: [] for k in cmds}
        for k, (cmd, e) in cmds.items():    # warm the page cache and the .pyc
            subprocess.run(cmd, stdout=subprocess.DEVNULL, env=e, cwd=base)
        order = list(cmds)
        for i in range(self.s["wall_n"]):
            for k in (order if (i + flip) % 2 == 0 else order[::-1]):
                cmd, e = cmds[k]
                r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                t = clock()
                rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, env=e,
                                    cwd=base).returncode
                times[k].append(clock() - t)
                r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu[k].append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
                if rc != 0:
                    raise RuntimeError("%s exited %d" % (cmd, rc))
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        cmed = {k: statistics.median(v) * 1000 for k, v in cpu.items()}
        self.res.add(fs, "wall", med["installed"], med["floor"])
        self.res.add(fs, "wall_cpu", cmed["installed"], cmed["floor"])
        self.res.add(fs, "wall_script", med["myq"], med["floor"])

    # counts ---------------------------------------------------------------

    def m_count(self, fs, base, r):
        s = self.s
        d = os.path.join(base, "count-%d" % r)
        os.mkdir(d)
        a = {"base": d, "bulk": s["count_bulk"], "trickle": s["count_trickle"],
             "batch": s["batch"]}
        out = run_child("count", a)
        for sc in ("bulk", "trickle", "batch"):
            c = out[sc]
            self.res.add(fs, "fsync_" + sc, (c.get("fsync", 0) - c.get("start_fsync", 0))
                         / float(c["jobs"]))
        b = out["bulk"]
        self.res.add(fs, "body_writes", b.get("body_writes", 0) / float(b["jobs"]))
        self.res.add(fs, "bytes", b.get("bytes", 0) / float(b["jobs"]), out["body_bytes"])
        self.res.add(fs, "log_bytes", b["log_bytes"] / float(b["jobs"]))
        if r == 0 and shutil.which("strace"):
            d2 = os.path.join(base, "count-strace")
            os.mkdir(d2)
            a["base"] = d2
            so = os.path.join(base, "logs", "strace.txt")
            cmd = ["strace", "-f", "-qq", "-c", "-o", so, "-e",
                   "trace=fsync,fdatasync,syncfs,sync_file_range",
                   PY, os.path.abspath(__file__), "_child", "count", json.dumps(a)]
            pr = subprocess.run(cmd, stdout=subprocess.PIPE, universal_newlines=True,
                                cwd=ROOT, env=child_env())
            if pr.returncode == 0:
                got = json.loads(pr.stdout.strip().splitlines()[-1])
                hook_total = sum(got[sc].get("fsync", 0) for sc in ("bulk", "trickle", "batch"))
                st_total = 0
                with open(so) as f:
                    for line in f:
                        parts = line.split()
                        if parts and parts[-1] in ("fsync", "fdatasync", "syncfs",
                                                   "sync_file_range"):
                            st_total += int(parts[3])
                self.res.add(fs, "strace", st_total, hook_total)

    # driver ----------------------------------------------------------------

    def main(self):
        for fs, path in self.o.targets:
            base = tempfile.mkdtemp(prefix="myq-bench-", dir=path)
            self.bases[fs] = base
            self.files(base)
            self.install(base)
        first = next(iter(self.bases.values()))
        self.modules = self.import_list(first)
        log("bare interpreter imports %d modules" % len(self.modules))
        for r in range(self.o.runs):
            self.run(r)


# The table ##################################################################

def fmt(v, unit=""):
    if v is None or v != v:
        return "-"
    if isinstance(v, str):
        return v
    a = abs(v)
    if unit in ("MiB",):
        return "%.1f" % v
    if a >= 1000:
        return "%.0f" % v
    if a >= 100:
        return "%.0f" % v
    if a >= 10:
        return "%.1f" % v
    return "%.2f" % v


def med(xs):
    xs = [x for x in xs if not (isinstance(x, float) and x != x)]
    if not xs:
        return None
    if isinstance(xs[0], str):
        return xs[len(xs) // 2]
    return statistics.median(xs)


# (key, label, unit, floor label, ratio kind, target text, check(ratio, value))
def metrics(fs, s):
    tm = fs == "tmpfs"
    drain_min = 0.5 if tm else 0.8
    ge = lambda t: (lambda r, v: r is not None and r >= t)   # noqa: E731
    return [
        ("enq_api", "enqueue myq.enqueue() durable", "jobs/s",
         "bare protocol loop", "x", ">=0.8x", ge(0.8)),
        ("enq_spool", "enqueue Spool.enqueue() durable", "jobs/s",
         "bare protocol loop", "x", ">=0.8x", ge(0.8)),
        ("enq_many", "enqueue_many(%d) durable" % s["batch"], "jobs/s",
         "bare, fsyncs after the batch", "x", "info", None),
        ("e2e", "durable job: enqueue + drain (no-op)", "jobs/s",
         "bare protocol loop, all steps", "x", ">=%gx" % drain_min, ge(drain_min)),
        ("drain", "drain %d, no-op handler (alone)" % s["drain"], "jobs/s",
         "bare claim+read+done", "x", "info", None),
        ("deep", "drain, 100k queued (first %d)" % s["take"], "jobs/s",
         "drain of %d (above)" % s["drain"], "x", ">=0.8x", ge(0.8)),
        ("deep_steady", "  same, jobs %d..%d only" % (s["take"] // 6, s["take"]), "jobs/s",
         "drain of %d (above)" % s["drain"], "x", "info", None),
        ("deep_floor", "  the floor itself, 100k vs %d queued" % s["drain"], "jobs/s",
         "bare drain of %d" % s["drain"], "x", "info", None),
        ("deep_prio", "drain, %dk queued, priorities in use (first %d)"
         % (s.get("prio_deep", 0) // 1000, s.get("prio_take", 0)), "jobs/s",
         "same %dk without priorities" % (s.get("prio_deep", 0) // 1000), "x",
         "info", None),
        ("exec", "drain exec /bin/true", "jobs/s",
         "bare Popen+stdin+wait", "x", ">=0.8x", ge(0.8)),
        ("exec4", "drain exec --concurrency 4", "jobs/s",
         "bare Popen, 4 in flight", "x", "info", None),
        ("two", "drain, 2 worker processes", "jobs/s",
         "1 process (above)", "x", "info", None),
        ("two_once", "2 workers: each job exactly once", "",
         "", "", "all", lambda r, v: v == 1.0),
        ("rss_idle", "worker VmRSS idle", "MiB",
         "bare imports", "+MiB", "<=+2 MiB", lambda r, v: r is not None and r <= 2.0),
        ("hwm_idle", "worker VmHWM idle", "MiB",
         "bare imports", "+MiB", "info", None),
        ("rss_script", "worker VmRSS idle, myq.py as a script", "MiB",
         "installed, idle", "+MiB", "<=+5 MiB", lambda r, v: r is not None and r <= 5.0),
        ("rss_deep", "worker VmRSS, 100k queued", "MiB",
         "bare imports", "+MiB", "<=+2 MiB", lambda r, v: r is not None and r <= 2.0),
        ("hwm_deep_sched", "worker VmHWM, 100k queued", "MiB",
         "bare imports", "+MiB", "info", None),
        ("rss_growth", "VmRSS growth 1k->100k queued", "MiB",
         "VmRSS at 1k", "+MiB", "<1 MiB", lambda r, v: v is not None and v < 1.0),
        ("idle_cpu", "idle worker CPU", "s/min",
         "", "", "<=0.05", lambda r, v: v is not None and v <= 0.05),
        ("lat_p50", "enqueue()->handler start p50", "ms",
         "enqueue() call p50", "", "<=20 ms", lambda r, v: v is not None and v <= 20),
        ("lat_p99", "enqueue()->handler start p99", "ms",
         "enqueue() call p99", "", "info", None),
        ("lat_ret_p50", "enqueue() return->handler p50", "ms",
         "", "", "info", None),
        ("wall", "`myq enqueue` process wall (installed)", "ms",
         "python3 -I -c 'import json'", "x", "<=1.5x",
         lambda r, v: r is not None and r <= 1.5),
        ("wall_cpu", "`myq enqueue` process CPU (installed)", "ms",
         "same for import json", "x", "info", None),
        ("wall_script", "same, myq.py run as a script", "ms",
         "python3 -I -c 'import json'", "x", "info", None),
        ("fsync_bulk", "fsync/job (enqueue 1 by 1, drain)", "",
         "", "", "<=3", lambda r, v: v is not None and v <= 3),
        ("fsync_trickle", "fsync/job (1 job into idle worker)", "",
         "", "", "<=3", lambda r, v: v is not None and v <= 3),
        ("fsync_batch", "fsync/job (enqueue_many, drain)", "",
         "", "", "<=3", lambda r, v: v is not None and v <= 3),
        ("body_writes", "job-body writes/job", "",
         "", "", "1", lambda r, v: v is not None and v <= 1.0),
        ("bytes", "bytes written/job (spool files)", "B",
         "job body bytes", "x", "info", None),
        ("log_bytes", "log bytes/job", "B", "", "", "info", None),
        ("strace", "fsync calls: strace vs hook", "",
         "hook count", "x", "=1x", lambda r, v: r is not None and abs(r - 1) < 1e-9),
    ]


def table(res, fs, s, markdown=False):
    rows = []
    for key, label, unit, flabel, rk, target, check in metrics(fs, s):
        d = res.data.get((fs, key))
        if not d:
            continue
        v, f, r = med(d["value"]), med(d["floor"]), med(d["ratio"])
        if key == "two_once":
            vs = "yes" if v == 1.0 else "NO"
            vs += " (%s)" % med(res.data[(fs, "two_split")]["value"])
        else:
            vs = fmt(v, unit)
        if rk == "x":
            rs = "%.2fx" % r if r is not None else "-"
        elif rk == "+MiB":
            rs = "%+.2f MiB" % r if r is not None else "-"
        else:
            rs = "-"
        fs_ = ("%s (%s)" % (fmt(f, unit), flabel)) if f is not None else "-"
        if check is None:
            verdict = "info"
        else:
            verdict = "pass" if check(r, v) else "MISS"
        rng = ""
        if rk == "x" and len(d["ratio"]) > 1:
            rr = [x for x in d["ratio"] if x == x]
            rng = "%.2f-%.2f" % (min(rr), max(rr))
        rows.append((label + (" [%s]" % unit if unit else ""), vs, fs_, rs, rng,
                     target, verdict))
    head = ("metric", "value", "floor", "ratio", "ratio range", "target", "result")
    if markdown:
        out = ["| " + " | ".join(head) + " |",
               "|" + "|".join("---" for _ in head) + "|"]
        for row in rows:
            out.append("| " + " | ".join(x.replace("|", "\\|") for x in row) + " |")
        return "\n".join(out)
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    line = "  ".join("%-*s" % (w, h) for w, h in zip(widths, head))
    out = [line, "-" * len(line)]
    for row in rows:
        out.append("  ".join("%-*s" % (w, x) for w, x in zip(widths, row)))
    return "\n".join(out)


def report(bench, info, markdown=False, types=None):
    o, s, res = bench.o, bench.s, bench.res
    out = []
    out.append("myq bench  %s  runs=%d%s  (medians over runs; ratio = median of "
               "per-run ratios, floor measured in the same run)"
               % (info["date"], o.runs, " --quick" if o.quick else ""))
    out.append("machine: %s, %s cores; kernel %s; Python %s"
               % (info["cpu"], info["cores"], info["kernel"], info["python"]))
    if info.get("myq"):
        out.append("measured: %s" % info["myq"])
    out.append("load average at start %s, at end %s"
               % (" ".join(info["loadavg"]), " ".join(info["loadavg_end"])))
    for fs, path in o.targets:
        typ, dev, mnt = (types or {}).get(path) or fstype(path)
        d = res.data.get((fs, "idle_window"))
        win = med(d["value"]) if d else 0
        out.append("")
        out.append("== %s: %s (%s on %s, mounted at %s) ==" % (fs, path, typ, dev, mnt))
        out.append(table(res, fs, s, markdown))
        notes = []
        dd = res.data.get((fs, "deep_depth"))
        if dd:
            notes.append("100k drain: depth %d at start, rate over the first %d jobs "
                         "(it includes the worker's first scan of the whole queue; "
                         "the next row leaves that out)" % (med(dd["value"]), s["take"]))
        po = res.data.get((fs, "prio_order_bad"))
        if po:
            notes.append("priorities: the first %d jobs started highest "
                         "priority first in %d of %d runs"
                         % (s["prio_take"], sum(1 for v in po["value"] if v == 0),
                            len(po["value"])))
        if win:
            notes.append("idle CPU measured over %.0f s, extrapolated to 1 min%s"
                         % (win, " (--quick)" if o.quick else ""))
        for k, label in (("hwm_drain1k", "drain child VmHWM 1k"), ("hwm_deep", "100k")):
            dd = res.data.get((fs, k))
            if dd:
                notes.append("%s: %.1f MiB" % (label, med(dd["value"])))
        out.append("notes: " + "; ".join(notes))
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        out.append("note: PYTHONDONTWRITEBYTECODE is set here: every `import myq` "
                   "compiles myq.py (the .pyc row uses a cache under the bench dir)")
    for n in res.notes:
        out.append("warning: " + n)
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        return child_main(argv[1], argv[2])
    ap = argparse.ArgumentParser(description="myq benchmark (see the docstring)")
    ap.add_argument("--quick", action="store_true", help="fewer jobs, 10 s idle window")
    ap.add_argument("--runs", type=int, default=3, help="runs (medians; at least 3)")
    ap.add_argument("--dir", help="a directory on a disk filesystem (default: "
                    "/var/tmp, /tmp or the repository, the first on a disk)")
    ap.add_argument("--shm", default="/dev/shm", help="a directory on tmpfs")
    ap.add_argument("--fs", default="ext4,tmpfs",
                    help="which of disk,tmpfs to run (names: ext4 or disk, tmpfs)")
    ap.add_argument("--json", help="also write the raw per-run figures here")
    ap.add_argument("--markdown", action="store_true", help="markdown tables")
    ap.add_argument("--from-json", metavar="FILE",
                    help="print the table of a run saved with --json; measure nothing")
    o = ap.parse_args(argv)
    if o.from_json:
        return rerender(o.from_json, o.markdown)
    if o.runs < 3:
        ap.error("--runs must be at least 3 (the table shows medians)")
    want = set(x.strip() for x in o.fs.split(","))
    o.targets = []
    disk = o.dir or pick_disk_dir()
    if want & {"ext4", "disk"}:
        typ = fstype(disk)[0]
        if typ in ("tmpfs", "ramfs"):
            ap.error("--dir %s is on %s, not a disk" % (disk, typ))
        o.targets.append((typ if typ != "?" else "disk", disk))
    if "tmpfs" in want:
        if fstype(o.shm)[0] == "tmpfs":
            o.targets.append(("tmpfs", o.shm))
        else:
            log("%s is not tmpfs; skipping tmpfs" % o.shm)
    if not o.targets:
        ap.error("nothing to run")
    b = Bench(o, QUICK if o.quick else FULL)
    info = machine()
    t0 = mono()
    try:
        b.main()
    finally:
        stop_all()
        for base in b.bases.values():
            shutil.rmtree(base, ignore_errors=True)
    info["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    text = report(b, info, o.markdown)
    sys.stdout.write(text + "\n")
    sys.stdout.write("took %.0f s\n" % (mono() - t0))
    if o.json:
        with open(o.json, "w") as f:
            json.dump({"machine": info, "sizes": b.s, "runs": o.runs,
                       "quick": o.quick, "targets": o.targets,
                       "fstypes": [fstype(p) for _, p in o.targets],
                       "data": {"%s/%s" % k: v for k, v in b.res.data.items()},
                       "notes": b.res.notes}, f, indent=1)
    return 0


def rerender(path, markdown):
    with open(path) as f:
        saved = json.load(f)

    class O(object):
        pass
    o = O()
    o.runs, o.quick = saved["runs"], saved["quick"]
    o.targets = [tuple(t) for t in saved["targets"]]
    b = O()
    b.o, b.s = o, saved["sizes"]
    b.res = Results()
    b.res.notes = saved["notes"]
    for k, v in saved["data"].items():
        fs, key = k.split("/", 1)
        b.res.data[(fs, key)] = v
    types = dict(zip((p for _, p in o.targets), saved.get("fstypes", [])))
    sys.stdout.write(report(b, saved["machine"], markdown, types) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
