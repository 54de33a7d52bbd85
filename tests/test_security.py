"""Attack tests: what the spool's owner, a producer or a remote
server can make root, the worker or a handler do.

Threat model.  The spool belongs to a user (MYQ_USER, here the throwaway
`myqsec1`); that user controls every entry of it and may replace any of
them by a symlink or a FIFO at any moment.  Producers write job files.
Root runs myq on that spool (the operator, cron, the init script) and must
never be steered into a root-only file or process, never hang, never print
a root-only file.  Victims: a 0700 root directory with secrets, a 0600 root
file, a root `sleep 1000`.

Each test makes an attack for real; those marked "guard" pin what the
defences must keep.
"""
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

import myq
from _core import MYQ, clean_env, ls, wait_for
from _http import answer, client_gone, http_servers  # noqa: F401 (a fixture)
from _sec import (DAEMON, Victim, become, box, needs_root,  # noqa: F401
                  owner, traceback_in)                      # (fixtures)

# needs_root, the owner and the box: _sec.py


# 2. The chown race of root's enqueue ########################################

SWAPPER = r'''
import os, sys, time
tmp, victim, stop, until = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
n = 0
while time.time() < until and not os.path.exists(stop):
    try:
        names = os.listdir(tmp)
    except OSError:
        continue
    for name in names:
        p = os.path.join(tmp, name)
        if os.path.islink(p):
            continue
        try:
            os.unlink(p)
            os.symlink(victim, p)
            n += 1
        except OSError:
            pass
print(n)
'''


def start_swapper(box, seconds=8.0):
    """The owner replaces every new file of tmp/ by a symlink to the
    victim, as fast as it can (bounded in time)."""
    stop = os.path.join(box.base, "stop-swapper")
    p = subprocess.Popen(
        [box.python, "-c", SWAPPER, box.d("tmp"), box.victim, stop,
         str(time.time() + seconds)],
        stdout=subprocess.PIPE, universal_newlines=True, cwd="/",
        preexec_fn=become(box.pw), start_new_session=True)
    return p, stop


def lost_jobs(box, ids):
    """ids whose incoming/ID.json is not a regular job file of the owner."""
    lost = []
    for jid in ids:
        p = box.d("incoming", jid + ".json")
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            lost.append("%s: missing" % jid)
            continue
        if not stat.S_ISREG(st.st_mode):
            lost.append("%s: not a regular file (%s)" % (
                jid, "symlink" if stat.S_ISLNK(st.st_mode) else "other"))
        elif st.st_uid != box.pw.pw_uid:
            lost.append("%s: owned by uid %d, not the spool's owner"
                        % (jid, st.st_uid))
        else:
            with open(p) as f:
                if json.loads(f.readline()).get("id") != jid:
                    lost.append("%s: not its job" % jid)
    return lost


@needs_root
def test_root_enqueue_chown_race(box):
    """Root's `myq enqueue` into the owner's spool while the owner swaps
    every tmp/ file for a symlink to a root file: the victim stays root's
    and every enqueue that said 0 left its job in incoming/, a regular
    file of the owner.  Fails today: enqueue chowns by path after the
    fsync (the victim is handed to the owner) and renames the symlink into
    incoming/ (the job is lost, exit 0)."""
    swapper, stop = start_swapper(box)
    ok, failed = [], []
    try:
        for i in range(50):
            jid = "race%d" % i
            r = box.root("enqueue", "t", "null", "--id", jid)
            (ok if r.returncode == 0 else failed).append(jid)
            assert not traceback_in(r.stderr), r.stderr
    finally:
        open(stop, "w").close()
        swaps = swapper.communicate(timeout=15)[0].strip()
    problems = box.changed() + lost_jobs(box, ok)
    assert not problems, "%d enqueues said 0, %s swaps:\n%s" % (
        len(ok), swaps, "\n".join(problems))


@needs_root
def test_api_enqueue_chown_race(box):
    """The same race through the Python API of a root program
    (`myq.open_store(p).enqueue`): no victim handed over, no job lost.  Fails
    today (os.chown by path)."""
    sp = myq.open_store(box.spool)
    swapper, stop = start_swapper(box)
    ok = []
    try:
        for i in range(200):
            try:
                ok.append(sp.enqueue("t", None, id="api%d" % i))
            except myq.MyqError:
                pass
    finally:
        open(stop, "w").close()
        swaps = swapper.communicate(timeout=15)[0].strip()
    problems = box.changed() + lost_jobs(box, ok)
    assert not problems, "%d enqueues returned, %s swaps:\n%s" % (
        len(ok), swaps, "\n".join(problems))


