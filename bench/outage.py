#!/usr/bin/env python3
"""What an outage and a drain cost the flash (issue 37), on a 4 KiB-block
ext4 on a loop device (root: losetup, mkfs.ext4, mount).

    python3 bench/outage.py [--myq LABEL=PATH ...] [--jobs 2000,20000]
                            [--stores files,sqlite] [--runs 3]
                            [--window 30] [--probe-max 2] [--drain-jobs 2000]
                            [--skip outage,drain] [--dir DIR]

`make bench-wear` runs it after bench/peers.py's bytes per job.  Every
--myq (default: this checkout's myq.py as "this"; e.g. --myq
main=/work/main/myq.py to compare) is measured in the same run, the runs
interleaved, and each figure is the median of --runs.

- outage: a fresh ext4 (mkfs -b 4096) per measurement; a spool of the store
  with the field trial's policy `tele handler=http batch=100 batch_wait=5s
  gzip=true`; N jobs (enqueue_many) whose url is a closed port on 127.0.0.1
  (connection refused: a destination failure); one `myq worker` with
  --backoff-base 0.5 --probe-max P, its log on another filesystem (in the
  field the log goes to syslog, in RAM).  Once the destination is held and
  a probe has failed, two windows of --window seconds, each between an
  os.sync() and the next, reading the sectors written
  (/sys/block/loopN/stat, field 7) and the worker's CPU time
  (/proc/PID/stat): the first with probes every <= P seconds (k of them,
  from the log), the second after `myq pause tele` (no probe starts): what
  time alone costs (heartbeats, the status line, the records).  An hour
  of the field's outage (a probe every 30 s, --probe-max's default) is
  then honestly: the second window's rate * 3600 + (first - second) / k
  per probe * 120.  Printed beside it: the first window's rate * 3600,
  an upper bound (every probe counted 30/P times).  CPU is the worker's
  share of one core, the same way.  Then (--arrivals R, default 20, the
  soak's rate: fewer are lost in /proc's 10 ms ticks) a third window,
  resumed, while a producer enqueues R readings a second (Spool.enqueue,
  durable): the worker's CPU per arriving reading, over the first
  window's (the same hold, none arriving).
- drain: N jobs of a no-op --module style handler (enqueue_many, os.sync()),
  drained by Worker(...).run(drain=True) in a child (its log on another
  filesystem), then umount: the sectors written from after the enqueue's
  sync to after the umount, per job; beside it bench/run.py's floor_drain
  (rename into processing/, read, rename into done/, fsync done/ every 64)
  on the same files.  Files store only (the SQLite store's drain is
  bench/peers.py's).

Every device is checked before it is read: the mount point's st_dev must be
the loop device's (a stale mount, or another device, fails loudly).
"""
import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
POLICY = ["handler=http", "batch=100", "batch_wait=5s", "gzip=true"]
FIELD_PROBE = 30.0          # --probe-max's default: a probe every 30 s


def log(msg):
    sys.stderr.write("outage: %s\n" % msg)
    sys.stderr.flush()


