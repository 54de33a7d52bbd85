"""SPEC §9, per-type policy, black box: `myq policy`, `pause`, `resume`,
bounds (`max_queued`, `max_bytes`, `overflow`), expiry (`ttl`, `enqueue
--ttl`, API `ttl=`), priority, cross-worker `concurrency` and `rate`, the
circuit breaker, and the figures `stats --json` gains (§6).

Everything goes through the CLI (quick commands in this process with
`call_myq`, workers as real processes), the API where §7 names it, and the
shell producer (a file written in tmp/, then renamed into incoming/).

What the SPEC leaves open is not assumed:
- the policy file's name and layout: a test that needs the file finds it
  (`policy_file`: the JSON file under the spool, outside the job
  directories, that names the type); tests compare its bytes or restore
  bytes saved earlier, never edit its structure;
- `policy --json`'s shape (`policy_json` accepts one object keyed by type
  with `*` or `default`, `{"default", "types"}`, or one object per line
  with a `type`), and how values are spelt (`ttl=7d` or `604800`);
- the extra fields of log events; which lines `check` prints (a line that
  names the thing is enough).

Waiting is "poll a condition until a deadline".  Where a rule is about
something that must NOT happen, a sentinel job of another type is run
first (proof that the worker scanned), and where the SPEC grants a delay
("a running worker picks up a change within a couple of seconds") the test
grants PICKUP seconds, no more.
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from _core import (FAST, STATUS_RE, blocking_handler, call_myq,
                   clean_env, enqueue, kill_quiet, ls, myq_argv, sql,
                   one_line_error, show, state, wait_for, worker,
                   write_incoming)
import _http
from _http import http_servers  # noqa: F401 (a fixture)
from _procs import alive, lines

PICKUP = 2.0            # SPEC 9: "within a couple of seconds"
PICKUP_DEADLINE = 4.5   # ... on a loaded machine
JOB_DIRS = ("tmp", "incoming", "processing", "done", "dlq", "failed")


# Helpers ######################################################################

def cli(spool, *args):
    return call_myq("--spool", spool, *args)


def ok(cp):
    assert cp.returncode == 0, (cp.args, cp.returncode, cp.stdout, cp.stderr)
    return cp


def stats(spool):
    return json.loads(ok(cli(spool, "stats", "--json")).stdout)


def snapshot(spool):
    """{path: bytes} of every regular file under the spool."""
    out = {}
    for d, _, files in os.walk(spool):
        for n in files:
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    out[p] = f.read()
    return out


def _mentions(obj, name):
    if isinstance(obj, dict):
        return name in obj or any(_mentions(v, name) for v in obj.values())
    if isinstance(obj, list):
        return any(_mentions(v, name) for v in obj)
    return obj == name


def policy_file(spool, type_):
    """The policy file: the JSON file under the spool (outside the job
    directories) that names `type_`.  SPEC 9 fixes "cat-able JSON in the
    spool", not the name; SPOOL/policy.json is preferred when it is one."""
    found = []
    for d, dirs, files in os.walk(spool):
        if d == spool:
            dirs[:] = [x for x in dirs if x not in JOB_DIRS]
        for n in files:
            p = os.path.join(d, n)
            if not os.path.isfile(p) or os.path.islink(p):
                continue                # locks/wake is a FIFO
            try:
                with open(p, "rb") as f:
                    obj = json.loads(f.read().decode("utf-8"))
            except (OSError, ValueError):
                continue
            if _mentions(obj, type_):
                found.append(p)
    assert found, "no JSON file under %s names type %s" % (spool, type_)
    pref = os.path.join(spool, "policy.json")
    if pref in found:
        return pref
    assert len(found) == 1, "which is the policy file? %s" % found
    return found[0]


def replace_file(path, data):
    """A hand edit done right: write beside, rename over."""
    tmp = path + ".hand-edit"
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, path)


def policy_text(spool):
    """`myq policy` -> {TYPE or '*': {key: value}} (SPEC 9: one line each,
    `TYPE key=value …`)."""
    out = {}
    for line in ok(cli(spool, "policy")).stdout.splitlines():
        if not line.strip():
            continue
        words = line.split()
        d = out.setdefault(words[0], {})
        for kv in words[1:]:
            assert "=" in kv, "not key=value: %r in %r" % (kv, line)
            k, v = kv.split("=", 1)
            d[k] = v
    return out


def policy_json(spool):
    """`myq policy --json` -> {TYPE or '*': {key: value}}, whichever of the
    plausible shapes it prints (see the module docstring)."""
    text = ok(cli(spool, "policy", "--json")).stdout.strip()
    try:
        docs = [json.loads(text)]
    except ValueError:
        docs = [json.loads(l) for l in text.splitlines() if l.strip()]
    out = {}

    def add(name, d):
        out[name] = dict((k, v) for k, v in d.items() if k != "type")
    for doc in docs:
        if isinstance(doc, list):
            for it in doc:
                add(it["type"], it)
        elif isinstance(doc.get("type"), str):
            add(doc["type"], doc)
        elif isinstance(doc.get("types"), dict):
            for k, v in doc["types"].items():
                add(k, v)
            if isinstance(doc.get("default"), dict):
                add("*", doc["default"])
        else:
            for k, v in doc.items():
                assert isinstance(v, dict), "policy --json: %r" % (doc,)
                add("*" if k == "default" else k, v)
    return out


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _dur(v):
    if isinstance(v, (int, float)):
        return float(v)
    v = v.strip()
    if v and v[-1] in _UNITS:
        return float(v[:-1] or 1) * _UNITS[v[-1]]
    return float(v)


def _size(v):
    if isinstance(v, (int, float)):
        return int(v)
    mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
    v = v.strip().upper()
    if v and v[-1] in mult:
        return int(float(v[:-1]) * mult[v[-1]])
    return int(v)


def _rate(v):
    """-> starts per second."""
    if isinstance(v, (list, tuple)):
        return float(v[0]) / _dur(v[1])
    n, per = str(v).split("/", 1)
    return float(n) / _dur(per)


def norm(key, v):
    if key == "ttl":
        return _dur(v)
    if key == "max_bytes":
        return _size(v)
    if key == "rate":
        return _rate(v)
    if key == "paused":
        return v in (True, "true", "True", "1", 1, "yes")
    if key in ("max_queued", "priority", "concurrency", "breaker"):
        return int(v)
    return str(v)


def assert_policy(got, want):
    """`got` {type: {key: value}} holds `want` (values compared by meaning)."""
    for t, keys in want.items():
        assert t in got, "no policy for %s in %s" % (t, got)
        for k, v in keys.items():
            assert k in got[t], "%s has no %s: %s" % (t, k, got[t])
            assert norm(k, got[t][k]) == norm(k, v), (t, k, got[t][k], v)


def is_paused(pol, t):
    return norm("paused", pol.get(t, {}).get("paused", False))


