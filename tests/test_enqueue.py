"""`myq enqueue` and `myq.enqueue`: writing jobs and refusing bad ones."""
import json
import os
import re
import stat
import time

import pytest

from _core import (FAST, blocking_handler, enqueue, ls, one_line_error, show,
                   start_worker, wait_for, worker, write_incoming)
from _core import call_myq

ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def job_file(spool, job_id):
    """The waiting job as its store keeps it: its file in incoming/, or
    (the SQLite store) its row as `myq show` gives it."""
    path = os.path.join(spool, "incoming", job_id + ".json")
    if not os.path.exists(path) and os.path.exists(os.path.join(spool, "queue.db")):
        return show(call_myq, spool, job_id)
    with open(path) as f:
        return json.load(f)


def assert_nothing_written(spool):
    assert ls(spool, "tmp") == []
    assert ls(spool, "incoming") == []


def test_enqueue_prints_the_id_alone(spool):
    cp = call_myq("--spool", spool, "enqueue", "greet", '{"name": "x"}')
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    assert len(lines) == 1 and cp.stdout.endswith("\n"), repr(cp.stdout)
    job_id = lines[0]
    assert ID_RE.match(job_id) and not job_id.startswith("."), job_id
    job = job_file(spool, job_id)
    assert job["id"] == job_id
    assert job["type"] == "greet"
    assert job["payload"] == {"name": "x"}
    assert job["attempts"] == 0
    assert ls(spool, "tmp") == []


def test_payload_defaults_to_null_and_dash_reads_stdin(run_myq, spool):
    a = enqueue(call_myq, spool, "t")
    assert job_file(spool, a)["payload"] is None
    b = enqueue(run_myq, spool, "t", "-", input='{"from": "stdin", "n": [1, 2]}')
    assert job_file(spool, b)["payload"] == {"from": "stdin", "n": [1, 2]}


def test_options_id_max_attempts_timeout(spool):
    job_id = enqueue(call_myq, spool, "t", "1", "--id", "job-1.a_B",
                     "--max-attempts", "3", "--timeout", "2.5")
    assert job_id == "job-1.a_B"
    job = job_file(spool, job_id)
    assert job["max_attempts"] == 3
    assert job["timeout"] == 2.5
    assert job["payload"] == 1
    s = show(call_myq, spool, job_id)
    assert s["state"] == "ready"


def test_attempt_counts_a_store_cannot_hold_are_refused(spool, handlers_dir,
                                                       run_myq):
    """max_attempts or attempts of 2**63 or more: the SQLite store cannot
    hold them (its enqueue, and every worker at a producer's file of one,
    died in a traceback).  Refused (65) on both stores, and such a
    producer's file quarantined while the other jobs run."""
    cp = call_myq("--spool", spool, "enqueue", "t", "--max-attempts", str(2 ** 63))
    assert cp.returncode == 65, cp.stderr
    one_line_error(cp)
    for name, field in (("big", "max_attempts"), ("many", "attempts")):
        with open(os.path.join(spool, "tmp", name), "w") as f:
            json.dump({"type": "t", field: 10 ** 20}, f)
        os.rename(os.path.join(spool, "tmp", name),
                  os.path.join(spool, "incoming", name + ".json"))
    other = enqueue(call_myq, spool, "t", "1")
    cp = worker(run_myq, spool, handlers=handlers_dir("t", "true"))
    assert cp.returncode == 0 and "Traceback" not in cp.stderr, cp.stderr
    assert show(call_myq, spool, other)["state"] == "done"
    for name in ("big", "many"):
        assert show(call_myq, spool, name)["state"] == "failed", name


def test_an_id_a_producers_file_has_is_a_duplicate(spool):
    """A shell producer's incoming/ID.json not taken in yet: enqueue --id
    ID is refused (73) as for any id the spool has (the SQLite store took
    it, and quarantined the producer's file later)."""
    write_incoming(spool, "x1.json", {"type": "t", "payload": 1})
    cp = call_myq("--spool", spool, "enqueue", "t", "2", "--id", "x1")
    assert cp.returncode == 73, (cp.returncode, cp.stderr)
    one_line_error(cp)