@needs_root
@pytest.mark.parametrize("sub", ["tmp", "incoming"])
def test_api_enqueue_refuses_a_symlinked_dir(box, sub, monkeypatch):
    """A root program's `myq.enqueue(spool, ...)` on the owner's spool
    whose tmp/ or incoming/ is a symlink to a root directory: a MyqError,
    nothing written outside the spool.  Fails today: the job is written
    into the victim directory.  (With O_TMPFILE an enqueue never goes
    through tmp/: it is refused only where it writes there, the way
    where the system refuses O_TMPFILE.)"""
    box.replace(sub, "symlink", box.victim_dir)
    myq._SPOOLS.clear()
    if sub == "tmp":
        monkeypatch.setattr(myq, "_TMPFILE", 0)
    with pytest.raises(myq.MyqError):
        myq.enqueue(box.spool, "t", {"x": 1}, id="viaapi")
    with pytest.raises(myq.MyqError):
        myq.open_store(box.spool).enqueue("t", None)
    assert box.changed() == []
    if sub == "tmp":
        monkeypatch.undo()
        assert myq._TMPFILE, "O_TMPFILE refused here"
        myq.open_store(box.spool).enqueue("t", None)     # (not through tmp/)
        assert box.changed() == []


# 3. Forged handler records #################################################

@pytest.fixture
def victim():
    v = Victim()
    yield v
    v.kill()


def owner_dir(box, name):
    p = os.path.join(box.base, name)
    os.mkdir(p, 0o755)
    os.chown(p, box.pw.pw_uid, box.pw.pw_gid)
    return p


def start_owner_worker(box, *opts, log=None):
    err = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            [box.python, box.myq, "--spool", box.spool, "worker"]
            + [str(o) for o in opts], stdout=subprocess.DEVNULL, stderr=err,
            env=clean_env(), cwd="/", preexec_fn=become(box.pw),
            start_new_session=True)
    finally:
        if log:
            err.close()


def killpg_quiet(p):
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
    p.wait(10)


@needs_root
def test_producer_forged_handler_line_reap(box, victim):
    """A producer appends `{"handler": {"pid": VICTIM, "start": S}}` to its
    job file; the owner's worker runs the job (a --module function: no
    handler record of its own), dies (kill -9); root's `myq reap`.  The
    victim (root's `sleep`) lives; the file was quarantined.  Fails today:
    reap takes the forged line for the worker's record and SIGKILLs the
    victim's process group."""
    out = owner_dir(box, "out")
    mark = os.path.join(out, "started")
    mod = os.path.join(box.base, "mod.py")
    with open(mod, "w") as f:
        f.write("import time\n"
                "def slow(job):\n"
                "    open(%r, 'w').close()\n"
                "    time.sleep(30)\n" % mark)
    os.chmod(mod, 0o644)
    box.owner_file("incoming/forged.json", json.dumps(
        {"id": "forged", "type": "slow"}) + "\n" + json.dumps(
        {"handler": {"pid": victim.pid, "start": victim.start}}) + "\n")
    w = start_owner_worker(box, "--module", mod, "--poll", "0.05")
    try:
        wait_for(lambda: os.path.exists(mark) or w.poll() is not None
                 or quarantined(box, "forged"), timeout=20,
                 what="the job to run or be quarantined")
    finally:
        killpg_quiet(w)
    r = box.root("reap")
    assert not traceback_in(r.stderr), r.stderr
    time.sleep(0.2)         # a SIGKILL is delivered at once; be generous
    assert victim.alive(), "root's reap killed the process a producer named"
    assert not os.path.exists(mark), "a job with forged records was run"
    assert quarantined(box, "forged"), "the forged job was not quarantined"


def quarantined(box, stem):
    return [n for n in ls(box.spool, "failed")
            if n.startswith(stem) and not n.endswith(".reason")]


def forge_claim(box, victim, jid="fj", pid=None):
    """The owner forges a claim naming the victim as its handler, and a
    worker record naming the victim as a hung worker (old heartbeat)."""
    wid = "w-77-abc"
    now = time.time()
    pid = victim.pid if pid is None else pid
    box.owner_file("processing/%s+%s.1.json" % (jid, wid), json.dumps(
        {"id": jid, "type": "t", "attempts": 0, "created_at": now,
         "updated_at": now, "available_at": now}) + "\n" + json.dumps(
        {"lease": {"worker": wid, "pid": victim.pid, "start": victim.start,
                   "boot_id": myq.boot_id(), "token": wid + ".1", "attempt": 1,
                   "leased_until": now - 100}}) + "\n" + json.dumps(
        {"handler": {"pid": pid, "start": victim.start}}) + "\n")
    rec = box.owner_file("locks/workers/%s.json" % wid, json.dumps(
        {"worker": wid, "pid": victim.pid, "start": victim.start,
         "boot_id": myq.boot_id(), "pidns": myq.pid_namespace(),
         "host": os.uname()[1], "lease": 1, "started_at": now - 100}))
    os.utime(rec, (1, 1))


