"""Never lose a job, proven by killing real processes.

Every mutating filesystem step of myq goes through `myq._hook(op, path,
when)`.  For each operation below the harness first runs it in a forked child
with a counting hook to learn its steps, then, for every step k and for both
"before" and "after", runs it again in a fresh forked child whose hook calls
os._exit(137) at that point.  A fresh reaper and a draining worker then
recover the spool, and the invariant is checked:

- every job is in exactly one state (incoming/, processing/, done/, dlq/,
  failed/): none lost, none in two places, none quarantined (corrupted);
  its payload is intact; a job in done/ has had its handler succeed;
- a job the operation was publishing exists exactly when the crash came after
  the step that published it (rename/link into incoming/);
- nothing is left in processing/ (no .fin, no claim);
- after `prune` with keep_tmp=0, tmp/ and locks/workers/ are empty, and
  `check` reports a healthy spool.

The crash points are enumerated from the code, not picked by hand: a step
added to myq adds crash points here.  Run with -s, or read the summary line
each test prints, for "crash points covered: N".
"""
import json
import os
import subprocess
import sys
import time
import traceback
import types

import pytest

import myq
from _core import myq_argv, quiet_log, under

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

CRASH = 137
COVERED = {}           # operation -> crash points checked
CLI_COVERED = []       # the same points again, recovered through the CLI


# Running an operation in a real child process ##################################

class _Recorder(object):
    """The hook: counts every call; at call number `die_at` (0-based) it
    reports the step on the pipe and exits at once, like a kill -9."""

    def __init__(self, fd, die_at=None):
        self.fd, self.die_at, self.calls = fd, die_at, []

    def __call__(self, op, path, when):
        self.calls.append((op, path, when))
        if self.die_at is not None and len(self.calls) - 1 == self.die_at:
            os.write(self.fd, json.dumps({"died": [op, path, when]}).encode())
            os._exit(CRASH)


