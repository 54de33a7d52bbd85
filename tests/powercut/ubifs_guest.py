#!/usr/bin/env python3
"""UBIFS on simulated NAND, run inside the VM: emulated power cuts, faults,
and the flash wear figure.

    ubifs_guest.py --myq myq.py --out DIR [--cuts N] [--faults N] [--store sqlite]

nandsim (64 MiB, 2 KiB pages, 128 KiB erase blocks) -> UBI -> a UBIFS
volume holding the spool.  Each round arms UBI's debugfs power-cut emulation
(tst_emulate_power_cut: after a random few more EC/VID header writes UBI
turns read-only, so nothing written after that reaches the flash), runs the
workload (a forked worker, API batches, the shell recipe, now and then
`myq enqueue` and `myq prune`) until the cut stops it, then "reboots":
kills every process, unmounts, detaches and re-attaches UBI (the page cache
is gone; only the NAND contents remain), mounts, recovers (myq init, a
worker --drain, myq check) and checks every job whose enqueue returned.

Faults: rounds with tst_emulate_io_failures or tst_emulate_bitflips armed
while a worker runs: the worker must stay up and no job may be lost or
corrupted.  Wear: bytes programmed and erase blocks written to (kprobes on
mtd_write and mtd_erase) and UBI's erase counters (detailed_erase_block_info)
per 1,000 durable jobs with no cuts armed.

The kernel log is read from /dev/kmsg as it is written (a cut is seen by
UBI's "emulating a power cut" line; all of it goes to ubifs-kmsg.log).  Boot
the guest with a big log_buf_len: after a cut UBIFS dumps the LEB it failed
to write, more than Debian's 128 KiB ring buffer holds.

--store sqlite: the same on a spool of the SQLite store (queue.db, the
shell recipe's files in its drop box); the checker reads the database.
"""

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check  # noqa: E402

MNT = "/run/mnt"
DBG = "/sys/kernel/debug/ubi/ubi0"


def sh(cmd, check_=True):
    r = subprocess.run(cmd, shell=True, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    if check_ and r.returncode:
        raise RuntimeError("%s: %s" % (cmd, r.stdout.decode()[-500:]))
    return r.stdout.decode()


def dbg(name, value):
    with open(os.path.join(DBG, name), "w") as f:
        f.write(str(value))


_idle = check._idle


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


class KLog(object):
    """The kernel log, read from /dev/kmsg as it is written: no subprocess
    per look (under TCG a dmesg|grep costs ~0.1 s), and nothing lost to the
    ring buffer wrapping.  Every record also goes to a file (the evidence
    for a round that ended oddly)."""

    def __init__(self, path):
        self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self.fd, 0, os.SEEK_END)
        self.out = open(path, "a")
        self.lines = []         # since mark()
        self.lost = 0

    def poll(self):
        while True:
            try:
                rec = os.read(self.fd, 8192)
            except BlockingIOError:
                return
            except BrokenPipeError:     # overwritten before we read it
                self.lost += 1
                continue
            if not rec:
                return
            head, _, text = rec.decode("utf-8", "replace").partition(";")
            text = text.split("\n", 1)[0]
            self.lines.append(text)
            try:
                usec = int(head.split(",")[2])
            except (IndexError, ValueError):
                usec = 0
            self.out.write("[%.6f] %s\n" % (usec / 1e6, text))

    def mark(self, what):
        self.poll()
        self.lines = []
        self.out.write("==== %s\n" % what)
        self.out.flush()

    def count(self, needle):
        self.poll()
        return sum(needle in l for l in self.lines)

    def grep(self, *needles):
        self.poll()
        return [l for l in self.lines if any(n in l for n in needles)]


def fault_events(klog):
    """How often UBI reported an emulated fault since klog.mark()."""
    text = "\n".join(klog.grep(""))
    return {"io_errors": text.count("cannot write"),
            "bitflips": text.count("bit-flip") + text.count("bitflip")
            + text.count("scrub"),
            "ro_mode": text.count("switch to read-only mode")}


TRACE = "/sys/kernel/tracing"


