#!/usr/bin/env python3
"""myq's power-cut harness (issue 14): `make powercut` runs this.

    python3 tests/powercut/powercut.py [PART ...]     (default: all parts)

Parts:
  ubifs  UBIFS on nandsim in VMs (ubifs_guest.py; --ubifs-vms of them, the
         cuts and fault rounds shared out): >= 200 emulated power cuts
         (UBI's tst_emulate_power_cut; re-attach, remount, recover,
         check), then rounds with emulated I/O errors and bitflips, and
         the flash wear figure (bytes and erase blocks per 1,000 jobs).
  boot   BusyBox init + rcS + init.d/myq on an ext4 disk; the VM is killed
         mid-work, booted again, and the spool must recover.
  ext4   the spool on ext4 on a virtio disk behind dm-log-writes in a VM;
         the workload runs there; replay.py replays the block log on the
         host at every flush point (plus random subsets of the unflushed
         writes), recovers and checks each image.
  ext4-ram, ubifs-ram
         the RAM tier's loss bound (SPEC 13; ram_guest.py): a spool with
         `init --ram` on a tmpfs, a durable=outage type forwarded over
         http to receiver.py (the link up, down, unreachable, flapping),
         --ram-cuts power cuts at random moments shared by --ram-vms VMs
         (ext4: dm-flakey drops every write from the cut on; UBIFS: UBI's
         emulation); every promised job delivered, in the spool, or lost
         within spill_after + --bound-margin of the cut, or the part fails
         (lost_beyond_bound).
  ext4-sqlite, ubifs-sqlite
         the same on a spool of the SQLite store (myq init --store sqlite:
         the jobs in queue.db, the shell recipe's files in its drop box);
         the checker reads the database.  ext4-sqlite replays
         --sqlite-max-points flush points (>= --sqlite-min-cuts cuts, or
         the part fails); ubifs-sqlite makes the same cuts as ubifs and
         --sqlite-faults fault rounds.

Each VM is a task in a child process; --parallel of them run at once
(default: 2 on a machine with 2 CPUs or more; a VM under TCG keeps one CPU
busy).  Each part ends with one line, printed when all its tasks are done:
  powercut: fs=FS cuts=N lost=0 doubled=0 corrupt=0 ...
and the exit status is 1 when any part found a broken promise or could not
run.  Needs root (apt-get, qemu, loop mounts); without root it says so and
exits 0.
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
import ramcheck  # noqa: E402
import replay  # noqa: E402

RESULTS = os.environ.get("POWERCUT_RESULTS", os.path.join(vm.CACHE, "results"))


PREFIX = ""


def say(*a):
    text = " ".join(str(x) for x in a)
    if PREFIX:
        text = "\n".join(PREFIX + line for line in text.split("\n"))
    print(text, flush=True)


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, **kw)


EXT4_GUEST = r"""set -e
exec > /run/pc/guest.log 2>&1
# The replay recovers each image on this host, as the same machine after
# the power came back: the workers' records must name this host (a new
# boot id then says they died).  Under another name only their leases
# (60 s, wall clock) could free their claims.
hostname {hostname}
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
    --cli {cli} --shell {shell} --seed {seed} --store {store} \
    --mark "dmsetup message log 0 mark" 2> /run/pc/workload.log
