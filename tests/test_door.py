"""The one door to the disk, and what lanes, owner records, batch splits
and holds could open: each attack made for real and refused.

Every step on a spool's file is made relative to
a directory descriptor that was opened without following a link and
checked (the owner's alone, but for tmp/ and incoming/).  These tests do
what a producer (or a server) would do and look at what myq did.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from _core import (FAST, MYQ, call_myq, enqueue, ls, run_myq, show, sql,
                   state, wait_for, write_incoming)
from _http import Server, answer


def _job(t, **kw):
    d = {"type": t, "payload": kw.pop("payload", None)}
    d.update(kw)
    return d


def _put_in_lane(myq, spool, lane, job):
    """Job `job` (with its id) waiting in lane `lane` (incoming/lanes/T@P),
    whatever its own home: a file written there, or its row moved there."""
    if not os.path.exists(os.path.join(spool, "queue.db")):
        with open(os.path.join(spool, lane, job["id"] + ".json"), "w") as f:
            json.dump(job, f)
        return
    myq.open_store(spool).enqueue(job["type"], job.get("payload"), id=job["id"],
                             priority=job.get("priority"))
    n = sql(spool, "UPDATE jobs SET lane=? WHERE id=? AND status='ready'",
            (lane, job["id"]))
    assert n == 1, n


def _in_lane(spool, lane, jid):
    """Does job `jid` wait in lane `lane` (its file, or its row)?"""
    rows = sql(spool, "SELECT 1 FROM jobs WHERE id=? AND status='ready' AND "
               "lane=?", (jid, lane))
    if rows is None:
        return os.path.exists(os.path.join(spool, lane, jid + ".json"))
    return bool(rows)


# A symlink among the lanes ###################################################

@pytest.mark.files_only("a lane is a directory, here a symlink")
def test_a_lane_that_is_a_symlink_is_never_followed(spool, tmp_path,
                                                    handlers_dir):
    """A producer (who could write incoming/, so incoming/lanes/) puts a
    symlink where a lane would be, to a directory outside the spool: the
    enqueue of that lane's type writes nothing there, the worker claims
    nothing from there, and check names the lane."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.json").write_text(json.dumps(_job("t")))
    os.makedirs(os.path.join(spool, "incoming", "lanes"), exist_ok=True)
    os.symlink(str(outside), os.path.join(spool, "incoming", "lanes", "t@5"))
    cp = call_myq("--spool", spool, "enqueue", "t", "1", "--priority", "5")
    assert cp.returncode == 78, (cp.returncode, cp.stderr)
    assert "not a directory" in cp.stderr and "t@5" in cp.stderr, cp.stderr
    assert sorted(os.listdir(str(outside))) == ["victim.json"]
    h = handlers_dir("t", "exit 0")
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", h, *FAST)
    assert cp.returncode == 0, cp.stderr
    assert sorted(os.listdir(str(outside))) == ["victim.json"]   # untouched
    assert ls(spool, "processing") == [] and ls(spool, "failed") == []
    chk = call_myq("--spool", spool, "check")
    assert chk.returncode == 1
    assert [l for l in chk.stdout.splitlines() if "lane" in l and "t@5" in l], \
        chk.stdout


@pytest.mark.files_only("incoming/lanes is a directory, here a symlink")
def test_a_lanes_directory_that_is_a_symlink_is_never_followed(spool, tmp_path):
    """incoming/lanes itself replaced by a link to a directory of lanes
    outside: no lane is used, nothing is written there (the
    owner's enqueue moves the link aside and makes its own, never 78)."""
    outside = tmp_path / "outside"
    (outside / "t@5").mkdir(parents=True)
    os.rmdir(os.path.join(spool, "incoming", "lanes"))      # (init made it)
    os.symlink(str(outside), os.path.join(spool, "incoming", "lanes"))
    cp = call_myq("--spool", spool, "enqueue", "t", "1", "--priority", "5")
    assert cp.returncode == 0, cp.stderr
    assert os.listdir(str(outside / "t@5")) == []
    assert not os.path.islink(os.path.join(spool, "incoming", "lanes"))
    assert call_myq("--spool", spool, "list").stdout.split()[0] == cp.stdout.strip()