@needs_root
def test_owner_forged_claim_root_reap(box, victim):
    """The owner forges processing/fj+w-77-abc.1.json with a handler line
    and a hung worker record, both naming root's process; root's `myq
    reap` must not signal it.  Fails today (SIGKILL to its group)."""
    forge_claim(box, victim)
    r = box.root("reap")
    assert not traceback_in(r.stderr), r.stderr
    time.sleep(0.2)
    assert victim.alive(), "root's reap killed the process the owner named"


@needs_root
def test_owner_forged_claim_root_delete_force(box, victim):
    """The same forged claim; root's `myq delete --force fj` must not
    signal the victim.  Fails today (SIGTERM to its group)."""
    forge_claim(box, victim)
    r = box.root("delete", "--force", "fj")
    assert not traceback_in(r.stderr), r.stderr
    time.sleep(0.2)
    assert victim.alive(), "root's delete --force killed the process the owner named"


@needs_root
def test_delete_force_non_numeric_pid(box, victim):
    """A forged handler record with `"pid": "1x"`: `delete --force` ends
    without a traceback.  Fails today (TypeError in proc_start)."""
    forge_claim(box, victim, pid="1x")
    r = box.root("delete", "--force", "fj")
    assert not traceback_in(r.stderr), r.stderr
    assert r.returncode in (0, 66), (r.returncode, r.stderr)
    assert victim.alive()


# 4. --module: only the file's own functions ################################

def test_module_imported_callables_are_not_handlers(run_myq, spool, tmp_path):
    """A --module file that imports `run` (subprocess), `system` (os) and
    defines `_private`: jobs of type run, system, getattr, _private never
    call them.  Fails today: a producer's job of type `run` whose first key
    is a program path makes the worker execute that program
    (subprocess.run(job) runs list(job)), and the job is done."""
    mark = tmp_path / "ran"
    evil = tmp_path / "evil.sh"
    evil.write_text("#!/bin/sh\ntouch '%s.run'\n" % mark)
    evil.chmod(0o755)
    mod = tmp_path / "handlers_mod.py"
    mod.write_text(
        "from subprocess import run\n"
        "import os\n"
        "from os import system\n"
        "def ok(job):\n"
        "    pass\n"
        "def _private(job):\n"
        "    open(%r, 'w').close()\n" % (str(mark) + ".private"))
    # a shell producer's files: it chooses the order of the keys
    for jid, typ in (("r1", "run"), ("s1", "system"), ("g1", "getattr"),
                     ("p1", "_private")):
        obj = json.loads('{"%s": 1, "id": "%s", "type": "%s", '
                         '"payload": "touch %s.sys", "max_attempts": 1}'
                         % (evil, jid, typ, mark))
        with open(os.path.join(spool, "incoming", jid + ".json"), "w") as f:
            f.write(json.dumps(obj))
    r = run_myq("--spool", spool, "worker", "--drain", "--module", str(mod),
                "--poll", "0.05", "--max-attempts", "1", timeout=60)
    assert not traceback_in(r.stderr), r.stderr
    called = [p for p in os.listdir(str(tmp_path)) if p.startswith("ran")]
    assert called == [], "imported/private callables were called: %s" % called
    assert ls(spool, "done") == []


def test_module_with_handlers_dict_is_exactly_that(run_myq, spool, tmp_path):
    """A --module file with a HANDLERS dict: its entries are the types, a
    function it also defines is not.  Fails today (getattr fallback)."""
    mark = tmp_path / "b-ran"
    mod = tmp_path / "handlers_mod.py"
    mod.write_text(
        "def _impl(job):\n"
        "    pass\n"
        "def b(job):\n"
        "    open(%r, 'w').close()\n"
        "HANDLERS = {'a': _impl}\n" % str(mark))
    for jid, typ in (("ja", "a"), ("jb", "b")):
        r = run_myq("--spool", spool, "enqueue", typ, "null", "--id", jid,
                    "--max-attempts", "1")
        assert r.returncode == 0, r.stderr
    r = run_myq("--spool", spool, "worker", "--drain", "--module", str(mod),
                "--poll", "0.05", timeout=60)
    assert not traceback_in(r.stderr), r.stderr
    assert "ja.json" in ls(spool, "done")
    assert not mark.exists(), "b is not in HANDLERS but was called"
    assert "jb.json" not in ls(spool, "done")


# 5. Odd ids and names ######################################################

ODD = ["", ".", "..", "a/b", "../x", "x" * 200, "../../etc/passwd",
       "failed/", "incoming/x", ".hidden"]
# valid ids ("-" is one) that name a directory: show/retry/delete
# exit 66 (no such job)
ODD_OK_NAMES = ["-", "failed", "incoming", "locks", "tmp"]


