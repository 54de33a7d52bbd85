#!/usr/bin/env python3
"""The CPU of an idle worker whose spool holds thousands of waiting jobs of
types it has no handler for (issue 36: "idle CPU with 8,000 jobs of types
without a handler is back at 3-6 % of a core"; the goal is under 1 %).

    python3 bench/idle.py [--n 8000] [--types N] [--store files|sqlite|both]
                          [--warm 300] [--after 0] [--window 20] [--runs 3]
                          [--python PY] [--profile FILE]

- N jobs (default 8,000) of --types distinct types (default: one type a
  job), none of which has a handler (an empty --handlers directory), are
  enqueued into a fresh spool (a temporary directory) before the worker
  starts.
- A real `myq worker` process takes them in: each type is held at its
  first job (myq(1) HANDLERS) and its jobs wait.  Once it has taken them
  all in (a hold logged for each type, at most --warm seconds; 2 s more)
  and --after seconds more, its CPU time (utime + stime of /proc/PID/stat,
  every thread) is read over --window seconds of idling.
- --runs spools per store, the median printed; the figure is the share of
  one core.  --profile FILE: one run a store instead, with the worker's
  measured window under cProfile (its stats written to FILE.STORE).
"""

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cpu_of(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def warmed(log, types, most):
    """Wait until the worker has taken every job in: a hold logged for
    each type (at most `most` seconds), then 2 s for the last ones' moves."""
    end = time.monotonic() + most
    while time.monotonic() < end:
        with open(log, "rb") as f:
            if f.read().count(b" event=hold dest=") >= types:
                break
        time.sleep(1.0)
    time.sleep(2.0)


def make_spool(py, store, n, types):
    tmp = tempfile.mkdtemp(prefix="myq-idle-")
    d = os.path.join(tmp, "spool")
    code = ("import sys; sys.path.insert(0, %r); import myq\n"
            "myq.main(['--spool', %r, 'init', '--store', %r])\n"
            "sp = myq.Spool(%r)\n"
            "for i in range(%d):\n"
            "    sp.enqueue('t%%05d' %% (i %% %d), i, sync=False)\n"
            "sp.close()\n" % (ROOT, d, store, d, n, types))
    subprocess.check_call([py, "-c", code], stdout=subprocess.DEVNULL)
    hd = os.path.join(tmp, "handlers")
    os.mkdir(hd)
    return tmp, d, hd


def one(py, store, args, profile=None):
    tmp, d, hd = make_spool(py, store, args.n, args.types)
    try:
        argv = ["--spool", d, "worker", "--handlers", hd]
        if profile:
            # the profiler runs over the measured window only: SIGUSR1
            # starts it, SIGUSR2 writes its stats
            code = ("import sys, signal, cProfile; sys.path.insert(0, %r)\n"
                    "import myq\n"
                    "pr = cProfile.Profile()\n"
                    "signal.signal(signal.SIGUSR1, lambda *a: pr.enable())\n"
                    "def stop(*a):\n"
                    "    pr.disable(); pr.dump_stats(%r)\n"
                    "signal.signal(signal.SIGUSR2, stop)\n"
                    "myq.main(%r)\n" % (ROOT, profile, argv))
            cmd = [py, "-c", code]
        else:
            cmd = [py, os.path.join(ROOT, "myq.py")] + argv
        log = os.path.join(tmp, "log")
        with open(log, "wb") as err:
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        try:
            warmed(log, args.types, args.warm)
            time.sleep(args.after)
            if profile:
                p.send_signal(signal.SIGUSR1)
            c0, t0 = cpu_of(p.pid), time.monotonic()
            time.sleep(args.window)
            c1, t1 = cpu_of(p.pid), time.monotonic()
            if profile:
                p.send_signal(signal.SIGUSR2)
                time.sleep(1.0)
        finally:
            p.terminate()
            p.wait()
        return 100.0 * (c1 - c0) / (t1 - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8000)
    ap.add_argument("--types", type=int, default=0,
                    help="distinct types (default: N, one a job)")
    ap.add_argument("--store", default="both")
    ap.add_argument("--warm", type=float, default=300.0)
    ap.add_argument("--after", type=float, default=0.0,
                    help="seconds idle before the window (the held types' "
                    "first probes come 5, 10, 20, ... 300 s after their hold)")
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--profile")
    args = ap.parse_args()
    args.types = args.types or args.n
    stores = ["files", "sqlite"] if args.store == "both" else [args.store]
    for store in stores:
        if args.profile:
            pct = one(args.python, store, args, args.profile + "." + store)
            print("%s: %.2f %% of a core (profiled: %s.%s)"
                  % (store, pct, args.profile, store))
            continue
        runs = [one(args.python, store, args) for _ in range(args.runs)]
        print("%s: idle CPU %.2f %% of a core (median of %s; %d jobs, %d "
              "types without a handler, %.0f s from %.0f s after the last hold)"
              % (store, statistics.median(runs),
                 ", ".join("%.2f" % r for r in runs), args.n, args.types,
                 args.window, args.after))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
