#!/usr/bin/env python3
"""Flash written per delivered job, RAM first (SPEC §13, issue 40) against
durable, side by side in one run (root: losetup, mkfs.ext4, mount).

    python3 bench/wear.py [--myq PATH] [--stores files,sqlite]
                          [--modes always,outage] [--links up,down]
                          [--rate 1] [--seconds 60] [--idle 30] [--runs 3]
                          [--parallel 4] [--url job|policy]
                          [--ubifs] [--fs ext4|ubifs] [--json FILE]

`make bench-wear` runs it first.  For every store, durability mode and
link state, in every run (the cases interleaved, a fresh filesystem each):

- a fresh 4 KiB-block ext4 on a loop device (bench/outage.py's Device: the
  mount point proven the loop device's, its backing file ours) holds the
  spool; sectors written are read from /sys/block/loopN/stat (field 7)
  after an os.sync().  Before each case a canary (1 MiB written and
  fsync'd into the spool's filesystem) must show up in that counter, and
  the spool's st_dev must be the device's: a stale mount or the wrong
  device fails the run loudly, it is never measured.
- the spool gets the field trial's policy `tele handler=http batch=100
  batch_wait=5s gzip=true`; `durable=outage` also `myq init --ram DIR`
  and `durable=outage` on the type (DIR on a tmpfs of its own, checked
  by statfs); `always` is today's default, no key set.  The url is each
  job's (`{"url", "body"}`), or with --url policy the type's `url=`.
- link up: the jobs' url is a local HTTP receiver answering 200 (it counts
  the ids of X-Myq-Ids: every job must arrive).  Link down: a closed port
  (connection refused); a producer of 2 readings a second runs until the
  worker's breaker holds the destination (3 batches failed), then the
  windows run with the hold in place (the RAM tier spills to the spool).
  The worker has the field's defaults (--backoff-base 5 s, --probe-max
  30 s): the hold's first probe comes 20 s after it, then every 30 s, so
  a 30 s window holds about one probe, as an hour of a real outage does.
- one `myq worker`, its log on the tmpfs (syslog on a device: RAM); the
  log's bytes a job are printed apart.  Two windows, each between two
  os.sync()s: idle (--idle s, no producer: what time alone costs, the
  heartbeats, probes and records) and load (a producer of --rate readings
  a second for --seconds, one `enqueue` API call each, as a sensor script
  would; the window ends when every job has arrived (up) or the RAM tier
  is empty and every job is in the spool (down)).

Per job: the load window's bytes over its jobs (gross), and less the idle
rate over the same time (net: the jobs' own).  A day at one reading a
second = (idle rate + net bytes a job * 1/s) * 86,400.  The producer runs
at the field's rate, not faster: a spill's batch, the RAM tier's point,
holds what arrived while it waited, so bytes a job depend on the rate.
The cases of a run go --parallel at once, each on its own device.  Goals
(issue 40): outage with the link up <= 1/20 of always (the day figures,
and the net per job); outage with the link down <= always with the link
down.

--ubifs: the same in a QEMU guest (tests/powercut/vm.py: TCG, Debian's
kernel) on UBIFS on nandsim (64 MiB, 2 KiB pages, 128 KiB erase blocks,
a fresh NAND for each case), the bytes programmed counted by a kprobe on
mtd_write (tests/powercut/ubifs_guest.py's way); one run by default
(--ubifs-runs), the guest is ~7x slower.  --fs ubifs is that guest side.
"""
import argparse
import gzip
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
sys.path.insert(0, HERE)
from outage import Device, closed_port  # noqa: E402

POLICY = ["handler=http", "batch=100", "batch_wait=5s", "gzip=true"]
DAY = 86400.0
TMPFS_MAGIC, RAMFS_MAGIC = 0x01021994, 0x858458f6


def log(msg):
    sys.stderr.write("wear: %s\n" % msg)
    sys.stderr.flush()


# The devices #################################################################

class Ext4(object):
    """bench/outage.py's Device (fresh 4 KiB ext4 on a loop device) and a
    byte counter that refuses to read anything but that device."""
    name = "ext4"

    def __init__(self, work):
        self.d = Device(work, 256)
        self.mnt = self.d.mnt
        self.st_dev = os.stat(self.mnt).st_dev

    def written(self):
        """Bytes written to the device since it was made."""
        return self.d.sectors() * 512

    def check(self, path):
        self.d.check()
        if os.stat(path).st_dev != self.st_dev:
            raise RuntimeError("%s is not on %s: the wrong device" % (path, self.d.dev))

    def close(self):
        self.d.close()


TRACE = "/sys/kernel/tracing"