def in_child(fn, die_at=None):
    """Run fn(arm) in a forked child; arm() installs the hook from then on.
    Returns (exit status, the hook calls seen (counting) or the step it died
    at)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                      # the child
        code = 0
        try:
            os.close(r)
            rec = _Recorder(w, die_at)

            def arm():
                myq._hook = rec
            fn(arm)
            myq._hook = None
            os.write(w, json.dumps({"calls": rec.calls}).encode())
        except BaseException:
            traceback.print_exc()
            code = 3
        os._exit(code)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
    return code, json.loads(b"".join(chunks).decode() or "{}")


# Handlers ##################################################################

_CURRENT = [None]      # the spool being exercised (inherited by children)


def effects_file(path):
    return path + ".effects"


def _record(job):
    fd = os.open(effects_file(_CURRENT[0]),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (job["id"] + "\n").encode())
    finally:
        os.close(fd)


def _flaky(job):
    raise RuntimeError("flaky failed")


def _bad(job):
    raise myq.PermanentError("bad is bad")


CHILD_HANDLERS = {"rec": _record, "flaky": _flaky, "bad": _bad}
RECOVERY_HANDLERS = {"rec": _record, "flaky": _record, "bad": _record}


def effects(path):
    try:
        with open(effects_file(path)) as f:
            return set(f.read().split())
    except FileNotFoundError:
        return set()


# Building blocks run in a child (the process that holds a claim) ################

def claimed(path, jid):
    sp = myq.open_store(path)
    me = myq.Identity(sp, lease=60)
    me.register()
    c = sp.claims.claim(jid + ".json", me)
    assert c is not None, "could not claim " + jid
    return sp, me, c


def die_holding(path, jid, then=None):
    """A worker claims jid and dies (kill -9 style), leaving its claim, its
    worker record, and whatever `then(sp, me, c, arm)` left behind."""
    def child(arm):
        sp, me, c = claimed(path, jid)
        if then:
            then(sp, me, c, arm)
        os._exit(0)
    code, out = in_child(child)
    assert code in (0, CRASH), "setup child failed (%s)" % code


def _die_on(op, where, when="after"):
    """A hook that exits at the first `op` on a path for which `where(path)`."""
    def hook(o, p, w):
        if o == op and where(p) and w == when:
            os._exit(CRASH)
    return hook


def put_dead(path, jid, payload):
    """A job in dlq/ the way a worker puts it there."""
    myq.enqueue(path, "bad", payload, id=jid, max_attempts=1)
    myq.Worker(path, handlers=CHILD_HANDLERS, log=quiet_log(), poll=0.05).run(
        drain=True)
    assert os.path.exists(os.path.join(path, "dlq", jid + ".json"))


def put_done(path, jid, payload):
    myq.enqueue(path, "rec", payload, id=jid)
    myq.Worker(path, handlers=CHILD_HANDLERS, log=quiet_log(), poll=0.05).run(
        drain=True)
    assert os.path.exists(os.path.join(path, "done", jid + ".json"))


# The operations ############################################################
#
# Each: setup(path) -> None, run in the test process (no hook);
# act(path, arm), run in the child; `jobs` = {id: payload} that must survive;
# `new` = ids the act publishes (present iff the crash came after the
# publishing step); `anon` = payload of one auto-id job the act publishes;
# `may_vanish` = ids retention may legitimately remove (prune).

OPS = {}


def op(name, jobs=None, new=None, anon=None, may_vanish=()):
    def deco(fn):
        setup, act = fn()
        OPS[name] = types.SimpleNamespace(
            name=name, setup=setup, act=act, jobs=dict(jobs or {}),
            new=dict(new or {}), anon=anon, may_vanish=set(may_vanish))
        return fn
    return deco


def _keep(path):
    myq.enqueue(path, "rec", {"keep": 1}, id="keep")


KEEP = {"keep": {"keep": 1}}


@op("enqueue-auto-id", jobs=KEEP, anon={"n": "auto"})
def _():
    def act(path, arm):
        arm()
        myq.enqueue(path, "rec", {"n": "auto"})
    return _keep, act


@op("enqueue-id-delay", jobs=KEEP, new={"e1": {"n": 1}})
def _():
    def act(path, arm):
        arm()
        myq.enqueue(path, "rec", {"n": 1}, id="e1", delay=0.001)
    return _keep, act


@op("enqueue-many", jobs=KEEP, new={"m1": {"n": 1}, "m2": {"n": 2}})
def _():
    def act(path, arm):
        arm()
        myq.open_store(path).enqueue_many([
            {"type": "rec", "payload": {"n": 1}, "id": "m1"},
            {"type": "rec", "payload": {"n": 2}, "id": "m2"}])
    return _keep, act


# The same enqueues through tmp/ + rename (link), the way where the system
# refuses O_TMPFILE (an older kernel, a filesystem without it): both ways
# have their crash points.
for _name in [n for n in OPS if n.startswith("enqueue")]:
    def _classic(spec):
        def act(path, arm):
            myq._TMPFILE = 0
            spec.act(path, arm)
        return act
    OPS[_name + "-via-tmp"] = types.SimpleNamespace(
        **dict(vars(OPS[_name]), name=_name + "-via-tmp",
               act=_classic(OPS[_name])))
    assert getattr(myq, "_TMPFILE", 0), "O_TMPFILE is refused here"


def _one(path):
    myq.enqueue(path, "rec", {"j": 1}, id="j")


J = {"j": {"j": 1}}


@op("claim", jobs=J)
def _():
    def act(path, arm):
        sp = myq.open_store(path)
        me = myq.Identity(sp, lease=60)
        me.register()
        arm()
        assert sp.claims.claim("j.json", me) is not None
    return _one, act


@op("heartbeat", jobs=J)
def _():
    def act(path, arm):
        sp, me, c = claimed(path, "j")
        w = myq.Worker(sp, log=quiet_log())
        w.me = me
        w.runs = [types.SimpleNamespace(claim=c, batch=None)]
        arm()
        w._heartbeat()
    return _one, act


@op("complete", jobs=J)
def _():
    def act(path, arm):
        sp, me, c = claimed(path, "j")
        _record(c.job)                  # the handler ran and succeeded
        arm()
        assert sp.claims.complete(c)
        myq._fsync_dir(sp.d("done"))            # the worker's group commit
    return _one, act


def _move(dest):
    def act(path, arm):
        sp, me, c = claimed(path, "j")
        job = dict(c.job, attempts=c.attempt, last_error="boom",
                   available_at=time.time())
        if dest == "dlq":
            job["failed_at"] = time.time()
        arm()
        assert sp.claims.move_on(c, job, dest, me)
        if dest == "incoming":
            sp._note_retry()
    return _one, act


op("retry", jobs=J)(lambda: _move("incoming"))
op("dead-letter", jobs=J)(lambda: _move("dlq"))


def _reap_setup(then=None, max_attempts=None):
    def setup(path):
        myq.enqueue(path, "rec", {"j": 1}, id="j", max_attempts=max_attempts)
        die_holding(path, "j", then)
        assert os.listdir(os.path.join(path, "processing"))
    return setup


def _reap_act(path, arm):
    arm()
    myq.open_store(path).reap()


@op("reap-requeue", jobs=J)
def _():
    return _reap_setup(), _reap_act


@op("reap-to-dlq", jobs=J)
def _():
    return _reap_setup(max_attempts=1), _reap_act


def _crashed_move(dest, op, where):
    def then(sp, me, c, arm):
        job = dict(c.job, attempts=c.attempt, last_error="x",
                   available_at=time.time())
        myq._hook = _die_on(op, where)
        sp.claims.move_on(c, job, dest, me)
        raise AssertionError("move_on did not crash")
    return then


@op("reap-fin", jobs=J)
def _():
    # the worker died in a retry, right after renaming its claim to .fin
    return _reap_setup(_crashed_move("incoming", "rename", lambda p: p.endswith(".fin"))), _reap_act


@op("reap-fin-moved", jobs=J)
def _():
    # the worker died in a dead-letter, after the job reached dlq/
    return _reap_setup(_crashed_move("dlq", "rename", lambda p: under(p, "dlq"))), _reap_act


@op("reap-ok-recorded", jobs=J)
def _():
    # the worker died holding a job whose id has a fresh record in locks/ok/
    # (done before, its done/ file removed early): the reaper counts it done
    def then(sp, me, c, arm):
        sp.producer.mark_ok(c.jid)
        _record(c.job)
    return _reap_setup(then), _reap_act


@op("redrive", jobs=J)
def _():
    def setup(path):
        put_dead(path, "j", {"j": 1})

    def act(path, arm):
        arm()
        assert myq.open_store(path).retry(["j"]) == 1
    return setup, act


@op("prune", jobs={"keep": {"keep": 1}, "dn": {"d": 1}, "dd": {"d": 2},
                   "junk": None}, may_vanish=("dn", "dd", "junk"))
def _():
    def setup(path):
        put_done(path, "dn", {"d": 1})
        put_dead(path, "dd", {"d": 2})
        _keep(path)
        with open(os.path.join(path, "tmp", "orphan.1.1.new"), "w") as f:
            f.write("{}")
        with open(os.path.join(path, "locks", "retries"), "w") as f:
            f.write("%d\n" % (time.time() - 3600) * 8000)  # > 64 KiB: compacted
        with open(os.path.join(path, "failed", "junk.json"), "w") as f:
            f.write("not json")
        with open(os.path.join(path, "failed", "junk.json.reason"), "w") as f:
            f.write("bad\n")
        code, _ = in_child(lambda arm: myq.Identity(myq.open_store(path)).register())

    def act(path, arm):
        arm()
        myq.open_store(path, keep_done=0, keep_dead=0, keep_failed=0, keep_tmp=0,
                  dedupe_window=0).prune()
    return setup, act


def _worker_cycle(type_, max_attempts=None):
    def setup(path):
        myq.enqueue(path, type_, {"j": 1}, id="j", max_attempts=max_attempts)

    def act(path, arm):
        w = myq.Worker(path, handlers=CHILD_HANDLERS, log=quiet_log(), poll=0.05,
                       backoff_base=0, jitter=0)
        arm()
        w.run(once=True)
    return setup, act


op("worker-success", jobs=J)(lambda: _worker_cycle("rec"))
op("worker-retry", jobs=J)(lambda: _worker_cycle("flaky"))
op("worker-dead", jobs=J)(lambda: _worker_cycle("bad"))
op("worker-last-attempt", jobs=J)(lambda: _worker_cycle("flaky", 1))


# Recovery and the invariant ################################################

# A worker (or reaper) killed between creating its record and writing it leaves
# an empty locks/workers/WID.json that prune never removes (myq.py bug,
# reported; pinned by test_half_written_worker_record_is_pruned).  The
# enumeration tolerates exactly that leftover and counts it.
KNOWN_EMPTY_RECORD_LEAK = False  # fixed: the record is written through tmp/
LEAKS = []


def recover(path):
    """What an operator's restart does: a reaper, then a draining worker,
    then prune with no grace for tmp/ orphans."""
    myq.open_store(path).reap()
    myq.Worker(path, handlers=RECOVERY_HANDLERS, log=quiet_log(), poll=0.05,
               backoff_base=0, jitter=0).run(drain=True)
    myq.open_store(path, keep_tmp=0).prune()


MODULE = """import os
def _rec(job):
    fd = os.open(%r, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (job["id"] + "\\n").encode())
    os.close(fd)
