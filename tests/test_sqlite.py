"""The SQLite store (myq-spool(5) SQLITE STORE): what is its own.
What both stores share (enqueue, retry and the dead letters, export and
import) runs against both in test_enqueue, test_retry_dlq and test_export
(conftest.BOTH_STORES); here: the store recorded and found, the schema an
operator reads with sqlite3, the missing module, the drop box, a damaged,
busy or full database, the clock, kills at every commit and in the middle
of a checkpoint, and workers that never run one job twice at once."""
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

import myq
from _core import (BOOT, MYQ, ROOT, STATUS_RE, call_myq, clean_env,
                   fill_disk, run_myq, show, sql, start_worker, stop,
                   wait_for, write_incoming, drain_here)


def sql_spool(path):
    path = str(path)
    assert call_myq("--spool", path, "init", "--store", "sqlite").returncode == 0
    return path


def rows(path, statement="SELECT id, status FROM jobs ORDER BY id"):
    return sql(str(path), statement)


def quiet(event, **kv):
    pass


RAN = []


def _ok(job):
    RAN.append(job["id"])


def _bad(job):
    raise myq.PermanentError("no")


HANDLERS = {"ok": _ok, "bad": _bad}


# The store recorded, found by every command, read with sqlite3 ###############

def test_init_records_the_store_and_every_command_finds_it(tmp_path):
    sp = sql_spool(tmp_path / "s")
    assert open(os.path.join(sp, "store")).read() == "sqlite\n"
    assert os.path.isfile(os.path.join(sp, "queue.db"))
    assert isinstance(myq.Spool(sp).store, myq.SqlStore)
    assert type(myq.Spool(str(tmp_path / "none")).store) is myq.FileStore
    jid = myq.enqueue(sp, "ok", {"n": 1})                  # the API
    cp = run_myq("--spool", sp, "enqueue", "ok", "2")      # the CLI
    assert cp.returncode == 0, cp.stderr
    assert {r[1] for r in rows(sp)} == {"ready"}
    assert sorted(r[0] for r in rows(sp)) == sorted([jid, cp.stdout.strip()])
    cp = run_myq("--spool", sp, "stats")
    assert STATUS_RE.match(cp.stdout.strip()) and " ready=2 " in cp.stdout
    del RAN[:]
    drain_here(sp, HANDLERS, log=quiet)
    assert sorted(RAN) == sorted(r[0] for r in rows(sp))
    assert {r[1] for r in rows(sp)} == {"done"}
    # nothing of a job is a file: the job directories stay empty
    for sub in ("incoming", "processing", "done", "dlq", "failed", "tmp"):
        assert os.listdir(os.path.join(sp, sub)) == [], sub
    # an existing spool keeps its store
    cp = run_myq("--spool", sp, "init")
    assert cp.returncode == 0 and isinstance(myq.Spool(sp).store, myq.SqlStore)
    files = str(tmp_path / "f")
    assert call_myq("--spool", files, "init").returncode == 0
    cp = run_myq("--spool", files, "init", "--store", "sqlite")
    assert cp.returncode == 78 and "export" in cp.stderr, cp.stderr


def test_the_schema_is_the_seeds_for_the_sqlite3_shell(tmp_path):
    sp = sql_spool(tmp_path / "s")
    myq.enqueue(sp, "ok", {"a": [1, 2]}, id="j1", timeout=5)
    cols = [r[1] for r in rows(sp, "PRAGMA table_info(jobs)")]
    for c in ("id", "queue", "payload", "status", "attempts", "max_attempts",
              "available_at", "leased_until", "worker_id", "last_error",
              "created_at", "updated_at"):
        assert c in cols, c
    idx = rows(sp, "PRAGMA index_info(idx_jobs_ready)")
    # the seed's index of the ready rows alone, by lane (every scan is one
    # lane's): a claim or a success takes the row out of it, and nothing
    # else of a finished job is indexed
    assert [r[2] for r in idx] == ["queue", "lane", "available_at", "id"]
    (sql,), = rows(sp, "SELECT sql FROM sqlite_master WHERE name='idx_jobs_ready'")
    assert sql.endswith("WHERE status='ready'"), sql
    assert rows(sp, "PRAGMA page_size") == [(1024,)]
    assert rows(sp, "PRAGMA journal_mode") == [("wal",)]
    (jid, queue, payload, status, extra), = rows(
        sp, "SELECT id, queue, payload, status, extra FROM jobs")
    assert (jid, queue, status) == ("j1", "s", "ready")
    assert json.loads(payload) == {"a": [1, 2]}
    assert json.loads(extra) == {"timeout": 5}