t1=$(cut -d' ' -f1 /proc/uptime)
echo "workload seconds: $t0 $t1"
umount /run/mnt
dmsetup status log
dmsetup remove log
sync
"""


def part_ext4(a, out, k=0, store="files"):
    fs = "ext4" if store == "files" else "ext4-" + store
    max_points = a.max_points if store == "files" else a.sqlite_max_points
    work = tempfile.mkdtemp(prefix="pc-%s-" % fs, dir=a.tmp)
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
                               shell=a.shell, seed=a.seed, store=store,
                               hostname=os.uname()[1])
    t0 = time.monotonic()
    r = vm.boot(script, work=share, disks=[data, logd], timeout=a.vm_timeout)
    t_vm = time.monotonic() - t0
    guest = open(os.path.join(share, "guest.log")).read() \
        if os.path.exists(os.path.join(share, "guest.log")) else ""
    say("powercut: %s VM: rc=%s boot=%.1fs vm=%.0fs cpu=%.0fs" % (
        fs, r["rc"], r["boot_seconds"] or -1, t_vm, r["cpu_seconds"]))
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
    # replay.py in a process of its own: it re-executes itself in a private
    # mount namespace (no other process's copy of the namespace can hold
    # its cuts' mounts)
    report = os.path.join(out, fs + "-report.json")
    try:
        os.unlink(report)
    except OSError:
        pass
    cmd = [sys.executable, os.path.join(HERE, "replay.py"), "--log", logd,
           "--base", base, "--journal", os.path.join(share, "journal"),
           "--myq", MYQ, "--subsets", str(a.subsets), "--seed", str(a.seed),
           "--max-points", str(max_points), "--report", report]
    if store != "files":
        cmd += ["--store", store]
    p = subprocess.Popen(cmd + ([] if a.verbose else ["--quiet"]),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for line in p.stdout:
        line = line.decode("utf-8", "replace").rstrip("\n")
        if not line.startswith("powercut: fs="):    # the part's line: below
            say(line)
    rc = p.wait()
    try:
        with open(report) as f:
            rep = json.load(f)
        totals, found = rep["totals"], rep["found"]
    except (OSError, ValueError, KeyError) as e:
        say("powercut: %s replay exit %s, no report (%s)" % (fs, rc, e))
        return None
    say("powercut: %s replay: exit %d; e2fsck -p exit statuses: %s" % (
        fs, rc, rep.get("fsck_exits")))
    totals["vm_seconds"] = round(t_vm, 1)
    say("powercut: %s replay: %.0fs" % (fs, time.monotonic() - t1))
    for f in found[:10]:
        say("  found:", json.dumps(f)[:1500])
    for name in ("journal", "guest.log", "workload.log"):
        try:
            shutil.copy(os.path.join(share, name), os.path.join(out, fs + "-" + name))
        except OSError:
            pass
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    totals["cpu_seconds"] = round(r["cpu_seconds"], 1)
    return totals


def report_ext4(a, results, store="files"):
    fs = "ext4" if store == "files" else "ext4-" + store
    totals = results[0]
    if totals is None:
        say("powercut: fs=%s: no result (the VM or the replay did not finish;"
            " see above)" % fs)
        return None
    say(replay.summary(fs, totals) + " vm_seconds=%.0f" % totals["vm_seconds"])
    say("powercut: fs=%s-wear cuts=0 lost=0 doubled=0 corrupt=0 jobs=%d "
        "disk_bytes_written=%d flushes=%d per_1000_jobs: bytes=%d flushes=%d"
        % (fs, a.jobs, totals["bytes_written"], totals["flushes"],
           totals["bytes_written"] * 1000 // a.jobs, totals["flushes"] * 1000 // a.jobs))
    if store != "files" and totals["cuts"] < a.sqlite_min_cuts:
        say("powercut: %s: %d cuts, fewer than the %d asked for (raise "
            "--sqlite-max-points)" % (fs, totals["cuts"], a.sqlite_min_cuts))
        totals["recover"] = totals.get("recover", 0) + 1
    return totals


UBIFS_GUEST = r"""exec > /run/pc/guest.log 2>&1
PC_PROFILE={profile} python3 {here}/ubifs_guest.py --myq {myq} --out /run/pc \
    --cuts {cuts} --faults {faults} --fault-first {fault_first} \
    --wear-jobs {wear} --seed {seed}{more}
"""


def _share(n, k, total):
    """Task k's share of `total` when n tasks share it."""
    base, extra = divmod(total, n)
    return base + (k < extra)


