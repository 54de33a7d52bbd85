"""A week in the field: what a soak at sensor rates meets, each case made
for real.

1. idempotency records bounded in count, and never what keeps a backlog
   from draining when inodes run short;
2. delivery below the guards: a worker that starts on a full disk and
   drains the backlog that filled it;
3. a batch cut by a kill -9 goes again with the same ids in the same order
   (the same Idempotency-Key);
4. batch_wait for every claim, not only the first after a quiet spell;
8. a type whose handler one worker lacks is held for that worker only;
6. what is removed unrun is counted (stats removed=);
7. retry refuses a file the service user cannot read, naming owner and mode.
(5, --probe-max, and 9, `held` in list and show, are in test_handlers_exec.)
"""
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import myq
from _core import (FAST, MYQ, call_myq, clean_env, fill_disk, ls, run_myq,
                   start_worker, wait_for)
from _procs import wait_gone


@pytest.fixture
def few_inodes(small_tmpfs):
    return small_tmpfs("8m", nr_inodes=160)


def _handler(tmp_path, name, body, batch_log=None):
    """An exec handler in Python; with batch_log it appends the ids it ran
    (a batch's: one JSON object a line on stdin), as one line, to that
    file."""
    d = tmp_path / "handlers"
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_text("#!%s\nimport json, os, sys, time\n"
                 "ids = ([json.loads(l)['id'] for l in sys.stdin if l.strip()]\n"
                 "       if os.environ.get('MYQ_BATCH') else\n"
                 "       [os.environ['MYQ_JOB_ID']])\n"
                 "log = %r\n"
                 "if log:\n"
                 "    with open(log, 'a') as f:\n"
                 "        f.write(' '.join(ids) + '\\n')\n%s\n"
                 % (sys.executable, str(batch_log or ""), body))
    p.chmod(0o755)
    return str(d)


def _lines(path):
    try:
        with open(str(path)) as f:
            return [l.split() for l in f.read().splitlines() if l.strip()]
    except FileNotFoundError:
        return []


def _states(spool, ids):
    return [json.loads(call_myq("--spool", spool, "show", i).stdout)["state"]
            for i in ids]


def _db(spool):
    """An sqlite3 connection to SPOOL/queue.db, or None on a spool of files."""
    db = os.path.join(spool, "queue.db")
    if not os.path.exists(db):
        return None
    import sqlite3
    return sqlite3.connect(db, timeout=30)


def _ok_records(spool):
    """The ids of the idempotency records: locks/ok/'s names; on an SQLite
    spool, the `ok` table's ids."""
    con = _db(spool)
    if con is None:
        return ls(spool, "locks/ok")
    try:
        return sorted(r[0] for r in con.execute("SELECT id FROM ok"))
    finally:
        con.close()


def _waiting_jobs(spool):
    """The waiting jobs, as dicts: incoming/'s files and its lanes'; on an
    SQLite spool, its ready rows, as the files would hold them."""
    con = _db(spool)
    if con is None:
        import glob
        out = []
        for f in glob.glob(os.path.join(spool, "incoming", "**", "*.json"),
                           recursive=True):
            with open(f) as fh:
                out.append(json.load(fh))
        return out
    try:
        return [myq._job_of_row(r) for r in con.execute(
            myq._SELECT + " WHERE status='ready'")]
    finally:
        con.close()


# 1. idempotency records ######################################################

def test_idempotency_records_are_bounded_in_count(spool, tmp_path):
    """20 producer-chosen ids done, retention removes their done files: at
    most --keep-ok-max records stay, the oldest went, and stats counts
    them as removed (the field: 6,548 records after 18 minutes, ~6 million
    a week, none ever removed within the 7-day window)."""
    h = _handler(tmp_path, "t", "")
    ids = ["r%02d" % i for i in range(20)]
    for i in ids:
        myq.enqueue(spool, "t", {"n": i}, id=i)
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", h, *FAST)
    assert cp.returncode == 0, cp.stderr
    cp = call_myq("--spool", spool, "prune", "--keep-done", "0",
                  "--keep-ok-max", "5")
    assert cp.returncode == 0, cp.stderr
    assert ls(spool, "done") == []
    kept = _ok_records(spool)
    assert len(kept) == 5, kept
    st = json.loads(call_myq("--spool", spool, "stats", "--json").stdout)
    assert st["removed"] == 15, st
    # the five kept are the newest; an id of theirs is still refused
    assert call_myq("--spool", spool, "enqueue", "t", "1", "--id",
                    kept[-1]).returncode != 0


