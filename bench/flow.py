#!/usr/bin/env python3
"""The slow flow and the worker's start (issue 42, items 2 and 4): what a
worker costs when it forwards little, old code beside new in one run.

    python3 bench/flow.py [--python PY] [--old REV | --no-old] [--stores files,sqlite]
                          [--runs 3] [--seconds 30] [--idle 30]
                          [--depths 1000,100000] [--fill-batch 5000]
                          [--no-flow] [--no-start]
                          [--json FILE]

- flow: a producer (its own process, not counted) enqueues one reading
  every 0.2 s (5/s) of type `fwd` (`handler=http batch=100 batch_wait=5s
  gzip=true`) to a keep-alive HTTP/1.1 server on 127.0.0.1 (a thread of
  this process, not counted); after a warm-up of 6 s, the worker's CPU
  (user + system: /proc/PID/task/*/schedstat, ns) over --seconds divided
  by the readings the server got meanwhile.  Then the producer stops and,
  once the backlog is sent, the idle worker's CPU over --idle seconds, as
  a share of one core.  One more run of the flow with `strace -c -f`
  attached for the window counts the worker's getdents64 (two a scan of
  a small directory), openat and stat calls per reading.
- start: a spool holding N jobs all due in a day; `worker --drain`
  (nothing to run) under callgrind, after one run outside the count:
  instructions of the whole process, at each --start-n (the difference
  is the part that grows with the depth).
- depth: enqueue per job (1,000 jobs into a spool already holding
  D - 1,000) and drain per job (D ready jobs, a --module noop handler,
  the worker's start included): CPU (getrusage of the children) per job,
  at each depth, and the ratio of the deepest to the shallowest.

Flow figures a median of --runs, start and depth of --start-runs and
--depth-runs (default 1: callgrind agrees to ~0.5%; a depth of 100,000
takes minutes); old (git show REV:myq.py) and new (this
tree's myq.py) interleaved.  tmpfs (/dev/shm), PYTHONHASHSEED=0, byte code
cached outside the tree.  Default --python: a venv of pyenv's plain 3.11
(/tmp/plainvenv; pyenv's own .pth files add ~104 M instructions a start).
"""

import argparse
import gzip
import http.server
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PYCACHE = os.path.join(tempfile.gettempdir(), "myq-flow-pycache")
BASE = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def default_python():
    venv = "/tmp/plainvenv/bin/python3"
    if os.path.exists(venv):
        return venv
    try:
        root = subprocess.check_output(["pyenv", "root"], universal_newlines=True,
                                       stderr=subprocess.DEVNULL).strip()
        py = os.path.join(root, "versions", "3.11.7", "bin", "python3")
        if os.path.exists(py):
            subprocess.check_call([py, "-m", "venv", "/tmp/plainvenv"])
            return venv
    except (OSError, subprocess.CalledProcessError):
        pass
    return sys.executable


def child_env():
    """bench/cpu.py's environment of a child, with this bench's cache."""
    import cpu
    return dict(cpu.child_env(), PYTHONPYCACHEPREFIX=PYCACHE)


# The server ##################################################################

class _Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        n = len(json.loads(body.decode("utf-8")))
        with self.server.lock:
            self.server.got += n
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *a):
        pass


def serve():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    srv.daemon_threads = True
    srv.lock, srv.got = threading.Lock(), 0
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


# /proc #######################################################################

def cpu_ns(pid):
    """Time on a CPU of every thread of pid, ns (schedstat: user + kernel)."""
    total = 0
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return 0
    for t in tasks:
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, t)) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


# The flow ####################################################################

PRODUCER = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import myq
sp = myq.Spool(sys.argv[2])
url, rate = sys.argv[3], float(sys.argv[4])
t = time.monotonic()
i = 0
while True:
    sp.enqueue("fwd", {"url": url, "body": {"n": i, "t": round(time.time(), 3),
                                            "temp": 21.5, "hum": 40}})
    i += 1
    t += 1.0 / rate
    time.sleep(max(0.0, t - time.monotonic()))
