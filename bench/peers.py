#!/usr/bin/env python3
"""myq side by side with the SQLite-backed queues a user would pick instead
(issue 15): huey 3.5 (SqliteHuey, fsync=True) and persist-queue 1.1
(SQLiteAckQueue), with the bare syscall loop of bench/run.py as the floor;
and myq's own SQLite store (issue 26, "myq-sqlite") beside all of them.

    python3 bench/peers.py [--quick] [--runs N] [--dir PATH] [--shm PATH]
                           [--n-mem N] [--n-disk N] [--n-depth N]
                           [--baseline DIR] [--queues Q,Q]
                           [--skip rates,wear,cpu]
                           [--json FILE]

`make bench` runs it after bench/run.py (`make bench-peers` alone).  myq's
runtime stays standard library only: the peers live in a bench-only venv,
bench/.venv-peers, that this script makes (python3 -m venv + pip install)
with the interpreter that runs it; every measurement runs in a fresh child
of that venv's python (the same interpreter binary, for myq too).

The same workload for every queue, in a fresh directory each time, a no-op
handler, the payload {"n": i}:

- enqueue: N durable enqueues, one at a time, in one process.
    myq           Spool(dir).enqueue("noop", {"n": i})          (sync=True)
    myq-sqlite    the same on a spool made by Spool(dir).init(store="sqlite")
                  (`myq init --store sqlite`: Spool(dir) is a SqlStore;
                  queue.db in WAL, synchronous=FULL for an enqueue)
    huey          SqliteHuey(filename=..., fsync=True, immediate=False);
                  calling the @huey.task() enqueues it
    persist-queue SQLiteAckQueue(dir).put({"n": i})  (WAL, synchronous=FULL,
                  set explicitly; it is SQLite's default too)
    floor         run.floor_enqueue: create in tmp/, write, rename into
                  incoming/, fsync, close, fsync incoming/
    sql-floor     the SQLite store's INSERT of the usual enqueue alone, on
                  its own connection (synchronous=FULL): what no Python
                  above the store's schema and statements can beat
- drain: in another process (as a consumer is), after os.sync(), until the
  queue is empty.
    myq           Worker(dir, handlers={"noop": fn}).run(drain=True), its log
                  in a file on the same filesystem
    myq-sqlite    the same (claims and successes commit with
                  synchronous=NORMAL; the worker's group commit fsyncs the
                  WAL)
    huey          the consumer's own loop without its threads:
                  task = huey.dequeue(); huey.execute(task)
    persist-queue item = q.get(block=False, raw=True); fn(item["data"]);
                  q.ack(id=item["pqid"])
    floor         run.floor_drain: rename into processing/, read, rename into
                  done/, fsync done/ every 64 jobs
    sql-floor     the store's claim (UPDATE ... RETURNING) and success
                  (UPDATE) of each ready row alone, NORMAL, the log
                  fsync'd every 64 jobs; each goal line of the SQLite
                  store says where this floor stands against the peer
  The time is taken inside the child from the opened queue to the last job,
  so the interpreter's start and the imports are not in it.
- on tmpfs (N=20,000) and on a disk (ext4, N=2,000), --runs runs (medians);
  in each run every queue is measured once, in an order that rotates from
  run to run, and the ratio myq/peer is taken within the run (a second
  table: myq-sqlite/peer and myq-sqlite/myq, the same way).  Each rate
  also per CPU second (the child's user + system time over the same loop;
  the floor's enqueue is not timed so): steadier where the machine is
  shared.
- depth (issue 25): 5,000 enqueues (--n-depth) into a tmpfs queue already
  1,000 and 100,000 deep (filled by enqueue_many in the same child first),
  myq, myq-sqlite and the baseline only.
- --baseline DIR: another myq.py (e.g. `git show main:myq.py >
  DIR/myq.py`) measured as the queue "base" (myq@base) in every step, in
  the same runs: before and after a change, side by side; and as
  "base-sqlite" (sqlite@base), its SQLite store, beside myq-sqlite.
  --queues Q,Q: those queues alone (e.g. myq-sqlite,base-sqlite,pq).
- wear: bytes the block device is asked to write per durable job (enqueue +
  drain, N=2,000), on 1 KiB blocks (a 256 MiB image, as mkfs.ext4 formats
  one that small) and on 4 KiB blocks (512 MiB: every eMMC or SD card
  filesystem); `make bench-wear` alone: a fresh ext4 image on a loop device for every queue
  (mkfs.ext4 with no lazy init, so no background writes), the sectors
  written from /sys/block/loopN/stat, read after mount and after umount
  (which flushes data and journal); and the journal's commits during the
  enqueues (/proc/fs/jbd2/loopN-8/info), per job.  Once more for myq with
  Spool.enqueue_many, 100 jobs a call ("myq-batch", and "myq-sqlite-batch"
  for the SQLite store: its enqueue bytes and commits a batch, printed
  below the table).  Needs root (losetup, mount); skipped
  with a message otherwise.
- instructions per job (valgrind --tool=callgrind, whole process, every
  thread): N=500 enqueues or drained jobs minus the same program with N=0,
  divided by N; PYTHONHASHSEED=0, byte code cached first, and myq's
  worker on a clock that moves 1 us a reading (its timers would otherwise
  fire by how slow valgrind is).  myq's (both stores) and the floor's by
  default, the peers' with --cpu-queues all (bench/README.md keeps them).  This is
  deterministic, unlike the rates: reruns, on any load, agree to within
  0.1% (enqueue) and 0.5% (drain: the job ids and timestamps differ, and
  the worker's SIGALRM tick runs on real time); bench/README.md tracks it,
  so that a change that costs CPU shows.
  Skipped with a message when valgrind is missing (apt-get install valgrind).
  perf stat -e instructions would do too where the machine exposes the
  counter (a VM often does not: "<not supported>").

The goals (printed below the tables where measured): issue 25's for myq's
files, and issue 26's for the SQLite store: enqueue and drain on tmpfs >=
1.2x huey and >= 1.0x persist-queue; a single durable enqueue on the disk
>= 1.0x huey and persist-queue; drain on the disk >= 1.2x huey; bytes
written per job <= huey's (1 KiB and 4 KiB blocks); flat from 1,000 to
100,000 queued (>= 0.95x).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VENV = os.path.join(HERE, ".venv-peers")
PKGS = ["huey>=3.5,<3.6", "persist-queue>=1.1,<1.2"]
QUEUES = ("floor", "myq", "myq-sqlite", "sql-floor", "huey", "pq")
MYQS = ("myq", "myq-sqlite", "base", "base-sqlite")    # the queues that are myq
LABEL = {"floor": "bare syscall floor", "myq": "myq", "huey": "huey (SqliteHuey)",
         "pq": "persist-queue (SQLiteAckQueue)",
         "myq-sqlite": "myq (SQLite store)",
         "sql-floor": "the SQLite store's statements alone"}

clock = time.perf_counter
cpu = time.process_time       # this process's user + system time

# The peers' instructions per job (--cpu-queues all, N=500), shown (marked *)
# when this run does not count them and the versions are these: they change
# only with the versions.  persist-queue's drain grows with N (its get scans
# the acked rows it keeps).
RECORDED = {
    "versions": {"python": "3.11.7", "huey": "3.5.4", "persist-queue": "1.1.0",
                 "sqlite": "3.40.1"},
    "n": 500,
    ("huey", "enqueue"): 140852, ("huey", "drain"): 286849,
    ("pq", "enqueue"): 80789, ("pq", "drain"): 271982,
}


def log(msg):
    sys.stderr.write("bench-peers: %s\n" % msg)
    sys.stderr.flush()


# The venv ####################################################################

def venv_python():
    """bench/.venv-peers/bin/python, made on first use with this interpreter;
    made again when the interpreter or the package list changed."""
    py = os.path.join(VENV, "bin", "python")
    stamp = os.path.join(VENV, ".stamp")
    want = "%s\n%s\n" % (os.path.realpath(sys.executable), " ".join(PKGS))
    try:
        with open(stamp) as f:
            if f.read() == want and os.path.exists(py):
                return py
    except OSError:
        pass
    log("making %s (%s)" % (VENV, ", ".join(PKGS)))
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.check_call([sys.executable, "-m", "venv", VENV])
    subprocess.check_call([py, "-m", "pip", "install", "-q",
                           "--disable-pip-version-check"] + PKGS)
    with open(stamp, "w") as f:
        f.write(want)
    return py


def versions(py):
    code = ("import importlib.metadata as m, sqlite3, platform\n"
            "print(platform.python_version(), m.version('huey'), "
            "m.version('persist-queue'), sqlite3.sqlite_version)")
    out = subprocess.run([py, "-c", code], stdout=subprocess.PIPE,
                         universal_newlines=True).stdout.split()
    return dict(zip(("python", "huey", "persist-queue", "sqlite"), out))


# The children: python bench/peers.py _child JSON ##############################
# One queue, one operation, in a fresh process of the venv's python.

PYCACHE = os.path.join(tempfile.gettempdir(), "myq-peers-pycache")


def child_env():
    """No MYQ_* nor PYTHONPATH; a fixed hash seed; byte code cached (under
    PYCACHE, outside the tree) even where PYTHONDONTWRITEBYTECODE is set:
    else every child, valgrind's too, compiles myq.py first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYQ_")}
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = PYCACHE
    env["PYTHONHASHSEED"] = "0"
    return env


