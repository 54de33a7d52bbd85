"""OpenWrt's python3-light.

myq must load, and run every core command, with only the modules that
python3-light ships.  The interpreter is started with -S (no site, so no
.pth file pre-imports anything) and a prelude that installs a sys.meta_path
finder raising ImportError for every module python3-light lacks, exactly as
a missing module would; it also logs each refused import to a file.
Then myq.py runs as __main__ (runpy), so a --module file's `import myq` gets
that same module.
"""
import json
import subprocess
import sys

import pytest

from _core import CODE, CODE_DIR, MYQ, ROOT, STATUS_RE, clean_env
from _pythons import IDS, PYTHONS, result_of, start_parallel

# python3-light's modules, with the C extension modules that ship with each package.
BLOCKED = sorted({
    "logging", "uuid", "_uuid", "urllib", "http", "email", "ssl", "_ssl",
    "_hashlib", "sqlite3", "_sqlite3", "ctypes", "_ctypes", "multiprocessing",
    "_multiprocessing", "_posixshmem", "asyncio", "_asyncio", "concurrent",
    "decimal", "_decimal", "_pydecimal", "xml", "pyexpat", "_elementtree",
    "unittest", "lzma", "_lzma", "dbm", "_dbm", "_gdbm", "unicodedata",
    "curses", "_curses", "_curses_panel", "readline", "venv", "pydoc",
    "pydoc_data",
})

# Optional imports the standard library itself tries and survives without
# (shutil probes its archive formats): not myq's doing, fine on the device.
STDLIB_PROBES = {"lzma", "_lzma"}

PRELUDE = r'''
import sys
BLOCKED = frozenset(%r)
LOG = %r


class LightFinder(object):
    """python3-light: these modules are simply not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            with open(LOG, "a") as f:
                f.write(name + "\n")
            raise ImportError("No module named %%r (not in python3-light)" %% name,
                              name=name)
        return None


sys.meta_path.insert(0, LightFinder())
already = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
if already:
    raise SystemExit("prelude: already imported before the block: %%s" %% already)
sys.path.insert(0, %r)
mode = sys.argv[1]
if mode == "--import":
    before = set(sys.modules)
    import myq
    sys.stdout.write(" ".join(sorted(set(sys.modules) - before)) + "\n")
    sys.stdout.write(" ".join(sorted(sys.modules)) + "\n")
elif mode == "--try":
    import importlib
    for name in sys.argv[2:]:
        try:
            importlib.import_module(name)
            sys.stdout.write(name + "=ok\n")
        except ImportError:
            sys.stdout.write(name + "=blocked\n")
else:
    # runpy.run_path(MYQ, run_name="__main__") with the code it would
    # compile taken from _core's cache (_core.BOOT: the compile is ~2/3 of
    # a command's CPU, and the flows below start ~160 of them)
    import runpy
    sys.argv = [%r] + sys.argv[1:]
    runpy._run_module_code(_myq_tests_code(%r, %r), mod_name="__main__",
                           pkg_name="", script_name=sys.argv[0])
'''


def prelude(tmp_path):
    log = str(tmp_path / "blocked.log")
    path = tmp_path / "light_boot.py"
    path.write_text(CODE + PRELUDE % (BLOCKED, log, ROOT, MYQ, MYQ, CODE_DIR))
    return str(path), log


def attempts(log):
    try:
        with open(log) as f:
            return set(f.read().split())
    except FileNotFoundError:
        return set()


def runner(tmp_path, python=None):
    """run(*args, input=None) -> CompletedProcess: myq.py run by `python`
    under the python3-light block; run.log collects the refused imports."""
    boot, log = prelude(tmp_path)

    def run(*args, input=None, timeout=60):
        return subprocess.run(
            [python or sys.executable, "-S", "-B", boot] + [str(a) for a in args],
            input=input, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            universal_newlines=True, env=clean_env(), timeout=timeout)

    run.log = log
    return run


def ok(cp):
    assert cp.returncode == 0, (cp.args[3:], cp.returncode, cp.stderr)
    return cp.stdout


@pytest.mark.parametrize("py", [p[1] for p in PYTHONS], ids=IDS)
def test_import_is_light_and_cheap(tmp_path, py):
    light = runner(tmp_path, py)
    cp = light("--import")
    assert cp.returncode == 0, cp.stderr
    new, everything = cp.stdout.splitlines()
    new, everything = set(new.split()), set(everything.split())
    assert "myq" in new
    assert not attempts(light.log), "import myq tried: %s" % sorted(attempts(light.log))
    assert not {m for m in everything if m.partition(".")[0] in BLOCKED}
    heavy = {"argparse", "subprocess", "threading", "random", "hashlib",
             "importlib.util", "shutil", "socket", "email", "inspect",
             "tempfile", "datetime", "locale", "gettext"}
    assert not (new & heavy), "import myq pulled in: %s" % sorted(new & heavy)
    assert not ({"argparse", "subprocess", "threading"} & everything)


def test_the_block_is_real(tmp_path):
    """The harness itself: blocked modules fail, python3-light ones load."""
    cp = runner(tmp_path)("--try", "logging", "urllib.request", "_hashlib", "hashlib",
               "json", "select", "signal", "subprocess", "argparse", "random")
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.split() == [
        "logging=blocked", "urllib.request=blocked", "_hashlib=blocked",
        "hashlib=ok", "json=ok", "select=ok", "signal=ok", "subprocess=ok",
        "argparse=ok", "random=ok"]