def test_a_producers_file_of_an_id_the_spool_has_is_quarantined(spool,
                                                               handlers_dir,
                                                               run_myq):
    """A shell producer's file of an id that waits in a lane or lies dead:
    a duplicate, quarantined, the job there untouched (files: the lane's
    job was replaced, the dead one ran again, one running ran twice at
    once; SQLite's take-in said so already)."""
    h = handlers_dir("t", 'case "$(cat)" in *dead*) exit 65;; esac')
    enqueue(call_myq, spool, "t", '"dead"', "--id", "d1")
    assert worker(run_myq, spool, handlers=h).returncode == 0
    enqueue(call_myq, spool, "t", '"later"', "--id", "w1", "--delay", "3600",
            "--priority", "5")
    for jid in ("d1", "w1"):
        write_incoming(spool, jid + ".json", {"type": "t", "payload": "shell"})
    cp = worker(run_myq, spool, handlers=h)
    assert cp.returncode == 0, cp.stderr
    rows = [json.loads(l) for l in call_myq("--spool", spool, "list",
                                            "--json").stdout.splitlines()]
    got = sorted((r["id"], r["state"]) for r in rows)
    assert got == [("d1", "dead"), ("d1", "failed"), ("w1", "failed"),
                   ("w1", "scheduled")], got
    for r in rows:
        if r["state"] == "failed":
            assert "duplicate" in r["last_error"], r
        else:
            assert r["payload"] in ("dead", "later"), r


def test_delay_makes_it_scheduled(spool):
    t0 = time.time()
    job_id = enqueue(call_myq, spool, "t", "null", "--delay", "100.5")
    t1 = time.time()
    s = show(call_myq, spool, job_id)
    assert s["state"] == "scheduled"
    assert t0 + 100.5 - 0.01 <= s["available_at"] <= t1 + 100.5 + 0.01


@pytest.mark.files_only
def test_job_file_mode_0640(spool):
    old = os.umask(0o022)
    try:
        job_id = enqueue(call_myq, spool, "t")
    finally:
        os.umask(old)
    st = os.stat(os.path.join(spool, "incoming", job_id + ".json"))
    assert stat.S_IMODE(st.st_mode) == 0o640, oct(st.st_mode)


def test_generated_ids_sort_in_creation_order(myq, spool):
    ids = [myq.enqueue(spool, "t", i) for i in range(60)]
    assert len(set(ids)) == 60
    assert sorted(ids) == ids
    cli = [enqueue(call_myq, spool, "t") for _ in range(3)]
    assert sorted(cli) == cli and cli[0] > ids[-1]
    for i in ids + cli:
        assert ID_RE.match(i) and not i.startswith("."), i


@pytest.mark.parametrize("payload", ["{bad", "{'a': 1}", "", "[1,", "nan-ish"])
def test_invalid_json_payload_is_65_and_writes_nothing(spool, payload):
    cp = call_myq("--spool", spool, "enqueue", "t", payload)
    assert cp.returncode == 65, (cp.returncode, cp.stderr)
    one_line_error(cp)
    assert_nothing_written(spool)


def test_invalid_json_on_stdin_is_65(run_myq, spool):
    cp = run_myq("--spool", spool, "enqueue", "t", "-", input="{not json")
    assert cp.returncode == 65, (cp.returncode, cp.stderr)
    assert_nothing_written(spool)


@pytest.mark.parametrize("bad", ["../x", ".x", "a" * 129, "a b", "a/b", "x\n",
                                 "é", ""])
def test_bad_id_is_65_and_writes_nothing(spool, bad):
    cp = call_myq("--spool", spool, "enqueue", "t", "--id", bad)
    assert cp.returncode == 65, (cp.returncode, cp.stderr)
    one_line_error(cp)
    assert_nothing_written(spool)


def test_id_of_128_chars_is_fine(spool):
    long_id = "a" * 128
    assert enqueue(call_myq, spool, "t", "--id", long_id) == long_id


@pytest.mark.parametrize("bad", ["../h", ".h", "h h", "a" * 129, "h/x"])
def test_bad_type_is_65_and_writes_nothing(spool, bad):
    cp = call_myq("--spool", spool, "enqueue", bad, "{}")
    assert cp.returncode == 65, (cp.returncode, cp.stderr)
    one_line_error(cp)
    assert_nothing_written(spool)