"""


def make_spool(py, tree, store, d):
    myq = os.path.join(tree, "myq.py")
    env = child_env()
    subprocess.check_call([py, myq, "--spool", d, "init"] +
                          (["--store", "sqlite"] if store == "sqlite" else []),
                          env=env, stdout=subprocess.DEVNULL)
    subprocess.check_call([py, myq, "--spool", d, "policy", "fwd", "handler=http",
                           "batch=100", "batch_wait=5s", "gzip=true"], env=env,
                          stdout=subprocess.DEVNULL)


def flow(py, tree, store, seconds, idle, strace=False):
    d = tempfile.mkdtemp(prefix="flow-", dir=BASE)
    srv = serve()
    procs = []
    try:
        sp = os.path.join(d, "s")
        make_spool(py, tree, store, sp)
        env = child_env()
        argv = [py, os.path.join(tree, "myq.py"), "--spool", sp, "worker",
                "--log", os.path.join(d, "log"), "--stats-interval", "0"]
        counts = os.path.join(d, "strace")
        w = subprocess.Popen(argv, env=env)
        procs.append(w)
        wpid = w.pid
        url = "http://127.0.0.1:%d/in" % srv.server_address[1]
        p = subprocess.Popen([py, "-c", PRODUCER, tree, sp, url, "5"], env=env)
        procs.append(p)
        time.sleep(6.0)                 # warm-up: the first batches went
        if strace:                      # (attached for the window only)
            st = subprocess.Popen(["strace", "-f", "-c", "-o", counts, "-p", str(wpid),
                                   "-e", "trace=getdents64,openat,open,newfstatat,"
                                   "statx,stat,lstat,fstat"],
                                  stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        c0, g0, t0 = cpu_ns(wpid), srv.got, time.monotonic()
        time.sleep(seconds)
        c1, g1 = cpu_ns(wpid), srv.got
        if strace:
            st.send_signal(2)
            st.wait()
        p.terminate()
        p.wait()
        time.sleep(6.0)                 # the last batch waits out batch_wait
        i0, it0 = cpu_ns(wpid), time.monotonic()
        time.sleep(idle)
        i1, it1 = cpu_ns(wpid), time.monotonic()
        w.terminate()
        w.wait()
        out = {"readings": g1 - g0, "ms_per_reading": (c1 - c0) / 1e6 / max(1, g1 - g0),
               "idle_pct": (i1 - i0) / 1e9 / (it1 - it0) * 100}
        if strace:
            calls = _strace_counts(counts)
            n = max(1, g1 - g0)
            out = {"per_reading": dict((k, round(v / n, 2)) for k, v in calls.items()),
                   "readings": n}
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        srv.shutdown()
        shutil.rmtree(d, ignore_errors=True)


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _strace_counts(path):
    out = {}
    for line in _read(path).splitlines():
        f = line.split()
        if len(f) >= 5 and f[-1].isidentifier() and f[3].isdigit() \
                and f[-1] != "total":
            out[f[-1]] = int(f[3])
    return out


# The start ###################################################################

MAKE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import myq
d, store, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
myq.main(["--spool", d, "init"] + (["--store", "sqlite"] if store == "sqlite" else []))
sp = myq.Spool(d)
step = int(sys.argv[6])
for i in range(0, n, step):
    sp.enqueue_many([{"type": "noop", "payload": {"n": j}, "delay": float(sys.argv[5])}
                     for j in range(i, min(n, i + step))], sync=False)
"""


def filled(py, tree, store, n, d, delay=86400, batch=5000):
    """A spool of n jobs, put `batch` a call of enqueue_many (each call's
    jobs share one available_at: --fill-batch)."""
    subprocess.check_call([py, "-c", MAKE, tree, d, store, str(n), str(delay),
                           str(max(1, batch))], env=child_env())


def start_instr(py, tree, store, n):
    """Instructions of `worker --drain` on n jobs due in a day."""
    d = tempfile.mkdtemp(prefix="start-", dir=BASE)
    try:
        sp = os.path.join(d, "s")
        filled(py, tree, store, n, sp)
        # (imported, from its cached byte code: a script run as `python
        # myq.py` is compiled at every start, ~700 M instructions that
        # hide the rest: bench/device.py measures that)
        argv = [py, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import myq; "
                "sys.exit(myq.main(sys.argv[2:]))", tree, "--spool", sp, "worker",
                "--drain", "--log", os.path.join(d, "log")]
        # a first run outside the count: byte code cached, the first
        # start's own work (a check after no clean stop) done
        subprocess.check_call(argv, env=child_env())
        out = os.path.join(d, "cg.out")
        subprocess.check_call(["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out,
                               "--dump-instr=no"] + argv, env=child_env(),
                              stderr=subprocess.DEVNULL)
        with open(out) as f:
            for line in f:
                if line.startswith("summary:") or line.startswith("totals:"):
                    return int(line.split()[1])
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return None


# Depth #######################################################################

DRAIN_MOD = "def noop(job):\n    pass\n"


def _child_cpu(argv, env):
    r0 = os.times()
    subprocess.check_call(argv, env=env, stdout=subprocess.DEVNULL)
    r1 = os.times()
    return (r1.children_user - r0.children_user) + (r1.children_system - r0.children_system)


ENQ = r"""
import sys, resource
sys.path.insert(0, sys.argv[1])
import myq
sp = myq.Spool(sys.argv[2])
r0 = resource.getrusage(resource.RUSAGE_SELF)
for i in range(int(sys.argv[3])):
    sp.enqueue("noop", {"n": i})
r1 = resource.getrusage(resource.RUSAGE_SELF)
print((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
"""


