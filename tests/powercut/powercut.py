#!/usr/bin/env python3
"""myq's power-cut harness (issue 14): `make powercut` runs this.

    python3 tests/powercut/powercut.py [PART ...]     (default: all parts)

Parts:
  ubifs  UBIFS on nandsim in a VM (ubifs_guest.py): >= 200 emulated power
         cuts (UBI's tst_emulate_power_cut; re-attach, remount, recover,
         check), then rounds with emulated I/O errors and bitflips, and
         the flash wear figure (erase blocks per 1,000 durable jobs).
  boot   BusyBox init + rcS + init.d/myq on an ext4 disk; the VM is killed
         mid-work, booted again, and the spool must recover.
  ext4   the spool on ext4 on a virtio disk behind dm-log-writes in a VM;
         the workload runs there; replay.py replays the block log on the
         host at every flush point (plus random subsets of the unflushed
         writes), recovers and checks each image.

Each part ends with one line
  powercut: fs=FS cuts=N lost=0 doubled=0 corrupt=0 ...
and the exit status is 1 when any part found a broken promise.  Needs root
(apt-get, qemu, loop mounts); without root it says so and exits 0.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MYQ = os.path.join(REPO, "myq.py")
sys.path.insert(0, HERE)
import vm  # noqa: E402
import replay  # noqa: E402

RESULTS = os.environ.get("POWERCUT_RESULTS", os.path.join(vm.CACHE, "results"))


def say(*a):
    print(*a, flush=True)


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, **kw)


EXT4_GUEST = r"""set -e
exec > /run/pc/guest.log 2>&1
modprobe virtio_blk
modprobe ext4
modprobe dm-log-writes
SZ=$(blockdev --getsz /dev/vda)
dmsetup create log --table "0 $SZ log-writes /dev/vda /dev/vdb"
mkdir -p /run/mnt/spool
mount -t ext4 /dev/mapper/log /run/mnt
dmsetup message log 0 mark mounted
t0=$(cut -d' ' -f1 /proc/uptime)
python3 {here}/workload.py --myq {myq} --spool /run/mnt/spool \
    --journal /run/pc/journal --runlog /run/pc/runs --jobs {jobs} \
    --cli {cli} --shell {shell} --seed {seed} \
    --mark "dmsetup message log 0 mark" 2> /run/pc/workload.log
