"""myq.py run as a script (the one-file install, `cp myq.py
/usr/bin/myq`).

Python 3.9+ keeps what it parsed of a script (~15 MB for myq.py) until the
script's module body returns; so myq.py leaves its body first and runs
main() from sys.excepthook (see "Run as a script" in myq.py), and a
long-running command (worker, supervise) that compiled myq.py gives the
freed heap back with malloc_trim(0) where ctypes has it.  These tests check
the mechanism; bench/run.py measures the memory (row rss_script).
"""
import json
import os
import py_compile
import signal
import subprocess
import sys
import time

import pytest

import _core
from _core import MYQ, clean_env, enqueue, has, show, wait_for, worker
from _core import call_myq, cmdline

# The store plays no part in what these prove: `make test-sqlite` leaves them out.
pytestmark = pytest.mark.store_free("the process image of myq.py run as a script")


@pytest.fixture
def run_myq():
    """This file is about myq.py started as a script: `python myq.py`
    itself, never _core.myq_argv's cached code."""
    def run(*args, **kw):
        return _core.run_myq(*args, script=True, **kw)
    return run

STACK_MOD = """\
import json, sys, traceback
import myq
OUT = %r


def t(job):
    with open(OUT, "w") as f:
        json.dump({"stack": [[fr[0], fr[2]] for fr in traceback.extract_stack()],
                   "same": myq is sys.modules["__main__"],
                   "file": myq.__file__}, f)
"""

# A stand-in for ctypes, first on PYTHONPATH: glibc (malloc_trim), musl (no
# malloc_trim) or python3-light (no ctypes at all).  It logs what myq does
# with it.
FAKE_CTYPES = """\
import os


def _log(line):
    with open(os.environ["FAKE_CTYPES_LOG"], "a") as f:
        f.write(line + "\\n")


_log("import")
if os.environ["FAKE_CTYPES"] == "missing":
    raise ImportError("No module named 'ctypes' (not in python3-light)")


class CDLL(object):
    def __init__(self, name):
        _log("CDLL %r" % (name,))

    if os.environ["FAKE_CTYPES"] == "glibc":
        def malloc_trim(self, pad):
            _log("malloc_trim %d" % pad)
            return 1
"""

EXPECTED = {
    "glibc": ["import", "CDLL None", "malloc_trim 0"],
    "musl": ["import", "CDLL None"],
    "missing": ["import"],
}


def fake_ctypes(tmp_path, libc):
    d = tmp_path / "fake"
    (d / "ctypes").mkdir(parents=True)
    (d / "ctypes" / "__init__.py").write_text(FAKE_CTYPES)
    log = tmp_path / "ctypes.log"
    env = {"PYTHONPATH": str(d), "FAKE_CTYPES": libc, "FAKE_CTYPES_LOG": str(log)}
    return env, log


def logged(log):
    try:
        return log.read_text().split("\n")[:-1]
    except FileNotFoundError:
        return []


def test_main_runs_after_the_module_body(run_myq, spool, tmp_path):
    out = tmp_path / "out.json"
    mod = tmp_path / "stack_mod.py"
    mod.write_text(STACK_MOD % str(out))
    job_id = enqueue(call_myq, spool, "t")
    cp = worker(run_myq, spool, "--module", str(mod))
    assert cp.returncode == 0, cp.stderr
    assert show(call_myq, spool, job_id)["state"] == "done"
    got = json.loads(out.read_text())
    frames = [tuple(f) for f in got["stack"]]
    assert (MYQ, "<module>") not in frames, frames
    assert (MYQ, "hook") in frames, frames
    # `import myq` in a handler module still gets this very module, whose
    # __file__ (the supervisor starts its workers from it) is still set
    assert got["same"] is True and got["file"] == MYQ


def test_exit_status_is_mains(run_myq, tmp_path):
    assert run_myq("version").returncode == 0
    cp = run_myq("no-such-command")
    assert cp.returncode == 64 and "Traceback" not in cp.stderr, cp.stderr
    cp = run_myq("--spool", str(tmp_path / "none"), "stats")
    assert cp.returncode not in (0, 1) and "Traceback" not in cp.stderr, cp.stderr