HANDLERS = {"rec": _rec, "flaky": _rec, "bad": _rec}
"""


def recover_cli(path):
    """The same through the command line: `myq worker --drain` alone, which
    first takes back the claims of dead workers."""
    mod = path + ".handlers.py"
    with open(mod, "w") as f:
        f.write(MODULE % effects_file(path))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYQ_")}
    cp = subprocess.run(myq_argv() + ["--spool", path, "worker", "--drain",
                         "--module", mod, "--poll", "0.05", "--backoff-base", "0",
                         "--jitter", "0"], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, env=env, timeout=60)
    assert cp.returncode == 0, cp.stdout
    myq.open_store(path, keep_tmp=0).prune()


def census(path):
    where = {}
    for sub in ("incoming", "processing", "done", "dlq", "failed"):
        for name in os.listdir(os.path.join(path, sub)):
            if sub == "failed" and name.endswith(".reason") or \
                    sub == "incoming" and name == "lanes":      # (init's)
                continue
            if sub == "processing":
                jid = name.partition("+")[0]
            elif name.endswith(".json"):
                jid = name[:-5]
            else:
                jid = name
            where.setdefault(jid, []).append(sub)
    return where


def listing(path):
    out = []
    for top, dirs, files in os.walk(path):
        for f in sorted(files):
            out.append(os.path.relpath(os.path.join(top, f), path))
    return "\n    ".join(sorted(out))


def publish_index(calls, jid=None):
    """Index of the hook call after which the job is published in incoming/."""
    for i, (o, p, w) in enumerate(calls):
        if o in ("rename", "link") and w == "after" and under(p, "incoming") \
                and p.endswith(".json") and (jid is None or
                                             os.path.basename(p) == jid + ".json"):
            return i
    raise AssertionError("no publishing step for %s in %r" % (jid, calls))


def check(path, spec, crash_index, calls):
    problems = []
    where = census(path)
    sp = myq.open_store(path)
    if os.listdir(sp.d("processing")):
        problems.append("processing/ not empty: %s" % os.listdir(sp.d("processing")))
    expected = dict(spec.jobs)
    for jid, payload in spec.new.items():
        if crash_index >= publish_index(calls, jid):
            expected[jid] = payload
        elif jid in where:
            problems.append("%s exists although the crash came before it was "
                            "published (%s)" % (jid, where[jid]))
    extra = sorted(set(where) - set(expected) - set(spec.new))
    if spec.anon is not None:
        must = crash_index >= publish_index(calls)
        if len(extra) > 1 or (must and not extra) or (extra and not must):
            problems.append("auto-id job: expected %d, found %s"
                            % (must, extra))
        for jid in extra:
            expected[jid] = spec.anon
        extra = []
    if extra:
        problems.append("unexpected jobs: %s" % extra)
    done_effects = effects(path)
    for jid, payload in sorted(expected.items()):
        states = where.get(jid, [])
        if not states and jid in spec.may_vanish:
            continue
        if len(states) != 1:
            problems.append("job %s is in %d places: %s" % (jid, len(states), states))
            continue
        if states[0] == "failed" and jid in spec.may_vanish:
            continue                # prune's own test file, not a job
        if states[0] == "failed":
            problems.append("job %s was quarantined (corrupted)" % jid)
            continue
        try:
            job = sp.show(jid)
        except myq.MyqError as e:
            problems.append("job %s unreadable: %s" % (jid, e))
            continue
        if job.get("id") != jid or job.get("payload") != payload:
            problems.append("job %s corrupted: %r" % (jid, job))
        if job["state"] == "done" and jid not in done_effects:
            problems.append("job %s is done but its handler never succeeded" % jid)
        if job["state"] not in ("done", "dead", "scheduled"):
            problems.append("job %s still %s after a drain" % (jid, job["state"]))
    left = os.listdir(sp.d("tmp"))
    if left:
        problems.append("tmp/ not empty after prune: %s" % left)
    for name in os.listdir(sp.d("locks", "workers")):
        if KNOWN_EMPTY_RECORD_LEAK and os.path.getsize(
                sp.d("locks", "workers", name)) == 0:
            LEAKS.append(name)      # see test_half_written_worker_record_is_pruned
            continue
        problems.append("locks/workers/%s (a dead process) not pruned" % name)
    health = sp.check(operator=False)     # dead jobs are expected here
    if health:
        problems.append("check: %s" % health)
    return problems


def run_points(tmp_path, spec, recovery=recover):
    """All crash points of one operation; returns (N steps, failures)."""
    base = str(tmp_path)

    def fresh(tag):
        path = os.path.join(base, tag, "spool")
        myq.open_store(path).init()
        _CURRENT[0] = path
        spec.setup(path)
        return path

    path = fresh("count")
    code, out = in_child(lambda arm: spec.act(path, arm))
    assert code == 0, "%s failed without a crash (exit %s)" % (spec.name, code)
    calls = out["calls"]
    assert calls, "%s made no filesystem step" % spec.name
    for i in range(0, len(calls), 2):       # well-formed: before/after pairs
        assert calls[i][2] == "before" and calls[i + 1][2] == "after" and \
            calls[i][0] == calls[i + 1][0], calls[i:i + 2]
    failures = []
    for i, (o, p, w) in enumerate(calls):
        point = "%s: step %d/%d %s %s %s" % (spec.name, i // 2 + 1, len(calls) // 2,
                                             w, o, os.path.relpath(p, path))
        path_i = fresh("p%d" % i)
        code, out = in_child(lambda arm: spec.act(path_i, arm), die_at=i)
        if code != CRASH:
            failures.append("%s: the child did not reach it (exit %s)" % (point, code))
            continue
        d_op, d_path, d_when = out["died"]
        if (d_op, d_when) != (o, w) or os.path.dirname(
                os.path.relpath(d_path, path_i)) != os.path.dirname(
                os.path.relpath(p, path)):
            failures.append("%s: the replay died at %s %s %s instead"
                            % (point, d_when, d_op, d_path))
            continue
        try:
            recovery(path_i)
            problems = check(path_i, spec, i, calls)
        except Exception:
            problems = ["recovery raised: " + traceback.format_exc()]
        if problems:
            failures.append("%s\n  %s\n  spool:\n    %s"
                            % (point, "\n  ".join(problems), listing(path_i)))
    return len(calls), failures


XFAIL = {}   # redrive fixed: the dlq file is owned (.fin) before it moves


@pytest.mark.parametrize("name", sorted(OPS))
def test_crash_points(name, tmp_path, capsys, request):
    if name in XFAIL:
        request.applymarker(pytest.mark.xfail(strict=True, reason=XFAIL[name]))
    n, failures = run_points(tmp_path, OPS[name])
    COVERED[name] = n
    with capsys.disabled():
        sys.stdout.write("\n[crash points] %-20s %3d (%d steps x before/after)"
                         % (name, n, n // 2))
    assert not failures, "%d of %d crash points broke the invariant:\n%s" % (
        len(failures), n, "\n".join(failures))


def test_crash_points_recovered_by_cli(tmp_path, capsys):
    """The crash points of `complete`, recovered by `myq worker --drain` as a
    separate program (slower, so only this operation)."""
    n, failures = run_points(tmp_path, OPS["complete"], recover_cli)
    CLI_COVERED.append(n)
    assert not failures, "\n".join(failures)


def test_half_written_worker_record_is_pruned(tmp_path):
    """A worker killed between creating locks/workers/WID.json and writing
    it: prune must not keep the empty record forever."""
    path = str(tmp_path / "spool")
    myq.open_store(path).init()

    def act(arm):
        arm()
        myq.Identity(myq.open_store(path)).register()
    code, out = in_child(act, die_at=1)          # after "create"
    assert code == CRASH and out["died"][0] == "create"
    sp = myq.open_store(path)
    workers = sp.d("locks", "workers")
    # The record is written beside its name (.WID.json.PID.N.tmp, in the
    # owner's own directory, not in tmp/ where a producer could swap it)
    # and renamed: no half-written record under the record's name.
    left = os.listdir(workers)
    assert len(left) == 1 and left[0].startswith(".") and \
        left[0].endswith(".tmp"), left
    assert os.listdir(sp.d("tmp")) == []
    sp.prune(now=time.time() + 40 * 86400)
    assert os.listdir(workers) == [] and os.listdir(sp.d("tmp")) == []


def test_crash_points_summary(capsys):
    """Runs last: the number of crash points the tests above covered."""
    if not COVERED:
        pytest.skip("no crash-point test ran")
    with capsys.disabled():
        if LEAKS:
            sys.stdout.write("\n[crash points] empty worker records left (known "
                             "bug): %d" % len(LEAKS))
        sys.stdout.write("\ncrash points covered: %d in %d operations (%s)%s\n" % (
            sum(COVERED.values()), len(COVERED), ", ".join(
                "%s %d" % kv for kv in sorted(COVERED.items())),
            "; %d of them again with CLI recovery" % sum(CLI_COVERED)
            if CLI_COVERED else ""))


# Durability order ############################################################

def _calls_of(path, act):
    code, out = in_child(lambda arm: act(path, arm))
    assert code == 0
    return [tuple(c) for c in out["calls"]]


def _index(calls, op, when, pred):
    for i, (o, p, w) in enumerate(calls):
        if o == op and w == when and pred(p):
            return i
    raise AssertionError("no %s %s matching in:\n%s" % (when, op, "\n".join(
        map(repr, calls))))


def _published(calls, dest, when="before", via=("rename", "link")):
    """Index of the rename (or link) that puts a job file into `dest`."""
    for o in via:
        try:
            return _index(calls, o, when, lambda p: under(p, dest)
                          and p.endswith(".json"))
        except AssertionError:
            continue
    raise AssertionError("nothing published into %s: %r" % (dest, calls))


def _assert_published_durably(calls, dest, via=("rename", "link")):
    pub = _published(calls, dest, via=via)
    # (a worker's next version of a job is written beside its claim, in
    # processing/, the owner's own directory: never in tmp/, where a
    # producer could swap it before the rename)
    src_like = [p for o, p, w in calls[:pub] if o == "create" and (
        under(p, "tmp") or (under(p, "processing") and p.endswith(".new")))]
    assert src_like, "the job was not written in tmp/ or processing/ first: %r" \
        % calls
    tmp = src_like[-1]
    f_sync = _index(calls, "fsync", "after", lambda p: p == tmp)
    assert f_sync < pub, "file fsync must come before publishing it"
    w_done = _index(calls, "write", "after", lambda p: p == tmp)
    assert w_done < f_sync
    return pub


@pytest.mark.files_only("the order of a job file's steps into incoming/")
def test_enqueue_durability_order(spool):
    """An enqueue writes its file in tmp/, renames (or links) it into
    incoming/, then fsyncs the file and incoming/: the file's fsync after
    its rename makes one journal commit of data, inode and name (ext4), and
    the directory's fsync finds nothing left to commit.  Nothing is
    promised before it returns, so a power cut between the rename and the
    fsync may leave a name without data (the power-cut tests show the
    worker quarantines it, and no enqueue that returned is lost)."""
    for via_tmp, kw in [(t, kw) for t in (False, True) for kw in (
            {}, {"id": "x1%d" % t}, {"id": "x2%d" % t, "delay": 5})]:
        def act(path, arm):
            if via_tmp:
                myq._TMPFILE = 0
            arm()
            myq.enqueue(path, "rec", {"a": 1}, **kw)
        calls = _calls_of(spool, act)
        pub = _published(calls, "incoming", "after")
        if via_tmp:
            tmp = [p for o, p, w in calls[:pub] if o == "create"
                   and under(p, "tmp")]
            assert tmp, "the job was not written in tmp/ first: %r" % calls
        else:
            # O_TMPFILE: an unnamed file in incoming/, linked at its name
            # (the step's path) once written; nothing in tmp/
            tmp = [p for o, p, w in calls[:pub] if o == "create"]
            assert tmp and under(tmp[-1], "incoming") and calls[pub][0] == \
                "link" and calls[pub][1] == tmp[-1], calls
        wrote = _index(calls, "write", "after", lambda p: p == tmp[-1])
        assert wrote < pub, "the job's data is written before its rename"
        fsync = _index(calls, "fsync", "after", lambda p: under(p, "incoming")
                       and p.endswith(".json"))
        assert fsync > pub, "the file's fsync comes after its rename"
        dsync = _index(calls, "fsync", "after",
                       lambda p: p.rstrip("/").endswith("/incoming"))
        assert dsync > fsync, "incoming/ must be fsynced after the job's fsync"
        # nothing after the directory fsync but cleanup
        assert all(o == "unlink" for o, p, w in calls[dsync + 1:]), calls


def test_retry_and_redrive_durability_order(tmp_path):
    path = str(tmp_path / "spool")
    myq.open_store(path).init()
    _CURRENT[0] = path
    _one(path)
    calls = _calls_of(path, OPS["retry"].act)
    pub = _assert_published_durably(calls, "incoming")
    fin = _index(calls, "rename", "after", lambda p: p.endswith(".fin"))
    assert fin < pub, "the claim is owned (.fin) before the new file is published"
    gone = _index(calls, "unlink", "before", lambda p: p.endswith(".fin"))
    assert gone > pub, "the .fin goes only once the job is in incoming/"
    # dead-letter: same order into dlq/
    path2 = str(tmp_path / "spool2")
    myq.open_store(path2).init()
    _one(path2)
    calls = _calls_of(path2, OPS["dead-letter"].act)
    pub = _assert_published_durably(calls, "dlq")
    assert _index(calls, "unlink", "before", lambda p: p.endswith(".fin")) > pub
    # redrive from the DLQ: tmp file fsynced before it enters incoming/,
    # incoming/ fsynced after
    path3 = str(tmp_path / "spool3")
    myq.open_store(path3).init()
    put_dead(path3, "j", {"j": 1})
    calls = _calls_of(path3, OPS["redrive"].act)
    pub = _assert_published_durably(calls, "incoming")
    assert _index(calls, "fsync", "after",
                  lambda p: p.rstrip("/").endswith("/incoming")) > pub


def test_worker_record_is_durable_before_its_name(tmp_path):
    """A worker's record (locks/workers/WID.json) is fsync'd before its
    rename: after a power cut it is whole or absent.  An empty one cannot
    be judged, and the dead worker's claims waited out their lease (the
    UBIFS power cuts found 47 recoveries that left a claim in processing/)."""
    path = str(tmp_path / "spool")
    myq.open_store(path).init()
    calls = _calls_of(path, lambda p, arm: (
        arm(), myq.Identity(myq.open_store(p)).register()))
    pub = _index(calls, "rename", "before", lambda p: under(p, "locks/workers"))
    tmp = [p for o, p, w in calls[:pub] if o == "create" and
           under(p, "locks/workers") and os.path.basename(p).startswith(".")]
    assert tmp, calls
    assert _index(calls, "fsync", "after", lambda p: p == tmp[-1]) < pub, calls


def test_complete_order(tmp_path):
    """Success is one rename into done/ (the done file is the job's
    idempotency record): no other file is made, and done/ is fsynced (the
    group commit) after it."""
    path = str(tmp_path / "spool")
    myq.open_store(path).init()
    _CURRENT[0] = path
    _one(path)
    calls = _calls_of(path, OPS["worker-success"].act)
    done = _index(calls, "rename", "before", lambda p: under(p, "done"))
    assert not [c for c in calls if c[0] == "create" and under(c[1], "locks/ok")], calls
    donedir = _index(calls, "fsync", "after", lambda p: p.rstrip("/").endswith("/done"))
    assert done < donedir
