"""What an idle worker writes to the spool's filesystem (flash
bytes a delivered job with durable=outage at most 1/20 of always, on
UBIFS too; time alone kept it above: the heartbeat, a utime of the worker's record
every lease/3, ~9 KB a beat on UBIFS).

A worker beats only while it holds a claim or made one since its last
beat (the beat vouches for its claims alone), and its next claim beats
first when the last beat is older than lease/3: a worker idle for longer
than its lease that claims a job is not taken for hung.

With a RAM tier the heartbeat is the tier's locks/workers/WID.beat (a
tmpfs), so a worker with nothing to do changes nothing in the spool: no
file's or directory's mtime, ctime or size.  Liveness is judged as before,
by the later of the record's mtime and that beat: a live worker that beats
in RAM is never robbed, a hung one (SIGSTOP) is robbed once its beat is
older than its lease, and a killed one's beat goes with its record.  Both
stores (the `spool` fixture)."""
import json
import os
import signal

import pytest

from _core import (FAST, cli, ok, show, start_worker, stop, wait_for, call_myq,
                   listening)
from _procs import lines, mono, reap

SLOW = r'''
import json, os, time
def slow(job):
    p = job["payload"]
    with open(p["runs"], "a") as f:
        f.write(job["id"] + "\n")
    while not os.path.exists(p["release"]):
        time.sleep(0.02)
tele = slow
'''



def _tier(spool, ram, tmp_path, *opts):
    """A RAM tier (none where `ram` is None), `slow` (durable) and `tele`
    (durable=outage) delivered by SLOW, a worker started: its Popen."""
    if ram is not None:
        ok(cli(spool, "init", "--ram", ram))
        ok(cli(spool, "policy", "tele", "durable=outage", "spill_after=1h"))
    mod = tmp_path / "slow.py"
    mod.write_text(SLOW)
    w = start_worker(spool, "--module", str(mod), *(FAST + opts + (
        "--log", str(tmp_path / "worker.log"))))
    wait_for(lambda: "event=start" in _log(tmp_path), what="the worker's start")
    return w


def _log(tmp_path):
    try:
        return (tmp_path / "worker.log").read_text()
    except OSError:
        return ""


def _snapshot(top):
    """{path: (mtime, ctime, size)} of everything under `top`."""
    out = {}
    for root, dirs, files in os.walk(top):
        for name in [""] + dirs + files:
            p = os.path.join(root, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            out[p] = (st.st_mtime_ns, st.st_ctime_ns, st.st_size)
    return out


def _changed(a, b):
    return sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))


def _payload(tmp_path, release):
    return json.dumps({"runs": str(tmp_path / "runs"), "release": str(release)})


def _record(spool, pid):
    """The path of worker `pid`'s record in locks/workers/."""
    d = os.path.join(spool, "locks", "workers")
    for name in os.listdir(d):
        if name.endswith(".json") and "-%d-" % pid in name:
            return os.path.join(d, name)
    raise AssertionError("no record of %d in %s" % (pid, os.listdir(d)))


def test_an_idle_worker_with_a_ram_tier_writes_nothing_to_the_spool(
        spool, ram, tmp_path):
    """A lease of 0.6 s (a beat every 0.2 s): over 10 leases after two RAM
    jobs were delivered, nothing in the spool changes (before: the
    record's mtime and ctime at each beat), while the beat in RAM goes on."""
    release = tmp_path / "release"
    release.touch()
    w = _tier(spool, ram, tmp_path, "--lease", "0.6", "--stats-interval", "0")
    try:
        for _ in range(2):
            ok(cli(spool, "enqueue", "tele", _payload(tmp_path, release)))
        wait_for(lambda: len(lines(tmp_path / "runs")) == 2, what="2 delivered")
        wait_for(lambda: show(call_myq, spool, lines(tmp_path / "runs")[1]
                              )["state"] == "done", what="the second done")
        beat = os.path.join(ram, "locks", "workers",
                            os.path.basename(_record(spool, w.pid))[:-5] + ".beat")
        before, t0 = _snapshot(spool), mono()
        b0 = os.lstat(beat).st_mtime if os.path.exists(beat) else None
        wait_for(lambda: mono() - t0 >= 6.0, timeout=30, what="10 leases")
        assert w.poll() is None
        changed = _changed(before, _snapshot(spool))
        assert changed == [], "an idle worker wrote to the spool: %s" % changed
        assert b0 is not None and os.lstat(beat).st_mtime > b0, "no beat in RAM"
    finally:
        assert stop(w) == 0
    assert not os.path.exists(beat), "the beat outlived its worker's stop"