def trace_start():
    """kprobes on mtd_write (its offset and length) and mtd_erase: the bytes
    and erase blocks that reach the NAND.  False when tracing is
    unavailable."""
    try:
        sh("[ -e {t}/kprobe_events ] || mount -t tracefs tracefs {t}; "
           "echo 'p:pcw mtd_write to=%si:u64 len=%dx:u64' >> {t}/kprobe_events && "
           "echo 'p:pce mtd_erase' >> {t}/kprobe_events && "
           "echo 16384 > {t}/buffer_size_kb && echo > {t}/trace && "
           "echo 1 > {t}/events/kprobes/pcw/enable && "
           "echo 1 > {t}/events/kprobes/pce/enable".format(t=TRACE))
        return True
    except (OSError, RuntimeError) as e:
        print("ubifs: no kprobe tracing: %s" % e, flush=True)
        return False


def trace_stop(erase_size):
    """(bytes written, writes, erases, lost events, distinct erase blocks
    written to) since trace_start."""
    for ev in ("pcw", "pce"):
        with open(os.path.join(TRACE, "events/kprobes/%s/enable" % ev), "w") as f:
            f.write("0")
    nbytes = writes = erases = 0
    blocks = set()
    with open(os.path.join(TRACE, "trace")) as f:
        for line in f:
            if " pcw: " in line and "len=" in line:
                writes += 1
                nbytes += int(line.rsplit("len=", 1)[1].split()[0], 0)
                blocks.add(int(line.rsplit("to=", 1)[1].split()[0], 0) // erase_size)
            elif " pce: " in line:
                erases += 1
    lost = 0
    try:
        with open(os.path.join(TRACE, "per_cpu/cpu0/stats")) as f:
            for line in f:
                if line.startswith("overrun:"):
                    lost = int(line.split()[1])
    except OSError:
        pass
    return nbytes, writes, erases, lost, len(blocks)


def erase_counts():
    """Sum of UBI's erase counters over all PEBs."""
    total = 0
    with open(os.path.join(DBG, "detailed_erase_block_info")) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].isdigit():
                total += int(parts[1])
    return total


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _ioc_w(nr, size):
    return (1 << 30) | (size << 16) | (ord("o") << 8) | nr  # UBI_CTRL_IOC_MAGIC


def _oserror(what):
    import ctypes
    e = ctypes.get_errno()
    return OSError(e, "%s: %s" % (what, os.strerror(e)))


def ubi_ctrl(attach):
    """ubiattach -m 0 -d 0 / ubidetach -m 0, as the ioctls on /dev/ubi_ctrl
    (include/uapi/mtd/ubi-user.h) without a process each."""
    import fcntl
    import struct
    fd = os.open("/dev/ubi_ctrl", os.O_RDONLY)
    try:
        if attach:      # struct ubi_attach_req: ubi_num 0, mtd_num 0, defaults
            fcntl.ioctl(fd, _ioc_w(64, 24), struct.pack("=iiihbb8x", 0, 0, 0, 0, 0, 0))
        else:           # UBI_IOCDET: the UBI device number
            fcntl.ioctl(fd, _ioc_w(65, 4), struct.pack("=i", 0))
    finally:
        os.close(fd)


def attach(first=False, timing=None):
    t = time.monotonic()
    ubi_ctrl(True)
    if first:
        sh("ubimkvol /dev/ubi0 -N spool -m")
    t1 = time.monotonic()
    if _libc().mount(b"ubi0:spool", MNT.encode(), b"ubifs", 0, None) != 0:
        raise _oserror("mount ubi0:spool")
    if timing is not None:
        for k, v in (("t_ubiattach", t1 - t), ("t_mount", time.monotonic() - t1)):
            timing[k] = timing.get(k, 0) + v


def detach(timing=None):
    t = time.monotonic()
    for _ in range(50):
        if _libc().umount2(MNT.encode(), 0) == 0:
            break
        time.sleep(0.1)
    else:
        raise _oserror("umount %s" % MNT)
    t1 = time.monotonic()
    ubi_ctrl(False)
    if timing is not None:
        for k, v in (("t_umount", t1 - t), ("t_ubidetach", time.monotonic() - t1)):
            timing[k] = timing.get(k, 0) + v


def close_db(sp):
    """What a call on a Spool of the SQLite store leaves open in this
    process, which unmounts the spool at every reboot: the connection to
    queue.db (SqlStore._conn; an exception's traceback would keep the
    Spool alive), and the descriptors of SPOOL and SPOOL/locks in the
    spool's door (SqlStore's create and enqueue_many do not release it as
    the files store's calls do: the umount failed with EBUSY; reported)."""
    if sp is None:
        return
    if callable(getattr(sp, "close", None)):
        sp.close()              # (Spool.close: the SQLite store's connection)
    else:
        db = getattr(sp, "_conn", None)
        if db is not None:
            sp._conn = None
            try:
                db.close()
            except Exception:
                pass
    try:
        sp.fs.release()
    except Exception:
        pass


