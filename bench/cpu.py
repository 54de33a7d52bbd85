#!/usr/bin/env python3
"""Instructions myq spends per enqueued job and per drained job, counted by
valgrind's callgrind: deterministic, unlike a rate (issue "Ahead of the
SQLite peers").

    python3 bench/cpu.py [--n N] [--python PY] [--dir PATH]
                         [--store files|sqlite] [--base REV]
                         [--profile DIR] [--cprofile DIR] [--json FILE]

- enqueue: `myq.Spool(dir).enqueue("noop", {"n": i})` N times, one by one,
  durable (the default sync=True), in one process.
- drain: a spool holding N such jobs (enqueued beforehand, outside the
  count); `myq.Worker(dir, module=FILE).run(drain=True)`, FILE being a
  --module file whose function `noop` does nothing; its log in a file on
  the same filesystem.
- Each figure is (the process with N) - (the same process with N=0),
  divided by N: the interpreter's start, the imports and the worker's start
  cancel out.  Whole process, every thread.
- tmpfs (/dev/shm where there is one), PYTHONHASHSEED=0, byte code cached
  (under a prefix outside the tree, written by a run before the counted
  ones even where PYTHONDONTWRITEBYTECODE is set), no MYQ_* variables.
- The worker runs on a clock that moves 1 us a reading (myq._mono): under
  valgrind, ~50 times slower, its timers (group commit after 1 s, prune
  after 5 s, heartbeat) would otherwise fire by how slow the machine is.
  What is left of real time is the SIGALRM tick of an inline handler
  (a few hundred instructions per tick).

Reruns agree to within ~0.5%: the job ids and timestamps differ from run to
run (their digits, a few branches).  Four valgrind processes, two at a time:
~30 s on 2 shared cores with N=500.

--store sqlite: the spools made by `init(store="sqlite")` (the SQLite
store); --base REV: the same runs, in the same pool, for myq.py of git REV
too (`git show REV:myq.py`), printed beside this tree's.

--profile DIR keeps the runs' callgrind files (--dump-instr=no) as
DIR/OP-N.cg and prints the C functions whose own cost grew most per job
(N run minus N=0 run, by callgrind_annotate); --cprofile DIR writes the Python-level picture of the
same N runs (cProfile, no valgrind) as DIR/{enqueue,drain}.txt.
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
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PYCACHE = os.path.join(tempfile.gettempdir(), "myq-cpu-pycache")
HANDLER = "def noop(job):\n    pass\n"


def default_python():
    """pyenv's 3.11 where there is one (the issue's figures are for 3.11),
    else this interpreter; never pyenv's shim."""
    try:
        root = subprocess.check_output(["pyenv", "root"], universal_newlines=True,
                                       stderr=subprocess.DEVNULL).strip()
        vers = sorted(v for v in os.listdir(os.path.join(root, "versions"))
                      if v.startswith("3.11."))
        if vers:
            return os.path.join(root, "versions", vers[-1], "bin", "python3")
    except (OSError, subprocess.CalledProcessError):
        pass
    return sys.executable


def child_env(root=None):
    env = dict((k, v) for k, v in os.environ.items() if not k.startswith("MYQ_"))
    if root:
        env["MYQ_CPU_ROOT"] = root      # where the child imports myq from
    for k in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONSTARTUP"):
        env.pop(k, None)
    env["PYTHONPYCACHEPREFIX"] = PYCACHE
    env["PYTHONHASHSEED"] = "0"
    return env


# The child: python bench/cpu.py _child OP DIR N [CPROFILE_OUT] ###############

def child(op, d, n, prof_out=None):
    sys.path.insert(0, os.environ.get("MYQ_CPU_ROOT") or ROOT)
    import myq
    sp = getattr(myq, 'open_store', myq.Spool)(d)
    sp.require()
    if op == "enqueue":
        def work():
            for i in range(n):
                sp.enqueue("noop", {"n": i})
    else:
        tick = [time.monotonic()]

        def mono():
            tick[0] += 1e-6
            return tick[0]
        myq._mono = mono
        log = myq.Log(path=os.path.join(d, "worker.log"))
        w = myq.Worker(sp, module=os.path.join(d, "handler.py"), log=log)

        def work():
            w.run(drain=True)
    if prof_out:
        import cProfile
        import pstats
        p = cProfile.Profile()
        p.runcall(work)
        with open(prof_out, "w") as f:
            st = pstats.Stats(p, stream=f)
            st.sort_stats("tottime").print_stats(45)
            st.sort_stats("cumulative").print_stats(45)
    else:
        work()
    if op == "drain":
        st = sp.stats()
        left, done = st["ready"] + st["scheduled"], st["done"]
        if left or done != n:
            raise SystemExit("drain: %d done, %d left of %d" % (done, left, n))