def depth(py, tree, store, n, batch=5000):
    """(enqueue s per job of 1,000 into a spool of n - 1,000 waiting,
    drain s per job of n ready, the worker's process whole)."""
    d = tempfile.mkdtemp(prefix="depth-", dir=BASE)
    try:
        sp = os.path.join(d, "s")
        filled(py, tree, store, n - 1000, sp, delay=0, batch=batch)
        env = child_env()
        enq = float(subprocess.check_output([py, "-c", ENQ, tree, sp, "1000"],
                                            env=env))
        mod = os.path.join(d, "h.py")
        with open(mod, "w") as f:
            f.write(DRAIN_MOD)
        cpu = _child_cpu([py, os.path.join(tree, "myq.py"), "--spool", sp, "worker",
                          "--drain", "--module", mod, "--log", os.path.join(d, "log")],
                         env)
        return enq / 1000, cpu / n
    finally:
        shutil.rmtree(d, ignore_errors=True)


# Main ########################################################################

def old_tree(rev):
    d = tempfile.mkdtemp(prefix="flow-old-")
    with open(os.path.join(d, "myq.py"), "wb") as f:
        f.write(subprocess.check_output(["git", "-C", ROOT, "show", rev + ":myq.py"]))
    return d


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=None)
    ap.add_argument("--old", default="e996a1f")
    ap.add_argument("--stores", default="files,sqlite")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--idle", type=float, default=30.0)
    ap.add_argument("--depths", default="1000,100000")
    ap.add_argument("--start-n", default="1000,100000")
    ap.add_argument("--start-runs", type=int, default=1,
                    help="callgrind's counts vary by ~0.5%%: one run each")
    ap.add_argument("--depth-runs", type=int, default=1)
    ap.add_argument("--fill-batch", type=int, default=5000,
                    help="jobs a call of enqueue_many when the depth's spool is "
                    "filled (one available_at each call: 100000 is an import "
                    "of one batch)")
    ap.add_argument("--no-flow", action="store_true")
    ap.add_argument("--no-strace", action="store_true")
    ap.add_argument("--no-start", action="store_true")
    ap.add_argument("--no-depth", action="store_true")
    ap.add_argument("--no-old", action="store_true",
                    help="this tree alone (a quick look: no old beside it)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    py = a.python or default_python()
    trees = [("old", old_tree(a.old))] if not a.no_old else []
    trees.append(("new", ROOT))
    stores = a.stores.split(",")
    res = {}

    def put(key, value):
        res.setdefault(key, []).append(value)

    print("python: %s; old: %s; runs: %d" % (py, a.old, a.runs), flush=True)
    for store in stores:
        if not a.no_flow:
            for r in range(a.runs):
                for name, tree in trees:
                    f = flow(py, tree, store, a.seconds, a.idle)
                    put((store, name, "ms_per_reading"), f["ms_per_reading"])
                    put((store, name, "idle_pct"), f["idle_pct"])
                    print(store, name, "flow", json.dumps(f), flush=True)
            if not a.no_strace:
                for name, tree in trees:
                    f = flow(py, tree, store, 20.0, 1.0, strace=True)
                    for k, v in f["per_reading"].items():
                        put((store, name, k + "_per_reading"), v)
                    print(store, name, "strace", json.dumps(f), flush=True)
        if not a.no_start:
            for n in [int(x) for x in a.start_n.split(",")]:
                for r in range(a.start_runs):
                    for name, tree in trees:
                        i = start_instr(py, tree, store, n)
                        put((store, name, "start_Minstr_%d" % n), i / 1e6)
                        print(store, name, "start", n, i, flush=True)
        if not a.no_depth:
            for n in [int(x) for x in a.depths.split(",")]:
                for r in range(a.depth_runs):
                    for name, tree in trees:
                        e, dr = depth(py, tree, store, n, a.fill_batch)
                        put((store, name, "enqueue_us_%d" % n), e * 1e6)
                        put((store, name, "drain_us_%d" % n), dr * 1e6)
                        print(store, name, "depth", n, e * 1e6, dr * 1e6, flush=True)
    table = {}
    for (store, name, k), v in sorted(res.items()):
        table.setdefault("%s %s" % (store, k), {})[name] = med(v)
    print("\n| %-34s | %12s | %12s |" % ("median of %d" % a.runs, "old", "new"))
    print("|%s|%s|%s|" % ("-" * 36, "-" * 14, "-" * 14))
    for k, v in table.items():
        print("| %-34s | %12s | %12s |" % (k, _fmt(v.get("old")), _fmt(v.get("new"))))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(table, f, indent=1)
    if not a.no_old:
        shutil.rmtree(trees[0][1], ignore_errors=True)


def _fmt(v):
    return "-" if v is None else ("%.4g" % v)


if __name__ == "__main__":
    main()