@pytest.mark.parametrize("payload", [None, 0, "x", {"a": [1, 2.5]},
                                     {"k": "\u00e9\u4e2d\U0001f600"}, [True, None]])
def test_the_usual_enqueue_stores_the_row_the_general_way_would(
        tmp_path, payload, monkeypatch):
    """SqlStore.enqueue's INSERT of the usual shape against _row_values of
    the same job: every column the same, the size what its file would hold
    (utf-8 bytes)."""
    sp = myq.open_store(sql_spool(tmp_path / "s")).require()
    general = myq._DirStore.enqueue
    with monkeypatch.context() as m:    # (the usual way, not the general)
        m.setattr(myq._DirStore, "enqueue", None)
        jid = sp.enqueue("ok", payload)
        sp.enqueue("ok", 1)
    assert myq._DirStore.enqueue is general
    cols = ", ".join(myq._SELECT_COLS + ("queue", "size", "worker_id",
                                         "leased_until"))
    (got,) = sql(sp.path, "SELECT %s FROM jobs WHERE id=?" % cols, (jid,))
    (got2,) = sql(sp.path, "SELECT %s FROM jobs WHERE id!=?" % cols, (jid,))
    for row, pl in ((got, payload), (got2, 1)):
        job = myq._job_of_row(row[:len(myq._SELECT_COLS)])
        assert job["payload"] == pl
        want = myq._row_values(sp, dict(job, last_error=None), "ready",
                               "incoming", job["created_at"])
        new = myq.new_job("ok", pl, job["id"], now=job["created_at"])
        assert want["size"] == len(myq._dumps_new(new))
        assert dict(zip(cols.split(", "), row)) == dict(
            want, lease=None, finished_at=None, token=None, worker_id=None,
            leased_until=None)
    # a type held for a missing handler waits in its lane, priority or not
    sp.set_lane_types({"held"})
    assert rows(sp.path, "SELECT lane FROM jobs WHERE id='%s'"
                % sp.enqueue("held", payload)) == [("incoming/lanes/held@0",)]
    # what the general way refuses, the usual call refuses the same
    with pytest.raises(myq.InvalidJob, match="lone surrogate"):
        sp.enqueue("ok", "\ud800")
    with pytest.raises(myq.InvalidJob, match="cannot be stored as JSON"):
        sp.enqueue("ok", float("nan"))


def _blocked(args, sp_env=None):
    """myq with `import sqlite3` failing, as on OpenWrt without
    python3-sqlite3 (started from its cached code, as myq_argv's are)."""
    code = "import sys; sys.modules['sqlite3'] = None\n" + BOOT
    return subprocess.run([sys.executable, "-c", code, MYQ] + list(args),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, env=clean_env(sp_env),
                          timeout=60)


def test_without_the_sqlite3_module_exit_78_names_the_package(tmp_path):
    sp = sql_spool(tmp_path / "s")
    for args in (["stats"], ["enqueue", "ok"], ["worker", "--drain"],
                 ["list"]):
        cp = _blocked(["--spool", sp] + args)
        assert cp.returncode == 78, (args, cp.stderr)
        assert "python3-sqlite3" in cp.stderr and "Traceback" not in cp.stderr
    t = str(tmp_path / "t")
    cp = _blocked(["--spool", t, "init", "--store", "sqlite"])
    assert cp.returncode == 78 and "python3-sqlite3" in cp.stderr
    # nothing made: a spool of files was left, which init then refused to
    # make SQLite once the module was there
    assert not os.path.exists(t)


