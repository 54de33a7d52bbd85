"""myq export and myq import: a backlog as JSON lines.

- a spool with jobs in every state, exported, imported into a fresh spool
  and exported again gives the same lines (a claimed job comes back ready,
  its attempt counted), and a worker there runs the ready ones and leaves
  the dead ones dead;
- bad lines are refused by number, the rest imported (exit 65); ids the
  spool has are refused as enqueue refuses them (exit 73); the disk-free
  guard and a type's bound refuse (exit 75); a missing spool exits 78;
- an import killed (SIGKILL) at any of its steps and run again gives each
  job exactly once.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import myq
from _core import (ROOT, clean_env, drain_here, myq_argv, run_myq,
                   sql, write_incoming)

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


RAN = []


def _ok(job):
    RAN.append(job["id"])


def _bad(job):
    raise myq.PermanentError("bad is bad")


def _flaky(job):
    raise RuntimeError("flaky failed")


HANDLERS = {"ok": _ok, "bad": _bad, "flaky": _flaky}


def every_state(path, store="files"):
    """A spool with jobs in every state: ready (plain, a lane's, a shell
    producer's with an extra field), scheduled (a delay, a retry's
    backoff), processing (a live claim), done, dead, and a quarantined
    file."""
    myq.open_store(path).init(store=store)
    sp = myq.open_store(path)
    sp.enqueue("ok", {"n": "done"}, id="d1")
    sp.enqueue("bad", {"n": "dead"}, id="x1")
    sp.enqueue("flaky", {"n": "retried"}, id="r1", max_attempts=3)
    write_incoming(path, "junk.json", None, raw=b"{not json")
    drain_here(path, HANDLERS, backoff_base=7200.0, backoff_max=7200.0)
    assert sp.show("d1")["state"] == "done" and sp.show("x1")["state"] == "dead"
    if store == "files":
        assert os.path.exists(os.path.join(path, "done", "d1.json"))
        assert os.path.exists(os.path.join(path, "dlq", "x1.json"))
    assert os.listdir(os.path.join(path, "failed"))
    sp.enqueue("ok", {"n": "ready"}, id="a1", timeout=30)
    sp.enqueue("ok", {"n": "soon"}, id="s1", delay=3600)
    sp.enqueue("ok", {"n": "lane"}, id="p1", priority=5)
    sp.enqueue("ok", [1, "ü", None], id="c1")
    write_incoming(path, "sh1.json", {"type": "ok", "payload": "shell",
                                      "origin": "a shell producer"})
    me = myq.Identity(sp, lease=60)
    me.register()
    assert sp.claims.claim("c1.json", me) is not None
    return sp


def export(path, *args):
    cp = run_myq("--spool", path, "export", *args)
    return cp, [json.loads(l) for l in cp.stdout.splitlines()]


def lines(rows):
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


def import_(path, text, *args):
    return run_myq("--spool", path, "import", *args, input=text)


@pytest.mark.parametrize("src", ["files", "sqlite"])
def test_round_trip_keeps_every_state_and_a_worker_runs_the_ready_ones(
        tmp_path, src, store):
    """Every state kept from a spool of either store to one of either (a
    file spool becomes an SQLite one and back), and a worker then runs
    what is ready."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    every_state(a, src)
    cp, rows = export(a)
    assert cp.returncode == 0, cp.stderr
    by = dict((r["id"], r) for r in rows)
    assert {r["state"] for r in rows} == {"ready", "scheduled", "processing",
                                          "done", "dead"}
    assert by["c1"]["state"] == "processing" and by["c1"]["attempts"] == 1
    assert "lease" not in by["c1"]
    assert by["r1"]["state"] == "scheduled" and by["r1"]["attempts"] == 1
    assert by["r1"]["last_error"]
    assert by["sh1"]["origin"] == "a shell producer"
    assert by["x1"]["failed_at"] and by["p1"]["priority"] == 5
    assert set(by) == {"d1", "x1", "r1", "a1", "s1", "p1", "c1", "sh1"}

    myq.open_store(b).init(store=store)
    imp = import_(b, cp.stdout)
    assert imp.returncode == 0, imp.stderr
    assert "imported 8, duplicate 0, bad 0" in imp.stderr
    cp2, rows2 = export(b)
    assert cp2.returncode == 0, cp2.stderr
    expect = [dict(r, state="ready") if r["state"] == "processing" else r
              for r in rows]
    assert lines(rows2) == lines(expect)
    # the lines themselves, byte for byte (each job's keys in its order,
    # which the same store keeps)
    assert src != store or sorted(cp2.stdout.replace('"state":"processing"', '"state":"ready"')
                  .splitlines()) == sorted(
        cp.stdout.replace('"state":"processing"', '"state":"ready"').splitlines())

    del RAN[:]
    drain_here(b, HANDLERS)
    assert sorted(RAN) == ["a1", "c1", "p1", "sh1"]
    _, after = export(b)
    state = dict((r["id"], r["state"]) for r in after)
    assert state["x1"] == "dead" and state["s1"] == "scheduled"
    assert state["r1"] == "scheduled" and state["d1"] == "done"
    assert all(state[j] == "done" for j in ("a1", "c1", "p1", "sh1"))