@pytest.mark.files_only("the modes of the lanes' directories")
def test_lanes_are_the_owners_alone(spool):
    """A lane and incoming/lanes/ are made mode 0750, whatever incoming/'s
    mode (group-writable for producers): a producer cannot put anything
    among them."""
    os.chmod(os.path.join(spool, "incoming"), 0o2770)
    enqueue(call_myq, spool, "t", "1", "--priority", "5")
    for p in ("incoming/lanes", "incoming/lanes/t@5"):
        mode = os.stat(os.path.join(spool, p)).st_mode & 0o777
        assert mode & 0o022 == 0, (p, oct(mode))


def test_check_says_when_a_producer_can_move_what_is_not_its_own(spool):
    """incoming/ group-writable without the sticky bit: a producer could mv
    incoming/lanes away, hiding every job waiting there from list, show,
    check and the workers; check says so, and what to do."""
    inc = os.path.join(spool, "incoming")
    os.chmod(inc, 0o2770)
    cp = call_myq("--spool", spool, "check")
    assert cp.returncode == 1 and "sticky" in cp.stdout and "chmod +t" in \
        cp.stdout, (cp.stdout, cp.stderr)
    os.chmod(inc, 0o3770)
    cp = call_myq("--spool", spool, "check")
    assert cp.returncode == 0, (cp.stdout, cp.stderr)


@pytest.mark.files_only("the modes of the lanes' directories")
def test_an_old_group_writable_lane_is_made_the_owners_again(spool):
    """A lane made by an earlier version took incoming/'s group-writable
    mode: the owner's door takes the write bits of others away."""
    lane = os.path.join(spool, "incoming", "lanes", "t@5")
    os.makedirs(lane)
    os.chmod(os.path.join(spool, "incoming", "lanes"), 0o2770)
    os.chmod(lane, 0o2770)
    enqueue(call_myq, spool, "t", "1", "--priority", "5")
    assert os.stat(lane).st_mode & 0o022 == 0
    assert len(os.listdir(lane)) == 1


def test_a_job_in_another_types_lane_obeys_its_own_types_rules(myq, spool,
                                                               handlers_dir,
                                                               tmp_path):
    """A job of a paused type found in another type's lane does not run
    under that lane's rules: it goes to its own home and waits."""
    h = handlers_dir("a", "exit 0")
    handlers_dir("b", 'touch "%s"' % (tmp_path / "b-ran"))
    assert call_myq("--spool", spool, "policy", "a", "priority=5").returncode == 0
    assert call_myq("--spool", spool, "pause", "b").returncode == 0
    a = enqueue(call_myq, spool, "a", "1")          # makes the lane a@5
    lane = "incoming/lanes/a@5"
    assert _in_lane(spool, lane, a)
    _put_in_lane(myq, spool, lane, _job("b", priority=5, id="intruder"))
    assert _in_lane(spool, lane, "intruder")
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", h, *FAST)
    assert cp.returncode == 0, cp.stderr
    assert not (tmp_path / "b-ran").exists()
    assert show(call_myq, spool, a)["state"] == "done"
    job = show(call_myq, spool, "intruder")
    assert job["type"] == "b" and job["state"] == "ready", job
    assert not _in_lane(spool, lane, "intruder")


# The owner's records are never written through tmp/ ##########################

def test_no_owner_record_is_made_in_tmp(myq, spool):
    """The policy, a worker's record, a hold's record and the totals are
    written beside their names, in the owner's own directories: a producer
    watching tmp/ has nothing there to swap before the rename."""
    created = []
    myq._hook = lambda op, p, w: created.append(p) if op == "create" else None
    try:
        sp = myq.open_store(spool)
        sp.set_policy("t", {"max_queued": 5})
        ident = myq.Identity(sp)
        ident.register()
        sp.breaker.write({"dest": "d", "why": "x", "until": time.time() + 60})
        sp.count("dropped", "t")
        ident.unregister()
    finally:
        myq._hook = None
    assert created
    assert not [p for p in created if "/tmp/" in p[len(spool):]], created
    assert ls(spool, "tmp") == []
    pol = os.stat(os.path.join(spool, "policy.json"))
    assert pol.st_mode & 0o022 == 0