class Device(object):
    """A fresh 4 KiB-block ext4 image on a loop device, mounted at `mnt`."""

    def __init__(self, work, mib):
        self.img = os.path.join(work, "fs.img")
        self.mnt = os.path.join(work, "mnt")
        with open(self.img, "wb") as f:
            f.truncate(mib << 20)
        self.dev = subprocess.check_output(
            ["losetup", "-f", "--show", self.img], universal_newlines=True).strip()
        self.name = os.path.basename(self.dev)
        self.mounted = False
        try:
            for _ in range(50):
                p = subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-E",
                                    "lazy_itable_init=0,lazy_journal_init=0",
                                    self.dev], stderr=subprocess.PIPE,
                                   universal_newlines=True)
                if p.returncode == 0:
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError("mkfs.ext4 %s: %s" % (self.dev, p.stderr))
            os.makedirs(self.mnt, exist_ok=True)
            if os.path.ismount(self.mnt):
                raise RuntimeError("%s is mounted already (a stale mount)" % self.mnt)
            subprocess.check_call(["mount", "-t", "ext4", self.dev, self.mnt])
            self.mounted = True
            self.check()
        except BaseException:
            self.close()
            raise

    def check(self):
        """Fail loudly unless mnt is this loop device's filesystem."""
        with open("/sys/block/%s/dev" % self.name) as f:
            major, minor = (int(x) for x in f.read().split(":"))
        st = os.stat(self.mnt)
        if st.st_dev != os.makedev(major, minor):
            raise RuntimeError("%s is not on %s (st_dev %d:%d, the device is "
                               "%d:%d): a stale mount or the wrong device" % (
                                   self.mnt, self.dev, os.major(st.st_dev),
                                   os.minor(st.st_dev), major, minor))
        with open("/sys/block/%s/loop/backing_file" % self.name) as f:
            if os.path.realpath(f.read().strip()) != os.path.realpath(self.img):
                raise RuntimeError("%s is backed by another file" % self.dev)

    def sectors(self):
        if self.mounted:
            self.check()
        with open("/sys/block/%s/stat" % self.name) as f:
            return int(f.read().split()[6])

    def umount(self):
        if self.mounted:
            subprocess.check_call(["umount", self.mnt])
            self.mounted = False

    def close(self):
        try:
            self.umount()
        finally:
            subprocess.call(["losetup", "-d", self.dev])
            try:
                os.unlink(self.img)
            except OSError:
                pass


def closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()               # nothing listens there: connection refused
    return port