@pytest.mark.parametrize("durable", ["always", "outage"])
def test_a_live_worker_beating_in_ram_is_never_robbed(spool, ram, tmp_path,
                                                      run_myq, durable):
    """Lease 1 s; the job (in the spool, or the RAM tier) runs until the
    test releases it, over at least 3 leases and 3 reaps: never taken
    back, while the record's mtime stays as the worker's start left it
    (every beat went to RAM)."""
    release = tmp_path / "release"
    w = _tier(spool, ram, tmp_path, "--lease", "1")
    try:
        jid = ok(cli(spool, "enqueue", "slow" if durable == "always" else "tele",
                     _payload(tmp_path, release))).stdout.strip()
        wait_for(lambda: lines(tmp_path / "runs"), what="the run's start")
        rec = _record(spool, w.pid)
        m0, t0, reaps = os.lstat(rec).st_mtime, mono(), 0
        while reaps < 3 or mono() - t0 < 3.0:
            assert reap(run_myq, spool) == 0, "a live owner was robbed"
            reaps += 1
            assert w.poll() is None
            assert show(call_myq, spool, jid)["state"] == "processing"
        assert os.lstat(rec).st_mtime == m0, "a beat went to the record"
        release.touch()
        wait_for(lambda: show(call_myq, spool, jid)["state"] == "done",
                 what="the job done")
        assert lines(tmp_path / "runs") == [jid]
    finally:
        release.touch()
        assert stop(w) == 0
    assert "event=requeued" not in _log(tmp_path)


def test_a_hung_worker_beating_in_ram_is_robbed_after_its_lease(
        spool, ram, tmp_path, run_myq):
    """SIGSTOP while it runs a job: no reap takes the job within 2/3 of
    the lease (its last beat was at most lease/3 before), one does after
    it, saying the worker stopped heartbeating; the hung worker is killed
    first, and its beat in RAM goes with its record at the next prune."""
    lease, release = 3.0, tmp_path / "release"
    w = _tier(spool, ram, tmp_path, "--lease", str(lease))
    try:
        jid = ok(cli(spool, "enqueue", "slow", _payload(tmp_path, release))
                 ).stdout.strip()
        wait_for(lambda: lines(tmp_path / "runs"), what="the run's start")
        name = os.path.basename(_record(spool, w.pid))[:-5]
        t0 = mono()
        w.send_signal(signal.SIGSTOP)
        while not reap(run_myq, spool):
            assert mono() - t0 < lease + 15, "the hung worker was never robbed"
        assert mono() >= t0 + lease * 2 / 3, "robbed before its lease ran out"
        job = show(call_myq, spool, jid)
        assert job["state"] == "ready" and job["attempts"] == 1, job
        assert "heartbeat" in job["last_error"], job
        assert w.wait(10) == -signal.SIGKILL and "killed" in job["last_error"]
    finally:
        if w.poll() is None:
            w.send_signal(signal.SIGCONT)
            stop(w)
    beat = os.path.join(ram, "locks", "workers", name + ".beat")
    assert os.path.exists(beat)         # (killed: nothing took it away)
    ok(cli(spool, "prune"))
    assert not os.path.exists(beat) and not os.path.exists(
        os.path.join(spool, "locks", "workers", name + ".json"))