def test_export_filters_and_failed_on_request(tmp_path, store):
    a = str(tmp_path / "a")
    every_state(a, store)
    _, rows = export(a, "dead", "done")
    assert sorted(r["id"] for r in rows) == ["d1", "x1"]
    _, rows = export(a, "ready", "--type", "ok")
    assert sorted(r["id"] for r in rows) == ["a1", "p1", "sh1"]
    _, rows = export(a, "failed")
    assert len(rows) == 1 and rows[0]["state"] == "failed"
    assert rows[0]["bytes"] == "{not json" and rows[0]["reason"]
    cp = run_myq("--spool", a, "export", "nosuch")
    assert cp.returncode == 64
    # a type no job can have, not UTF-8 at all (byte 0xff): no rows, as
    # files say (the SQLite store died encoding it)
    for args in (("export", "--type", "\udcff"),
                 ("delete", "--state", "done", "--type", "\udcff")):
        cp = run_myq("--spool", a, *args)
        assert cp.returncode == 0 and "Traceback" not in cp.stderr, cp.stderr
        assert cp.stdout.strip() in ("", "deleted=0"), cp.stdout


@pytest.mark.files_only
def test_export_skips_what_is_not_a_job_and_says_so(tmp_path, store):
    a = str(tmp_path / "a")
    sp = myq.open_store(a).init(store=store)
    sp.enqueue("ok", 1, id="good")
    write_incoming(a, "broken.json", None, raw=b'{"type": "ok", ')
    cp, rows = export(a)
    assert cp.returncode == 65
    assert [r["id"] for r in rows] == ["good"]
    assert "broken.json" in cp.stderr and "skipped" in cp.stderr


def test_bad_lines_are_refused_by_number_and_the_rest_imported(tmp_path, store):
    b = str(tmp_path / "b")
    myq.open_store(b).init(store=store)
    text = "\n".join([
        '{"id": "g1", "type": "ok", "payload": 1}',
        'not json',
        '{"id": "g2", "payload": 2}',
        '{"id": ".bad", "type": "ok"}',
        '{"type": "ok"}',
        '[1, 2]',
        '{"state": "failed", "file": "x.json", "reason": "r", "bytes": null}',
        '{"id": "g3", "type": "ok", "state": "sleeping"}',
        '{"id": "g4", "type": "ok", "attempts": -1}',
        '{"id": "g5", "type": "ok", "state": "dead", "attempts": 5}',
    ]) + "\n"
    cp = import_(b, text)
    assert cp.returncode == 65, cp.stderr
    for n in (2, 3, 4, 5, 6, 7, 8, 9):
        assert "line %d:" % n in cp.stderr
    assert "imported 2, duplicate 0, bad 8" in cp.stderr
    assert "Traceback" not in cp.stderr
    _, rows = export(b)
    assert {r["id"]: r["state"] for r in rows} == {"g1": "ready", "g5": "dead"}


def test_ids_the_spool_has_are_refused_as_enqueue_refuses_them(tmp_path, store):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    every_state(a)
    cp, _ = export(a)
    myq.open_store(b).init(store=store)
    assert import_(b, cp.stdout).returncode == 0
    again = import_(b, cp.stdout)
    assert again.returncode == 73, again.stderr
    assert "imported 0, duplicate 8, bad 0" in again.stderr
    # done within the de-duplication window: enqueue refuses it too
    assert run_myq("--spool", b, "enqueue", "ok", "--id", "d1").returncode == 73
    # a job done on the new spool is refused by a second import
    c = str(tmp_path / "c")
    myq.open_store(c).init(store=store)
    one = '{"id": "once", "type": "ok"}\n'
    assert import_(c, one).returncode == 0
    drain_here(c, HANDLERS)
    cp = import_(c, one)
    assert cp.returncode == 73 and "duplicate 1" in cp.stderr


def test_the_disk_guard_and_a_bound_refuse(tmp_path, store):
    b = str(tmp_path / "b")
    myq.open_store(b).init(store=store)
    text = "".join('{"id": "j%d", "type": "ok"}\n' % i for i in range(5))
    cp = import_(b, text, "--min-free", "1000G")
    assert cp.returncode == 75, cp.stderr
    assert "from line 1 on" in cp.stderr and "imported 0" in cp.stderr
    assert not [n for n in os.listdir(os.path.join(b, "incoming"))
                if n.endswith(".json")]
    assert export(b)[1] == []
    assert run_myq("--spool", b, "policy", "ok", "max_queued=2").returncode == 0
    cp = import_(b, text)
    assert cp.returncode == 75, cp.stderr
    assert "imported 2, duplicate 0, bad 0, refused 3" in cp.stderr
    assert "line 3:" in cp.stderr and "max_queued" in cp.stderr