t1=$(cut -d' ' -f1 /proc/uptime)
echo "workload seconds: $t0 $t1"
umount /run/mnt
dmsetup status log
dmsetup remove log
sync
"""


def part_ext4(a, out):
    work = tempfile.mkdtemp(prefix="pc-ext4-", dir="/var/tmp")
    base = os.path.join(work, "base.img")
    data = os.path.join(work, "data.img")
    logd = os.path.join(work, "log.img")
    with open(base, "wb") as f:
        f.truncate(a.ext4_mb << 20)
    sh(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
        base])
    shutil.copyfile(base, data)
    with open(logd, "wb") as f:
        f.truncate(4 << 30)
    share = os.path.join(work, "share")
    os.makedirs(share)
    script = EXT4_GUEST.format(here=HERE, myq=MYQ, jobs=a.jobs, cli=a.cli,
                               shell=a.shell, seed=a.seed)
    t0 = time.monotonic()
    r = vm.boot(script, work=share, disks=[data, logd], timeout=a.vm_timeout)
    t_vm = time.monotonic() - t0
    guest = open(os.path.join(share, "guest.log")).read() \
        if os.path.exists(os.path.join(share, "guest.log")) else ""
    say("powercut: ext4 VM: rc=%s boot=%.1fs vm=%.0fs" % (
        r["rc"], r["boot_seconds"] or -1, t_vm))
    if r["rc"] != 0:
        say(r["console"][-3000:])
        say(guest[-3000:])
        try:
            say(open(os.path.join(share, "workload.log")).read()[-3000:])
        except OSError:
            pass
        return None
    for line in guest.splitlines():
        if line.startswith(("workload:", "0 ")) or "log-writes" in line:
            say("  guest:", line)
    t1 = time.monotonic()
    totals, found = replay.replay(
        logd, base, os.path.join(share, "journal"), MYQ, subsets=a.subsets,
        seed=a.seed, max_points=a.max_points, verbose=a.verbose,
        report=os.path.join(out, "ext4-report.json"))
    totals["vm_seconds"] = round(t_vm, 1)
    say("powercut: ext4 replay: %.0fs" % (time.monotonic() - t1))
    for f in found[:10]:
        say("  found:", json.dumps(f)[:1500])
    for name in ("journal", "guest.log", "workload.log"):
        try:
            shutil.copy(os.path.join(share, name), os.path.join(out, "ext4-" + name))
        except OSError:
            pass
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    say(replay.summary("ext4", totals) + " vm_seconds=%.0f" % t_vm)
    say("powercut: fs=ext4-wear cuts=0 lost=0 doubled=0 corrupt=0 jobs=%d "
        "disk_bytes_written=%d flushes=%d per_1000_jobs: bytes=%d flushes=%d"
        % (a.jobs, totals["bytes_written"], totals["flushes"],
           totals["bytes_written"] * 1000 // a.jobs, totals["flushes"] * 1000 // a.jobs))
    return totals


UBIFS_GUEST = r"""exec > /run/pc/guest.log 2>&1
python3 {here}/ubifs_guest.py --myq {myq} --out /run/pc --cuts {cuts} \
    --faults {faults} --wear-jobs {wear} --seed {seed}
"""


def part_ubifs(a, out):
    """UBIFS on nandsim: power cuts, then faults, then the wear figure."""
    share = tempfile.mkdtemp(prefix="pc-ubifs-", dir="/var/tmp")
    script = UBIFS_GUEST.format(here=HERE, myq=MYQ, cuts=a.cuts, faults=a.faults,
                                wear=a.wear_jobs, seed=a.seed)
    t0 = time.monotonic()
    r = vm.boot(script, work=share, timeout=a.vm_timeout * 2)
    t_vm = time.monotonic() - t0
    say("powercut: ubifs VM: rc=%s boot=%.1fs vm=%.0fs" % (
        r["rc"], r["boot_seconds"] or -1, t_vm))
    try:
        with open(os.path.join(share, "ubifs-result.json")) as f:
            res = json.load(f)
    except (OSError, ValueError):
        say(r["console"][-3000:])
        try:
            say(open(os.path.join(share, "guest.log")).read()[-3000:])
        except OSError:
            pass
        return None
    for name in os.listdir(share):
        if name.startswith(("ubifs-", "guest.log")):
            shutil.copy(os.path.join(share, name), os.path.join(out, name))
    if not a.keep:
        shutil.rmtree(share, ignore_errors=True)
    for f in res["found"][:10]:
        say("  found:", json.dumps(f)[:1500])
    if res.get("stage") != "end":
        say("powercut: ubifs: the VM stopped during the %s stage (timeout?)"
            % res.get("stage"))
    ct, t = res.get("cut_totals") or res["totals"], res["totals"]
    ct["seconds"] = res["cut_seconds"]
    ct["promised"] = res["promised"]
    say(replay.summary("ubifs", ct) + " rounds=%d" % ct["rounds"])
    fault = {k: t[k] - ct.get(k, 0) for k in t if isinstance(t[k], int)}
    fault["seconds"] = res.get("fault_seconds", 0)
    fault["cuts"] = fault.get("rounds", 0)     # each fault round ends in a reboot
    say("powercut: ubifs rounds ended by: %s; seconds per phase: %s" % (
        res.get("round_ends"), {k: round(v) for k, v in res.get("timing", {}).items()}))
    say(replay.summary("ubifs-faults", fault) + " producer_errors=%d "
        "ubi_io_errors=%d ubi_bitflips=%d ubi_ro_mode=%d worker_died=%d" % (
            t.get("fault_errors", 0), t.get("io_errors", 0), t.get("bitflips", 0),
            t.get("ro_mode", 0), t.get("worker_died", 0)))
    w = res["wear"]
    say("powercut: fs=ubifs-wear cuts=0 lost=0 doubled=0 corrupt=0 jobs=%d "
        "nand_bytes_written=%s (%s mtd_write calls) erase_blocks=%d (%d bytes "
        "each; %s mtd_erase calls) per_1000_jobs: bytes=%s erase_blocks=%.1f" % (
            w["jobs"], w.get("bytes"), w.get("writes"), w["erases"], w["erase_bytes"],
            w.get("traced_erases"), w.get("bytes_per_1000"), w["erases_per_1000"]))
    merged = dict(t)
    if res.get("stage") != "end":
        merged["recover"] = merged.get("recover", 0) + 1    # an unfinished part fails
    merged["vm_seconds"] = round(t_vm, 1)
    return merged


def part_boot(a, out):
    import boot_part
    return boot_part.run(a, out, vm, replay)


PARTS = {"ext4": part_ext4, "ubifs": part_ubifs, "boot": part_boot}


def _hidden_in_guest(path):
    """The guest mounts fresh /tmp, /run, /proc, /sys and /dev over the
    host's root: a checkout there is out of its sight."""
    return any(path == d or path.startswith(d + "/")
               for d in ("/tmp", "/run", "/proc", "/sys", "/dev"))