def test_a_file_spool_never_imports_sqlite3(tmp_path, handlers_dir):
    files = str(tmp_path / "f")
    h = handlers_dir("ok", "cat >/dev/null")
    for args in (["init"], ["enqueue", "ok", "1"], ["stats"], ["list"],
                 ["worker", "--drain", "--handlers", h], ["export"],
                 ["check"]):
        cp = _blocked(["--spool", files] + args)
        assert cp.returncode == 0, (args, cp.stderr)
    probe = ("import sys; sys.path.insert(0, %r); import myq; "
             "sp = myq.open_store(%r); sp.enqueue('ok', 1); list(sp.list()); "
             "sp.stats(); print('sqlite3' in sys.modules)" % (ROOT, files))
    cp = subprocess.run([sys.executable, "-c", probe], stdout=subprocess.PIPE,
                        universal_newlines=True, env=clean_env())
    assert cp.stdout.strip() == "False"


# The drop box: shell producers unchanged ######################################

def test_shell_producers_drop_files_and_the_worker_takes_them_in(tmp_path):
    sp = sql_spool(tmp_path / "s")
    write_incoming(sp, "sh1.json", {"type": "ok", "payload": "from sh"})
    write_incoming(sp, "bad.json", None, raw=b"{not json")
    write_incoming(sp, "notes.txt", None, raw=b"ignored: no .json")
    later = write_incoming(sp, "later.json", {"type": "ok"})
    t = time.time() + 3600
    os.utime(later, (t, t))             # mtime after ctime: the schedule
    # show and list see a dropped file before any worker touched it
    assert show(call_myq, sp, "sh1")["state"] == "ready"
    del RAN[:]
    drain_here(sp, HANDLERS, log=quiet)
    assert RAN == ["sh1"]
    assert dict(rows(sp)) == {"sh1": "done", "later": "ready"}
    assert abs(show(call_myq, sp, "later")["available_at"] - t) < 1
    assert sorted(os.listdir(os.path.join(sp, "incoming"))) == ["notes.txt"]
    failed = os.listdir(os.path.join(sp, "failed"))
    assert sorted(failed) == ["bad.json", "bad.json.reason"]
    listed = [r["id"] for r in myq.open_store(sp).list("failed")]
    assert listed == ["bad"] or listed == ["bad.json"], listed


def test_a_file_taken_in_and_left_by_a_crash_is_one_job(tmp_path):
    """A crash between the commit of the row and the file's removal leaves
    the file: its id is refused the second time, and the job runs once."""
    sp = sql_spool(tmp_path / "s")
    path = write_incoming(sp, "once.json", {"type": "ok", "payload": 1})
    keep = str(tmp_path / "copy")
    shutil.copy(path, keep)
    s = myq.open_store(sp)
    s.claims.dropbox.take_in()
    assert dict(rows(sp)) == {"once": "ready"} and not os.path.exists(path)
    shutil.copy(keep, path)             # as if the unlink never happened
    del RAN[:]
    drain_here(sp, HANDLERS, log=quiet)
    assert RAN == ["once"]
    assert not os.path.exists(path) and dict(rows(sp)) == {"once": "done"}
    # its own job, not a duplicate: nothing quarantined, nothing to repair
    assert os.listdir(os.path.join(sp, "failed")) == []
    assert run_myq("--spool", sp, "check").returncode == 0
    # another job under the same id, while the first waits: a duplicate
    myq.enqueue(sp, "ok", 1, id="twice", delay=3600)
    write_incoming(sp, "twice.json", {"type": "ok", "payload": "other"})
    s.claims.dropbox.take_in()
    assert sorted(os.listdir(os.path.join(sp, "failed"))) == [
        "twice.json", "twice.json.reason"]     # (a tmpfs lists the newest first)
    shutil.copy(keep, path)             # sent again while its row stays
    drain_here(sp, HANDLERS, log=quiet)
    assert RAN == ["once"] and not os.path.exists(path)


