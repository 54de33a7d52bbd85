"""The ext4 replay checks each cut on that cut's disk, or fails it loudly.
One image file reused with `mount -o loop` is not enough: a process that
copied the mount namespace while a cut was mounted keeps that cut's
superblock alive after a umount that exited 0, the next mount of the same
file gets the same loop device and that old superblock back, and the
checks would run on an earlier cut's recovered state (a busy machine
reported lost=14192 corrupt=100 where myq had lost nothing).

The replay runs here on a small log made on the host (synthlog.py: 9
clean states of a 16 MiB ext4, a job more in each), no VM: a few seconds.
The tests that mount need root, losetup, mkfs.ext4 and mount namespaces;
without them they skip and say why.  The others run everywhere."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import replay  # noqa: E402

MYQ = os.path.join(os.path.dirname(os.path.dirname(HERE)), "myq.py")
JOBS = 8
TOOLS = ("losetup", "mkfs.ext4", "e2fsck", "tune2fs", "mount", "umount",
         "unshare", "nsenter")


def _cannot_mount():
    """Why this machine cannot run the replay, or None."""
    if os.geteuid() != 0:
        return "needs root (loop devices, mount)"
    missing = [t for t in TOOLS if not shutil.which(t)]
    if missing:
        return "missing %s" % " ".join(missing)
    for cmd, what in ((["losetup", "--find"], "no free loop device"),
                      (["unshare", "--mount", "true"], "no mount namespaces")):
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            return "%s (%s: %s)" % (what, " ".join(cmd), r.stdout.decode()[-200:])
    return None


_WHY_NOT = _cannot_mount()
needs_mounts = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))


# -- no root needed ---------------------------------------------------------

def test_e2fsck_exit_statuses_each_have_their_count():
    assert replay.fsck_verdict(0) is None
    assert replay.fsck_verdict(1) == "fsck_fixed"       # counted, cut checked
    for rc in (2, 3, 4, 8, 12, 16, 32, 128):
        assert replay.fsck_verdict(rc) == "fsck"        # the cut fails
    assert "fsck" in replay.BAD and "stale" in replay.BAD
    assert "fsck_fixed" not in replay.BAD


def test_distinct_ids_are_counted_whole_however_many_notes():
    totals = dict(lost=0, doubled=0, corrupt=0, stuck=0, recover=0, rerun=0,
                  fsck=0, cuts=0, in_failed=0, nul_tails=0, nul_cuts=0,
                  stale=0, fsck_fixed=0)
    distinct = {}
    first = ["id-%02d" % k for k in range(30)]          # 30 lost, 10 notes
    second = ["id-%02d" % k for k in range(20, 45)]     # 25 lost, 10 in both
    for ids in (first, second):
        replay.add_cut(totals, distinct, {
            "lost": len(ids), "corrupt": 1, "notes": ["lost: %s" % i for i in ids[:10]],
            "ids": {"lost": ids, "corrupt": ["id-00", "id-00"]}})
    assert totals["cuts"] == 2 and totals["lost"] == 55
    assert totals["lost_ids"] == 45 and totals["corrupt_ids"] == 1
    assert distinct["lost"]["id-25"] == 2 and distinct["lost"]["id-05"] == 1
    line = replay.summary("ext4", totals)
    assert " lost=55 " in line and " lost_ids=45 " in line, line
    assert " stale=0 fsck_fixed=0 " in line, line


def test_the_replay_refuses_to_run_in_a_shared_mount_namespace(tmp_path):
    if replay.mount_ns_private() is None:
        pytest.skip("this test process is itself in a private mount namespace")
    with pytest.raises(RuntimeError, match="private mount namespace"):
        replay.replay("no-log", "no-base", "no-journal", MYQ, work=str(tmp_path))


# -- with mounts ------------------------------------------------------------

@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("synthlog"))
    r = subprocess.run([sys.executable, os.path.join(HERE, "synthlog.py"),
                        "--out", out, "--myq", MYQ, "--jobs", str(JOBS)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert r.returncode == 0, r.stdout.decode()
    return out


def _cut_mounts(pid):
    """The replay's cut mounts seen in /proc/PID/mountinfo: {maj:min: path}
    (read here, not by the replay's code under test)."""
    out = {}
    try:
        with open("/proc/%s/mountinfo" % pid) as f:
            for line in f:
                pre, _, post = line.partition(" - ")
                pre, post = pre.split(), post.split()
                if post and post[0] == "ext4" and "/pc-replay-" in pre[4]:
                    out[pre[2]] = pre[4]
    except OSError:
        pass
    return out


def _ns(pid):
    try:
        return os.readlink("/proc/%s/ns/mnt" % pid)
    except OSError:
        return None


def _start_replay(synth, tmp_path):
    report = str(tmp_path / "report.json")
    p = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "replay.py"),
         "--log", os.path.join(synth, "log.img"),
         "--base", os.path.join(synth, "base.img"),
         "--journal", os.path.join(synth, "journal"),
         "--myq", MYQ, "--subsets", "0", "--report", report],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return p, report


def _finish(p, report, holders):
    try:
        out = p.communicate(timeout=120)[0].decode("utf-8", "replace")
    finally:
        for h in holders:
            h.kill()
            h.wait()
    with open(report) as f:
        rep = json.load(f)
    return p.returncode, out, rep


CLEAN = dict(lost=0, doubled=0, corrupt=0, stuck=0, in_failed=0, recover=0,
             fsck=0)