def _run_from_copy(argv):
    """Run from a copy of what the guest needs (myq.py, init.d/,
    tests/powercut/) under the cache directory, which the guest sees."""
    import shutil
    src = os.path.join(vm.CACHE, "src")
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(os.path.join(src, "tests"))
    shutil.copy2(MYQ, os.path.join(src, "myq.py"))
    shutil.copytree(os.path.join(REPO, "init.d"), os.path.join(src, "init.d"))
    shutil.copytree(HERE, os.path.join(src, "tests", "powercut"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    say("powercut: %s is out of the guest's sight: running from a copy in %s"
        % (REPO, src))
    env = dict(os.environ, POWERCUT_COPY="1")
    return subprocess.call([sys.executable, os.path.join(
        src, "tests", "powercut", "powercut.py")] + list(
        sys.argv[1:] if argv is None else argv), env=env)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="*")
    ap.add_argument("--jobs", type=int, default=520)
    ap.add_argument("--cli", type=int, default=12)
    ap.add_argument("--shell", type=int, default=12)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--subsets", type=int, default=2)
    ap.add_argument("--max-points", type=int, default=int(
        os.environ.get("POWERCUT_MAX_POINTS", "0")))
    ap.add_argument("--ext4-mb", type=int, default=64)
    ap.add_argument("--cuts", type=int, default=int(
        os.environ.get("POWERCUT_CUTS", "200")))
    ap.add_argument("--faults", type=int, default=6)
    ap.add_argument("--wear-jobs", type=int, default=1000)
    ap.add_argument("--boot-kill", type=float, default=40,
                    help="seconds after which the first boot is killed")
    ap.add_argument("--vm-timeout", type=float, default=900)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        say("powercut: skipped: needs root (apt-get, qemu, loop devices, mount)")
        return 0
    if _hidden_in_guest(REPO) and not os.environ.get("POWERCUT_COPY"):
        return _run_from_copy(argv)
    vm.ensure_tools()
    os.makedirs(RESULTS, exist_ok=True)
    bad = False
    t0 = time.monotonic()
    for name in a.parts or list(PARTS):
        t = PARTS[name](a, RESULTS)
        if t is None or any(t.get(k) for k in replay.BAD):
            bad = True
    say("powercut: total %.0fs, results in %s" % (time.monotonic() - t0, RESULTS))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
