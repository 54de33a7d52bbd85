"""Per-type policy, from outside: `myq policy` (as lines, as JSON, the
file in the spool, a hand edit, a running worker picking up a change),
`pause` and `resume`, the bounds (`max_queued`, `max_bytes`, `overflow`:
reject or drop-oldest, at enqueue and at a worker's scan), the figures
`stats --json` and the Prometheus text gain, and one parser per kind of
value for policy, flags and variables alike.

Everything goes through the CLI (quick commands in this process with
`call_myq`, workers as real processes), the Python API, and the shell
producer (a file written in tmp/, then renamed into incoming/).

What the contract leaves open is not assumed:
- the policy file's name and layout: a test that needs the file finds it
  (`policy_file`: the JSON file under the spool, outside the job
  directories, that names the type); tests compare its bytes or restore
  bytes saved earlier, never edit its structure;
- `policy --json`'s shape (`policy_json` accepts one object keyed by type
  with `*` or `default`, `{"default", "types"}`, or one object per line
  with a `type`), and how values are spelt (`ttl=7d` or `604800`);
- the extra fields of log events; which lines `check` prints (a line that
  names the thing is enough).

Where a rule is about something that must NOT happen, a sentinel job of
another type is run first (proof that the worker scanned); a running
worker is granted PICKUP seconds to see a change of policy, no more.
"""
import json
import os
import subprocess
import time

import pytest

from _core import (FAST, PICKUP, PICKUP_DEADLINE, STATUS_RE, blocking_handler,
                   call_myq, clean_env, cli, dead_error, enqueue, myq_argv, ok,
                   one_line_error, show, sql, state, stats, wait_for, waiting,
                   worker, write_incoming)
from _http import http_servers, status_servers  # noqa: F401 (fixtures)
from _procs import bg_worker, rec_handler, run_sentinel, started_ids

JOB_DIRS = ("tmp", "incoming", "processing", "done", "dlq", "failed")


# Helpers ######################################################################

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
    directories) that names `type_`.  The contract fixes "cat-able JSON in
    the spool", not the name; SPOOL/policy.json is preferred when it is one."""
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
    """`myq policy` -> {TYPE or '*': {key: value}} (one line each,
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


def gone_or_not_waiting(spool, jid):
    cp = cli(spool, "show", jid)
    if cp.returncode == 66:
        return True
    ok(cp)
    return json.loads(cp.stdout)["state"] not in ("ready", "scheduled", "held",
                                                  "processing")


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


def test_handler_key_runs_the_type_with_a_builtin(run_myq, spool, status_servers):
    srv = status_servers()
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
    time.sleep(PICKUP + 0.5)                    # the allowance to see it
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
    # for a time to come (a delay, a retry) went last
    ok(cli(spool, "policy", "tz", "max_queued=2", "overflow=drop-oldest"))
    enqueue(call_myq, spool, "tz", None, "--id", "x1", "--delay", "100")
    # (x2 at once: a file's mtime is the kernel's coarse clock, up to a
    # jiffy behind x1's created_at; on a tmpfs x2 was taken for the
    # earlier, and went, until drop-oldest allowed for it)
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
