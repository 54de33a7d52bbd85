"""The circuit breaker, from outside: failures of different jobs at one
destination hold it; probes rotate among its jobs, cost no attempt, are
held by pause and rate like any start, and a probe's success releases the
destination; a job's own failure, a 4xx answer, one job failing again and
again never trip it; a missing handler holds its type at once and its
arrival releases it; a hold outlives a worker's restart and `resume-dest`
ends it at once; jobs released run at once; ttl keeps running while held;
an http destination is scheme, host and port; an outage costs at most one
attempt, and only of the job that began it.
"""
import os
import time

import pytest

from _core import (FAST, call_myq, cli, dead_error, enqueue, http_job, ls, ok,
                   show, state, stats, wait_for, waiting, worker)
from _http import http_servers, status_servers  # noqa: F401 (fixtures)
from _procs import bg_worker, rec_handler, started_ids, starts


# 7. Circuit breaker ###########################################################

SINK = r'''T='%s'
echo "$MYQ_JOB_ID $MYQ_ATTEMPT $(date +%%s.%%N)" >> "$T/starts"
[ -e "$T/up" ] && exit 0
echo "destination down" >&2
exit 75
'''


def _epoch(stamp):
    """A log line's time (2026-12-06T07:38:37.340Z) as epoch seconds."""
    import calendar
    day, _, rest = stamp.rstrip("Z").partition("T")
    whole, _, frac = rest.partition(".")
    return calendar.timegm(time.strptime(day + " " + whole, "%Y-%m-%d %H:%M:%S")) \
        + float("0." + (frac or "0"))


def _attempt_rule(recs):
    """An outage costs a job at most one attempt, and only the job that
    started the streak spends it: MYQ_ATTEMPT stays 1, except for that
    job's later runs (2)."""
    assert recs, "nothing ran"
    first = recs[0][0]
    for jid, att, _ in recs:
        assert att <= 2, (jid, att)
        if att == 2:
            assert jid == first, "%s spent an attempt in the streak" % jid


def test_destination_failures_of_different_jobs_hold_it(run_myq, spool,
                                                        handlers_dir, tmp_path):
    h = handlers_dir("sink", SINK % tmp_path)
    ok(cli(spool, "policy", "sink", "breaker=3"))
    for i in range(5):
        enqueue(call_myq, spool, "sink", None, "--id", "d%d" % i)
    t0 = time.time()
    cp = worker(run_myq, spool, handlers=h, timeout=30)   # backoff 60 s
    assert cp.returncode == 0, cp.stderr
    recs = starts(tmp_path)
    assert len(recs) == 3 and len(set(r[0] for r in recs)) == 3, recs
    assert [l for l in cp.stderr.splitlines()
            if "event=hold" in l and "dest=sink" in l.split()], cp.stderr
    held = stats(spool)["held"]
    assert [x["dest"] for x in held] == ["sink"], held
    assert held[0]["until"] > t0 + 30
    chk = cli(spool, "check")
    assert chk.returncode == 1
    assert [l for l in chk.stdout.splitlines() if "sink" in l and "held" in l], \
        chk.stdout
    jobs = [show(call_myq, spool, "d%d" % i) for i in range(5)]
    assert all(j["state"] in ("ready", "scheduled", "held") for j in jobs), jobs
    assert sum(j["attempts"] for j in jobs) == 1, [j["attempts"] for j in jobs]
    assert ls(spool, "dlq") == []


@pytest.mark.parametrize("lane", ["", "concurrency=5"])
def test_probes_rotate_count_no_attempt_and_success_releases(
        spool, handlers_dir, tmp_path, procs, lane):
    """(With a lane, concurrency=5: the probes went round the jobs that
    had failed alone, the others never started.)"""
    h = handlers_dir("sink", SINK % tmp_path)
    ok(cli(spool, "policy", "sink", *["breaker=2"] + lane.split()))
    for i in range(4):
        enqueue(call_myq, spool, "sink", None, "--id", "p%d" % i)
    w, log = bg_worker(procs, tmp_path, spool, "--handlers", h, "--poll", "0.05",
                       "--jitter", "0", "--backoff-base", "0.2",
                       "--backoff-max", "0.4")
    wait_for(lambda: len(starts(tmp_path)) >= 7, timeout=20,
             what="2 failures and 5 probes")
    (tmp_path / "up").touch()
    wait_for(lambda: len(ls(spool, "done")) == 4, timeout=20,
             what="the backlog to run once released")
    recs = starts(tmp_path)
    down = [r for r in recs if r[2] < os.stat(str(tmp_path / "up")).st_mtime]
    probes = down[2:]
    ids = [r[0] for r in probes]
    print("probes: %s" % ids)
    # "each time a different one": the probes go round the 4 waiting jobs
    assert len(set(ids[:4])) == 4, "probes do not rotate: %s" % ids
    # (the worker's own times of its probes: a handler's start lags by how
    # loaded the machine is, and a probe that ran longer than the backoff
    # is followed by the next at once)
    text = log.read_text()
    at = [_epoch(l.split()[0]) for l in text.splitlines()
          if "event=probe" in l and "dest=sink" in l.split()]
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert gaps and min(gaps) >= 0.15, "probes closer than the backoff: %s" % gaps
    _attempt_rule(down)
    assert "event=hold" in text and "dest=sink" in text
    assert [l for l in text.splitlines()
            if "event=release" in l and "dest=sink" in l.split()], text
    assert stats(spool)["held"] == []
    assert ls(spool, "dlq") == []


