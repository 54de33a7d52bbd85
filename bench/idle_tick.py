#!/usr/bin/env python3
"""What an idle worker's poll tick costs (issue 42 item 2: an idle worker
is to cost at most 0.05 % of a core), old code beside new.

    python3 bench/idle_tick.py [--old REV] [--stores files,sqlite]
                               [--what ir,syscalls,cpu] [--runs 3]
                               [--seconds 20] [--python PY]

A worker (`worker --stats-interval 0`) on an empty spool of its own on
tmpfs (init, then `policy fwd handler=http batch=100 batch_wait=5s
gzip=true`, as bench/flow.py's), nothing queued, nothing running:

- ir: user-space instructions per idle second, callgrind of the whole
  process over 26 s and over 16 s after its `event=start`, the difference
  / 10 (what comes once after a start, such as a first reap's imports,
  cancels out; deterministic to ~1 %; a bare Python loop of select()
  with a 1 s timeout costs ~400);
- syscalls: the same spans under `strace -f -c`, per second, by call;
- cpu: its CPU time (schedstat: user + kernel, every thread) over
  --seconds from 8 s after its start, as a share of one core; the old
  and the new worker run at once, the median of --runs (an idle
  worker's CPU is mostly its caches gone cold while it slept: on this
  VM 0.1 % or 1 % of a core by the hour, the same code).

Old: `git show REV:myq.py` (default main); new: this tree's myq.py.
"""

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
BASE = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def spool(py, myq, store, env):
    d = tempfile.mkdtemp(prefix="idle-tick-", dir=BASE)
    sp = os.path.join(d, "s")
    subprocess.check_call([py, myq, "--spool", sp, "init", "--store", store],
                          env=env, stdout=subprocess.DEVNULL)
    subprocess.check_call([py, myq, "--spool", sp, "policy", "fwd", "handler=http",
                           "batch=100", "batch_wait=5s", "gzip=true"], env=env,
                          stdout=subprocess.DEVNULL)
    # (imported, not run as a script: a script's start may run itself
    # again from its byte code, an exec that valgrind does not follow)
    argv = [py, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import myq; "
            "sys.exit(myq.main(sys.argv[2:]))", os.path.dirname(myq),
            "--spool", sp, "worker", "--log", os.path.join(d, "log"),
            "--stats-interval", "0"]
    return d, argv


def started(d, most=300):
    """The worker's pid, once its log says it started."""
    end = time.monotonic() + most
    while time.monotonic() < end:
        try:
            with open(os.path.join(d, "log"), "rb") as f:
                m = re.search(rb"event=start .*pid=(\d+)", f.read())
            if m:
                return int(m.group(1))
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the worker did not start")


def cpu_ns(pid):
    total = 0
    for t in os.listdir("/proc/%d/task" % pid):
        with open("/proc/%d/task/%s/schedstat" % (pid, t)) as f:
            total += int(f.read().split()[0])
    return total


def under(tool, out, py, myq, store, env, seconds):
    """Run the worker under `tool` (callgrind, strace) for `seconds` after
    its start; the tool's output file."""
    d, argv = spool(py, myq, store, env)
    path = os.path.join(d, "out")
    pre = (["valgrind", "--tool=callgrind", "--callgrind-out-file=" + path]
           if tool == "callgrind" else ["strace", "-f", "-c", "-o", path])
    p = subprocess.Popen(pre + argv, env=env, stderr=subprocess.DEVNULL)
    try:
        pid = started(d)
        time.sleep(seconds)
        os.kill(pid, signal.SIGTERM)        # (strace itself ignores it)
        p.wait()
        with open(path) as f:
            return f.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        shutil.rmtree(d, ignore_errors=True)


def ir(py, myq, store, env):
    def total(text):
        m = re.search(r"^(?:summary|totals):\s*(\d+)", text, re.M)
        if m is None:
            raise SystemExit("no callgrind totals: %r" % text[:300])
        return int(m.group(1))
    a = total(under("callgrind", None, py, myq, store, env, 26))
    b = total(under("callgrind", None, py, myq, store, env, 16))
    return (a - b) / 10.0


def syscalls(py, myq, store, env):
    def calls(text):
        out = {}
        for line in text.splitlines():
            f = line.split()
            if len(f) >= 5 and f[-1].isidentifier() and f[-1] != "total" \
                    and f[3].isdigit():
                out[f[-1]] = int(f[3])
        return out
    a = calls(under("strace", None, py, myq, store, env, 26))
    b = calls(under("strace", None, py, myq, store, env, 16))
    diff = dict((k, (a.get(k, 0) - b.get(k, 0)) / 10.0) for k in set(a) | set(b))
    return dict((k, v) for k, v in sorted(diff.items()) if v)


def cpu(py, trees, store, env, seconds, warm=8.0):
    """{name: the worker's share of a core over `seconds`}, a worker of
    each tree at once (the same load on the machine: an idle worker's CPU
    here is mostly its caches and TLB gone cold in the second it slept,
    which other processes decide), `warm` seconds after their start (past
    the first prune).  warm=None: a start alone, which fills the
    byte-code cache the measured runs then find."""
    ws = {}
    try:
        for name, myq in trees:
            d, argv = spool(py, myq, store, env)
            ws[name] = (d, subprocess.Popen(argv, env=env))
        for d, w in ws.values():
            started(d)
        if warm is None:
            return None
        time.sleep(warm)
        c0 = dict((n, cpu_ns(w.pid)) for n, (d, w) in ws.items())
        t0 = time.monotonic()
        time.sleep(seconds)
        c1 = dict((n, cpu_ns(w.pid)) for n, (d, w) in ws.items())
        t1 = time.monotonic()
        return dict((n, (c1[n] - c0[n]) / 1e9 / (t1 - t0) * 100) for n in ws)
    finally:
        for d, w in ws.values():
            w.terminate()
            w.wait()
            shutil.rmtree(d, ignore_errors=True)


def main():
    import flow
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="main")
    ap.add_argument("--stores", default="files,sqlite")
    ap.add_argument("--what", default="ir,syscalls,cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--python", default=None)
    a = ap.parse_args()
    py = a.python or flow.default_python()
    env = flow.child_env()
    tmp = tempfile.mkdtemp(prefix="idle-tick-old-")
    try:
        old = os.path.join(tmp, "myq.py")
        with open(old, "wb") as f:
            f.write(subprocess.check_output(["git", "show", a.old + ":myq.py"],
                                            cwd=ROOT))
        trees = [("old", old), ("new", os.path.join(ROOT, "myq.py"))]
        what = a.what.split(",")
        for store in a.stores.split(","):
            cpu(py, trees, store, env, 0, warm=None)
            for name, myq in trees:
                if "ir" in what:
                    print("%s %-6s instructions per idle second: %d"
                          % (store, name, ir(py, myq, store, env)), flush=True)
                if "syscalls" in what:
                    calls = syscalls(py, myq, store, env)
                    print("%s %-6s system calls per idle second: %.1f %s"
                          % (store, name, sum(calls.values()), calls), flush=True)
            if "cpu" in what:
                got = dict((name, []) for name, _ in trees)
                for _ in range(a.runs):
                    for name, share in cpu(py, trees, store, env,
                                           a.seconds).items():
                        got[name].append(share)
                for name, _ in trees:
                    print("%s %-6s CPU of an idle worker: %.3f %% of a core "
                          "(median of %s)" % (store, name, statistics.median(got[name]),
                                              " ".join("%.3f" % x for x in got[name])),
                          flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