def test_a_dropped_file_of_a_dead_job_is_said_and_counted_not_lost(tmp_path):
    """A producer drops the same job again (id, type, payload) after it
    went dead: one job, so the file goes, but said and counted (it went
    without a word), with the way to run it again."""
    sp = sql_spool(tmp_path / "s")
    job = {"id": "X", "type": "bad", "payload": {"n": 1}}
    write_incoming(sp, "X.json", job)
    drain_here(sp, HANDLERS, log=quiet)
    assert rows(sp) == [("X", "dead")]
    write_incoming(sp, "X.json", job)
    events = []
    myq.Worker(sp, handlers={"bad": _bad}, poll=0.05, jitter=0,
               log=lambda ev, **kv: events.append((ev, kv))).run(drain=True)
    assert os.listdir(os.path.join(sp, "incoming")) == []
    assert ("skipped", {"id": "X", "why": "the same job is dead already (its "
            "row): myq retry X runs it again"}) in events, events
    assert myq.open_store(sp).reader.totals()["removed"] == {"bad": 1}


def test_a_producer_that_cannot_write_the_database_drops_a_file(tmp_path,
                                                                 monkeypatch):
    sp = sql_spool(tmp_path / "s")
    s = myq.open_store(sp)
    monkeypatch.setattr(s.rows, "drop_box", lambda: True)
    jid = s.enqueue("ok", {"x": 1})
    assert os.listdir(os.path.join(sp, "incoming")) == [jid + ".json"]
    assert rows(sp) == []
    del RAN[:]
    drain_here(sp, HANDLERS, log=quiet)
    assert RAN == [jid] and dict(rows(sp)) == {jid: "done"}


# A damaged, busy, full database ################################################