def test_short_of_inodes_records_go_first_and_the_backlog_drains(few_inodes,
                                                                 tmp_path):
    """An 8 MiB filesystem with 160 inodes, most of them idempotency
    records: below --min-free-inodes the worker frees records (oldest
    first) and delivers the backlog, instead of claiming nothing (the
    field: jobs sat ready for good, `prune` removed ok=0)."""
    spool = os.path.join(few_inodes, "spool")
    assert call_myq("--spool", spool, "init").returncode == 0
    ok = os.path.join(spool, "locks", "ok")
    os.makedirs(ok, exist_ok=True)
    n = 0
    while os.statvfs(spool).f_favail > 40:
        open(os.path.join(ok, "old%03d" % n), "w").close()
        n += 1
    ids = ["b%02d" % i for i in range(10)]
    for i in ids:
        assert call_myq("--spool", spool, "enqueue", "t", "1", "--id", i,
                       "--min-free-inodes", "0").returncode == 0
    h = _handler(tmp_path, "t", "")
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", h,
                 "--min-free-inodes", "60", *FAST, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert _states(spool, ids) == ["done"] * 10
    assert len(ls(spool, "locks/ok")) < n       # records went, not jobs


# 2. delivery below the guards ################################################

@pytest.mark.parametrize("store", ["files", "sqlite"])
def test_a_worker_starts_and_drains_on_a_full_disk(small_fs, tmp_path, store):
    """The disk is full (a filler file took the rest, after a worker ran
    there): `myq worker` starts all the same (it used to exit 75: a
    restart loop under supervise) and delivers what waits, in the room of
    the reserve (locks/room) that the first worker set aside.  (SQLite:
    the log index is made again at the first open after the last close,
    and the log must wrap within what it has.)"""
    spool = os.path.join(small_fs, "spool")
    assert call_myq("--spool", spool, "init", "--store", store).returncode == 0
    h = _handler(tmp_path, "t", "")
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", h,
                 "--min-free", "64K", *FAST)
    assert cp.returncode == 0, cp.stderr
    assert os.path.getsize(os.path.join(spool, "locks", "room")) == myq._DirStore.ROOM
    ids = ["f%02d" % i for i in range(8 if store == "files" else 40)]
    for i in ids:
        assert call_myq("--spool", spool, "enqueue", "t", "1", "--id", i,
                       "--min-free", "0").returncode == 0
    fill_disk(os.path.join(small_fs, "filler"))
    assert os.statvfs(spool).f_bavail == 0
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", h,
                 "--min-free", "64K", *FAST, timeout=60)
    assert cp.returncode == 0, (cp.returncode, cp.stderr)
    assert ls(spool, "incoming") == [] and ls(spool, "processing") == []
    assert ls(spool, "failed") == []
    # every job finished: done, or (its done file freed for room) refused
    # again as a duplicate of a finished id
    for i in ids:
        s = call_myq("--spool", spool, "show", i)
        assert s.returncode != 0 or json.loads(s.stdout)["state"] == "done", i


# 3. a batch cut by a crash ###################################################

def test_a_split_half_that_meets_a_destination_failure_waits(spool, tmp_path):
    """A batch fails for good and is split; a half then meets a failure
    of the destination (exit 75): its jobs wait without an attempt spent,
    as any job's (the worker died of it in a traceback, the halves left
    in processing/)."""
    assert call_myq("--spool", spool, "policy", "t", "batch=4").returncode == 0
    h = _handler(tmp_path, "t", "sys.exit(65 if len(ids) == 4 else 75)")
    for i in ("j1", "j2", "j3", "j4"):
        myq.enqueue(spool, "t", {}, id=i)
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", h, *FAST)
    assert cp.returncode == 0 and "Traceback" not in cp.stderr, cp.stderr
    assert ls(spool, "processing") == []
    jobs = [json.loads(call_myq("--spool", spool, "show", i).stdout)
            for i in ("j1", "j2", "j3", "j4")]
    assert [j["state"] for j in jobs] == ["scheduled"] * 4, jobs
    assert sorted(j["attempts"] for j in jobs) == [0, 0, 1, 1], jobs


