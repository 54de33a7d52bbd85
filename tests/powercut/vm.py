#!/usr/bin/env python3
"""Boot a throw-away QEMU VM (TCG) that runs a command in the host's own root.

    python3 tests/powercut/vm.py [--disk FILE ...] [--timeout S] [--] CMD...

The guest is Debian's kernel (the host's /boot/vmlinuz-*, installed from
linux-image-amd64 when missing) with a tiny initramfs built here: Debian's
static BusyBox as /init's shell plus the modules needed to reach the host
(virtio_pci, 9pnet_virtio, 9p and their dependencies, read from
modules.dep).  /init mounts the host's root read-only over virtio-9p
(tag `hostroot`), puts fresh proc, sys, dev, /tmp and /run on top of it,
mounts the work directory (tag `work`, read-write, a host temp dir) at
/run/pc, chroots into the host root and runs /run/pc/cmd.sh there (with the
host's python3, modprobe, dmsetup ...), writes its exit status to
/run/pc/rc and powers off.  Disks given with --disk appear as /dev/vda,
/dev/vdb, ... (virtio_blk is loaded by modprobe inside the chroot).

Python stdlib only, run as root on the host.  Used as a library by the
other scripts here: ensure_tools(), build_initramfs(), boot().
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.environ.get("POWERCUT_CACHE", "/var/tmp/myq-powercut")

PACKAGES = {            # what must exist -> the Debian package bringing it
    "qemu-system-x86_64": "qemu-system-x86",
    "busybox-static": "busybox-static",
    "ubimkvol": "mtd-utils",
    "dmsetup": "dmsetup",
    "mkfs.ext4": "e2fsprogs",
    "losetup": "mount",
}
INITRD_MODULES = ("virtio_pci", "9pnet_virtio", "9p")


def log(*a):
    print("powercut:", *a, file=sys.stderr, flush=True)


def _static_busybox():
    for p in ("/bin/busybox", "/usr/bin/busybox"):
        try:
            out = subprocess.run(["file", "-L", p], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL).stdout
        except OSError:
            out = b""
        if os.path.exists(p) and (b"statically linked" in out or _elf_static(p)):
            return p
    return None


def _elf_static(path):
    """True when the ELF file has no PT_INTERP (no dynamic loader)."""
    import struct
    try:
        with open(path, "rb") as f:
            h = f.read(64)
            if h[:4] != b"\x7fELF" or h[4] != 2:
                return False
            phoff, = struct.unpack_from("<Q", h, 32)
            phentsize, phnum = struct.unpack_from("<HH", h, 54)
            f.seek(phoff)
            ph = f.read(phentsize * phnum)
        return not any(struct.unpack_from("<I", ph, i * phentsize)[0] == 3
                       for i in range(phnum))
    except (OSError, struct.error):
        return False


def kernel():
    """(vmlinuz path, version) of the newest Debian kernel in /boot."""
    best = None
    for p in glob.glob("/boot/vmlinuz-*"):
        ver = p[len("/boot/vmlinuz-"):]
        if os.path.isdir("/lib/modules/%s/kernel" % ver):
            key = [int(x) if x.isdigit() else 0 for x in re.split(r"[.-]", ver)]
            if best is None or key > best[0]:
                best = (key, p, ver)
    return (best[1], best[2]) if best else (None, None)


def missing_packages():
    need = []
    for tool, pkg in PACKAGES.items():
        if tool == "busybox-static":
            if not _static_busybox():
                need.append(pkg)
        elif not shutil.which(tool) and not os.path.exists("/usr/sbin/" + tool) \
                and not os.path.exists("/sbin/" + tool):
            need.append(pkg)
    if kernel()[0] is None:
        need.append("linux-image-amd64")
    if not shutil.which("file"):
        need.append("file")
    return sorted(set(need))


def ensure_tools():
    need = missing_packages()
    if not need:
        return
    if os.geteuid() != 0:
        raise SystemExit("powercut: needs root to install %s" % " ".join(need))
    log("installing", " ".join(need))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends"]
                   + need, env=env, check=True, stdout=subprocess.DEVNULL)
    left = missing_packages()
    if left:
        raise SystemExit("powercut: still missing after apt-get: %s" % left)


# initramfs -------------------------------------------------------------------

def _moddeps(ver, names):
    """Module files (relative to /lib/modules/VER) for names, dependencies
    first, from modules.dep."""
    base = "/lib/modules/%s" % ver
    deps = {}
    with open(os.path.join(base, "modules.dep")) as f:
        for line in f:
            mod, _, rest = line.partition(":")
            deps[mod.strip()] = rest.split()
    byname = {}
    for mod in deps:
        n = os.path.basename(mod)
        n = re.sub(r"\.ko(\..*)?$", "", n).replace("-", "_")
        byname[n] = mod
    order = []

    def add(mod):
        if mod in order:
            return
        for d in reversed(deps.get(mod, [])):   # modules.dep: deepest last
            add(d)
        order.append(mod)
    for n in names:
        n = n.replace("-", "_")
        if n not in byname:
            continue        # built in
        add(byname[n])
    return [os.path.join(base, m) for m in order]


class Cpio(object):
    """A cpio archive in the 'newc' format, as the kernel unpacks it."""

    def __init__(self):
        self.parts = []
        self.ino = 1000

    def _add(self, name, mode, data=b"", rdev=(0, 0), nlink=1):
        self.ino += 1
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join("%08X" % v for v in (
            self.ino, mode, 0, 0, nlink, 0, len(data), 0, 0,
            rdev[0], rdev[1], len(nb), 0))
        rec = hdr.encode() + nb
        rec += b"\0" * (-len(rec) % 4)
        rec += data + b"\0" * (-len(data) % 4)
        self.parts.append(rec)

    def dir(self, name):
        self._add(name, 0o040755, nlink=2)

    def file(self, name, data, mode=0o644):
        self._add(name, 0o100000 | mode, data)

    def symlink(self, name, target):
        self._add(name, 0o120777, target.encode())

    def chardev(self, name, major, minor):
        self._add(name, 0o020600, rdev=(major, minor))

    def bytes(self):
        self._add("TRAILER!!!", 0)
        out = b"".join(self.parts)
        return out + b"\0" * (-len(out) % 512)


INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /lib/modules/order); do insmod /lib/modules/$m; done
echo "powercut-guest: initramfs up $(cut -d' ' -f1 /proc/uptime)"
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /newroot || poweroff -f
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t devtmpfs dev /newroot/dev
mount -t tmpfs tmp /newroot/tmp
mount -t tmpfs run /newroot/run
mkdir -p /newroot/run/pc /newroot/run/mnt
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 work /newroot/run/pc || poweroff -f
[ -d /newroot/sys/kernel/debug ] && mount -t debugfs debugfs /newroot/sys/kernel/debug
echo "powercut-guest: root up $(cut -d' ' -f1 /proc/uptime)"
chroot /newroot /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    TMPDIR=/tmp DM_DISABLE_UDEV=1 /bin/sh /run/pc/cmd.sh
rc=$?
echo $rc > /newroot/run/pc/rc
echo "powercut-guest: exit $rc at $(cut -d' ' -f1 /proc/uptime)"
sync
umount /newroot/run/pc
poweroff -f
"""


