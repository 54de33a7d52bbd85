"""Chaos soak (a crash leaves each job in exactly one place; at-least-once
delivery; liveness): 2 producers, 4 `myq worker` processes
on one spool, SIGKILLs of workers and of handlers every 0.2-1 s (a killed
worker is restarted at once), at least 3000 jobs.

At the end (no more kills, the workers drained and stopped, `myq reap`, a
final `worker --drain`): every enqueued id is in exactly one of done/ and
dlq/, nothing is left in processing/ or incoming/, every done job had its
effect, and a job has a duplicate effect only if one of its runs was killed
(the test notes, for each kill, which jobs the victim was running).

The seed is printed; CHAOS_SEED=N replays the same kill schedule.
"""
import os
import random
import signal
import sys
import time

import pytest

from _core import MYQ, clean_env, ls, read_job, sql, wait_for
from _procs import Procs, children, job_of, proc_stat

PER_PRODUCER = 2500
WORKERS = 4
KILL_SECONDS = 35.0          # at most; kills stop once every job is finished
MAX_ATTEMPTS = 50

WORKER_OPTS = (
    "--concurrency", "1",    # one run per worker: one kill, one victim run
    "--lease", "5", "--poll", "0.1", "--timeout", "30",
    "--backoff-base", "0.05", "--backoff-max", "0.5", "--jitter", "0.5",
    "--max-attempts", str(MAX_ATTEMPTS), "--stats-interval", "0",
    "--keep-done-max", "1000000", "--keep-done", "86400",
)

# Producer 1: the Python API (durable enqueue).  Producer 2: what a shell
# producer does (write in tmp/, rename into incoming/, no fsync, no poke).
PRODUCER_API = r'''
import sys
sys.path.insert(0, sys.argv[1])
import myq
spool, n = sys.argv[2], int(sys.argv[3])
for i in range(n):
    myq.enqueue(spool, "work", i, id="api-%05d" % i, max_attempts=MAXA)
'''.replace("MAXA", str(MAX_ATTEMPTS))

PRODUCER_SHELL = r'''
import json, os, sys
spool, n = sys.argv[2], int(sys.argv[3])
for i in range(n):
    name = "sh-%05d" % i
    tmp = os.path.join(spool, "tmp", name + ".part")
    with open(tmp, "w") as f:
        f.write(json.dumps({"type": "work", "payload": i,
                            "max_attempts": MAXA}))
    os.rename(tmp, os.path.join(spool, "incoming", name + ".json"))
'''.replace("MAXA", str(MAX_ATTEMPTS))


def handler_body(effects):
    # The effect first, then (for 3 ids in 10) a little work: a kill during
    # that sleep leaves an effect whose run will be repeated.
    return ('printf "%%s\\n" "$MYQ_JOB_ID" >> "%s"\n'
            'case "$MYQ_JOB_ID" in *[012]) sleep 0.02;; esac\n'
            'exit 0' % effects)


def count(spool, sub):
    return sum(1 for n in ls(spool, sub) if n.endswith(".json"))


class Chaos(object):
    def __init__(self, procs, spool, handlers, tmp_path, rng):
        self.procs, self.spool, self.rng = procs, spool, rng
        self.handler = os.path.join(handlers, "work")
        self.opts = ("--handlers", handlers) + WORKER_OPTS
        self.logdir = tmp_path
        self.slots = [self.start(i) for i in range(WORKERS)]
        self.kills = []             # (kind, set of job ids it was running)
        self.misses = 0

    def start(self, i):
        return self.procs.worker(self.spool, *self.opts,
                                 log=self.logdir / ("w%d.log" % i))

    def handlers(self):
        """{pid: job id} of the handlers the workers run right now."""
        out = {}
        for pid in children(p.pid for p in self.slots):
            try:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if self.handler.encode() in argv:
                out[pid] = job_of(pid)
        return out

    def running(self, pid):
        """Jobs whose claim (or .fin) in processing/ belongs to worker pid."""
        tag = "+w-%d-" % pid
        out = {n.split("+", 1)[0] for n in ls(self.spool, "processing")
               if tag in n}
        # the SQLite store: its claimed rows
        out.update(r[0] for r in sql(
            self.spool, "SELECT id FROM jobs WHERE status='processing' AND "
            "worker_id LIKE ?", ("w-%d-%%" % pid,)) or ())
        return out

    def kill_worker(self):
        i = self.rng.randrange(WORKERS)
        w = self.slots[i]
        assert w.poll() is None, "worker %d exited by itself: %s" % (
            i, w.returncode)
        w.send_signal(signal.SIGSTOP)       # freeze it, then look
        victims = self.running(w.pid)
        for p, j in self.handlers().items():
            st = proc_stat(p)       # once: the handler may exit meanwhile
            if st and st[1] == w.pid and j:
                victims.add(j)
        w.kill()
        w.wait(10)
        self.kills.append(("worker", victims))
        self.slots[i] = self.start(i)

    def kill_handler(self):
        hs = list(self.handlers().items())
        if not hs:
            self.misses += 1
            return
        pid, jid = self.rng.choice(hs)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            self.misses += 1
            return
        self.kills.append(("handler", {jid} if jid else set()))


