"""init.d/myq's start through `myq supervise --daemon`, under
`busybox sh` with the helpers of test_initd.py: start returns once the
supervisor runs its first worker, or with the child's own error line.
"""
import os
import re

import pytest

from test_initd import BUSYBOX, SCRIPT, bindirs, children, service  # noqa: F401 (fixtures)
from _core import wait_for

needs_busybox = pytest.mark.skipif(
    not BUSYBOX, reason="busybox not installed (apt-get install busybox)")


@needs_busybox
@pytest.mark.parametrize("kind", ["ssd", "plain"])
def test_start_returns_with_the_worker_running(service, kind):
    """No waiting after start: its OK means the pidfile names the
    supervisor and the supervisor's worker has been started."""
    s = service(kind, settings={"MYQ_WORKERS": "2"})
    r = s.run("start")
    assert r.returncode == 0 and r.stdout == "Starting myq: OK\n", r
    assert r.stderr == ""
    assert " --daemon " in open("/proc/%d/cmdline" % s.pid()).read().replace("\0", " ")
    # both forked by then (a child between its fork and its title still
    # reads "supervise": the supervisor's children are its workers alone)
    assert len(children(s.pid())) == 2, "start returned before the workers started"
    s.wait_workers(2)
    assert s.run("stop").returncode == 0
    assert s.leftovers() == []


@needs_busybox
def test_an_error_of_the_daemon_is_starts_one_line(service):
    """What only the forked supervisor finds (here: its pidfile is a
    symlink, which it does not follow) is said by start, with FAIL and
    exit 1; nothing runs, nothing is made where the link points."""
    s = service("plain")
    os.makedirs(os.path.dirname(s.pidfile))
    target = os.path.join(s.base, "elsewhere")
    os.symlink(target, s.pidfile)
    r = s.run("start")
    assert r.returncode == 1 and r.stdout == "Starting myq: FAIL\n", r
    assert re.match(r"^myq: Too many levels of symbolic links \(%s\)\n$"
                    % re.escape(s.pidfile), r.stderr), r.stderr
    assert not os.path.lexists(target)
    # (the forked supervisor said why, then exits: awaited, not assumed)
    wait_for(lambda: s.leftovers() == [], what="the failed supervisor to exit")
    assert s.run("status").returncode == 3


def test_one_place_runs_myq():
    """The init script runs myq through its myq() function alone, and
    leaves the waiting to supervise --daemon."""
    text = open(SCRIPT).read()
    assert text.count("env -i") == 1
    assert "start-stop-daemon -" not in text and "/proc/uptime" not in text
    assert len(text.splitlines()) <= 200


@needs_busybox
def test_myq_store_sqlite_makes_an_sqlite_spool_and_it_delivers(service):
    """MYQ_STORE=sqlite in /etc/default/myq: start makes a spool of the
    SQLite store (myq-spool(5) SQLITE STORE), its worker runs what is
    enqueued; an existing spool of the other store is refused, saying how
    to move its jobs."""
    from _core import wait_for
    s = service("plain", settings={"MYQ_STORE": "sqlite"})
    r = s.run("start")
    assert r.returncode == 0 and r.stdout == "Starting myq: OK\n", r
    try:
        assert open(os.path.join(s.spool, "store")).read() == "sqlite\n"
        s.myq("enqueue", "ok", '"via sqlite"')
        wait_for(lambda: os.path.exists(s.out) and "via sqlite" in open(s.out).read(),
                 timeout=20, what="the job run")
    finally:
        assert s.run("stop").returncode == 0
    files = service("plain", settings={"MYQ_STORE": "files"})
    os.makedirs(os.path.join(files.spool, "incoming"))
    s.settings["MYQ_STORE"] = "files"
    s.write_defaults()
    r = s.run("start")
    assert r.returncode != 0 and "export" in r.stdout + r.stderr, r
    assert s.leftovers() == []