def test_an_idle_worker_without_a_ram_tier_writes_nothing_to_the_spool(
        spool, tmp_path):
    """The same without a RAM tier: a worker that holds no claim skips its
    beats (before: a utime of its record every lease/3)."""
    release = tmp_path / "release"
    release.touch()
    w = _tier(spool, None, tmp_path, "--lease", "0.6", "--stats-interval", "0")
    try:
        jid = ok(cli(spool, "enqueue", "slow", _payload(tmp_path, release))
                 ).stdout.strip()
        wait_for(lambda: show(call_myq, spool, jid)["state"] == "done",
                 what="the job done")
        wait_for(lambda: b" d slow 1 " in open(os.path.join(
            spool, "locks", "rates"), "rb").read(), what="the delivery counted")
        # (the beat its claim owes, the first after it, may come after the
        # done and the count: its record alone, within a lease)
        first, t0 = _snapshot(spool), mono()
        wait_for(lambda: mono() - t0 >= 0.6, what="a lease")
        before, t0 = _snapshot(spool), mono()
        assert _changed(first, before) in ([], [_record(spool, w.pid)])
        wait_for(lambda: mono() - t0 >= 6.0, timeout=30, what="10 leases")
        assert w.poll() is None
        changed = _changed(before, _snapshot(spool))
        assert changed == [], "an idle worker wrote to the spool: %s" % changed
    finally:
        assert stop(w) == 0


@pytest.mark.parametrize("tier", ["ram", "none"])
def test_a_worker_idle_past_its_lease_then_claiming_is_never_robbed(
        spool, ram, tmp_path, run_myq, tier):
    """Lease 1 s, idle for 3 leases (no beat: its last is 3 s old), then a
    job: the claim beats first, and the run goes on over 3 more leases and
    3 reaps without being taken back or its worker killed."""
    release = tmp_path / "release"
    w = _tier(spool, ram if tier == "ram" else None, tmp_path, "--lease", "1")
    try:
        t0 = mono()
        wait_for(lambda: mono() - t0 >= 3.0, what="3 leases idle")
        jid = ok(cli(spool, "enqueue", "slow", _payload(tmp_path, release))
                 ).stdout.strip()
        wait_for(lambda: lines(tmp_path / "runs"), what="the run's start")
        t0, reaps = mono(), 0
        while reaps < 3 or mono() - t0 < 3.0:
            assert reap(run_myq, spool) == 0, "a live owner was robbed"
            reaps += 1
            assert w.poll() is None, "the worker was killed"
            assert show(call_myq, spool, jid)["state"] == "processing"
        release.touch()
        wait_for(lambda: show(call_myq, spool, jid)["state"] == "done",
                 what="the job done")
        assert lines(tmp_path / "runs") == [jid]
    finally:
        release.touch()
        assert stop(w) == 0
    assert "event=requeued" not in _log(tmp_path)


def test_ram_jobs_delivered_fsync_nothing_of_the_spool(myq, spool, ram,
                                                       monkeypatch):
    """A worker (in a thread) delivers 5 RAM jobs one by one: no fsync of
    anything in the spool meanwhile.  Before, each group commit fsync'd
    the spool's done/ (files) or its log (queue.db-wal) though no job of
    the spool's had finished: a page written each time on UBIFS.  A
    durable job's success is still committed (the control)."""
    import threading
    ok(cli(spool, "init", "--ram", ram))
    ok(cli(spool, "policy", "tele", "durable=outage", "spill_after=1h"))
    done = []
    w = myq.Worker(myq.open_store(spool), handlers={
        "tele": done.append, "alarm": done.append},
                   log=lambda ev, **kv: None, poll=0.05, stats_interval=0)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink("/proc/self/fd/%d" % fd))
        return real(fd)
    try:
        wait_for(lambda: os.path.isdir(os.path.join(ram, "incoming")) and
                 listening(spool), what="the worker listening")
        monkeypatch.setattr(os, "fsync", fsync)
        producer = myq.open_store(spool)
        for i in range(5):
            producer.enqueue("tele", {"n": i})
            wait_for(lambda: len(done) == i + 1, what="job %d delivered" % i)
        wait_for(lambda: not w.finish._pending, what="the group commit")
        root = os.path.realpath(spool) + "/"
        mine = [p for p in synced if (p + "/").startswith(root)]
        assert mine == [], "RAM jobs' deliveries fsync'd the spool: %s" % mine
        producer.enqueue("alarm", {"n": 5})
        wait_for(lambda: len(done) == 6 and not w.finish._pending and [
            p for p in synced if p.startswith(root + ("done" if producer.store
                                                      == "files" else "queue.db"))],
            what="the durable job's success committed")
        producer.close()
    finally:
        monkeypatch.setattr(os, "fsync", real)
        w._on_stop(signal.SIGTERM, None)
        t.join(30)
    assert not t.is_alive()