def test_a_retried_batch_waits_one_wait_and_comes_due_as_one(spool, tmp_path):
    """A batch that failed goes again as that batch (the same ids, the same
    Idempotency-Key): its jobs wait one wait, not a jittered one each, or
    the first due went alone and the rest were put back, deferred, and
    sent later in other requests under other keys."""
    assert call_myq("--spool", spool, "policy", "t", "batch=4").returncode == 0
    h = _handler(tmp_path, "t", "sys.exit(1)")
    ids = ["j1", "j2", "j3", "j4"]
    for i in ids:
        myq.enqueue(spool, "t", {}, id=i)
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", h,
                 "--poll", "0.05", "--jitter", "0.5", "--backoff-base", "60")
    assert cp.returncode == 0, cp.stderr
    jobs = [json.loads(call_myq("--spool", spool, "show", i).stdout) for i in ids]
    assert [j["state"] for j in jobs] == ["scheduled"] * 4, jobs
    due = [j["available_at"] for j in jobs]
    assert max(due) - min(due) < 0.1, due       # (jittered: 30-90 s apart)


def test_a_batch_cut_by_a_kill_goes_again_with_its_ids(spool, tmp_path):
    """A worker runs a batch of three and is killed (-9) mid-run; meanwhile
    another job came.  The next worker sends those three again together, in
    the same order (the same Idempotency-Key for http), and the newcomer on
    its own: before, the batch was formed afresh from what was ready, so its
    jobs went again split over two batches under two new keys (the field:
    a receiver that de-duplicates on the key stored 100 readings twice)."""
    p = call_myq("--spool", spool, "policy", "t", "batch=3")
    assert p.returncode == 0, p.stderr
    log, started = tmp_path / "batches", tmp_path / "started"
    h = _handler(tmp_path, "t",
                 "if not os.path.exists(%r):\n"
                 "    with open(%r, 'w') as f:\n"
                 "        f.write(str(os.getpid()))\n"
                 "    time.sleep(60)\n" % (str(started), str(started)),
                 batch_log=log)
    for i in ("b5", "b6", "b7"):
        myq.enqueue(spool, "t", {"n": i}, id=i)
    w = start_worker(spool, "--handlers", h, *FAST)
    try:
        wait_for(lambda: started.exists() and started.read_text(),
                 what="the first batch's handler")
        assert _lines(log) == [["b5", "b6", "b7"]]
        myq.enqueue(spool, "t", {"n": "a"}, id="a3")    # sorts first
        os.killpg(w.pid, signal.SIGKILL)                # the worker
        w.wait(10)
        os.kill(int(started.read_text()), signal.SIGKILL)   # its handler
        wait_gone(int(started.read_text()))
    finally:
        if w.poll() is None:
            os.killpg(w.pid, signal.SIGKILL)
            w.wait(10)
    # the dead worker's claims are taken back by the next worker's reap
    rp = call_myq("--spool", spool, "reap")
    assert rp.returncode == 0, rp.stderr
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", h, *FAST)
    assert cp.returncode == 0, cp.stderr
    assert _states(spool, ["a3", "b5", "b6", "b7"]) == ["done"] * 4
    after = _lines(log)[1:]
    assert ["b5", "b6", "b7"] in after, after
    assert sorted(sum(after, [])) == ["a3", "b5", "b6", "b7"], after
    assert ls(spool, "processing") == []