def layout_intact(spool):
    for sub in myq.SUBDIRS + ("locks/ok", "locks/workers"):
        p = os.path.join(spool, sub)
        assert os.path.isdir(p) and not os.path.islink(p), sub + " is gone"


def seed(run_myq, spool):
    """A dead job, a failed file, a done job: things an odd id could hit."""
    with open(os.path.join(spool, "failed", "bad.json"), "w") as f:
        f.write("not json")
    with open(os.path.join(spool, "failed", "bad.json.reason"), "w") as f:
        f.write("x bad JSON\n")
    with open(os.path.join(spool, "dlq", "dead1.json"), "w") as f:
        f.write(json.dumps({"id": "dead1", "type": "t", "attempts": 5}) + "\n")


@pytest.mark.parametrize("cmd", ["show", "retry", "delete", "delete --force",
                                 "enqueue --id"])
def test_cli_odd_ids(run_myq, spool, cmd):
    """show/retry/delete and enqueue --id with ids that are no ids: exit
    64, 65 or 66, one line `myq: …`, no traceback, the layout intact.
    Fails today: `retry ""` renames failed/ into incoming/, `delete ""`
    exits 75 (IsADirectoryError), `show ""` prints the directory as a job
    (exit 0)."""
    seed(run_myq, spool)
    problems = []
    for jid in ODD + ODD_OK_NAMES:
        if cmd == "enqueue --id":
            if jid in ODD_OK_NAMES:
                continue
            args = ["enqueue", "t", "null", "--id", jid]
        else:
            args = cmd.split() + [jid]
        r = run_myq("--spool", spool, *args, timeout=20)
        err = r.stderr.strip("\n")
        if r.returncode not in (64, 65, 66) or not err.startswith("myq: ") \
                or "\n" in err:
            problems.append("%s %r: exit %d, stdout %r, stderr %r" % (
                cmd, jid, r.returncode, r.stdout[:100], r.stderr[-300:]))
        try:
            layout_intact(spool)
        except AssertionError as e:
            problems.append("%s %r broke the layout: %s" % (cmd, jid, e))
            break
    assert ls(spool, "failed") == ["bad.json", "bad.json.reason"], problems
    assert ls(spool, "dlq") == ["dead1.json"], problems
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("op", ["show", "retry", "retry-list", "delete",
                                "delete-list", "enqueue"])
def test_api_odd_ids(myq, spool, op):
    """The API with odd ids (NUL included): a myq.MyqError subclass, never
    a raw ValueError/IsADirectoryError; the layout intact.  Fails today
    (ValueError: embedded null byte; retry("") moves failed/)."""
    seed(None, spool)
    sp = myq.open_store(spool)
    problems = []
    for jid in ODD + ["x\x00y", "\x00"]:
        call = {"show": lambda: sp.show(jid),
                "retry": lambda: sp.retry(jid),
                "retry-list": lambda: sp.retry([jid]),
                "delete": lambda: sp.delete(jid),
                "delete-list": lambda: sp.delete([jid], force=True),
                "enqueue": lambda: sp.enqueue("t", None, id=jid)}[op]
        try:
            got = call()
            problems.append("%s(%r) returned %r" % (op, jid, got))
        except myq.MyqError:
            pass
        except Exception as e:
            problems.append("%s(%r) raised %s: %s" % (op, jid,
                                                      type(e).__name__, e))
        try:
            layout_intact(spool)
        except AssertionError as e:
            problems.append("%s(%r) broke the layout: %s" % (op, jid, e))
            break
    assert ls(spool, "dlq") == ["dead1.json"], problems
    assert not problems, "\n".join(problems)


def test_api_delete_str_is_one_id(myq, spool):
    """`Spool(p).delete("abc")` deletes job abc, not a, b and c.  Fails
    today (a str is iterated)."""
    sp = myq.open_store(spool)
    for jid in ("a", "b", "c"):
        sp.enqueue("t", None, id=jid)
    try:
        sp.delete("abc")
    except myq.NoSuchJob:
        pass
    assert ls(spool, "incoming") == ["a.json", "b.json", "c.json"]
    sp.enqueue("t", None, id="abc")
    assert sp.delete("abc") == 1
    assert ls(spool, "incoming") == ["a.json", "b.json", "c.json"]
    try:
        sp.retry("abc")
    except myq.NoSuchJob:
        pass


