"""`myq init`: the spool layout, and refusing a missing spool."""
import errno
import os
import stat
import subprocess

import pytest

from _core import enqueue, has, ls, one_line_error
from _core import call_myq

LAYOUT = ("tmp", "incoming", "processing", "done", "dlq", "failed", "locks")


def test_init_creates_the_seven_dirs_mode_0750(tmp_path):
    spool = str(tmp_path / "a" / "b" / "q")  # parents are created too
    old = os.umask(0o022)
    try:
        cp = call_myq("--spool", spool, "init")
    finally:
        os.umask(old)
    assert cp.returncode == 0, cp.stderr
    for d in LAYOUT:
        st = os.stat(os.path.join(spool, d))
        assert stat.S_ISDIR(st.st_mode), d
        assert stat.S_IMODE(st.st_mode) == 0o750, (d, oct(st.st_mode))


def test_init_is_idempotent_and_keeps_jobs(spool):
    job = enqueue(call_myq, spool, "t", '{"k": 1}', "--id", "keep-me")
    for _ in range(2):
        cp = call_myq("--spool", spool, "init")
        assert cp.returncode == 0, cp.stderr
    assert ls(spool, "incoming") == ["keep-me.json"]
    assert job == "keep-me"
    for d in LAYOUT:
        assert os.path.isdir(os.path.join(spool, d))


def test_myq_spool_env_selects_the_spool(run_myq, tmp_path):
    spool = str(tmp_path / "envq")
    assert run_myq("init", env={"MYQ_SPOOL": spool}).returncode == 0
    assert os.path.isdir(os.path.join(spool, "incoming"))
    cp = run_myq("enqueue", "t", env={"MYQ_SPOOL": spool})
    assert cp.returncode == 0, cp.stderr
    assert ls(spool, "incoming") == [cp.stdout.strip() + ".json"]


COMMANDS = [
    ("enqueue", "t", "{}"),
    ("worker", "--once"),
    ("worker", "--drain"),
    ("stats",),
    ("stats", "--json"),
    ("list",),
    ("show", "x"),
    ("retry", "x"),
    ("retry", "--all"),
    ("delete", "x"),
    ("reap",),
    ("prune",),
    ("check",),
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: "-".join(c))
def test_missing_spool_exits_78_and_creates_nothing(run_myq, tmp_path, cmd):
    spool = str(tmp_path / "nope")
    run = run_myq if cmd[0] == "worker" else call_myq
    cp = run("--spool", spool, *cmd, timeout=20)
    assert cp.returncode == 78, (cp.returncode, cp.stdout, cp.stderr)
    assert not os.path.exists(spool)
    err = one_line_error(cp)
    assert "init" in err, err  # says how to fix it: `myq init`


@pytest.mark.parametrize("cmd", [("enqueue", "t"), ("worker", "--once"),
                                 ("stats",), ("list",)],
                         ids=lambda c: "-".join(c))
def test_uninitialised_spool_exits_78_and_creates_nothing(run_myq, tmp_path, cmd):
    spool = tmp_path / "empty"
    spool.mkdir()
    run = run_myq if cmd[0] == "worker" else call_myq
    cp = run("--spool", str(spool), *cmd, timeout=20)
    assert cp.returncode == 78, (cp.returncode, cp.stdout, cp.stderr)
    assert os.listdir(str(spool)) == []
    assert "init" in one_line_error(cp)


def test_layout_on_two_filesystems_is_refused(run_myq, spool):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs inside the spool")
    done = os.path.join(spool, "done")
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", done],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if m.returncode != 0:
        pytest.skip("cannot mount tmpfs here: %s" % m.stderr.decode().strip())
    try:
        cp = call_myq("--spool", spool, "init")
        assert cp.returncode == 78, (cp.returncode, cp.stderr)
        one_line_error(cp)
        cp = run_myq("--spool", spool, "worker", "--once", timeout=20)
        assert cp.returncode == 78, (cp.returncode, cp.stderr)
        one_line_error(cp)
    finally:
        subprocess.run(["umount", done])


def test_the_lease_line_is_what_dumps_would_write(myq, spool):
    """Claims format the lease record from a per-worker prefix (it is
    written for every job): it must be the bytes dumps() gives."""
    import json
    sp = myq.open_store(spool)
    me = myq.Identity(sp, lease=30)
    for until in (myq._now() + 30, 1e10 + 0.5, 5.0, 1796000000.1234):
        line = me.lease_line(me.token(), 7, until)
        rec = json.loads(line)["lease"]
        assert rec["attempt"] == 7 and rec["worker"] == me.wid
        assert line == myq.dumps({"lease": {
            "worker": me.wid, "pid": me.pid, "start": me.start,
            "boot_id": myq.boot_id(), "token": rec["token"], "attempt": 7,
            "leased_until": round(until, 3)}})


