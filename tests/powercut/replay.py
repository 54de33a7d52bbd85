#!/usr/bin/env python3
"""Replay a dm-log-writes log onto a disk image, at every flush point.

    replay.py --log LOG --base IMG --journal J --myq myq.py [--subsets K]
              [--store sqlite]

The log format (the kernel's Documentation/admin-guide/device-mapper/
log-writes.rst and drivers/md/dm-log-writes.c): sector 0 holds the super
(le64 magic 0x6a736677736872, le64 version 1, le64 nr_entries, le32
sectorsize); then, from the next sector, nr_entries entries, each one
sector holding (le64 sector, le64 nr_sectors, le64 flags, le64 data_len)
followed by nr_sectors sectors of the data written (none for a discard or
a mark; a mark's text follows the entry header in the same sector).  Flags:
FLUSH 1, FUA 2, DISCARD 4, MARK 8, METADATA 16.  A write is logged when it
completes; the writes completed before a FLUSH are logged before it, so at
a power cut between two flushes the disk holds every write before the first
and any subset of the writes between them.

For each FLUSH/FUA entry this builds the disk as it was there (the prefix)
and, with --subsets K, K more images adding a random subset of the writes
logged before the next flush; on each it runs e2fsck -p, mounts it, runs
myq's recovery and checks (check.py).  A job counts as promised at a point
when the workload's mark for its returned enqueue lies before the point.

Each cut is checked on its own disk, provably, or fails (stale=1): a new
image file, labelled for the cut, on a new loop device; the mounted
filesystem must report that label before any check; the umount and the
detach must be seen done.  The replay runs in a private mount namespace
(this script re-executes itself under `unshare -m --propagation private`).
"""

import argparse
import fcntl
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check  # noqa: E402

MAGIC = 0x6a736677736872
FLUSH, FUA, DISCARD, MARK, METADATA = 1, 2, 4, 8, 16


BAD = ("lost", "doubled", "corrupt", "stuck", "recover", "fsck", "in_failed",
       "stale", "lost_beyond_bound")


class Entry(object):
    __slots__ = ("i", "sector", "nr", "flags", "off", "mark")

    def __repr__(self):
        return "<%d s=%d n=%d f=%d%s>" % (self.i, self.sector, self.nr,
                                         self.flags, " " + self.mark if self.mark else "")


def read_log(path):
    """(sectorsize, [Entry]) of a dm-log-writes log device image."""
    with open(path, "rb") as f:
        sup = f.read(32)
        magic, version, n, ss = struct.unpack_from("<QQQI", sup)
        if magic != MAGIC or version != 1:
            raise ValueError("%s: not a dm-log-writes log (magic %#x)" % (path, magic))
        entries = []
        pos = ss
        for i in range(n):
            f.seek(pos)
            hdr = f.read(ss)
            if len(hdr) < 32:
                break
            e = Entry()
            e.i = i
            e.sector, e.nr, e.flags, dlen = struct.unpack_from("<QQQQ", hdr)
            e.mark = None
            e.off = pos + ss
            pos += ss
            if e.flags & MARK:
                e.mark = hdr[32:32 + dlen].decode("utf-8", "replace")
            elif not e.flags & DISCARD:
                pos += e.nr * ss
            entries.append(e)
    return ss, entries


class Disk(object):
    def __init__(self, log_path, ss):
        self.log = open(log_path, "rb")
        self.ss = ss

    def apply(self, img, e):
        if e.flags & MARK or e.nr == 0:
            return 0
        img.seek(e.sector * self.ss)
        if e.flags & DISCARD:
            left = e.nr * self.ss
            while left:
                k = min(left, 1 << 20)
                img.write(b"\0" * k)
                left -= k
            return 0
        self.log.seek(e.off)
        data = self.log.read(e.nr * self.ss)
        img.write(data)
        return len(data)