def build_initramfs(ver, out, extra_init=None, files=()):
    busybox = _static_busybox()
    c = Cpio()
    for d in ("bin", "dev", "proc", "sys", "newroot", "lib", "lib/modules",
              "etc", "tmp", "root"):
        c.dir(d)
    c.chardev("dev/console", 5, 1)
    c.chardev("dev/null", 1, 3)
    with open(busybox, "rb") as f:
        c.file("bin/busybox", f.read(), 0o755)
    c.symlink("bin/sh", "busybox")
    mods = _moddeps(ver, INITRD_MODULES)
    names = []
    for m in mods:
        n = os.path.basename(m)
        with open(m, "rb") as f:
            c.file("lib/modules/" + n, f.read())
        names.append(n)
    c.file("lib/modules/order", ("\n".join(names) + "\n").encode())
    c.file("init", (extra_init or INIT).encode(), 0o755)
    for d in sorted(set(os.path.dirname(n) for n, _, _ in files)):
        if d and d not in ("bin", "etc", "lib"):
            c.dir(d)
    for name, data, mode in files:
        c.file(name, data.encode(), mode)
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(c.bytes())
    os.rename(tmp, out)
    return out


def initramfs():
    """The cached initramfs for the current kernel (built when missing)."""
    vmlinuz, ver = kernel()
    os.makedirs(CACHE, exist_ok=True)
    out = os.path.join(CACHE, "initrd-%s.cpio" % ver)
    stamp = out + ".src"
    src = INIT + "\n" + ver + "\n" + str(_static_busybox())
    try:
        with open(stamp) as f:
            fresh = f.read() == src and os.path.exists(out)
    except OSError:
        fresh = False
    if not fresh:
        build_initramfs(ver, out)
        with open(stamp, "w") as f:
            f.write(src)
    return vmlinuz, out