@pytest.mark.files_only("done/ files and locks/ok/ records (mknod)")
@pytest.mark.parametrize("refused", [None, errno.EPERM, errno.ENOSYS])
def test_success_needs_no_record_until_done_goes_early(myq, spool, monkeypatch,
                                                       refused):
    """A finished job's done/ file is its idempotency record: success
    creates no other file (no inode per job).  When retention removes done/
    files within the de-duplication window, a producer-chosen id keeps its
    record in locks/ok/ (one mknod(); where a sandbox refuses it, open +
    close), dated when the job was done; an id myq generated needs none.
    Either way the chosen id stays refused for the window."""
    monkeypatch.setattr(myq, "_MKNOD", True)
    if refused is not None:
        def mknod(*a, **kw):
            raise OSError(refused, os.strerror(refused))
        monkeypatch.setattr(myq.os, "mknod", mknod)
    sp = myq.open_store(spool)
    ids = sp.enqueue_many([{"type": "noop"} for _ in range(3)])
    ids += sp.enqueue_many([{"type": "noop", "id": "mine-%d" % i} for i in range(2)])
    w = myq.Worker(spool, handlers={"noop": lambda job: None},
                   log=myq.Log(path=os.devnull))
    assert w.run(drain=True) == 0
    for jid in ids:
        assert os.path.exists(os.path.join(spool, "done", jid + ".json"))
    assert os.listdir(os.path.join(spool, "locks", "ok")) == []
    done_at = os.lstat(os.path.join(spool, "done", "mine-0.json")).st_ctime
    with pytest.raises(myq.DuplicateJob):
        myq.enqueue(spool, "noop", id="mine-0")
    out = myq.open_store(spool, keep_done=0).prune()
    assert out["done"] == 5 and os.listdir(os.path.join(spool, "done")) == []
    assert sorted(os.listdir(os.path.join(spool, "locks", "ok"))) == ["mine-0", "mine-1"]
    for jid in ("mine-0", "mine-1"):
        st = os.lstat(os.path.join(spool, "locks", "ok", jid))
        assert stat.S_ISREG(st.st_mode) and st.st_size == 0
        with pytest.raises(myq.DuplicateJob):
            myq.enqueue(spool, "noop", id=jid)
    assert abs(os.lstat(os.path.join(spool, "locks", "ok", "mine-0")).st_mtime
               - done_at) < 0.01
    assert myq._MKNOD is (refused is None)
    # the window ends: the id may come again
    sp = myq.open_store(spool, dedupe_window=1)
    assert sp.find_id("mine-0", now=done_at + 2) is None
    assert sp.find_id("mine-0", now=done_at + 0.5) is not None


@pytest.mark.files_only("a copy of a done job's file dropped into incoming/")
def test_a_done_job_dropped_again_is_skipped_not_run(myq, spool):
    """A done job's file copied back into incoming/ (an operator's cp, a
    producer's retry of its own file), by an id myq generated or one a
    producer chose: within the de-duplication window its done/ file says
    it ran, and the worker skips it (logged), without running it again."""
    import shutil
    sp = myq.open_store(spool)
    ids = [sp.enqueue("noop", {"n": 1}), sp.enqueue("noop", {"n": 2}, id="mine-1")]
    ran, events = [], []
    w = myq.Worker(spool, handlers={"noop": lambda job: ran.append(job["id"])},
                   log=lambda event, **kv: events.append((event, kv.get("id"))))
    assert w.run(drain=True) == 0 and sorted(ran) == sorted(ids)
    for jid in ids:
        shutil.copy(os.path.join(spool, "done", jid + ".json"),
                    os.path.join(spool, "tmp", jid + ".json"))
        os.rename(os.path.join(spool, "tmp", jid + ".json"),
                  os.path.join(spool, "incoming", jid + ".json"))
    del ran[:]
    w = myq.Worker(spool, handlers={"noop": lambda job: ran.append(job["id"])},
                   log=lambda event, **kv: events.append((event, kv.get("id"))))
    assert w.run(drain=True) == 0
    assert ran == []
    assert sorted(j for e, j in events if e == "skipped") == sorted(ids)
    assert ls(spool, "incoming") == [] and ls(spool, "processing") == []