@needs_mounts
def test_namespace_copies_made_elsewhere_cannot_hold_a_cut(synth, tmp_path):
    """What the busy machine did: other processes copying the mount
    namespace (`unshare -m`, sandboxes, a service's private /tmp) the
    whole time.  The replay's cuts are mounted in a namespace of its own:
    never seen here, never held; every cut clean."""
    p, report = _start_replay(synth, tmp_path)
    holders, seen = [], {}
    while p.poll() is None:
        seen.update(_cut_mounts("self"))
        # short-lived (they copy this namespace, others' mounts too)
        holders.append(subprocess.Popen(["unshare", "--mount", "sleep", "3"]))
        time.sleep(0.02)
    rc, out, rep = _finish(p, report, holders)
    t = rep["totals"]
    assert len(holders) > 10, "too few namespace copies made: %d" % len(holders)
    assert {k: t[k] for k in CLEAN} == CLEAN and t.get("stale") == 0, out
    assert seen == {}, "the replay's cuts were mounted in this namespace: %s" % seen
    assert rc == 0, out
    assert t["cuts"] == JOBS + 1 and t["rerun"] == JOBS * (JOBS + 1) // 2, t


@needs_mounts
def test_a_cut_held_by_a_copy_of_the_replays_namespace_fails_loudly(synth, tmp_path):
    """A process that enters the replay's own namespace and copies it
    (nsenter, then `unshare -m sleep 30`) while a cut is mounted holds that
    cut's filesystem after the umount.  That cut fails (stale=1, the holder
    named); the next cuts, on new images and new loop devices with labels
    of their own, are checked on their own disks and are clean."""
    p, report = _start_replay(synth, tmp_path)
    holders, held, tried = [], {}, set()
    while p.poll() is None and not held:
        ns = _ns(p.pid)
        cuts = _cut_mounts(p.pid)
        for majmin, path in cuts.items():
            if path in tried:
                continue
            tried.add(path)
            h = subprocess.Popen(["nsenter", "--mount=/proc/%d/ns/mnt" % p.pid,
                                  "unshare", "--mount", "sleep", "30"])
            holders.append(h)
            t_end = time.monotonic() + 2
            while time.monotonic() < t_end and _ns(h.pid) in (None, ns, _ns("self")):
                time.sleep(0.002)        # until unshare made its copy
            if _cut_mounts(h.pid).get(majmin) == path:
                held[path] = h.pid
            break
        time.sleep(0.001)
    rc, out, rep = _finish(p, report, holders)
    t = rep["totals"]
    assert held, "no cut could be held (tried %d; too fast?): %s" % (len(tried), out)
    line = [l for l in out.splitlines() if l.startswith("powercut: fs=ext4 ")][0]
    assert {k: t[k] for k in CLEAN} == CLEAN, out       # no cut on a wrong disk
    assert t.get("stale") == 1 and " stale=1 " in line, line
    assert rc == 1, out
    assert t["cuts"] == JOBS + 1, t
    (bad,) = rep["found"]
    assert bad["counts"] == {"stale": 1}, bad
    notes = " ".join(bad["notes"])
    (pid,) = held.values()
    assert "still bound" in notes and "pid %d (sleep)" % pid in notes, bad
    assert "mnt-%s" % bad["label"] in list(held)[0], (bad, held)


SUPERBLOCK_BACK = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, %(here)r)
import replay
work = %(work)r
img, mnt = os.path.join(work, "test.img"), os.path.join(work, "mnt")
os.mkdir(mnt)
def sh(*cmd):
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE).stdout.decode().strip()
sh("cp", %(base)r, img); sh("tune2fs", "-L", "cut-1", img)
sh("mount", "-o", "loop", img, mnt)
h = subprocess.Popen(["unshare", "--mount", "sleep", "30"])
time.sleep(0.3)
sh("umount", mnt)                                   # exits 0
sh("cp", %(base)r, img); sh("tune2fs", "-L", "cut-2", img)
sh("mount", "-o", "loop", img, mnt)                 # the same loop device
dev = [m[3] for m in replay.mounts() if m[1] == mnt][0]
out = {"dev": dev, "label": replay.mounted_label(mnt),
       "problems": replay.verify_mounted(mnt, dev, "cut-2")}
sh("umount", mnt)
out["detach"] = replay.loop_detach(dev, wait=0.5)
h.kill(); h.wait()
print(json.dumps(out))
"""


@needs_mounts
def test_the_old_superblock_handed_back_is_told_by_its_label(synth, tmp_path):
    """The old way made on purpose (one file, `mount -o loop` twice, a
    namespace copy in between): the kernel hands back the first mount's
    superblock.  verify_mounted, which every cut passes before its checks,
    sees the wrong label; loop_detach sees the device still bound."""
    code = SUPERBLOCK_BACK % {"here": HERE, "work": str(tmp_path),
                              "base": os.path.join(synth, "base.img")}
    r = subprocess.run(["unshare", "--mount", "--propagation", "private",
                        sys.executable, "-c", code], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=60)
    assert r.returncode == 0, r.stdout.decode()
    out = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert out["label"] == "cut-1", out           # the kernel's old superblock
    assert any(re.search(r"label is 'cut-1', this cut's is 'cut-2'", p)
               for p in out["problems"]), out
    assert out["detach"] and "still bound" in out["detach"][0], out
