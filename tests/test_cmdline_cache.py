"""A long-running command of myq.py run as a script starts again from
its byte code (The process image: _run_from_cache); its command line, as
ps and /proc/PID/cmdline show it, is the one it was started with, with
the byte-code cache (PYTHONDONTWRITEBYTECODE unset: a device) or without
it (set: the suite's machine), whatever the caller's environment.

Before: the new image's -c text (a kilobyte) stayed as NUL padding after
the words, in the supervisor's line and in every worker forked from it.
"""
import os
import shutil
import signal
import subprocess
import sys

import pytest

from _core import MYQ, clean_env, wait_for
from _procs import children, wait_gone

CACHE = {"cache": None, "no cache": "1"}


def _raw(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _line(words):
    return b"".join(os.fsencode(w) + b"\0" for w in words)


@pytest.fixture
def copy(tmp_path):
    """myq.py in a directory of its own: no byte code beside it yet."""
    d = tmp_path / "lib"
    d.mkdir()
    shutil.copy(MYQ, str(d / "myq.py"))
    return str(d / "myq.py")


def _env(dont_write):
    env = clean_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if dont_write:
        env["PYTHONDONTWRITEBYTECODE"] = dont_write
    return env


def _pyc(copy):
    d = os.path.join(os.path.dirname(copy), "__pycache__")
    return os.listdir(d) if os.path.isdir(d) else []


@pytest.mark.parametrize("which", sorted(CACHE))
def test_a_worker_run_as_a_script_shows_the_line_it_was_started_with(
        copy, tmp_path, which):
    """`python3 myq.py --spool SPOOL worker` (with -B too): its
    /proc/PID/cmdline is those words, byte for byte."""
    spool = str(tmp_path / "q")
    env = _env(CACHE[which])
    subprocess.run([sys.executable, copy, "--spool", spool, "init"],
                   env=env, check=True)
    for flags in ([], ["-B"]):
        argv = [sys.executable] + flags + [copy, "--spool", spool, "worker",
                                           "--poll", "0.05"]
        p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: os.listdir(os.path.join(spool, "locks", "workers")),
                     what="the worker's record")
            # (-B: the new image's title names no interpreter flags)
            want = _line([sys.executable, copy] + argv[2 + len(flags):]) \
                if CACHE[which] is None else _line(argv)
            assert _raw(p.pid) == want
        finally:
            p.terminate()
            p.wait(15)
        wait_for(lambda: not os.listdir(os.path.join(spool, "locks", "workers")),
                 what="the record gone")
    assert bool(_pyc(copy)) == (CACHE[which] is None), _pyc(copy)


@pytest.mark.parametrize("which", sorted(CACHE))
def test_supervise_and_its_workers_show_clean_lines(copy, tmp_path, which):
    """supervise --daemon: the supervisor's line is the one it was started
    with; each worker forked from it shows `python3 myq.py --spool SPOOL
    worker --parent-pid PID ...` in the supervisor's room, no more."""
    spool = str(tmp_path / "q")
    env = _env(CACHE[which])
    subprocess.run([sys.executable, copy, "--spool", spool, "init"],
                   env=env, check=True)
    argv = [sys.executable, copy, "--spool", spool, "supervise", "--daemon",
            "--pidfile", spool + ".pid", "--log", spool + ".log",
            "--workers", "2", "--handlers", str(tmp_path)]
    subprocess.run(argv, env=env, check=True, timeout=60)
    with open(spool + ".pid") as f:
        sup = int(f.read())
    try:
        def workers():
            kids = [k for k in children([sup]) if b"\0worker\0" in _raw(k)]
            return kids if len(kids) == 2 else None
        for w in wait_for(workers, what="2 workers"):
            raw = _raw(w)
            words = raw.rstrip(b"\0").split(b"\0")
            assert words[:7] == [os.fsencode(x) for x in (
                sys.executable, copy, "--spool", spool, "worker",
                "--parent-pid", str(sup))], raw
            assert len(raw) == len(_line(argv)), raw
        assert _raw(sup) == _line(argv)
    finally:
        os.kill(sup, signal.SIGTERM)
        wait_gone(sup, 30)
    assert bool(_pyc(copy)) == (CACHE[which] is None), _pyc(copy)