MODULE = '''
import json, os
import myq
OUT = %r


def mod_ok(job):
    with open(os.path.join(OUT, job["id"]), "w") as f:
        json.dump(job["payload"], f)


def mod_perm(job):
    raise myq.PermanentError("refused")


def mod_later(job):
    raise myq.RetryLater(3600, "not yet")
'''


@pytest.fixture(scope="module")
def light_flows(request, tmp_path_factory):
    return start_parallel(request, tmp_path_factory,
                          "test_core_flow_under_python3_light", light_flow)


@pytest.mark.slow
@pytest.mark.parametrize("ident", IDS)
def test_core_flow_under_python3_light(ident, light_flows):
    result_of(light_flows, ident)


def light_flow(py, tmp_path):
    light_ = runner(tmp_path, py)

    spool = str(tmp_path / "spool")
    out = tmp_path / "out"
    out.mkdir()
    hdir = tmp_path / "handlers"
    hdir.mkdir()
    (hdir / "ex").write_text('#!/bin/sh\ncat > "%s/$MYQ_JOB_ID"\n' % out)
    (hdir / "ex").chmod(0o755)
    (hdir / "bad").write_text('#!/bin/sh\necho nope >&2\nexit 1\n')
    (hdir / "bad").chmod(0o755)
    module = tmp_path / "mod.py"
    module.write_text(MODULE % str(out))
    S = ("--spool", spool)

    ok(light_(*S, "init"))
    assert ok(light_(*S, "enqueue", "ex", '{"a": 1}', "--id", "e1")) == "e1\n"
    ok(light_(*S, "enqueue", "ex", "-", "--id", "e2", input="[1, 2]"))
    ok(light_(*S, "enqueue", "mod_ok", '"hi"', "--id", "m1"))
    ok(light_(*S, "enqueue", "mod_perm", "--id", "m2"))
    ok(light_(*S, "enqueue", "mod_later", "--id", "m3"))
    ok(light_(*S, "enqueue", "bad", "--id", "b1", "--max-attempts", "2"))
    ok(light_(*S, "enqueue", "ex", "--id", "later", "--delay", "3600"))
    bad = light_(*S, "enqueue", "ex", "{oops")
    assert bad.returncode == 65 and bad.stderr.count("\n") == 1, bad.stderr

    w = light_(*S, "worker", "--drain", "--handlers", str(hdir), "--module",
              str(module), "--poll", "0.05", "--backoff-base", "0", "--jitter", "0",
              timeout=120)
    assert w.returncode == 0, w.stderr
    assert json.loads((out / "e1").read_text()) == {"a": 1}
    assert json.loads((out / "e2").read_text()) == [1, 2]
    assert json.loads((out / "m1").read_text()) == "hi"

    line = ok(light_(*S, "stats")).strip()
    assert STATUS_RE.match(line), line
    st = json.loads(ok(light_(*S, "stats", "--json")))
    assert (st["done"], st["dead"], st["scheduled"]) == (3, 2, 2), st
    jobs = {j["id"]: j for j in map(json.loads,
                                    ok(light_(*S, "list", "--json")).splitlines())}
    assert {k: v["state"] for k, v in jobs.items()} == {
        "e1": "done", "e2": "done", "m1": "done", "m2": "dead", "m3": "scheduled",
        "b1": "dead", "later": "scheduled"}
    assert "PermanentError" in jobs["m2"]["last_error"]
    assert "nope" in jobs["b1"]["last_error"] and jobs["b1"]["attempts"] == 2
    assert ok(light_(*S, "list", "dead")).split()[0] in ("b1", "m2")
    b1 = json.loads(ok(light_(*S, "show", "b1")))
    assert b1["state"] == "dead"

    assert ok(light_(*S, "retry", "b1")).strip() == "retried=1"
    (hdir / "bad").write_text("#!/bin/sh\nexit 0\n")
    ok(light_(*S, "worker", "--once", "--handlers", str(hdir), "--poll", "0.05"))
    assert json.loads(ok(light_(*S, "show", "b1")))["state"] == "done"
    assert ok(light_(*S, "delete", "m2")).strip() == "deleted=1"
    assert ok(light_(*S, "reap")).strip() == "requeued=0"
    pr = ok(light_(*S, "prune", "--keep-done", "0"))
    assert "done=" in pr, pr
    chk = light_(*S, "check")
    assert chk.returncode == 0, chk.stdout + chk.stderr
    assert ok(light_("version")).startswith("myq ")

    # Nothing myq asked for was refused; only the standard library's own
    # optional probes (shutil looking for lzma) may have been.
    assert attempts(light_.log) <= STDLIB_PROBES, sorted(attempts(light_.log))


@pytest.mark.parametrize("py", [p[1] for p in PYTHONS], ids=IDS)
def test_http_job_without_urllib_is_held_naming_the_package(tmp_path, py):
    light_ = runner(tmp_path, py)

    spool = str(tmp_path / "spool")
    S = ("--spool", spool)
    ok(light_(*S, "init"))
    ok(light_(*S, "enqueue", "http", '{"url": "http://127.0.0.1:9/hook", "body": {"x": 1}}',
             "--id", "h1"))
    w = light_(*S, "worker", "--drain", "--poll", "0.05", timeout=60)
    assert w.returncode == 0, w.stderr
    job = json.loads(ok(light_(*S, "show", "h1")))
    assert job["state"] == "held", job     # held, not dead
    assert job["attempts"] == 0, job
    assert "python3-urllib" in job["last_error"], job["last_error"]
    assert {"http", "urllib", "urllib.request"} & attempts(light_.log)