def part_ubifs(a, out, k=0, store="files"):
    """One UBIFS VM (of --ubifs-vms): its share of the cuts and the fault
    rounds; the first also measures the wear."""
    fs = "ubifs" if store == "files" else "ubifs-" + store
    n = max(1, a.ubifs_vms)
    nfaults = a.faults if store == "files" else a.sqlite_faults
    cuts = _share(n, k, a.cuts)
    faults = _share(n, k, nfaults)
    share = tempfile.mkdtemp(prefix="pc-%s-" % fs, dir=a.tmp)
    script = UBIFS_GUEST.format(
        here=HERE, myq=MYQ, cuts=cuts, faults=faults,
        fault_first=sum(_share(n, j, nfaults) for j in range(k)),
        wear=a.wear_jobs if k == 0 else 0,
        seed=a.seed + 1000 * k + (0 if store == "files" else 500),
        more="" if store == "files" else " --store " + store,
        profile=os.environ.get("PC_PROFILE", ""))
    t0 = time.monotonic()
    # A write that fails after the cut makes UBIFS dump the whole LEB to
    # the kernel log (hundreds of KiB): a big ring buffer keeps UBI's cut
    # message, and loglevel=3 keeps the dumps (KERN_ERR) off the emulated
    # serial console.
    r = vm.boot(script, work=share, timeout=a.vm_timeout * 2,
                append="log_buf_len=16M loglevel=3")
    t_vm = time.monotonic() - t0
    say("powercut: %s VM %d: rc=%s boot=%.1fs vm=%.0fs cpu=%.0fs cuts=%d "
        "faults=%d" % (fs, k, r["rc"], r["boot_seconds"] or -1, t_vm,
                       r["cpu_seconds"], cuts, faults))
    res = _guest_result(share, "ubifs-result.json", r)
    if res is None:
        return None
    dest = os.path.join(out, "%s-vm%d" % (fs, k))
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for name in os.listdir(share):
        if name.startswith(("ubifs-", "guest.log", "console.log")):
            shutil.copy(os.path.join(share, name), os.path.join(dest, name))
    if not a.keep:
        shutil.rmtree(share, ignore_errors=True)
    for f in res["found"][:10]:
        say("  found:", json.dumps(f)[:1500])
    if res.get("stage") != "end":
        say("powercut: %s VM %d stopped during the %s stage (timeout?)"
            % (fs, k, res.get("stage")))
    res.update(vm_seconds=round(t_vm, 1), cpu_seconds=round(r["cpu_seconds"], 1),
               want_cuts=cuts)
    return res


def _add(into, d):
    for key, v in d.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            into[key] = into.get(key, 0) + v
        elif isinstance(v, dict):
            _add(into.setdefault(key, {}), v)
    return into