def test_a_lone_job_of_a_batched_type_cut_by_a_kill_goes_again_alone(spool,
                                                                     tmp_path):
    """A job of a batched type that ran alone (nothing else was ready) is a
    batch of one, recorded like any other: killed (-9) mid-run, it goes
    again alone, the same one-id batch (the same Idempotency-Key for http),
    not batched with what came meanwhile (before, a batch of one was not
    recorded: it went again inside a new batch under a new key, and a
    held destination's probe, sent alone, the same)."""
    p = call_myq("--spool", spool, "policy", "t", "batch=3")
    assert p.returncode == 0, p.stderr
    log, started = tmp_path / "batches", tmp_path / "started"
    h = _handler(tmp_path, "t",
                 "if not os.path.exists(%r):\n"
                 "    with open(%r, 'w') as f:\n"
                 "        f.write(str(os.getpid()))\n"
                 "    time.sleep(60)\n" % (str(started), str(started)),
                 batch_log=log)
    myq.enqueue(spool, "t", {"n": 1}, id="b1")
    w = start_worker(spool, "--handlers", h, *FAST)
    try:
        wait_for(lambda: started.exists() and started.read_text(),
                 what="the lone job's handler")
        assert _lines(log) == [["b1"]]
        for i in ("a1", "a2"):                          # sort first
            myq.enqueue(spool, "t", {"n": i}, id=i)
        os.killpg(w.pid, signal.SIGKILL)
        w.wait(10)
        os.kill(int(started.read_text()), signal.SIGKILL)
        wait_gone(int(started.read_text()))
    finally:
        if w.poll() is None:
            os.killpg(w.pid, signal.SIGKILL)
            w.wait(10)
    rp = call_myq("--spool", spool, "reap")
    assert rp.returncode == 0, rp.stderr
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", h, *FAST)
    assert cp.returncode == 0, cp.stderr
    assert _states(spool, ["a1", "a2", "b1"]) == ["done"] * 3
    after = _lines(log)[1:]
    assert ["b1"] in after, after
    assert sorted(sum(after, [])) == ["a1", "a2", "b1"], after
    assert ls(spool, "processing") == [] and ls(spool, "locks/batches") == []


# 4. batch_wait for every claim ###############################################

def test_batch_wait_applies_after_a_full_batch_too(spool, tmp_path):
    """batch=3 batch_wait=3s, four jobs at once: three go at once (a whole
    batch is ready); the fourth waits its window, and two more that come
    within it go with it: one request, not one a reading (the field: 40 %
    of requests carried one reading, the ones just after a full batch)."""
    p = call_myq("--spool", spool, "policy", "t", "batch=3", "batch_wait=3s")
    assert p.returncode == 0, p.stderr
    log, ran = tmp_path / "batches", tmp_path / "ran"
    h = _handler(tmp_path, "t", "open(%r + '.' + ids[0], 'w').close()"
                 % str(ran), batch_log=log)
    for i in ("j1", "j2", "j3", "j4"):
        myq.enqueue(spool, "t", {"n": i}, id=i)
    w = start_worker(spool, "--handlers", h, *FAST)
    try:
        wait_for(lambda: _lines(log), what="the first batch")
        first = _lines(log)[0]
        assert len(first) == 3, first
        myq.enqueue(spool, "t", {"n": "j5"}, id="j5")
        myq.enqueue(spool, "t", {"n": "j6"}, id="j6")
        wait_for(lambda: len(sum(_lines(log), [])) == 6, timeout=20,
                 what="all six jobs run")
        assert len(_lines(log)) == 2, _lines(log)
        assert sorted(_lines(log)[1]) == sorted(
            {"j1", "j2", "j3", "j4", "j5", "j6"} - set(first))
    finally:
        os.killpg(w.pid, signal.SIGTERM)
        w.wait(15)


# 8. a handler one worker lacks ###############################################

def test_a_worker_without_the_handler_does_not_starve_the_type(spool, tmp_path):
    """Two workers on one spool, only one with the handler of type t (an
    operator trying `myq worker --module test.py` on a live spool): every
    job of t is done by the one that has it.  Before, the other held the
    type spool-wide, the first released it, and 100 ms later it was held
    again: 0 of 20 done in 8 s."""
    h = _handler(tmp_path, "t", "")
    other = tmp_path / "other"
    other.mkdir()
    (other / "u").write_text("#!/bin/sh\nexit 0\n")
    (other / "u").chmod(0o755)
    ids = [myq.enqueue(spool, "t", {"n": i}) for i in range(20)]
    logs = [open(str(tmp_path / n), "w") for n in ("lacking.log", "having.log")]
    lacking = start_worker(spool, "--handlers", str(other), *FAST,
                           stderr=logs[0])
    having = None
    try:
        wait_for(lambda: ls(spool, "locks/held"), what="t held by the worker "
                 "without its handler")
        having = start_worker(spool, "--handlers", h, *FAST, stderr=logs[1])
        wait_for(lambda: len(ls(spool, "done")) == 20, timeout=30,
                 what="the 20 jobs done by the worker that has the handler: "
                 "%s" % [l.name for l in logs])
        assert _states(spool, ids) == ["done"] * 20
        assert lacking.poll() is None       # and the other keeps running
    finally:
        for w in (lacking, having):
            if w is not None:
                os.killpg(w.pid, signal.SIGTERM)
                w.wait(15)
        for f in logs:
            f.close()


