"""The retry delay, dlq/, and `myq retry`."""
import json
import os
import time

import pytest

from _core import enqueue, ls, one_line_error, show, wait_for, worker
from _core import call_myq


def fail_once(run_myq, spool, job_id, handlers, base, mx, jitter="0"):
    """Run the job once (it fails); return (t0, t1, job)."""
    t0 = time.time()
    cp = worker(run_myq, spool, "--backoff-base", base, "--backoff-max", mx,
                "--jitter", jitter, handlers=handlers, mode="--once")
    t1 = time.time()
    assert cp.returncode == 0, cp.stderr
    return t0, t1, show(call_myq, spool, job_id)


@pytest.mark.slow
def test_backoff_doubles_and_is_capped(run_myq, spool, handlers_dir):
    h = handlers_dir("f", "exit 1")
    job_id = enqueue(call_myq, spool, "f", "null", "--max-attempts", "10")
    base, mx = 0.3, 1.0
    for n in (1, 2, 3, 4):
        wait_for(lambda: show(call_myq, spool, job_id)["state"] == "ready",
                 timeout=10, what="job ready again")
        t0, t1, job = fail_once(run_myq, spool, job_id, h, str(base), str(mx))
        assert job["attempts"] == n
        assert job["state"] == "scheduled"
        want = min(base * 2 ** (n - 1), mx)
        got_lo, got_hi = job["available_at"] - t1, job["available_at"] - t0
        assert got_lo - 0.02 <= want <= got_hi + 0.02, (n, want, got_lo, got_hi)


def test_jitter_spreads_within_fraction(run_myq, spool, handlers_dir):
    h = handlers_dir("f", "exit 1")
    ids = [enqueue(call_myq, spool, "f") for _ in range(8)]
    t0 = time.time()
    cp = worker(run_myq, spool, "--backoff-base", "100", "--jitter", "0.1",
                handlers=h)
    t1 = time.time()
    assert cp.returncode == 0, cp.stderr
    delays = []
    for i in ids:
        job = show(call_myq, spool, i)
        assert job["state"] == "scheduled" and job["attempts"] == 1
        assert t0 + 90 - 0.01 <= job["available_at"] <= t1 + 110 + 0.01, job
        delays.append(job["available_at"])
    assert len(set(round(d, 3) for d in delays)) > 1, "no jitter applied"


def test_exhausted_attempts_go_to_dlq(run_myq, spool, handlers_dir, tmp_path,
                                      store):
    runs = tmp_path / "runs"
    h = handlers_dir("f", 'echo x >> "%s"; echo "failure-no-$MYQ_ATTEMPT" >&2; exit 1' % runs)
    job_id = enqueue(call_myq, spool, "f", '{"p": 1}', "--max-attempts", "3")

    def dead():
        cp = worker(run_myq, spool, "--backoff-base", "0.01", handlers=h)
        assert cp.returncode == 0, cp.stderr
        return show(call_myq, spool, job_id)["state"] == "dead"

    before = time.time()
    wait_for(dead, timeout=30, what="job dead")
    if store == "files":
        assert ls(spool, "dlq") == [job_id + ".json"]
        with open(os.path.join(spool, "dlq", job_id + ".json")) as f:
            job = json.load(f)
    else:
        job = show(call_myq, spool, job_id)
    assert job["attempts"] == 3
    assert job["payload"] == {"p": 1}
    assert before - 1 <= job["failed_at"] <= time.time() + 1
    assert "failure-no-3" in job["last_error"]
    assert runs.read_text().count("x") == 3


def make_dead(run_myq, spool, handlers_dir, tmp_path, n=1):
    runs = tmp_path / "runs"
    h = handlers_dir("f", 'echo "$MYQ_JOB_ID" >> "%s"\n'
                          '[ -e "%s" ] && exit 0\nexit 65' % (runs, tmp_path / "fixed"))
    ids = [enqueue(call_myq, spool, "f", "null", "--id", "d%d" % i) for i in range(n)]
    cp = worker(run_myq, spool, handlers=h)
    assert cp.returncode == 0, cp.stderr
    for i in ids:
        assert show(call_myq, spool, i)["state"] == "dead"
    return h, ids, runs


