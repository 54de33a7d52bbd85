"""A handler run whose worker died before recording it (between starting
the handler and writing locks/workers/TOKEN.run) is killed before its job
runs again, as a recorded one is: found by its MYQ_CLAIM alone.  Without
that, the job's next run goes on beside the orphaned one."""
import os
import subprocess
import sys

from _core import MYQ, clean_env, run_myq, wait_for

# a worker that dies (as kill -9 would) just before it records its handler
DIES = r"""
import os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import myq
def hook(op, path, when):
    if op == "create" and path.endswith(".run") and when == "before":
        os._exit(9)
myq._hook = hook
sys.exit(myq.main(sys.argv[2:]))
"""


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_an_unrecorded_run_is_killed_before_its_job_runs_again(
        spool, tmp_path, handlers_dir):
    pids = tmp_path / "pids"
    h = handlers_dir("w", 'echo $$ >> "%s"\nexec sleep 60' % pids)
    jid = run_myq("--spool", spool, "enqueue", "w", "{}").stdout.strip()
    cp = subprocess.run(
        [sys.executable, "-c", DIES, MYQ, "--spool", spool, "worker",
         "--drain", "--handlers", h],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True, timeout=60)
    assert cp.returncode == 9, cp.stderr
    wait_for(lambda: pids.exists() and pids.read_text().strip(),
             what="the handler's start")
    orphan = int(pids.read_text().split()[0])
    try:
        assert _alive(orphan)       # its own session: the worker's death left it
        cp = run_myq("--spool", spool, "reap")
        assert cp.returncode == 0, cp.stderr
        wait_for(lambda: not _alive(orphan), timeout=10,
                 what="the orphaned run killed by the reap")
    finally:
        if _alive(orphan):
            os.kill(orphan, 9)
    assert jid
