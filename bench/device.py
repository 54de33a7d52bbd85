#!/usr/bin/env python3
"""Absolute figures a router engineer can compare (issue 25), each measured
for this tree's myq.py and, in the same run, for a baseline (`git show
REV:myq.py`, REV=main unless --base), so that every ratio is within one run.

    python3 bench/device.py [--base REV] [--runs 3] [--n 300] [--json FILE]
                            [--arm ROOT] [--skip cpu,arm] [--no-readme]

- flash: myq.py's source, and its byte code (py_compile, the .pyc the
  interpreter writes beside it: what a device stores besides the source).
- memory: `myq supervise --workers 1` run from a one-file copy of myq.py
  (byte code cached beside it, as a device's second start finds it): RSS
  and PSS (/proc/PID/smaps_rollup: PSS counts a page shared by k processes
  as 1/k, what the device really loses) of the supervisor + its worker,
  summed.  idle: once the worker said it started, after 2 s; busy: the
  highest sum sampled every 20 ms while it drains N exec jobs (a shell
  handler) and N http jobs (POST to a local server) enqueued at once.
  Medians of --runs runs, the two trees interleaved.
- instructions per enqueue and per delivered job: bench/cpu.py (callgrind;
  durable Spool.enqueue, a no-op --module drain), run once per tree: the
  counts are deterministic to ~0.5 %.
- start-up of `myq enqueue` (one job, a new process, the spool on tmpfs),
  in a venv of --python made here (a plain interpreter: a pyenv build's
  site-packages may run .pth files, ~100 M instructions a start, that
  hide the difference): the one-file copy (bin/myq, a copy of myq.py run
  as a script: compiled at every start) and the installed layout (`myq.py
  install --destdir`: its launcher imports myq.py from the byte code
  install wrote, hash-based and unchecked), against a bare `python3 -c pass` (the same
  site start-up as the launcher's): wall time (median of 7), peak RSS
  (/usr/bin/time's %M, median of 5: a child's own ru_maxrss counts the
  forking parent's pages) and whole-process instructions (callgrind,
  median of --runs).
- armv7l: the same start-up under qemu-user (qemu-arm-static) with a
  Debian armhf root (--arm ROOT, default /root/armhf): wall time, median
  of 3, emulated on this host, so only its ratios carry over.  Skipped,
  with the reason, where there is no qemu-arm-static or no root.  The root
  (bench/README.md): `debootstrap --arch=armhf --variant=minbase
  --include=python3-minimal,busybox --foreign bookworm ROOT`, then
  `dpkg-deb -x` of its python3*, libpython3.11-minimal, libexpat1 and
  busybox .debs (var/cache/apt/archives/) and of libpython3.11-stdlib
  (python3-minimal has no json; `apt-get download
  libpython3.11-stdlib:armhf`), libraries copied to usr/lib.

Then it rewrites the README's device table (its first screen) with this
tree's figures: each row this run measured (--no-readme: none).

The field workload's CPU per job is the soak's (`make soak`, tests/soak):
it needs root, network namespaces and ~4 minutes, so it is not run here.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HANDLER = "#!/bin/sh\ncat >/dev/null\n"


def env_for(extra=None):
    env = dict((k, v) for k, v in os.environ.items() if not k.startswith("MYQ_"))
    for k in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONSTARTUP",
              "PYTHONPYCACHEPREFIX"):
        env.pop(k, None)
    env["PYTHONHASHSEED"] = "0"
    env.update(extra or {})
    return env


def default_python():
    sys.path.insert(0, HERE)
    from cpu import default_python as d
    return d()


def make_tree(where, source):
    """A directory holding myq.py (`source`) and bench/cpu.py (this tree's:
    the same measuring code for both), mode 755 (a byte code cache there is
    trusted), with myq.py's byte code cached."""
    os.makedirs(os.path.join(where, "bench"), 0o755)
    os.chmod(where, 0o755)
    with open(os.path.join(where, "myq.py"), "wb") as f:
        f.write(source)
    shutil.copy(os.path.join(HERE, "cpu.py"), os.path.join(where, "bench"))
    return where


def flash(py, tree):
    src = os.path.join(tree, "myq.py")
    pyc = os.path.join(tree, "flash.pyc")
    subprocess.check_call([py, "-c", "import py_compile, sys; "
                           "py_compile.compile(sys.argv[1], cfile=sys.argv[2], "
                           "doraise=True)", src, pyc])
    out = {"source_kb": os.path.getsize(src) / 1024.0,
           "bytecode_kb": os.path.getsize(pyc) / 1024.0}
    os.unlink(pyc)
    return out


