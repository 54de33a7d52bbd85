"""Recover a spool after a (simulated) power cut and check myq's promises.

recover_and_check(spool, promised, myq_path) runs the README's recovery
(a worker --drain with the workload's handlers, then `myq check`) and
returns a dict of counts:

  lost      a promised job (its enqueue had returned before the cut) is in no
            state directory and has no success record (a done job that
            retention removed keeps a locks/ok record when a producer chose
            its id; one with an id myq generated keeps none, so the workload
            tells which ids it saw in done/ before a prune: `pruned`)
  doubled   a job in more than one place after recovery, or a job that was
            done (or dead) before recovery and ran again during it
  corrupt   a job whose payload does not match its checksum or the journal
  in_failed valid jobs quarantined in failed/ (a promised one is also lost:
            it will not run unless an operator retries it)
  nul_tails job files that end in NUL bytes before recovery (read past them)
  stuck     anything left in processing/ after recovery
  recover   the worker or `myq check` failed (exit status, or problems)
  ids       {kind: [id, ...]} every id behind the counts above (lost,
            doubled, corrupt, stuck, in_failed), complete: notes are
            prose for people, these are for counting
  rerun     promised jobs that ran during recovery (not done before it:
            pending, or done but its success record not durable; allowed),
            for information

On a spool of the SQLite store (SPOOL/store says "sqlite") the jobs are
the rows of queue.db, read with sqlite3 itself (read-only: no checkpoint,
the log left as the cut left it), not through myq: a row is a place
(ready, processing, done, dead), a pruned done job counts by its `ok`
row, a `failed` row whose payload is intact is a valid job quarantined.
The drop box (incoming/ files), failed/ and processing/, done/, dlq/ (which
stay empty) are read as for files: a file there beside a row is a second
place.  A database sqlite3 cannot read is a failed recovery, and every
promised job then counts lost.
"""

import hashlib
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
STATE_DIRS = ("incoming", "processing", "done", "dlq")


def _myq(myq_path):
    d = os.path.dirname(os.path.abspath(myq_path))
    if d not in sys.path:
        sys.path.insert(0, d)
    import myq
    return myq


def _listdir(p):
    try:
        return sorted(os.listdir(p))
    except OSError:
        return []


def _idle():
    """Seconds this machine's CPUs were idle (/proc/stat)."""
    with open("/proc/stat") as f:
        v = f.readline().split()
    return (int(v[4]) + int(v[5])) / float(os.sysconf("SC_CLK_TCK"))


_PARSED = {}


def load(path, myq):
    """(job or None, tail): myq.parse's job; when myq cannot parse the file,
    the job object read past trailing NUL bytes (tail=True), as a power cut
    leaves a file whose size grew before its appended data reached the disk.
    Every file is read whole each time; the parse of the same bytes is
    remembered (under TCG parsing is most of a scan's time)."""
    with open(path, "rb") as f:
        data = f.read()
    key = hashlib.sha1(data).digest()
    hit = _PARSED.get(key)
    if hit is None:
        if len(_PARSED) > 50000:
            _PARSED.clear()
        hit = _PARSED[key] = _load(data, myq)
    return hit


def _load(data, myq):
    try:
        return myq.parse(data)[0], data.endswith(b"\0")
    except Exception:
        pass
    stripped = data.rstrip(b"\0")
    if stripped != data:
        try:
            return myq.parse(stripped)[0], True
        except Exception:
            pass
    return None, data.endswith(b"\0")


def store_of(spool):
    """The store SPOOL/store records: "files" (no record) or its word."""
    try:
        with open(os.path.join(spool, "store")) as f:
            return f.read().strip() or "files"
    except OSError:
        return "files"


DB_STATES = {"ready": "incoming", "processing": "processing", "done": "done",
             "dead": "dlq"}     # a row's status -> the directory it would be


def db_rows(spool, what="id, status, payload, type"):
    """The rows of SPOOL/queue.db's jobs (`what`), its ok ids, and None or
    the error sqlite3 gave.  Opened read-only: nothing is written to the
    database or its log (no checkpoint at the close)."""
    import sqlite3
    from urllib.parse import quote
    path = os.path.join(spool, "queue.db")
    if not os.path.exists(path):
        return [], set(), "%s is missing" % path
    rows, ok = [], set()
    try:
        db = sqlite3.connect("file:%s?mode=ro" % quote(path), uri=True,
                             timeout=30)
        try:
            rows = db.execute("SELECT %s FROM jobs" % what).fetchall()
            ok = set(r[0] for r in db.execute("SELECT id FROM ok"))
        finally:
            db.close()
    except sqlite3.Error as e:
        return rows, ok, "%s: %s" % (path, e)
    return rows, ok, None


