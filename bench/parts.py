#!/usr/bin/env python3
"""Where a drained job's and an enqueue's time go on the SQLite store,
against the peer of the goal each misses, in the same run (issue 26: on
tmpfs, drain >= 1.2x huey, enqueue >= 1.0x persist-queue).

    python3 bench/parts.py [--runs N] [--n N] [--shm PATH]

`make bench-parts`.  A waterfall: the worker as it is (what bench/peers.py
measures), then the same drain with one more of its layers taken out at each
step, down to a loop that does nothing but what a claim and a success are
(the store's statements, a token and a lease, the payload read, the
handler, the done line, the write-ahead log fsync'd every 64 jobs), and the
statements alone (bench/peers.py's sql-floor).  Every step past the first
is a measurement, not a way to run myq: what it takes out is a guarantee
or a feature (myq(1)), so the tests would fail on it.

    worker             Worker(spool, handlers={"noop": fn}).run(drain=True)
    - scheduler        its claim is the lane's cached head, claimed: no lanes
                       to learn, no holds, gates or probes, no per-claim
                       heartbeat check
    - run layers       a claimed job is called, completed and logged: no
                       handler resolution, policy, breaker, _Run, time
                       limit, or finish dispatch
    - admission        no due time, idempotency, expiry or lane check
    - validation       the row is not checked (normalize)
    bare loop          the store's statements and the least around them
                       (above), in a loop over the ready ids: no worker
    statements alone   the claim and success statements only
    huey               task = huey.dequeue(); huey.execute(task)

The enqueue, the same way (durable single enqueues, synchronous=FULL):

    enqueue            Spool(dir).enqueue("noop", {"n": i}, sync=True)
    bare insert        the type checked, an id, the payload's JSON, the
                       INSERT: no disk guard, no size, no worker woken
    statement alone    the INSERT only
    persist-queue      SQLiteAckQueue(dir).put({"n": i})

Each in a fresh child of bench/.venv-peers' python (bench/peers.py makes it:
huey is not myq's), on a tmpfs spool of --n jobs (enqueue_many, then
os.sync()); the time is taken from the opened queue to the last job.  The
order rotates from run to run; medians of --runs.  bench/README.md keeps a
run and what it says.
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
sys.path.insert(0, HERE)
import peers    # noqa: E402  (the venv and the children's environment)

STEPS = ("worker", "- scheduler", "- run layers", "- admission",
         "- validation", "bare loop", "statements alone", "huey")
ENQ_STEPS = ("enqueue", "bare insert", "statement alone", "persist-queue")


def _ablate(myq, k):
    """Take out the first k layers of the worker (STEPS[1:k+1])."""
    S, R = myq._Scheduler, myq._Runner
    if k >= 1:
        general = S._next_claim

        def _next_claim(self, force=False):
            L = self._top
            if len(self._lanes) == 1 and L.cache:
                m, name, scheduled = L.cache[-1]
                if name and m <= myq._now():
                    L.cache.pop()
                    c = self.spool.claims.claim(name, self.me, self.max_attempts,
                                                scheduled, L.sub)
                    if c is not None:
                        self._taken = (None, None, L)
                        return c
            return general(self, force)
        S._next_claim = _next_claim
    if k >= 2:
        def _start(self, c):
            self.sched._taken = (None, None, None)
            fn = self.resolver.handlers[c.job["type"]]
            t0 = myq._mono()
            job = dict(c.job)
            job["attempts"] = c.attempt
            fn(job)
            ms = int((myq._mono() - t0) * 1000)
            if self.spool.claims.complete(c):
                f = self.finish
                if not f._pending:
                    f._pending_since = myq._mono()
                f._pending += 1
                self.log.done(c.jid, c.job["type"], c.attempt, ms)
        R._start = _start
    if k >= 3:
        myq.Claims._admit = lambda self, *a: True
    if k >= 4:
        myq.normalize = lambda job, *a, **kw: job


def child_enqueue(a):
    """One of ENQ_STEPS: n durable single enqueues, synchronous=FULL."""
    n, d, step = a["n"], a["dir"], a["step"]
    if step == "persist-queue":
        enq = peers.open_queue("pq", d)[0]
    else:
        sys.path.insert(0, ROOT)
        import myq
        sp = getattr(myq, 'open_store', myq.Spool)(d)
        sp.require()
        if step == "enqueue":
            def enq(i):
                sp.enqueue("noop", {"n": i}, sync=True)
        else:
            db, name, bare = sp._db(), sp.name, step == "bare insert"
            db.execute("PRAGMA synchronous=FULL")
            now_, enc, new_id = time.time, myq._encode_value, myq._new_id

            def enq(i):
                now = now_()
                if bare:        # what the job needs: its type, id and JSON
                    myq._check_name("noop", "type")
                    pj = enc({"n": i})
                else:
                    pj = '{"n":%d}' % i
                db.execute(myq._INSERT_NEW, (new_id(now), name, "noop", pj,
                                             now, 150 + len(pj)))
    c, t = time.process_time(), time.perf_counter()
    for i in range(n):
        enq(i)
    t, c = time.perf_counter() - t, time.process_time() - c
    print(json.dumps({"t": t, "cpu": c, "n": n}))


def child(a):
    if a["step"] in ENQ_STEPS:
        return child_enqueue(a)
    n, d, step = a["n"], a["dir"], a["step"]
    done = [0]

    def handler(*args):
        done[0] += 1
    if step == "huey":
        enq, drain, done = peers.open_queue("huey", d)[:3]
        for i in range(n):
            enq(i)
        os.sync()
        c, t = time.process_time(), time.perf_counter()
        drain()
        t, c = time.perf_counter() - t, time.process_time() - c
        print(json.dumps({"t": t, "cpu": c, "n": done[0]}))
        return
    sys.path.insert(0, ROOT)
    import myq
    sp = getattr(myq, 'open_store', myq.Spool)(d)
    sp.require().enqueue_many([{"type": "noop", "payload": {"n": i}}
                               for i in range(n)])
    os.sync()
    k = STEPS.index(step)
    c, t = time.process_time(), time.perf_counter()
    if k <= 4:
        _ablate(myq, k)
        w = myq.Worker(sp, handlers={"noop": lambda job: handler()},
                       log=myq.Log(path=os.path.join(d, "worker.log")))
        w.run(drain=True)
    else:
        db = sp._db()
        db.execute("PRAGMA synchronous=NORMAL")
        ids = [r[0] for r in db.execute(
            "SELECT id FROM jobs WHERE status='ready' ORDER BY available_at, id")]
        wal = os.path.join(d, myq.DB_NAME + "-wal")
        me = myq.Identity(sp, 60.0)
        bare = step == "bare loop"
        logf = open(os.path.join(d, "worker.log"), "a")
        loads, mono, now_ = json.loads, time.monotonic, time.time
        for j, jid in enumerate(ids):
            if bare:
                tok = me.token()
                now = now_()
                pre, post = me.lease_parts(tok, now + 60)
                args = (me.wid, tok, pre, post, now + 60, jid, "incoming",
                        now + 0.5)
            else:
                tok, now = "t", now_()
                args = ("w", tok, '{"lease":{"attempt":', "}}", now + 60, jid,
                        "incoming", now + 0.5)
            row = db.execute(myq._CLAIM_RETURNING, args).fetchall()[0]
            t0 = mono()
            handler({"id": row[0], "type": row[1], "payload": loads(row[2]),
                     "attempts": row[3] + 1})
            ms = int((mono() - t0) * 1000)
            now = now_()
            db.execute(myq._SUCCESS, (row[3] + 1, now, now, jid, tok))
            if bare:
                logf.write("%s event=done id=%s type=%s attempt=%d ms=%d\n" % (
                    myq.iso(now), jid, row[1], row[3] + 1, ms))
            if j % 64 == 63:
                logf.flush()
                fd = os.open(wal, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        logf.close()
    t, c = time.perf_counter() - t, time.process_time() - c
    print(json.dumps({"t": t, "cpu": c, "n": done[0]}))


def run_step(py, step, d, n):
    if step in ("huey", "persist-queue"):
        os.makedirs(d)
    else:
        peers.prepare("myq-sqlite", d)
    p = subprocess.run([py, os.path.abspath(__file__), "_child", json.dumps(
        {"step": step, "dir": d, "n": n})], stdout=subprocess.PIPE,
        universal_newlines=True, env=peers.child_env(), cwd=ROOT, timeout=900)
    if p.returncode != 0:
        raise SystemExit("bench-parts: %s failed (exit %d)" % (step, p.returncode))
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if r["n"] != n:
        raise SystemExit("bench-parts: %s drained %d of %d jobs: it measured "
                         "something else" % (step, r["n"], n))
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--shm", default="/dev/shm", help="a directory on tmpfs")
    o = ap.parse_args()
    if peers.fstype(o.shm) != "tmpfs":
        raise SystemExit("bench-parts: %s is not on tmpfs" % o.shm)
    py = peers.venv_python()
    waterfall(py, o, STEPS, "huey", "drain", "1.2x")
    waterfall(py, o, ENQ_STEPS, "persist-queue", "single durable enqueue",
              "1.0x")


def waterfall(py, o, STEPS, peer, what, goal):
    us = dict((s, []) for s in STEPS)
    ratio = dict((s, []) for s in STEPS)
    for r in range(o.runs):
        base = tempfile.mkdtemp(prefix="myq-parts-", dir=o.shm)
        try:
            order = STEPS[r % len(STEPS):] + STEPS[:r % len(STEPS)]
            got = {}
            for s in order:
                got[s] = run_step(py, s, os.path.join(base, s.replace(" ", "_")),
                                  o.n)["t"] / o.n * 1e6
                shutil.rmtree(os.path.join(base, s.replace(" ", "_")))
            for s in STEPS:         # (the ratio within the run)
                us[s].append(got[s])
                ratio[s].append(got[peer] / got[s])
            sys.stderr.write("bench-parts: %s, run %d of %d: %s\n" % (
                what, r + 1, o.runs, ", ".join("%s %.1f" % (s, got[s])
                                               for s in STEPS)))
            sys.stderr.flush()
        finally:
            shutil.rmtree(base, ignore_errors=True)
    print("\nSQLite store, %s on tmpfs, N=%d, medians of %d (load %.1f)"
          % (what, o.n, o.runs, os.getloadavg()[0]))
    print("%-18s %10s %10s  %s" % ("", "us/job", "jobs/s", "x %s (goal %s)" % (
        peer, goal)))
    for s in STEPS:
        m = statistics.median(us[s])
        print("%-18s %10.1f %10s  %.2fx (%.2f-%.2f)" % (
            s, m, "{:,}".format(int(1e6 / m)), statistics.median(ratio[s]),
            min(ratio[s]), max(ratio[s])))


if __name__ == "__main__":
    if sys.argv[1:2] == ["_child"]:
        child(json.loads(sys.argv[2]))
    else:
        main()
