"""`myq supervise --daemon`: the init script's start.

The command forks; the child leads its own session, writes the pidfile and
starts its first worker, then says so through a pipe; the command exits 0
only then, or with the child's error (one line on stderr, its exit status).
It holds none of the caller's descriptors: a shell's $(...) around it
returns at once.
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from _core import MYQ, ROOT, clean_env, one_line_error, wait_for
from _procs import alive, children, proc_stat

# The store plays no part in what these prove: `make test-sqlite` leaves them out.
pytestmark = pytest.mark.store_free("supervise --daemon's fork, session, pidfile and descriptors")


def daemon(spool, tmp_path, *extra, **kw):
    """Run `supervise --daemon` -> CompletedProcess; `pass_fds`: descriptors
    the caller leaks into it (as BusyBox ash does)."""
    argv = [sys.executable, MYQ, "--spool", spool, "supervise", "--daemon",
            "--pidfile", str(tmp_path / "myq.pid"),
            "--log", str(tmp_path / "myq.log"), "--poll", "0.05"] + list(extra)
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, env=clean_env(), cwd="/",
                          timeout=30, pass_fds=kw.get("pass_fds", ()))


def stop(spool, tmp_path):
    cp = subprocess.run([sys.executable, MYQ, "--spool", spool, "supervise",
                         "--stop", "--pidfile", str(tmp_path / "myq.pid"),
                         "--stop-timeout", "5"], env=clean_env(), timeout=60,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        universal_newlines=True)
    assert cp.returncode == 0, cp.stderr


def read_pid(tmp_path):
    with open(str(tmp_path / "myq.pid")) as f:
        return int(f.read())


def fds(pid):
    d = "/proc/%d/fd" % pid
    return dict((int(n), os.readlink(os.path.join(d, n))) for n in os.listdir(d))


def test_daemon_is_ready_when_the_command_returns(spool, tmp_path, handlers_dir):
    """Exit 0, nothing printed; by then the pidfile names the supervisor,
    which leads its own session, is no child of the caller's, and has
    started its worker; a pipe the caller leaked is not held."""
    handlers_dir("t", "cat >/dev/null")
    r, w = os.pipe()
    try:
        cp = daemon(spool, tmp_path, "--handlers", handlers_dir.path,
                    pass_fds=(w,))
        os.close(w)
        pid = read_pid(tmp_path)
        assert cp.returncode == 0 and cp.stdout == cp.stderr == "", cp
        st = proc_stat(pid)
        assert st[2] == pid, "the supervisor leads its own process group"
        assert os.getsid(pid) == pid, "and its own session"
        assert children([pid]), "the first worker runs when the command returns"
        held = fds(pid)
        assert sorted(held)[:3] == [0, 1, 2] and held[0] == os.devnull
        assert held[1] == held[2] == str(tmp_path / "myq.log")
        os.set_blocking(r, False)
        assert os.read(r, 1) == b"", "the leaked pipe is still held open"
        (worker,) = children([pid])
        assert "worker" in open("/proc/%d/cmdline" % worker).read().split("\0")
    finally:
        os.close(r)
        stop(spool, tmp_path)
    wait_for(lambda: not alive(pid), what="the supervisor to stop")
    assert not os.path.exists(str(tmp_path / "myq.pid"))
    log = open(str(tmp_path / "myq.log")).read()
    assert "event=worker_start" in log and "event=supervise_stop" in log


def test_shell_substitution_returns_at_once(spool, tmp_path, handlers_dir):
    """What the init script does: $(myq supervise --daemon 2>&1 >/dev/null)
    in a function, under sh: it returns (the daemon keeps neither the
    substitution's pipe nor a descriptor the shell saved)."""
    handlers_dir("t", "cat >/dev/null")
    script = textwrap.dedent("""\
        m() { "$@"; }
        out=$(m "%s" "%s" --spool "%s" supervise --daemon --pidfile "%s" \\
              --log "%s" --handlers "%s" 2>&1 >/dev/null) || exit 9
        printf 'ok [%%s]\\n' "$out"
        """) % (sys.executable, MYQ, spool, tmp_path / "myq.pid",
                tmp_path / "myq.log", handlers_dir.path)
    busybox = shutil.which("busybox")
    argv = [busybox, "sh", "-c", script] if busybox else ["sh", "-c", script]
    try:
        cp = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            universal_newlines=True, env=clean_env(), timeout=20)
        assert cp.returncode == 0 and cp.stdout == "ok []\n", cp
        assert alive(read_pid(tmp_path))
    finally:
        stop(spool, tmp_path)