@pytest.mark.files_only("the files a retry writes")
def test_a_retry_is_not_written_in_tmp(myq, spool):
    """A retried job's next version is written beside its claim, in
    processing/ (the owner's), then renamed into incoming/."""
    sp = myq.open_store(spool)
    sp.enqueue("t", None, id="r1")
    created = []
    myq._hook = lambda op, p, w: created.append(p) if op == "create" else None

    def fail(job):
        raise ValueError("again")
    try:
        myq.Worker(sp, handlers={"t": fail}, log=lambda *a, **k: None,
                   backoff_base=60).run(once=True)
    finally:
        myq._hook = None
    assert [p for p in created if p.endswith(".new")], created
    assert not [p for p in created if "/tmp/" in p[len(spool):]], created
    assert show(call_myq, spool, "r1")["attempts"] == 1


# A failed batch's halves and --concurrency ###################################

SPLIT = r'''#!/bin/sh
# one line per start and end; fails every batch of more than one job
echo "start $$ $MYQ_BATCH" >> "%(log)s"
sleep 0.05
echo "end $$" >> "%(log)s"
[ "${MYQ_BATCH:-1}" -le 1 ] && exit 0
exit 65
'''


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_a_split_never_runs_more_than_concurrency(spool, tmp_path, concurrency):
    """batch=16 that fails for good is split down to single jobs: at no
    time do more handlers run than --concurrency (64 were seen at
    once for --concurrency 1)."""
    log = tmp_path / "runs.log"
    hd = tmp_path / "h"
    hd.mkdir()
    (hd / "b").write_text(SPLIT % {"log": log})
    (hd / "b").chmod(0o755)
    assert call_myq("--spool", spool, "policy", "b", "batch=16").returncode == 0
    for i in range(16):
        enqueue(call_myq, spool, "b", str(i), "--id", "b%02d" % i)
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", str(hd),
                 "--concurrency", concurrency, *FAST, timeout=120)
    assert cp.returncode == 0, cp.stderr
    running = peak = 0
    for line in log.read_text().splitlines():
        running += 1 if line.startswith("start") else -1
        peak = max(peak, running)
    assert peak <= int(concurrency), log.read_text()
    assert len(ls(spool, "done")) == 16 and ls(spool, "dlq") == []
    assert "event=split" in cp.stderr


# A job's own unsendable request is not its destination's failure ############

def test_an_unsendable_header_is_the_jobs_own_failure(spool, myq):
    """Jobs whose own header value carries a newline (or is not Latin-1)
    never reach the server and never hold it: a good job right after them
    goes at once, and they end dead, naming why, without a hold."""
    srv = Server(default=lambda h: answer(h, 200, b""), protocol="HTTP/1.0").start()
    try:
        url = srv.url("/x")
        # (and a name that is not ASCII: retried for ever as the server's
        # failure, holding it)
        for i, hdrs in enumerate([{"X-Bad": "a\nInjected: 1"},
                                  {"X-Bad": "caf\u00e9\u2603"}, {"X-Bad": "x\r\ny"},
                                  {"X-Na\u00efve": "1"}]):
            enqueue(call_myq, spool, "http", json.dumps(
                {"url": url, "headers": hdrs}), "--id", "bad%d" % i)
        enqueue(call_myq, spool, "http", json.dumps({"url": url + "?good"}),
                "--id", "good")
        cp = run_myq("--spool", spool, "worker", "--drain", *FAST, timeout=60)
        assert cp.returncode == 0, cp.stderr
        assert "event=hold" not in cp.stderr, cp.stderr
        assert show(call_myq, spool, "good")["state"] == "done"
        for i in range(4):
            j = show(call_myq, spool, "bad%d" % i)
            assert j["state"] == "dead" and "cannot be sent" in j["last_error"], j
        assert [r["target"] for r in srv.requests] == ["/x?good"]
        assert json.loads(call_myq("--spool", spool, "stats", "--json")
                          .stdout)["held"] == []
    finally:
        srv.stop()


