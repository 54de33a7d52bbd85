"""`myq supervise` forks its children: the workers, the intake
and the final reap are forks of the supervisor, sharing its pages, not
new interpreters that load myq again; each is retitled (its command line
rewritten in place) so that ps, the init scripts and `supervise --stop`
see a worker, an intake, never a second supervisor.  Where the title does
not fit in the supervisor's command line, the child is exec'd as before.

What tells a fork from an exec here: anonymous pages shared with the
supervisor (Shared_Dirty of /proc/PID/smaps_rollup: an exec'd process
starts with none) and the same interpreter (/proc/PID/exe).
"""
import os
import shutil
import signal
import subprocess
import sys

import pytest

from _core import MYQ, call_myq, clean_env, enqueue, has, wait_for
from _procs import alive, children
from _core import cmdline, free_port
from test_intake import auth, post

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"),
                                reason="needs /proc/PID/smaps_rollup")


def shared_dirty_kb(pid):
    with open("/proc/%d/smaps_rollup" % pid) as f:
        for line in f:
            if line.startswith("Shared_Dirty:"):
                return int(line.split()[1])
    return 0


def kinds(sup):
    """{pid: "worker" | "intake" | ...} of the supervisor's children."""
    out = {}
    for p in children([sup.pid]):
        try:
            words = cmdline(p)
        except OSError:
            continue
        for k in ("worker", "intake", "supervise"):
            if k in words:
                out[p] = k
    return out


def workers(sup):
    """The supervisor's children that are workers by now: one seen between
    its fork and its title (or exec) still reads "supervise"."""
    return [p for p, k in kinds(sup).items() if k == "worker"]


def forked(pid, sup):
    return os.readlink("/proc/%d/exe" % pid) == os.readlink("/proc/%d/exe" % sup) \
        and shared_dirty_kb(pid) > 1024


def start(argv, log, env=None):
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                            stderr=open(log, "ab"), env=env or clean_env(),
                            start_new_session=True)


def finish(sup):
    if sup.poll() is None:
        sup.send_signal(signal.SIGTERM)
    try:
        return sup.wait(30)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)


def test_children_are_forked_and_named_for_what_they_are(spool, tmp_path,
                                                          handlers_dir):
    handlers_dir("t", "cat >/dev/null")
    log = str(tmp_path / "sup.log")
    port = free_port()
    sup = start([sys.executable, MYQ, "--spool", spool, "supervise", "--workers",
                 "2", "--handlers", handlers_dir.path, "--log", log,
                 "--listen", "127.0.0.1:%d" % port, "--poll", "0.05"], log)
    try:
        got = wait_for(lambda: (lambda k: sorted(k.values()) == [
            "intake", "worker", "worker"] and k)(kinds(sup)), timeout=30,
            what="two workers and an intake")
        for pid, kind in got.items():
            words = cmdline(pid)
            assert forked(pid, sup.pid), (kind, shared_dirty_kb(pid))
            assert "supervise" not in words and "--spool" in words, words
            line = " ".join(words)
            assert " --spool %s %s --parent-pid %d " % (spool, kind, sup.pid) \
                in line, line
            assert words[:2] == [sys.executable, MYQ], words
        assert "supervise" in cmdline(sup.pid)
        # they work: a job in through the intake, done by a worker
        wait_for(lambda: "event=intake_start" in open(log).read(),
                 what="the intake to listen")
        assert post(port, "t", "1", auth(spool))[0] == 202
        jid = enqueue(call_myq, spool, "t")
        wait_for(lambda: has(spool, "done", jid), timeout=30,
                 what="the job done")
    finally:
        assert finish(sup) == 0
    text = open(log).read()
    assert "event=supervise_stop" in text and "Traceback" not in text, text


