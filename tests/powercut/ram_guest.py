#!/usr/bin/env python3
"""The RAM tier's loss bound under power cuts (SPEC 13), run inside the VM.

    ram_guest.py --fs ext4|ubifs --myq myq.py --out DIR [--cuts N]
                 [--spill-after S] [--margin M] [--seed N]

A spool on the filesystem under test (ext4 on a virtio disk behind a
device-mapper target, or UBIFS on nandsim as ubifs_guest.py makes it),
`myq init --ram /run/pc-ram` (a tmpfs of its own), a type `tel` with
`durable=outage spill_after=S url=http://127.0.0.1:PORT/` (myq's own http
handler) and a type `ok` (durable=always, handlers.py).  receiver.py, in a
process of its own, is the far end of the link.

Each round: the link is set up, down (503), unreachable (the port
closed), stalled (200 after 1.5-5 s) or flapping between them; a worker
(myq worker, forked) runs while this process produces jobs (API batches, `myq enqueue`, the shell
recipe into the RAM tier's drop box; ~1 in 7 of type ok), for a random
time; then the power is cut:

  timed   (both) the worker is stopped (SIGSTOP: it does nothing more)
          and the moment T read; then ext4: dm-flakey drops every write
          from then on (dmsetup suspend --nolockfs, load, resume: the
          xfstests recipe), so the disk keeps what was written before T
          and nothing of what the page cache held; UBIFS: UBI's power-cut
          emulation armed for its next header write, and a scratch file
          written until it comes;
  armed   (UBIFS, half the rounds) the emulation armed at the round's
          start (at UBI's 1st-4th header write: a spill or a durable
          job's write), T the moment this process sees UBI's message
          (later than the cut: the strict side).

then every process of the spool is killed, the RAM tier's tmpfs unmounted
and a fresh one mounted (a reboot empties it), the filesystem unmounted
and mounted again from what the disk or the NAND holds (ext4: after
e2fsck -p), the receiver told a new epoch, and the spool recovered and
checked (check.recover_and_check: myq init, worker --drain with the link
up, myq check).  ramcheck.py says what each promised job is: delivered,
in the spool, or lost within or beyond the bound.

The result (JSON) goes to OUT/ram-result.json after each round.
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
import ramcheck  # noqa: E402
import ubifs_guest as ug  # noqa: E402

MNT = ug.MNT
RAM = "/run/pc-ram"
PORT = 18080
TYPE = "tel"
SZ_CACHE = {}


def sh(cmd, check_=True):
    return ug.sh(cmd, check_)


def fstype(path):
    """The filesystem type of the mount at `path` (the last one there)."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            if pre.split()[4] == path:
                found = post.split()[0]
    return found


def mount_ram():
    os.makedirs(RAM, exist_ok=True)
    if ug._libc().mount(b"pcram", RAM.encode(), b"tmpfs", 0, b"size=32m") != 0:
        raise ug._oserror("mount tmpfs %s" % RAM)


def reboot_ram():
    """A reboot empties the RAM tier: its tmpfs unmounted (lazily: a
    descriptor some dead process's code left open must not keep it) and a
    new one mounted."""
    if ug._libc().umount2(RAM.encode(), 2) != 0:        # MNT_DETACH
        raise ug._oserror("umount %s" % RAM)
    mount_ram()


def ram_ids():
    """The ids of the job files in the RAM tier now (ID.json, ID+....json)."""
    out = set()
    for _, _, files in os.walk(RAM):
        out.update(f.split("+", 1)[0].rsplit(".json", 1)[0] for f in files
                   if f.endswith(".json"))
    return out


# ext4 behind dm ---------------------------------------------------------------

DEV = "/dev/vda"


def _sectors():
    if "n" not in SZ_CACHE:
        SZ_CACHE["n"] = int(sh("blockdev --getsz %s" % DEV).strip())
    return SZ_CACHE["n"]