# What an operator reads ######################################################

def test_a_spool_named_with_a_space_keeps_the_status_line_one_field_each(
        myq, tmp_path):
    """The queue is the spool's directory name: "my q=1" printed as is
    made 'queue=my q=1 ready=0', a field more."""
    sp = str(tmp_path / "my q=1")
    assert call_myq("--spool", sp, "init").returncode == 0
    line = call_myq("--spool", sp, "stats").stdout.strip()
    assert line.split()[1] == "queue=my\\x20q\\x3d1", line
    assert all(f.count("=") == 1 for f in line.split()[1:]), line


def test_control_characters_never_reach_the_status_line_or_check(myq, spool):
    """A destination name with a tab, a newline and an '=' and a hold
    reason with an escape sequence (a server's 503 body): the status line
    stays one line of key=value fields, check prints no escape, the
    Prometheus labels none either."""
    sp = myq.open_store(spool)
    dest = "http://evil\tqueue=forged\nx=1:80"
    sp.breaker.write({"dest": dest, "why": "503: \x1b[2J\x1b[31mgone",
                   "until": time.time() + 600, "probes": 0})
    line = call_myq("--spool", spool, "stats").stdout
    assert line.count("\n") == 1 and "\t" not in line, repr(line)
    fields = line.split()[1:]
    assert all("=" in f for f in fields), fields
    assert [f for f in fields if f.startswith("queue=")] == ["queue=spool"]
    chk = call_myq("--spool", spool, "check")
    assert "\x1b" not in chk.stdout and "\\x1b" in chk.stdout, repr(chk.stdout)
    prom = call_myq("--spool", spool, "stats", "--prometheus").stdout
    assert "\x1b" not in prom and "\t" not in prom
    assert all(l.startswith(("#", "myq_")) for l in prom.splitlines()), prom


# Bounded by construction #####################################################

def test_a_hold_records_each_waiting_job_once(myq, spool):
    """A destination that stays down: each time a job is put back, the
    hold's list of waiting jobs must not grow by a line."""
    sp = myq.open_store(spool)
    for _ in range(20):
        for i in range(5):
            sp.breaker.note_job("http://down:80", "incoming/j%d.json" % i)
    path = sp.breaker._path("http://down:80", ".jobs")
    with open(path) as f:
        assert len(f.read().split()) == 5
    # several workers (fresh processes) wrote the same names again: the
    # list is compacted when read
    with open(path, "a") as f:
        f.write("incoming/j0.json\n" * 600)
    assert len(sp.breaker.jobs("http://down:80")) == 5
    with open(path) as f:
        assert len(f.read().split()) == 5


def test_a_streak_record_is_bounded(myq, spool):
    sp = myq.open_store(spool)
    for i in range(2000):
        sp.breaker.streak("d", "j%d" % (i % 7))
    with open(sp.breaker._path("d", ".streak")) as f:
        assert len(f.read().split()) <= 512
    started, distinct, total = sp.breaker.streak("d", "new")
    assert not started and distinct == 8