def done_ids(spool):
    """The ids of the done jobs (done/ files, or done rows): what a prune
    may remove (a done job whose id myq generated keeps no record once
    gone: the checker's `pruned`)."""
    if store_of(spool) == "sqlite":
        rows, _, err = db_rows(spool, "id, status")
        if err:
            raise OSError("cannot list the done rows: %s" % err)
        return sorted(r[0] for r in rows if r[1] == "done")
    return sorted(n[:-5] for n in os.listdir(os.path.join(spool, "done"))
                  if n.endswith(".json"))


def busy(spool):
    """How many jobs wait or run (flaky ones waiting for a retry too): the
    job files of incoming/, its lanes and processing/ (and the ready and
    processing rows).  Only job files: init makes incoming/lanes/, which
    is no job (counted, a workload waited for it until its VM's time was
    up, and the part ended with no result)."""
    inc = os.path.join(spool, "incoming")
    n = sum(name.endswith(".json") for name in _listdir(inc)) + \
        len(_listdir(os.path.join(spool, "processing")))
    lanes = os.path.join(inc, "lanes")
    for lane in _listdir(lanes):
        n += sum(name.endswith(".json")
                 for name in _listdir(os.path.join(lanes, lane)))
    if store_of(spool) == "sqlite":
        rows, _, err = db_rows(spool, "status")
        n += sum(r[0] in ("ready", "processing") for r in rows) + bool(err)
    return n


def _row_job(jid, status, payload, typ):
    """The job a checker reads from a row: None when its payload is not
    JSON."""
    try:
        p = json.loads(payload) if payload is not None else None
    except ValueError:
        return None
    return {"id": jid, "type": typ, "status": status, "payload": p}


def scan(spool, myq, read=STATE_DIRS + ("failed",), store="files", errors=None,
         ids=None):
    """{id: [(state, name, job or None)]}, ok ids, failed valid jobs, the
    files that end in NUL bytes.  Files are read (and parsed) only in the
    directories named in `read` (and with `ids`, a set, only those of
    these ids: the others are listed); elsewhere job is None.  store "sqlite":
    the rows of queue.db too (state "db:STATUS", name "queue.db:ID"; the
    payload parsed when the directory the status stands for is in `read`),
    its ok ids, and the failed rows whose payload is intact; what sqlite3
    said to `errors` (a list)."""
    where, tails = {}, []
    for sub in STATE_DIRS:
        names = _listdir(os.path.join(spool, sub))
        if sub == "incoming":
            # a type with a policy waits in its lane: incoming/lanes/LANE/
            lanes = os.path.join(spool, sub, "lanes")
            names += ["lanes/%s/%s" % (lane, n) for lane in _listdir(lanes)
                      for n in _listdir(os.path.join(lanes, lane))]
        for name in names:
            if not name.endswith((".json", ".fin")):
                continue
            jid = os.path.basename(name)[:-5]
            if sub == "processing":
                jid = jid.split("+", 1)[0]
            job, tail = None, False
            if sub in read and (ids is None or jid in ids):
                try:
                    job, tail = load(os.path.join(spool, sub, name), myq)
                except OSError:
                    pass
            where.setdefault(jid, []).append((sub, name, job))
            if tail:
                tails.append("%s/%s" % (sub, name))
    ok = set(_listdir(os.path.join(spool, "locks", "ok")))
    failed_valid = []
    for name in _listdir(os.path.join(spool, "failed")) if "failed" in read else ():
        p = os.path.join(spool, "failed", name)
        if name.endswith(".reason") or not os.path.isfile(p):
            continue
        try:
            job, tail = load(p, myq)
        except OSError:
            job = None
        if isinstance(job, dict) and "type" in job:
            failed_valid.append((name, job))
    if store == "sqlite":
        rows, db_ok, err = db_rows(spool)
        if err and errors is not None:
            errors.append(err)
        ok |= db_ok
        for jid, status, payload, typ in rows:
            sub = DB_STATES.get(status)
            if sub is None:         # failed: a row myq could not read
                job = _row_job(jid, status, payload, typ) \
                    if "failed" in read else None
                if job is not None and _intact(job):
                    failed_valid.append(("queue.db:" + jid, job))
                continue
            job = _row_job(jid, status, payload, typ) if sub in read else None
            where.setdefault(jid, []).append(("db:" + status, "queue.db:" + jid,
                                              job))
    return where, ok, failed_valid, tails