def ext4_up(timing):
    t = time.monotonic()
    sh("dmsetup create pc --table '0 %d linear %s 0'" % (_sectors(), DEV))
    r = subprocess.run(["e2fsck", "-p", "/dev/mapper/pc"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    if ug._libc().mount(b"/dev/mapper/pc", MNT.encode(), b"ext4", 0, None) != 0:
        raise ug._oserror("mount /dev/mapper/pc")
    timing["t_mount"] = timing.get("t_mount", 0) + time.monotonic() - t
    return r.returncode, r.stdout.decode("utf-8", "replace")[-300:]


def ext4_cut():
    """From now on every write to the disk is dropped (dm-flakey with
    drop_writes, always down): what the disk has is what was written
    before."""
    sh("dmsetup suspend --nolockfs pc && dmsetup load pc --table "
       "'0 %d flakey %s 0 0 1 1 drop_writes' && dmsetup resume pc"
       % (_sectors(), DEV))


def ext4_down(timing):
    t = time.monotonic()
    for _ in range(50):
        if ug._libc().umount2(MNT.encode(), 0) == 0:
            break
        time.sleep(0.1)
    else:
        raise ug._oserror("umount %s" % MNT)
    sh("dmsetup remove pc")
    timing["t_umount"] = timing.get("t_umount", 0) + time.monotonic() - t


def payload(rng, n):
    blob = "%x" % rng.getrandbits(4 * rng.choice((16, 64, 400)))
    return {"n": n, "blob": blob,
            "sum": hashlib.sha256(blob.encode()).hexdigest()[:16]}


class RamRun(object):
    def __init__(self, a):
        self.a = a
        sys.path.insert(0, os.path.dirname(os.path.abspath(a.myq)))
        import myq
        self.myq = myq
        # What a worker imports at its first http job (myq's http handler:
        # http.client, its email parser, urllib, ssl), imported once here:
        # every worker of a round and of a recovery is a fork of this
        # process, and each imported them anew (0.3-1.3 s a round each
        # under TCG), where a device's worker imports them once in its life
        import http.client  # noqa: F401
        import select  # noqa: F401
        import threading  # noqa: F401
        import urllib.parse  # noqa: F401
        self.rng = random.Random(a.seed)
        self.spool = os.path.join(MNT, "spool")
        self.ledger = ramcheck.Ledger()
        self.env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
                        PC_RUNLOG=os.path.join(a.out, "ram-runs"))
        self.epoch = 0
        self.n = 0
        self.wpid = None
        self.offset = 0
        self.deliveries = "/tmp/pc-deliveries.log"
        self.control = "/tmp/pc-link.json"
        self.totals = dict(cuts=0, rounds=0, lost_beyond_bound=0,
                           lost_within_bound=0, doubled=0, corrupt=0, stuck=0,
                           in_failed=0, recover=0, fsck=0, recovery_runs=0,
                           promised=0, delivered=0, spooled=0, ram_seen=0,
                           empty_rounds=0, not_tmpfs=0, down_rounds=0,
                           max_lost_in_a_cut=0, oldest_lost_s=0.0, no_cut=0,
                           bound_s=a.spill_after, margin_s=a.margin)
        self.found = []
        self.kinds = {}
        self.modes = {}
        self.timing = {}
        self.counts = {"cli": 0, "api": 0, "shell": 0, "always": 0}
        self.klog = ug.KLog(os.path.join(a.out, "ram-kmsg.log")) \
            if a.fs == "ubifs" else None
        self.max_cut_lag = 0.0
        self.corrupt_ids = set()    # the distinct ids behind `corrupt`

    # the link ---------------------------------------------------------------

    def link(self, mode, period=0.5, stall=3.0):
        tmp = self.control + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"epoch": self.epoch, "mode": mode, "period": period,
                       "stall": stall, "t0": time.monotonic()}, f)
        os.rename(tmp, self.control)

    def start_receiver(self):
        self.link("up")
        self.receiver = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "receiver.py"), "--port",
             str(PORT), "--control", self.control, "--log", self.deliveries])
        import socket
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", PORT), 1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the receiver did not listen on %d" % PORT)

    def read_deliveries(self):
        new, self.offset = ramcheck.read_deliveries(self.deliveries, self.offset)
        return new

    # the spool --------------------------------------------------------------

    def myq_cli(self, *args):
        rc, out = check.fork_myq(self.myq, ["--spool", self.spool] + list(args),
                                 self.env)
        out = out.decode("utf-8", "replace")
        if rc:
            raise RuntimeError("myq %s: exit %d: %s" % (" ".join(args), rc,
                                                        out[-300:]))
        return out

    def setup(self):
        self.myq_cli("init")
        self.myq_cli("init", "--ram", RAM)
        self.myq_cli("policy", TYPE, "durable=outage",
                     "spill_after=%gs" % (self.a.policy_spill_after
                                          or self.a.spill_after),
                     "url=http://127.0.0.1:%d/" % PORT)
        st = json.loads(self.myq_cli("stats", "--json"))
        if float(st.get("ram_bound_s", -1)) != float(self.a.policy_spill_after
                                                     or self.a.spill_after):
            self.totals["bound_wrong"] = "ram_bound_s=%s, spill_after=%s" % (
                st.get("ram_bound_s"), self.a.spill_after)

    def start_worker(self):
        pid = os.fork()
        if pid == 0:
            try:
                fd = os.open(os.path.join(self.a.out, "ram-worker.log"),
                             os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update(self.env)
                rc = self.myq.main(["--spool", self.spool, "worker", "--module",
                                    os.path.join(HERE, "handlers.py"),
                                    "--backoff-base", "0.2", "--backoff-max", "1",
                                    "--poll", "0.2", "--stats-interval", "0"])
            except BaseException:
                import traceback
                traceback.print_exc()
                rc = 70
            os._exit(rc if isinstance(rc, int) else 1)
        self.wpid = pid
        # enqueue puts a tel job in RAM when a worker is alive: wait for it
        # to be seen (its start), not long
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not self._worker_up():
            time.sleep(0.05)

    def _worker_up(self):
        """Does a producer see a worker listening (then a durable=outage
        job goes to RAM: myq's own test)?"""
        sp = self.myq.open_store(self.spool)
        try:
            return sp.ram.usable()
        except (AttributeError, OSError):
            return False
        finally:
            ug.close_db(sp)

    def promise(self, ids_sums, durable="outage", producer=True):
        """The jobs whose enqueue returned just now.  producer: made by
        myq's enqueue (not the shell recipe, which writes into the RAM tier
        itself): counted in ram_seen when found there (RAM-first)."""
        ret = time.monotonic()
        for jid, s in ids_sums.items():
            self.ledger.promise(jid, s, ret, durable)
        if producer and durable == "outage" and ram_ids() & set(ids_sums):
            self.totals["ram_seen"] += 1

    def produce_one(self):
        rng, myq = self.rng, self.myq
        r = rng.random()
        if r < 0.04:
            p = payload(rng, self.n)
            rc, out = check.fork_myq(myq, ["--spool", self.spool, "enqueue", TYPE,
                                           json.dumps(p)], self.env)
            out = out.decode("utf-8", "replace")
            if rc:
                raise OSError("myq enqueue exit %d: %s" % (rc, out[-200:]))
            self.promise({out.split()[-1]: p["sum"]})
            self.n += 1
            self.counts["cli"] += 1
        elif r < 0.10:
            # the shell recipe, into the RAM tier's drop box (a tmpfs: no sync)
            p = payload(rng, self.n)
            jid = "sh-%d" % self.n
            body = json.dumps({"type": TYPE, "payload": p})
            script = ('printf "%%s\\n" \'%s\' > "$RAM/tmp/%s.json" && '
                      'mv "$RAM/tmp/%s.json" "$RAM/incoming/%s.json"'
                      % (body, jid, jid, jid))
            r2 = subprocess.run(["sh", "-c", script], env=dict(self.env, RAM=RAM),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if r2.returncode:
                raise OSError("shell producer: %s" % r2.stderr.decode()[-200:])
            self.promise({jid: p["sum"]}, producer=False)
            self.n += 1
            self.counts["shell"] += 1
        else:
            always = r > 0.86
            k = 1 if always else rng.randint(1, 3)
            specs = []
            for i in range(k):
                spec = {"type": "ok" if always else TYPE,
                        "payload": payload(rng, self.n + i)}
                if rng.random() < 0.2:
                    spec["id"] = "x-%d" % (self.n + i)
                specs.append(spec)
            sp = myq.open_store(self.spool)
            try:
                ids = sp.enqueue_many(specs)
            finally:
                ug.close_db(sp)
            self.promise(dict((jid, s["payload"]["sum"]) for jid, s in zip(ids, specs)),
                         "always" if always else "outage")
            self.n += k + 1
            self.counts["always" if always else "api"] += k

    # a round ------------------------------------------------------------------

    def tick(self, key, t0):
        t = time.monotonic()
        self.timing[key] = self.timing.get(key, 0) + t - t0
        return t

    def ubifs_cut_now(self):
        """Arm UBI's cut for its next header write and write until it
        comes; True when UBI said it cut."""
        ug.dbg("tst_emulate_power_cut_min", 1)
        ug.dbg("tst_emulate_power_cut_max", 1)
        ug.dbg("tst_emulate_power_cut", 3)
        path = os.path.join(MNT, "scratch")
        for k in range(40):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                try:
                    os.write(fd, os.urandom(256 << 10))
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError:
                pass
            if self.klog.count("emulating a power cut"):
                return True
        return False

    def round(self, i, work):
        a, rng = self.a, self.rng
        t0 = time.monotonic()
        mode = ("up", "down", "flap", "unreachable", "stall", "flap")[i % 6]
        period = rng.choice((0.3, 0.7, 1.5))
        stall = rng.uniform(1.5, 5)
        self.modes[mode] = self.modes.get(mode, 0) + 1
        self.totals["down_rounds"] += mode != "up"
        if fstype(RAM) != "tmpfs":
            self.totals["not_tmpfs"] += 1
        style = "timed" if a.fs == "ext4" or rng.random() < 0.5 else "armed"
        if self.klog:
            self.klog.mark("round %d" % i)
        if style == "armed":
            lo = rng.randint(1, 2)
            ug.dbg("tst_emulate_power_cut_min", lo)
            ug.dbg("tst_emulate_power_cut_max", lo + rng.randint(0, 2))
            ug.dbg("tst_emulate_power_cut", 3)
        t, idle = time.monotonic(), check._idle()
        self.start_worker()
        self.tick("t_start", t)
        self.link(mode, period, stall)
        until = time.monotonic() + rng.uniform(a.min_work, a.max_work)
        made = len(self.ledger.promised)
        err = None
        seen_cut = False
        while time.monotonic() < until:
            try:
                self.produce_one()
            except Exception as e:      # (UBIFS read-only: the cut came)
                err = e
                self.n += 20
                break
            if style == "armed" and self.klog.count("emulating a power cut"):
                seen_cut = True
                break
            if rng.random() < 0.5:
                time.sleep(rng.choice((0.02, 0.1, 0.2)))
        if style == "armed" and not seen_cut:
            seen_cut = self.klog.count("emulating a power cut") > 0
        made = len(self.ledger.promised) - made
        if err is not None and not seen_cut and a.fs == "ext4":
            self.totals["producer_errors"] = self.totals.get("producer_errors", 0) + 1
            self.found.append({"round": i, "notes": ["producer: %r" % err]})
        # the cut
        if self.wpid:
            os.kill(self.wpid, signal.SIGSTOP)
        cut = time.monotonic()
        if style == "armed" and seen_cut:
            pass                # (T: seen now, later than the cut)
        elif a.fs == "ext4":
            ext4_cut()
        else:
            style = "timed" if style == "timed" else "armed-late"
            seen_cut = self.ubifs_cut_now()
        lag = time.monotonic() - cut
        self.max_cut_lag = max(self.max_cut_lag, lag)
        if self.wpid:
            os.kill(self.wpid, signal.SIGKILL)
            os.waitpid(self.wpid, 0)
            self.wpid = None
        kind = style if (a.fs == "ext4" or seen_cut) else "none"
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        t1 = self.tick("t_work", t0)
        self.timing["w_idle"] = self.timing.get("w_idle", 0) + check._idle() - idle
        # the reboot
        self.epoch += 1
        self.link("up")
        reboot_ram()
        fsck_rc = 0
        if a.fs == "ext4":
            ext4_down(self.timing)
            fsck_rc, fsck_out = ext4_up(self.timing)
        else:
            ug.dbg("tst_emulate_power_cut", 0)
            ug.detach(self.timing)
            ug.attach(timing=self.timing)
            try:
                os.unlink(os.path.join(MNT, "scratch"))
            except OSError:
                pass
        self.totals["rounds"] += 1
        self.totals["cuts"] += kind != "none"
        self.totals["no_cut"] += kind == "none"
        if made == 0 and err is None:
            # (a round whose armed cut came at its first enqueue, which the
            # spool then refused, made none: a cut all the same)
            self.totals["empty_rounds"] += 1
            self.found.append({"round": i, "notes": ["no job produced"]})
        elif made == 0:
            self.totals["cut_before_a_job"] = self.totals.get(
                "cut_before_a_job", 0) + 1
        t2 = self.tick("t_reboot", t1)
        self.check(i, cut, mode, kind, fsck_rc, work)
        self.tick("t_recover", t2)

    def check(self, i, cut, mode, kind, fsck_rc, work):
        """After the reboot that ended epoch self.epoch - 1."""
        led, E = self.ledger, self.epoch - 1
        d, c = led.add(self.read_deliveries())
        self.totals["doubled"] += d
        self.totals["corrupt"] += c
        if fsck_rc >= 2:
            self.totals["fsck"] += 1
            self.found.append({"round": i, "notes": ["e2fsck -p exit %d" % fsck_rc]})
            return
        outstanding = led.outstanding(E, cut)
        where, _, _, _ = check.scan(self.spool, self.myq, read=())
        self.totals["spooled"] += sum(1 for j in where if j in outstanding
                                      and led.promised[j][2] == "outage")
        res = check.recover_and_check(self.spool, outstanding, self.a.myq, work,
                                      fork=True, only_promised=True)
        for jid in res["finished"]:
            led.settle(jid)
        d, c = led.add(self.read_deliveries())
        self.totals["doubled"] += d + res["doubled"]
        self.totals["corrupt"] += c + res["corrupt"]
        self.corrupt_ids.update(res["ids"]["corrupt"])
        for k in ("stuck", "in_failed", "recover"):
            self.totals[k] += res[k]
        self.totals["recovery_runs"] += res["rerun"]
        for k, v in res.get("spent", {}).items():
            self.timing["r_" + k] = self.timing.get("r_" + k, 0) + v
        again = [j for j, eps in led.delivered.items() if self.epoch in eps]
        lost = ramcheck.lost_after(led, E, cut, res["ids"]["lost"], again)
        cls = ramcheck.classify(lost, led.promised, cut, self.a.spill_after,
                                self.a.margin)
        self.totals["lost_beyond_bound"] += cls["lost_beyond_bound"]
        self.totals["lost_within_bound"] += cls["lost_within_bound"]
        self.totals["max_lost_in_a_cut"] = max(self.totals["max_lost_in_a_cut"],
                                               len(lost))
        if cls["within"]:
            self.totals["oldest_lost_s"] = max(
                self.totals["oldest_lost_s"],
                max(cls["ages"][j] for j in cls["within"]))
        for j in lost:          # gone: not counted again at the next cut
            led.forget(j)
        bad = [k for k in ("lost_beyond_bound", "doubled", "corrupt", "stuck",
                           "in_failed", "recover") if (cls.get(k) or res.get(k))]
        if res["corrupt"] and len(self.found) < 20:
            self.keep_evidence(i, res["notes"])
        if bad or d or c:
            self.found.append({"round": i, "mode": mode, "kind": kind, "bad": bad,
                               "beyond": [(j, cls["ages"][j]) for j in cls["beyond"]][:20],
                               "notes": res["notes"][:8]})
            print("ram: round %d (%s, %s): %s %s" % (i, mode, kind, bad,
                                                     res["notes"][:4]), flush=True)

    def keep_evidence(self, i, notes):
        """The files the checker found bad, copied out of the spool (the
        VM's disk is gone after the run)."""
        import shutil
        for n in notes:
            if n.startswith("bad content: "):
                rel = n[len("bad content: "):].strip()
                src = os.path.join(self.spool, rel)
                dst = os.path.join(self.a.out, "ram-evidence-%d-%s" % (
                    i, rel.replace("/", "_")))
                try:
                    shutil.copy(src, dst)
                except OSError:
                    pass

    def save(self, stage):
        t = self.totals
        t["promised"] = len(self.ledger.promised)
        t["delivered"] = len(self.ledger.delivered)
        t["reused_ids"] = len(self.ledger.reused)
        t["corrupt_ids"] = len(self.corrupt_ids | set(self.ledger.corrupt_ids))
        out = {"stage": stage, "totals": t, "found": self.found[:50],
               "kinds": self.kinds, "modes": self.modes, "timing": self.timing,
               "counts": self.counts, "max_cut_lag_s": round(self.max_cut_lag, 3),
               "unpromised_deliveries": self.ledger.unpromised,
               "doubled_ids": self.ledger.doubled_ids[:20],
               "reused_ids": self.ledger.reused[:20],
               "corrupt_ids": self.ledger.corrupt_ids[:20]}
        p = os.path.join(self.a.out, "ram-result.json")
        with open(p + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.rename(p + ".tmp", p)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--fs", choices=("ext4", "ubifs"), required=True)
    ap.add_argument("--myq", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cuts", type=int, default=100)
    ap.add_argument("--seed", type=int, default=40)
    ap.add_argument("--spill-after", type=float, default=2.0)
    ap.add_argument("--margin", type=float, default=1.0)
    ap.add_argument("--policy-spill-after", type=float, default=0,
                    help="the type's spill_after when not the bound checked "
                    "(a test of the harness: longer must fail it)")
    ap.add_argument("--min-work", type=float, default=0.3)
    ap.add_argument("--max-work", type=float, default=4.0)
    a = ap.parse_args(argv)
    # every done job stays (the checker counts a job it cannot find lost;
    # retention's default 1,000 would remove the first rounds' after ~25
    # rounds), for the rounds' workers and the recovery's alike
    os.environ["MYQ_KEEP_DONE_MAX"] = "1000000"
    if a.fs == "ext4":
        for m in ("virtio_blk", "ext4", "dm_mod", "dm_flakey"):
            sh("modprobe %s" % m, False)
        os.makedirs(MNT, exist_ok=True)
        ext4_up({})
    else:
        for m in ("lzo", "zstd", "ubifs"):
            sh("modprobe %s" % m, False)
        sh("modprobe nandsim first_id_byte=0x20 second_id_byte=0xa2 "
           "third_id_byte=0x00 fourth_id_byte=0x15")
        sh("modprobe ubi")
        os.makedirs(MNT, exist_ok=True)
        ug.attach(first=True)
    mount_ram()
    run = RamRun(a)
    run.start_receiver()
    run.setup()
    work = "/tmp/pc-ram"
    os.makedirs(work, exist_ok=True)
    t0 = time.monotonic()
    i = 0
    try:
        while run.totals["cuts"] < a.cuts and i < a.cuts * 2:
            run.round(i, work)
            i += 1
            run.save("cuts")
            if i % 20 == 0:
                print("ram: %d rounds, %d cuts, %.0fs %s" % (
                    i, run.totals["cuts"], time.monotonic() - t0,
                    {k: round(v) for k, v in run.timing.items()}), flush=True)
        run.save("end")
    finally:
        run.receiver.terminate()
        try:
            import shutil
            shutil.copy(run.deliveries, os.path.join(a.out, "ram-deliveries.log"))
        except OSError:
            pass
    print("ram: %s" % ramcheck.summary(a.fs + "-ram", run.totals), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
