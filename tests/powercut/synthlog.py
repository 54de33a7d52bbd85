#!/usr/bin/env python3
"""A small dm-log-writes log made on the host, without a VM (for tests).

    synthlog.py --out DIR --myq myq.py [--jobs N] [--mb MB]

Writes DIR/base.img (a fresh ext4), DIR/log.img (the log) and
DIR/journal (the workload's journal format).  The filesystem goes through
N+1 states, each ended by a clean umount: a spool made by `myq init`, then
one more job enqueued in each.  Each state's blocks that differ from the
one before are logged as writes, then a mark (for a job: "job-K", whose
journal line promises it), then a FLUSH.  So replay.py, at each flush
point (with --subsets 0), rebuilds exactly one of those clean states, with
the jobs enqueued so far promised; recovery must then find them all.

Needs root (loop devices, mount) and runs its mounts in a private mount
namespace (it re-executes itself under `unshare -m --propagation private`).
"""

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import replay  # noqa: E402

SS = 512
CHUNK = 4096


def _sh(cmd):
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT).stdout.decode().strip()


def payload(n):
    blob = hashlib.sha256(b"synthlog %d" % n).hexdigest() * (1 + n % 3)
    return {"n": n, "blob": blob,
            "sum": hashlib.sha256(blob.encode()).hexdigest()[:16]}


def _mounted(img, mnt, action):
    dev = _sh(["losetup", "--find", "--show", img])
    try:
        _sh(["mount", "-t", "ext4", dev, mnt])
        try:
            return action()
        finally:
            _sh(["umount", mnt])
    finally:
        _sh(["losetup", "-d", dev])
        name = os.path.basename(dev)
        for _ in range(100):
            if not os.path.exists("/sys/block/%s/loop" % name):
                break
            time.sleep(0.02)
        else:
            raise RuntimeError("%s still bound after losetup -d" % dev)


def build(out, myq_path, jobs=4, mb=16):
    sys.path.insert(0, os.path.dirname(os.path.abspath(myq_path)))
    import myq
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, "base.img")
    stage = os.path.join(out, "stage.img")
    mnt = os.path.join(out, "mnt")
    os.makedirs(mnt, exist_ok=True)
    with open(base, "wb") as f:
        f.truncate(mb << 20)
    _sh(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
         base])
    with open(base, "rb") as f:
        prev = f.read()
    with open(stage, "wb") as f:
        f.write(prev)
    spool = os.path.join(mnt, "spool")
    entries = []        # (sector, flags, data or mark text)
    journal = []

    def init():
        myq.main(["--spool", spool, "init"])

    def enqueue(n):
        p = payload(n)
        jid = myq.open_store(spool).enqueue("ok", p)
        return {jid: p["sum"]}
    steps = [(None, init)] + [("job-%d" % n, (lambda n=n: enqueue(n)))
                              for n in range(1, jobs + 1)]
    for mark, action in steps:
        promised = _mounted(stage, mnt, action)
        with open(stage, "rb") as f:
            cur = f.read()
        k = 0
        while k < len(cur):
            if cur[k:k + CHUNK] == prev[k:k + CHUNK]:
                k += CHUNK
                continue
            j = k
            while j < len(cur) and cur[j:j + CHUNK] != prev[j:j + CHUNK]:
                j += CHUNK
            entries.append((k // SS, 0, cur[k:j]))
            k = j
        prev = cur
        if mark:
            entries.append((0, replay.MARK, mark.encode()))
            journal.append({"mark": mark, "jobs": promised})
        entries.append((0, replay.FLUSH, b""))
    with open(os.path.join(out, "log.img"), "wb") as f:
        f.write(struct.pack("<QQQI", replay.MAGIC, 1, len(entries), SS).ljust(SS, b"\0"))
        for sector, flags, data in entries:
            if flags & replay.MARK:
                f.write((struct.pack("<QQQQ", 0, 0, flags, len(data)) + data)
                        .ljust(SS, b"\0"))
            else:
                f.write(struct.pack("<QQQQ", sector, len(data) // SS, flags, 0)
                        .ljust(SS, b"\0"))
                f.write(data)
    with open(os.path.join(out, "journal"), "w") as f:
        for rec in journal:
            f.write(json.dumps(rec) + "\n")
    os.unlink(stage)
    os.rmdir(mnt)
    return {"entries": len(entries), "flushes": len(steps),
            "promised": sum(len(r["jobs"]) for r in journal)}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--myq", required=True)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--mb", type=int, default=16)
    a = ap.parse_args(argv)
    if not os.environ.get("PC_SYNTHLOG_UNSHARED"):
        env = dict(os.environ, PC_SYNTHLOG_UNSHARED="1")
        os.execvpe("unshare", ["unshare", "--mount", "--propagation", "private",
                               sys.executable, os.path.abspath(__file__)] + argv, env)
    print(json.dumps(build(a.out, a.myq, a.jobs, a.mb)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