# memory ######################################################################

def rollup(pid):
    got = {}
    try:
        with open("/proc/%d/smaps_rollup" % pid) as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("Rss", "Pss"):
                    got[k] = int(v.split()[0])
    except OSError:
        return None
    return got if len(got) == 2 else None


def children(pid):
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d, "rb") as f:
                st = f.read()
            with open("/proc/%s/cmdline" % d, "rb") as f:
                words = f.read().split(b"\0")
        except OSError:
            continue
        if int(st.rpartition(b")")[2].split()[1]) == pid and b"worker" in words:
            out.append(int(d))
    return out


def total(sup):
    """(RSS, PSS) in kB of the supervisor and its worker, or None."""
    parts = [rollup(p) for p in [sup] + children(sup)]
    if len(parts) < 2 or None in parts:
        return None
    return sum(p["Rss"] for p in parts), sum(p["Pss"] for p in parts)


class Sink(object):
    """A local HTTP server that answers every request 200."""

    def __init__(self):
        import http.server

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST

            def log_message(self, *a):
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = "http://127.0.0.1:%d/in" % self.srv.server_address[1]


def wait(pred, timeout, what):
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise SystemExit("bench/device.py: timed out waiting for " + what)
        time.sleep(0.02)


def memory_run(py, tree, base, n, sink):
    """One run: (idle RSS, idle PSS, busy RSS, busy PSS) in kB."""
    d = tempfile.mkdtemp(dir=base)
    spool, hdir, log = (os.path.join(d, x) for x in ("spool", "h", "log"))
    os.mkdir(hdir)
    with open(os.path.join(hdir, "t"), "w") as f:
        f.write(HANDLER)
    os.chmod(os.path.join(hdir, "t"), 0o755)
    prog = os.path.join(tree, "myq.py")
    env = env_for()
    subprocess.check_call([py, prog, "--spool", spool, "init"], env=env,
                          stdout=subprocess.DEVNULL)
    sup = subprocess.Popen([py, prog, "--spool", spool, "supervise", "--workers",
                            "1", "--handlers", hdir, "--log", log], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        wait(lambda: os.path.exists(log) and "event=start " in open(log).read(),
             30, "the worker to start")
        time.sleep(2.0)
        idle = wait(lambda: total(sup.pid), 10, "the worker's memory")
        code = ("import sys; sys.path.insert(0, %r); import myq\n"
                "sp = getattr(myq, 'open_store', myq.Spool)(%r)\n"
                "for i in range(%d):\n"
                "    sp.enqueue('t', {'n': i}, sync=False)\n"
                "    sp.enqueue('http', {'url': %r, 'method': 'POST', "
                "'body': 'reading %%d' %% i}, sync=False)\n"
                % (tree, spool, n, sink.url))
        subprocess.check_call([py, "-c", code], env=env)
        done = os.path.join(spool, "done")
        busy = idle
        end = time.monotonic() + 300
        while len(os.listdir(done)) < 2 * n:
            t = total(sup.pid)
            if t:
                busy = max(busy, t, key=lambda x: x[1])
            if time.monotonic() > end:
                raise SystemExit("bench/device.py: the drain did not end")
            time.sleep(0.02)
        return idle + busy
    finally:
        sup.terminate()
        try:
            sup.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(sup.pid, 9)
            sup.wait()
        shutil.rmtree(d, ignore_errors=True)


# start-up ####################################################################

def installed(py, tree):
    """The layout `myq install` lays out for `tree`'s myq.py, under
    tree/root; its launcher pointed at it.  -> the launcher's path."""
    root = os.path.join(tree, "root")
    if not os.path.isdir(root):
        os.mkdir(root)
        subprocess.check_call([py, os.path.join(tree, "myq.py"), "install",
                               "--destdir", root, "--prefix", "/usr"],
                              env=env_for(), stdout=subprocess.DEVNULL)
        bindir = os.path.join(tree, "bin")
        os.mkdir(bindir)
        shutil.copy(os.path.join(tree, "myq.py"), os.path.join(bindir, "myq"))
    launcher = os.path.join(root, "usr", "bin", "myq")
    with open(launcher) as f:
        text = f.read()
    with open(launcher, "w") as f:
        f.write(text.replace(repr("/usr/lib/myq"),
                             repr(os.path.join(root, "usr", "lib", "myq"))))
    return launcher


def startup_argvs(py, tree, spool):
    words = ["--spool", spool, "enqueue", "t", '{"n": 1}']
    return {
        "bare": [py, "-c", "pass"],
        "onefile": [py, os.path.join(tree, "bin", "myq")] + words,
        "installed": [py, installed(py, tree)] + words,
    }


def wall_ms(argv, env, runs, prefix=()):
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.check_call(list(prefix) + argv, env=env, stdout=subprocess.DEVNULL)
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def peak_kb(argv, env, runs, where):
    """Median peak RSS of argv, KB, as /usr/bin/time measures it (its own
    fork and exec: a child of this Python would count its pages); None
    without GNU time."""
    if not os.access("/usr/bin/time", os.X_OK):
        return None
    out, got = os.path.join(where, "time.out"), []
    for _ in range(runs):
        subprocess.check_call(["/usr/bin/time", "-f", "%M", "-o", out] + argv,
                              env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            got.append(int(f.read().split()[-1]))
    return statistics.median(got)


def instructions(argv, env, where):
    out = os.path.join(where, "start.cg")
    subprocess.check_call(["valgrind", "--tool=callgrind", "-q",
                           "--callgrind-out-file=" + out] + argv, env=env,
                          stdout=subprocess.DEVNULL)
    with open(out) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                os.unlink(out)
                return int(line.split()[1])
    raise RuntimeError("no summary in " + out)


def plain_venv(py, base):
    """A venv of `py` (no site-packages of its own: none of its .pth
    files); `py` itself where venv is missing."""
    where = os.path.join(base, "venv")
    if not os.path.isdir(where):
        try:
            subprocess.check_call([py, "-m", "venv", "--without-pip", where],
                                  stdout=subprocess.DEVNULL)
        except (OSError, subprocess.CalledProcessError):
            return py
    return os.path.join(where, "bin", "python3")


def startup(py, trees, base, cpu, runs):
    """The start-up figures of each tree, interleaved, medians."""
    plain = plain_venv(py, base)
    said = py if plain == py else "a venv of " + py
    py, env = plain, env_for()
    res, samples = {}, dict((name, {}) for name, _ in trees)
    for name, tree in trees:
        spool = tempfile.mkdtemp(dir=base)
        subprocess.check_call([py, os.path.join(tree, "myq.py"), "--spool", spool,
                               "init"], env=env, stdout=subprocess.DEVNULL)
        argvs = startup_argvs(py, tree, spool)
        for argv in argvs.values():
            subprocess.check_call(argv, env=env, stdout=subprocess.DEVNULL)  # caches
        res[name] = {"python": py, "argvs": argvs}
    for _ in range(max(1, runs)):
        for name, _ in trees:
            for k, argv in res[name]["argvs"].items():
                got = samples[name].setdefault(k, {"ms": [], "kb": [], "instr": []})
                got["ms"].append(wall_ms(argv, env, 7))
                kb = peak_kb(argv, env, 5, base)
                if kb is not None:
                    got["kb"].append(kb)
                if cpu:
                    got["instr"].append(instructions(argv, env, base))
    for name, _ in trees:
        out = {"python": said}
        for k, got in samples[name].items():
            for unit, values in got.items():
                if values:
                    out["%s_%s" % (k, unit)] = statistics.median(values)
        res[name] = out
    return res


def arm(root, trees, base):
    qemu = shutil.which("qemu-arm-static") or shutil.which("qemu-arm")
    if not qemu:
        return "no qemu-arm-static (apt-get install qemu-user-static)"
    py = os.path.join(root, "usr", "bin", "python3")
    if not os.path.exists(py):
        return "no Debian armhf root at %s (see --arm)" % root
    prefix = [qemu, "-L", root]
    env = env_for()
    res = {}
    try:
        res["machine"] = subprocess.check_output(
            prefix + [py, "-c", "import platform; print(platform.machine(), "
                      "platform.python_version())"], env=env,
            universal_newlines=True).strip()
        for name, tree in trees:
            spool = tempfile.mkdtemp(dir=base)
            subprocess.check_call(prefix + [py, os.path.join(tree, "myq.py"),
                                            "--spool", spool, "init"], env=env,
                                  stdout=subprocess.DEVNULL)
            got = {}
            for k, argv in startup_argvs(py, tree, spool).items():
                subprocess.check_call(prefix + argv, env=env,
                                      stdout=subprocess.DEVNULL)
                got[k + "_ms"] = wall_ms(argv, env, 3, prefix)
            res[name] = got
            shutil.rmtree(spool, ignore_errors=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return "qemu-user run failed: %s" % e
    return res


# the report ##################################################################

def cpu_counts(py, tree, base):
    out = os.path.join(base, "cpu-%s.json" % os.path.basename(tree))
    subprocess.check_call([py, os.path.join(tree, "bench", "cpu.py"), "--python",
                           py, "--json", out], env=env_for(),
                          stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def row(label, a, b, fmt="%.1f"):
    ratio = ("%.2fx" % (b / a)) if a else "-"
    print("| %s | %s | %s | %s |" % (label, fmt % a, fmt % b, ratio))


def report(res):
    b, t = res["base"], res["this"]
    print("\n| figure | baseline (%s) | this tree | this/baseline |"
          % res["base_rev"])
    print("|---|---|---|---|")
    row("myq.py source, KB", b["flash"]["source_kb"], t["flash"]["source_kb"])
    row("byte code (.pyc), KB", b["flash"]["bytecode_kb"], t["flash"]["bytecode_kb"])
    for k, label in (("idle_rss", "idle RSS, supervisor + 1 worker, MB"),
                     ("idle_pss", "idle PSS, supervisor + 1 worker, MB"),
                     ("busy_rss", "busy RSS (http + exec drain), MB"),
                     ("busy_pss", "busy PSS (http + exec drain), MB")):
        if k in b:
            row(label, b[k] / 1024.0, t[k] / 1024.0)
    if "idle_pss" in t:
        print("| idle PSS vs the baseline's idle RSS sum | | | %.2fx |"
              % (t["idle_pss"] / float(b["idle_rss"])))
    for k, label in (("enqueue", "instructions per enqueue (durable)"),
                     ("drain", "instructions per delivered job (no-op)")):
        if k in b.get("cpu", {}):
            row(label, b["cpu"][k], t["cpu"][k], "%.0f")
    if "start" in t:
        print("| `myq enqueue` start-up (%s): | | | |"
              % t["start"]["python"])
    for k, label in (("bare_ms", "bare `python3 -c pass`, ms"),
                     ("installed_ms", "`myq enqueue`, installed layout, ms"),
                     ("onefile_ms", "`myq enqueue`, one-file copy, ms"),
                     ("bare_kb", "bare interpreter, peak RSS, MB"),
                     ("installed_kb", "`myq enqueue` installed, peak RSS, MB"),
                     ("onefile_kb", "`myq enqueue` one-file copy, peak RSS, MB"),
                     ("bare_instr", "bare interpreter, M instructions"),
                     ("installed_instr", "`myq enqueue` installed, M instructions"),
                     ("onefile_instr", "`myq enqueue` one-file copy, M instructions")):
        if k in b.get("start", {}) and k in t.get("start", {}):
            div = {"instr": 1e6, "kb": 1024.0}.get(k.rsplit("_", 1)[1], 1.0)
            row(label, b["start"][k] / div, t["start"][k] / div)
    for name, st in (("baseline", b.get("start", {})), ("this tree", t.get("start", {}))):
        for unit, div in (("instr", 1.0), ("kb", 1.0)):
            if "bare_" + unit in st and "installed_" + unit in st:
                print("| %s: installed / bare, %s | | | %.2fx (one file %.2fx) |"
                      % (name, "instructions" if unit == "instr" else "peak RSS",
                         st["installed_" + unit] / st["bare_" + unit],
                         st["onefile_" + unit] / st["bare_" + unit]))
    a = res.get("arm")
    if isinstance(a, dict):
        print("| armv7l (qemu-user, %s): | | | |" % a.get("machine"))
        for k, label in (("bare_ms", "bare interpreter, ms"),
                         ("installed_ms", "`myq enqueue` installed, ms"),
                         ("onefile_ms", "`python3 myq.py enqueue`, ms")):
            row("  " + label, a["base"][k], a["this"][k], "%.0f")
    elif a:
        print("\narmv7l: skipped: %s" % a)


def readme_rows(res):
    """{the README device table's row label: its new figures} for what this
    run measured of this tree (a row whose figures it lacks is left out)."""
    t, a = res["this"], res.get("arm")
    rows = {"flash": "%.0f KB `myq.py` + %.0f KB cached byte code" % (
        t["flash"]["source_kb"], t["flash"]["bytecode_kb"])}
    if "idle_pss" in t:
        rows["RAM, supervisor + 1 worker (PSS)"] = (
            "%.1f MB idle, %.1f MB draining http + exec jobs"
            % (t["idle_pss"] / 1024.0, t["busy_pss"] / 1024.0))
    if "cpu" in t:
        rows["instructions"] = "%.0f k a durable enqueue, %.0f k a delivered job" % (
            t["cpu"]["enqueue"] / 1e3, t["cpu"]["drain"] / 1e3)
    st = t.get("start", {})
    if "installed_instr" in st and isinstance(a, dict):
        m, mb = 1e6, 1024.0
        rows["`myq enqueue` start-up"] = (
            "installed %.0f M instructions, %.1f MB peak (bare interpreter "
            "%.1f M, %.1f MB); one file %.0f M, %.1f MB; armv7l %.2f s (bare "
            "%.2f), one file %.1f s" % (
                st["installed_instr"] / m, st["installed_kb"] / mb,
                st["bare_instr"] / m, st["bare_kb"] / mb, st["onefile_instr"] / m,
                st["onefile_kb"] / mb, a["this"]["installed_ms"] / 1e3,
                a["this"]["bare_ms"] / 1e3, a["this"]["onefile_ms"] / 1e3))
    return rows


def rewrite_readme(res, path=os.path.join(ROOT, "README.md")):
    """The README's device table (its first screen) with this run's figures
    of this tree, row by row: a row this run did not measure (--skip, no
    valgrind, no armv7l root; the soak's and bench-wear's) stays as it is."""
    with open(path) as f:
        text = f.read()
    done = []
    for label, figures in sorted(readme_rows(res).items()):
        head = "| %s | " % label
        at = text.find("\n" + head)
        if at < 0:
            sys.stderr.write("README.md: no %r row\n" % label)
            continue
        end = text.index("\n", at + 1)
        text = text[:at + 1] + head + figures + " |" + text[end:]
        done.append(label)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    sys.stderr.write("README.md: rows rewritten: %s\n" % ", ".join(done))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main", help="git revision of the baseline")
    ap.add_argument("--python", default=None, help="default: pyenv's 3.11")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n", type=int, default=300, help="jobs of each kind (busy)")
    ap.add_argument("--arm", default="/root/armhf", metavar="ROOT")
    ap.add_argument("--skip", default="", help="comma-separated: memory,cpu,start,arm")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--no-readme", action="store_true",
                    help="leave README.md's device table as it is")
    o = ap.parse_args()
    skip = set(o.skip.split(",")) - {""}
    py = o.python or default_python()
    base = tempfile.mkdtemp(prefix="myq-device-", dir="/dev/shm"
                            if os.path.isdir("/dev/shm") else None)
    t0 = time.monotonic()
    res = {"python": py, "base_rev": o.base}
    try:
        src = subprocess.check_output(["git", "-C", ROOT, "show", o.base + ":myq.py"])
        with open(os.path.join(ROOT, "myq.py"), "rb") as f:
            mine = f.read()
        trees = [("base", make_tree(os.path.join(base, "base"), src)),
                 ("this", make_tree(os.path.join(base, "this"), mine))]
        for name, tree in trees:
            res[name] = {"flash": flash(py, tree)}
            installed(py, tree)
        if "memory" not in skip:
            sink = Sink()
            runs = dict((name, []) for name, _ in trees)
            for _ in range(o.runs):
                for name, tree in trees:
                    runs[name].append(memory_run(py, tree, base, o.n, sink))
            for name, _ in trees:
                for i, k in enumerate(("idle_rss", "idle_pss", "busy_rss", "busy_pss")):
                    res[name][k] = statistics.median(r[i] for r in runs[name])
                res[name]["memory_runs"] = runs[name]
        have_vg = shutil.which("valgrind") is not None
        if "cpu" not in skip and have_vg:
            for name, tree in trees:
                res[name]["cpu"] = cpu_counts(py, tree, base)
        if "start" not in skip:
            got = startup(py, trees, base, have_vg and "cpu" not in skip, o.runs)
            for name, _ in trees:
                res[name]["start"] = got[name]
        if "arm" not in skip:
            res["arm"] = arm(o.arm, trees, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(res)
    if not o.no_readme:
        rewrite_readme(res)
    sys.stderr.write("bench/device.py: %.0f s, %s\n" % (time.monotonic() - t0, py))
    if o.json:
        with open(o.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