def test_a_killed_child_is_forked_again(spool, tmp_path, handlers_dir):
    handlers_dir("t", "cat >/dev/null")
    log = str(tmp_path / "sup.log")
    sup = start([sys.executable, MYQ, "--spool", spool, "supervise",
                 "--handlers", handlers_dir.path, "--log", log], log)
    try:
        (first,) = wait_for(lambda: workers(sup), timeout=30, what="a worker")
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: [p for p in workers(sup) if p != first],
                          timeout=30, what="a new worker")[0]
        assert forked(second, sup.pid) and "worker" in cmdline(second)
        assert "event=worker_exit slot=0 pid=%d status=-9" % first in open(log).read()
        jid = enqueue(call_myq, spool, "t")
        wait_for(lambda: has(spool, "done", jid), timeout=30,
                 what="the job done")
    finally:
        assert finish(sup) == 0


def test_sighup_reopens_the_log_in_the_children(spool, tmp_path, handlers_dir):
    """logrotate's way: the log renamed, SIGHUP to the supervisor; every
    child then writes to a new file of the old name."""
    handlers_dir("t", "cat >/dev/null")
    log = str(tmp_path / "sup.log")
    sup = start([sys.executable, MYQ, "--spool", spool, "supervise", "--workers",
                 "2", "--handlers", handlers_dir.path, "--log", log], log)

    def logs(pid):
        d = "/proc/%d/fd" % pid
        out = set()
        for n in os.listdir(d):
            try:
                out.add(os.readlink(os.path.join(d, n)))
            except OSError:
                pass
        return out

    try:
        # As soon as the children are there, before their workers' own
        # handlers maybe: a child keeps SIGHUP blocked until its worker's
        # handler is in place, which then gets it (not ignored, not lost)
        wait_for(lambda: len(kinds(sup)) == 2, timeout=30, what="two children")
        os.rename(log, log + ".1")
        sup.send_signal(signal.SIGHUP)
        pids = wait_for(lambda: len(workers(sup)) == 2 and workers(sup),
                        timeout=30, what="two workers")
        wait_for(lambda: all(log in logs(p) for p in pids + [sup.pid]),
                 what="every process to reopen the log")
        jid = enqueue(call_myq, spool, "t")
        wait_for(lambda: os.path.exists(log) and ("event=done id=" + jid)
                 in open(log).read(), timeout=30, what="the job's line in the new log")
        assert all(alive(p) for p in pids), "SIGHUP kills no child"
    finally:
        assert finish(sup) == 0


def test_a_title_that_does_not_fit_means_an_exec(spool, tmp_path, handlers_dir):
    """A supervisor whose own command line is shorter than a worker's first
    words (everything given in MYQ_* variables): its worker is exec'd, as a
    new interpreter, with the whole command line; it works the same."""
    handlers_dir("t", "cat >/dev/null")
    prog = str(tmp_path / "m")          # not NAME.py: run as it is
    shutil.copy(MYQ, prog)
    log = str(tmp_path / "sup.log")
    env = clean_env({"MYQ_SPOOL": spool, "MYQ_HANDLERS": handlers_dir.path,
                     "MYQ_LOG": log})
    sup = start([sys.executable, prog, "supervise"], log, env=env)
    try:
        # A child seen between its fork and its exec still has the
        # supervisor's command line ("supervise"): wait for the exec'd one.
        (pid,) = wait_for(lambda: workers(sup), timeout=30, what="a worker exec'd")
        words = cmdline(pid)
        assert words[:5] == [sys.executable, prog, "--spool", spool, "worker"]
        assert not forked(pid, sup.pid), shared_dirty_kb(pid)
        jid = enqueue(call_myq, spool, "t")
        wait_for(lambda: has(spool, "done", jid), timeout=30,
                 what="the job done")
    finally:
        assert finish(sup) == 0


def test_title_keeps_the_first_words_and_says_what_it_left_out(myq):
    words = ["py", "myq", "--spool", "/s", "worker", "--parent-pid", "7",
             "--log", "/var/log/myq.log"]
    whole = "\0".join(words).encode() + b"\0"
    assert myq._title((100, 100 + len(whole)), words, 5) == whole
    assert myq._title((100, 100 + len(whole) + 3), words, 5) == whole + b"\0" * 3
    cut = myq._title((0, len(whole) - 1), words, 5)
    assert cut.split(b"\0")[:9] == [w.encode() for w in words[:8]] + [b"..."]
    assert len(cut) == len(whole) - 1
    assert myq._title((0, 20), words, 5) is None      # not even "... worker"
