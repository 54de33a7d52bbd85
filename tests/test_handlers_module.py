"""Python handlers from --module FILE.py (and the Worker API)."""
import json
import shutil
import subprocess
import sys
import time

from _core import MYQ, clean_env, enqueue, show, wait_for
from _core import call_myq, drain

PRELUDE = "import json\nimport myq\nOUT = %r\n"


def module(tmp_path, body):
    out = str(tmp_path / "out")
    p = tmp_path / "handlers_mod.py"
    p.write_text(PRELUDE % out + body)
    return str(p), out


def test_function_named_like_the_type(run_myq, spool, tmp_path):
    mod, out = module(tmp_path, (
        "def greet(job):\n"
        "    with open(OUT, 'w') as f:\n"
        "        json.dump(job, f)\n"))
    job_id = enqueue(call_myq, spool, "greet", '{"who": "py"}', "--id", "g1")
    drain(spool, "--module", mod)
    with open(out) as f:
        seen = json.load(f)
    assert seen["id"] == "g1"
    assert seen["type"] == "greet"
    assert seen["payload"] == {"who": "py"}
    assert seen["attempts"] == 1
    assert show(call_myq, spool, job_id)["state"] == "done"


def test_handlers_dict(run_myq, spool, tmp_path):
    mod, out = module(tmp_path, (
        "def _impl(job):\n"
        "    with open(OUT, 'a') as f:\n"
        "        f.write(job['type'] + '\\n')\n"
        "HANDLERS = {'send-x': _impl, 'other.type': _impl}\n"))
    a = enqueue(call_myq, spool, "send-x")
    b = enqueue(call_myq, spool, "other.type")
    drain(spool, "--module", mod)
    with open(out) as f:
        assert sorted(f.read().split()) == ["other.type", "send-x"]
    assert show(call_myq, spool, a)["state"] == "done"
    assert show(call_myq, spool, b)["state"] == "done"


def test_permanent_error_is_dead(run_myq, spool, tmp_path):
    mod, _ = module(tmp_path, (
        "def t(job):\n"
        "    raise myq.PermanentError('nope-77')\n"))
    job_id = enqueue(call_myq, spool, "t")
    drain(spool, "--module", mod)
    job = show(call_myq, spool, job_id)
    assert job["state"] == "dead", job
    assert job["attempts"] == 1
    assert "nope-77" in job["last_error"]


def test_retry_later_uses_its_delay(run_myq, spool, tmp_path):
    mod, _ = module(tmp_path, (
        "def t(job):\n"
        "    raise myq.RetryLater(30)\n"))
    job_id = enqueue(call_myq, spool, "t")
    t0 = time.time()
    drain(spool, "--module", mod, "--jitter", "0", "--backoff-base", "1000")
    t1 = time.time()
    job = show(call_myq, spool, job_id)
    assert job["state"] == "scheduled", job
    assert job["attempts"] == 1
    assert t0 + 30 - 0.05 <= job["available_at"] <= t1 + 30 + 0.05, (
        job["available_at"] - t0, job["available_at"] - t1)


def test_other_exception_retries_with_backoff(run_myq, spool, tmp_path):
    mod, _ = module(tmp_path, (
        "def t(job):\n"
        "    raise ValueError('bad thing 42')\n"))
    job_id = enqueue(call_myq, spool, "t")
    t0 = time.time()
    drain(spool, "--module", mod, "--jitter", "0", "--backoff-base", "20")
    t1 = time.time()
    job = show(call_myq, spool, job_id)
    assert job["state"] == "scheduled", job
    assert job["attempts"] == 1
    assert t0 + 20 - 0.05 <= job["available_at"] <= t1 + 20 + 0.05
    assert "ValueError" in job["last_error"]
    assert "bad thing 42" in job["last_error"]


def test_other_exception_on_last_attempt_is_dead(run_myq, spool, tmp_path):
    mod, _ = module(tmp_path, "def t(job):\n    raise KeyError('k9')\n")
    job_id = enqueue(call_myq, spool, "t", "null", "--max-attempts", "1")
    drain(spool, "--module", mod)
    job = show(call_myq, spool, job_id)
    assert job["state"] == "dead"
    assert "KeyError" in job["last_error"] and "k9" in job["last_error"]


def test_attempts_is_the_current_run(run_myq, spool, tmp_path):
    mod, out = module(tmp_path, (
        "def t(job):\n"
        "    with open(OUT, 'a') as f:\n"
        "        f.write('%d\\n' % job['attempts'])\n"
        "    if job['attempts'] < 2:\n"
        "        raise myq.RetryLater(0.01)\n"))
    job_id = enqueue(call_myq, spool, "t")

    def done():
        drain(spool, "--module", mod)
        return show(call_myq, spool, job_id)["state"] == "done"

    wait_for(done, timeout=30, what="job done")
    with open(out) as f:
        assert f.read().split() == ["1", "2"]