def rec_handler(handlers_dir, tmp_path, name, body="exit 0"):
    """Exec handler `name`: appends `ID ATTEMPT EPOCH` to T/starts when it
    starts, then runs `body`."""
    return handlers_dir(name, 'echo "$MYQ_JOB_ID $MYQ_ATTEMPT $(date +%%s.%%N)"'
                        ' >> "%s/starts"\n%s' % (tmp_path, body))


def starts(tmp_path):
    """[(id, attempt, epoch)] in the order the handler runs started."""
    out = []
    for l in lines(tmp_path / "starts"):
        jid, att, ts = l.split()
        out.append((jid, int(att), float(ts)))
    return out


def started_ids(tmp_path):
    return [s[0] for s in starts(tmp_path)]


def bg_worker(procs, tmp_path, spool, *opts, name="w"):
    """A worker in the background logging to T/NAME.log, once it started."""
    log = tmp_path / (name + ".log")
    w = procs.worker(spool, *opts, log=log)
    wait_for(lambda: log.exists() and "event=start worker=" in log.read_text(),
             what="worker %s to start" % name)
    return w, log


def run_sentinel(spool, tmp_path, timeout=15):
    """Enqueue a job of type `sentinel` (its handler must exist) and wait
    until it is done: proof that the worker scanned incoming/ since."""
    jid = enqueue(call_myq, spool, "sentinel")
    wait_for(lambda: state(call_myq, spool, jid) == "done", timeout=timeout,
             what="the sentinel job to run")
    return jid


def waiting(spool, type_=None):
    """Ids of the waiting jobs (ready + scheduled) of `type_`."""
    out = []
    for st in ("ready", "scheduled"):
        cp = ok(cli(spool, "list", st, "--json", *(("--type", type_) if type_ else ())))
        out += [json.loads(l)["id"] for l in cp.stdout.splitlines() if l.strip()]
    return sorted(out)


def incoming_jobs(spool):
    """Job files in incoming/ and in any sub-directory (lane) a worker
    keeps there (SPEC 9)."""
    return sorted(n for _, _, files in os.walk(os.path.join(spool, "incoming"))
                  for n in files if n.endswith(".json"))


def waiting_bytes(spool, type_):
    """The size of the waiting job files of `type_` (incoming/ and any
    sub-directory a worker keeps there; on an SQLite spool, the sizes of
    its ready rows, each the bytes of the file the job would be)."""
    rows = sql(spool, "SELECT coalesce(sum(size), 0) FROM jobs WHERE "
               "status='ready' AND type=?", (type_,))
    if rows is not None:
        return rows[0][0]
    total = 0
    for d, _, files in os.walk(os.path.join(spool, "incoming")):
        for n in files:
            if not n.endswith(".json"):
                continue
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                data = f.read()
            if json.loads(data.split(b"\n", 1)[0]).get("type") == type_:
                total += len(data)
    return total


def dead_error(spool, jid):
    job = show(call_myq, spool, jid)
    assert job["state"] == "dead", job
    return job["last_error"] or ""


def gone_or_not_waiting(spool, jid):
    cp = cli(spool, "show", jid)
    if cp.returncode == 66:
        return True
    ok(cp)
    return json.loads(cp.stdout)["state"] not in ("ready", "scheduled", "held",
                                                  "processing")


# A test HTTP server ###########################################################

@pytest.fixture
def servers(http_servers):
    """make(answer) -> a running server (the shared one, _http) whose
    answer(handler) gives the status; srv.answers() lists (time, status,
    Idempotency-Key)."""
    def make(answer=lambda h: 200):
        def route(h):
            code = answer(h)
            _http.answer(h, code, b"status %d" % code, close=True)
        return http_servers(default=route)
    return make


def http_job(spool, url, *opts):
    return enqueue(call_myq, spool, "http", json.dumps({"url": url}), *opts)


# 1. myq policy ################################################################

def test_policy_set_and_show_as_lines_and_json(spool):
    ok(cli(spool, "policy", "tele", "max_queued=5000", "overflow=drop-oldest",
           "ttl=7d", "priority=5"))
    ok(cli(spool, "policy", "alarm", "priority=9", "max_bytes=64K",
           "concurrency=2", "rate=30/m", "breaker=5"))
    ok(cli(spool, "policy", "--default", "ttl=3d"))
    want = {"tele": {"max_queued": 5000, "overflow": "drop-oldest",
                     "ttl": 7 * 86400, "priority": 5},
            "alarm": {"priority": 9, "max_bytes": 65536, "concurrency": 2,
                      "rate": "30/m", "breaker": 5},
            "*": {"ttl": 3 * 86400}}
    text = policy_text(spool)
    assert_policy(text, want)
    assert "ttl" not in text["alarm"], "the default is not the type's own"
    assert_policy(policy_json(spool), want)
    # a second call changes one key and keeps the others
    ok(cli(spool, "policy", "tele", "priority=-2"))
    want["tele"]["priority"] = -2
    assert_policy(policy_text(spool), want)


def test_empty_value_removes_a_key(spool):
    ok(cli(spool, "policy", "tele", "ttl=7d", "max_queued=5"))
    ok(cli(spool, "policy", "tele", "ttl="))
    got = policy_text(spool)
    assert "ttl" not in got.get("tele", {}), got
    assert_policy(got, {"tele": {"max_queued": 5}})
    assert "ttl" not in policy_json(spool).get("tele", {})


@pytest.mark.parametrize("args", [
    ["tele", "bogus=1"],
    ["tele", "max_queued=-1"],
    ["tele", "max_queued=lots"],
    ["tele", "max_bytes=12Q"],
    ["tele", "overflow=maybe"],
    ["tele", "ttl=soon"],
    ["tele", "ttl=-1s"],
    ["tele", "priority=10"],
    ["tele", "priority=-10"],
    ["tele", "priority=1.5"],
    ["tele", "concurrency=-1"],
    ["tele", "rate=5"],
    ["tele", "rate=5/fortnight"],
    ["tele", "rate=x/s"],
    ["tele", "breaker=-1"],
    ["tele", "handler=ftp"],
    ["tele", "paused=maybe"],
    ["tele", "max_queued=5", "bogus=1"],        # nothing half-applied
    ["--default", "ttl=soon"],
    ["--default", "bogus=1"],
])
def test_bad_key_or_value_exits_64_and_changes_nothing(spool, args):
    ok(cli(spool, "policy", "tele", "max_queued=7", "ttl=1h"))
    before = snapshot(spool)
    cp = cli(spool, "policy", *args)
    assert cp.returncode == 64, (cp.returncode, cp.stderr)
    one_line_error(cp)
    assert snapshot(spool) == before, "a refused policy changed the spool"
    assert_policy(policy_text(spool), {"tele": {"max_queued": 7, "ttl": 3600}})