def test_missing_spool_exits_78_and_creates_nothing(tmp_path):
    nope = str(tmp_path / "nope")
    assert run_myq("--spool", nope, "export").returncode == 78
    assert import_(nope, '{"id": "a", "type": "ok"}\n').returncode == 78
    assert not os.path.exists(nope)
    assert run_myq("--spool", nope, "import", str(tmp_path / "no.jsonl")
                   ).returncode in (66, 78)


# A real import killed mid-stream, then run again ###############################

KILLER = (
    "import os, signal, sys\n"
    "sys.path.insert(0, %r)\n"
    "import myq\n"
    "seen = [0]\n"
    "def hook(op, path, when):\n"
    "    seen[0] += 1\n"
    "    if seen[0] == int(os.environ['DIE_AT']):\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "myq._hook = hook\n"
    "rc = myq.main(sys.argv[1:])\n"
    "sys.stderr.write('steps=%%d\\n' %% seen[0])\n"
    "sys.exit(rc)\n" % ROOT)


def _backlog(n):
    out = []
    for i in range(n):
        state = ("ready", "scheduled", "dead", "done", "processing")[i % 5]
        job = {"id": "k%03d" % i, "type": "ok", "payload": {"i": i},
               "attempts": i % 3, "available_at": time.time() +
               (3600 if state == "scheduled" else -10),
               "created_at": time.time() - 60, "updated_at": time.time() - 30,
               "last_error": None, "state": state}
        out.append(json.dumps(job))
    return "\n".join(out) + "\n"


def _ids_once(path):
    """{id: [the directories it is in]}; an SQLite spool's rows as the
    directory of their state."""
    where = {}
    for jid, status in sql(path, "SELECT id, status FROM jobs") or ():
        where.setdefault(jid, []).append({
            "ready": "incoming", "dead": "dlq"}.get(status, status))
    for sub in ("incoming", "done", "dlq", "processing"):
        for name in os.listdir(os.path.join(path, sub)):
            if name.endswith(".json"):
                where.setdefault(name[:-5], []).append(sub)
    return where


@pytest.mark.parametrize("frac", [0.02, 0.2, 0.35, 0.5, 0.51, 0.77, 0.99])
def test_an_import_killed_mid_stream_and_run_again_gives_each_job_once(
        tmp_path, frac, store):
    n = 600                     # three batches of 256 and a short one
    text = _backlog(n)
    probe = str(tmp_path / "probe")
    myq.open_store(probe).init(store=store)
    cp = subprocess.run([sys.executable, "-c", KILLER, "--spool", probe,
                         "import"], input=text, universal_newlines=True,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        env=clean_env({"DIE_AT": "0"}))   # (never: counts)
    assert cp.returncode == 0, cp.stderr
    steps = int(cp.stderr.rpartition("steps=")[2])
    # (each job: at least a create and a link; each batch of 256 one
    # transaction, two steps: before and after its commit)
    assert steps > (2 * n if store == "files" else 2 * (n // 256))

    b = str(tmp_path / "b")
    myq.open_store(b).init(store=store)
    die_at = max(1, int(steps * frac))
    cp = subprocess.run([sys.executable, "-c", KILLER, "--spool", b, "import"],
                        input=text, universal_newlines=True,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        env=clean_env({"DIE_AT": str(die_at)}))
    assert cp.returncode == -signal.SIGKILL, cp.stderr
    before = _ids_once(b)
    assert len(before) <= n
    cp = import_(b, text)
    assert cp.returncode in (0, 73), cp.stderr
    got = cp.stderr.rpartition("imported ")[2]
    imported, dup = int(got.split(",")[0]), int(got.split("duplicate ")[1]
                                                 .split(",")[0])
    assert dup == len(before) and imported + dup == n
    where = _ids_once(b)
    assert sorted(where) == ["k%03d" % i for i in range(n)]
    assert all(len(v) == 1 for v in where.values()), \
        [k for k, v in where.items() if len(v) > 1]
    for i in range(n):
        sub = where["k%03d" % i][0]
        assert sub == {"dead": "dlq", "done": "done"}.get(
            ("ready", "scheduled", "dead", "done", "processing")[i % 5],
            "incoming")
    _, rows = export(b)
    assert len(rows) == n


def test_an_import_killed_from_outside_and_run_again(tmp_path, store):
    """SIGKILL from another process while the import reads a pipe."""
    n = 2000
    text = _backlog(n)
    b = str(tmp_path / "b")
    myq.open_store(b).init(store=store)
    p = subprocess.Popen(myq_argv() + ["--spool", b, "import"],
                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=clean_env())
    data = text.encode()
    half = data.index(b"\n", len(data) // 2) + 1
    p.stdin.write(data[:half])
    p.stdin.flush()
    deadline = time.time() + 30
    while len(_ids_once(b)) < 300 and time.time() < deadline:
        time.sleep(0.005)
    p.kill()
    p.wait()
    p.stdin.close()
    first = len(_ids_once(b))
    assert 0 < first < n
    cp = import_(b, text)
    assert cp.returncode == 73, cp.stderr
    where = _ids_once(b)
    assert len(where) == n and all(len(v) == 1 for v in where.values())
    assert "duplicate %d" % first in cp.stderr
