#!/usr/bin/env python3
"""A real boot: BusyBox init (PID 1) runs an rcS that starts init.d/myq.

Host side (run()): builds an initramfs whose /init execs `busybox init`;
/etc/inittab runs /etc/init.d/rcS, which mounts the host root (9p) and the
work dir, then runs /run/pc/rc.local in the host-root chroot: it mounts the
spool's ext4 disk (/dev/vda) and starts the service with the repository's
init.d/myq (MYQ_DEFAULTS pointing at settings written here), then this file
in the background.  Boot 1 (`produce`): enqueue batches without end,
journalling each returned enqueue to the work dir; the host kills QEMU
mid-work.  Boot 2 (`verify`): the service recovers the spool; once it is
idle, stop it, run the checks (check.py) against every job whose enqueue
had returned, write boot-result.json, power off (SIGUSR2 to init).
"""

import hashlib
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MYQ = os.path.join(REPO, "myq.py")
SPOOL = "/run/mnt/spool"

INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
exec /bin/busybox init
"""
INITTAB = """::sysinit:/etc/init.d/rcS
::shutdown:/bin/sync
"""
RCS = r"""#!/bin/sh
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /lib/modules/order); do insmod /lib/modules/$m; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /newroot
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t devtmpfs dev /newroot/dev
mount -t tmpfs tmp /newroot/tmp
mount -t tmpfs run /newroot/run
mkdir -p /newroot/run/pc /newroot/run/mnt
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 work /newroot/run/pc
echo "powercut-guest: root up $(cut -d' ' -f1 /proc/uptime)"
chroot /newroot /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    TMPDIR=/tmp /bin/sh /run/pc/rc.local > /newroot/run/pc/rc.local.log 2>&1
echo "powercut-guest: rcS done"
"""
RC_LOCAL = r"""modprobe virtio_blk
modprobe ext4
mount -t ext4 /dev/vda /run/mnt
MYQ_DEFAULTS=/run/pc/default-myq sh {repo}/init.d/myq start
setsid python3 {here}/boot_part.py {phase} > /run/pc/{phase}.log 2>&1 < /dev/null &
"""
# (--keep-done-max: every done job stays, the proof that it was delivered:
# retention's default 1,000 removed the first done jobs of a fast boot,
# which the check then counted lost)
DEFAULTS = """MYQ_SPOOL={spool}
MYQ_BIN={myq}
MYQ_ARGS="--module {here}/handlers.py --backoff-base 0.2 --backoff-max 1 --keep-done-max 1000000"
MYQ_LOG=/run/mnt/myq.log
MYQ_PIDFILE=/run/myq.pid
"""


def produce():
    sys.path.insert(0, REPO)
    import myq
    rng = random.Random()
    j = open("/run/pc/boot-journal", "a")
    n = 0
    while True:
        specs = []
        for i in range(rng.randint(1, 10)):
            blob = "%x" % rng.getrandbits(4 * rng.choice((16, 400)))
            t = "ok" if rng.random() < 0.85 else ("flaky" if rng.random() < 0.5 else "bad")
            specs.append({"type": t, "payload": {
                "n": n, "blob": blob,
                "sum": hashlib.sha256(blob.encode()).hexdigest()[:16]}})
            n += 1
        ids = myq.open_store(SPOOL).enqueue_many(specs)
        j.write(json.dumps({i: s["payload"]["sum"] for i, s in zip(ids, specs)}) + "\n")
        j.flush()
        os.fsync(j.fileno())
        time.sleep(rng.choice((0, 0.05, 0.2)))


def verify():
    sys.path.insert(0, HERE)
    import check
    promised = {}
    with open("/run/pc/boot-journal") as f:
        for line in f:
            try:
                promised.update(json.loads(line))
            except ValueError:
                pass
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        busy = [n for n in os.listdir(os.path.join(SPOOL, "incoming"))
                if n.endswith(".json") and os.stat(os.path.join(
                    SPOOL, "incoming", n)).st_mtime < time.time()]
        busy += os.listdir(os.path.join(SPOOL, "processing"))
        if not busy:
            break
        time.sleep(1)
    env = dict(os.environ, MYQ_DEFAULTS="/run/pc/default-myq")
    subprocess.run(["sh", os.path.join(REPO, "init.d", "myq"), "stop"], env=env)
    res = check.recover_and_check(SPOOL, promised, MYQ, "/tmp", fork=True)
    res["promised"] = len(promised)
    with open(os.path.join(SPOOL, "..", "myq.log"), errors="replace") as f:
        log = f.read()
    res["log_taken_back"] = log.count("taken back") + log.count("requeued")
    with open("/run/pc/boot-result.json", "w") as f:
        json.dump(res, f, indent=1)
    subprocess.run(["sync"])
    os.kill(1, 12)      # SIGUSR2: BusyBox init powers off


def run(a, out, vm, replay):
    import shutil
    import tempfile
    share = tempfile.mkdtemp(prefix="pc-boot-", dir=getattr(a, "tmp", "/var/tmp"))
    disk = os.path.join(share, "spool.img")
    with open(disk, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", disk], check=True)
    _, ver = vm.kernel()
    initrd = os.path.join(share, "initrd-boot.cpio")
    vm.build_initramfs(ver, initrd, extra_init=INIT, files=[
        ("etc/inittab", INITTAB, 0o644), ("etc/init.d/rcS", RCS, 0o755)])
    with open(os.path.join(share, "default-myq"), "w") as f:
        f.write(DEFAULTS.format(spool=SPOOL, myq=MYQ, here=HERE))
    times = []
    for phase, kill in (("produce", a.boot_kill), ("verify", None)):
        with open(os.path.join(share, "rc.local"), "w") as f:
            f.write(RC_LOCAL.format(repo=REPO, here=HERE, phase=phase))
        r = vm.boot("", work=share, disks=[disk], initrd=initrd,
                    timeout=a.vm_timeout, kill_after=kill)
        times.append(r["seconds"])
        print("powercut: boot %s: %.0fs killed=%s boot=%.1fs" % (
            phase, r["seconds"], r["killed"], r["boot_seconds"] or -1), flush=True)
    try:
        with open(os.path.join(share, "boot-result.json")) as f:
            res = json.load(f)
    except (OSError, ValueError):
        for name in ("rc.local.log", "produce.log", "verify.log", "console.log"):
            try:
                print(name, open(os.path.join(share, name)).read()[-1500:])
            except OSError:
                pass
        return None
    for n in res.get("notes", [])[:10]:
        print("  found:", n)
    for name in os.listdir(share):
        if name.endswith((".log", ".json")) or name == "boot-journal":
            shutil.copy(os.path.join(share, name), os.path.join(out, "boot-" + name))
    if not a.keep:
        shutil.rmtree(share, ignore_errors=True)
    t = dict(res, cuts=1, fsck=0, nul_cuts=int(bool(res.get("nul_tails"))),
             seconds=round(sum(times), 1))
    t.pop("notes", None)
    return t


if __name__ == "__main__":
    {"produce": produce, "verify": verify}[sys.argv[1]]()