def report_ubifs(a, results, store="files"):
    """One set of lines for all the UBIFS VMs."""
    fs = "ubifs" if store == "files" else "ubifs-" + store
    if not results or any(r is None for r in results):
        say("powercut: fs=%s: no result from %d of %d VMs (see above)" % (
            fs, sum(r is None for r in results), len(results)))
        return None
    ct, t, timing, ends = {}, {}, {}, {}
    for res in results:
        _add(ct, res.get("cut_totals") or res["totals"])
        _add(t, res["totals"])
        _add(timing, res.get("timing", {}))
        _add(ends, res.get("round_ends", {}))
    ct["seconds"] = max(res["cut_seconds"] for res in results)
    ct["promised"] = sum(res["promised"] for res in results)
    unfinished = [k for k, res in enumerate(results) if res.get("stage") != "end"]
    short = sum(max(0, res["want_cuts"] - res.get("cut_totals", {}).get("cuts", 0))
                for res in results)
    info = [i for res in results for i in res.get("info", [])]
    for i in info[:10]:
        say("  odd round:", json.dumps(i)[:600])
    say("powercut: %s rounds ended by: %s; guest seconds per phase (all VMs): %s"
        % (fs, ends, {k: round(v) for k, v in sorted(timing.items())}))
    say(replay.summary(fs, ct) + " rounds=%d ro_rounds=%d vms=%d vm_seconds=%s "
        "cpu_seconds=%s" % (
            ct["rounds"], ct.get("ro_rounds", 0), len(results),
            "+".join("%.0f" % res["vm_seconds"] for res in results),
            "+".join("%.0f" % res["cpu_seconds"] for res in results)))
    fault = {k: t[k] - ct.get(k, 0) for k in t if isinstance(t[k], int)}
    fault["seconds"] = max(res.get("fault_seconds", 0) for res in results)
    fault["cuts"] = fault.get("rounds", 0)     # each fault round ends in a reboot
    say(replay.summary(fs + "-faults", fault) + " producer_errors=%d "
        "ubi_io_errors=%d ubi_bitflips=%d ubi_ro_mode=%d worker_died=%d" % (
            t.get("fault_errors", 0), t.get("io_errors", 0), t.get("bitflips", 0),
            t.get("ro_mode", 0), t.get("worker_died", 0)))
    w = results[0].get("wear")
    if w:
        say("powercut: fs=%s-wear cuts=0 lost=0 doubled=0 corrupt=0 jobs=%d "
            "nand_bytes_written=%s mtd_writes=%s erase_blocks_written=%s "
            "ubi_erases=%d erase_block_bytes=%d per_1000_jobs: bytes=%s "
            "erase_blocks_written=%s bytes_in_erase_blocks=%s ubi_erases=%.1f" % (
                fs, w["jobs"], w.get("bytes"), w.get("writes"), w.get("blocks_written"),
                w["erases"], w["erase_bytes"], w.get("bytes_per_1000"),
                w.get("blocks_written_per_1000"), w.get("block_equivalents_per_1000"),
                w["erases_per_1000"]))
    merged = dict(t)
    if unfinished or short:
        say("powercut: %s: %s" % (fs, "; ".join(
            (["VM %s did not finish" % unfinished] if unfinished else [])
            + (["%d cuts fewer than the %d asked for" % (short, a.cuts)] if short else []))))
        merged["recover"] = merged.get("recover", 0) + 1    # an unfinished part fails
    return merged


RAM_GUEST = r"""exec > /run/pc/guest.log 2>&1
ip link set lo up || ifconfig lo up
python3 {here}/ram_guest.py --fs {fs} --myq {myq} --out /run/pc \
    --cuts {cuts} --seed {seed} --spill-after {spill} --margin {margin} \
    --policy-spill-after {policy}
"""


def part_ram(a, out, k=0, fs="ext4"):
    """One VM of a RAM part (of --ram-vms): its share of the cuts."""
    name = fs + "-ram"
    n = max(1, a.ram_vms)
    cuts = _share(n, k, a.ram_cuts)
    share = tempfile.mkdtemp(prefix="pc-%s-" % name, dir=a.tmp)
    disks = []
    if fs == "ext4":
        disk = os.path.join(a.tmp, "ram-%d.img" % k)
        with open(disk, "wb") as f:
            f.truncate(a.ext4_mb << 20)
        sh(["mkfs.ext4", "-q", "-F", "-E",
            "lazy_itable_init=0,lazy_journal_init=0", disk])
        disks = [disk]
    script = RAM_GUEST.format(here=HERE, myq=MYQ, fs=fs, cuts=cuts,
                              seed=a.seed + 4000 + 100 * k + (fs == "ubifs"),
                              spill=a.spill_after, margin=a.bound_margin,
                              policy=a.ram_policy_spill_after)
    t0 = time.monotonic()
    # a round is ~5 s under TCG (up to 4 s of work, the reboot, the
    # recovery): 10 s a cut on a busy machine
    r = vm.boot(script, work=share, disks=disks, timeout=a.vm_timeout + 10 * cuts,
                append="log_buf_len=16M loglevel=3")
    t_vm = time.monotonic() - t0
    say("powercut: %s VM %d: rc=%s boot=%.1fs vm=%.0fs cpu=%.0fs cuts=%d" % (
        name, k, r["rc"], r["boot_seconds"] or -1, t_vm, r["cpu_seconds"], cuts))
    dest = os.path.join(out, "%s-vm%d" % (name, k))
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for f in os.listdir(share):
        if f.startswith(("ram-", "guest.log", "console.log")):
            shutil.copy(os.path.join(share, f), os.path.join(dest, f))
    res = _guest_result(share, "ram-result.json", r)
    if res is None:
        return None
    for f in res.get("found", [])[:10]:
        say("  found:", json.dumps(f)[:1500])
    if res.get("stage") != "end":
        say("powercut: %s VM %d stopped during the %s stage (timeout?)"
            % (name, k, res.get("stage")))
    res.update(vm_seconds=round(t_vm, 1), cpu_seconds=round(r["cpu_seconds"], 1),
               want_cuts=cuts)
    return res