def _damage(sp):
    """Garbage over a page in the middle of queue.db (checkpointed first)."""
    db = sqlite3.connect(os.path.join(sp, "queue.db"))
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = db.execute("PRAGMA page_size").fetchone()[0]
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.close()
    with open(os.path.join(sp, "queue.db"), "r+b") as f:
        f.seek(size * (pages // 2))
        f.write(os.urandom(size))
    return pages


def test_a_damaged_database_stops_claims_check_says_so_export_saves(tmp_path):
    sp = sql_spool(tmp_path / "s")
    s = myq.open_store(sp)
    s.enqueue_many([{"type": "ok", "payload": "x" * 3000, "id": "j%03d" % i}
                    for i in range(60)])
    assert _damage(sp) > 20
    cp = run_myq("--spool", sp, "check")          # a problem found: 1, not 78
    assert cp.returncode == 1 and "damaged" in cp.stdout, (cp.returncode, cp.stderr)
    cp = run_myq("--spool", sp, "check", "--json")
    assert cp.returncode == 1 and not json.loads(cp.stdout)["ok"], cp.stderr
    cp = run_myq("--spool", sp, "worker", "--drain")
    assert cp.returncode == 78, cp.stderr
    assert "damaged" in cp.stderr and "export" in cp.stderr
    assert "Traceback" not in cp.stderr
    cp = run_myq("--spool", sp, "export")
    got = [json.loads(l)["id"] for l in cp.stdout.splitlines()]
    assert "Traceback" not in cp.stderr
    assert 30 <= len(got) < 60, (len(got), cp.stderr)
    assert len(set(got)) == len(got)


def test_export_of_a_damaged_database_writes_each_job_once(tmp_path):
    """Damage past the first 256 rows (export reads 256 at a time): those
    were written, then the salvage wrote every readable row from the
    first again."""
    sp = sql_spool(tmp_path / "s")
    myq.open_store(sp).enqueue_many([{"type": "ok", "payload": "x" * 3000,
                                 "id": "j%03d" % i} for i in range(300)])
    db = sqlite3.connect(os.path.join(sp, "queue.db"))
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    with open(os.path.join(sp, "queue.db"), "r+b") as f:
        data = f.read()
        f.seek(data.rfind(b"x" * 900) - 500)    # the last job's payload
        f.write(os.urandom(1000))
    cp = run_myq("--spool", sp, "export")
    assert "Traceback" not in cp.stderr and "damaged" in cp.stderr
    got = [json.loads(line)["id"] for line in cp.stdout.splitlines()]
    assert len(got) == len(set(got)) and len(got) >= 299, (len(got), len(set(got)))


def test_a_claim_whose_admission_fails_on_io_goes_back_ready(tmp_path,
                                                             monkeypatch):
    """The claim commits, then a write of its admission fails (busy, full):
    the row goes back to ready untouched, at once or, that write failing
    too, at the worker's next try; it stayed this live worker's claim
    until it stopped."""
    import errno
    sp = sql_spool(tmp_path / "s")
    s = myq.open_store(sp)
    jid = s.enqueue("ok", None)
    calls = {"admit": 0, "back": 0}
    real_admit, real_write = myq._SqlClaims._admit, myq._SqlDb.write

    def admit(self, *a):
        calls["admit"] += 1
        if calls["admit"] <= 2:
            raise myq._DbError(errno.EBUSY, "busy")
        return real_admit(self, *a)

    def write(self, statement, *a, **kw):
        if statement.startswith("UPDATE jobs SET status='ready', token=NULL") \
                and calls["admit"] == 2 and not calls["back"]:
            calls["back"] += 1
            raise myq._DbError(errno.EBUSY, "busy")
        return real_write(self, statement, *a, **kw)
    monkeypatch.setattr(myq._SqlClaims, "_admit", admit)
    monkeypatch.setattr(myq._SqlDb, "write", write)
    s = myq.open_store(sp)          # (its handles on the patched statements)
    with pytest.raises(OSError) as e:          # given back at once
        s.claims.claim(jid + ".json", myq.Identity(s, 60.0), 5, True)
    assert not getattr(e.value, "give_back", None)
    assert rows(sp, "SELECT status, token, attempts FROM jobs") == [
        ("ready", None, 0)]
    del RAN[:]
    drain_here(sp, HANDLERS, log=quiet)       # its give-back fails once: the worker's next try
    assert RAN == [jid] and calls == {"admit": 3, "back": 1}, calls
    assert rows(sp) == [(jid, "done")]


def test_an_emptied_database_is_damaged_not_busy(tmp_path):
    """queue.db emptied (0 bytes: no schema): every command said "try
    again later" (75), check too; it is damaged: 78, check 1."""
    sp = sql_spool(tmp_path / "s")
    open(os.path.join(sp, "queue.db"), "w").close()
    cp = run_myq("--spool", sp, "enqueue", "ok")
    assert cp.returncode == 78 and "damaged" in cp.stderr, cp.stderr
    cp = run_myq("--spool", sp, "check")
    assert cp.returncode == 1 and "damaged" in cp.stdout, (cp.stdout, cp.stderr)


def test_a_busy_database_is_waited_for_then_exit_75(tmp_path):
    sp = sql_spool(tmp_path / "s")
    db = sqlite3.connect(os.path.join(sp, "queue.db"), isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    try:
        t0 = time.monotonic()
        cp = run_myq("--spool", sp, "enqueue", "ok", env={"MYQ_DB_BUSY": "0.3"})
        waited = time.monotonic() - t0
        assert cp.returncode == 75, cp.stderr
        assert "busy" in cp.stderr and "\n" not in cp.stderr.strip()
        assert "for 0.3s" in cp.stderr         # (the wait it was given)
        assert waited >= 0.3
    finally:
        db.execute("ROLLBACK")
        db.close()
    assert run_myq("--spool", sp, "enqueue", "ok").returncode == 0
    assert len(rows(sp)) == 1


SMALL_FS = "4m"          # the small_fs fixture's size


def test_a_full_disk_refuses_with_75_and_keeps_every_job(small_fs, tmp_path):
    """SQLITE_FULL: an enqueue that cannot be written exits 75 and the
    database stays whole; room made, the same enqueue goes in."""
    sp = sql_spool(os.path.join(small_fs, "s"))
    for i in range(5):
        assert run_myq("--spool", sp, "enqueue", "ok", '"%s"' % ("y" * 2000),
                       "--id", "k%d" % i, "--min-free", "0").returncode == 0
    filler = os.path.join(small_fs, "filler")
    fill_disk(filler)
    big = '"%s"' % ("z" * 60000)
    cp = run_myq("--spool", sp, "enqueue", "ok", big, "--id", "big",
                 "--min-free", "0", "--min-free-inodes", "0")
    assert cp.returncode == 75, cp.stderr
    assert "Traceback" not in cp.stderr
    os.unlink(filler)
    assert rows(sp, "PRAGMA quick_check") == [("ok",)]
    assert sorted(r[0] for r in rows(sp)) == ["k%d" % i for i in range(5)]
    cp = run_myq("--spool", sp, "enqueue", "ok", big, "--id", "big")
    assert cp.returncode == 0, cp.stderr
    del RAN[:]
    drain_here(sp, HANDLERS, log=quiet)
    assert sorted(RAN) == ["big"] + ["k%d" % i for i in range(5)]


# The clock ###################################################################

def test_when_the_clock_goes_back_a_job_keeps_the_delay_it_had_left(
        tmp_path, monkeypatch):
    sp = sql_spool(tmp_path / "s")
    s = myq.open_store(sp)
    s.enqueue("ok", None, id="soon", delay=30)
    s.claims.change_key()           # the offset of wall to monotonic seen
    real = myq._now
    monkeypatch.setattr(myq, "_now", lambda: real() - 86400)   # a day back
    s.claims.change_key()
    due = dict(rows(sp, "SELECT id, available_at FROM jobs"))["soon"]
    assert 20 < due - myq._now() <= 31, due - myq._now()


# Crash points: a kill at every commit ########################################

KILLER = (
    "import os, signal, sys\n"
    "sys.path.insert(0, %r)\n"
    "import myq\n"
    "seen = [0]\n"
    "def hook(op, path, when):\n"
    "    if op != 'commit':\n"
    "        return\n"
    "    seen[0] += 1\n"
    "    if seen[0] == int(os.environ['DIE_AT']):\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "myq._hook = hook\n"
    "def ok(job):\n"
    "    open(os.environ['RUNS'], 'a').write(job['id'] + '\\n')\n"
    "def flaky(job):\n"
    "    ok(job)\n"
    "    if job['attempts'] < 1:\n"
    "        raise RuntimeError('once more')\n"
    "def bad(job):\n"
    "    ok(job)\n"
    "    raise myq.PermanentError('never')\n"
    "sp = sys.argv[1]\n"
    "s = myq.open_store(sp)\n"
    "def put(f):\n"
    "    try:\n"
    "        f()\n"
    "    except myq.DuplicateJob:\n"
    "        pass                  # (made durable before the kill)\n"
    "if sys.argv[2] == 'produce':\n"
    "    put(lambda: s.enqueue('ok', 1, id='a'))\n"
    "    put(lambda: s.enqueue_many([{'type': 'flaky', 'id': 'b'},\n"
    "        {'type': 'bad', 'id': 'c'}, {'type': 'ok', 'id': 'd'}]))\n"
    "    put(lambda: s.enqueue('bad', 2, id='e', max_attempts=1))\n"
    "else:\n"
    "    myq.Worker(sp, handlers={'ok': ok, 'flaky': flaky, 'bad': bad},\n"
    "               log=lambda e, **kv: None, poll=0.02, jitter=0,\n"
    "               backoff_base=0.01, lease=60).run(drain=True)\n"
    "sys.stderr.write('commits=%%d\\n' %% seen[0])\n" % ROOT)

FINAL = {"a": "done", "b": "done", "c": "dead", "d": "done", "e": "dead"}


def _run(sp, what, die_at, runs):
    return subprocess.run([sys.executable, "-c", KILLER, sp, what],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=120,
                          env=clean_env({"DIE_AT": str(die_at), "RUNS": runs}))


def test_a_kill_at_every_commit_loses_nothing_and_doubles_nothing(tmp_path):
    """Enqueue, claim, finish, retry and dead-letter, killed (SIGKILL)
    before and after each of their commits in turn; then everything run
    again to the end: every job in its final state once, none lost, a job
    run again only where a kill ended its run before its finish committed."""
    probe = sql_spool(tmp_path / "probe")
    runs = str(tmp_path / "probe.runs")
    counts = []
    for what in ("produce", "work"):
        cp = _run(probe, what, 0, runs)
        assert cp.returncode == 0, cp.stderr
        counts.append(int(cp.stderr.rpartition("commits=")[2]))
    assert dict(rows(probe)) == FINAL
    # (the work: claims ahead, successes by the group commit: 8 commits)
    assert counts[0] >= 6 and counts[1] >= 8, counts
    cases = [("produce", k) for k in range(1, counts[0] + 1)] + \
            [("work", k) for k in range(1, counts[1] + 1)]
    for n, (what, k) in enumerate(cases):
        sp = sql_spool(tmp_path / ("s%d" % n))
        runs = str(tmp_path / ("s%d.runs" % n))
        if what == "work":
            assert _run(sp, "produce", 0, runs).returncode == 0
        cp = _run(sp, what, k, runs)
        assert cp.returncode == -signal.SIGKILL, (what, k, cp.stderr)
        if what == "produce":
            # the producer again (what the first made durable is refused)
            before = dict(rows(sp))
            assert set(before) <= set(FINAL)
            assert _run(sp, "produce", 0, runs).returncode == 0
        assert call_myq("--spool", sp, "reap").returncode == 0
        cp = _run(sp, "work", 0, runs)
        assert cp.returncode == 0, (what, k, cp.stderr)
        assert dict(rows(sp)) == FINAL, (what, k)
        ran = open(runs).read().split()
        # a job runs again only where the kill ended its run before its
        # finish was committed: once more at most
        most = 1 if what == "produce" else 2
        assert 1 <= ran.count("a") <= most and 1 <= ran.count("d") <= most, ran


# kill -9 in the middle of a WAL checkpoint #####################################

CHECKPOINTER = (
    "import sqlite3, sys\n"
    "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "print('ready', flush=True)\n"
    "db.execute('PRAGMA wal_checkpoint(TRUNCATE)')\n")


def test_kill_9_in_the_middle_of_a_wal_checkpoint(tmp_path):
    sp = sql_spool(tmp_path / "s")
    s = myq.open_store(sp)
    db = os.path.join(sp, "queue.db")
    n = 0
    for delay in (0.0, 0.002, 0.005, 0.01, 0.02, 0.05):
        con = sqlite3.connect(db)
        con.execute("PRAGMA wal_autocheckpoint=0")      # (this one: no)
        con.close()
        ids = ["c%d-%d" % (n, i) for i in range(2000)]
        s.enqueue_many([{"type": "ok", "payload": "p" * 200, "id": i} for i in ids])
        n += 1
        p = subprocess.Popen([sys.executable, "-c", CHECKPOINTER, db],
                             stdout=subprocess.PIPE, universal_newlines=True)
        assert p.stdout.readline() == "ready\n"
        time.sleep(delay)
        p.kill()
        p.wait()
        assert rows(sp, "PRAGMA quick_check") == [("ok",)]
        assert len(rows(sp)) == 2000 * n
    del RAN[:]
    drain_here(sp, HANDLERS, log=quiet)
    assert len(RAN) == 2000 * n == len(set(RAN))


# Several workers, kills, never one job twice at once ############################

def test_workers_killed_at_random_lose_nothing_and_never_overlap(
        tmp_path, handlers_dir):
    sp = sql_spool(tmp_path / "s")
    log = tmp_path / "log"
    if not shutil.which("flock"):
        pytest.skip("flock(1) not found")
    locks = tmp_path / "locks"
    locks.mkdir()
    # each run holds its job's lock while it runs: a second run of the same
    # job while the first still runs (not killed) cannot take it
    h = handlers_dir("w", 'exec 9>"%s/$MYQ_JOB_ID"\n'
                          'flock -n 9 || echo "overlap $MYQ_JOB_ID" >> "%s"\n'
                          'echo "run $MYQ_JOB_ID" >> "%s"\nsleep 0.0$(( $$ %% 5 ))'
                          % (locks, log, log))
    ids = myq.open_store(sp).enqueue_many([{"type": "w", "id": "j%03d" % i}
                                      for i in range(150)])
    rnd = random.Random(5)
    ws = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        ws = [w for w in ws if w.poll() is None]
        while len(ws) < 3:
            ws.append(start_worker(sp, "--handlers", h, "--poll", "0.05",
                                   "--lease", "3", "--backoff-base", "0.05"))
        time.sleep(rnd.uniform(0.05, 0.4))
        if rnd.random() < 0.5:
            victim = rnd.choice(ws)
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
        if all(s == "done" for _, s in rows(sp)):
            break
    for w in ws:
        stop(w)
    call_myq("--spool", sp, "reap")
    cp = run_myq("--spool", sp, "worker", "--drain", "--handlers", h,
                 "--backoff-base", "0.01")
    assert cp.returncode == 0, cp.stderr
    assert dict(rows(sp)) == dict((i, "done") for i in ids)
    text = log.read_text()
    assert "overlap" not in text, [l for l in text.splitlines() if "overlap" in l]
    assert set(l.split()[1] for l in text.splitlines()) == set(ids)


def test_a_read_only_filesystem_refuses_writes_and_reads_what_is_there(
        small_fs):
    """The flash remounted read-only (after an error, as devices do): a
    write exits 75 saying so, nothing changes; list, show, stats and export
    still read every job."""
    sp = sql_spool(os.path.join(small_fs, "s"))
    ids = [run_myq("--spool", sp, "enqueue", "ok", str(i)).stdout.strip()
           for i in range(3)]
    cp = subprocess.run(["mount", "-o", "remount,ro", small_fs],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        universal_newlines=True)
    if cp.returncode != 0:
        pytest.skip("cannot remount read-only: %s" % cp.stdout.strip())
    try:
        for args in (["enqueue", "ok", "9"], ["worker", "--drain"]):
            cp = run_myq("--spool", sp, *args)
            assert cp.returncode == 75, (args, cp.stderr)
            assert "Read-only" in cp.stderr or "read-only" in cp.stderr
            assert "Traceback" not in cp.stderr
        cp = run_myq("--spool", sp, "export")
        assert cp.returncode == 0, cp.stderr
        assert sorted(json.loads(l)["id"] for l in cp.stdout.splitlines()) == \
            sorted(ids)
        assert show(call_myq, sp, ids[0])["state"] == "ready"
        assert " ready=3 " in run_myq("--spool", sp, "stats").stdout
    finally:
        subprocess.run(["mount", "-o", "remount,rw", small_fs])
    del RAN[:]
    drain_here(sp, HANDLERS, log=quiet)
    assert sorted(RAN) == sorted(ids)


def test_the_supervisor_never_opens_the_database_its_workers_fork_from(
        tmp_path, handlers_dir):
    """SQLite's locks and its per-file bookkeeping do not survive a fork:
    a supervisor that had the database open would hand its children a
    state they must not use.  It never opens it; each worker does, and
    runs jobs."""
    sp = sql_spool(tmp_path / "s")
    h = handlers_dir("ok", "cat >/dev/null")
    log = str(tmp_path / "sup.log")
    sup = subprocess.Popen([sys.executable, MYQ, "--spool", sp, "supervise",
                            "--workers", "2", "--handlers", h, "--log", log,
                            "--poll", "0.05"], env=clean_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def opened(pid):
        out = []
        for n in os.listdir("/proc/%d/fd" % pid):
            try:
                out.append(os.readlink("/proc/%d/fd/%s" % (pid, n)))
            except OSError:
                pass
        return [p for p in out if "queue.db" in p]
    try:
        jid = myq.enqueue(sp, "ok", 1)
        wait_for(lambda: dict(rows(sp)).get(jid) == "done", timeout=30,
                 what="the job done")
        def kids():
            return [int(p) for p in open("/proc/%d/task/%d/children" % (
                sup.pid, sup.pid)).read().split()]
        # (the other worker may still be starting: it opens it then)
        wait_for(lambda: len(kids()) == 2 and all(opened(k) for k in kids()),
                 what="both workers with the database open")
        assert opened(sup.pid) == []
    finally:
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(30) == 0