def _intact(job, want_sum=None):
    try:
        p = job["payload"]
        good = hashlib.sha256(p["blob"].encode()).hexdigest()[:16] == p["sum"]
        return good and (want_sum is None or p["sum"] == want_sum)
    except (KeyError, TypeError, AttributeError):
        return False


def fork_myq(myq, args, env):
    """Run myq.main(args) in a forked child (no interpreter start: under TCG
    that is most of a second).  Returns (exit status, output)."""
    import tempfile
    out = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            # sys.stdout may not be fd 1 (pytest's capture): write there
            import io
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False),
                                          line_buffering=True)
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False),
                                          line_buffering=True)
            os.environ.clear()
            os.environ.update(env)
            rc = myq.main(args)
        except BaseException:
            import traceback
            traceback.print_exc()
            rc = 70
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(rc if isinstance(rc, int) else 1)
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    return os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") \
        else (status >> 8), out.read()


class _Done(object):
    def __init__(self, rc, out):
        self.returncode, self.stdout = rc, out


FINISHED = ("done", "dlq", "db:done", "db:dead")
CLAIMED = ("processing", "db:processing")


def recover_and_check(spool, promised, myq_path, workdir, timeout=300,
                      python=None, fork=False, pruned=(), store=None,
                      only_promised=False):
    """store: the store the spool must have ("files", "sqlite"); None: the
    one SPOOL/store records.  only_promised: the job files read are the
    promised ones' (the others are listed: where a job is, how many
    places; the RAM parts, whose ledger settles what it saw finished)."""
    myq = _myq(myq_path)
    found_store = store_of(spool)
    store = store or found_store
    if not promised and os.path.isdir(spool):
        store = found_store     # a cut in `myq init` (nothing promised yet)
    db_errors = []
    py = python or sys.executable

    def run(args, env):
        if fork:
            return _Done(*fork_myq(myq, args[2:], env))
        return subprocess.run(args, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout)
    res = dict(lost=0, doubled=0, corrupt=0, stuck=0, recover=0, rerun=0,
               in_failed=0, nul_tails=0)
    notes = []
    ids = dict(lost=[], doubled=[], corrupt=[], stuck=[], in_failed=[])
    import time
    clock = [time.monotonic(), _idle()]
    spent = {}

    def lap(what):         # wall and idle seconds of each step
        t, i = time.monotonic(), _idle()
        spent[what] = t - clock[0]
        spent["idle_" + what] = i - clock[1]
        clock[:] = [t, i]
    # Before recovery only what recovery works on is read: done/ and dlq/
    # files are read (all of them) after it, and recovery does not touch
    # those that were there before.
    want = set(promised) if only_promised else None
    pre, pre_ok, _, pre_tails = scan(spool, myq, read=("incoming", "processing"),
                                     store=store, errors=db_errors, ids=want)
    lap("scan_pre")
    if found_store != store:
        res["recover"] += 1
        notes.append("the spool's store is %r, not %r" % (found_store, store))
    for err in db_errors:
        notes.append("before recovery, sqlite3 could not read the database: %s"
                     % err)
    finished_pre = set(pre_ok)
    for jid, locs in pre.items():
        if any(s in FINISHED for s, _, _ in locs):
            finished_pre.add(jid)
    runlog = os.path.join(workdir, "recovery-runs.log")
    try:
        os.unlink(runlog)
    except OSError:
        pass
    env = dict(os.environ, PC_RUNLOG=runlog, PYTHONDONTWRITEBYTECODE="1")
    env.pop("MYQ_SPOOL", None)
    run([py, myq_path, "--spool", spool, "init"], env)
    lap("init")
    w = run([py, myq_path, "--spool", spool, "worker", "--module",
             os.path.join(HERE, "handlers.py"), "--drain", "--stats-interval", "0",
             "--min-free", "0"], env)
    lap("drain")
    if w.returncode != 0:
        res["recover"] += 1
        notes.append("worker --drain exit %d: %s" % (
            w.returncode, w.stdout.decode("utf-8", "replace")[-600:]))
    # (--warn-capacity 0: the outage capacity the workload's arrivals
    # leave on a small test disk is advice to an operator, not a recovery
    # that failed)
    c = run([py, myq_path, "--spool", spool, "check", "--min-free", "0",
             "--warn-capacity", "0", "--json"], env)
    lap("check")
    try:
        # dead jobs are the workload's (it makes dead letters on purpose):
        # what needs an operator is not a failed recovery
        problems = [p for p in json.loads(c.stdout.decode("utf-8"))["problems"]
                    if " dead job(s) in dlq/" not in p]
    except (ValueError, KeyError, TypeError):
        problems = ["exit %d, no JSON: %s" % (c.returncode, c.stdout[-300:])]
    if problems:
        res["recover"] += 1
        notes.append("myq check: %s" % "; ".join(problems)[-600:])
    del db_errors[:]
    post, post_ok, failed_valid, post_tails = scan(spool, myq, store=store,
                                                   errors=db_errors, ids=want)
    lap("scan_post")
    if db_errors:
        res["recover"] += 1
        notes.extend("after recovery, sqlite3 could not read the database: %s"
                     % err for err in db_errors)
    old = set("%s/%s" % (s, n) for locs in pre.values() for s, n, _ in locs
              if s in ("done", "dlq"))
    pre_tails += [t for t in post_tails if t in old]
    res["nul_tails"] = len(pre_tails)
    if pre_tails:
        notes.append("NUL bytes at the end of (before recovery): %s"
                     % ", ".join(pre_tails[:5]))
    ran = []
    try:
        with open(runlog) as f:
            ran = [l.split()[1] for l in f if len(l.split()) >= 2]
    except OSError:
        pass
    for jid in sorted(set(ran)):
        if jid in finished_pre:
            res["doubled"] += 1
            ids["doubled"].append(jid)
            notes.append("ran again although done/dead before recovery: %s (pre: %s)"
                         % (jid, [s for s, _, _ in pre.get(jid, [])]
                            + ([("locks/ok", "ok")[store == "sqlite"]]
                               if jid in pre_ok else [])))
        elif jid in promised:
            res["rerun"] += 1
    for jid, locs in post.items():
        if any(s in CLAIMED for s, _, _ in locs):
            res["stuck"] += 1
            ids["stuck"].append(jid)
            notes.append("left in processing/: %s" % [n for _, n, _ in locs])
        if len(locs) > 1:
            res["doubled"] += 1
            ids["doubled"].append(jid)
            notes.append("in %d places after recovery: %s" % (
                len(locs), ["%s/%s" % (s, n) for s, n, _ in locs]))
        for s, n, job in locs:
            if job is None or not _intact(job, promised.get(jid)):
                if jid in promised or job is not None:
                    res["corrupt"] += 1
                    ids["corrupt"].append(jid)
                    notes.append("bad content: %s/%s" % (s, n))
    # promised jobs finished (done, dead) and whole, in one place
    res["finished"] = sorted(
        jid for jid, locs in post.items() if jid in promised and len(locs) == 1
        and locs[0][0] in FINISHED and locs[0][2] is not None
        and _intact(locs[0][2], promised[jid]))
    quarantined = {}
    for name, job in failed_valid:
        res["in_failed"] += 1
        ids["in_failed"].append(job.get("id") or name[:-5])
        quarantined[job.get("id") or name[:-5]] = name
        try:
            with open(os.path.join(spool, "failed", name + ".reason")) as f:
                why = "; reason: " + f.read(300).strip()
        except OSError:
            why = ""
        notes.append("valid job quarantined in failed/: %s (id %s, intact: %s)%s"
                     % (name, job.get("id"), _intact(job), why))
    for jid in promised:
        if jid not in post and jid not in post_ok and jid not in pruned:
            res["lost"] += 1
            ids["lost"].append(jid)
            notes.append("lost: %s (pre-recovery: %s)%s" % (
                jid, [n for _, n, _ in pre.get(jid, [])] or "nowhere",
                " -> failed/%s" % quarantined[jid] if jid in quarantined else ""))
    res["notes"] = notes
    res["ids"] = ids
    res["spent"] = spent
    return res