@pytest.mark.parametrize("how", ["paused", "rate=1/m"])
def test_a_probe_is_a_start_of_its_type_pause_and_rate_hold_it(
        spool, handlers_dir, tmp_path, procs, how):
    """A held type's probe started while the type was paused, and past its
    rate (six in six seconds at rate=1/m): it is a start like any
    other.  (A bounded look: nothing may start in it.)"""
    h = handlers_dir("sink", SINK % tmp_path)
    ok(cli(spool, "policy", "sink", "breaker=1",
           "concurrency=5" if how == "paused" else how))
    enqueue(call_myq, spool, "sink", None, "--id", "j1")
    wait = 3 if how == "paused" else 1      # (the pause lands first, loaded)
    w, log = bg_worker(procs, tmp_path, spool, "--handlers", h, "--poll", "0.05",
                       "--jitter", "0", "--backoff-base", str(wait),
                       "--backoff-max", str(wait))
    wait_for(lambda: "event=hold" in log.read_text(), what="the hold")
    if how == "paused":
        ok(cli(spool, "pause", "sink"))
    time.sleep(wait + 1.5)  # the probe was due after `wait` s
    assert [r[0] for r in starts(tmp_path)] == ["j1"], starts(tmp_path)
    assert "event=probe" not in log.read_text()
    if how == "paused":     # (and it was the pause that held it)
        ok(cli(spool, "resume", "sink"))
        wait_for(lambda: "event=probe" in log.read_text(), what="a probe")


def test_a_jobs_own_failure_never_trips_a_hold(run_myq, spool, handlers_dir,
                                               tmp_path):
    h = rec_handler(handlers_dir, tmp_path, "own", 'echo "bad input" >&2; exit 1')
    ok(cli(spool, "policy", "own", "breaker=2"))
    for i in range(4):
        enqueue(call_myq, spool, "own", None, "--id", "o%d" % i)
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert sorted(started_ids(tmp_path)) == ["o0", "o1", "o2", "o3"]
    assert "event=hold" not in cp.stderr
    assert stats(spool)["held"] == []
    assert [show(call_myq, spool, "o%d" % i)["attempts"] for i in range(4)] == [1] * 4


def test_one_job_failing_again_and_again_does_not_trip(spool, handlers_dir,
                                                       tmp_path, procs):
    """`breaker` counts failures of DIFFERENT jobs; the streak's first
    failure alone costs an attempt."""
    h = handlers_dir("sink", SINK % tmp_path)
    ok(cli(spool, "policy", "sink", "breaker=2"))
    enqueue(call_myq, spool, "sink", None, "--id", "solo", "--max-attempts", "3")
    w, log = bg_worker(procs, tmp_path, spool, "--handlers", h, "--poll", "0.05",
                       "--jitter", "0", "--backoff-base", "0.05",
                       "--backoff-max", "0.1")
    wait_for(lambda: len(starts(tmp_path)) >= 5 or ls(spool, "dlq"),
             timeout=20, what="5 runs of solo")
    assert "event=hold" not in log.read_text()
    _attempt_rule(starts(tmp_path))
    assert ls(spool, "dlq") == []