def test_policy_file_is_catable_json_in_the_spool(spool):
    """Changed by atomic replace, JSON that `cat` shows; its name is the
    implementer's (the test finds the file that changed)."""
    before = snapshot(spool)
    ok(cli(spool, "policy", "tele", "max_queued=5000", "ttl=7d"))
    after = snapshot(spool)
    changed = [p for p in after if before.get(p) != after[p]]
    changed = [p for p in changed
               if os.path.relpath(p, spool).split(os.sep)[0] not in JOB_DIRS]
    pf = policy_file(spool, "tele")
    assert pf in changed, (pf, changed)
    doc = json.loads(after[pf].decode("utf-8"))       # cat-able JSON
    assert _mentions(doc, "tele") and _mentions(doc, "max_queued"), doc
    assert not [n for n in os.listdir(os.path.dirname(pf))
                if n != os.path.basename(pf) and
                n.startswith(os.path.basename(pf))], "a temporary file is left"


def test_concurrent_policy_calls_lose_nothing(spool):
    """20 processes each set another type, 5 more each another key of one
    type, all at once: every value is there afterwards."""
    keys = [("max_queued", "11"), ("ttl", "1h"), ("priority", "3"),
            ("concurrency", "2"), ("breaker", "4")]
    argvs = [["t%02d" % i, "max_queued=%d" % (100 + i)] for i in range(20)]
    argvs += [["shared", "%s=%s" % kv] for kv in keys]
    ps = [subprocess.Popen(myq_argv() + ["--spool", spool, "policy"] + a,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=clean_env(), universal_newlines=True)
          for a in argvs]
    for p, a in zip(ps, argvs):
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, (a, p.returncode, err)
    want = dict(("t%02d" % i, {"max_queued": 100 + i}) for i in range(20))
    want["shared"] = dict(keys)
    assert_policy(policy_text(spool), want)
    json.loads(open(policy_file(spool, "t00"), "rb").read().decode("utf-8"))


def test_default_applies_to_types_without_their_own_value(spool):
    ok(cli(spool, "policy", "--default", "max_queued=1"))
    ok(cli(spool, "policy", "own", "max_queued=2"))
    enqueue(call_myq, spool, "anytype")
    cp = cli(spool, "enqueue", "anytype")
    assert cp.returncode == 75, (cp.returncode, cp.stderr)
    enqueue(call_myq, spool, "own")
    enqueue(call_myq, spool, "own")             # its own bound: 2
    assert cli(spool, "enqueue", "own").returncode == 75
    ok(cli(spool, "policy", "--default", "max_queued="))
    enqueue(call_myq, spool, "anytype")         # the default is gone


def test_hand_edit_that_does_not_parse_is_ignored_and_check_reports_it(
        spool, handlers_dir, tmp_path, procs):
    """Workers keep the last good policy (here: `p` paused) and `check`
    names the file."""
    rec_handler(handlers_dir, tmp_path, "paus")
    h = rec_handler(handlers_dir, tmp_path, "sentinel")
    ok(cli(spool, "pause", "paus"))
    pf = policy_file(spool, "paus")
    good = open(pf, "rb").read()
    bg_worker(procs, tmp_path, spool, "--handlers", h, *FAST)
    p1 = enqueue(call_myq, spool, "paus", None, "--id", "p1")
    run_sentinel(spool, tmp_path)
    assert "p1" not in started_ids(tmp_path)
    with open(pf, "wb") as f:                   # an editor's bad save
        f.write(b'{"paus": {"paused": tru')
    cp = cli(spool, "check")
    assert cp.returncode == 1, cp.stdout
    named = [l for l in cp.stdout.splitlines() if os.path.basename(pf) in l]
    assert named, "check does not name the policy file:\n" + cp.stdout
    time.sleep(PICKUP + 0.5)                    # the worker has re-read it
    run_sentinel(spool, tmp_path)
    assert "p1" not in started_ids(tmp_path), "the bad file unpaused the type"
    assert state(call_myq, spool, p1) == "ready"
    replace_file(pf, good)
    cp = cli(spool, "check")
    assert not [l for l in cp.stdout.splitlines() if os.path.basename(pf) in l]
    ok(cli(spool, "resume", "paus"))
    wait_for(lambda: state(call_myq, spool, p1) == "done", timeout=PICKUP_DEADLINE,
             what="p1 to run once resumed")


def test_running_worker_picks_up_a_change_within_seconds(
        spool, handlers_dir, tmp_path, procs):
    """No restart, no myq command to wake it: the policy file is put back
    by hand (bytes saved while `p` was not paused)."""
    rec_handler(handlers_dir, tmp_path, "paus")
    h = rec_handler(handlers_dir, tmp_path, "sentinel")
    ok(cli(spool, "policy", "paus", "priority=1"))
    pf = policy_file(spool, "paus")
    unpaused = open(pf, "rb").read()
    ok(cli(spool, "pause", "paus"))
    assert open(pf, "rb").read() != unpaused
    bg_worker(procs, tmp_path, spool, "--handlers", h, *FAST)
    p1 = enqueue(call_myq, spool, "paus", None, "--id", "p1")
    run_sentinel(spool, tmp_path)
    assert state(call_myq, spool, p1) == "ready"
    t0 = time.monotonic()
    replace_file(pf, unpaused)
    wait_for(lambda: state(call_myq, spool, p1) == "done",
             timeout=PICKUP_DEADLINE, what="the worker to see the edit")
    print("picked up after %.2fs" % (time.monotonic() - t0))
    # and a change through the CLI too
    ok(cli(spool, "pause", "paus"))
    time.sleep(PICKUP + 0.5)
    p2 = enqueue(call_myq, spool, "paus", None, "--id", "p2")
    run_sentinel(spool, tmp_path)
    assert state(call_myq, spool, p2) == "ready", "pause not picked up"
    ok(cli(spool, "resume", "paus"))
    wait_for(lambda: state(call_myq, spool, p2) == "done",
             timeout=PICKUP_DEADLINE, what="resume to be picked up")