def payload(rng, n):
    blob = "%x" % rng.getrandbits(4 * rng.choice((16, 64, 400, 1500)))
    return {"n": n, "blob": blob,
            "sum": hashlib.sha256(blob.encode()).hexdigest()[:16]}


class Run(object):
    def __init__(self, a):
        self.a = a
        sys.path.insert(0, os.path.dirname(os.path.abspath(a.myq)))
        import myq
        self.myq = myq
        self.rng = random.Random(a.seed)
        self.spool = os.path.join(MNT, "spool")
        self.promised = {}
        self.pruned = set()
        self.wpid = None        # the worker running now, if any
        self.n = 0
        self.journal = open(os.path.join(a.out, "ubifs-journal"), "a")
        self.env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
                        PC_RUNLOG=os.path.join(a.out, "ubifs-runs"))
        self.totals = dict(lost=0, doubled=0, corrupt=0, stuck=0, recover=0,
                           rerun=0, in_failed=0, nul_tails=0, nul_cuts=0,
                           fsck=0, cuts=0, rounds=0, ro_rounds=0)
        self.found = []
        self.counts = {"cli": 0, "api": 0, "shell": 0}
        self.timing = {}
        self.ends = {}
        self.found_info = []
        self.steps = {}
        self._idle = _idle()
        self.klog = KLog(os.path.join(a.out, "ubifs-kmsg.log"))

    def promise(self, jobs, how):
        self.promised.update(jobs)
        self.journal.write(json.dumps({"how": how, "jobs": jobs}) + "\n")
        self.journal.flush()

    def start_worker(self, log):
        pid = os.fork()
        self.wpid = pid         # (the parent's; a prune stops it a moment)
        if pid == 0:
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update(self.env)
                rc = self.myq.main(["--spool", self.spool, "worker", "--module",
                                    os.path.join(HERE, "handlers.py"),
                                    "--backoff-base", "0.2", "--backoff-max", "1",
                                    "--poll", "0.5", "--stats-interval", "0"])
            except BaseException:
                import traceback
                traceback.print_exc()
                rc = 70
            os._exit(rc if isinstance(rc, int) else 1)
        return pid

    def produce_one(self):
        """One producer step; raises when the spool refuses (the cut)."""
        rng, myq, a = self.rng, self.myq, self.a
        r = rng.random()
        # few dead letters: dlq/ keeps them all (retention 30 days), and
        # every recovery scans them
        t = lambda: "ok" if rng.random() < 0.88 else (  # noqa: E731
            "flaky" if rng.random() < 0.8 else "bad")
        if r < a.cli_rate:
            p = payload(rng, self.n)
            # The CLI's own code (myq.main) in a forked child: a fresh
            # interpreter costs ~2 s under TCG (the ext4 and boot parts
            # start real `myq enqueue` processes).
            rc, out = check.fork_myq(myq, ["--spool", self.spool, "enqueue",
                                           t(), json.dumps(p)], self.env)
            out = out.decode("utf-8", "replace")
            if rc:
                raise OSError("myq enqueue exit %d: %s" % (rc, out[-200:]))
            self.promise({out.split()[-1]: p["sum"]}, "cli")
            self.n += 1
            self.counts["cli"] += 1
        elif r < a.cli_rate + a.shell_rate:
            p = payload(rng, self.n)
            jid = "sh-%d" % self.n
            body = json.dumps({"type": t(), "payload": p})
            script = ('printf "%%s\\n" \'%s\' > "$SPOOL/tmp/%s.json" && sync && '
                      'mv "$SPOOL/tmp/%s.json" "$SPOOL/incoming/%s.json" && sync'
                      % (body, jid, jid, jid))
            r2 = subprocess.run(["sh", "-c", script], env=dict(self.env, SPOOL=self.spool),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            # sync(1) reports no error: the job is promised only when the
            # file is in incoming/ and the fs is still writable afterwards.
            if r2.returncode:
                raise OSError("shell producer: %s" % r2.stderr.decode()[-200:])
            probe = os.path.join(self.spool, "tmp", ".probe")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                os.write(fd, b"x")
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
            self.promise({jid: p["sum"]}, "shell")
            self.n += 1
            self.counts["shell"] += 1
        else:
            k = rng.randint(1, 6)
            specs = []
            for i in range(k):
                spec = {"type": t(), "payload": payload(rng, self.n + i)}
                if rng.random() < 0.2:
                    spec["id"] = "x-%d" % (self.n + i)
                specs.append(spec)
            sp = myq.open_store(self.spool)
            try:
                ids = sp.enqueue_many(specs)
            finally:
                close_db(sp)
            self.promise({jid: s["payload"]["sum"] for jid, s in zip(ids, specs)}, "api")
            self.n += k
            self.counts["api"] += k
        if rng.random() < 0.03:
            # The worker is stopped from the listing to the prune's end: a
            # job it finished in between would be removed unlisted, and
            # counted lost (seen once in a fault round: a retried job).
            # A worker stopped in a write transaction of queue.db keeps
            # its lock: the prune waits MYQ_DB_BUSY seconds and exits 75;
            # the worker then runs a moment, and both are done again.
            env = dict(self.env, MYQ_KEEP_DONE_MAX="40")
            if a.store == "sqlite":
                env["MYQ_DB_BUSY"] = "1"
            for k in range(10):
                if self.wpid:
                    os.kill(self.wpid, signal.SIGSTOP)
                try:
                    # what the prune may remove (an id myq generated keeps no
                    # record)
                    self.pruned.update(check.done_ids(self.spool))
                    rc, out = check.fork_myq(myq, ["--spool", self.spool, "prune"],
                                             env)
                finally:
                    if self.wpid:
                        os.kill(self.wpid, signal.SIGCONT)
                if rc != 75 or a.store != "sqlite":
                    break
                self.totals["prune_busy"] = self.totals.get("prune_busy", 0) + 1
                time.sleep(0.1)
            if rc:
                raise OSError("prune exit %d: %s" % (
                    rc, out.decode("utf-8", "replace")[-200:]))

    def recover(self, what, work):
        res = check.recover_and_check(self.spool, dict(self.promised), self.a.myq,
                                      work, fork=True, pruned=self.pruned,
                                      store=self.a.store)
        for k in self.totals:
            if k in res:
                self.totals[k] += res[k]
        self.totals["nul_cuts"] += bool(res.get("nul_tails"))
        for k, v in res.get("spent", {}).items():
            self.timing["r_" + k] = self.timing.get("r_" + k, 0) + v
        if any(res.get(k) for k in ("lost", "doubled", "corrupt", "stuck",
                                    "recover", "in_failed")):
            self.found.append({"round": what, "promised": len(self.promised),
                               "notes": res["notes"][:8]})
            print("ubifs: %s: %s" % (what, res["notes"][:4]), flush=True)
        return res

    def tick(self, key, t0):
        t = time.monotonic()
        self.timing[key] = self.timing.get(key, 0) + t - t0
        idle = _idle()
        self.timing["idle_" + key] = self.timing.get("idle_" + key, 0) + idle - self._idle
        self._idle = idle
        return t

    def reboot(self):
        """What the power coming back does: the page cache is gone, UBI is
        attached again from the NAND contents, UBIFS mounted (and
        recovered by the kernel)."""
        detach(self.timing)
        attach(timing=self.timing)

    def cut_round(self, i, work):
        a, klog = self.a, self.klog
        t0 = time.monotonic()
        self._idle = _idle()
        klog.mark("round %d" % i)
        lo = self.rng.randint(1, 2)
        dbg("tst_emulate_power_cut_min", lo)
        dbg("tst_emulate_power_cut_max", lo + self.rng.randint(0, 2))
        dbg("tst_emulate_power_cut", 3)
        wpid = self.start_worker(os.path.join(a.out, "ubifs-worker.log"))
        err = None
        steps = 0
        while steps < a.max_steps and time.monotonic() - t0 < 60:
            try:
                self.produce_one()
            except Exception as e:      # the spool refused: the power went
                err = e
                self.n += 20            # never reuse an explicit id it may have placed
                break
            steps += 1
            if klog.count("emulating a power cut"):
                break                   # the worker met the cut
            if self.rng.random() < 0.1:
                time.sleep(0.05)
        os.kill(wpid, signal.SIGKILL)       # the power went: every process dies
        os.waitpid(wpid, 0)
        self.wpid = None
        dbg("tst_emulate_power_cut", 0)
        t1 = self.tick("t_work", t0)
        cut = klog.count("emulating a power cut") > 0
        if cut:
            why = "cut"
        elif err is not None and "Read-only file system" in str(err):
            why = "ro"      # read-only without UBI's cut: see the evidence
        else:
            why = type(err).__name__ if err else "steps"
        self.ends[why] = self.ends.get(why, 0) + 1
        self.steps[why] = self.steps.get(why, 0) + steps
        if why != "cut":
            ev = klog.grep("UBI", "UBIFS", "read-only", "Power cut")
            self.found_info.append({"round": i, "end": why, "error": repr(err)[:300],
                                    "steps": steps, "kernel": ev[-30:]})
            print("ubifs: round %d ended %s without a UBI power cut: %r; kernel: %s"
                  % (i, why, err, ev[-8:]), flush=True)
        self.reboot()
        self.totals["rounds"] += 1
        self.totals["cuts"] += cut
        self.totals["ro_rounds"] += why == "ro"
        t2 = time.monotonic()
        self._idle = _idle()
        self.recover("cut %d%s" % (i, "" if cut else " (%s: no UBI cut)" % why), work)
        self.tick("t_recover", t2)

    def fault_round(self, i, kind, work):
        """A worker runs while UBI reports I/O errors or bitflips."""
        klog = self.klog
        wpid = self.start_worker(os.path.join(self.a.out, "ubifs-fault-worker.log"))
        klog.mark("fault %s %d" % (kind, i))
        dbg(kind, 1)
        errors = 0
        for k in range(self.a.fault_steps):
            try:
                self.produce_one()
            except Exception:
                errors += 1
            if k % 10 == 0:     # emulated bitflips happen on reads from the NAND
                drop_caches()
        time.sleep(1)
        alive = os.waitpid(wpid, os.WNOHANG) == (0, 0)
        dbg(kind, 0)
        seen = fault_events(klog)
        for k in seen:
            self.totals[k] = self.totals.get(k, 0) + seen[k]
        if not alive:
            self.totals.setdefault("worker_died", 0)
            self.totals["worker_died"] += 1
            self.found.append({"round": "fault %s %d" % (kind, i),
                               "notes": ["the worker exited during faults"]})
        else:
            os.kill(wpid, signal.SIGTERM)
            os.waitpid(wpid, 0)
        self.wpid = None
        # an I/O error turns UBI read-only: reboot as after a cut
        self.reboot()
        self.totals["rounds"] += 1
        self.totals.setdefault("fault_errors", 0)
        self.totals["fault_errors"] += errors
        return self.recover("fault %s %d" % (kind, i), work)


def wear(run, a, t0):
    """Bytes and erase blocks written to the NAND for a.wear_jobs durable
    jobs (a steady producer of API batches and a worker, no cuts)."""
    ec0 = erase_counts()
    sh("sync")
    erase_size = int(sh("cat /sys/class/mtd/mtd0/erasesize"))
    traced = trace_start()
    n0 = run.n
    wpid = run.start_worker(os.path.join(a.out, "ubifs-worker.log"))
    saved = (a.cli_rate, a.shell_rate)
    a.cli_rate = a.shell_rate = 0
    while run.n - n0 < a.wear_jobs:
        run.produce_one()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and check.busy(run.spool):
        time.sleep(0.5)
    os.kill(wpid, signal.SIGTERM)
    os.waitpid(wpid, 0)
    run.wpid = None
    sh("sync")
    a.cli_rate, a.shell_rate = saved
    jobs = run.n - n0
    ec1 = erase_counts()
    tb = trace_stop(erase_size) if traced else None
    per = 1000.0 / jobs
    # NAND is programmed once per erase: every block written to is erased
    # again before it is written again (UBI erases lazily, in the
    # background, so its erase counters trail the writes).
    return {"jobs": jobs, "erase_bytes": erase_size,
            "erases": ec1 - ec0, "erases_per_1000": round((ec1 - ec0) * per, 1),
            "bytes": tb and tb[0], "writes": tb and tb[1],
            "traced_erases": tb and tb[2], "trace_overrun": tb and tb[3],
            "blocks_written": tb and tb[4],
            "bytes_per_1000": tb and int(tb[0] * per),
            "blocks_written_per_1000": tb and round(tb[4] * per, 1),
            "block_equivalents_per_1000": tb and round(tb[0] * per / erase_size, 1),
            "seconds": round(time.monotonic() - t0, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--myq", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cuts", type=int, default=200)
    ap.add_argument("--faults", type=int, default=6)
    ap.add_argument("--fault-first", type=int, default=0,
                    help="the index of the first fault round (the kinds alternate)")
    ap.add_argument("--wear-jobs", type=int, default=500)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--fault-steps", type=int, default=150)
    ap.add_argument("--cli-rate", type=float, default=0.01)
    ap.add_argument("--shell-rate", type=float, default=0.05)
    ap.add_argument("--store", default="files", choices=("files", "sqlite"))
    a = ap.parse_args(argv)
    for m in ("lzo", "zstd", "ubifs"):
        sh("modprobe %s" % m, False)
    # 64 MiB NAND, 2 KiB pages, 128 KiB erase blocks
    sh("modprobe nandsim first_id_byte=0x20 second_id_byte=0xa2 "
       "third_id_byte=0x00 fourth_id_byte=0x15")
    sh("modprobe ubi")
    os.makedirs(MNT, exist_ok=True)
    attach(first=True)
    run = Run(a)
    close_db(run.myq.open_store(run.spool).init(store=a.store))
    work = "/tmp/pc-ubifs"
    os.makedirs(work, exist_ok=True)
    t0 = time.monotonic()
    out = {}
    if a.wear_jobs:
        out["wear"] = wear(run, a, t0)
        print("ubifs: wear %s" % out["wear"], flush=True)
    t1 = time.monotonic()
    def save(stage):
        out["stage"] = stage
        out["cut_seconds"] = round(time.monotonic() - t1, 1)
        out["timing"] = run.timing
        out["round_ends"] = run.ends
        out["info"] = run.found_info[:50]
        out["steps"] = run.steps
        out["kmsg_lost"] = run.klog.lost
        out["totals"] = run.totals
        out["found"] = run.found
        out["promised"] = len(run.promised)
        out["counts"] = run.counts
        with open(os.path.join(a.out, "ubifs-result.json.tmp"), "w") as f:
            json.dump(out, f, indent=1)
        os.rename(os.path.join(a.out, "ubifs-result.json.tmp"),
                  os.path.join(a.out, "ubifs-result.json"))

    i = 0
    while run.totals["cuts"] < a.cuts and i < a.cuts * 2:
        run.cut_round(i, work)
        i += 1
        out["cut_totals"] = dict(run.totals)
        save("cuts")
        if i % 20 == 0:
            print("ubifs: %d rounds, %d cuts, %d promised, %.0fs %s" % (
                i, run.totals["cuts"], len(run.promised),
                time.monotonic() - t1, {k: round(v) for k, v in run.timing.items()}),
                flush=True)
    cut_seconds = round(time.monotonic() - t1, 1)
    t2 = time.monotonic()
    for i in range(a.faults):
        kind = ("tst_emulate_io_failures", "tst_emulate_bitflips")[(a.fault_first + i) % 2]
        run.fault_round(i, kind, work)
        out["fault_seconds"] = round(time.monotonic() - t2, 1)
        save("faults")
    out["fault_seconds"] = round(time.monotonic() - t2, 1)
    save("end")
    out["cut_seconds"] = cut_seconds
    with open(os.path.join(a.out, "ubifs-result.json"), "w") as f:
        json.dump(out, f, indent=1)
    out["files"] = {d: len(os.listdir(os.path.join(run.spool, d))) for d in
                    ("incoming", "processing", "done", "dlq", "failed", "locks/ok")}
    if a.store == "sqlite":
        rows, ok, err = check.db_rows(run.spool, "status")
        for (st,) in rows:
            out["files"]["rows_" + st] = out["files"].get("rows_" + st, 0) + 1
        out["files"]["rows_ok"] = len(ok)
    print("ubifs: files at the end: %s" % out["files"], flush=True)
    if os.environ.get("PC_PROFILE"):
        import cProfile
        import pstats
        drop_caches()
        pr = cProfile.Profile()
        pr.enable()
        t = time.monotonic()
        run.recover("profile", work)
        print("ubifs: profiled recovery %.2fs" % (time.monotonic() - t))
        pr.disable()
        pstats.Stats(pr, stream=sys.stdout).sort_stats("cumulative").print_stats(40)
        sys.stdout.flush()
    with open(os.path.join(a.out, "ubifs-result.json"), "w") as f:
        json.dump(out, f, indent=1)
    detach()
    return 0


if __name__ == "__main__":
    sys.exit(main())