def cpu_of(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / float(os.sysconf("SC_CLK_TCK"))


ENQUEUE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import myq
sp = getattr(myq, 'open_store', myq.Spool)(sys.argv[2])
n, url = int(sys.argv[3]), sys.argv[4]
for first in range(0, n, 1000):
    sp.enqueue_many([{"type": sys.argv[5], "payload": {"url": url, "body": {
        "sensor": "t%d" % (i % 8), "n": i, "v": 21.5 + i % 7}}}
        for i in range(first, min(n, first + 1000))])
"""


def myq_cmd(myq, spool, *args):
    return [sys.executable, myq, "--spool", spool] + list(args)


def outage_once(myq, store, n, o, work):
    dev = Device(work, 256 if n <= 5000 else 768)
    logf = os.path.join(work, "worker.log")
    w = None
    try:
        spool = os.path.join(dev.mnt, "spool")
        subprocess.check_call(myq_cmd(myq, spool, "init", "--store", store))
        subprocess.check_call(myq_cmd(myq, spool, "policy", "tele", *POLICY),
                              stdout=subprocess.DEVNULL)
        url = "http://127.0.0.1:%d/ingest" % closed_port()
        subprocess.check_call([sys.executable, "-c", ENQUEUE,
                               os.path.dirname(os.path.abspath(myq)), spool,
                               str(n), url, "tele"])
        with open(logf, "w") as lf:
            w = subprocess.Popen(myq_cmd(myq, spool, "worker", "--backoff-base",
                                         "0.5", "--probe-max", str(o.probe_max)),
                                 stdout=lf, stderr=lf)
        # held, and a probe failed since: the outage's steady state
        deadline = time.monotonic() + 120
        while True:
            text = open(logf).read()
            at = text.find("event=hold")
            if at >= 0 and text.count("event=probe", at) >= 2:
                break
            if w.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("no hold and probe within 120 s:\n" + text[-2000:])
            time.sleep(0.2)
        time.sleep(1.0)
        probes = [0]

        def window():
            os.sync()
            s0, c0, t0 = dev.sectors(), cpu_of(w.pid), time.monotonic()
            p0 = open(logf).read().count("event=probe")
            time.sleep(o.window)
            os.sync()
            s1, c1, t1 = dev.sectors(), cpu_of(w.pid), time.monotonic()
            text = open(logf).read()
            probes[0] = text.count("event=probe") - p0
            if w.poll() is not None:
                raise RuntimeError("the worker exited:\n" + text[-2000:])
            return (s1 - s0) * 512.0 / (t1 - t0), (c1 - c0) / (t1 - t0)
        w1, cpu1 = window()             # probes every <= P seconds
        k = probes[0]
        # the same, paused (`myq pause`: no probe starts): what time alone
        # costs (heartbeats, the status line, the hold's bookkeeping)
        subprocess.check_call(myq_cmd(myq, spool, "pause", "tele"),
                              stdout=subprocess.DEVNULL)
        time.sleep(2.0)
        w2, cpu2 = window()
        if probes[0]:
            raise RuntimeError("%d probes while paused" % probes[0])
        per_probe = max(0.0, (w1 - w2) * o.window / max(1, k))
        cpu_probe = max(0.0, (cpu1 - cpu2) * o.window / max(1, k))
        field = 3600.0 / FIELD_PROBE
        got = {"mb_per_h": (w2 * 3600 + per_probe * field) / 1e6,
               "cpu_pct": (cpu2 * 3600 + cpu_probe * field) / 36.0,
               "upper_mb_per_h": w1 * 3600 / 1e6, "kb_per_probe": per_probe / 1e3,
               "probes": k, "window_s": o.window}
        if o.arrivals:
            # held again (resumed), readings arriving: the worker's CPU per
            # arriving job, beside the first window's (the same, none)
            subprocess.check_call(myq_cmd(myq, spool, "resume", "tele"),
                                  stdout=subprocess.DEVNULL)
            p = subprocess.Popen([sys.executable, "-c", ARRIVE,
                                  os.path.dirname(os.path.abspath(myq)), spool,
                                  url, str(o.arrivals)])
            try:
                time.sleep(2.0)
                w3, cpu3 = window()
            finally:
                p.kill()
                p.wait()
            got["cpu_ms_per_arrival"] = max(0.0, cpu3 - cpu1) / o.arrivals * 1e3
        return got
    finally:
        if w is not None and w.poll() is None:
            w.send_signal(signal.SIGTERM)
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        dev.close()


ARRIVE = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import myq
sp, url, rate = getattr(myq, 'open_store', myq.Spool)(sys.argv[2]), sys.argv[3], float(sys.argv[4])
t, i = time.monotonic(), 0
while True:
    sp.enqueue("tele", {"url": url, "body": {"sensor": "a", "n": i, "v": 1.5}})
    i += 1
    t += 1.0 / rate
    time.sleep(max(0.0, t - time.monotonic()))
"""


DRAIN = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
mode, spool, logf = sys.argv[2], sys.argv[3], sys.argv[4]
if mode == "floor":
    sys.path.insert(0, sys.argv[5])
    import run
    n, _ = run.floor_drain(spool)
else:
    import myq
    w = myq.Worker(spool, handlers={"noop": lambda job: None},
                   log=myq.Log(path=logf))
    w.run(drain=True)
    n = len(os.listdir(os.path.join(spool, "done")))
print(json.dumps({"n": n}))
"""


def drain_once(myq, mode, n, work):
    dev = Device(work, 256)
    try:
        spool = os.path.join(dev.mnt, "spool")
        subprocess.check_call(myq_cmd(myq, spool, "init"))
        subprocess.check_call([sys.executable, "-c", ENQUEUE,
                               os.path.dirname(os.path.abspath(myq)), spool,
                               str(n), "http://127.0.0.1:1/", "noop"])
        os.sync()
        s0 = dev.sectors()
        out = subprocess.check_output([sys.executable, "-c", DRAIN,
                                       os.path.dirname(os.path.abspath(myq)),
                                       mode, spool, os.path.join(work, "drain.log"),
                                       HERE], universal_newlines=True)
        got = json.loads(out.strip().splitlines()[-1])["n"]
        if got != n:
            raise RuntimeError("%s drained %d of %d" % (mode, got, n))
        dev.umount()
        s1 = dev.sectors()
        return (s1 - s0) * 512.0 / n
    finally:
        dev.close()


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--myq", action="append", default=[],
                    help="LABEL=PATH of a myq.py (default: this=./myq.py)")
    ap.add_argument("--jobs", default="2000,20000")
    ap.add_argument("--stores", default="files,sqlite")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--probe-max", type=float, default=2.0)
    ap.add_argument("--drain-jobs", type=int, default=2000)
    ap.add_argument("--arrivals", type=float, default=20.0,
                    help="readings a second in a third window (0: none)")
    ap.add_argument("--skip", default="")
    ap.add_argument("--dir", default=None, help="where the images go")
    ap.add_argument("--json", default=None, help="write the figures here")
    o = ap.parse_args()
    if os.geteuid() != 0:
        log("skipped: needs root (losetup, mkfs.ext4, mount)")
        return 0
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if not shutil.which(tool):
            log("skipped: %s not found" % tool)
            return 0
    myqs = [tuple(m.split("=", 1)) for m in o.myq] or [
        ("this", os.path.join(ROOT, "myq.py"))]
    skip = set(o.skip.split(","))
    res = {}
    for r in range(o.runs):
        for label, path in myqs:
            for store in ([] if "outage" in skip else o.stores.split(",")):
                for n in [int(x) for x in o.jobs.split(",")]:
                    work = tempfile.mkdtemp(prefix="myq-outage-", dir=o.dir)
                    try:
                        got = outage_once(path, store, n, o, work)
                    finally:
                        shutil.rmtree(work, ignore_errors=True)
                    res.setdefault(("outage", label, store, n), []).append(got)
                    log("run %d %s %s N=%d: %.1f MB/h (upper bound %.1f), %.3f%% "
                        "CPU, %.1f KB/probe, %d probes in %.0f s" % (
                            r + 1, label, store, n, got["mb_per_h"],
                            got["upper_mb_per_h"], got["cpu_pct"],
                            got["kb_per_probe"], got["probes"], got["window_s"]))
            for mode in ([] if "drain" in skip else ("myq", "floor")):
                work = tempfile.mkdtemp(prefix="myq-drain-", dir=o.dir)
                try:
                    b = drain_once(path, mode, o.drain_jobs, work)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                res.setdefault(("drain", label, mode), []).append(b)
                log("run %d %s drain %s: %.2f KB/job" % (r + 1, label, mode, b / 1e3))
    print("\noutage (4 KiB ext4, closed port, %s; an hour of the field's "
          "outage, a probe every %gs, from windows of %gs with probes every "
          "<= %gs and paused; medians of %d)" % (
              " ".join(POLICY), FIELD_PROBE, o.window, o.probe_max, o.runs))
    print("%-8s %-7s %7s %10s %8s %10s %9s %7s %12s" % (
        "myq", "store", "held", "MB/h", "CPU %", "upper MB/h", "KB/probe",
        "probes", "ms/arrival"))
    out = {}
    for key in sorted(k for k in res if k[0] == "outage"):
        rs = res[key]
        mb, cpu = med([x["mb_per_h"] for x in rs]), med([x["cpu_pct"] for x in rs])
        pr = med([x["probes"] for x in rs])
        up = med([x["upper_mb_per_h"] for x in rs])
        kb = med([x["kb_per_probe"] for x in rs])
        arr = med([x["cpu_ms_per_arrival"] for x in rs
                   if "cpu_ms_per_arrival" in x])
        print("%-8s %-7s %7d %10.1f %8.2f %10.1f %9.1f %7d %12.2f" % (
            key[1], key[2], key[3], mb, cpu, up, kb, pr, arr))
        out["outage %s %s %d" % key[1:]] = {"mb_per_h": mb, "cpu_pct": cpu,
                                            "upper_mb_per_h": up,
                                            "kb_per_probe": kb, "probes": pr,
                                            "cpu_ms_per_arrival": arr,
                                            "runs": rs}
    for label, _ in myqs:
        m, f = res.get(("drain", label, "myq")), res.get(("drain", label, "floor"))
        if m and f:
            ratio = med([a / b for a, b in zip(m, f)])
            print("drain %s, files: %.2f KB/job, floor %.2f KB/job: %.2fx the "
                  "floor (goal <= 1.1x; medians of %d, N=%d)" % (
                      label, med(m) / 1e3, med(f) / 1e3, ratio, len(m), o.drain_jobs))
            out["drain " + label] = {"myq": m, "floor": f, "ratio": ratio}
    if o.json:
        with open(o.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