def test_quarantined_names_still_reachable(run_myq, spool):
    """Guard (passes today): a file quarantined for its bad name is shown,
    retried and deleted by the name `list failed` gives it."""
    with open(os.path.join(spool, "incoming", "bad name.json"), "w") as f:
        f.write(json.dumps({"type": "t"}))
    r = run_myq("--spool", spool, "worker", "--drain", "--poll", "0.05")
    assert r.returncode == 0, r.stderr
    r = run_myq("--spool", spool, "list", "failed", "--json")
    (name,) = [json.loads(l)["id"] for l in r.stdout.splitlines()]
    assert name == "bad name"
    r = run_myq("--spool", spool, "show", name)
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "failed", r.stderr
    r = run_myq("--spool", spool, "retry", name)
    assert r.returncode == 0, r.stderr
    assert "bad name.json" in ls(spool, "incoming")
    os.rename(os.path.join(spool, "incoming", "bad name.json"),
              os.path.join(spool, "failed", "bad name.json"))
    r = run_myq("--spool", spool, "delete", name)
    assert r.returncode == 0, r.stderr
    assert ls(spool, "failed") == []


# 6. A flood of bad files must not stop the heartbeat #######################

@pytest.mark.slow
def test_flood_of_bad_files_keeps_the_heartbeat(run_myq, spool, tmp_path,
                                                handlers_dir, procs):
    """A worker (--lease 2) runs a long job; a producer drops 100,000 files
    with bad names into incoming/; `myq reap` runs in a loop meanwhile.
    The long job runs once and ends done; the worker never logs
    event=lost.  Fails today: the worker quarantines the whole flood in
    one go without a heartbeat, a reaper takes its live job back (kills
    the handler), the job runs twice."""
    runs = tmp_path / "runs"
    hd = handlers_dir("long", 'echo "$MYQ_JOB_ID" >> "%s"\nsleep 8\nexit 0' % runs)
    log = tmp_path / "worker.log"
    r = run_myq("--spool", spool, "enqueue", "long", "null", "--id", "long")
    assert r.returncode == 0, r.stderr
    w = procs.worker(spool, "--handlers", hd, "--lease", "2", "--concurrency",
                     "2", "--poll", "0.05", "--jitter", "0", "--backoff-base",
                     "60", "--stats-interval", "0", log=log)
    wait_for(lambda: runs.exists() and runs.read_text().strip() == "long",
             what="the long job to start")
    stop = threading.Event()
    reaped = []

    def reaper():       # (a reap every ~0.1 s: a lapse of the 2 s lease is seen)
        while not stop.wait(0.1):
            cp = run_myq("--spool", spool, "reap", timeout=60)
            reaped.append(cp.stdout.strip())
    t = threading.Thread(target=reaper)
    t.daemon = True
    t.start()
    try:
        inc = os.path.join(spool, "incoming")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        for i in range(100000):
            os.close(os.open(os.path.join(inc, "bad name %d.json" % i), flags,
                             0o644))
        wait_for(lambda: "long.json" in ls(spool, "done")
                 or len(runs.read_text().split()) > 1, timeout=120,
                 interval=0.2, what="the long job to end")
    finally:
        stop.set()
        t.join(60)
    n = len(runs.read_text().split())
    lost = [l for l in log.read_text().splitlines() if "event=lost" in l]
    assert lost == [], "the worker's live job was taken back"
    assert n == 1, "the long job ran %d times (reaps: %s)" % (
        n, [x for x in reaped if x != "requeued=0"])
    assert w.poll() is None


# 7. http: never in flight twice; redirects ##################################

@pytest.fixture
def servers(http_servers):
    """make(behave) -> a running test server (_http) where behave(handler)
    answers every request; it records them (srv.requests)."""
    return lambda behave: http_servers(default=behave)


def test_http_job_never_in_flight_twice(run_myq, spool, servers, procs,
                                        tmp_path):
    """4 http jobs (timeout 1 s) to a server that trickles its answer over
    3 s, worker --concurrency 4, quick retries: no two requests with the
    same Idempotency-Key are ever open at once (the server sees when the
    client closes).  Fails today: the timed-out thread is abandoned, still
    reading, while the job is retried."""
    def trickle(h):
        try:
            h.send_response(200)
            h.send_header("Content-Length", "60")
            h.end_headers()
            h.wfile.flush()
            for _ in range(60):
                if client_gone(h.connection):
                    break
                time.sleep(0.05)
                h.wfile.write(b"x")
                h.wfile.flush()
        except OSError:
            pass
        finally:
            h.close_connection = True
    srv = servers(trickle)
    for i in range(4):
        r = run_myq("--spool", spool, "enqueue", "http", json.dumps(
            {"url": srv.url("/slow"), "method": "GET"}), "--id", "h%d" % i,
            "--timeout", "1", "--max-attempts", "3")
        assert r.returncode == 0, r.stderr
    log = tmp_path / "worker.log"
    w = procs.worker(spool, "--concurrency", "4", "--backoff-base", "0.2",
                     "--jitter", "0", "--poll", "0.05", log=log)

    def each_sent_again():
        keys = [r["headers"].get("Idempotency-Key") for r in list(srv.requests)]
        return len([k for k in set(keys) if keys.count(k) >= 2]) == 4
    # every job sent again (its first retry: when the abandoned thread
    # would still be reading; the breaker then holds the rest, which took
    # the wait for all 4 dead to its 12 s), or all dead
    try:
        wait_for(lambda: len(ls(spool, "dlq")) == 4 or each_sent_again(),
                 timeout=12, what="each job sent again or dead")
    except AssertionError:
        pass            # judged by what the server saw
    w.send_signal(signal.SIGTERM)
    w.wait(15)
    assert srv.wait(lambda: all(r["end"] is not None for r in srv.requests),
                    timeout=10), "timed out waiting for every request to end"
    seen = [(r["headers"].get("Idempotency-Key"), r["mono"], r["end"])
            for r in srv.requests]      # (key, start, end)
    text = log.read_text()
    assert not traceback_in(text), text
    overlaps = []
    for key in sorted(set(rec[0] for rec in seen)):
        recs = sorted((rec[1], rec[2]) for rec in seen if rec[0] == key)
        for (s1, e1), (s2, e2) in zip(recs, recs[1:]):
            if s2 < e1:
                overlaps.append("%s: a request at +%.2fs while one from "
                                "+%.2fs ran until +%.2fs" % (
                                    key, s2 - recs[0][0], 0.0 if s1 == recs[0][0]
                                    else s1 - recs[0][0], e1 - recs[0][0]))
    assert seen, "no request reached the server"
    t0 = min(rec[1] for rec in seen)
    assert overlaps == [], "\n".join("%s %.2f-%.2f" % (k, s - t0, e - t0)
                                      for k, s, e in sorted(seen))


