"""_core.call_myq, the in-process CLI most tests use for quick commands,
and _core.run_myq, the subprocess most others use (myq.py's code cached by
_core.BOOT), answer exactly like the real program (`python myq.py`): the
same exit status, stdout and stderr, for output and for every kind of
error.  (Not `check --min-free`: its answer holds the free space, which
other tests change meanwhile.)"""
import pytest

import subprocess
import sys

from _core import MYQ, call_myq, clean_env, enqueue, run_myq

CASES = [
    ("version",),
    ("{spool}", "list"),
    ("{spool}", "list", "--json"),
    ("{spool}", "list", "scheduled"),
    ("{spool}", "show", "j1"),
    ("{spool}", "show", "nope"),
    ("{spool}", "show", "x\ny"),
    ("{spool}", "enqueue", "t", "{bad"),
    ("{spool}", "enqueue", "bad type"),
    ("{spool}", "enqueue", "t", "--id", "\u00e9t\u00e9"),
    ("{spool}", "enqueue", "t", "1", "--id", "j1"),
    ("{spool}", "enqueue", "t", "--max-attempts", "x"),
    ("{spool}", "retry", "nope"),
    ("{spool}", "retry"),
    ("{spool}", "delete", "nope"),
    ("{spool}", "list", "bogus"),
    ("{spool}", "frobnicate"),
    ("{spool}",),
    ("{spool}", "check"),
    ("{missing}", "stats"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: " ".join(
    c[1:] if c[0].startswith("{") else c))
def test_call_myq_answers_like_the_program(spool, tmp_path, case):
    enqueue(run_myq, spool, "t", '{"s": "\u00e9t\u00e9\\u2028 \\u0000"}',
            "--id", "j1")
    enqueue(run_myq, spool, "t", "null", "--id", "later", "--delay", "600")
    names = {"{spool}": ["--spool", spool],
             "{missing}": ["--spool", str(tmp_path / "missing")]}
    args = []
    for a in case:
        args += names.get(a, [a])
    script = subprocess.run([sys.executable, MYQ] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, universal_newlines=True,
                            env=clean_env(), timeout=60)
    sub, inproc = run_myq(*args), call_myq(*args)
    assert (sub.returncode, sub.stdout, sub.stderr) == \
        (script.returncode, script.stdout, script.stderr)
    assert (inproc.returncode, inproc.stdout, inproc.stderr) == \
        (sub.returncode, sub.stdout, sub.stderr)