def test_too_large_is_65(spool):
    big = json.dumps({"blob": "x" * 2000})
    cp = call_myq("--spool", spool, "enqueue", "t", big, "--max-job-bytes", "1K")
    assert cp.returncode == 65, (cp.returncode, cp.stderr)
    one_line_error(cp)
    assert_nothing_written(spool)
    small = json.dumps({"blob": "x" * 100})
    assert enqueue(call_myq, spool, "t", small, "--max-job-bytes", "1K")


def test_disk_free_guard_is_75(spool):
    cp = call_myq("--spool", spool, "enqueue", "t", "{}", "--min-free", "1000G")
    assert cp.returncode == 75, (cp.returncode, cp.stderr)
    one_line_error(cp)
    assert_nothing_written(spool)
    cp = call_myq("--spool", spool, "enqueue", "t", "{}",
                  "--min-free-inodes", str(2 ** 62))
    assert cp.returncode == 75, (cp.returncode, cp.stderr)
    assert_nothing_written(spool)


def test_duplicate_while_queued_is_73(spool, myq):
    enqueue(call_myq, spool, "t", "1", "--id", "dup")
    cp = call_myq("--spool", spool, "enqueue", "t", "2", "--id", "dup")
    assert cp.returncode == 73, (cp.returncode, cp.stderr)
    one_line_error(cp)
    assert job_file(spool, "dup")["payload"] == 1
    with pytest.raises(myq.DuplicateJob):
        myq.enqueue(spool, "t", 3, id="dup")
    assert ls(spool, "tmp") == []


def test_duplicate_while_done_or_dead_is_73(run_myq, spool, handlers_dir, myq):
    handlers_dir("ok", "exit 0")
    handlers_dir("bad", "exit 65")
    enqueue(call_myq, spool, "ok", "--id", "was-done")
    enqueue(call_myq, spool, "bad", "--id", "was-dead")
    cp = worker(run_myq, spool, handlers=handlers_dir.path)
    assert cp.returncode == 0, cp.stderr
    assert show(call_myq, spool, "was-done")["state"] == "done"
    assert show(call_myq, spool, "was-dead")["state"] == "dead"
    for job_id in ("was-done", "was-dead"):
        cp = call_myq("--spool", spool, "enqueue", "ok", "--id", job_id)
        assert cp.returncode == 73, (job_id, cp.returncode, cp.stderr)
        with pytest.raises(myq.DuplicateJob):
            myq.enqueue(spool, "ok", id=job_id)
    assert ls(spool, "incoming") == []


def test_duplicate_while_processing_is_73(spool, handlers_dir, tmp_path):
    body, started, release = blocking_handler(tmp_path)
    handlers_dir("block", body)
    enqueue(call_myq, spool, "block", "--id", "busy")
    w = start_worker(spool, "--drain", "--handlers", handlers_dir.path, *FAST)
    try:
        wait_for(lambda: (started / "busy").exists(), what="handler start")
        cp = call_myq("--spool", spool, "enqueue", "block", "--id", "busy")
        assert cp.returncode == 73, (cp.returncode, cp.stderr)
        assert ls(spool, "incoming") == []
    finally:
        release.touch()
        stop_rc = w.wait(30)
    assert stop_rc == 0


def test_api_enqueue_returns_id_and_raises_myq_errors(myq, spool, store):
    job_id = myq.enqueue(spool, "t", {"a": 1})
    assert job_file(spool, job_id)["payload"] == {"a": 1}
    assert myq.enqueue(spool, "t", None, id="given") == "given"
    j = myq.enqueue(spool, "t", None, id="later", delay=50, max_attempts=2,
                    timeout=1.5)
    d = job_file(spool, j)
    assert (d["max_attempts"], d["timeout"]) == (2, 1.5)
    assert d["available_at"] > time.time() + 45
    for cls in ("DuplicateJob", "InvalidJob", "SpoolFull"):
        assert issubclass(getattr(myq, cls), myq.MyqError), cls
    with pytest.raises(myq.InvalidJob):
        myq.enqueue(spool, "t", None, id="../x")
    with pytest.raises(myq.InvalidJob):
        myq.enqueue(spool, "bad type", None)
    with pytest.raises(myq.InvalidJob):
        myq.enqueue(spool, "t", {"not": object()})
    assert ls(spool, "tmp") == []
    assert sorted(ls(spool, "incoming") if store == "files" else [
        r["id"] + ".json" for r in myq.open_store(spool).list()]) == sorted(
        [job_id + ".json", "given.json", "later.json"])