def test_a_second_start_refuses_while_the_first_runs(spool, tmp_path):
    """Two starts at once (two init scripts) ran two supervisors, and stop
    then left one running: the pidfile is held while the
    supervisor lives; the second says so (78) and runs nothing."""
    cp = daemon(spool, tmp_path)
    assert cp.returncode == 0, cp
    first = read_pid(tmp_path)
    try:
        cp = daemon(spool, tmp_path)
        assert cp.returncode == 78 and "another myq supervise runs" in \
            cp.stderr, cp
        one_line_error(cp)
        assert read_pid(tmp_path) == first and alive(first)
        def supervisors():
            out = []
            for p in procs_of(spool):
                try:
                    if "\0supervise\0" in open("/proc/%d/cmdline" % p).read():
                        out.append(p)
                except OSError:
                    pass
            return out
        wait_for(lambda: supervisors() == [first], what="one supervisor")
    finally:
        stop(spool, tmp_path)


def test_pidfile_with_another_hard_link_is_the_error(spool, tmp_path):
    """The child refuses the pidfile: the command says so (exit 78, one
    line), nothing runs, the linked file is untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.link(str(victim), str(tmp_path / "myq.pid"))
    cp = daemon(spool, tmp_path)
    assert cp.returncode == 78, cp
    one_line_error(cp)
    assert "has 2 hard links" in cp.stderr
    assert victim.read_text() == "precious\n"
    wait_for(lambda: not procs_of(spool), what="the child to exit")


def test_stop_on_a_stale_pidfile_leaves_a_group_of_that_number(spool, tmp_path):
    """The supervisor died (the OOM killer); its pid is now the number of
    another program's process group whose leader left (a daemon that
    forked twice): stop waited for that group and SIGKILLed it.
    Of a dead supervisor, only the workers it started are its own."""
    sh = subprocess.Popen(["sh", "-c", "sleep 60 </dev/null >/dev/null 2>&1 & "
                           "echo $!"], stdout=subprocess.PIPE,
                          universal_newlines=True, start_new_session=True)
    other = int(sh.stdout.readline())
    sh.wait(10)                         # the group's leader is gone
    try:
        assert proc_stat(other)[2] == sh.pid    # (its group: the dead pid)
        (tmp_path / "myq.pid").write_text("%d\n" % sh.pid)
        cp = subprocess.run([sys.executable, MYQ, "--spool", spool, "supervise",
                             "--stop", "--pidfile", str(tmp_path / "myq.pid"),
                             "--stop-timeout", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, universal_newlines=True,
                            env=clean_env(), timeout=30)
        assert cp.returncode == 0, cp.stderr
        assert alive(other), "stop killed another program's process group"
    finally:
        os.kill(other, signal.SIGKILL)


def procs_of(spool):
    found = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and alive(int(p)) and spool in open(
                    "/proc/%s/cmdline" % p, errors="replace").read():
                found.append(int(p))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("what", ["no-dir", "fifo-log"])
def test_other_errors_are_said_with_their_status(spool, tmp_path, what):
    if what == "no-dir":     # the child cannot create the pidfile
        cp = subprocess.run([sys.executable, MYQ, "--spool", spool, "supervise",
                             "--daemon", "--pidfile", str(tmp_path / "no" / "pid"),
                             "--log", str(tmp_path / "log")], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            universal_newlines=True, timeout=30)
        assert cp.returncode == 75, cp
        assert str(tmp_path / "no" / "pid") in cp.stderr
    else:                   # the log cannot be opened: said before the fork
        os.mkfifo(str(tmp_path / "myq.log"))
        cp = daemon(spool, tmp_path)
        assert cp.returncode == 78, cp
        assert "cannot open log file" in cp.stderr
    one_line_error(cp)
    assert not os.path.exists(str(tmp_path / "myq.pid"))


def test_dry_run_and_bad_options_never_fork(spool, tmp_path):
    cp = daemon(spool, tmp_path, "--dry-run")
    assert cp.returncode == 0 and not os.path.exists(str(tmp_path / "myq.pid"))
    cp = daemon(spool, tmp_path, "--no-such-option")
    assert cp.returncode == 64 and "--no-such-option" in cp.stderr
    one_line_error(cp)


RUN = textwrap.dedent("""\
    import os, sys
    sys.path.insert(0, %r)
    import myq
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        %s
    os.close(w)
    try:
        print(myq.await_daemon(pid, r, "LOG", timeout=%s))
    except myq.MyqError as e:
        print(e.code, e)
    """)


def await_with(child, timeout=20):
    code = RUN % (ROOT, child, timeout)
    cp = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, universal_newlines=True,
                        env=clean_env(), timeout=60)
    assert cp.returncode == 0, cp.stderr
    return cp.stdout.strip()


@pytest.mark.parametrize("child, said", [
    ("os.write(w, b'0 \\n'); os._exit(0)", "0"),
    ("os.write(w, b'78 pidfile x: no\\n'); os._exit(0)", "78 pidfile x: no"),
    ("os._exit(3)", "3 the supervisor exited at once; see LOG"),
    ("os.kill(os.getpid(), 9)", "1 the supervisor exited at once; see LOG"),
])
def test_await_daemon_reads_the_childs_word(child, said):
    assert await_with(child) == said


def test_await_daemon_gives_up_on_a_silent_child():
    got = await_with("import time; n = os.open(os.devnull, os.O_RDWR); "
                     "os.dup2(n, 1); os.dup2(n, 2); time.sleep(30)", timeout=0.5)
    assert got.startswith("1 the supervisor (pid ") and "see LOG" in got, got
    os.kill(int(got.split("(pid ")[1].split(")")[0]), signal.SIGKILL)


def test_a_first_worker_that_cannot_start_is_the_error(spool, tmp_path):
    """The child cannot start its worker (no such interpreter): the caller
    hears why, and the supervisor stops (its pidfile gone)."""
    pidfile = str(tmp_path / "myq.pid")
    child = ("sup = myq.Supervisor(myq.open_store(%r), 1, [], myq.Log(path=%r), "
             "pidfile=%r, python='/nonexistent/python3', ready=w); "
             "os._exit(sup.run())" % (spool, str(tmp_path / "log"), pidfile))
    got = await_with(child)
    assert got == "1 cannot start a worker: No such file or directory", got
    wait_for(lambda: not os.path.exists(pidfile), what="the pidfile to go")


def test_a_supervisor_stopped_before_its_first_worker_says_so(spool, tmp_path):
    child = ("import signal; "
             "sup = myq.Supervisor(myq.open_store(%r), 1, [], myq.Log(path=%r), "
             "ready=w); sup.stop = 1; os._exit(sup.run())"
             % (spool, str(tmp_path / "log")))
    assert await_with(child) == \
        "1 the supervisor stopped before its first worker started"


def test_sigterm_stops_the_daemon(spool, tmp_path, handlers_dir):
    """The supervisor started by --daemon stops on SIGTERM like any other:
    its workers first, then it, then its pidfile."""
    handlers_dir("t", "cat >/dev/null")
    cp = daemon(spool, tmp_path, "--handlers", handlers_dir.path)
    assert cp.returncode == 0, cp
    pid = read_pid(tmp_path)
    workers = list(children([pid]))
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not alive(pid) and not any(alive(w) for w in workers),
             what="the supervisor and its worker to stop")
    assert not os.path.exists(str(tmp_path / "myq.pid"))
