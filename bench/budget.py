"""What the spool's budget (issue 37) costs a plain enqueue: the API's
Spool.enqueue, µs a job (median of the per-job times, the median of
ROUNDS rounds), for each store: myq without the budget's code (--old
FILE: an older myq.py), this myq without a budget, and with one (big
enough never to shed).  sync=False shows the code's own cost (no fsync),
sync=True what a producer waits for.  All variants in the same run,
interleaved round by round.

    python3 bench/budget.py [--old OLD/myq.py] [--jobs 1000] [--rounds 5]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import os, sys, time, json
sys.path.insert(0, sys.argv[1])
import myq
spool, store, budget, sync, jobs = sys.argv[2], sys.argv[3], sys.argv[4], \
    sys.argv[5] == "1", int(sys.argv[6])
myq.main(["--spool", spool, "init", "--store", store])
if budget != "-":
    myq.main(["--spool", spool, "policy", "--budget", budget])
sp = getattr(myq, 'open_store', myq.Spool)(spool)
payload = {"sensor": "t1", "value": 21.5, "pad": "x" * 200}
times = []
for i in range(jobs):
    t = time.perf_counter()
    sp.enqueue("tele", payload, sync=sync)
    times.append(time.perf_counter() - t)
times.sort()
print(json.dumps(times[len(times) // 2] * 1e6))
"""


def one(code_dir, store, budget, sync, jobs):
    d = tempfile.mkdtemp(prefix="myq-bench-budget-")
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, code_dir, os.path.join(d, "s"), store,
             budget, "1" if sync else "0", str(jobs)],
            stdout=subprocess.PIPE, check=True, universal_newlines=True).stdout
        return json.loads(out.strip().split("\n")[-1])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", help="an older myq.py (without the budget)")
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    variants = []
    if a.old:
        old = tempfile.mkdtemp(prefix="myq-bench-old-")
        shutil.copy(a.old, os.path.join(old, "myq.py"))
        variants.append(("old", old, "-"))
    variants += [("no budget", HERE, "-"), ("budget 1G", HERE, "1G")]
    for store in ("files", "sqlite"):
        for sync in (False, True):
            res = dict((v[0], []) for v in variants)
            for _ in range(a.rounds):
                for name, code, budget in variants:
                    res[name].append(one(code, store, budget, sync, a.jobs))
            print("%-6s sync=%-5s " % (store, sync) + "  ".join(
                "%s %.1f us" % (name, sorted(v)[len(v) // 2])
                for name, v in res.items()))


if __name__ == "__main__":
    main()