@pytest.mark.slow
def test_chaos_soak(run_myq, spool, handlers_dir, tmp_path):
    seed = int(os.environ.get("CHAOS_SEED") or int(time.time() * 1000) % 10**6)
    rng = random.Random(seed)
    effects = tmp_path / "effects"
    h = handlers_dir("work", handler_body(effects))
    procs = Procs(tmp_path)
    t_start = time.monotonic()
    try:
        chaos = Chaos(procs, spool, h, tmp_path, rng)
        root = os.path.dirname(MYQ)
        producers = [
            procs.spawn([sys.executable, "-c", src, root, spool,
                         str(PER_PRODUCER)], env=clean_env())
            for src in (PRODUCER_API, PRODUCER_SHELL)]
        ids = (["api-%05d" % i for i in range(PER_PRODUCER)]
               + ["sh-%05d" % i for i in range(PER_PRODUCER)])
        total = len(ids)

        def finished():
            return count(spool, "done") + count(spool, "dlq")

        # Chaos: pace the kills until every job is finished (or time is up).
        deadline = time.monotonic() + KILL_SECONDS
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.2, 1.0))   # the kill schedule, not a wait
            if rng.random() < 0.5:
                chaos.kill_worker()
            else:
                chaos.kill_handler()
            if (all(p.poll() is not None for p in producers)
                    and finished() >= total):
                break
        for p in producers:
            assert p.wait(60) == 0, "a producer failed"
        t_chaos = time.monotonic() - t_start

        # Calm: the surviving workers finish what is left.
        wait_for(lambda: finished() >= total, timeout=60, interval=0.2,
                 what="every job done or dead after the kills stopped")
        for i, w in enumerate(chaos.slots):
            assert w.poll() is None, "a worker exited by itself"
            # A worker restarted a moment ago may not have installed its
            # SIGTERM handler yet: wait for its start line first.
            log = tmp_path / ("w%d.log" % i)
            wait_for(lambda: "event=start worker=w-%d-" % w.pid in log.read_text(),
                     what="worker %d to start" % i)
            w.send_signal(signal.SIGTERM)
        for w in chaos.slots:
            assert w.wait(30) == 0
        cp = run_myq("--spool", spool, "reap")
        assert cp.returncode == 0, cp.stderr
        cp = run_myq("--spool", spool, "worker", "--drain", *chaos.opts,
                     timeout=60)
        assert cp.returncode == 0, cp.stderr
    finally:
        procs.cleanup()

    done = {n[:-5] for n in ls(spool, "done") if n.endswith(".json")}
    dead = {n[:-5] for n in ls(spool, "dlq") if n.endswith(".json")}
    lost = set(ids) - done - dead
    assert not (done & dead), "jobs in both done/ and dlq/: %s" % sorted(
        done & dead)[:10]
    assert done | dead == set(ids), "lost: %s, unknown: %s" % (
        sorted(lost)[:10], sorted((done | dead) - set(ids))[:10])
    assert ls(spool, "processing") == []
    assert [n for n in ls(spool, "incoming") if n.endswith(".json")] == []
    assert ls(spool, "failed") == []

    runs, known = {}, set(ids)
    with open(str(effects)) as f:
        for line in f:
            jid = line.rstrip("\n")
            assert jid in known, "garbled effect %r" % line
            runs[jid] = runs.get(jid, 0) + 1
    no_effect = sorted(j for j in done if j not in runs)
    assert not no_effect, "done without an effect: %s" % no_effect[:10]
    killed = {}
    for kind, victims in chaos.kills:
        for j in victims:
            killed[j] = killed.get(j, 0) + 1
    duplicates = sum(n - 1 for n in runs.values())
    unexplained = sorted(j for j, n in runs.items() if n - 1 > killed.get(j, 0))
    n_workers = sum(1 for k, _ in chaos.kills if k == "worker")
    for j in dead:
        job = read_job(spool, "dlq", j)
        assert job["attempts"] >= MAX_ATTEMPTS, job
    print("\nchaos seed=%d jobs=%d kills=%d (workers=%d handlers=%d, misses=%d)"
          " lost=%d dead=%d duplicate_effects=%d tmp_left=%d"
          " chaos_s=%.1f total_s=%.1f"
          % (seed, total, len(chaos.kills), n_workers,
             len(chaos.kills) - n_workers, chaos.misses, len(lost), len(dead),
             duplicates, len(ls(spool, "tmp")), t_chaos,
             time.monotonic() - t_start))
    assert duplicates <= len(chaos.kills)
    assert not unexplained, (
        "duplicate effects without a killed run: %s"
        % [(j, runs[j], killed.get(j, 0)) for j in unexplained[:10]])
    assert len(chaos.kills) >= 10, "too few kills to mean anything"