def test_handler_key_runs_the_type_with_a_builtin(run_myq, spool, servers):
    srv = servers()
    ok(cli(spool, "policy", "alarm", "handler=http"))
    jid = enqueue(call_myq, spool, "alarm", json.dumps({"url": srv.url("/a")}))
    cp = worker(run_myq, spool, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert state(call_myq, spool, jid) == "done", show(call_myq, spool, jid)
    assert [h[2] for h in srv.answers()] == [jid]


# 2. pause, resume #############################################################

def test_paused_type_does_not_start_drain_exits_stats_and_check_show_it(
        run_myq, spool, handlers_dir, tmp_path):
    rec_handler(handlers_dir, tmp_path, "metrics")
    h = rec_handler(handlers_dir, tmp_path, "alarms")
    ok(cli(spool, "pause", "metrics"))
    assert is_paused(policy_text(spool), "metrics")
    for i in range(3):
        enqueue(call_myq, spool, "metrics", None, "--id", "p%d" % i)
    enqueue(call_myq, spool, "alarms", None, "--id", "q0")
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr        # --drain: paused is not ready
    assert started_ids(tmp_path) == ["q0"]
    assert waiting(spool, "metrics") == ["p0", "p1", "p2"]
    assert stats(spool)["paused"] == ["metrics"]
    chk = cli(spool, "check")
    assert chk.returncode == 1
    assert [l for l in chk.stdout.splitlines()
            if "metrics" in l and "pause" in l], chk.stdout
    ok(cli(spool, "resume", "metrics"))
    assert not is_paused(policy_text(spool), "metrics")
    assert stats(spool)["paused"] == []
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert sorted(started_ids(tmp_path)) == ["p0", "p1", "p2", "q0"]
    assert cli(spool, "check").returncode == 0


def test_pause_lets_the_running_job_finish(spool, handlers_dir, tmp_path, procs):
    body, started, release = blocking_handler(tmp_path)
    h = handlers_dir("slow", body)
    enqueue(call_myq, spool, "slow", None, "--id", "s1")
    w, log = bg_worker(procs, tmp_path, spool, "--drain", "--handlers", h, *FAST)
    wait_for(lambda: (started / "s1").exists(), what="s1 to start")
    ok(cli(spool, "pause", "slow"))
    enqueue(call_myq, spool, "slow", None, "--id", "s2")
    time.sleep(PICKUP + 0.5)                    # SPEC's allowance to see it
    release.touch()
    w.wait(20)                                  # --drain: only paused left
    assert w.returncode == 0
    assert state(call_myq, spool, "s1") == "done"
    assert state(call_myq, spool, "s2") == "ready"
    assert not (started / "s2").exists()


def test_pause_all_covers_new_types_and_resume_all(run_myq, spool, handlers_dir,
                                                   tmp_path):
    rec_handler(handlers_dir, tmp_path, "old")
    h = rec_handler(handlers_dir, tmp_path, "brandnew")
    ok(cli(spool, "policy", "old", "priority=1"))
    ok(cli(spool, "pause", "--all"))
    enqueue(call_myq, spool, "old", None, "--id", "o1")
    enqueue(call_myq, spool, "brandnew", None, "--id", "n1")
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert started_ids(tmp_path) == []
    assert cli(spool, "check").returncode == 1
    ok(cli(spool, "resume", "--all"))
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert sorted(started_ids(tmp_path)) == ["n1", "o1"]


def test_pause_resume_refuse_nothing_to_do(spool):
    assert cli(spool, "pause").returncode == 64
    assert cli(spool, "resume").returncode == 64


# 3. Bounds ####################################################################

def test_max_queued_reject_counts_waiting_jobs_only(spool, handlers_dir, tmp_path,
                                                    procs):
    body, started, release = blocking_handler(tmp_path)
    h = handlers_dir("tele", body)
    ok(cli(spool, "policy", "tele", "max_queued=2"))
    enqueue(call_myq, spool, "tele", None, "--id", "r1")
    bg_worker(procs, tmp_path, spool, "--handlers", h, *FAST)
    wait_for(lambda: (started / "r1").exists(), what="r1 to start")
    enqueue(call_myq, spool, "tele", None, "--id", "w1")      # running: not counted
    enqueue(call_myq, spool, "tele", None, "--id", "w2", "--delay", "1h")
    cp = cli(spool, "enqueue", "tele", "null", "--id", "w3")
    assert cp.returncode == 75, (cp.returncode, cp.stderr)
    err = one_line_error(cp)
    assert "tele" in err and "max_queued" in err, err
    assert cli(spool, "show", "w3").returncode == 66, "half-written"
    assert waiting(spool, "tele") == ["w1", "w2"]
    enqueue(call_myq, spool, "other")                         # other types: free
    release.touch()


def test_max_bytes_reject(spool):
    ok(cli(spool, "policy", "blob", "max_bytes=2K"))
    payload = json.dumps("x" * 600)
    n, cp = 0, None
    for n in range(10):
        cp = cli(spool, "enqueue", "blob", payload)
        if cp.returncode != 0:
            break
    assert cp.returncode == 75, (cp.returncode, cp.stderr)
    err = one_line_error(cp)
    assert "blob" in err and "max_bytes" in err, err
    total = waiting_bytes(spool, "blob")
    assert n >= 2 and total <= 2048, (n, total)
    assert total + total // n > 2048, "refused below the bound"


def test_api_raises_spoolfull_at_the_bound(myq, spool):
    ok(cli(spool, "policy", "tele", "max_queued=1"))
    myq.enqueue(spool, "tele", {"n": 1})
    with pytest.raises(myq.SpoolFull) as e:
        myq.enqueue(spool, "tele", {"n": 2})
    assert isinstance(e.value, myq.MyqError)
    assert "tele" in str(e.value) and "max_queued" in str(e.value)
    assert len(waiting(spool, "tele")) == 1


def _drop_files(spool, type_, n, prefix="s"):
    now = time.time()
    for i in range(n):
        path = write_incoming(spool, "%s%d.json" % (prefix, i), {
            "type": type_, "payload": i, "created_at": now - 100 + i})
        os.utime(path, (now - 100 + i, now - 100 + i))


def test_shell_producer_files_past_the_bound_are_rejected_at_scan(
        run_myq, spool, handlers_dir, tmp_path):
    h = rec_handler(handlers_dir, tmp_path, "sh")
    ok(cli(spool, "policy", "sh", "max_queued=2"))
    _drop_files(spool, "sh", 5)
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert sorted(started_ids(tmp_path)) == ["s0", "s1"]
    for jid in ("s2", "s3", "s4"):              # the newest excess
        assert dead_error(spool, jid).startswith("rejected"), jid
    assert stats(spool)["rejected"] == 3


def test_drop_oldest_removes_lowest_priority_then_earliest(spool):
    ok(cli(spool, "policy", "tele", "max_queued=3", "overflow=drop-oldest"))
    enqueue(call_myq, spool, "tele", None, "--id", "a")
    enqueue(call_myq, spool, "tele", None, "--id", "b", "--priority", "5")
    enqueue(call_myq, spool, "tele", None, "--id", "c")
    for jid in ("d", "e", "f"):                 # each makes room: a, c, d go
        enqueue(call_myq, spool, "tele", None, "--id", jid)
    assert waiting(spool, "tele") == ["b", "e", "f"]
    for jid in ("a", "c", "d"):
        assert gone_or_not_waiting(spool, jid), jid
    assert stats(spool)["dropped"] == 3
    # the earliest made, not the earliest due: a job made first that waits
    # for a time to come (a delay, a retry) went last (review)
    ok(cli(spool, "policy", "tz", "max_queued=2", "overflow=drop-oldest"))
    enqueue(call_myq, spool, "tz", None, "--id", "x1", "--delay", "100")
    for jid in ("x2", "x3"):
        enqueue(call_myq, spool, "tz", None, "--id", jid)
    assert gone_or_not_waiting(spool, "x1")
    assert sorted(waiting(spool, "tz")) == ["x2", "x3"], waiting(spool, "tz")


def test_drop_oldest_at_scan_is_logged_and_counted(run_myq, spool, handlers_dir,
                                                   tmp_path):
    h = rec_handler(handlers_dir, tmp_path, "dr")
    ok(cli(spool, "policy", "dr", "max_queued=2", "overflow=drop-oldest"))
    _drop_files(spool, "dr", 4)
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert sorted(started_ids(tmp_path)) == ["s2", "s3"]
    assert len([l for l in cp.stderr.splitlines() if "event=dropped" in l]) == 2, \
        cp.stderr
    assert stats(spool)["dropped"] == 2
    assert gone_or_not_waiting(spool, "s0") and gone_or_not_waiting(spool, "s1")


def test_retries_and_operator_retry_are_not_new_arrivals(
        spool, handlers_dir, tmp_path, procs):
    """`rt` (max_queued=1): a is running when b fills the bound; a fails
    and comes back (2 waiting): neither is rejected.  `op` (max_queued=1):
    c is dead, d fills the bound, `myq retry c` is not refused."""
    body, started, release = blocking_handler(tmp_path)
    handlers_dir("rt", body.replace("exit 0", "exit 1"))
    handlers_dir("op", "exit 65")
    h = rec_handler(handlers_dir, tmp_path, "sentinel")
    ok(cli(spool, "policy", "rt", "max_queued=1"))
    ok(cli(spool, "policy", "op", "max_queued=1"))
    enqueue(call_myq, spool, "rt", None, "--id", "a")
    enqueue(call_myq, spool, "op", None, "--id", "c")
    bg_worker(procs, tmp_path, spool, "--handlers", h, *FAST)
    wait_for(lambda: (started / "a").exists(), what="a to start")
    enqueue(call_myq, spool, "rt", None, "--id", "b", "--delay", "1h")
    release.touch()
    wait_for(lambda: state(call_myq, spool, "a") == "scheduled",
             what="a to be retried")
    wait_for(lambda: state(call_myq, spool, "c") == "dead", what="c dead")
    enqueue(call_myq, spool, "op", None, "--id", "d", "--delay", "1h")
    ok(cli(spool, "retry", "c"))              # not refused: not an arrival
    run_sentinel(spool, tmp_path)
    assert waiting(spool, "rt") == ["a", "b"]
    for jid in ("a", "b", "c", "d"):
        assert not (show(call_myq, spool, jid)["last_error"] or ""
                    ).startswith("rejected"), jid
    assert stats(spool)["rejected"] == 0


# 4. Expiry ####################################################################

def _expire_wait(spool, *jids):
    """Until every job's expiry has passed (read from show: expires_at)."""
    ts = [show(call_myq, spool, j)["expires_at"] for j in jids]
    wait_for(lambda: time.time() > max(ts) + 0.05, timeout=30,
             what="the jobs' expiry")


@pytest.mark.parametrize("via", ["cli", "api"])
def test_expired_job_is_never_started(myq, run_myq, spool, handlers_dir, tmp_path,
                                      via):
    h = rec_handler(handlers_dir, tmp_path, "ex")
    if via == "cli":
        x = enqueue(call_myq, spool, "ex", None, "--id", "exp-x", "--ttl", "0.5")
        y = enqueue(call_myq, spool, "ex", None, "--id", "live-y", "--ttl", "1h")
    else:
        x = myq.enqueue(spool, "ex", None, id="exp-x", ttl=0.5)
        y = myq.enqueue(spool, "ex", None, id="live-y", ttl=3600)
    job = show(call_myq, spool, x)
    assert job["expires_at"] == pytest.approx(job["created_at"] + 0.5, abs=0.05)
    _expire_wait(spool, x)
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert started_ids(tmp_path) == [y]
    assert dead_error(spool, x).startswith("expired")
    assert state(call_myq, spool, y) == "done"
    assert stats(spool)["expired"] == 1
    assert [l for l in cp.stderr.splitlines() if x in l and "expire" in l], \
        "the expiry is not logged:\n" + cp.stderr


@pytest.mark.parametrize("ttl", ["soon", "-1", "1x"])
def test_enqueue_bad_ttl_is_64(spool, ttl):
    cp = cli(spool, "enqueue", "ex", "null", "--ttl", ttl)
    assert cp.returncode == 64, (cp.returncode, cp.stderr)
    one_line_error(cp)
    assert incoming_jobs(spool) == []


def test_policy_ttl_counts_from_created_at_with_the_current_ttl(
        run_myq, spool, handlers_dir, tmp_path):
    """p1 enqueued before any policy, then `ttl=1s`: expired.  p2 under
    `ttl=1s`, then `ttl=1h`: runs.  --default reaches other types."""
    rec_handler(handlers_dir, tmp_path, "pt")
    h = rec_handler(handlers_dir, tmp_path, "other")
    p1 = enqueue(call_myq, spool, "pt", None, "--id", "p1")
    ok(cli(spool, "policy", "pt", "ttl=1s"))
    ok(cli(spool, "policy", "--default", "ttl=1s"))
    p2 = enqueue(call_myq, spool, "pt", None, "--id", "p2")
    o1 = enqueue(call_myq, spool, "other", None, "--id", "o1")
    created = show(call_myq, spool, p2)["created_at"]
    wait_for(lambda: time.time() > created + 1.1, what="1 s to pass")
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert started_ids(tmp_path) == []
    for jid in (p1, p2, o1):
        assert dead_error(spool, jid).startswith("expired"), jid
    assert stats(spool)["expired"] == 3
    # now the current ttl is what counts
    p3 = enqueue(call_myq, spool, "pt", None, "--id", "p3")
    c3 = show(call_myq, spool, p3)["created_at"]
    wait_for(lambda: time.time() > c3 + 1.1, what="1 s to pass")
    ok(cli(spool, "policy", "pt", "ttl=1h"))
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert started_ids(tmp_path) == [p3]


def test_a_run_already_started_finishes_past_its_expiry(spool, handlers_dir,
                                                        tmp_path, procs):
    """A warm worker starts r1 (`--ttl 2`) at once; it is still running
    when its expiry passes, and finishes."""
    body, started, release = blocking_handler(tmp_path)
    h = handlers_dir("slow", body)
    bg_worker(procs, tmp_path, spool, "--handlers", h, *FAST)
    enqueue(call_myq, spool, "slow", None, "--id", "r1", "--ttl", "2")
    wait_for(lambda: (started / "r1").exists() or state(call_myq, spool, "r1")
             == "dead", what="r1 to start")
    assert (started / "r1").exists(), "r1 expired before a warm worker took it"
    _expire_wait(spool, "r1")
    release.touch()
    wait_for(lambda: state(call_myq, spool, "r1") in ("done", "dead"),
             what="r1 to finish")
    assert state(call_myq, spool, "r1") == "done"


def test_retry_of_an_expired_job_clears_its_expiry(spool, handlers_dir, tmp_path,
                                                   procs):
    """x (`--ttl 1.5`) and y (its type's `ttl=1.5s`) wait out their ttl
    while their types are paused (the ttl keeps running), expire once
    resumed, and run after `myq retry` (the ttl counts from the retry: a
    warm worker starts them well within it)."""
    rec_handler(handlers_dir, tmp_path, "ex")
    h = rec_handler(handlers_dir, tmp_path, "ey")
    ok(cli(spool, "policy", "ey", "ttl=1.5s"))
    ok(cli(spool, "pause", "ex", "ey"))
    bg_worker(procs, tmp_path, spool, "--handlers", h, *FAST)
    enqueue(call_myq, spool, "ex", None, "--id", "x", "--ttl", "1.5")
    enqueue(call_myq, spool, "ey", None, "--id", "y")
    created = show(call_myq, spool, "y")["created_at"]
    _expire_wait(spool, "x")
    wait_for(lambda: time.time() > created + 1.6, what="y's ttl to pass")
    ok(cli(spool, "resume", "ex", "ey"))
    wait_for(lambda: all(state(call_myq, spool, j) == "dead" for j in "xy"),
             timeout=PICKUP_DEADLINE, what="x and y to expire")
    assert dead_error(spool, "x").startswith("expired")
    assert dead_error(spool, "y").startswith("expired")
    assert started_ids(tmp_path) == []
    ok(cli(spool, "retry", "x", "y"))
    exp = show(call_myq, spool, "x").get("expires_at")
    assert exp is None or exp > time.time(), "retry kept the old expiry"
    wait_for(lambda: all(state(call_myq, spool, j) in ("done", "dead")
                         for j in "xy"), what="x and y to run")
    assert sorted(started_ids(tmp_path)) == ["x", "y"]
    assert state(call_myq, spool, "x") == "done"
    assert state(call_myq, spool, "y") == "done"


# A clock that jumps (libfaketime on myq's processes, as tests/test_clock.py)

def _find_faketime():
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1",
                    "/usr/lib/faketime/libfaketime.so.1",
                    "/usr/local/lib/faketime/libfaketime.so.1",
                    "/usr/lib64/faketime/libfaketime.so.1"):
        found = glob.glob(pattern)
        if found:
            return found[0]
    return None