def test_an_exception_out_of_main_is_printed_and_exits_1(myq, monkeypatch, capsys):
    def boom(argv=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(myq, "main", boom)
    monkeypatch.setattr(myq, "_COMPILED_AT_START", [])
    monkeypatch.setattr(sys, "excepthook", None)      # restored after
    with pytest.raises(SystemExit) as e:
        myq._after_body(sys.__excepthook__)(myq._BodyDone, myq._BodyDone(), None)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: boom" in err, err
    assert sys.excepthook is sys.__excepthook__     # the one it replaced


def test_another_exception_goes_to_the_hook_it_replaced(myq, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "excepthook", None)
    try:
        raise ValueError("not ours")
    except ValueError:
        myq._after_body(lambda *a: seen.append(a[1]))(*sys.exc_info())
    assert [str(e) for e in seen] == ["not ours"]


@pytest.mark.parametrize("libc", sorted(EXPECTED))
def test_worker_as_script_trims_the_heap_where_it_can(run_myq, spool, tmp_path,
                                                       handlers_dir, libc):
    env, log = fake_ctypes(tmp_path, libc)
    handlers_dir("t", "cat >/dev/null")
    job_id = enqueue(call_myq, spool, "t")
    cp = worker(run_myq, spool, handlers=handlers_dir.path, env=env)
    assert cp.returncode == 0, cp.stderr
    assert "Traceback" not in cp.stderr and "ctypes" not in cp.stderr, cp.stderr
    assert show(call_myq, spool, job_id)["state"] == "done"
    assert logged(log) == EXPECTED[libc]


def test_short_commands_do_not_trim(run_myq, spool, tmp_path):
    env, log = fake_ctypes(tmp_path, "glibc")
    cp = run_myq("--spool", spool, "enqueue", "t", env=env)
    assert cp.returncode == 0, cp.stderr
    cp = run_myq("--spool", spool, "stats", env=env)
    assert cp.returncode == 0, cp.stderr
    assert logged(log) == []


def installed(tmp_path, pyc):
    """The module layout: lib/myq.py, with a current .pyc when pyc."""
    lib = tmp_path / "lib"
    lib.mkdir()
    src = lib / "myq.py"
    src.write_bytes(open(MYQ, "rb").read())
    old = time.time() - 120
    os.utime(str(src), (old, old))
    if pyc:
        cfile = lib / "__pycache__" / ("myq.%s.pyc" % sys.implementation.cache_tag)
        py_compile.compile(str(src), cfile=str(cfile), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
        os.utime(str(cfile), (old + 60, old + 60))    # written before the worker
    launcher = tmp_path / "myq"
    launcher.write_text("import sys\nsys.path.insert(0, %r)\nimport myq\n"
                        "sys.exit(myq.main())\n" % str(lib))
    return str(launcher)


@pytest.mark.parametrize("pyc", [True, False], ids=["with-pyc", "no-pyc"])
def test_installed_worker_trims_only_when_it_compiled(spool, tmp_path,
                                                      handlers_dir, pyc):
    env, log = fake_ctypes(tmp_path, "glibc")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    prog = installed(tmp_path, pyc)
    handlers_dir("t", "cat >/dev/null")
    job_id = enqueue(call_myq, spool, "t")
    cp = subprocess.run(
        [sys.executable, prog, "--spool", spool, "worker", "--drain",
         "--poll", "0.05", "--handlers", handlers_dir.path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
        env=clean_env(env), timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert show(call_myq, spool, job_id)["state"] == "done"
    assert logged(log) == ([] if pyc else EXPECTED["glibc"])


def test_supervisor_as_script_trims_the_heap(spool, tmp_path, handlers_dir, procs):
    """Where it cannot run from a byte code cache (a copy of myq.py with
    none beside it, byte code writing off): malloc_trim."""
    env, log = fake_ctypes(tmp_path, "glibc")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    prog = one_file_copy(tmp_path)
    handlers_dir("t", "cat >/dev/null")
    job_id = enqueue(call_myq, spool, "t")
    p = procs.spawn([sys.executable, prog, "--spool", spool, "supervise",
                     "--workers", "1", "--handlers", handlers_dir.path,
                     "--log", str(tmp_path / "sup.log")], env=clean_env(env))
    try:
        wait_for(lambda: has(spool, "done", job_id), timeout=20,
                 what="the supervised worker to run the job")
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(15)
    # the supervisor's own (its workers get a clean environment: the real ctypes)
    assert logged(log) == EXPECTED["glibc"]


def one_file_copy(tmp_path):
    """myq.py copied alone into a directory of its own (no __pycache__)."""
    d = tmp_path / "onefile"
    d.mkdir()
    os.chmod(str(d), 0o755)             # whatever the umask
    prog = d / "myq.py"
    prog.write_bytes(open(MYQ, "rb").read())
    return str(prog)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
@pytest.mark.parametrize("command", ["worker", "supervise"])
def test_long_running_script_runs_again_from_its_byte_code(
        spool, tmp_path, handlers_dir, procs, command):
    """A worker (or supervisor) started from the one-file copy writes the
    byte code cache beside it and execs itself (same pid, same words after
    the program) with myq.py imported from that cache: it never holds what
    the compile fragmented.  It works on as before and stops on SIGTERM."""
    prog = one_file_copy(tmp_path)
    # each start of an interpreter (a first image, a new one) logs its pid
    site = tmp_path / "site"
    site.mkdir()
    starts = tmp_path / "starts"
    (site / "sitecustomize.py").write_text(
        "import os\nwith open(%r, 'a') as f:\n    f.write('%%d\\n' %% "
        "os.getpid())\n" % str(starts))
    env = clean_env({"PYTHONPATH": str(site)})
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    handlers_dir("t", "cat >/dev/null")
    words = ["--spool", spool, command, "--handlers", handlers_dir.path,
             "--log", str(tmp_path / "w.log")]
    if command == "supervise":
        words += ["--workers", "1"]
    p = procs.spawn([sys.executable, prog] + words, env=env)
    job_id = enqueue(call_myq, spool, "t")
    try:
        wait_for(lambda: has(spool, "done", job_id), timeout=30,
                 what="the job to be done")
        # the new image (code that imports the cache, read from a pipe)
        # shows the words it was started with, written over its own, no
        # byte left over (test_cmdline_cache.py)
        with open("/proc/%d/cmdline" % p.pid, "rb") as f:
            raw = f.read()
        assert raw == "".join(w + "\0" for w in [sys.executable, prog]
                              + words).encode(), raw
        assert starts.read_text().split().count(str(p.pid)) == 2
        assert os.listdir(os.path.join(os.path.dirname(prog), "__pycache__"))
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
@pytest.mark.parametrize("why", ["no-cache", "others-may-write"])
def test_no_second_start_without_a_safe_byte_code_cache(
        spool, tmp_path, handlers_dir, procs, why):
    """The worker runs as it was started, and writes no cache, where there
    can be none (byte code writing off, none beside the copy: it gives the
    heap back with malloc_trim instead), or where others may write the
    copy's directory (as /tmp): byte code there could be anyone's."""
    prog = one_file_copy(tmp_path)
    env = clean_env({"PYTHONDONTWRITEBYTECODE": "1"})
    if why == "others-may-write":
        os.chmod(os.path.dirname(prog), 0o1777)
        del env["PYTHONDONTWRITEBYTECODE"]
    handlers_dir("t", "cat >/dev/null")
    p = procs.spawn([sys.executable, prog, "--spool", spool, "worker",
                     "--handlers", handlers_dir.path], env=env)
    job_id = enqueue(call_myq, spool, "t")
    try:
        wait_for(lambda: has(spool, "done", job_id), timeout=30,
                 what="the job to be done")
        assert cmdline(p.pid)[1] == prog
        assert not os.path.exists(os.path.join(os.path.dirname(prog),
                                               "__pycache__"))
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0


def test_a_drain_does_not_start_again(run_myq, spool, tmp_path, handlers_dir):
    """worker --drain (or --once) ends soon: it is not worth a second
    start, and writes no byte code cache."""
    prog = one_file_copy(tmp_path)
    env = clean_env({})
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    handlers_dir("t", "cat >/dev/null")
    job_id = enqueue(call_myq, spool, "t")
    cp = subprocess.run([sys.executable, prog, "--spool", spool, "worker",
                         "--drain", "--handlers", handlers_dir.path],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        universal_newlines=True, env=env, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert show(call_myq, spool, job_id)["state"] == "done"
    assert not os.path.exists(os.path.join(os.path.dirname(prog), "__pycache__"))