def _run_module():
    sys.path.insert(0, HERE)
    import run
    return run


def open_queue(q, d, fake_clock=False, base=None):
    """(enqueue fn, drain fn, handler counter list[, floor enqueue loop]).
    q "base": myq, imported from the directory `base` (--baseline: the
    code before a change, measured in the same run)."""
    done = [0]

    def handler(*a, **k):
        done[0] += 1

    if q in MYQS:
        sys.path.insert(0, base if q.startswith("base") else ROOT)
        import myq
        sp = getattr(myq, 'open_store', myq.Spool)(d)
        sp.require()
        if q in ("myq-sqlite", "base-sqlite"):
            assert sp.store == "sqlite", sp.store
        if fake_clock:
            # For the instruction count: the worker's timers (group commit
            # after 1 s, prune after 5 s, ...) run on myq._mono; under
            # valgrind, 50 times slower, they would fire where a real run
            # fires none, and by how slow the machine is.  This clock
            # moves 1 us a reading: what a real drain of N jobs sees.
            tick = [time.monotonic()]

            def mono():
                tick[0] += 1e-6
                return tick[0]
            myq._mono = mono

        def enq(i):
            sp.enqueue("noop", {"n": i}, sync=True)

        def drain():
            w = myq.Worker(sp, handlers={"noop": lambda job: handler()},
                           log=myq.Log(path=os.path.join(d, "worker.log")))
            w.run(drain=True)

        def many(first, k):
            sp.enqueue_many([{"type": "noop", "payload": {"n": i}}
                             for i in range(first, first + k)])
        return enq, drain, done, many
    if q == "huey":
        from huey import SqliteHuey
        h = SqliteHuey("bench", filename=os.path.join(d, "huey.db"),
                       fsync=True, immediate=False)
        noop = h.task(name="noop")(handler)
        assert h.storage.conn.execute("pragma synchronous").fetchone()[0] == 2

        def enq(i):
            noop(i)

        def drain():
            while True:
                task = h.dequeue()
                if task is None:
                    return
                h.execute(task)
        return enq, drain, done
    if q == "pq":
        from persistqueue import SQLiteAckQueue
        from persistqueue.exceptions import Empty
        pq = SQLiteAckQueue(d)
        for conn in {id(c): c for c in (pq._getter, pq._putter)}.values():
            conn.execute("PRAGMA synchronous=FULL")
            assert conn.execute("pragma journal_mode").fetchone()[0] == "wal"

        def enq(i):
            pq.put({"n": i})

        def drain():
            while True:
                try:
                    item = pq.get(block=False, raw=True)
                except Empty:
                    return
                handler(item["data"])
                pq.ack(id=item["pqid"])
        return enq, drain, done
    if q == "sql-floor":
        # The SQLite store's own statements and nothing else, on a spool of
        # the store (its connection: page size, WAL, indexes, synchronous as
        # the store sets them): an enqueue is the usual one's INSERT (FULL),
        # a drain each ready row's claim (UPDATE ... RETURNING) and success
        # (UPDATE), both NORMAL, the log fsync'd every 64 jobs as the
        # worker's group commit does.  What no Python above it can beat.
        sys.path.insert(0, ROOT)
        import myq
        sp = getattr(myq, 'open_store', myq.Spool)(d)
        sp.require()
        assert sp.store == "sqlite", sp.store
        db, name = sp._db(), sp.name

        def enq(i):
            now = time.time()
            pj = '{"n":%d}' % i
            db.execute(myq._INSERT_NEW, (myq._new_id(now), name, "noop", pj,
                                         now, 150 + len(pj)))

        def drain():
            db.execute("PRAGMA synchronous=NORMAL")
            ids = [r[0] for r in db.execute(
                "SELECT id FROM jobs WHERE status='ready' ORDER BY available_at")]
            wal = os.path.join(d, myq.DB_NAME + "-wal")
            for k, jid in enumerate(ids):
                now = time.time()
                row = db.execute(myq._CLAIM_RETURNING, (
                    "w", "t", '{"lease":{"attempt":', "}}", now + 60, jid,
                    "incoming", now + 0.5)).fetchall()[0]
                handler(json.loads(row[2]))
                db.execute(myq._SUCCESS, (1, now, now, jid, "t"))
                if k % 64 == 63:
                    fd = os.open(wal, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
        return enq, drain, done
    if q == "floor":
        run = _run_module()
        sys.path.insert(0, ROOT)
        import myq
        data = myq.dumps(myq.new_job("noop", {"n": 1}))
        state = {}

        def enq(i):     # batched below: the floor loop is one call
            state["n"] = state.get("n", 0) + 1

        def drain():
            k, _ = run.floor_drain(d)
            done[0] += k
        return (enq, drain, done, lambda n: run.floor_enqueue(d, n, data))
    raise SystemExit("unknown queue %s" % q)


def child(a):
    q, op, d, n = a["q"], a["op"], a["dir"], a["n"]
    got = open_queue(q, d, a.get("fake_clock"), a.get("base"))
    if a.get("prefill"):            # (myq, base, myq-sqlite: this deep first)
        got[3](10 ** 9, a["prefill"])
    enq, drain, done = got[:3]
    if a.get("cprofile"):           # --cprofile: the timed loop alone
        import cProfile
        prof = cProfile.Profile()
        if op == "enqueue":
            def drain(enq=enq):
                for i in range(n):
                    enq(i)
            op = "drain"            # (timed and counted as one loop below)
            done[0] = n
        inner = drain

        def drain():
            prof.runcall(inner)
            prof.dump_stats(a["cprofile"])
    if op == "enqueue":
        if q == "floor":
            t = got[3](n) if n else 0.0
        elif a.get("batch"):            # myq: Spool.enqueue_many
            b = a["batch"]
            c, t = cpu(), clock()
            for k in range(0, n, b):
                got[3](k, min(b, n - k))
            t, c = clock() - t, cpu() - c
        else:
            c, t = cpu(), clock()
            for i in range(n):
                enq(i)
            t, c = clock() - t, cpu() - c
        out = {"n": n, "t": t, "cpu": c if q != "floor" else None}
    else:
        c, t = cpu(), clock()
        drain()
        t, c = clock() - t, cpu() - c
        out = {"n": done[0], "t": t, "cpu": c}
    sys.stdout.write(json.dumps(out) + "\n")


def prepare(q, d):
    """A fresh, empty queue directory (myq's layout for myq and the floor;
    myq-sqlite: `myq init --store sqlite`)."""
    os.makedirs(d)
    if q in ("myq-sqlite", "sql-floor", "base-sqlite"):
        # In a child: init(store="sqlite") leaves a descriptor of the spool
        # open in its process, which would keep the wear step's loop
        # device busy at its umount.
        subprocess.check_call([sys.executable, "-c", "import sys; "
                               "sys.path.insert(0, sys.argv[1]); import myq; "
                               "getattr(myq, 'open_store', myq.Spool)(sys.argv[2]).init(store='sqlite')",
                               ROOT, d], env=child_env())
    elif q in ("myq", "floor", "base"):
        sys.path.insert(0, ROOT)
        import myq
        getattr(myq, 'open_store', myq.Spool)(d).init()


BASE = []      # [the directory of the baseline's myq.py] with --baseline


def run_child(py, a, wrap=(), timeout=900):
    if a["q"].startswith("base"):
        a = dict(a, base=BASE[0])
    p = subprocess.run(list(wrap) + [py, os.path.abspath(__file__), "_child",
                                     json.dumps(a)],
                       stdout=subprocess.PIPE, universal_newlines=True,
                       env=child_env(), cwd=ROOT, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError("%s %s failed (exit %d)" % (a["q"], a["op"], p.returncode))
    return json.loads(p.stdout.strip().splitlines()[-1])


def enqueue_drain(py, q, d, n):
    """Fresh queue at d; n enqueues in one child, os.sync(), drain in
    another.  Returns (enqueue/s, drain/s, enqueue/CPU-s, drain/CPU-s);
    the floor's enqueue CPU is not measured (None)."""
    prepare(q, d)
    e = run_child(py, {"q": q, "op": "enqueue", "dir": d, "n": n})
    os.sync()       # no writeback of the enqueues left for the drain to pay
    r = run_child(py, {"q": q, "op": "drain", "dir": d, "n": n})
    if r["n"] != n:
        raise RuntimeError("%s drained %d of %d jobs" % (q, r["n"], n))
    os.sync()
    return (n / e["t"], n / r["t"], e["cpu"] and n / e["cpu"],
            r["cpu"] and n / r["cpu"])


DEPTHS = (1000, 100000)


def depth(py, o, res, r):
    """Enqueues into a queue already DEPTHS deep (tmpfs, myq, myq-sqlite and
    the baseline): the create and rename in a directory of 100,000 entries
    against one of 1,000 (myq-sqlite: an insert into a table and index of
    100,000 rows against 1,000)."""
    qs = [q for q in o.queues if q in MYQS]
    n = o.n_depth
    for k in DEPTHS:
        for q in (qs if r % 2 else qs[::-1]):
            d = tempfile.mkdtemp(prefix="myq-peers-depth-", dir=o.shm)
            try:
                prepare(q, os.path.join(d, q))
                e = run_child(py, {"q": q, "op": "enqueue", "n": n,
                                   "dir": os.path.join(d, q), "prefill": k})
                res.setdefault(("depth%d" % k, "enqueue", q), []).append(n / e["t"])
                res.setdefault(("depth%d" % k, "enqueue-cpu", q), []).append(
                    n / e["cpu"])
            finally:
                shutil.rmtree(d, ignore_errors=True)


# Throughput ##################################################################

def fstype(path):
    path = os.path.realpath(path)
    best = ("?", "")
    with open("/proc/self/mounts") as f:
        for line in f:
            dev, mnt, typ = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) \
                    and len(mnt) >= len(best[1]):
                best = (typ, mnt)
    return best[0]


def throughput(py, o, res):
    qs = o.queues
    for r in range(o.runs):
        if o.n_depth and "tmpfs" in [t[0] for t in o.targets]:
            depth(py, o, res, r)
        for fs, path, n in o.targets:
            base = tempfile.mkdtemp(prefix="myq-peers-", dir=path)
            try:
                order = list(qs[r % len(qs):] + qs[:r % len(qs)])
                t0 = time.monotonic()
                for q in order:
                    got = enqueue_drain(py, q, os.path.join(base, q), n)
                    for op, v in zip(("enqueue", "drain", "enqueue-cpu",
                                      "drain-cpu"), got):
                        if v is not None:
                            res.setdefault((fs, op, q), []).append(v)
                log("run %d/%d on %s (N=%d): %.0f s" % (r + 1, o.runs, fs, n,
                                                        time.monotonic() - t0))
            finally:
                shutil.rmtree(base, ignore_errors=True)


# Wear: bytes written to the device ############################################

def commits(dev):
    """Journal commits of the ext4 on `dev` so far (jbd2), or None."""
    try:
        with open("/proc/fs/jbd2/%s-8/info" % os.path.basename(dev)) as f:
            return int(f.readline().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def sectors_written(dev):
    with open("/sys/block/%s/stat" % os.path.basename(dev)) as f:
        return int(f.read().split()[6])


WEAR_FS = (("1k", 1024, 256), ("4k", 4096, 512))   # (key, block size, MiB)
BATCHES = ("myq-batch", "myq-sqlite-batch")         # enqueue_many, 100 a call


def wear(py, o, res):
    if os.geteuid() != 0:
        return "skipped: needs root (losetup, mount)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if not shutil.which(tool):
            return "skipped: %s not found" % tool
    for key, bs, mib in WEAR_FS:
        wear_on(py, o, res, key, bs, mib)
    return ("ext4 on a loop device, fresh mkfs per queue: %s; N=%d" % (
        ", ".join("%d-byte blocks in %d MiB (wear%s)" % (bs, mib, key)
                  for key, bs, mib in WEAR_FS), o.n_wear))


def mkfs(dev, bs):
    """mkfs.ext4 on `dev`; again while the device is still busy from the
    last umount (its journal thread ends a moment later)."""
    for i in range(50):
        p = subprocess.run(["mkfs.ext4", "-q", "-F", "-b", str(bs), "-E",
                            "lazy_itable_init=0,lazy_journal_init=0", dev],
                           stderr=subprocess.PIPE, universal_newlines=True)
        if p.returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError("mkfs.ext4 %s: %s" % (dev, p.stderr.strip()))


def wear_on(py, o, res, key, bs, mib):
    """Every queue on a fresh image and loop device of its own (a device
    used again was at times still busy after the umount)."""
    work = tempfile.mkdtemp(prefix="myq-peers-wear-", dir=o.dir)
    try:
        for q in [q for q in o.queues if q != "sql-floor"] + list(BATCHES):
            img = os.path.join(work, q + ".img")
            with open(img, "wb") as f:
                f.truncate(mib << 20)
            dev = subprocess.check_output(["losetup", "-f", "--show", img],
                                          universal_newlines=True).strip()
            try:
                mkfs(dev, bs)
                wear_one(py, o, res, key, q, dev, os.path.join(work, "mnt"))
            finally:
                subprocess.call(["losetup", "-d", dev])
                os.unlink(img)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def wear_one(py, o, res, key, q, dev, mnt):
    n, w = o.n_wear, "wear" + key
    os.makedirs(mnt, exist_ok=True)
    subprocess.check_call(["mount", "-t", "ext4", dev, mnt])
    # myq-batch, myq-sqlite-batch: Spool.enqueue_many, 100 jobs a call
    a = {"q": q, "op": "enqueue", "n": n}
    if q in BATCHES:
        a.update(q=q[:-len("-batch")], batch=100)
    try:
        d = os.path.join(mnt, q)
        os.sync()
        s0 = sectors_written(dev)
        prepare(a["q"], d)
        c0 = commits(dev)
        run_child(py, dict(a, dir=d))
        c1 = commits(dev)
        os.sync()
        s1 = sectors_written(dev)
        r = run_child(py, {"q": a["q"], "op": "drain", "dir": d, "n": n})
        if r["n"] != n:
            raise RuntimeError("%s drained %d of %d" % (q, r["n"], n))
    finally:
        subprocess.check_call(["umount", mnt])
    s2 = sectors_written(dev)
    res[(w, "enqueue", q)] = [(s1 - s0) * 512.0 / n]
    res[(w, "drain", q)] = [(s2 - s1) * 512.0 / n]
    res[(w, "total", q)] = [(s2 - s0) * 512.0 / n]
    if c0 is not None:
        res[("commits" + key, "enqueue", q)] = [(c1 - c0) * 1.0 / n]
    log("wear %s, %s blocks: %.1f KB/job" % (q, key, (s2 - s0) * 0.5 / n))


# Instructions: valgrind --tool=callgrind ######################################

def callgrind(py, out, a):
    run_child(py, a, wrap=["valgrind", "--tool=callgrind", "-q",
                           "--callgrind-out-file=" + out])
    total = None
    with open(out) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                total = int(line.split()[1])
    os.unlink(out)
    return total


def instructions(py, o, res, queues):
    """Two valgrind processes at a time (the count does not depend on the
    load): every enqueue first, then every drain of what they queued."""
    from concurrent.futures import ThreadPoolExecutor
    if not shutil.which("valgrind"):
        return "skipped: valgrind not installed (apt-get install valgrind)"
    n = o.n_cpu
    base = tempfile.mkdtemp(prefix="myq-peers-cg-", dir=o.shm)
    t0 = time.monotonic()
    try:
        cases = [(q, k) for q in queues for k in (0, n)]
        got = {}
        for q in queues:    # byte code cached before any count
            d = os.path.join(base, "warm-" + q)
            prepare(q, d)
            run_child(py, {"q": q, "op": "enqueue", "dir": d, "n": 1})
            run_child(py, {"q": q, "op": "drain", "dir": d, "n": 1})
        for q, k in cases:
            prepare(q, os.path.join(base, "%s-%d" % (q, k)))
        with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as ex:
            for op in ("enqueue", "drain"):
                futs = {}
                for q, k in cases:
                    name = "%s-%d" % (q, k)
                    futs[(op, q, k)] = ex.submit(
                        callgrind, py, os.path.join(base, "%s.%s.cg" % (name, op)),
                        {"q": q, "op": op, "dir": os.path.join(base, name), "n": k,
                         "fake_clock": True})
                for key, f in futs.items():
                    got[key] = f.result()
        for q in queues:
            for op in ("enqueue", "drain"):
                res[("cpu", op, q)] = [(got[(op, q, n)] - got[(op, q, 0)]) / float(n)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    log("callgrind: %.0f s" % (time.monotonic() - t0))
    return "valgrind --tool=callgrind, N=%d minus N=0, tmpfs, PYTHONHASHSEED=0" % n


# The table ###################################################################

def fmt(v):
    if v is None:
        return "-"
    if v >= 100:
        return "{:,.0f}".format(v)
    return "%.1f" % v


def peers_of(o, me="myq"):
    """Whom `me` is compared with: myq (files) with the peers and the
    baseline; myq-sqlite with the peers and myq (files)."""
    if me == "myq-sqlite":
        return tuple(q for q in ("huey", "pq", "myq", "base-sqlite")
                     if q in o.queues)
    return ("huey", "pq") + (("base",) if "base" in o.queues else ())


def ratio(res, key, me, peer):
    """The median of me/peer, the ratio taken run by run, or None."""
    m, p = res.get(key + (me,)), res.get(key + (peer,))
    if not m or not p:
        return None
    return statistics.median([a / b for a, b in zip(m, p)])


def ratio_cells(res, key, o, me="myq"):
    """Medians of me/peer, the ratio taken run by run."""
    out = []
    for peer in peers_of(o, me):
        m, p = res.get(key + (me,)), res.get(key + (peer,))
        if not m or not p:
            out.append("-")
            continue
        rs = [a / b for a, b in zip(m, p)]
        s = "%.2fx" % statistics.median(rs)
        if len(rs) > 1:
            s += " (%.2f-%.2f)" % (min(rs), max(rs))
        out.append(s)
    return out


def report(res, o, info, notes):
    rows = []
    for fs, _, n in o.targets:
        for op in ("enqueue", "drain"):
            rows.append(("%s/s %s (N=%s)" % (op, fs, "{:,}".format(n)), (fs, op)))
            rows.append(("  per CPU second", (fs, op + "-cpu")))
    for k in DEPTHS:
        rows.append(("enqueue/s tmpfs, %s queued (N=%s)" % (
            "{:,}".format(k), "{:,}".format(o.n_depth)), ("depth%d" % k, "enqueue")))
        rows.append(("  per CPU second", ("depth%d" % k, "enqueue-cpu")))
    for key, bs, mib in WEAR_FS:
        for op, label in (("total", "KB to disk/job, enqueue+drain (ext4 %s)" % key),
                          ("enqueue", "  of which enqueue"),
                          ("drain", "  of which drain")):
            rows.append((label, ("wear" + key, op)))
        rows.append(("journal commits/job, enqueue (ext4 %s)" % key,
                     ("commits" + key, "enqueue")))
    for op in ("enqueue", "drain"):
        rows.append(("instructions/job, %s (callgrind)" % op, ("cpu", op)))
    names = {"floor": "floor", "myq": "myq", "huey": "huey", "pq": "persist-queue",
             "base": "myq@base", "myq-sqlite": "myq-sqlite",
             "base-sqlite": "sqlite@base",
             "sql-floor": "sql-floor"}
    head = ["metric"] + [names[q] for q in o.queues] + [
        "myq/" + names[p] for p in peers_of(o)]
    rows = [(label, key) for label, key in rows
            if any(res.get(key + (q,)) for q in o.queues)]
    lines = []
    for label, key in rows:
        cells = [label]
        for q in o.queues:
            v = res.get(key + (q,))
            if v is None:
                cells.append("-")
            else:
                v = statistics.median(v)
                if key[0].startswith("wear"):
                    cells.append("%.2f" % (v / 1024.0))
                elif key[0].startswith("commits"):
                    cells.append("%.3f" % v)
                else:
                    cells.append(fmt(v) + ("*" if key + (q,) in o.recorded else ""))
        cells += ratio_cells(res, key, o)
        lines.append(cells)
    widths = [max(len(c[i]) for c in lines + [head]) for i in range(len(head))]
    out = ["myq side by side with its SQLite-backed peers  %s  runs=%d" % (
        info["date"], o.runs),
        "Python %(python)s, huey %(huey)s, persist-queue %(persist-queue)s, "
        "SQLite %(sqlite)s; durable settings (fsync / synchronous=FULL)" % info,
        "load average at start %s, at end %s" % (info["load0"], info["load1"]),
        "rates: medians over runs, jobs/s, higher is better; ratios myq/peer "
        "taken within each run (median, range); KB and instructions: lower is "
        "better, so a ratio < 1 favours myq there", ""]
    if BASE:
        out.insert(3, "myq@base: myq.py of %s (--baseline), measured in the "
                   "same runs" % BASE[0])
    out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    out.append("-" * len(out[-1]))
    for c in lines:
        out.append("  ".join(x.ljust(w) for x, w in zip(c, widths)))
    out.append("")
    if "myq-sqlite" in o.queues:
        # The SQLite store against the peers and against myq's files, the
        # same rows (its own figures are in the myq-sqlite column above).
        head = ["myq-sqlite (SQLite store) against"] + [
            "sqlite/" + names[p] for p in peers_of(o, "myq-sqlite")]
        lines = [[label] + ratio_cells(res, key, o, "myq-sqlite")
                 for label, key in rows if res.get(key + ("myq-sqlite",))]
        widths = [max(len(c[i]) for c in lines + [head]) for i in range(len(head))]
        out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        out.append("-" * len(out[-1]))
        for c in lines:
            out.append("  ".join(x.ljust(w) for x, w in zip(c, widths)))
        out.append("")
    for k, v in notes.items():
        out.append("%s: %s" % (k, v))
    for key, _, _ in WEAR_FS:
        for q in BATCHES:
            b = res.get(("wear" + key, "enqueue", q))
            if b:
                c = res.get(("commits" + key, "enqueue", q))
                out.append("wear %s, %s enqueue_many (100 a call): %.2f KB/job "
                           "to enqueue%s" % (
                               key, q[:-len("-batch")], b[0] / 1024.0,
                               ", %.2f journal commits a batch" % (c[0] * 100)
                               if c else ""))
    goals = check_goals(res, o)
    if goals:
        out.append("")
        out.extend(goals)
    return "\n".join(out)


def check_goals(res, o):
    """Issue 25's goals (and 15's that still hold), and issue 26's for the
    SQLite store, where measured."""
    goals = []
    disk = [fs for fs, _, _ in o.targets if fs != "tmpfs"]
    d = disk[0] if disk else "ext4"
    for me, text, key, peer, want, higher in SQL_GOALS(d) if \
            "myq-sqlite" in o.queues else ():
        x = ratio(res, key, me, peer)
        if x is None:
            continue
        ok = x >= want if higher else x <= want
        f = ratio(res, key, "sql-floor", peer)
        goals.append("goal %-48s %.2fx  %s%s" % (
            text + ":", x, "pass" if ok else "MISS",
            "  (its statements alone: %.2fx)" % f if f is not None else ""))

    def r(key, peer):
        return ratio(res, key, "myq", peer)
    for text, key, peer, want, higher in (
            ("tmpfs enqueue >= 0.95x huey", ("tmpfs", "enqueue"), "huey", 0.95, True),
            ("  per CPU second", ("tmpfs", "enqueue-cpu"), "huey", 0.95, True),
            ("tmpfs drain >= 1.0x huey", ("tmpfs", "drain"), "huey", 1.0, True),
            ("  per CPU second", ("tmpfs", "drain-cpu"), "huey", 1.0, True),
            ("%s drain >= huey" % d, (d, "drain"), "huey", 1.0, True),
            ("bytes/job <= huey, 1 KiB blocks", ("wear1k", "total"), "huey", 1.0,
             False),
            ("bytes/job <= huey, 4 KiB blocks", ("wear4k", "total"), "huey", 1.0,
             False)):
        x = r(key, peer)
        if x is None:
            continue
        ok = x >= want if higher else x <= want
        goals.append("goal %-48s %.2fx  %s" % (text + ":", x, "pass" if ok else "MISS"))
    for q in [q for q in MYQS if q in o.queues]:
        for op in ("enqueue", "enqueue-cpu"):
            a = res.get(("depth%d" % DEPTHS[1], op, q))
            b = res.get(("depth%d" % DEPTHS[0], op, q))
            if a and b:
                x = statistics.median([i / j for i, j in zip(a, b)])
                goals.append("goal %-48s %.2fx  %s" % (
                    "%s 100k queued >= 0.95x 1k%s:" % (
                        q, " (CPU)" if op.endswith("cpu") else ""),
                    x, "pass" if x >= 0.95 else "MISS"))
    for key, _, _ in WEAR_FS:
        for text, q, k in (("commits/single enqueue <= 1", "myq", 1),
                           ("commits/enqueue_many(100) <= 1", "myq-batch", 100)):
            c = res.get(("commits" + key, "enqueue", q))
            if c:
                goals.append("goal %-48s %.2f   %s" % (
                    "%s (%s):" % (text, key), c[0] * k,
                    "pass" if c[0] * k <= 1.0 else "MISS"))
    return goals


def SQL_GOALS(d):
    """Issue 26's goals for the SQLite store (me, text, key, peer, want,
    higher is better); d: the disk's filesystem type."""
    s = "myq-sqlite"
    return (
        (s, "sqlite tmpfs enqueue >= 1.2x huey", ("tmpfs", "enqueue"), "huey", 1.2, True),
        (s, "  per CPU second", ("tmpfs", "enqueue-cpu"), "huey", 1.2, True),
        (s, "sqlite tmpfs enqueue >= 1.0x persist-queue", ("tmpfs", "enqueue"), "pq",
         1.0, True),
        (s, "  per CPU second", ("tmpfs", "enqueue-cpu"), "pq", 1.0, True),
        (s, "sqlite tmpfs drain >= 1.2x huey", ("tmpfs", "drain"), "huey", 1.2, True),
        (s, "  per CPU second", ("tmpfs", "drain-cpu"), "huey", 1.2, True),
        (s, "sqlite tmpfs drain >= 1.0x persist-queue", ("tmpfs", "drain"), "pq",
         1.0, True),
        (s, "  per CPU second", ("tmpfs", "drain-cpu"), "pq", 1.0, True),
        (s, "sqlite %s single enqueue >= 1.0x huey" % d, (d, "enqueue"), "huey",
         1.0, True),
        (s, "sqlite %s single enqueue >= 1.0x persist-queue" % d, (d, "enqueue"),
         "pq", 1.0, True),
        (s, "sqlite %s drain >= 1.2x huey" % d, (d, "drain"), "huey", 1.2, True),
        (s, "sqlite bytes/job <= huey, 1 KiB blocks", ("wear1k", "total"), "huey",
         1.0, False),
        (s, "sqlite bytes/job <= huey, 4 KiB blocks", ("wear4k", "total"), "huey",
         1.0, False))


def cprofile(py, o):
    """--cprofile DIR: each queue's enqueue of --n-mem jobs and their drain,
    one child each on tmpfs under cProfile (the timed loop alone), the
    stats in DIR and their top printed, by own time and by cumulative."""
    import io
    import pstats
    os.makedirs(o.cprofile, exist_ok=True)
    base = tempfile.mkdtemp(prefix="myq-peers-prof-", dir=o.shm)
    try:
        for q in o.cprofile_queues.split(","):
            d = os.path.join(base, q)
            prepare(q, d)
            for op in ("enqueue", "drain"):
                out = os.path.abspath(os.path.join(o.cprofile, "%s.%s.pstats" % (q, op)))
                r = run_child(py, {"q": q, "op": op, "dir": d, "n": o.n_mem,
                                   "cprofile": out})
                s = io.StringIO()
                st = pstats.Stats(out, stream=s)
                st.sort_stats("tottime").print_stats(20)
                st.sort_stats("cumulative").print_stats(25)
                sys.stdout.write("%s %s: %d jobs, %.2f s under cProfile (%s)\n%s\n" % (
                    q, op, r["n"], r["t"], out, s.getvalue()))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        return child(json.loads(argv[1]))
    ap = argparse.ArgumentParser(description="myq against huey and persist-queue "
                                 "(see the docstring)")
    ap.add_argument("--quick", action="store_true",
                    help="N/10 (tmpfs 2,000, disk 200, wear 200, cpu 100)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", help="a directory on a disk (default /var/tmp)")
    ap.add_argument("--shm", default="/dev/shm", help="a directory on tmpfs")
    ap.add_argument("--n-mem", type=int, default=20000)
    ap.add_argument("--n-disk", type=int, default=2000)
    ap.add_argument("--n-wear", type=int, default=2000)
    ap.add_argument("--n-cpu", type=int, default=500)
    ap.add_argument("--n-depth", type=int, default=5000,
                    help="enqueues timed into a queue 1,000 and 100,000 deep "
                    "(tmpfs; 0: not measured)")
    ap.add_argument("--baseline", metavar="DIR",
                    help="a directory holding another myq.py (e.g. main's: "
                    "git show main:myq.py > DIR/myq.py): measured as "
                    "myq@base in the same runs")
    ap.add_argument("--cpu-queues", default="floor,myq,myq-sqlite",
                    help="whose instructions to count: floor,myq,myq-sqlite,"
                    "huey,pq or "
                    "all (the peers' counts do not change unless their "
                    "versions do: bench/README.md has them; counting them "
                    "adds ~1 min)")
    ap.add_argument("--skip", default="", help="any of: rates,wear,cpu")
    ap.add_argument("--queues", dest="queues_only", metavar="Q,Q",
                    help="measure these queues alone (of floor,myq,myq-sqlite,"
                    "sql-floor,huey,pq and with --baseline base,base-sqlite)")
    ap.add_argument("--json", help="also write the raw figures here")
    ap.add_argument("--cprofile", metavar="DIR",
                    help="instead of the bench: cProfile of one child each, "
                    "enqueue and drain on tmpfs (--n-mem), of --cprofile-queues; "
                    "DIR/QUEUE.OP.pstats and the top functions printed")
    ap.add_argument("--cprofile-queues", default="myq-sqlite",
                    help="for --cprofile (default myq-sqlite; e.g. myq,myq-sqlite)")
    o = ap.parse_args(argv)
    o.recorded = set()
    if o.quick:
        o.n_mem, o.n_disk, o.n_wear, o.n_cpu = 2000, 200, 200, 100
        o.n_depth = min(o.n_depth, 1000)
    o.queues = QUEUES
    if o.baseline:
        BASE.append(os.path.abspath(o.baseline))
        if not os.path.isfile(os.path.join(BASE[0], "myq.py")):
            raise SystemExit("--baseline %s: no myq.py there" % o.baseline)
        o.queues = QUEUES + ("base", "base-sqlite")
    if o.queues_only:
        keep = o.queues_only.split(",")
        o.queues = tuple(q for q in o.queues if q in keep)
    skip = set(x for x in o.skip.split(",") if x)
    o.dir = o.dir or next((c for c in ("/var/tmp", "/tmp", ROOT)
                           if os.path.isdir(c) and fstype(c) not in
                           ("tmpfs", "ramfs", "overlay", "?")), "/var/tmp")
    o.targets = []
    if fstype(o.shm) == "tmpfs":
        o.targets.append(("tmpfs", o.shm, o.n_mem))
    else:
        log("%s is not tmpfs; skipping tmpfs" % o.shm)
    o.targets.append((fstype(o.dir), o.dir, o.n_disk))
    py = venv_python()
    if o.cprofile:
        return cprofile(py, o)
    info = versions(py)
    info["date"] = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime())
    info["load0"] = " ".join(open("/proc/loadavg").read().split()[:3])
    res, notes = {}, {}
    t0 = time.monotonic()
    if "rates" not in skip:
        throughput(py, o, res)
    notes["disk"] = "%s (%s)" % (o.dir, fstype(o.dir))
    if "wear" not in skip:
        notes["wear"] = wear(py, o, res)
    if "cpu" not in skip:
        cq = o.queues if o.cpu_queues == "all" else o.cpu_queues.split(",")
        notes["instructions"] = instructions(py, o, res, cq)
        rec = all(info.get(k) == v for k, v in RECORDED["versions"].items()) \
            and o.n_cpu == RECORDED["n"] and res.get(("cpu", "enqueue", "myq"))
        for q in ("huey", "pq"):
            if q not in cq and rec:
                for op in ("enqueue", "drain"):
                    res[("cpu", op, q)] = [RECORDED[(q, op)]]
                    o.recorded.add(("cpu", op, q))
        if o.recorded:
            notes["instructions"] += ("; * recorded (bench/peers.py RECORDED, "
                                      "same versions and N; --cpu-queues all "
                                      "counts them again)")
    info["load1"] = " ".join(open("/proc/loadavg").read().split()[:3])
    sys.stdout.write(report(res, o, info, notes) + "\n")
    sys.stdout.write("took %.0f s\n" % (time.monotonic() - t0))
    if o.json:
        with open(o.json, "w") as f:
            json.dump({"info": info, "notes": notes,
                       "data": {"/".join(k): v for k, v in res.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