FT_LIB = _find_faketime()
FT_BASE = {"FAKETIME_DONT_FAKE_MONOTONIC": "1", "NO_FAKE_STAT": "1"}
needs_faketime = pytest.mark.skipif(
    FT_LIB is None, reason="libfaketime is not installed (apt-get install faketime)")
DAY2_1970 = 86400 + 3600          # 1970-01-02 01:00 UTC


def ft_env(offset=None, rcfile=None):
    env = dict(FT_BASE, LD_PRELOAD=FT_LIB)
    if rcfile:
        env.update(FAKETIME_TIMESTAMP_FILE=str(rcfile), FAKETIME_NO_CACHE="1")
    else:
        env["FAKETIME"] = offset
    return env


@needs_faketime
def test_clock_jump_from_1970_never_expires_a_job_early(
        run_myq, spool, handlers_dir, tmp_path, procs):
    """A device without a real-time clock: worker and producer run in
    1970, jobs with `--ttl 60` and a type `ttl=60s` are queued behind a
    running job, then NTP sets the clock 56 years ahead.  A few seconds
    of real waiting do not expire them."""
    body, started, release = blocking_handler(tmp_path)
    handlers_dir("hold", body)
    rec_handler(handlers_dir, tmp_path, "tj")
    h = rec_handler(handlers_dir, tmp_path, "pj")
    ok(cli(spool, "policy", "pj", "ttl=60s"))
    offset = "-%d" % int(time.time() - DAY2_1970)
    rc = tmp_path / "faketimerc"
    rc.write_text(offset + "\n")
    procs.worker(spool, "--handlers", h, *FAST, env=ft_env(rcfile=rc),
                 log=tmp_path / "w.log")
    enqueue(run_myq, spool, "hold", None, "--id", "h1", env=ft_env(offset))
    wait_for(lambda: (started / "h1").exists(), what="h1 to start")
    enqueue(run_myq, spool, "tj", None, "--id", "j1", "--ttl", "60",
            env=ft_env(offset))
    enqueue(run_myq, spool, "pj", None, "--id", "k1", env=ft_env(offset))
    assert show(call_myq, spool, "j1")["created_at"] < 10 ** 6, "not 1970"
    rc.write_text("+0\n")                       # the first NTP sync
    time.sleep(0.3)
    release.touch()
    for jid in ("j1", "k1"):
        wait_for(lambda: state(call_myq, spool, jid) in ("done", "dead"),
                 what="%s to finish" % jid)
        assert state(call_myq, spool, jid) == "done", show(call_myq, spool, jid)
    assert stats(spool)["expired"] == 0