def test_http_4xx_never_trips_and_a_4xx_answer_releases(run_myq, spool, status_servers,
                                                        procs, tmp_path):
    bad = status_servers(lambda h: 400)
    ok(cli(spool, "policy", "http", "breaker=2"))
    ids = [http_job(spool, bad.url("/x")) for _ in range(3)]
    cp = worker(run_myq, spool, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert len(bad.answers()) == 3 and "event=hold" not in cp.stderr
    assert all(state(call_myq, spool, j) == "dead" for j in ids)
    # down (503) -> held; the first probe gets 404: released, the rest run
    mode = {"code": 503}

    def answer(h):
        if mode["code"] == "404 once":
            mode["code"] = 200
            return 404
        return mode["code"]
    srv = status_servers(answer)
    for _ in range(4):
        http_job(spool, srv.url("/y"))
    w, log = bg_worker(procs, tmp_path, spool, "--poll", "0.05", "--jitter", "0",
                       "--backoff-base", "0.3", "--backoff-max", "0.3")
    dest = "dest=" + srv.origin()
    wait_for(lambda: dest in log.read_text() and "event=hold" in log.read_text(),
             timeout=20, what="the hold")
    # The probe's answer is a 404, once; then the server is up (switched by
    # the server itself: the released jobs follow the probe within ms)
    mode["code"] = "404 once"
    wait_for(lambda: any(c == 404 for _, c, _ in srv.answers()), timeout=20,
             what="the probe")
    wait_for(lambda: [l for l in log.read_text().splitlines()
                      if "event=release" in l and dest in l.split()],
             timeout=20, what="the 404 to release the hold")
    wait_for(lambda: len([1 for _, c, _ in srv.answers() if c == 200]) == 3,
             timeout=20, what="the other three to be delivered")


def test_missing_handler_holds_at_once_and_releases_when_it_appears(
        run_myq, spool, handlers_dir, tmp_path, procs):
    h = rec_handler(handlers_dir, tmp_path, "sentinel")
    ok(cli(spool, "policy", "ghost", "breaker=5"))
    for i in range(3):
        enqueue(call_myq, spool, "ghost", None, "--id", "g%d" % i)
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert len([l for l in cp.stderr.splitlines() if "event=hold" in l]) >= 1
    assert [x["dest"] for x in stats(spool)["held"]] == ["ghost"]
    assert [show(call_myq, spool, "g%d" % i)["attempts"] for i in range(3)] == [0] * 3
    w, log = bg_worker(procs, tmp_path, spool, "--handlers", h, *FAST)
    rec_handler(handlers_dir, tmp_path, "ghost")
    wait_for(lambda: all(state(call_myq, spool, "g%d" % i) == "done"
                         for i in range(3)), timeout=20,
             what="the jobs to run once the handler is there")
    assert [l for l in log.read_text().splitlines()
            if "event=release" in l and "dest=ghost" in l.split()]


def _trip_sink(run_myq, spool, handlers_dir, tmp_path, prefix):
    """A "sink" handler that fails until T/up exists, breaker=2, 4 jobs
    PREFIX0..3 and one worker --drain: two fail, the destination is held
    (backoff 60 s).  Returns the handlers directory."""
    h = handlers_dir("sink", SINK % tmp_path)
    ok(cli(spool, "policy", "sink", "breaker=2"))
    for i in range(4):
        enqueue(call_myq, spool, "sink", None, "--id", "%s%d" % (prefix, i))
    cp = worker(run_myq, spool, handlers=h, timeout=30)       # backoff 60 s
    assert cp.returncode == 0, cp.stderr
    return h


def test_hold_survives_a_worker_restart_and_resume_dest_releases_now(
        run_myq, spool, handlers_dir, tmp_path):
    h = _trip_sink(run_myq, spool, handlers_dir, tmp_path, "d")
    assert len(starts(tmp_path)) == 2
    cp = worker(run_myq, spool, handlers=h, timeout=30)       # a new worker
    assert cp.returncode == 0, cp.stderr
    assert len(starts(tmp_path)) == 2, "the restarted worker forgot the hold"
    assert [x["dest"] for x in stats(spool)["held"]] == ["sink"]
    (tmp_path / "up").touch()
    ok(cli(spool, "resume", "--dest", "sink"))
    assert stats(spool)["held"] == []
    assert cli(spool, "check").returncode == 0
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert len(ls(spool, "done")) == 4, ("jobs still waiting out their backoff",
                                         cp.stderr, waiting(spool))


@pytest.mark.files_only("a job file's ctime past its mtime")
def test_released_jobs_run_at_once_whatever_their_ctime(
        run_myq, spool, handlers_dir, tmp_path):
    """A release makes the held jobs ready by setting their mtime to now.
    A file whose mtime is not later than its ctime is due by the
    available_at in its JSON (a producer's own file), and the kernel stamps
    the ctime from a coarse clock that can be a tick past the mtime just
    set (seen in CI: one job in a few hundred then waited out its parking,
    60 s).  Here the ctime is moved past the mtime on purpose (chmod):
    every released job must still run at once, none deferred."""
    h = _trip_sink(run_myq, spool, handlers_dir, tmp_path, "c")
    assert [x["dest"] for x in stats(spool)["held"]] == ["sink"]
    (tmp_path / "up").touch()
    ok(cli(spool, "resume", "--dest", "sink"))
    time.sleep(0.02)        # a ctime that is surely later than the mtime
    files = [os.path.join(d, n) for d, _, names in
             os.walk(os.path.join(spool, "incoming")) for n in names
             if n.endswith(".json")]
    assert len(files) == 4, files
    for p in files:
        os.chmod(p, os.stat(p).st_mode)
        st = os.stat(p)
        assert st.st_mtime <= st.st_ctime, p
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert "event=deferred" not in cp.stderr, cp.stderr
    assert len(ls(spool, "done")) == 4, ("released jobs deferred again",
                                         cp.stderr, waiting(spool))


def test_ttl_keeps_running_while_held_and_no_probe_starts_an_expired_job(
        spool, handlers_dir, tmp_path, procs):
    """e0, e1 trip the breaker; e2 (`--ttl 1`) waits behind the hold while
    probes go out every 0.3 s: once expired it is never started (not even
    as a probe) and ends in dlq/ as expired."""
    h = handlers_dir("sink", SINK % tmp_path)
    ok(cli(spool, "policy", "sink", "breaker=2"))
    enqueue(call_myq, spool, "sink", None, "--id", "e0")
    enqueue(call_myq, spool, "sink", None, "--id", "e1")
    bg_worker(procs, tmp_path, spool, "--handlers", h, "--poll", "0.05",
              "--jitter", "0", "--backoff-base", "0.3", "--backoff-max", "0.3")
    wait_for(lambda: len(starts(tmp_path)) >= 2, what="the trip")
    enqueue(call_myq, spool, "sink", None, "--id", "e2", "--ttl", "1")
    exp = show(call_myq, spool, "e2")["expires_at"]
    wait_for(lambda: state(call_myq, spool, "e2") == "dead", timeout=15,
             what="e2 to expire while held")
    assert dead_error(spool, "e2").startswith("expired")
    # (the handler's timestamp may lag its start on a loaded machine)
    assert [r for r in starts(tmp_path) if r[0] == "e2" and r[2] > exp + 0.5] == []
    (tmp_path / "up").touch()
    wait_for(lambda: all(state(call_myq, spool, j) == "done" for j in ("e0", "e1")),
             timeout=15, what="the others to run once up")
    assert stats(spool)["expired"] == 1


def test_http_destination_is_scheme_host_port(run_myq, spool, status_servers):
    down = status_servers(lambda h: 503)
    fine = status_servers(lambda h: 200)
    ok(cli(spool, "policy", "http", "breaker=2"))
    for i in range(3):
        http_job(spool, down.url("/d%d" % i))
        http_job(spool, fine.url("/f%d" % i))
    cp = worker(run_myq, spool, timeout=30)                   # backoff 60 s
    assert cp.returncode == 0, cp.stderr
    assert len([1 for _, c, _ in fine.answers() if c == 200]) == 3
    assert len(down.answers()) == 2
    assert [x["dest"] for x in stats(spool)["held"]] == [down.origin()]
    assert "event=hold dest=%s" % down.origin() in cp.stderr, cp.stderr
    ok(cli(spool, "resume", "--dest", down.origin()))
    assert stats(spool)["held"] == []


def test_destination_failure_costs_an_attempt_only_at_a_streak_start(
        run_myq, spool, handlers_dir, tmp_path):
    """`bad` fails (exit 75) between successes of other jobs of the same
    destination: each of its failures starts a streak, so it ends in dlq/
    after its max_attempts, as before."""
    h = rec_handler(handlers_dir, tmp_path, "mix",
                    '[ "$MYQ_JOB_ID" = bad ] && exit 75\nsleep 0.05\nexit 0')
    enqueue(call_myq, spool, "mix", None, "--id", "bad", "--priority", "5",
            "--max-attempts", "3")
    for i in range(30):
        enqueue(call_myq, spool, "mix", None, "--id", "g%02d" % i)
    cp = worker(run_myq, spool, "--backoff-base", "0.05", "--backoff-max", "0.1",
                handlers=h, timeout=60)
    assert cp.returncode == 0, cp.stderr
    job = show(call_myq, spool, "bad")
    assert job["state"] == "dead" and job["attempts"] == 3, job
    assert len(ls(spool, "done")) == 30
    assert "event=hold" not in cp.stderr
