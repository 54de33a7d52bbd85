#!/usr/bin/env python3
"""The power-cut workload, run inside the VM on the spool under test.

    workload.py --myq /path/myq.py --spool DIR --journal FILE [--jobs N]
                [--mark CMD] [--seed S] [--store sqlite]

A worker (myq worker --module handlers.py) runs in the background while
producers add at least --jobs jobs, mixing:
  - `myq enqueue` (the CLI, one process per job),
  - API batches: myq.open_store(p).enqueue_many(...), some with explicit ids,
  - the README's shell producer: write in tmp/, sync, mv into incoming/, sync.
Types: ok (most), flaky (retried twice), bad (dead letter).  Every ~150
jobs, and at the end, `myq prune` with a small --keep-done-max.

After each enqueue returned, the workload appends one JSON line to the
journal (outside the disk under test): {"mark": NAME, "jobs": {id: sum}},
then runs `MARK NAME` (e.g. `dmsetup message log 0 mark`), so the log of
block writes says where each promise was made: a job counts as promised at a
replay point only when its mark lies before that point.  Every payload
carries a random blob and its sha256, so the checker sees a torn or mixed
file.  --store sqlite: the same on a spool of the SQLite store (queue.db;
the shell recipe drops its files in the drop box).
"""

import argparse
import hashlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check  # noqa: E402