def test_many_held_types_cost_an_idle_poll_no_reading(myq, spool):
    """1,100 types without a handler: at most 1,024 hold records are
    written, each once; an idle worker's poll then reads none of them
    again (14-21 % of a core was seen for 8,000)."""
    sp = myq.open_store(spool)
    sp.enqueue_many([{"type": "u%04d" % i} for i in range(1100)])
    w = myq.Worker(sp, handlers={}, log=lambda *a, **k: None, poll=0.01,
                   stats_interval=0)
    assert w.run(drain=True) == 0
    names = os.listdir(os.path.join(spool, "locks", "held"))
    assert len([n for n in names if n.endswith(".json")]) == 1024, len(names)
    # (the first _Holds.LANED held types wait in their lanes, no list of
    # jobs; the others' jobs are listed for the release)
    assert len([n for n in names if n.endswith(".jobs")]) == 1024 - myq._Holds.LANED
    reads = []
    real = sp.read_file
    sp.read_file = lambda *a, **k: (reads.append(a[0]), real(*a, **k))[1]
    w2 = myq.Worker(sp, handlers={}, log=lambda *a, **k: None, poll=0.01,
                    stats_interval=0)
    w2.holds.missing = dict((h["dest"], ("x", 1.0, h["until"], True)) for h in sp.breaker.records())
    w2.holds._handlers_next = float("inf")
    w2.holds._load_holds()
    reads[:] = []
    for _ in range(50):
        w2.holds._check_holds()
    assert reads == []


def test_a_huge_number_in_the_policy_is_ignored_not_a_crash(spool, handlers_dir):
    """A hand edit with a 400-digit size: every command goes on (the last
    good policy, here none) and check says what is wrong."""
    with open(os.path.join(spool, "policy.json"), "w") as f:
        f.write('{"t": {"max_bytes": %s, "rate": "%s/s"}}' % ("9" * 400, "9" * 400))
    h = handlers_dir("t", "exit 0")
    jid = enqueue(call_myq, spool, "t", "1")
    assert call_myq("--spool", spool, "stats").returncode == 0
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", h, *FAST)
    assert cp.returncode == 0, cp.stderr
    assert show(call_myq, spool, jid)["state"] == "done"
    chk = call_myq("--spool", spool, "check")
    assert chk.returncode == 1 and "does not parse" in chk.stdout, chk.stdout
    cp = call_myq("--spool", spool, "policy", "t", "max_bytes=" + "9" * 400)
    assert cp.returncode == 64 and len(cp.stderr) < 400, cp.stderr


# Processes ###################################################################

def test_a_zombie_worker_holds_no_claim(myq, spool):
    """A worker killed but not yet waited for by its parent is a zombie:
    it runs nothing, so reap takes its claim back at once."""
    sp = myq.open_store(spool)
    sp.enqueue("t", None, id="z1")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: (open("/proc/%d/stat" % child.pid).read()
                      .rsplit(")", 1)[1].split()[0] == "Z"), what="a zombie")
    try:
        ident = myq.Identity(sp)
        ident.pid, ident.start = child.pid, myq.proc_start(child.pid)
        ident.wid = "w-%d-zzz" % child.pid
        ident.path = sp.d("locks", "workers", ident.wid + ".json")
        ident.register()
        c = sp.claims.claim("z1.json", ident)
        assert c is not None and c.jid == "z1"
        sp.claims.close(c)
        assert sp.reap() == 1
        assert state(call_myq, spool, "z1") == "ready"
    finally:
        child.wait()


def test_a_textfile_another_user_owns_is_never_written(myq, spool, tmp_path):
    """In a shared textfile directory, another user's myq_QUEUE.prom (a
    squat) is neither written through nor replaced: an error says whose
    it is."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the squatter is another user (chown)")
    d = tmp_path / "textfile"
    d.mkdir()
    os.chmod(str(d), 0o1777)
    squat = d / "myq_spool.prom"
    squat.write_text("myq_jobs{queue=\"spool\",state=\"ready\"} 0\n")
    os.chown(str(squat), 65534, 65534)
    errors = []
    w = myq.Worker(spool, handlers={}, log=lambda ev, **kv: errors.append(kv))
    w.textfile = str(d)
    myq._write_textfile(w)
    assert squat.read_text() == "myq_jobs{queue=\"spool\",state=\"ready\"} 0\n"
    assert [e for e in errors if "uid 65534" in str(e.get("error"))], errors
    assert sorted(os.listdir(str(d))) == ["myq_spool.prom"]