def test_jobs_queued_on_a_1970_clock_do_not_expire_after_the_sync(
        run_myq, spool, handlers_dir, tmp_path):
    """The same device, its worker restarted after the clock was set: the
    files written in 1970 (JSON times and the kernel's mtimes) carry
    created_at/expires_at 56 years back.  They were not waiting for 56
    years: they run."""
    rec_handler(handlers_dir, tmp_path, "tj")
    h = rec_handler(handlers_dir, tmp_path, "pj")
    ok(cli(spool, "policy", "pj", "ttl=1h"))
    t = DAY2_1970
    for name, job in (("j2", {"type": "tj", "created_at": t, "available_at": t,
                              "updated_at": t, "expires_at": t + 3600}),
                      ("k2", {"type": "pj", "created_at": t, "available_at": t,
                              "updated_at": t})):
        path = write_incoming(spool, name + ".json", job)
        os.utime(path, (t, t))
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert sorted(started_ids(tmp_path)) == ["j2", "k2"]
    assert stats(spool)["expired"] == 0


# 5. Priority ##################################################################

@pytest.mark.parametrize("p", ["10", "-10", "1.5", "high", ""])
def test_enqueue_priority_out_of_range_is_64(spool, p):
    cp = cli(spool, "enqueue", "t", "null", "--priority", p)
    assert cp.returncode == 64, (cp.returncode, cp.stderr)
    one_line_error(cp)
    assert incoming_jobs(spool) == []


@pytest.mark.parametrize("p", ["-9", "0", "9"])
def test_enqueue_priority_is_a_job_field(spool, p):
    jid = enqueue(call_myq, spool, "t", None, "--priority", p)
    assert show(call_myq, spool, jid)["priority"] == int(p)