def payload(rng, n):
    blob = "%x" % rng.getrandbits(4 * rng.choice((16, 64, 400, 1500)))
    return {"n": n, "blob": blob,
            "sum": hashlib.sha256(blob.encode()).hexdigest()[:16]}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--myq", required=True)
    ap.add_argument("--spool", required=True)
    ap.add_argument("--journal", required=True)
    ap.add_argument("--runlog", default="")
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--cli", type=int, default=12, help="jobs via myq enqueue")
    ap.add_argument("--shell", type=int, default=12, help="jobs via the shell recipe")
    ap.add_argument("--mark", default="", help="command + mark name")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--prune-every", type=int, default=150)
    ap.add_argument("--keep-done-max", type=int, default=40)
    ap.add_argument("--store", default="files", choices=("files", "sqlite"))
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(a.myq)))
    import myq
    rng = random.Random(a.seed)
    py = sys.executable
    env = dict(os.environ, PC_RUNLOG=a.runlog, PYTHONDONTWRITEBYTECODE="1")
    journal = open(a.journal, "a")
    nmark = [0]
    t0 = time.monotonic()

    def promise(jobs, how):
        nmark[0] += 1
        name = "m%d" % nmark[0]
        journal.write(json.dumps({"mark": name, "how": how, "jobs": jobs,
                                  "t": round(time.monotonic() - t0, 2)}) + "\n")
        journal.flush()
        os.fsync(journal.fileno())
        if a.mark:
            subprocess.run(shlex.split(a.mark) + [name], check=True)

    def event(what, **extra):
        nmark[0] += 1
        name = "%s%d" % (what, nmark[0])
        journal.write(json.dumps(dict(extra, mark=name, how=what)) + "\n")
        journal.flush()
        if a.mark:
            subprocess.run(shlex.split(a.mark) + [name], check=True)

    subprocess.run([py, a.myq, "--spool", a.spool, "init"]
                   + (["--store", a.store] if a.store != "files" else []),
                   check=True, env=env)
    event("init")
    worker = subprocess.Popen(
        [py, a.myq, "--spool", a.spool, "worker", "--module",
         os.path.join(HERE, "handlers.py"), "--backoff-base", "0.2",
         "--backoff-max", "1", "--poll", "0.5", "--stats-interval", "0"],
        env=env)
    spool = myq.open_store(a.spool)
    n = 0
    cli_left, sh_left = a.cli, a.shell
    next_prune = a.prune_every
    counts = {"cli": 0, "api": 0, "shell": 0}

    def done_ids():
        """What a prune may remove: done jobs with an id myq generated keep
        no record once gone (the checker's `pruned`)."""
        return check.done_ids(a.spool)

    def prune():
        """myq prune, the worker stopped from the listing to the prune's
        end: a job it finished in between would be removed unlisted, and
        counted lost (seen once on UBIFS: a retried job).  A worker stopped
        in a write transaction of queue.db keeps its lock: the prune waits
        MYQ_DB_BUSY seconds and exits 75; then the worker runs a moment and
        the listing and the prune are done again."""
        for k in range(20):
            worker.send_signal(signal.SIGSTOP)
            try:
                event("preprune", done=done_ids())
                rc = subprocess.run([py, a.myq, "--spool", a.spool, "prune"],
                                    env=dict(env, MYQ_DB_BUSY="1",
                                             MYQ_KEEP_DONE_MAX=str(a.keep_done_max))
                                    if a.store == "sqlite" else dict(
                                        env, MYQ_KEEP_DONE_MAX=str(a.keep_done_max))
                                    ).returncode
            finally:
                worker.send_signal(signal.SIGCONT)
            if rc == 0:
                break
            if rc != 75 or a.store != "sqlite":
                raise subprocess.CalledProcessError(rc, "myq prune")
            time.sleep(0.2)
        else:
            raise RuntimeError("myq prune: the database stayed busy")
        event("prune")

    def pick_type():
        r = rng.random()
        return "ok" if r < 0.8 else ("flaky" if r < 0.9 else "bad")

    while n < a.jobs:
        left = a.jobs - n
        r = rng.random()
        if cli_left and r < cli_left / max(left, 1) * 3:
            t, p = pick_type(), payload(rng, n)
            out = subprocess.run([py, a.myq, "--spool", a.spool, "enqueue", t,
                                  json.dumps(p)], env=env, check=True,
                                 stdout=subprocess.PIPE).stdout.decode().strip()
            promise({out: p["sum"]}, "cli")
            cli_left -= 1
            n += 1
            counts["cli"] += 1
        elif sh_left and r < (cli_left + sh_left) / max(left, 1) * 3:
            t, p = pick_type(), payload(rng, n)
            jid = "sh-%d" % n
            body = json.dumps({"type": t, "payload": p})
            # The README's recipe, with the sync before and after the mv that
            # the Guarantees section asks for.
            script = ('printf "%%s\\n" %s > "$SPOOL/tmp/%s.json" && sync && '
                      'mv "$SPOOL/tmp/%s.json" "$SPOOL/incoming/%s.json" && sync'
                      % (shlex.quote(body), jid, jid, jid))
            subprocess.run(["sh", "-c", script], check=True,
                           env=dict(env, SPOOL=a.spool))
            promise({jid: p["sum"]}, "shell")
            sh_left -= 1
            n += 1
            counts["shell"] += 1
        else:
            k = min(left, rng.randint(1, 25))
            specs, sums = [], []
            for i in range(k):
                t, p = pick_type(), payload(rng, n + i)
                spec = {"type": t, "payload": p}
                if rng.random() < 0.2:
                    spec["id"] = "x-%d" % (n + i)
                specs.append(spec)
                sums.append(p["sum"])
            ids = spool.enqueue_many(specs)
            promise(dict(zip(ids, sums)), "api")
            n += k
            counts["api"] += k
        if n >= next_prune:
            next_prune += a.prune_every
            prune()
        time.sleep(rng.choice((0, 0, 0.05, 0.2)))
    # Let the worker finish (flaky jobs wait for their retries), for less
    # than the VM's time: a job that never ends is then counted by the
    # checker (stuck), not hidden in a part with no result.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not check.busy(a.spool):
            break
        time.sleep(0.5)
    else:
        print("workload: still busy after 120 s: %d" % check.busy(a.spool))
    prune()
    worker.send_signal(signal.SIGTERM)
    worker.wait(60)
    event("end")
    st = subprocess.run([py, a.myq, "--spool", a.spool, "stats"], env=env,
                        stdout=subprocess.PIPE).stdout.decode()
    print("workload: jobs=%d %s in %.0fs; worker exit %s; stats: %s" % (
        n, " ".join("%s=%d" % kv for kv in sorted(counts.items())),
        time.monotonic() - t0, worker.returncode, " ".join(st.split())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