def test_api_enqueue_spool_full(myq, spool, monkeypatch):
    real = os.statvfs

    class Tiny:
        def __init__(self, st):
            self.__st = st

        def __getattr__(self, name):
            if name in ("f_bavail", "f_bfree", "f_favail", "f_ffree"):
                return 0
            return getattr(self.__st, name)

        def __getitem__(self, i):
            return (0 if i in (3, 4, 6, 7) else self.__st[i])

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny(real(p)))
    with pytest.raises(myq.SpoolFull):
        myq.enqueue(spool, "t", 1)
    monkeypatch.undo()
    assert ls(spool, "incoming") == [] and ls(spool, "tmp") == []


@pytest.mark.files_only
@pytest.mark.parametrize("via_tmp", [False, True])
def test_a_job_claimed_before_enqueue_returns_was_enqueued(myq, spool, monkeypatch,
                                                           via_tmp):
    """A worker may claim the job between the rename into incoming/ and
    enqueue's check that the file there is the one it wrote: that is not
    "replaced" (found by the power-cut harness: the caller was told nothing
    was enqueued while the job ran).  Both ways: through tmp/, and linked
    from an unnamed file (O_TMPFILE: no such check is needed)."""
    if via_tmp:
        monkeypatch.setattr(myq, "_TMPFILE", 0)

    def claim_now(op, path, when):
        if op in ("rename", "link") and when == "after" and "/incoming/" in path:
            jid = os.path.basename(path)[:-5]
            os.rename(path, os.path.join(spool, "processing",
                                         jid + "+w-1-abcdef.1.json"))
    monkeypatch.setattr(myq, "_hook", claim_now)
    jid = myq.open_store(spool).enqueue("ok", {"x": 1})
    monkeypatch.setattr(myq, "_hook", None)
    assert os.listdir(os.path.join(spool, "processing")) == [
        jid + "+w-1-abcdef.1.json"]


@pytest.mark.files_only
def test_an_explicit_id_claimed_while_its_producer_unlinks_tmp(myq, spool,
                                                                monkeypatch):
    """An explicit id is linked into incoming/, then its tmp/ name unlinked
    (after the fsync).  A worker that claims it in between sees two names;
    when the producer's unlink comes between the worker's lstat and its
    look into tmp/, the worker finds no tmp/ name, and the file has one
    name left: a job, not a hard link for failed/ (seen in test_chaos)."""
    sp = myq.open_store(spool)
    me = myq.Identity(sp)
    real_scandir = myq._scandir
    got = []

    def producer_unlinks_first(path):
        if path == sp.d("tmp"):
            for name in os.listdir(path):
                os.unlink(os.path.join(path, name))
        return real_scandir(path)

    def claim_now(op, path, when):
        if op == "link" and when == "after" and "/incoming/" in path:
            monkeypatch.setattr(myq, "_scandir", producer_unlinks_first)
            got.append(sp.claims.claim(os.path.basename(path), me))
            monkeypatch.setattr(myq, "_scandir", real_scandir)
    monkeypatch.setattr(myq, "_hook", claim_now)
    assert sp.enqueue("ok", {"x": 1}, id="linked-1") == "linked-1"
    monkeypatch.setattr(myq, "_hook", None)
    assert got and got[0] is not None and got[0].jid == "linked-1"
    sp.claims.close(got[0])
    assert ls(spool, "failed") == []
    assert [n.split("+")[0] for n in ls(spool, "processing")] == ["linked-1"]


# A producer's poke and disk-free guard, cheaper from its second job on #######

def _reader(spool):
    """A listening worker's end of locks/wake."""
    return os.open(os.path.join(spool, "locks", "wake"),
                   os.O_RDONLY | os.O_NONBLOCK)


def _pokes(fd):
    try:
        return len(os.read(fd, 4096))
    except BlockingIOError:
        return 0


@pytest.mark.files_only
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_producer_keeps_nothing_open_in_the_spool(myq, spool):
    """After its enqueues, with a worker listening, a process holds no
    descriptor on the spool's filesystem: a producer that stays must not
    keep it busy (umount at shutdown; seen in the power-cut VM when the
    wake FIFO was kept open between pokes)."""
    r = _reader(spool)
    try:
        sp = myq.open_store(spool)
        for i in range(20):
            sp.enqueue("t", i)
        sp.enqueue_many([{"type": "t", "payload": i} for i in range(20)])
        assert _pokes(r) == 21                  # every call poked
        held = []
        for f in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink("/proc/self/fd/" + f)
            except OSError:
                continue
            if target.startswith(spool) and int(f) != r:
                held.append(target)
        assert held == []
    finally:
        os.close(r)


