"""Part I is a program by itself: myq.py without the sections of Part II
(test_structure's PART_II: the SQLite store, HTTP forwarding, MQTT,
intake, install, the process image) makes a spool, takes a job, runs it
with a --module handler, says its statistics and checks a supervisor's
options; what it lacks is said, not a traceback."""
import os
import re
import subprocess
import sys

from _core import MYQ, clean_env
from test_structure import HEADER, PART_II


def _core_alone(tmp_path):
    with open(MYQ) as f:
        lines = f.read().split("\n")
    out, skip = [], False
    for line in lines:
        m = HEADER.match(line)
        if m:
            skip = m.group(1) in PART_II
        if not skip:
            out.append(line)
    path = tmp_path / "myq.py"
    path.write_text("\n".join(out))
    assert len(out) < len(lines) * 0.8
    return str(path)


def _run(core, *args):
    return subprocess.run([sys.executable, core] + list(args), env=clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=60)


def test_the_core_runs_a_job_without_the_extensions(tmp_path):
    core = _core_alone(tmp_path)
    spool = str(tmp_path / "spool")
    handlers = tmp_path / "h.py"
    handlers.write_text("def t(job):\n    print('ran', job['payload'])\n")
    assert _run(core, "--spool", spool, "init").returncode == 0
    cp = _run(core, "--spool", spool, "enqueue", "t", '{"a": 1}')
    assert cp.returncode == 0, cp.stderr
    cp = _run(core, "--spool", spool, "worker", "--drain", "--module",
              str(handlers))
    assert cp.returncode == 0 and "ran {'a': 1}" in cp.stdout, cp.stderr
    cp = _run(core, "--spool", spool, "stats")
    assert cp.returncode == 0 and " done=1 " in cp.stdout, cp.stdout
    cp = _run(core, "--spool", spool, "supervise", "--dry-run", "--module",
              str(handlers))
    assert cp.returncode == 0, cp.stderr


def test_what_the_core_lacks_is_said(tmp_path):
    core = _core_alone(tmp_path)
    spool = str(tmp_path / "spool")
    cp = _run(core, "--spool", spool, "init", "--store", "sqlite")
    assert cp.returncode == 64 and "unknown store 'sqlite'" in cp.stderr, cp.stderr
    cp = _run(core, "--spool", spool, "intake")
    assert cp.returncode == 64 and "Traceback" not in cp.stderr, cp.stderr
    assert re.search(r"invalid choice: 'intake'", cp.stderr), cp.stderr
    assert os.path.basename(MYQ) == "myq.py"
