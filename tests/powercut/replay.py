#!/usr/bin/env python3
"""Replay a dm-log-writes log onto a disk image, at every flush point.

    replay.py --log LOG --base IMG --journal J --myq myq.py [--subsets K]

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
"""

import argparse
import json
import os
import random
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


BAD = ("lost", "doubled", "corrupt", "stuck", "recover", "fsck", "in_failed")


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


def check_image(img, promised, myq_path, work, fs="ext4", pruned=()):
    """fsck, mount, recover, check.  Returns check's dict (+ fsck)."""
    r = run(["e2fsck", "-p", img])
    res = {"fsck": 0}
    if r.returncode >= 4:
        res["fsck"] = 1
        res["notes"] = ["e2fsck -p exit %d: %s" % (r.returncode, r.stdout[-400:])]
        return res
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    r = run(["mount", "-t", fs, "-o", "loop", img, mnt])
    if r.returncode != 0:
        res["fsck"] = 1
        res["notes"] = ["mount failed: %s" % r.stdout[-400:]]
        return res
    try:
        spool = os.path.join(mnt, "spool")
        if not os.path.isdir(spool) and not promised:
            res["notes"] = []
            res["nospool"] = 1
            return res
        # recovery in forked children of this process (no interpreter start
        # per command: most of the time of a cut otherwise)
        res.update(check.recover_and_check(spool, promised, myq_path, work,
                                           fork=True, pruned=pruned))
    finally:
        for _ in range(20):
            if run(["umount", mnt]).returncode == 0:
                break
            time.sleep(0.2)
    return res


def replay(log_path, base, journal, myq_path, subsets=2, seed=14,
           max_points=0, work=None, verbose=False, report=None):
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
    work = work or tempfile.mkdtemp(prefix="pc-replay-", dir="/dev/shm")
    prefix = os.path.join(work, "prefix.img")
    test = os.path.join(work, "test.img")
    shutil.copyfile(base, prefix)
    disk = Disk(log_path, ss)
    totals = dict(lost=0, doubled=0, corrupt=0, stuck=0, recover=0, rerun=0,
                  fsck=0, cuts=0, in_failed=0, nul_tails=0, nul_cuts=0)
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
                shutil.copyfile(prefix, test)
                if extra:
                    with open(test, "r+b") as t:
                        for e in extra:
                            disk.apply(t, e)
                res = check_image(test, dict(promised), myq_path, work,
                                  pruned=pruned)
                totals["cuts"] += 1
                if totals["cuts"] % 100 == 0:
                    print("replay: %d cuts, at entry %d/%d, %.0fs" % (
                        totals["cuts"], p, len(entries), time.monotonic() - t0),
                        file=sys.stderr, flush=True)
                for key in totals:
                    if key not in ("cuts", "nul_cuts"):
                        totals[key] += res.get(key, 0)
                totals["nul_cuts"] += bool(res.get("nul_tails"))
                bad = [n for n in res.get("notes", []) if not n.startswith("rerun")]
                if any(res.get(k) for k in BAD):
                    found.append({"point": p, "variant": v, "extra": len(extra),
                                  "promised": len(promised), "notes": bad[:10]})
                    if verbose:
                        print("replay: point %d/%d variant %d: %s" % (
                            p, len(entries), v, bad[:5]), file=sys.stderr)
    totals["bytes_written"] = sum(e.nr * ss for e in entries
                                  if not e.flags & (MARK | DISCARD))
    totals["flushes"] = len(points)
    totals["points"] = len(chosen)
    totals["all_points"] = len(points)
    totals["entries"] = len(entries)
    totals["promised"] = len(promised)
    totals["seconds"] = round(time.monotonic() - t0, 1)
    if report:
        with open(report, "w") as f:
            json.dump({"totals": totals, "found": found}, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    return totals, found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--journal", required=True)
    ap.add_argument("--myq", required=True)
    ap.add_argument("--subsets", type=int, default=2)
    ap.add_argument("--max-points", type=int, default=0)
    ap.add_argument("--report")
    ap.add_argument("--list", action="store_true", help="print the entries")
    a = ap.parse_args(argv)
    if a.list:
        ss, entries = read_log(a.log)
        for e in entries:
            print(e)
        return 0
    totals, found = replay(a.log, a.base, a.journal, a.myq, a.subsets,
                           max_points=a.max_points, verbose=True, report=a.report)
    print(summary("ext4", totals))
    return 0 if not found else 1


def summary(fs, t):
    """The one line each part ends with (counts summed over all cuts)."""
    line = ("powercut: fs=%s cuts=%d lost=%d doubled=%d corrupt=%d stuck=%d "
            "in_failed=%d recover_errors=%d fs_errors=%d recovery_runs=%d "
            "nul_tail_files=%d (in %d cuts)" % (
                fs, t["cuts"], t["lost"], t["doubled"], t["corrupt"], t["stuck"],
                t["in_failed"], t["recover"], t["fsck"], t["rerun"],
                t["nul_tails"], t["nul_cuts"]))
    for k in ("points", "all_points", "entries", "promised", "seconds"):
        if k in t:
            line += " %s=%s" % (k, t[k])
    return line


if __name__ == "__main__":
    sys.exit(main())