def sh(cmd):
    p = subprocess.run(cmd, shell=True, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, universal_newlines=True)
    if p.returncode:
        raise RuntimeError("%s: %s" % (cmd, p.stdout[-500:]))
    return p.stdout


class Ubifs(object):
    """In the guest: a fresh nandsim NAND -> UBI -> UBIFS at mnt; the bytes
    programmed (mtd_write's len, a kprobe) since it was made."""
    name = "ubifs"
    MNT = "/run/mnt-wear"

    def __init__(self, work):
        for m in ("lzo", "zstd", "ubifs", "ubi"):
            subprocess.call(["modprobe", m])
        sh("rmmod nandsim 2>/dev/null; modprobe nandsim first_id_byte=0x20 "
           "second_id_byte=0xa2 third_id_byte=0x00 fourth_id_byte=0x15")
        with open("/proc/mtd") as f:
            mtds = f.read().splitlines()[1:]
        if len(mtds) != 1 or "NAND simulator" not in mtds[0]:
            raise RuntimeError("/proc/mtd is not nandsim's alone: %s" % mtds)
        self.mnt = self.MNT
        os.makedirs(self.mnt, exist_ok=True)
        if os.path.ismount(self.mnt):
            raise RuntimeError("%s is mounted already (a stale mount)" % self.mnt)
        if not os.path.exists(TRACE + "/kprobe_events"):
            sh("mount -t tracefs tracefs " + TRACE)
        if not os.path.exists(TRACE + "/events/kprobes/wearw"):
            sh("echo 'p:wearw mtd_write to=%si:u64 len=%dx:u64' >> "
               + TRACE + "/kprobe_events")
        sh("echo 0 > {t}/events/kprobes/wearw/enable; echo 16384 > "
           "{t}/buffer_size_kb; echo > {t}/trace; echo 1 > "
           "{t}/events/kprobes/wearw/enable".format(t=TRACE))
        sh("ubiattach -m 0 -d 0 && ubimkvol /dev/ubi0 -N spool -m && "
           "mount -t ubifs ubi0:spool " + self.mnt)
        self.st_dev = os.stat(self.mnt).st_dev

    def written(self):
        with open(TRACE + "/per_cpu/cpu0/stats") as f:
            for line in f:
                if line.startswith("overrun:") and int(line.split()[1]):
                    raise RuntimeError("the trace lost events: %s" % line)
        n = 0
        with open(TRACE + "/trace") as f:
            for line in f:
                if " wearw: " in line and "len=" in line:
                    n += int(line.rsplit("len=", 1)[1].split()[0], 0)
        return n

    def check(self, path):
        with open("/proc/self/mountinfo") as f:
            mine = [ln.split() for ln in f if ln.split()[4] == self.mnt]
        if len(mine) != 1 or "ubifs" not in mine[0] or "ubi0:spool" not in mine[0]:
            raise RuntimeError("%s is not ubi0:spool alone: %s" % (self.mnt, mine))
        if os.stat(path).st_dev != self.st_dev:
            raise RuntimeError("%s is not on %s" % (path, self.mnt))

    def close(self):
        subprocess.call(["umount", self.mnt])
        subprocess.call(["ubidetach", "-m", "0"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
        subprocess.call(["rmmod", "nandsim"])


def canary(dev, where):
    """1 MiB written and fsync'd into `where` must reach the counter: else
    the counter is not this filesystem's device."""
    dev.check(where)
    os.sync()
    b0 = dev.written()
    path = os.path.join(where, ".wear-canary")
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    b1 = dev.written()
    os.unlink(path)
    os.sync()
    if b1 - b0 < (1 << 20):
        raise RuntimeError("1 MiB fsync'd into %s showed %d bytes on the counted "
                           "device: the wrong device" % (where, b1 - b0))


def ram_fs(path):
    """The statfs magic of `path` (tmpfs/ramfs for a RAM tier)."""
    out = subprocess.check_output(["stat", "-f", "-c", "%t", path],
                                  universal_newlines=True)
    return int(out.strip(), 16)


# The receiver ################################################################

class Receiver(object):
    """A local HTTP/1.1 server answering 200; the set of job ids received."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        rx = self
        self.ids, self.requests, self.lock = set(), 0, threading.Lock()

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                ids = self.headers.get("X-Myq-Ids")
                if ids is None:         # one job, no batch: its Idempotency-Key
                    ids = self.headers.get("Idempotency-Key", "")
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                json.loads(body.decode("utf-8"))
                with rx.lock:
                    rx.ids.update(x for x in ids.split(",") if x)
                    rx.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.url = "http://127.0.0.1:%d/ingest" % self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def count(self):
        with self.lock:
            return len(self.ids)

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


PRODUCE = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import myq
sp = getattr(myq, 'open_store', myq.Spool)(sys.argv[2])
url, rate, n = sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
own = sys.argv[6:] != ["policy"]        # (else the type's policy has the url)
t = time.monotonic()
for i in range(n):
    body = {"sensor": "t%d" % (i % 8), "n": i, "v": 21.5 + i % 7}
    sp.enqueue("tele", {"url": url, "body": body} if own else body)
    t += 1.0 / rate
    time.sleep(max(0.0, t - time.monotonic()))
"""


# One case ####################################################################

def myq_cmd(myq, spool, *args):
    return [sys.executable, myq, "--spool", spool] + list(args)


def stats(myq, spool):
    return json.loads(subprocess.check_output(myq_cmd(myq, spool, "stats", "--json")))


def wait_for(what, pred, timeout, w, logf):
    deadline = time.monotonic() + timeout
    while not pred():
        if w.poll() is not None:
            raise RuntimeError("the worker exited waiting for %s:\n%s" % (
                what, open(logf).read()[-2000:]))
        if time.monotonic() > deadline:
            raise RuntimeError("no %s within %d s:\n%s" % (
                what, timeout, open(logf).read()[-2000:]))
        time.sleep(0.2)


def produce(myq, spool, url, rate, n, where="job"):
    subprocess.check_call([sys.executable, "-c", PRODUCE,
                           os.path.dirname(os.path.abspath(myq)), spool, url,
                           str(rate), str(n), where])


def waiting(myq, spool):
    s = stats(myq, spool)
    return s["ready"] + s["processing"] + s.get("scheduled", 0)


def settled(myq, spool, total):
    """Down: the RAM tier empty (no key: no RAM tier) and all `total` jobs
    waiting in the spool."""
    s = stats(myq, spool)
    return s.get("ram", 0) == 0 and (
        s["ready"] + s["processing"] + s.get("scheduled", 0)) >= total


def case(myq, fs, store, mode, link, o, work):
    """Bytes written (idle window, load window) and the log's bytes, one case."""
    dev = (Ubifs if fs == "ubifs" else Ext4)(work)
    tmp = tempfile.mkdtemp(prefix="wear-", dir=o.tmpfs)
    rx, w = None, None
    logf = os.path.join(tmp, "worker.log")
    try:
        spool = os.path.join(dev.mnt, "spool")
        subprocess.check_call(myq_cmd(myq, spool, "init", "--store", store),
                              stdout=subprocess.DEVNULL)
        pol = list(POLICY)
        if mode == "outage":
            ram = os.path.join(tmp, "ram")
            if ram_fs(tmp) not in (TMPFS_MAGIC, RAMFS_MAGIC):
                raise RuntimeError("%s is not on a RAM filesystem" % tmp)
            subprocess.check_call(myq_cmd(myq, spool, "init", "--ram", ram),
                                  stdout=subprocess.DEVNULL)
            pol.append("durable=outage")
        if link == "up":
            rx = Receiver()
            url = rx.url
        else:
            url = "http://127.0.0.1:%d/ingest" % closed_port()
        if o.url == "policy":
            pol.append("url=" + url)
        subprocess.check_call(myq_cmd(myq, spool, "policy", "tele", *pol),
                              stdout=subprocess.DEVNULL)
        canary(dev, spool)
        w = subprocess.Popen(myq_cmd(myq, spool, "worker", "--log", logf),
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_for("start", lambda: os.path.exists(logf) and
                 "event=start" in open(logf).read(), 60, w, logf)
        # warm up: the http path loaded and a connection made (up), the
        # destination held and what came before it spilled (down)
        if link == "up":
            warm = 3
            produce(myq, spool, url, 10.0, warm, o.url)
            wait_for("delivery", lambda: rx.count() >= warm, 60, w, logf)
        else:
            # readings until the breaker holds the destination (3 batches
            # failed in a row), then every one of them in the spool
            p = subprocess.Popen([sys.executable, "-c", PRODUCE,
                                  os.path.dirname(os.path.abspath(myq)), spool,
                                  url, "2", "1000", o.url])
            try:
                wait_for("hold", lambda: "event=hold" in open(logf).read(),
                         120, w, logf)
            finally:
                p.kill()
                p.wait()
            wait_for("the spill", lambda: settled(myq, spool, 0), 60, w, logf)
            warm = waiting(myq, spool)
        time.sleep(1.0)
        dev.check(spool)

        def window(body):
            os.sync()
            b0, t0, l0 = dev.written(), time.monotonic(), os.path.getsize(logf)
            body()
            os.sync()
            dev.check(spool)
            return (dev.written() - b0, time.monotonic() - t0,
                    os.path.getsize(logf) - l0)
        ib, it, _ = window(lambda: time.sleep(o.idle))
        n = int(round(o.rate * o.seconds))

        def load():
            produce(myq, spool, url, o.rate, n, o.url)
            if link == "up":
                wait_for("delivery", lambda: rx.count() >= warm + n, 120, w, logf)
            else:
                wait_for("the spill", lambda: settled(myq, spool, warm + n), 120,
                         w, logf)
        lb, lt, lg = window(load)
        if w.poll() is not None:
            raise RuntimeError("the worker exited:\n" + open(logf).read()[-2000:])
        idle_rate = ib / it
        return {"jobs": n, "idle_Bps": idle_rate, "load_B": lb, "load_s": lt,
                "gross_B_job": lb / float(n),
                "net_B_job": max(0.0, lb - idle_rate * lt) / n,
                "log_B_job": lg / float(n),
                "requests": rx.requests if rx else None}
    finally:
        if w is not None and w.poll() is None:
            w.terminate()
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        if rx is not None:
            rx.close()
        dev.close()
        shutil.rmtree(tmp, ignore_errors=True)


def day(r):
    """Bytes a day at one reading a second."""
    return (r["idle_Bps"] + r["net_B_job"]) * DAY


# Report ######################################################################

def med(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt_b(b):
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= div:
            return "%.2f %s" % (b / div, unit)
    return "%.0f B" % b


def report(res, o, fs):
    print("\nflash written per delivered job, %s (%s; producer %g/s for %gs, "
          "idle window %gs; medians of %d)" % (
              "4 KiB ext4 on a loop device" if fs == "ext4" else
              "UBIFS on nandsim (QEMU guest)", " ".join(POLICY), o.rate,
              o.seconds, o.idle, max(len(v) for v in res.values())))
    print("%-7s %-7s %-5s %11s %11s %9s %10s %12s" % (
        "store", "durable", "link", "gross B/job", "net B/job", "idle B/s",
        "log B/job", "a day at 1/s"))
    out = {}
    for key in sorted(res):
        rs = res[key]
        f = {k: med([r[k] for r in rs]) for k in
             ("gross_B_job", "net_B_job", "idle_Bps", "log_B_job")}
        f["day_B"] = med([day(r) for r in rs])
        f["runs"] = rs
        out[key] = f
        print("%-7s %-7s %-5s %11.0f %11.0f %9.1f %10.0f %12s" % (
            key[0], key[1], key[2], f["gross_B_job"], f["net_B_job"],
            f["idle_Bps"], f["log_B_job"], fmt_b(f["day_B"])))
    for store in o.stores.split(","):
        a_up, r_up = out.get((store, "always", "up")), out.get((store, "outage", "up"))
        a_dn, r_dn = out.get((store, "always", "down")), out.get((store, "outage", "down"))
        if a_up and r_up:
            x = r_up["day_B"] / a_up["day_B"]
            y = r_up["net_B_job"] / max(1.0, a_up["net_B_job"])
            print("goal %s link up, outage <= 1/20 of always: a day %.4f (1/%.0f), "
                  "net a job %.4f: %s" % (store, x, 1 / x if x else float("inf"), y,
                                          "pass" if max(x, y) <= 0.05 else "MISS"))
        if a_dn and r_dn:
            x = r_dn["net_B_job"] / max(1.0, a_dn["net_B_job"])
            print("goal %s link down, outage <= always: net a job %.2fx, a day "
                  "%.2fx: %s" % (store, x, r_dn["day_B"] / a_dn["day_B"],
                                 "pass" if x <= 1.0 else "MISS"))
    return {"%s %s %s %s" % ((fs,) + k): v for k, v in out.items()}


# The UBIFS guest #############################################################

def ubifs_on_host(o):
    """Run this script with --fs ubifs in a QEMU guest (tests/powercut/vm.py);
    its figures back as JSON."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "powercut"))
    import vm
    if os.path.exists("/sys/module/nandsim") or subprocess.call(
            ["modprobe", "-n", "nandsim"], stderr=subprocess.DEVNULL) == 0:
        log("note: this host has nandsim; the guest is used all the same")
    args = ["--fs", "ubifs", "--myq", o.myq, "--stores", o.stores, "--modes",
            o.modes, "--links", o.links, "--url", o.url, "--rate", str(o.rate), "--seconds",
            str(o.seconds), "--idle", str(o.idle), "--runs", str(o.ubifs_runs), "--parallel", "1",
            "--tmpfs", "/run", "--json", "/run/pc/wear.json"]
    script = ("ip link set lo up 2>/dev/null || ifconfig lo up\n"
              "cd %s && %s %s %s\n" % (ROOT, sys.executable, os.path.abspath(__file__),
                                      " ".join(args)))
    cases = len(o.stores.split(",")) * len(o.modes.split(",")) * len(o.links.split(","))
    r = vm.boot(script, timeout=120 + cases * o.ubifs_runs * (
        o.idle + o.seconds + 90) * 2, mem=1024)
    try:
        text = r["console"]
        for line in text.splitlines():
            if line.startswith("wear:"):       # (the table: below, from the JSON)
                sys.stderr.write(line.rstrip("\r") + "\n")
        if r["rc"] != 0:
            raise RuntimeError("the UBIFS guest failed (rc %s):\n%s" % (
                r["rc"], text[-3000:]))
        with open(os.path.join(r["work"], "wear.json")) as f:
            return json.load(f)
    finally:
        shutil.rmtree(r["work"], ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--myq", default=os.path.join(ROOT, "myq.py"))
    ap.add_argument("--stores", default="files,sqlite")
    ap.add_argument("--modes", default="always,outage")
    ap.add_argument("--links", default="up,down")
    ap.add_argument("--rate", type=float, default=1.0, help="readings a second")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--parallel", type=int, default=4, help="cases at once")
    ap.add_argument("--idle", type=float, default=30.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--url", default="job", choices=("job", "policy"),
                    help="where the url is: each job's payload, or the "
                    "type's policy (url=)")
    ap.add_argument("--fs", default="ext4", choices=("ext4", "ubifs"))
    ap.add_argument("--ubifs", action="store_true", help="also UBIFS, in a QEMU guest")
    ap.add_argument("--ubifs-runs", type=int, default=1)
    ap.add_argument("--tmpfs", default="/dev/shm", help="the RAM tier's and log's tmpfs")
    ap.add_argument("--dir", default=None, help="where the images go")
    ap.add_argument("--json", default=None)
    o = ap.parse_args()
    if os.geteuid() != 0:
        log("skipped: needs root (losetup, mkfs.ext4, mount)")
        return 0
    for tool in ("losetup", "mkfs.ext4", "mount", "umount", "stat"):
        if not shutil.which(tool):
            log("skipped: %s not found" % tool)
            return 0
    if ram_fs(o.tmpfs) not in (TMPFS_MAGIC, RAMFS_MAGIC):
        raise SystemExit("wear: --tmpfs %s is not a RAM filesystem" % o.tmpfs)
    modes = o.modes.split(",")
    helptext = subprocess.check_output(
        [sys.executable, o.myq, "init", "--help"], universal_newlines=True)
    if "outage" in modes and "--ram" not in helptext:
        log("skipped durable=outage: %s has no `init --ram` (SPEC §13 not "
            "there yet)" % o.myq)
        modes.remove("outage")
    res = {}

    def one(r, key):
        store, mode, link = key
        work = tempfile.mkdtemp(prefix="myq-wear-", dir=o.dir)
        try:
            got = case(o.myq, o.fs, store, mode, link, o, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        res.setdefault(key, []).append(got)
        log("run %d %s %s %s link %s: %.0f B/job gross, %.0f net, idle %.1f "
            "B/s, log %.0f B/job, a day at 1/s %s" % (
                r + 1, o.fs, store, mode, link, got["gross_B_job"],
                got["net_B_job"], got["idle_Bps"], got["log_B_job"],
                fmt_b(day(got))))
    keys = [(s, m, k) for s in o.stores.split(",") for k in o.links.split(",")
            for m in modes]
    # the cases of a run at once, each on its own device (the counters are
    # the devices': what one writes is never counted for another)
    from concurrent.futures import ThreadPoolExecutor
    for r in range(o.runs):
        with ThreadPoolExecutor(max(1, o.parallel)) as ex:
            for f in [ex.submit(one, r, k) for k in keys]:
                f.result()
    out = report(res, o, o.fs) if res else {}
    if o.ubifs and o.fs == "ext4":
        try:
            got = ubifs_on_host(o)
        except Exception as e:      # the guest is extra: ext4's figures stand
            log("UBIFS not measured: %s" % e)
            got = None
        if got:
            out.update(got)
            ures = {}
            for k, v in got.items():
                ures[tuple(k.split()[1:])] = v["runs"]
            report(ures, o, "ubifs")
    if o.json:
        with open(o.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