def promises(journal_path, key="jobs"):
    """{mark name: {id: sum}} from the workload's journal (key "done":
    {mark name: [ids in done/ before a prune]})."""
    out = {}
    with open(journal_path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue        # a torn last line
            if key == "jobs" or rec.get(key):
                out[rec["mark"]] = rec.get(key) or {}
    return out


def run(cmd, **kw):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def _out(r, n=400):
    return r.stdout.decode("utf-8", "replace")[-n:].strip()


# The disk a cut is checked on must be that cut's, provably.  Each cut gets
# a new image file, a label of its own (written before the mount), a loop
# device of its own (losetup --find --show), and the replay runs in a
# private mount namespace.  Before any check the MOUNTED filesystem must
# report the cut's label; after the checks the umount and the detach must
# really happen.  (Before: one image file reused with `mount -o loop`; a
# process that copied the mount namespace while a cut was mounted kept
# that cut's superblock alive after a umount that exited 0, and the next
# `mount -o loop` of the same file got the same loop device and the old
# superblock back, with an earlier cut's recovered state.)

FS_IOC_GETFSLABEL = 0x81009431      # _IOR(0x94, 49, char[256]), Linux 4.18


def mount_ns_private():
    """None when this process's mounts are its own: its mount namespace is
    neither PID 1's nor its parent's, and no mount in it propagates to a
    peer group (no "shared:" in /proc/self/mountinfo).  Else why not."""
    try:
        mine = os.readlink("/proc/self/ns/mnt")
        for pid in (1, os.getppid()):
            try:
                if os.readlink("/proc/%d/ns/mnt" % pid) == mine:
                    return "this process is in the mount namespace of pid %d" % pid
            except (FileNotFoundError, PermissionError):
                pass        # gone, or out of our sight (not ours, then)
        with open("/proc/self/mountinfo") as f:
            for line in f:
                pre = line.split(" - ", 1)[0].split()
                if any(t.startswith("shared:") for t in pre[6:]):
                    return "mount %s propagates to its peers (%s)" % (
                        pre[4], " ".join(pre[6:]))
    except OSError as e:
        return "cannot read the mount namespace: %s" % e
    return None


def _unescape(path):
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def mounts(pid="self"):
    """[(maj:min, mount point, fstype, source)] of /proc/PID/mountinfo, in
    its order (a mount on top of another comes after it)."""
    out = []
    with open("/proc/%s/mountinfo" % pid) as f:
        for line in f:
            pre, _, post = line.rstrip("\n").partition(" - ")
            pre, post = pre.split(), post.split()
            if len(pre) >= 5 and len(post) >= 2:
                out.append((pre[2], _unescape(pre[4]), post[0], _unescape(post[1])))
    return out


def _majmin(dev):
    rdev = os.stat(dev).st_rdev
    return "%d:%d" % (os.major(rdev), os.minor(rdev))


def mounted_label(mnt):
    """The label of the filesystem mounted at mnt, as its superblock in the
    kernel says (FS_IOC_GETFSLABEL: not read from the disk)."""
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        buf = bytearray(256)
        fcntl.ioctl(fd, FS_IOC_GETFSLABEL, buf)
    finally:
        os.close(fd)
    return bytes(buf).split(b"\0", 1)[0].decode("utf-8", "replace")


def verify_mounted(mnt, dev, label):
    """[] when the filesystem at mnt is the cut's: the top mount there (in
    this namespace) is dev, by device number and source, and the mounted
    superblock reports the cut's label.  Else what differs."""
    problems = []
    want = _majmin(dev)
    top = [m for m in mounts() if m[1] == mnt]
    if not top:
        problems.append("nothing mounted at %s" % mnt)
    elif top[-1][0] != want or top[-1][3] != dev:
        problems.append("%s is device %s (%s), not %s (%s)" % (
            mnt, top[-1][0], top[-1][3], want, dev))
    try:
        got = mounted_label(mnt)
    except OSError as e:
        problems.append("cannot read the mounted filesystem's label: %s" % e)
    else:
        if got != label:
            problems.append(
                "the mounted filesystem's label is %r, this cut's is %r: the "
                "kernel handed back another filesystem's superblock" % (got, label))
    return problems


def _loop_sys(dev):
    return "/sys/block/%s/loop" % os.path.basename(dev)


def loop_backing(dev):
    """The file dev is bound to, or None when it is not bound."""
    try:
        with open(os.path.join(_loop_sys(dev), "backing_file")) as f:
            return f.read().strip()
    except OSError:
        return None


def loop_attach(img):
    """(device, problems): a free loop device bound to img."""
    r = run(["losetup", "--find", "--show", img])
    dev = r.stdout.decode("utf-8", "replace").strip()
    if r.returncode != 0 or not dev.startswith("/dev/"):
        return None, ["losetup --find --show exit %d: %s" % (r.returncode, _out(r))]
    back = loop_backing(dev)
    if back != os.path.realpath(img):
        return dev, ["%s is bound to %r, not to this cut's image %s" % (dev, back, img)]
    return dev, []


def holders(majmin):
    """Processes whose mount namespace holds a mount of
    the device majmin: "pid N (comm) at PATH", one per namespace."""
    out, seen = [], set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ns = os.readlink("/proc/%s/ns/mnt" % pid)
            if ns in seen:
                continue
            seen.add(ns)
            at = [m[1] for m in mounts(pid) if m[0] == majmin]
            if at:
                with open("/proc/%s/comm" % pid) as f:
                    out.append("pid %s (%s) at %s" % (pid, f.read().strip(), at[0]))
        except OSError:
            pass
    return out


def loop_detach(dev, wait=3.0):
    """Detach dev; [] when it is really unbound.  `losetup -d` of a device
    still open (a filesystem on it alive in another mount namespace) exits
    0 and only marks it to autoclear: so the device must be seen unbound."""
    majmin = _majmin(dev)
    back = loop_backing(dev)
    r = run(["losetup", "-d", dev])
    if r.returncode != 0:
        return ["losetup -d %s exit %d: %s" % (dev, r.returncode, _out(r))]
    t_end = time.monotonic() + wait
    while loop_backing(dev) is not None:
        if time.monotonic() > t_end:
            return ["%s (%s) still bound to %s %.0f s after losetup -d: its "
                    "filesystem is held, by: %s" % (
                        dev, majmin, back, wait,
                        "; ".join(holders(majmin)) or "nothing in /proc"
                        " (a lazy umount or a namespace without a process)")]
        time.sleep(0.05)
    return []


def umount(mnt, tries=20):
    """[] when mnt is unmounted (in this namespace); else what failed (and
    a lazy umount, so the replay goes on)."""
    for k in range(tries):
        r = run(["umount", mnt])
        if r.returncode == 0:
            break
        time.sleep(0.2)
    else:
        run(["umount", "-l", mnt])
        return ["umount %s failed %d times: %s (lazily unmounted)" % (
            mnt, tries, _out(r))]
    if any(m[1] == mnt for m in mounts()):
        return ["umount %s exited 0 but it is still mounted" % mnt]
    return []


def drop_other_cuts():
    """A new mount namespace is a copy: it holds every mount that was in
    the one it came from, among them a cut that a replay mounting in that
    namespace (the old way; or a test) had mounted just then, whose
    superblock this copy would keep alive.  Lazily unmount those here
    (this namespace's mounts propagate nowhere).  Returns the paths."""
    dropped = []
    for _, path, _, _ in reversed(mounts()):
        if "/pc-replay-" in path:
            if run(["umount", "-l", path]).returncode == 0:
                dropped.append(path)
    return dropped


def fsck_verdict(rc):
    """e2fsck -p's exit status -> the count it goes to: 0 none; 1
    (errors corrected, the preen a boot would do) "fsck_fixed", the cut
    still checked; 2 (corrected, reboot needed) and up "fsck", the cut
    failed and not checked."""
    if rc == 0:
        return None
    return "fsck_fixed" if rc == 1 else "fsck"


def new_image(src, path):
    """A new file (O_EXCL) at path with src's bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with open(src, "rb") as s:
            size = os.fstat(s.fileno()).st_size
            off = 0
            while off < size:
                n = os.sendfile(fd, s.fileno(), off, min(size - off, 1 << 30))
                if n <= 0:
                    raise OSError("sendfile: short copy of %s" % src)
                off += n
    finally:
        os.close(fd)


def check_cut(img, label, promised, myq_path, work, fs="ext4", pruned=(),
              store=None):
    """One cut, on img (a file made for this cut alone): e2fsck -p; the
    cut's label set; a loop device of its own; mount; the mounted
    filesystem proven to be this one (verify_mounted); recover and check;
    umount and detach, both seen done.  Returns check's dict and fsck
    (e2fsck >= 2 or a failed mount), fsck_fixed (e2fsck 1), fsck_exit,
    stale (the disk not provably the cut's: then not checked; or not
    released: umount or detach failed), notes."""
    res = {"fsck": 0, "fsck_fixed": 0, "stale": 0, "notes": []}
    notes = res["notes"]
    r = run(["e2fsck", "-p", img])
    res["fsck_exit"] = r.returncode
    verdict = fsck_verdict(r.returncode)
    if verdict:
        res[verdict] = 1
        notes.append("e2fsck -p exit %d%s: %s" % (
            r.returncode, " (errors corrected)" if r.returncode == 1 else "", _out(r)))
        if verdict == "fsck":
            return res
    r = run(["tune2fs", "-L", label, img])
    if r.returncode != 0:
        res["stale"] = 1
        notes.append("stale: tune2fs -L exit %d: %s" % (r.returncode, _out(r)))
        return res
    dev, problems = loop_attach(img)
    if dev is None or problems:
        res["stale"] = 1        # (a device bound to another file is left alone)
        notes.extend("stale: " + p for p in problems)
        return res
    mnt = os.path.join(os.path.realpath(work), "mnt-" + label)
    os.mkdir(mnt)
    problems = []
    try:
        if any(m[1] == mnt for m in mounts()):
            problems.append("%s was mounted before the cut's mount" % mnt)
            return res
        r = run(["mount", "-t", fs, dev, mnt])
        if r.returncode != 0:
            res["fsck"] = 1
            notes.append("mount failed: %s" % _out(r))
            return res
        try:
            wrong = verify_mounted(mnt, dev, label)
            if wrong:
                problems.extend(wrong)
                notes.append("not checked: the disk at %s is not this cut's" % mnt)
                return res
            spool = os.path.join(mnt, "spool")
            if not os.path.isdir(spool) and not promised:
                res["nospool"] = 1
                return res
            # recovery in forked children of this process (no interpreter
            # start per command: most of the time of a cut otherwise)
            chk = check.recover_and_check(spool, promised, myq_path, work,
                                          fork=True, pruned=pruned, store=store)
            notes.extend(chk.pop("notes", []))
            res.update(chk)
        finally:
            problems.extend(umount(mnt))
    finally:
        problems.extend(loop_detach(dev))
        try:
            os.rmdir(mnt)
        except OSError as e:
            problems.append("rmdir %s: %s" % (mnt, e))
        if problems:
            res["stale"] = 1
            notes.extend("stale: " + p for p in problems)
    return res


ID_KINDS = ("lost", "doubled", "corrupt", "stuck", "in_failed")


def add_cut(totals, distinct, res):
    """Add one cut's counts to totals and its ids to distinct ({kind: {id:
    cuts}}); totals[KIND_ids] = distinct ids of that kind so far."""
    totals["cuts"] += 1
    for key in totals:
        if key in res and key != "cuts" and isinstance(res[key], int):
            totals[key] += res[key]
    totals["nul_cuts"] += bool(res.get("nul_tails"))
    for kind, ids in (res.get("ids") or {}).items():
        d = distinct.setdefault(kind, {})
        for jid in set(ids):
            d[jid] = d.get(jid, 0) + 1
    for kind in ID_KINDS:
        totals[kind + "_ids"] = len(distinct.get(kind, ()))


def replay(log_path, base, journal, myq_path, subsets=2, seed=14,
           max_points=0, work=None, verbose=False, report=None, store=None):
    """Every chosen cut on a disk of its own (check_cut).  Only in a
    private mount namespace (main() makes one): a process that copies the
    namespace this replay mounts in would hold its cuts.  Returns (totals,
    found); the report (JSON) adds every distinct id behind each count and
    e2fsck's exit statuses."""
    why = mount_ns_private()
    if why:
        raise RuntimeError("replay: not in a private mount namespace (%s): run "
                           "replay.py, which re-executes itself under unshare -m "
                           "--propagation private" % why)
    t0 = time.monotonic()
    ss, entries = read_log(log_path)
    marks = promises(journal)
    # ids seen in done/ before a prune: nowhere after a cut is no loss for
    # them (a generated id keeps no record once its done file is pruned);
    # up to the end of a point's unflushed writes, which may hold the prune
    dones = promises(journal, "done")
    pruned, seen = set(), 0
    points = [e.i for e in entries if e.flags & (FLUSH | FUA)]
    chosen = points
    if max_points and len(points) > max_points:
        step = len(points) / float(max_points)
        chosen = sorted(set(points[int(k * step)] for k in range(max_points))
                        | {points[-1]})
    rng = random.Random(seed)
    work = tempfile.mkdtemp(prefix="pc-replay-", dir=work or "/dev/shm")
    prefix = os.path.join(work, "prefix.img")
    shutil.copyfile(base, prefix)
    disk = Disk(log_path, ss)
    totals = dict(lost=0, doubled=0, corrupt=0, stuck=0, recover=0, rerun=0,
                  fsck=0, cuts=0, in_failed=0, nul_tails=0, nul_cuts=0,
                  stale=0, fsck_fixed=0)
    distinct, fsck_exits, fixed = {}, {}, []
    run_tag = os.urandom(2).hex()
    found = []
    promised = {}
    applied = 0
    nxt_flush = {}
    for k, p in enumerate(points):
        nxt_flush[p] = points[k + 1] if k + 1 < len(points) else len(entries)
    chosen_set = set(chosen)
    with open(prefix, "r+b") as img:
        for p in points:
            while applied <= p:
                e = entries[applied]
                if e.mark and e.mark in marks:
                    promised.update(marks[e.mark])
                disk.apply(img, e)
                applied += 1
            if p not in chosen_set:
                continue
            img.flush()
            while seen < min(nxt_flush[p] + 1, len(entries)):
                if entries[seen].mark in dones:
                    pruned.update(dones[entries[seen].mark])
                seen += 1
            pending = [e for e in entries[p + 1:nxt_flush[p]]
                       if not e.flags & MARK and e.nr]
            variants = [()] + [
                tuple(e for e in pending if rng.random() < 0.5)
                for _ in range(subsets if pending else 0)]
            for v, extra in enumerate(variants):
                n = totals["cuts"]
                # a label of its own (16 bytes at most): cut number, run tag
                label = "c%d-%s" % (n, run_tag)
                test = os.path.join(work, "cut-%d.img" % n)
                new_image(prefix, test)
                if extra:
                    with open(test, "r+b") as t:
                        for e in extra:
                            disk.apply(t, e)
                try:
                    res = check_cut(test, label, dict(promised), myq_path, work,
                                    pruned=pruned, store=store)
                finally:
                    os.unlink(test)
                add_cut(totals, distinct, res)
                rc = str(res.get("fsck_exit"))
                fsck_exits[rc] = fsck_exits.get(rc, 0) + 1
                if totals["cuts"] % 100 == 0:
                    print("replay: %d cuts, at entry %d/%d, %.0fs" % (
                        totals["cuts"], p, len(entries), time.monotonic() - t0),
                        file=sys.stderr, flush=True)
                bad = [n for n in res.get("notes", []) if not n.startswith("rerun")]
                where = {"cut": n, "label": label, "point": p, "variant": v,
                         "extra": len(extra), "promised": len(promised),
                         "fsck_exit": res.get("fsck_exit")}
                if res.get("fsck_fixed"):
                    fixed.append(dict(where, notes=[b for b in bad
                                                    if b.startswith("e2fsck")]))
                if any(res.get(k) for k in BAD):
                    # notes capped; the counts and ids are whole
                    found.append(dict(
                        where, counts={k: res[k] for k in BAD if res.get(k)},
                        ids={k: sorted(set(i)) for k, i in
                             (res.get("ids") or {}).items() if i},
                        notes=bad[:10], notes_total=len(bad)))
                    if verbose:
                        print("replay: point %d/%d variant %d (%s): %s" % (
                            p, len(entries), v, label, bad[:5]),
                            file=sys.stderr, flush=True)
    totals["bytes_written"] = sum(e.nr * ss for e in entries
                                  if not e.flags & (MARK | DISCARD))
    totals["flushes"] = len(points)
    totals["points"] = len(chosen)
    totals["all_points"] = len(points)
    totals["entries"] = len(entries)
    totals["promised"] = len(promised)
    totals["seconds"] = round(time.monotonic() - t0, 1)
    if report:
        with open(report + ".tmp", "w") as f:
            json.dump({"totals": totals, "found": found, "fsck_exits": fsck_exits,
                       "fsck_fixed": fixed,
                       "distinct": {k: distinct.get(k, {}) for k in ID_KINDS}},
                      f, indent=1)
        os.rename(report + ".tmp", report)
    shutil.rmtree(work, ignore_errors=True)
    return totals, found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--journal", required=True)
    ap.add_argument("--myq", required=True)
    ap.add_argument("--subsets", type=int, default=2)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--max-points", type=int, default=0)
    ap.add_argument("--work", help="the directory for the cuts' images "
                    "(default /dev/shm; a temp dir is made in it)")
    ap.add_argument("--report")
    ap.add_argument("--store", default="files", choices=("files", "sqlite"),
                    help="the store of the workload's spool (the checker "
                    "reads queue.db for sqlite)")
    ap.add_argument("--quiet", action="store_true",
                    help="no line per failed cut (the report has them)")
    ap.add_argument("--list", action="store_true", help="print the entries")
    a = ap.parse_args(argv)
    if a.list:
        ss, entries = read_log(a.log)
        for e in entries:
            print(e)
        return 0
    why = mount_ns_private()
    if why:
        # again in a mount namespace of its own: unshare(1) runs this
        # script in this same process (the same pid)
        if os.environ.get("PC_REPLAY_UNSHARED") == str(os.getpid()):
            print("replay: still not in a private mount namespace after "
                  "unshare: %s" % why, file=sys.stderr)
            return 2
        env = dict(os.environ, PC_REPLAY_UNSHARED=str(os.getpid()))
        try:
            os.execvpe("unshare", ["unshare", "--mount", "--propagation", "private",
                                   sys.executable, os.path.abspath(__file__)]
                       + list(sys.argv[1:] if argv is None else argv), env)
        except OSError as e:
            print("replay: cannot run unshare: %s" % e, file=sys.stderr)
            return 2
    for path in drop_other_cuts():
        print("replay: dropped this namespace's copy of another replay's cut "
              "%s" % path, file=sys.stderr, flush=True)
    totals, found = replay(a.log, a.base, a.journal, a.myq, a.subsets, seed=a.seed,
                           max_points=a.max_points, work=a.work,
                           verbose=not a.quiet, report=a.report, store=a.store)
    print(summary("ext4" if a.store == "files" else "ext4-" + a.store, totals))
    return 0 if not found else 1


def summary(fs, t):
    """The one line each part ends with (counts summed over all cuts; the
    ext4 replay adds stale= and fsck_fixed= after fs_errors=, and the
    distinct ids behind lost, doubled and corrupt)."""
    line = ("powercut: fs=%s cuts=%d lost=%d doubled=%d corrupt=%d stuck=%d "
            "in_failed=%d recover_errors=%d fs_errors=%d" % (
                fs, t["cuts"], t["lost"], t["doubled"], t["corrupt"], t["stuck"],
                t["in_failed"], t["recover"], t["fsck"]))
    for k in ("stale", "fsck_fixed"):
        if k in t:
            line += " %s=%d" % (k, t[k])
    line += " recovery_runs=%d nul_tail_files=%d (in %d cuts)" % (
        t["rerun"], t["nul_tails"], t["nul_cuts"])
    for k in ("lost_ids", "doubled_ids", "corrupt_ids", "points", "all_points",
              "entries", "promised", "seconds"):
        if k in t:
            line += " %s=%s" % (k, t[k])
    return line


if __name__ == "__main__":
    sys.exit(main())