# boot ------------------------------------------------------------------------

def boot(script, work=None, disks=(), timeout=600, mem=512, append="",
         console=None, qemu_extra=(), kill_after=None, initrd=None):
    """Run `script` (sh text) in the guest.  Returns a dict: rc (the
    script's exit status, None when the guest did not finish), seconds,
    boot_seconds (kernel start to the chroot, from the guest's uptime),
    work (the shared directory), console (its text)."""
    ensure_tools()
    vmlinuz, default_initrd = initramfs()
    initrd = initrd or default_initrd
    own = work is None
    if own:
        work = tempfile.mkdtemp(prefix="pc-work-")
    with open(os.path.join(work, "cmd.sh"), "w") as f:
        f.write(script)
    try:
        os.unlink(os.path.join(work, "rc"))
    except OSError:
        pass
    cmd = ["qemu-system-x86_64", "-nographic", "-accel", "tcg", "-m", str(mem),
           "-smp", "1", "-no-reboot", "-kernel", vmlinuz, "-initrd", initrd,
           "-append", "console=ttyS0 panic=-1 quiet loglevel=4 " + append,
           "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,"
                      "readonly=on,multidevs=remap",
           "-virtfs", "local,path=%s,mount_tag=work,security_model=none" % work,
           "-nic", "none"]
    for d in disks:
        if isinstance(d, str):
            d = {"file": d}
        cmd += ["-drive", "file=%s,format=raw,if=virtio,cache=%s" % (
            d["file"], d.get("cache", "unsafe"))]
    cmd += list(qemu_extra)
    con_path = console or os.path.join(work, "console.log")
    t0 = time.monotonic()
    with open(con_path, "wb") as con:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=con,
                             stderr=subprocess.STDOUT)
        killed = False
        limit = kill_after if kill_after else timeout
        # os.wait4 rather than p.wait: the VM's own CPU time (user + sys of
        # QEMU), which other load on the host does not inflate the way it
        # inflates the wall time.
        try:
            while True:
                pid, status, ru = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() - t0 > limit:
                    p.kill()
                    pid, status, ru = os.wait4(p.pid, 0)
                    killed = True
                    break
                time.sleep(0.2)
        except BaseException:       # stopped (SIGTERM, ^C): no VM left behind
            p.kill()
            p.wait()
            raise
        p.returncode = status
    secs = time.monotonic() - t0
    with open(con_path, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    rc = None
    try:
        with open(os.path.join(work, "rc")) as f:
            rc = int(f.read().strip())
    except (OSError, ValueError):
        pass
    m = re.search(r"powercut-guest: root up ([0-9.]+)", text)
    return {"rc": rc, "seconds": secs, "killed": killed, "work": work,
            "cpu_seconds": ru.ru_utime + ru.ru_stime,
            "boot_seconds": float(m.group(1)) if m else None, "console": text}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--disk", action="append", default=[])
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--work", help="shared directory (default: a new temp dir)")
    ap.add_argument("--show-console", action="store_true")
    ap.add_argument("cmd", nargs="*", default=["uname -a; python3 -c 'import sys; print(sys.version)'"])
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("powercut: skipped (needs root: apt-get, loop devices, qemu)")
        return 0
    r = boot(" ".join(a.cmd) + "\n", work=a.work, disks=a.disk, timeout=a.timeout)
    if a.show_console or r["rc"] is None:
        sys.stdout.write(r["console"][-4000:])
    print("powercut: vm rc=%s boot=%.1fs total=%.1fs cpu=%.1fs work=%s" % (
        r["rc"], r["boot_seconds"] or -1, r["seconds"], r["cpu_seconds"], r["work"]))
    return 0 if r["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