# A producer's whole process: --startup (issue 25) ############################

def _instructions(cmd, env, cwd, children=False):
    """Ir of one process under callgrind (with `children`: it and every
    process it starts, summed)."""
    out = os.path.join(cwd, "cg.%p")
    subprocess.check_call(
        ["valgrind", "--tool=callgrind", "-q", "--callgrind-out-file=" + out,
         "--trace-children=" + ("yes" if children else "no")] + cmd,
        env=env, cwd=cwd, stdout=subprocess.DEVNULL)
    total = 0
    for name in os.listdir(cwd):
        if name.startswith("cg."):
            with open(os.path.join(cwd, name)) as f:
                for line in f:
                    if line.startswith(("summary:", "totals:")):
                        total += int(line.split()[1])
                        break
            os.unlink(os.path.join(cwd, name))
    return total


def _shell_recipe():
    """README's "One job from a shell" script."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("#!/bin/sh\n# One job from a shell")
    return text[start:text.index("```", start)]


def startup(py, base, runs=3):
    """Instructions of one `myq enqueue` process, whole, beside its floors,
    medians of `runs`.  The interpreter is a venv of `py` without packages:
    a floor that is the interpreter, not what its site-packages' .pth
    files import at every start (here certifi and more: 138 M for `-c
    pass`, 34 M in the venv), as on a device with an empty site-packages."""
    venv = os.path.join(base, "venv")
    subprocess.check_call([py, "-m", "venv", "--without-pip", venv])
    vpy = os.path.join(venv, "bin", "python3")
    dest, prefix = os.path.join(base, "dest"), os.path.join(base, "target", "usr")
    os.makedirs(dest)
    one = os.path.join(base, "one", "myq.py")       # the copy a user makes
    os.makedirs(os.path.dirname(one))
    shutil.copy(os.path.join(ROOT, "myq.py"), one)
    subprocess.check_call([vpy, one, "install", "--destdir", dest, "--prefix",
                           prefix], stdout=subprocess.DEVNULL)
    shutil.copytree(os.path.join(dest, prefix.lstrip("/")), prefix)
    spool = os.path.join(base, "spool")
    subprocess.check_call([vpy, one, "--spool", spool, "init"])
    recipe = os.path.join(base, "recipe.sh")
    with open(recipe, "w") as f:
        f.write(_shell_recipe())
    env = child_env()
    env.pop("PYTHONPYCACHEPREFIX")      # the layout's own __pycache__/
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    sh_env = dict(env, SPOOL=spool)
    enq = ["--spool", spool, "enqueue", "greet", '{"n": 1}']
    rows = [
        ("myq enqueue, installed by `python3 myq.py install`",
         [vpy, os.path.join(prefix, "bin", "myq")] + enq, env, False),
        ("myq stats, installed", [vpy, os.path.join(prefix, "bin", "myq"),
                                  "--spool", spool, "stats"], env, False),
        ("myq worker --drain, installed (an empty spool: a worker's start "
         "and stop)", [vpy, os.path.join(prefix, "bin", "myq"), "--spool",
                       spool, "worker", "--drain"], env, False),
        ("python3 myq.py enqueue (the one file, compiled at every start)",
         [vpy, one] + enq, env, False),
        ("python3 -c pass", [vpy, "-c", "pass"], env, False),
        ("python3 -I -c 'import json'", [vpy, "-I", "-c", "import json"], env,
         False),
        ("the shell recipe (README), sh alone", ["sh", recipe], sh_env, False),
        ("the shell recipe, with the programs it runs", ["sh", recipe], sh_env,
         True),
    ]
    got = {}
    for name, cmd, e, kids in rows:
        subprocess.run(cmd, env=e, stdout=subprocess.DEVNULL)   # warm
        work = os.path.join(base, "w")
        os.makedirs(work, exist_ok=True)
        got[name] = statistics.median(_instructions(cmd, e, work, kids)
                                      for _ in range(runs))
    bare = float(got["python3 -c pass"])
    inst, json_ = got[rows[0][0]], got["python3 -I -c 'import json'"]
    print("instructions per process (callgrind, medians of %d; x: of "
          "python3 -c pass), a venv of %s" % (runs, py))
    for name, _, _, _ in rows:
        print("%8.1f M %6.2fx  %s" % (got[name] / 1e6, got[name] / bare, name))
    print("installed enqueue / python3 -c pass: %.2fx; / python3 -I -c "
          "'import json': %.2fx" % (inst / bare, inst / json_))
    return dict((name, got[name]) for name, _, _, _ in rows)


# The parent ##################################################################

def prepare(py, d, op, n, store="files", root=ROOT):
    """A fresh spool at d (for a drain: holding n jobs, and the handler);
    also compiles myq.py's byte code for the counted runs."""
    os.makedirs(d)
    code = ("import sys; sys.path.insert(0, %r); import myq\n"
            "sp = getattr(myq, 'open_store', myq.Spool)(%r).init(%s)\n"
            % (root, d, "" if store == "files" else "store=%r" % store))
    if op == "drain":
        code += ("for i in range(%d):\n    sp.enqueue('noop', {'n': i}, "
                 "sync=False)\n" % n)
        with open(os.path.join(d, "handler.py"), "w") as f:
            f.write(HANDLER)
    subprocess.check_call([py, "-c", code], env=child_env(), cwd=ROOT)
    if store != "files":        # the store's own spool, opened afresh
        code = ("import sys; sys.path.insert(0, %r); import myq\n"
                "assert myq.open_store(%r).store == %r\n" % (root, d, store))
        subprocess.check_call([py, "-c", code], env=child_env(), cwd=ROOT)


