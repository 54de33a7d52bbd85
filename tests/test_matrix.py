"""myq runs on CPython 3.7 through 3.13.

The core flow (init, enqueue through the CLI and the API, a draining worker
with an exec handler and a --module handler, a retry into dlq/, the status
line, show/list/retry/delete/reap/prune/check) as real subprocesses, on EVERY
CPython >= 3.7 that pyenv has on this machine (called directly, never through
the shim).  Without pyenv only sys.executable is tested, and the test ids say
so (`sys.executable-…-no-pyenv`).
"""
import json
import os
import re
import subprocess

import pytest

from _core import MYQ, ROOT, STATUS_RE, clean_env, myq_argv
from _pythons import (IDS, PYENV_ROOT, PYTHONS, by_minor, result_of,
                      start_parallel)

ID_RE = re.compile(r"^\d{13}-[0-9a-f]{8}$")
ENV = clean_env({"PYTHONDONTWRITEBYTECODE": "1"})   # no .pyc of 7 versions in ROOT


def run(py, *args, input=None, timeout=60, script=False):
    """myq.py on `py`: `script`, as `py myq.py`; else from the code `py`
    compiled for the flow's first command (_core.BOOT)."""
    return subprocess.run(
        ([py, MYQ] if script else myq_argv(py)) + [str(a) for a in args],
        input=input,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True, env=ENV, timeout=timeout)


def ok(cp):
    assert cp.returncode == 0, (cp.args, cp.returncode, cp.stderr)
    return cp.stdout


def sh(path, body):
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, 0o755)


MODULE = '''
import json, os
import myq

OUT = %r


def _write(job):
    with open(os.path.join(OUT, job["id"]), "w") as f:
        json.dump({"payload": job["payload"], "attempts": job["attempts"],
                   "type": job["type"]}, f)


def mod_ok(job):
    _write(job)


def mod_perm(job):
    raise myq.PermanentError("refused " + job["id"])


def _fail(job):
    raise ValueError("bad thing %%d" %% job["attempts"])


# With a HANDLERS dict, exactly its entries are the types.
HANDLERS = {"mod-ok": mod_ok, "mod_ok": mod_ok, "mod_perm": mod_perm,
            "mod-fail": _fail}
'''


def test_interpreters_found():
    """Say which interpreters the matrix covers (and fail on a broken pyenv)."""
    assert PYTHONS
    if PYENV_ROOT is None:
        pytest.skip("pyenv not found: only sys.executable is tested (%s)" % IDS)
    assert all(v >= (3, 7) for _, _, v in PYTHONS)