# 6. removed unrun, counted ###################################################

def test_what_is_removed_unrun_is_counted(spool):
    """A stray in tmp/ (a producer's write that never got its mv) older
    than --keep-tmp: prune removes it and stats says so (removed=), in the
    JSON, the status line and per type where one is known.  Before, only
    a log line said it."""
    stray = os.path.join(spool, "tmp", "reading.123")
    with open(stray, "w") as f:
        f.write('{"type": "t", "payload": 1}')
    old = time.time() - 2 * 3600
    os.utime(stray, (old, old))
    cp = call_myq("--spool", spool, "prune")
    assert cp.returncode == 0, cp.stderr
    assert not os.path.exists(stray)
    st = json.loads(call_myq("--spool", spool, "stats", "--json").stdout)
    assert st["removed"] == 1, st
    line = call_myq("--spool", spool, "stats").stdout
    assert " removed=1 " in " %s " % line.replace("\n", " "), line


# 7. a file the service user cannot read ######################################

def test_retry_refuses_a_file_the_service_user_cannot_read():
    """A root producer's 0600 file was quarantined (the worker, the spool's
    owner, cannot read it).  `myq retry` refuses it, naming its owner and
    mode, instead of saying retried=1 and leaving it to be quarantined
    again at the next poll, endlessly."""
    if os.geteuid() != 0:
        pytest.skip("a file another user cannot read needs root to make")
    base = tempfile.mkdtemp(prefix="myq-field-")    # (tmp_path is root's 0700)
    os.chmod(base, 0o755)
    spool = os.path.join(base, "spool")
    cp = run_myq("--spool", spool, "init", "--owner",
                 pwd.getpwuid(65534).pw_name)
    assert cp.returncode == 0, cp.stderr
    bad = os.path.join(spool, "failed", "hot1.json")
    with open(bad, "w") as f:
        f.write(json.dumps({"id": "hot1", "type": "t", "payload": 1}))
    os.chown(bad, 0, 0)
    os.chmod(bad, 0o600)
    cp = run_myq("--spool", spool, "retry", "hot1")    # (it drops to the owner)
    assert cp.returncode != 0, (cp.returncode, cp.stdout, cp.stderr)
    assert "uid 0" in cp.stderr and "0600" in cp.stderr, cp.stderr
    assert os.path.exists(bad) and ls(spool, "incoming") == []
    shutil.rmtree(base)


# 6. the README's shell recipe ################################################

def _readme_recipe():
    """The shell producer recipe, as the README gives it."""
    with open(os.path.join(os.path.dirname(MYQ), "README.md")) as f:
        text = f.read()
    start = text.index("#!/bin/sh\n# One job from a shell")
    return text[start:text.index("```", start)]


@pytest.mark.parametrize("full", [False, True], ids=["room", "full"])
def test_the_readme_shell_recipe_checks_its_write(small_fs, tmp_path, full):
    """The recipe under BusyBox sh: with room, one job in incoming/; on a
    full disk it exits 75 and publishes nothing (before: printf failed, the
    unconditional mv published an empty file, 183 in a minute, and nothing
    counted the readings lost)."""
    sh = shutil.which("busybox")
    if not sh:
        pytest.skip("busybox not installed (apt-get install busybox)")
    spool = os.path.join(small_fs, "spool")
    assert call_myq("--spool", spool, "init").returncode == 0
    script = tmp_path / "produce.sh"
    script.write_text(_readme_recipe())
    if full:
        fill_disk(os.path.join(small_fs, "filler"))
    cp = subprocess.run([sh, "sh", str(script)], env=dict(
        clean_env(), SPOOL=spool), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, universal_newlines=True, timeout=30)
    if full:
        assert cp.returncode == 75, (cp.returncode, cp.stderr)
        assert ls(spool, "incoming") == [] and ls(spool, "tmp") == []
    else:
        assert cp.returncode == 0, cp.stderr
        names = ls(spool, "incoming")
        assert len(names) == 1 and ls(spool, "tmp") == []
        with open(os.path.join(spool, "incoming", names[0])) as f:
            assert json.load(f)["type"] == "greet"


# 10. no spin while every slot is busy ########################################