def test_http_redirect_drops_configured_headers(run_myq, spool, servers):
    """A GET to server A that redirects to server B (another port: another
    origin), worker --http-header 'Authorization: Bearer secret': B never
    sees the Authorization header.  Fails today (urllib copies it)."""
    srv_b = servers(lambda h: answer(h, 200, b""))
    srv_a = servers(lambda h: answer(h, 302, b"",
                                     [("Location", srv_b.url("/landing"))]))
    r = run_myq("--spool", spool, "enqueue", "http", json.dumps(
        {"url": srv_a.url("/start"), "method": "GET"}), "--id", "redir",
        "--max-attempts", "1")
    assert r.returncode == 0, r.stderr
    r = run_myq("--spool", spool, "worker", "--drain", "--poll", "0.05",
                "--http-header", "Authorization: Bearer secret", timeout=60)
    assert r.returncode == 0, r.stderr
    leaked = [req["headers"] for req in srv_b.requests
              if any(k.lower() == "authorization" for k in req["headers"])]
    assert leaked == [], "the Authorization header followed the redirect"


def test_http_redirect_to_ftp_not_followed(run_myq, spool, servers):
    """A redirect to ftp://127.0.0.1:PORT/x: no connection to PORT, and
    the job is not done.  Fails today (urllib follows ftp:// redirects)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(5)
    lsock.setblocking(False)
    ftp = "ftp://127.0.0.1:%d/x" % lsock.getsockname()[1]

    srv_a = servers(lambda h: answer(h, 302, b"", [("Location", ftp)]))
    try:
        r = run_myq("--spool", spool, "enqueue", "http", json.dumps(
            {"url": srv_a.url("/start"), "method": "GET"}), "--id", "toftp",
            "--max-attempts", "1", "--timeout", "3")
        assert r.returncode == 0, r.stderr
        r = run_myq("--spool", spool, "worker", "--drain", "--poll", "0.05",
                    timeout=60)
        assert r.returncode == 0, r.stderr
        try:
            conn, _ = lsock.accept()
            conn.close()
            connected = True
        except (BlockingIOError, InterruptedError):
            connected = False
    finally:
        lsock.close()
    assert not connected, "the worker followed the redirect to " + ftp
    assert "toftp.json" not in ls(spool, "done")


# 8. A handler's daemonised children ########################################



def daemon_handler(tmp_path, handlers_dir, then):
    """An exec handler that leaves a daemon behind (fork, the parent exits,
    the child calls setsid: another session, its parent is init), writes
    its pid to T/ID.pid (killed by the procs fixture whatever happens),
    then runs `then`."""
    script = tmp_path / "daemon.py"
    script.write_text(DAEMON)
    return handlers_dir("d", '"%s" "%s" "%s/$MYQ_JOB_ID.pid" </dev/null '
                        '>/dev/null 2>&1\n%s' % (sys.executable, script,
                                                  tmp_path, then))


def test_timeout_kills_setsid_children(run_myq, spool, tmp_path, handlers_dir,
                                       procs):
    """A handler past its time limit: its daemonised child is gone too.
    Fails today (only the handler's process group is killed)."""
    from _procs import read_pid, alive
    hd = daemon_handler(tmp_path, handlers_dir, "sleep 1000")
    r = run_myq("--spool", spool, "enqueue", "d", "null", "--id", "slow",
                "--timeout", "1", "--max-attempts", "1")
    assert r.returncode == 0, r.stderr
    w = procs.worker(spool, "--handlers", hd, "--poll", "0.05",
                     log=tmp_path / "w.log")
    pid = read_pid(tmp_path / "slow.pid")
    wait_for(lambda: "slow.json" in ls(spool, "dlq"), timeout=20,
             what="the job to time out")
    try:
        wait_for(lambda: not alive(pid), timeout=5)
    except AssertionError:
        raise AssertionError("the handler's setsid child %d survived the "
                             "timeout kill" % pid)
    assert w.poll() is None


def test_shutdown_kills_setsid_children(run_myq, spool, tmp_path, handlers_dir,
                                        procs):
    """SIGTERM to the worker (--grace 0.5) while the handler runs: after the
    worker exits, the handler's daemonised child is gone.  Fails today."""
    from _procs import read_pid, alive
    hd = daemon_handler(tmp_path, handlers_dir, "sleep 1000")
    r = run_myq("--spool", spool, "enqueue", "d", "null", "--id", "held")
    assert r.returncode == 0, r.stderr
    w = procs.worker(spool, "--handlers", hd, "--poll", "0.05", "--grace", "0.5",
                     log=tmp_path / "w.log")
    pid = read_pid(tmp_path / "held.pid")
    w.send_signal(signal.SIGTERM)
    assert w.wait(15) == 0
    assert "held.json" in ls(spool, "incoming")
    try:
        wait_for(lambda: not alive(pid), timeout=5)
    except AssertionError:
        raise AssertionError("the handler's setsid child %d survived the "
                             "worker's shutdown" % pid)


def test_handler_that_succeeded_keeps_its_children(run_myq, spool, tmp_path,
                                                   handlers_dir, procs):
    """Guard (passes today): a handler that exits 0 keeps what it started
    (the procs fixture kills it at the end)."""
    from _procs import read_pid, alive
    hd = daemon_handler(tmp_path, handlers_dir, "exit 0")
    r = run_myq("--spool", spool, "enqueue", "d", "null", "--id", "fine")
    assert r.returncode == 0, r.stderr
    r = run_myq("--spool", spool, "worker", "--drain", "--handlers", hd,
                "--poll", "0.05")
    assert r.returncode == 0, r.stderr
    assert "fine.json" in ls(spool, "done")
    pid = read_pid(tmp_path / "fine.pid")
    time.sleep(0.3)
    assert alive(pid), "a successful handler's child was killed"


# 9. Smaller items ##########################################################

def test_log_file_not_world_readable(spool, tmp_path):
    """`worker --log FILE` creates FILE 0640 or stricter (umask 022).
    Fails today (0644)."""
    log = tmp_path / "myq.log"
    r = subprocess.run([sys.executable, MYQ, "--spool", spool, "worker",
                        "--once", "--log", str(log)], env=clean_env(),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, timeout=30,
                       preexec_fn=lambda: os.umask(0o022))
    assert r.returncode == 0, r.stderr
    mode = stat.S_IMODE(os.stat(str(log)).st_mode)
    assert mode & ~0o640 == 0, "log file created %o" % mode


def test_myq_http_header_variable_is_one_header(run_myq, spool, servers):
    """MYQ_HTTP_HEADER='Authorization: Bearer x' is one header, and it
    arrives.  Fails today (split on blanks: exit 64)."""
    srv = servers(lambda h: answer(h, 200, b""))
    r = run_myq("--spool", spool, "enqueue", "http", json.dumps(
        {"url": srv.url("/x"), "method": "GET"}), "--id", "hdr")
    assert r.returncode == 0, r.stderr
    r = run_myq("--spool", spool, "worker", "--drain", "--poll", "0.05",
                env={"MYQ_HTTP_HEADER": "Authorization: Bearer x"}, timeout=60)
    assert r.returncode != 64, r.stderr
    assert r.returncode == 0, r.stderr
    assert [req["headers"].get("Authorization") for req in srv.requests] == ["Bearer x"]
    assert "hdr.json" in ls(spool, "done")


def test_retry_after_zero_is_not_a_busy_loop(run_myq, spool, servers, procs,
                                            tmp_path):
    """A server that answers 503 with `Retry-After: 0` to a job with
    max_attempts 1000: in 3 s the worker sends at most 5 requests.  Fails
    today (thousands: the job is rewritten as fast as the disk allows)."""
    srv = servers(lambda h: answer(h, 503, b"", [("Retry-After", "0")]))
    r = run_myq("--spool", spool, "enqueue", "http", json.dumps(
        {"url": srv.url("/busy"), "method": "GET"}), "--id", "ra0",
        "--max-attempts", "1000")
    assert r.returncode == 0, r.stderr
    w = procs.worker(spool, "--poll", "0.05", "--backoff-base", "0.2",
                     "--jitter", "0", log=tmp_path / "w.log")
    assert srv.wait_requests(1, timeout=15), "timed out waiting for the first request"
    time.sleep(3.0)             # the window being measured
    w.send_signal(signal.SIGTERM)
    w.wait(15)
    hits = [r["mono"] for r in srv.requests]
    first = hits[0]
    n = len([t for t in hits if t - first <= 3.0])
    assert n <= 5, "%d requests in 3 s" % n


def test_supervise_gives_workers_a_clean_environment(spool, tmp_path, procs):
    """`myq supervise` started with SECRET_TOKEN in its environment: its
    worker's environment has no SECRET_TOKEN (PATH, HOME, LANG, LC_*, TZ
    and --pass-env only).  Fails today (Popen inherits it all)."""
    from _procs import children
    env = clean_env({"SECRET_TOKEN": "xyz", "LANG": "C.UTF-8", "TZ": "UTC"})
    sup = procs.spawn([sys.executable, MYQ, "--spool", spool, "supervise",
                       "--workers", "1", "--poll", "0.5"], env=env,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def worker_pid():
        for pid in children([sup.pid]):
            try:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    if b"worker" in f.read().split(b"\0"):
                        return pid
            except OSError:
                pass
        return None
    pid = wait_for(worker_pid, what="the supervised worker")
    with open("/proc/%d/environ" % pid, "rb") as f:
        names = [kv.partition(b"=")[0].decode() for kv in f.read().split(b"\0")
                 if kv]
    sup.send_signal(signal.SIGTERM)
    sup.wait(15)
    assert "SECRET_TOKEN" not in names
    extra = [n for n in names if n in env and n not in (
        "PATH", "HOME", "LANG", "TZ") and not n.startswith("LC_")]
    assert extra == [], "the worker got %s" % extra


# 10. What root writes in the owner's spool stays usable by the owner ########

@needs_root
def test_root_retry_and_reap_leave_files_the_owner_can_run(box, owner):
    """Root's `myq retry` of a dead job and root's `myq reap` of a dead
    worker's claim write the job anew: the new files belong to the owner,
    whose worker then runs both jobs (done, not quarantined).  Fails today:
    the files are root's 0640, the owner's worker quarantines them
    (permission denied)."""
    now = time.time()
    job = {"type": "t", "attempts": 5, "created_at": now, "updated_at": now,
           "available_at": now, "max_attempts": 9}
    box.owner_file("dlq/d1.json", json.dumps(dict(job, id="d1")) + "\n")
    wid = "w-88-abc"
    box.owner_file("processing/c1+%s.1.json" % wid, json.dumps(
        dict(job, id="c1", attempts=0)) + "\n" + json.dumps(
        {"lease": {"worker": wid, "pid": 999999, "start": 1,
                   "boot_id": myq.boot_id(), "token": wid + ".1", "attempt": 1,
                   "leased_until": now - 100}}) + "\n")
    r = box.root("retry", "d1")
    assert r.returncode == 0, r.stderr
    r = box.root("reap")
    assert r.returncode == 0 and r.stdout.strip() == "requeued=1", r.stdout + r.stderr
    owners = {n: os.lstat(box.d("incoming", n)).st_uid
              for n in ls(box.spool, "incoming")}
    hd = owner_dir(box, "handlers")
    with open(os.path.join(hd, "t"), "w") as f:
        f.write("#!/bin/sh\ncat >/dev/null\n")
    os.chmod(os.path.join(hd, "t"), 0o755)
    r = box.owner("worker", "--drain", "--handlers", hd, "--poll", "0.05")
    assert r.returncode == 0, r.stderr
    assert owners == {"d1.json": owner.pw_uid, "c1.json": owner.pw_uid}
    assert ls(box.spool, "done") == ["c1.json", "d1.json"], ls(box.spool, "failed")


@needs_root
def test_root_worker_runs_handlers_as_the_owner(box, owner):
    """Root runs `myq worker --drain` on the owner's spool (an operator
    debugging): the job's handler runs as the spool's owner, not as root
    (the design: root's CLI becomes the owner).  Fails today: the owner's
    jobs run as root."""
    out = owner_dir(box, "out")
    hd = owner_dir(box, "handlers")
    with open(os.path.join(hd, "t"), "w") as f:
        f.write("#!/bin/sh\nid -u > '%s/uid'\n" % out)
    os.chmod(os.path.join(hd, "t"), 0o755)
    r = box.owner("enqueue", "t", "null", "--id", "who")
    assert r.returncode == 0, r.stderr
    r = box.root("worker", "--drain", "--handlers", hd, "--poll", "0.05",
                 timeout=60)
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "uid")) as f:
        assert int(f.read()) == owner.pw_uid, "the owner's job ran as root"