@pytest.mark.parametrize("py", [p[1] for p in PYTHONS], ids=IDS)
def test_compiles_without_warnings(py, tmp_path):
    """Every interpreter byte-compiles myq.py with warnings as errors (e.g.
    an invalid escape sequence is a SyntaxWarning on 3.12+)."""
    cp = subprocess.run(
        [py, "-W", "error", "-c",
         "import py_compile, sys; py_compile.compile(sys.argv[1], "
         "cfile=sys.argv[2], doraise=True)", MYQ, str(tmp_path / "myq.pyc")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
        timeout=60)
    assert cp.returncode == 0, cp.stderr


def test_parses_with_python37(tmp_path):
    """The oldest supported grammar: 3.7 parses and compiles myq.py."""
    py = by_minor(7)
    if py is None:
        pytest.skip("no CPython 3.7 here (pyenv: %s)" % (PYENV_ROOT or "absent"))
    cp = subprocess.run(
        [py, "-c", "import ast, py_compile, sys; src = open(sys.argv[1]).read(); "
         "ast.parse(src, sys.argv[1]); py_compile.compile(sys.argv[1], "
         "cfile=sys.argv[2], doraise=True); print(sys.version_info[:2])",
         MYQ, str(tmp_path / "myq37.pyc")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
        timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "(3, 7)"


@pytest.fixture(scope="module")
def flows(request, tmp_path_factory):
    """The flow runs on every selected interpreter at once; each test below
    reports the result of one interpreter."""
    return start_parallel(request, tmp_path_factory, "test_core_flow", core_flow)


@pytest.mark.slow
@pytest.mark.parametrize("ident", IDS)
def test_core_flow(ident, flows):
    result_of(flows, ident)


def core_flow(py, tmp_path):
    spool = str(tmp_path / "q" / "spool")
    out = tmp_path / "out"
    out.mkdir()
    hdir = tmp_path / "handlers"
    hdir.mkdir()
    sh(str(hdir / "ok"), 'cat > "%s/$MYQ_JOB_ID"\n'
       'echo "$MYQ_ATTEMPT $MYQ_MAX_ATTEMPTS $MYQ_JOB_TYPE" > "%s/$MYQ_JOB_ID.env"'
       % (out, out))
    sh(str(hdir / "flaky"), 'echo "boom on attempt $MYQ_ATTEMPT" >&2\nexit 1')
    sh(str(hdir / "perm"), 'echo "bad input" >&2\nexit 65')
    module = tmp_path / "mod.py"
    module.write_text(MODULE % str(out))

    # init (with parents), idempotent; version.  The first as a script.
    ok(run(py, "--spool", spool, "init", script=True))
    ok(run(py, "--spool", spool, "init"))
    for sub in ("tmp", "incoming", "processing", "done", "dlq", "failed", "locks"):
        assert os.path.isdir(os.path.join(spool, sub)), sub

    # enqueue through the CLI
    assert ok(run(py, "--spool", spool, "enqueue", "ok", '{"n": 1, "s": "\u00e9t\u00e9"}',
                  "--id", "c1")) == "c1\n"
    gen = ok(run(py, "--spool", spool, "enqueue", "ok")).strip()
    assert ID_RE.match(gen), gen
    assert ok(run(py, "--spool", spool, "enqueue", "ok", "-", "--id", "c3",
                  input='[1, 2, {"k": null}]\n')) == "c3\n"
    ok(run(py, "--spool", spool, "enqueue", "flaky", "--id", "f1",
           "--max-attempts", "2"))
    ok(run(py, "--spool", spool, "enqueue", "perm", "7", "--id", "p1"))
    dup = run(py, "--spool", spool, "enqueue", "ok", "--id", "c1")
    assert dup.returncode == 73 and dup.stderr.count("\n") == 1, dup.stderr

    # enqueue through the Python API, with the same interpreter
    api = subprocess.run(
        [py, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import myq; "
         "s = sys.argv[2]; "
         "print(myq.enqueue(s, 'mod_ok', {'k': [1, 2.5, 'x']}, id='a1')); "
         "print(myq.enqueue(s, 'mod-fail', None, id='a2', max_attempts=2)); "
         "print(myq.enqueue(s, 'mod_perm', 1, id='a3'));"
         "print(myq.enqueue(s, 'mod_ok', 'later', id='a4', delay=3600))\n"
         "try:\n    myq.enqueue(s, 'mod_ok', id='a1')\n"
         "except myq.DuplicateJob:\n    print('dup')\n",
         ROOT, spool],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
        env=ENV, timeout=60)
    assert api.returncode == 0, api.stderr
    assert api.stdout.split() == ["a1", "a2", "a3", "a4", "dup"]

    st = json.loads(ok(run(py, "--spool", spool, "stats", "--json")))
    assert (st["ready"], st["scheduled"], st["processing"]) == (8, 1, 0), st

    # the worker: exec handlers, a --module file, retries straight into dlq/
    w = run(py, "--spool", spool, "worker", "--drain", "--handlers", str(hdir),
            "--module", str(module), "--backoff-base", "0", "--jitter", "0",
            "--poll", "0.05", timeout=120)
    assert w.returncode == 0, w.stderr

    jobs = {j["id"]: j for j in map(json.loads, ok(run(
        py, "--spool", spool, "list", "--json")).splitlines())}
    assert sorted(jobs) == sorted(["c1", gen, "c3", "a1", "a2", "a3", "a4",
                                   "f1", "p1"])
    for j in jobs.values():
        assert {"id", "type", "state", "attempts", "available_at",
                "last_error"} <= set(j), j
    assert [jobs[i]["state"] for i in ("c1", gen, "c3", "a1")] == ["done"] * 4
    with open(str(out / "c1")) as f:
        assert json.load(f) == {"n": 1, "s": "\u00e9t\u00e9"}
    assert (out / "c1.env").read_text().split() == ["1", "5", "ok"]
    with open(str(out / gen)) as f:
        assert json.load(f) is None
    with open(str(out / "c3")) as f:
        assert json.load(f) == [1, 2, {"k": None}]
    with open(str(out / "a1")) as f:
        assert json.load(f) == {"payload": {"k": [1, 2.5, "x"]}, "attempts": 1,
                                "type": "mod_ok"}
    f1 = json.loads(ok(run(py, "--spool", spool, "show", "f1")))
    assert set(f1.pop("iso")) == {"created_at", "updated_at", "available_at",
                                  "failed_at"}        # show's ISO times
    assert f1 == dict(jobs["f1"], state="dead")
    assert (f1["state"], f1["attempts"]) == ("dead", 2), f1
    assert "boom on attempt 2" in f1["last_error"] and "failed_at" in f1
    p1 = jobs["p1"]
    assert (p1["state"], p1["attempts"]) == ("dead", 1), p1
    assert "bad input" in p1["last_error"]
    a2 = jobs["a2"]
    assert (a2["state"], a2["attempts"]) == ("dead", 2), a2
    assert "ValueError" in a2["last_error"] and "bad thing 2" in a2["last_error"]
    a3 = jobs["a3"]
    assert (a3["state"], a3["attempts"]) == ("dead", 1)
    assert "PermanentError" in a3["last_error"] and "refused a3" in a3["last_error"]
    assert jobs["a4"]["state"] == "scheduled"

    # the status line, and its JSON twin
    line = ok(run(py, "--spool", spool, "stats")).rstrip("\n")
    assert "\n" not in line and STATUS_RE.match(line), line
    assert " queue=spool ready=0 processing=0 done=4 dead=4 " in line, line
    st = json.loads(ok(run(py, "--spool", spool, "stats", "--json")))
    assert st["queue"] == "spool"
    assert all(type(v) is int for k, v in st.items()
               if k not in ("queue", "held", "paused", "destinations",
                            "dropped_by", "types", "budget_bytes",
                            "outage_capacity_s")), st
    assert st["held"] == [], st
    assert (st["done"], st["dead"], st["scheduled"], st["retries_1m"]) == (4, 4, 1, 2)

    # list, one line per job starting with its id
    lines = ok(run(py, "--spool", spool, "list", "dead")).splitlines()
    assert sorted(l.split()[0] for l in lines) == ["a2", "a3", "f1", "p1"]
    assert all(l.split()[1] == "dead" for l in lines), lines

    # retry a dead job with a repaired handler; delete another
    assert ok(run(py, "--spool", spool, "retry", "f1")).strip() == "retried=1"
    f1 = json.loads(ok(run(py, "--spool", spool, "show", "f1")))
    assert (f1["state"], f1["attempts"]) == ("ready", 0), f1
    sh(str(hdir / "flaky"), 'cat > "%s/$MYQ_JOB_ID"' % out)
    ok(run(py, "--spool", spool, "worker", "--drain", "--handlers", str(hdir),
           "--poll", "0.05", timeout=120))
    assert ok(run(py, "--spool", spool, "delete", "p1")).strip() == "deleted=1"
    gone = run(py, "--spool", spool, "show", "p1")
    assert gone.returncode == 66 and gone.stderr.count("\n") == 1
    st = json.loads(ok(run(py, "--spool", spool, "stats", "--json")))
    assert (st["done"], st["dead"]) == (5, 2), st

    # housekeeping commands
    assert ok(run(py, "--spool", spool, "reap")).strip() == "requeued=0"
    pr = ok(run(py, "--spool", spool, "prune")).split()
    assert pr and all(re.match(r"^\w+=\d+$", kv) for kv in pr), pr
    chk = run(py, "--spool", spool, "check")     # the 2 dead jobs need an operator
    assert chk.returncode == 1, chk.stdout + chk.stderr
    assert chk.stdout.startswith("2 dead job(s) in dlq/"), chk.stdout
    ok(run(py, "--spool", spool, "delete", "--force", *[
        j["id"] for j in map(json.loads, ok(run(py, "--spool", spool, "list",
                                                "dead", "--json")).splitlines())]))
    chk = run(py, "--spool", spool, "check")
    assert chk.returncode == 0, chk.stdout + chk.stderr
    missing = run(py, "--spool", str(tmp_path / "nope"), "stats")
    assert missing.returncode == 78 and not (tmp_path / "nope").exists()