def test_dead_jobs_never_run_again_without_retry(run_myq, spool, handlers_dir, tmp_path):
    h, ids, runs = make_dead(run_myq, spool, handlers_dir, tmp_path)
    (tmp_path / "fixed").touch()
    for _ in range(2):
        cp = worker(run_myq, spool, handlers=h)
        assert cp.returncode == 0, cp.stderr
    assert call_myq("--spool", spool, "reap").returncode == 0
    assert runs.read_text().split() == ["d0"]
    assert show(call_myq, spool, "d0")["state"] == "dead"


def test_retry_brings_a_dead_job_back(run_myq, spool, handlers_dir, tmp_path,
                                      store):
    h, ids, runs = make_dead(run_myq, spool, handlers_dir, tmp_path)
    cp = call_myq("--spool", spool, "retry", "d0")
    assert cp.returncode == 0, cp.stderr
    job = show(call_myq, spool, "d0")
    assert job["state"] == "ready"
    assert job["attempts"] == 0
    if store == "files":
        assert ls(spool, "dlq") == []
        assert ls(spool, "incoming") == ["d0.json"]
    (tmp_path / "fixed").touch()
    cp = worker(run_myq, spool, handlers=h)
    assert cp.returncode == 0, cp.stderr
    assert show(call_myq, spool, "d0")["state"] == "done"
    assert runs.read_text().split() == ["d0", "d0"]


def test_retry_all(run_myq, spool, handlers_dir, tmp_path):
    make_dead(run_myq, spool, handlers_dir, tmp_path, n=3)
    keep = enqueue(call_myq, spool, "f", "null", "--delay", "500")
    cp = call_myq("--spool", spool, "retry", "--all")
    assert cp.returncode == 0, cp.stderr
    assert ls(spool, "dlq") == []
    for i in ("d0", "d1", "d2"):
        job = show(call_myq, spool, i)
        assert (job["state"], job["attempts"]) == ("ready", 0), job
    assert show(call_myq, spool, keep)["state"] == "scheduled"


def test_retry_several_ids(run_myq, spool, handlers_dir, tmp_path):
    make_dead(run_myq, spool, handlers_dir, tmp_path, n=3)
    cp = call_myq("--spool", spool, "retry", "d0", "d2")
    assert cp.returncode == 0, cp.stderr
    assert show(call_myq, spool, "d0")["state"] == "ready"
    assert show(call_myq, spool, "d1")["state"] == "dead"
    assert show(call_myq, spool, "d2")["state"] == "ready"


def test_retry_unknown_id_is_66(spool):
    cp = call_myq("--spool", spool, "retry", "no-such-job")
    assert cp.returncode == 66, (cp.returncode, cp.stderr)
    one_line_error(cp)
    assert ls(spool, "incoming") == []


def test_a_retry_waits_its_backoff_though_another_worker_saw_it_due(myq, spool):
    """Two workers: one runs a job and puts it back with its backoff while
    the other's scan still holds it as due (its own handler ran long
    meanwhile).  That scan's claim must not take it: it waits its time
    (the SQLite store ran it again at once, the backoff ignored).  A held
    destination's probe (anytime) still takes it now."""
    sp = myq.open_store(spool)
    jid = sp.enqueue("f", {"n": 1})
    a, b = myq.Identity(sp, 60.0), myq.Identity(sp, 60.0)
    c = sp.claims.claim(jid + ".json", a, 5, True)
    assert c is not None and c.attempt == 1
    job = dict(c.job)
    job["attempts"] = 1
    job["available_at"] = myq._now() + 30
    assert sp.claims.move_on(c, job, "incoming", a)
    assert sp.claims.claim(jid + ".json", b, 5, True) is None    # b's scan
    got = show(call_myq, spool, jid)
    assert got["state"] == "scheduled" and got["attempts"] == 1, got
    assert 25 < got["available_at"] - time.time() <= 30, got
    p = sp.claims.claim(jid + ".json", b, 5, True, anytime=True)
    assert p is not None and p.attempt == 2