_COUNTING = r'''
import signal, sys
sys.path.insert(0, sys.argv[1])
import myq
n = [0]
real = myq.Worker._wait
def counted(self, busy):
    n[0] += 1
    return real(self, busy)
myq.Worker._wait = counted
w = myq.Worker(sys.argv[2], concurrency=2, stats_interval=0,
               log=lambda *a, **k: None)
def report(*a):
    sys.stdout.write("%d\n" % n[0])
    sys.stdout.flush()
signal.signal(signal.SIGUSR1, report)
w.run()
'''


def test_a_worker_whose_slots_are_all_busy_sleeps(spool, tmp_path):
    """batch=10 batch_wait=1s, two requests to a server that answers after
    a long while, --concurrency 2: both slots wait.  The worker's loop
    sleeps until a run ends (a handful of turns in 3 s: the poll, the
    heartbeat).  Before, the claim made at batch_wait's due time left that
    time, now past, as the loop's next deadline: select() with timeout 0,
    a core spent (the soak: 99 % while the link was down, 28 ms a job)."""
    import socket
    import threading
    p = call_myq("--spool", spool, "policy", "tele", "handler=http",
                 "batch=10", "batch_wait=1s")
    assert p.returncode == 0, p.stderr
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    got, release = [], threading.Event()

    def hold(c):
        got.append(c.recv(65536))
        release.wait(30)
        c.close()

    def accept():
        while not release.is_set():
            try:
                c = srv.accept()[0]
            except OSError:
                return
            threading.Thread(target=hold, args=(c,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    for path in ("a", "b"):     # two urls: two batches, one per slot
        myq.enqueue(spool, "tele", {"url": "http://127.0.0.1:%d/%s" % (port, path),
                                    "body": {"n": 1}})
    w = subprocess.Popen([sys.executable, "-c", _COUNTING,
                          os.path.dirname(MYQ), spool], env=clean_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         universal_newlines=True)
    try:
        wait_for(lambda: len(got) == 2, timeout=30, what="both requests sent")
        w.send_signal(signal.SIGUSR1)
        before = int(w.stdout.readline())
        time.sleep(3)           # (the span over which the turns are counted)
        w.send_signal(signal.SIGUSR1)
        turns = int(w.stdout.readline()) - before
        assert turns < 300, "%d turns of the loop in 3 s with every slot busy" % turns
    finally:
        release.set()
        srv.close()
        w.terminate()
        w.wait(15)


def test_an_mqtt_batch_that_fails_together_is_batched_afresh(spool, tmp_path):
    """A broker takes 20 publishes of a batch and drops the connection:
    each job gets its own outcome (retry).  None of them may keep a
    batch_of whose record the batch's end removed: they would go again
    one publish at a time, a PUBACK round trip each (the soak: most of the
    drain after the link came back; 50 jobs 10.7 s instead of 1.0 s)."""
    import socket
    import threading
    p = call_myq("--spool", spool, "policy", "reading", "handler=mqtt",
                 "batch=50")
    assert p.returncode == 0, p.stderr
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(5)
    port = s.getsockname()[1]

    def broker():       # CONNACK, swallow the publishes, drop the connection
        c = s.accept()[0]
        c.recv(65536)
        c.sendall(b"\x20\x02\x00\x00")
        time.sleep(1.0)
        c.close()
    threading.Thread(target=broker, daemon=True).start()
    ids = [myq.enqueue(spool, "reading", {"topic": "t/x", "message": {"n": i}})
           for i in range(20)]
    log = tmp_path / "w.log"
    w = start_worker(spool, "--mqtt", "mqtt://127.0.0.1:%d" % port,
                     "--timeout", "3", "--log", str(log), *FAST)
    try:
        wait_for(lambda: log.exists() and log.read_text().count("event=retry") == 20,
                 timeout=30, what="the 20 jobs put back for a retry")
    finally:
        w.terminate()
        w.wait(15)
        s.close()
    waiting = _waiting_jobs(spool)
    assert sorted(j["id"] for j in waiting) == sorted(ids)
    kept = set(os.listdir(os.path.join(spool, "locks", "batches"))
               if os.path.isdir(os.path.join(spool, "locks", "batches")) else ())
    assert [j["id"] for j in waiting if j.get("batch_of")
            and j["batch_of"] not in kept] == []        # none left alone