def test_type_missing_from_module_is_held(run_myq, spool, tmp_path):
    """No function for the type: held, not dead; no attempt spent."""
    mod, _ = module(tmp_path, "def known(job):\n    pass\n")
    job_id = enqueue(call_myq, spool, "unknown_type")
    drain(spool, "--module", mod)
    job = show(call_myq, spool, job_id)
    assert job["state"] == "held" and job["attempts"] == 0, job
    assert "no handler" in job["last_error"].lower()


def test_handlers_dir_wins_over_module(run_myq, spool, tmp_path, handlers_dir):
    mod, out = module(tmp_path, (
        "def t(job):\n"
        "    open(OUT, 'w').write('module')\n"))
    handlers_dir("t", 'echo dir > "%s"' % out)
    job_id = enqueue(call_myq, spool, "t")
    drain(spool, "--module", mod, handlers=handlers_dir.path)
    with open(out) as f:
        assert f.read().strip() == "dir"
    assert show(call_myq, spool, job_id)["state"] == "done"


def test_same_exception_classes_when_run_as_script(run_myq, spool, tmp_path):
    # run_myq runs `python3 myq.py`, so myq is __main__ while the module does
    # `import myq`: PermanentError/RetryLater must still be recognised.
    mod, _ = module(tmp_path, (
        "def perm(job):\n"
        "    raise myq.PermanentError('perm-1')\n"
        "def later(job):\n"
        "    raise myq.RetryLater(500)\n"))
    p = enqueue(call_myq, spool, "perm")
    l = enqueue(call_myq, spool, "later")
    t0 = time.time()
    drain(spool, "--module", mod, "--jitter", "0", "--backoff-base", "5")
    assert show(call_myq, spool, p)["state"] == "dead"
    job = show(call_myq, spool, l)
    assert job["state"] == "scheduled"
    assert job["available_at"] >= t0 + 499


def test_import_myq_works_when_installed_without_py_suffix(spool, tmp_path):
    # copied to /usr/bin/myq; a --module file still does `import myq`.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "myq"
    shutil.copy(MYQ, str(exe))
    mod, out = module(tmp_path, (
        "def t(job):\n"
        "    open(OUT, 'w').write(myq.__name__)\n"
        "    raise myq.PermanentError('from-bin')\n"))
    job_id = enqueue(call_myq, spool, "t")
    cp = subprocess.run(
        [sys.executable, str(exe), "--spool", spool, "worker", "--drain",
         "--poll", "0.05", "--module", mod],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
        env=clean_env(), cwd=str(tmp_path), timeout=60)
    assert cp.returncode == 0, cp.stderr
    job = show(call_myq, spool, job_id)
    assert job["state"] == "dead", job
    assert "from-bin" in job["last_error"]


def test_worker_api_with_registered_handlers(myq, spool):
    seen = []

    def ok(job):
        seen.append((job["id"], job["payload"], job["attempts"]))

    def perm(job):
        raise myq.PermanentError("api-perm")

    a = myq.enqueue(spool, "ok", {"n": 1})
    b = myq.enqueue(spool, "perm", None)
    w = myq.Worker(spool, handlers={"ok": ok, "perm": perm}, poll=0.05)
    assert w.run(drain=True) == 0
    assert seen == [(a, {"n": 1}, 1)]
    s = myq.open_store(spool)
    assert s.show(a)["state"] == "done"
    assert s.show(b)["state"] == "dead"
    assert "api-perm" in s.show(b)["last_error"]


def test_handlers_that_enqueue_while_the_worker_polls(run_myq, spool, tmp_path):
    # A --module handler's thread enqueues while the worker's loop closes
    # its own descriptors at every poll tick: each thread has its doors, so
    # no enqueue goes through a descriptor another thread closed (shared,
    # 9 runs in 20 of the soak lost enqueues to EBADF or SpoolBusy).
    mod, out = module(tmp_path, (
        "import threading\n"
        "def fan(job):\n"
        "    for i in range(60):\n"
        "        myq.enqueue(%r, 'leaf', {'n': i},\n"
        "                    id='%%s-%%d' %% (job['id'], i))\n"
        "def leaf(job):\n"
        "    with open(OUT, 'a') as f:\n"
        "        f.write(job['id'] + '\\n')\n" % spool))
    fans = ["f%d" % i for i in range(6)]
    for f in fans:
        enqueue(call_myq, spool, "fan", "{}", "--id", f)
    drain(spool, "--module", mod, "--concurrency", "6", "--poll", "0.001")
    for f in fans:
        job = show(call_myq, spool, f)
        assert job["state"] == "done", job
    with open(out) as f:
        seen = sorted(f.read().split())
    assert seen == sorted("%s-%d" % (f, i) for f in fans for i in range(60))