def report_ram(a, results, fs="ext4"):
    """One line for all the VMs of a RAM part; the totals with `recover`
    raised when the run could not check what it claims."""
    name = fs + "-ram"
    if not results or any(r is None for r in results):
        say("powercut: fs=%s: no result from %d of %d VMs (see above)" % (
            name, sum(r is None for r in results), len(results)))
        return None
    t = {}
    for res in results:
        for key, v in res["totals"].items():
            if key in ("max_lost_in_a_cut", "oldest_lost_s", "bound_s", "margin_s"):
                t[key] = max(t.get(key, 0), v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                t[key] = t.get(key, 0) + v
            elif key == "bound_wrong":
                t[key] = v
    kinds, modes = {}, {}
    for res in results:
        _add(kinds, res.get("kinds", {}))
        _add(modes, res.get("modes", {}))
    say("powercut: %s cuts by kind: %s; links: %s; slowest cut: %ss from T to "
        "the cut in place (the worker stopped at T)"
        % (name, kinds, modes, max(res.get("max_cut_lag_s", 0) for res in results)))
    say(ramcheck.summary(name, t) + " vms=%d vm_seconds=%s" % (
        len(results), "+".join("%.0f" % res["vm_seconds"] for res in results)))
    wrong = ramcheck.problems(t, a.ram_cuts)
    wrong += ["VM %d did not finish" % k for k, res in enumerate(results)
              if res.get("stage") != "end"]
    if wrong:
        say("powercut: %s FAILED: %s" % (name, "; ".join(wrong)))
        t["recover"] = t.get("recover", 0) + 1
    return t


def part_boot(a, out, k=0):
    import boot_part
    return boot_part.run(a, out, vm, replay)


def report_boot(a, results):
    t = results[0]
    if t is None:
        say("powercut: fs=ext4-boot: no result (see above)")
        return None
    say(replay.summary("ext4-boot", t) + " killed_after=%ss" % a.boot_kill)
    return t


def _on(store, fn):
    return lambda *args: fn(*args, store=store)


# name: (task, report); the order is the start order (longest first)
PARTS = {"ubifs-ram": (lambda *x: part_ram(*x, fs="ubifs"),
                       lambda *x: report_ram(*x, fs="ubifs")),
         "ext4-ram": (lambda *x: part_ram(*x, fs="ext4"),
                      lambda *x: report_ram(*x, fs="ext4")),
         "ext4": (part_ext4, report_ext4), "ubifs": (part_ubifs, report_ubifs),
         "ubifs-sqlite": (_on("sqlite", part_ubifs), _on("sqlite", report_ubifs)),
         "ext4-sqlite": (_on("sqlite", part_ext4), _on("sqlite", report_ext4)),
         "boot": (part_boot, report_boot)}



def _guest_result(share, name, r):
    """The guest's result file `name` in `share`, read; None (the console's
    and the guest log's ends said) when there is none to read."""
    try:
        with open(os.path.join(share, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        say(r["console"][-3000:])
        try:
            say(open(os.path.join(share, "guest.log")).read()[-3000:])
        except OSError:
            pass
        return None

def vms_of(a, name):
    """How many VMs (tasks) a part has."""
    if name.endswith("-ram"):
        return max(1, a.ram_vms)
    return max(1, a.ubifs_vms) if name.startswith("ubifs") else 1


def tasks_of(a, parts):
    out = []
    for name in PARTS:
        if name in parts:
            for k in range(vms_of(a, name)):
                out.append((name, k))
    return out


def _terminate_on_sigterm():
    """SIGTERM (timeout(1), CI's cap) unwinds: the finally clauses stop
    the children and their VMs."""
    import signal

    def stop(sig, frame):
        raise SystemExit("powercut: stopped by signal %d" % sig)
    signal.signal(signal.SIGTERM, stop)


def run_task(a, spec, result_path):
    """In a child process: one task; its result (JSON) to result_path."""
    global PREFIX
    _terminate_on_sigterm()
    name, k = spec.split(":")
    PREFIX = "[%s] " % (name if vms_of(a, name) == 1 else "%s-%s" % (name, k))
    t0 = time.monotonic()
    # the task's disks and shared directories (the guest sees /var/tmp);
    # gone at the end, also when the task is stopped, unless --keep
    a.tmp = tempfile.mkdtemp(prefix="pc-task-%s-%s-" % (name, k), dir="/var/tmp")
    try:
        res = PARTS[name][0](a, RESULTS, int(k))
    except Exception:
        import traceback
        say(traceback.format_exc())
        res = None
    finally:
        if a.keep:
            say("powercut: kept %s" % a.tmp)
        else:
            shutil.rmtree(a.tmp, ignore_errors=True)
    say("powercut: %s %s done in %.0fs" % (name, k, time.monotonic() - t0))
    with open(result_path + ".tmp", "w") as f:
        json.dump(res, f)
    os.rename(result_path + ".tmp", result_path)
    return 0


def run_parts(a, parts, argv):
    """Start the tasks, at most a.parallel at once; report each part when
    all its tasks are done.  Returns {part: merged totals or None}."""
    todo = tasks_of(a, parts)
    want = {}
    for name, k in todo:
        want[name] = want.get(name, 0) + 1
    got = {name: {} for name in want}
    running = {}
    tmp = tempfile.mkdtemp(prefix="pc-tasks-", dir="/var/tmp")
    reported = {}
    _terminate_on_sigterm()
    try:
        while todo or running:
            while todo and len(running) < max(1, a.parallel):
                name, k = todo.pop(0)
                path = os.path.join(tmp, "%s-%d.json" % (name, k))
                p = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                      "--task", "%s:%d" % (name, k),
                                      "--task-result", path] + list(argv))
                running[p] = (name, k, path, time.monotonic())
                say("powercut: started %s %d (pid %d)" % (name, k, p.pid))
            time.sleep(0.5)
            for p in [p for p in running if p.poll() is not None]:
                name, k, path, t0 = running.pop(p)
                try:
                    with open(path) as f:
                        got[name][k] = json.load(f)
                except (OSError, ValueError):
                    say("powercut: %s %d exited %s without a result" % (
                        name, k, p.returncode))
                    got[name][k] = None
                if len(got[name]) == want[name]:
                    reported[name] = PARTS[name][1](
                        a, [got[name][j] for j in sorted(got[name])])
    finally:
        for p in running:
            p.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    return reported


def _hidden_in_guest(path):
    """The guest mounts fresh /tmp, /run, /proc, /sys and /dev over the
    host's root: a checkout there is out of its sight."""
    return any(path == d or path.startswith(d + "/")
               for d in ("/tmp", "/run", "/proc", "/sys", "/dev"))


def _run_from_copy(argv):
    """Run from a copy of what the guest needs (myq.py, init.d/,
    tests/powercut/) under the cache directory, which the guest sees."""
    os.makedirs(vm.CACHE, exist_ok=True)
    # a directory of this run's own: CI runs two at once
    src = tempfile.mkdtemp(prefix="src-", dir=vm.CACHE)
    os.makedirs(os.path.join(src, "tests"))
    shutil.copy2(MYQ, os.path.join(src, "myq.py"))
    shutil.copytree(os.path.join(REPO, "init.d"), os.path.join(src, "init.d"))
    shutil.copytree(HERE, os.path.join(src, "tests", "powercut"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    say("powercut: %s is out of the guest's sight: running from a copy in %s"
        % (REPO, src))
    env = dict(os.environ, POWERCUT_COPY="1")
    try:
        return subprocess.call([sys.executable, os.path.join(
            src, "tests", "powercut", "powercut.py")] + list(
            sys.argv[1:] if argv is None else argv), env=env)
    finally:
        shutil.rmtree(src, ignore_errors=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="*")
    ap.add_argument("--jobs", type=int, default=520)
    ap.add_argument("--cli", type=int, default=12)
    ap.add_argument("--shell", type=int, default=12)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--subsets", type=int, default=2)
    ap.add_argument("--max-points", type=int, default=int(
        os.environ.get("POWERCUT_MAX_POINTS", "0")))
    ap.add_argument("--sqlite-max-points", type=int, default=int(
        os.environ.get("POWERCUT_SQLITE_MAX_POINTS", "200")),
        help="ext4-sqlite: flush points replayed (0: all)")
    ap.add_argument("--sqlite-min-cuts", type=int, default=200,
                    help="ext4-sqlite: fewer cuts fail the part")
    ap.add_argument("--sqlite-faults", type=int, default=2,
                    help="ubifs-sqlite: fault rounds (shared by its VMs)")
    ap.add_argument("--ext4-mb", type=int, default=64)
    ap.add_argument("--cuts", type=int, default=int(
        os.environ.get("POWERCUT_CUTS", "200")))
    ap.add_argument("--faults", type=int, default=6)
    ap.add_argument("--wear-jobs", type=int, default=1000)
    ap.add_argument("--ubifs-vms", type=int, default=2,
                    help="VMs sharing the UBIFS cuts and fault rounds")
    ap.add_argument("--ram-cuts", type=int, default=int(
        os.environ.get("POWERCUT_RAM_CUTS", "200")),
        help="ext4-ram, ubifs-ram: power cuts each (shared by --ram-vms)")
    ap.add_argument("--ram-vms", type=int, default=2,
                    help="VMs sharing a RAM part's cuts")
    ap.add_argument("--spill-after", type=float, default=2.0,
                    help="the RAM parts' spill_after (seconds): the bound")
    ap.add_argument("--bound-margin", type=float, default=1.0,
                    help="the RAM parts: a job lost that was promised more "
                    "than spill_after + this before the cut is beyond the bound")
    ap.add_argument("--ram-policy-spill-after", type=float, default=0,
                    help="the RAM parts' type gets this spill_after while the "
                    "bound checked stays --spill-after (a test of the "
                    "harness: a longer one must fail the part)")
    ap.add_argument("--parallel", type=int, default=int(os.environ.get(
        "POWERCUT_PARALLEL", min(2, os.cpu_count() or 1))),
        help="VMs (tasks) at once; each keeps one CPU busy")
    ap.add_argument("--boot-kill", type=float, default=40,
                    help="seconds after which the first boot is killed")
    ap.add_argument("--vm-timeout", type=float, default=900)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--task-result", help=argparse.SUPPRESS)
    ap.add_argument("--prepare", action="store_true",
                    help="only install what the VMs need and build their "
                    "initramfs (CI does it while the suite runs)")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        say("powercut: skipped: needs root (apt-get, qemu, loop devices, mount)")
        return 0
    if a.prepare:
        vm.ensure_tools()
        vm.initramfs()
        return 0
    if a.task:
        return run_task(a, a.task, a.task_result)
    if _hidden_in_guest(REPO) and not os.environ.get("POWERCUT_COPY"):
        return _run_from_copy(argv)
    unknown = [p for p in a.parts if p not in PARTS]
    if unknown:
        ap.error("unknown part(s) %s: the parts are %s" % (
            " ".join(unknown), " ".join(PARTS)))
    vm.ensure_tools()
    vm.initramfs()          # built once, before the tasks share it
    os.makedirs(RESULTS, exist_ok=True)
    t0 = time.monotonic()
    parts = a.parts or list(PARTS)
    reported = run_parts(a, parts, argv)
    bad = False
    for name in parts:
        t = reported.get(name)
        if t is None or any(t.get(k) for k in replay.BAD):
            bad = True
    say("powercut: total %.0fs (%d at once), results in %s" % (
        time.monotonic() - t0, a.parallel, RESULTS))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