def test_no_worker_listening_is_looked_for_again_soon(myq, spool, monkeypatch):
    """Where no worker listened, a producer does not look again for 10 ms
    (each look is a failed open); after that, a worker that came is poked."""
    clock = [1000.0]
    monkeypatch.setattr(myq, "_mono", lambda: clock[0])
    sp = myq.open_store(spool)
    sp.enqueue("t", 1)          # none listens
    r = _reader(spool)
    try:
        sp.enqueue("t", 3)
        assert _pokes(r) == 0   # within the 10 ms: not looked for
        clock[0] += 0.011
        sp.enqueue("t", 4)
        assert _pokes(r) == 1
    finally:
        os.close(r)


def test_the_disk_free_guard_asks_once_a_second_while_its_room_lasts(
        myq, spool, monkeypatch):
    """statvfs at most once a second while the jobs since fit in what it
    saw free beyond --min-free (a job counted as its bytes and a block);
    at once when they do not, and then it refuses."""
    real = os.statvfs
    free = [None]
    calls = []

    class Fake:
        def __init__(self, st):
            self.__st = st

        def __getattr__(self, name):
            if name == "f_bavail":
                return free[0] // self.__st.f_frsize
            return getattr(self.__st, name)

    def statvfs(p):
        calls.append(p)
        return Fake(real(p))
    clock = [1000.0]
    monkeypatch.setattr(myq, "_mono", lambda: clock[0])
    monkeypatch.setattr(os, "statvfs", statvfs)
    sp = myq.open_store(spool, min_free=1 << 20)
    block = real(spool).f_frsize
    free[0] = (1 << 20) + 10 * block            # room for some jobs
    for i in range(4):
        sp.enqueue("t", i)
    assert len(calls) == 1                      # 4 jobs: 4 * (bytes + block)
    clock[0] += 1.0
    sp.enqueue("t", 4)
    assert len(calls) == 2                      # a second later: again
    for i in range(5, 20):
        try:
            sp.enqueue("t", i)
        except myq.SpoolFull:
            break
        free[0] -= 2 * block                    # as the files really take
    else:
        pytest.fail("never refused")
    assert len(calls) >= 3                      # asked again when the room ran out
    assert not any(n.endswith(".new") for n in ls(spool, "tmp"))


@pytest.fixture
def ext4(tmp_path):
    """A fresh ext4 filesystem on a loop device: (mount point, a function
    that reads its journal's commit count).  Root only."""
    from _core import ext4_image
    with ext4_image(tmp_path, block=None) as (mnt, dev):
        info = "/proc/fs/jbd2/%s-8/info" % os.path.basename(dev)
        if not os.path.exists(info):
            pytest.skip("no %s: cannot count journal commits" % info)

        def commits():
            with open(info) as f:
                return int(f.readline().split()[0])
        yield mnt, commits


def test_a_batch_is_one_journal_commit_not_one_a_job(myq, ext4):
    """enqueue_many starts every file's writeback before the first fsync,
    and fsyncs the last file first, so that one journal commit holds all
    their blocks: on ext4, a batch of 100 durable jobs costs one commit, not
    100 (1.6-1.8 when the first file is fsync'd first; single enqueues: one
    each, the measure's control)."""
    mnt, commits = ext4
    spool = os.path.join(mnt, "spool")
    sp = myq.open_store(spool)
    sp.init()
    os.sync()
    c0 = commits()
    for i in range(10):
        sp.enqueue("t", i)
    c1 = commits()
    ids = []
    for b in range(10):
        ids += sp.enqueue_many([{"type": "t", "payload": i} for i in range(100)])
    c2 = commits()
    assert c1 - c0 >= 10, "the control: single enqueues, one commit each"
    # (slack for the journal's own commit every 5 s)
    assert c2 - c1 <= 12, "%d commits for 10 batches of 100" % (c2 - c1)
    assert len(ids) == 1000 and len(ls(spool, "incoming")) == 1010