def counted(py, d, op, n, keep=None, root=None):
    out = keep or (d + ".cg")
    cmd = ["valgrind", "--tool=callgrind", "-q", "--callgrind-out-file=" + out]
    if keep:
        cmd.append("--dump-instr=no")
    subprocess.check_call(cmd + [py, os.path.abspath(__file__), "_child", op, d,
                                 str(n)], env=child_env(root), cwd=ROOT)
    total = None
    with open(out) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                total = int(line.split()[1])
    if not keep:
        os.unlink(out)
    if total is None:
        raise RuntimeError("no summary line in %s" % out)
    return total


def _functions(path):
    """{file:function: own Ir} of a callgrind file."""
    out = subprocess.run(["callgrind_annotate", "--threshold=100", path],
                         stdout=subprocess.PIPE, universal_newlines=True).stdout
    got = {}
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[1].startswith("(") and ":" in parts[2]:
            try:
                v = int(parts[0].replace(",", ""))
            except ValueError:
                continue
            name = parts[2].split(" [")[0]
            name = name.rsplit("/", 1)[-1]
            got[name] = got.get(name, 0) + v
    return got


def per_function(where, op, n):
    a = _functions(os.path.join(where, "%s-0.cg" % op))
    b = _functions(os.path.join(where, "%s-%d.cg" % (op, n)))
    diff = [(k, (b.get(k, 0) - a.get(k, 0)) / float(n)) for k in set(a) | set(b)]
    diff.sort(key=lambda kv: -abs(kv[1]))
    return diff


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--python", default=None, help="default: pyenv's 3.11")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm")
                    else tempfile.gettempdir())
    ap.add_argument("--profile", metavar="DIR",
                    help="keep the N runs' callgrind files here")
    ap.add_argument("--cprofile", metavar="DIR",
                    help="cProfile the N runs (no valgrind) into DIR/OP.txt")
    ap.add_argument("--only", choices=("enqueue", "drain"))
    ap.add_argument("--store", choices=("files", "sqlite", "both"),
                    default="files")
    ap.add_argument("--base", metavar="REV",
                    help="also myq.py of this git revision, in the same run")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--startup", action="store_true",
                    help="instead: one `myq enqueue` process, installed and "
                    "one-file, beside python3 and the shell recipe")
    o = ap.parse_args()
    py = o.python or default_python()
    if o.startup:
        base = tempfile.mkdtemp(prefix="myq-startup-", dir=o.dir)
        try:
            res = startup(py, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        if o.json:
            with open(o.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    ops = [o.only] if o.only else ["enqueue", "drain"]
    stores = ["files", "sqlite"] if o.store == "both" else [o.store]
    base = tempfile.mkdtemp(prefix="myq-cpu-", dir=o.dir)
    trees = [("this tree", ROOT)]
    if o.base:
        src = subprocess.check_output(["git", "show", o.base + ":myq.py"],
                                      cwd=ROOT)
        os.makedirs(os.path.join(base, "base"))
        with open(os.path.join(base, "base", "myq.py"), "wb") as f:
            f.write(src)
        trees.insert(0, ("base " + o.base, os.path.join(base, "base")))
    t0 = time.monotonic()
    try:
        if o.cprofile:
            os.makedirs(o.cprofile, exist_ok=True)
            for op in ops:
                d = os.path.join(base, op + "-prof")
                prepare(py, d, op, o.n, stores[0])
                subprocess.check_call(
                    [py, os.path.abspath(__file__), "_child", op, d, str(o.n),
                     os.path.join(os.path.abspath(o.cprofile), op + ".txt")],
                    env=child_env(), cwd=ROOT)
                print("cProfile %s: %s" % (op, os.path.join(o.cprofile,
                                                             op + ".txt")))
            return
        if not shutil.which("valgrind"):
            raise SystemExit("bench/cpu.py: valgrind not found "
                             "(apt-get install valgrind)")
        runs = []
        for t, (label, root) in enumerate(trees):
            for store in stores:
                for op in ops:  # byte code cached (stdlib too) before any count
                    d = os.path.join(base, "warm-%d-%s-%s" % (t, store, op))
                    prepare(py, d, op, 1, store, root)
                    subprocess.check_call(
                        [py, os.path.abspath(__file__), "_child", op, d, "1"],
                        env=child_env(root), cwd=ROOT)
                    for n in (0, o.n):
                        d = os.path.join(base, "%d-%s-%s-%d" % (t, store, op, n))
                        prepare(py, d, op, n, store, root)
                        keep = None
                        if o.profile and t == len(trees) - 1:
                            os.makedirs(o.profile, exist_ok=True)
                            keep = os.path.join(os.path.abspath(o.profile),
                                                "%s-%d.cg" % (op, n))
                        runs.append(((label, store, op, n), d, keep, root))
        with ThreadPoolExecutor(max_workers=2) as ex:
            futs = [(k, ex.submit(counted, py, d, k[2], k[3], keep, root))
                    for k, d, keep, root in runs]
            got = dict((k, f.result()) for k, f in futs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res = {"python": py, "n": o.n}
    for label, _ in trees:
        for store in stores:
            for op in ops:
                k = (label, store, op)
                v = (got[k + (o.n,)] - got[k + (0,)]) / float(o.n)
                if label == trees[-1][0] and store == stores[0]:
                    res[op] = v
                res["%s %s %s" % k] = v
                print("instructions per %-8s %9.0f   (N=%d: %d, N=0: %d)  %s, %s"
                      % (op if op == "drain" else "enqueue", v, o.n,
                         got[k + (o.n,)], got[k + (0,)], store, label))
    sys.stderr.write("bench/cpu.py: %.0f s, %s, %s\n"
                     % (time.monotonic() - t0, py, o.dir))
    if o.profile:
        for op in ops:
            print("\n%s: own instructions per job, by C function" % op)
            for fn, v in per_function(o.profile, op, o.n)[:40]:
                print("%9.0f  %s" % (v, fn))
    if o.json:
        with open(o.json, "w") as f:
            json.dump(res, f, indent=1)

if __name__ == "__main__":
    if sys.argv[1:2] == ["_child"]:
        a = sys.argv[2:]
        child(a[0], a[1], int(a[2]), a[3] if len(a) > 3 else None)
    else:
        main()