@pytest.mark.files_only("a claim's file, moved back to incoming/ by a retry")
def test_show_finds_a_job_that_moved_back_while_it_was_looked_for(
        myq, spool, monkeypatch):
    """`myq show` looks in incoming/ before processing/: a retry that puts
    the job back in between was missed by both looks (a flake of a test
    that waits for a retry's state); the job is looked for again."""
    sp = myq.open_store(spool)
    sp.enqueue("t", {"n": 1}, id="a")
    inc = os.path.join(spool, "incoming", "a.json")
    claimed = os.path.join(spool, "processing", myq._claim_name("a", "w-1-abcdef.1"))
    os.rename(inc, claimed)
    real = myq._listdir

    def listdir(path):
        if path.rstrip("/").endswith("processing") and os.path.exists(claimed):
            os.rename(claimed, inc)         # the retry, between the looks
        return real(path)
    monkeypatch.setattr(myq, "_listdir", listdir)
    assert sp.show("a")["state"] == "ready"


def test_a_chosen_id_stays_refused_for_the_window_when_done_goes_early(
        myq, spool):
    """What the test above proves of the files, on either store: retention
    removes the done jobs within the de-duplication window, and an id a
    producer chose stays refused until the window (from when the job was
    done) ends."""
    sp = myq.open_store(spool)
    ids = sp.enqueue_many([{"type": "noop"} for _ in range(3)])
    ids += sp.enqueue_many([{"type": "noop", "id": "mine-%d" % i}
                            for i in range(2)])
    before = myq._now()
    w = myq.Worker(spool, handlers={"noop": lambda job: None},
                   log=myq.Log(path=os.devnull))
    assert w.run(drain=True) == 0
    after = myq._now()
    for jid in ids:
        assert has(spool, "done", jid), jid
    with pytest.raises(myq.DuplicateJob):
        myq.enqueue(spool, "noop", id="mine-0")
    out = myq.open_store(spool, keep_done=0).prune()
    assert out["done"] == 5 and ls(spool, "done") == []
    for jid in ("mine-0", "mine-1"):
        with pytest.raises(myq.NoSuchJob):
            sp.show(jid)
        with pytest.raises(myq.DuplicateJob):
            myq.enqueue(spool, "noop", id=jid)
    # the window ends: the id may come again
    sp = myq.open_store(spool, dedupe_window=1)
    assert sp.find_id("mine-0", now=after + 2) is None
    assert sp.find_id("mine-0", now=before + 0.5) is not None


def test_deleting_a_done_job_keeps_its_id_refused(myq, spool):
    sp = myq.open_store(spool)
    sp.enqueue("noop", id="d1")
    w = myq.Worker(spool, handlers={"noop": lambda job: None},
                   log=myq.Log(path=os.devnull))
    assert w.run(drain=True) == 0
    assert sp.delete(["d1"]) == 1
    assert not has(spool, "done", "d1")
    with pytest.raises(myq.DuplicateJob):
        sp.enqueue("noop", id="d1")


# A power cut tore the lease's append (found by tests/powercut) ##############

@pytest.mark.parametrize("tail", [
    b"\0" * 120,                                    # the size, not the bytes
    b'{"lease":{"worker":"w-1-abc","pid":1' + b"\0" * 90,   # half a line
])
def test_a_claim_whose_lease_append_was_torn_is_taken_back(tmp_path, tail):
    """ext4 keeps an append's new length but not its bytes after a power
    cut: the claim ends in NULs.  The job (fsynced whole before) is taken
    back to incoming/ and runs, instead of being quarantined as unreadable;
    done/ files with such a tail still show."""
    import myq
    spool = str(tmp_path / "spool")
    sp = myq.open_store(spool).init()
    job = myq.new_job("t", {"n": 1}, id="j1")
    claim = os.path.join(spool, "processing", "j1+w-999999-abcdef.1.json")
    with open(claim, "wb") as f:
        f.write(myq.dumps(job) + tail)
    assert sp.reap() == 1
    assert os.listdir(os.path.join(spool, "failed")) == []
    back = sp.show("j1")
    assert back["state"] == "ready" and back["payload"] == {"n": 1}, back
    done = os.path.join(spool, "done", "d1.json")
    with open(done, "wb") as f:
        f.write(myq.dumps(myq.new_job("t", None, id="d1")) + tail)
    assert sp.show("d1")["state"] == "done"
    # only the last, torn line is forgiven: other data after the job is not
    with pytest.raises(myq.InvalidJob):
        myq.parse(myq.dumps(job) + b"garbage\nmore\0")