def test_priority_then_available_at_then_id(run_myq, spool, handlers_dir,
                                            tmp_path):
    """Jobs enqueued with `myq enqueue` (their priority known from the
    start; `pd` takes its type's priority=3), and two shell producer files
    of priority 0 with the same available_at (an earlier one than the
    others'), written in reverse id order."""
    rec_handler(handlers_dir, tmp_path, "pa")
    h = rec_handler(handlers_dir, tmp_path, "pd")
    ok(cli(spool, "policy", "pd", "priority=3"))
    at = time.time() - 30
    for jid in ("x2", "x1"):
        path = write_incoming(spool, jid + ".json", {
            "type": "pa", "created_at": at, "available_at": at})
        os.utime(path, (at, at))
    for jid, t, p in (("a", "pa", "0"), ("b", "pa", None), ("c", "pa", "5"),
                      ("d", "pa", "-1"), ("e", "pa", "5"), ("f", "pd", None),
                      ("g", "pa", "4")):
        enqueue(call_myq, spool, t, None, "--id", jid,
                *(("--priority", p) if p is not None else ()))
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert started_ids(tmp_path) == ["c", "e", "g", "f", "x1", "x2", "a", "b", "d"]


def test_policy_priority_is_fixed_when_the_job_is_enqueued(
        run_myq, spool, handlers_dir, tmp_path):
    h = rec_handler(handlers_dir, tmp_path, "pf")
    ok(cli(spool, "policy", "pf", "priority=-5"))
    enqueue(call_myq, spool, "pf", None, "--id", "u1")
    ok(cli(spool, "policy", "pf", "priority=3"))
    enqueue(call_myq, spool, "pf", None, "--id", "u2")
    enqueue(call_myq, spool, "pf", None, "--id", "u3", "--priority", "0")
    assert show(call_myq, spool, "u1")["priority"] == -5
    assert show(call_myq, spool, "u2")["priority"] == 3
    assert show(call_myq, spool, "u3")["priority"] == 0
    cp = worker(run_myq, spool, handlers=h, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert started_ids(tmp_path) == ["u2", "u3", "u1"]


DEPTH = 20000


def test_priority_9_is_next_to_start_at_depth(myq, run_myq, spool, tmp_path,
                                              procs):
    """20,000 priority-0 jobs (shell producer files) being drained by one
    worker; a priority-9 job enqueued through the API, then one through
    `myq enqueue`, then one that becomes ready 1 s later: each is the next
    to start.  A start recorded after the enqueue returned may be the job
    the worker had claimed already (one, concurrency 1)."""
    rec = tmp_path / "order"
    mod = tmp_path / "h.py"
    mod.write_text("import time\n_f = open(%r, 'a', buffering=1)\n\n"
                   "def lo(job):\n"
                   "    _f.write('%%s %%.6f\\n' %% (job['id'], time.time()))\n"
                   "    time.sleep(0.003)\n" % str(rec))
    now = time.time()
    inc = os.path.join(spool, "incoming")
    for i in range(DEPTH):
        with open(os.path.join(inc, "lo%05d.json" % i), "w") as f:
            f.write('{"type":"lo","payload":%d,"created_at":%r,'
                    '"available_at":%r}\n' % (i, now - 60 + i * 1e-3,
                                              now - 60 + i * 1e-3))
    t0 = time.monotonic()
    bg_worker(procs, tmp_path, spool, "--module", str(mod), "--poll", "0.1",
              "--jitter", "0")
    wait_for(lambda: len(lines(rec)) >= 30, timeout=120,
             what="the worker to be draining")
    print("first 30 started after %.1fs" % (time.monotonic() - t0))

    def check(jid, n_after):
        wait_for(lambda: jid in [l.split()[0] for l in lines(rec)], timeout=30,
                 what="%s to start" % jid)
        order = [l.split()[0] for l in lines(rec)]
        pos = order.index(jid)
        assert pos <= n_after + 1, (
            "%s started as #%d, %d jobs after its enqueue returned"
            % (jid, pos, pos - n_after))
    myq.enqueue(spool, "lo", None, id="hi-api", priority=9)
    check("hi-api", len(lines(rec)))
    enqueue(run_myq, spool, "lo", None, "--id", "hi-cli", "--priority", "9")
    check("hi-cli", len(lines(rec)))
    enqueue(run_myq, spool, "lo", None, "--id", "hi-later", "--priority", "9",
            "--delay", "1")
    due = show(call_myq, spool, "hi-later")["available_at"]
    wait_for(lambda: "hi-later" in [l.split()[0] for l in lines(rec)],
             timeout=30, what="hi-later to start")
    recs = [l.split() for l in lines(rec)]
    t_hi = [float(t) for j, t in recs if j == "hi-later"][0]
    between = [j for j, t in recs if due + 0.01 < float(t) < t_hi]
    assert len(between) <= 1, (
        "%d jobs started after hi-later became ready, before it" % len(between))
    assert len(lines(rec)) < DEPTH


# 6. Cross-worker limits #######################################################

def _intervals(tmp_path):
    """{id: [start, end]} from T/iv lines `ID EPOCH start|end`."""
    iv = {}
    for l in lines(tmp_path / "iv"):
        jid, ts, what = l.split()
        iv.setdefault(jid, [None, None])[0 if what == "start" else 1] = float(ts)
    return iv


def _max_overlap(iv, until=None):
    ev = []
    for s, e in iv.values():
        ev.append((s, 1))
        ev.append((e if e is not None else (until or float("inf")), -1))
    ev.sort(key=lambda x: (x[0], x[1]))        # an end before a start at a tie
    cur = best = 0
    for _, d in ev:
        cur += d
        best = max(best, cur)
    return best


IV_BODY = r'''T='%s'
echo "$MYQ_JOB_ID $(date +%%s.%%N) start" >> "$T/iv"
echo $$ > "$T/$MYQ_JOB_ID.pid"
%s
echo "$MYQ_JOB_ID $(date +%%s.%%N) end" >> "$T/iv"
'''


def test_concurrency_holds_across_two_workers(spool, handlers_dir, tmp_path,
                                              procs):
    h = handlers_dir("cc", IV_BODY % (tmp_path, "sleep 0.3"))
    ok(cli(spool, "policy", "cc", "concurrency=2"))
    for i in range(10):
        enqueue(call_myq, spool, "cc", None, "--id", "c%d" % i)
    for n in ("a", "b"):
        bg_worker(procs, tmp_path, spool, "--handlers", h, "--concurrency", "3",
                  *FAST, name=n)
    wait_for(lambda: len(ls(spool, "done")) >= 10, timeout=30,
             what="the 10 jobs to run")
    iv = _intervals(tmp_path)
    assert len(iv) == 10
    assert _max_overlap(iv) == 2, "max simultaneous %d, policy 2" % _max_overlap(iv)


def test_concurrency_slots_come_back_after_kill_9(spool, handlers_dir, tmp_path,
                                                  procs):
    """Worker A runs k1, k2 (both slots of `concurrency=2`) and is killed
    with SIGKILL, its handlers too.  Worker B takes the two jobs back and
    runs both at once; a third still waits for a slot."""
    hold = ('i=0; while [ ! -e "%s/release" ]; do sleep 0.02; i=$((i+1)); '
            '[ $i -gt 1500 ] && exit 1; done' % tmp_path)
    handlers_dir("kk", IV_BODY % (tmp_path, hold))
    h = rec_handler(handlers_dir, tmp_path, "sentinel")
    ok(cli(spool, "policy", "kk", "concurrency=2"))
    enqueue(call_myq, spool, "kk", None, "--id", "k1")
    enqueue(call_myq, spool, "kk", None, "--id", "k2")
    a, _ = bg_worker(procs, tmp_path, spool, "--handlers", h, "--concurrency", "3",
                     *FAST, name="a")
    wait_for(lambda: len(_intervals(tmp_path)) == 2, what="k1, k2 to start")
    pids = [int(open(str(tmp_path / (j + ".pid"))).read()) for j in ("k1", "k2")]
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            kill_quiet(pid)
    wait_for(lambda: not any(alive(p) for p in pids), what="handlers gone")
    os.unlink(str(tmp_path / "iv"))
    bg_worker(procs, tmp_path, spool, "--handlers", h, "--concurrency", "3",
              *FAST, name="b")
    wait_for(lambda: sorted(_intervals(tmp_path)) == ["k1", "k2"], timeout=20,
             what="B to run k1 and k2 at once (the slots came back)")
    enqueue(call_myq, spool, "kk", None, "--id", "k3")
    run_sentinel(spool, tmp_path)
    time.sleep(0.3)
    assert "k3" not in _intervals(tmp_path), "a third run of concurrency=2"
    (tmp_path / "release").touch()
    wait_for(lambda: all(state(call_myq, spool, j) == "done"
                         for j in ("k1", "k2", "k3")), timeout=20,
             what="all done")
    assert _max_overlap(_intervals(tmp_path)) == 2


def test_rate_holds_across_two_workers(spool, tmp_path, procs):
    """rate=5/s: at most 5 starts in any 0.7 s (not 1 s: the timestamps,
    taken by a --module handler as it is called, lag the starts by up to
    0.3 s on a loaded machine, and a limiter lets the 6th start exactly 1 s
    after the 1st; a limit per worker, per fixed window or a bucket of 5
    still shows 8 to 10), and the rate is used (15 jobs do not take
    much more than 3 s)."""
    mod = tmp_path / "rr.py"
    mod.write_text("import os, time\n\ndef rr(job):\n"
                   "    fd = os.open(%r, os.O_WRONLY | os.O_APPEND | os.O_CREAT)\n"
                   "    os.write(fd, ('%%s 1 %%.6f\\n' %% (job['id'], time.time()))"
                   ".encode())\n    os.close(fd)\n" % str(tmp_path / "starts"))
    ok(cli(spool, "policy", "rr", "rate=5/s"))
    n, per = 15, 5
    for i in range(n):
        enqueue(call_myq, spool, "rr", None, "--id", "r%02d" % i)
    for name in ("a", "b"):
        bg_worker(procs, tmp_path, spool, "--module", str(mod), "--concurrency",
                  "3", *FAST, name=name)
    wait_for(lambda: len(starts(tmp_path)) >= n, timeout=30,
             what="the jobs to start")
    ts = sorted(s[2] for s in starts(tmp_path))
    most = max(len([t for t in ts if t0 <= t < t0 + 0.7]) for t0 in ts)
    print("starts %s; most in 0.7 s: %d" % (["%.2f" % (t - ts[0]) for t in ts], most))
    assert most <= per, "%d starts within 0.7 s under rate=5/s" % most
    span = ts[-1] - ts[0]
    assert span >= (n - per) / float(per) * 0.9, span
    assert span <= n / float(per) * 2 + 1, "the rate is not used: %.1fs" % span


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
    had failed alone, the others never started: review.)"""
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
    rate (six in six seconds at rate=1/m: review): it is a start like any
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


def test_http_4xx_never_trips_and_a_4xx_answer_releases(run_myq, spool, servers,
                                                        procs, tmp_path):
    bad = servers(lambda h: 400)
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
    srv = servers(answer)
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


def test_http_destination_is_scheme_host_port(run_myq, spool, servers):
    down = servers(lambda h: 503)
    fine = servers(lambda h: 200)
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


# 8. Figures ###################################################################

def test_stats_json_has_the_policy_figures(spool):
    st = stats(spool)
    for k in ("dropped", "expired", "rejected"):
        assert st[k] == 0 and isinstance(st[k], int), (k, st)
    assert st["paused"] == [] and st["held"] == []
    ok(cli(spool, "pause", "zz", "aa"))
    assert sorted(stats(spool)["paused"]) == ["aa", "zz"]
    line = ok(cli(spool, "stats")).stdout.strip()
    assert STATUS_RE.match(line), line


def test_prometheus_has_the_policy_figures(spool):
    ok(cli(spool, "pause", "zz"))
    ok(cli(spool, "policy", "tele", "max_queued=1", "overflow=drop-oldest"))
    enqueue(call_myq, spool, "tele")
    enqueue(call_myq, spool, "tele")            # one dropped
    text = ok(cli(spool, "stats", "--prometheus")).stdout
    assert [l for l in text.splitlines()
            if l.startswith("myq_paused{") and 'type="zz"' in l
            and l.split()[-1] == "1"], text
    assert [l for l in text.splitlines()
            if l.startswith("myq_dropped_total{") and 'type="tele"' in l
            and l.split()[-1] == "1"], text


# One parser per kind of value ################################################

@pytest.mark.parametrize("kind", ["BOOL", "COUNT", "NATURAL", "PRIORITY", "SIZE",
                                  "SECONDS", "POSITIVE_SECONDS", "FRACTION"])
def test_every_kind_refuses_empty_and_bad_values_saying_what_it_takes(myq, kind):
    k = getattr(myq, kind)
    for bad in ("", "bogus", None, [1]):
        with pytest.raises(ValueError) as e:
            k(bad)
        assert str(e.value).startswith("it takes "), e.value


def test_the_policy_and_the_command_line_read_a_kind_alike(myq):
    """A policy file's `paused` and a MYQ_* switch are one BOOL (before,
    the switch took "" as false and the policy refused it); `priority`
    is --priority's kind."""
    P = myq.Policy
    assert P.KEYS["paused"] is P.KEYS["gzip"] is myq.BOOL
    assert P.KEYS["priority"] is myq.PRIORITY
    for text, want in [("yes", True), (" OFF ", False), ("1", True), (False, False)]:
        assert myq.BOOL(text) is want and P.value("paused", text) is want
    for bad in ("", "maybe"):
        with pytest.raises(myq.UsageError) as e:
            P.value("gzip", bad)
        assert "%s for policy key gzip: it takes true or false" % json.dumps(bad) \
            in str(e.value)
    assert P.value("ttl", "1h") == 3600 and P.value("ttl", 90.5) == 90.5
    assert P.value("max_bytes", "1M") == P.value("max_bytes", 1 << 20) == 1 << 20
    with pytest.raises(myq.UsageError):
        P.value("max_bytes", 1.5)
