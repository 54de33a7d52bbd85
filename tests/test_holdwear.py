"""A hold writes nothing per waiting job, and a claim's lease costs no
data block (myq-spool(5) CLAIMS and HOLDS).

The field trial's type (`handler=http batch=100`) against a server that
answers 503 to everything: three failed batches hold the destination, and
from then on each probe is ONE job (X-Myq-Ids), and a probe that fails
again rewrites no job: every waiting job's file keeps its inode, mtime and
bytes (the SQLite store: every row its columns), the probe's own job its
bytes and inode (its mtime moves it behind the others: the next probe is
another job).  bench/outage.py measures what this saves on a device.
"""
import json
import os
import sqlite3

import pytest

import myq
from _core import call_myq, show, wait_for
from _http import answer, http_servers  # noqa: F401 (a fixture)

both = pytest.mark.parametrize("store", ["files", "sqlite"], indirect=True)
N = 250
OPTS = ("--poll", "0.05", "--jitter", "0", "--backoff-base", "0.2",
        "--backoff-max", "0.3", "--probe-max", "0.3")


def ids_of(r):
    return r["headers"]["X-Myq-Ids"].split(",")


def held_with_probes(spool, server, procs, tmp_path):
    """N jobs of the field's type, a worker, the server failing every
    request: returns once the destination is held and a probe failed."""
    cp = call_myq("--spool", spool, "policy", "tele", "handler=http",
                  "batch=100", "gzip=true")
    assert cp.returncode == 0, cp.stderr
    sp = myq.open_store(spool)
    url = server.url("/ingest")
    sp.enqueue_many([{"type": "tele", "id": "j%03d" % i,
                      "payload": {"url": url, "body": {"n": i}}}
                     for i in range(N)])
    log = tmp_path / "w.log"
    procs.worker(spool, *OPTS, log=log)
    # 3 failed batches (the default breaker) hold it; then probes
    assert server.wait(lambda: len(server.requests) >= 5, timeout=30), \
        log.read_text()
    wait_for(lambda: "event=hold" in log.read_text(), what="the hold")
    return log


def probes(server, after):
    with server.lock:
        return [ids_of(r) for r in server.requests[after:]]


@both
def test_a_probe_is_one_job_whatever_the_batch(spool, http_servers, procs,
                                               tmp_path):
    server = http_servers(default=lambda h: answer(h, 503, b"down"))
    held_with_probes(spool, server, procs, tmp_path)
    assert server.wait(lambda: len(server.requests) >= 9, timeout=30)
    with server.lock:
        sent = [ids_of(r) for r in server.requests]
    # the first three: the batches that tripped the breaker; the rest probes
    assert [len(x) for x in sent[:3]] == [100, 100, 50], [len(x) for x in sent]
    assert [len(x) for x in sent[3:]] == [1] * len(sent[3:]), \
        [len(x) for x in sent]
    # each probe another job
    assert len(set(x[0] for x in sent[3:])) == len(sent[3:]), sent[3:]


def snapshot(spool, store):
    """{job id: what a rewrite would change} of every job not finished."""
    out = {}
    if store == "sqlite":
        db = sqlite3.connect(os.path.join(spool, "queue.db"))
        try:
            for row in db.execute(
                    "SELECT id, payload, attempts, last_error, created_at, "
                    "updated_at, extra, lane, available_at, status FROM jobs "
                    "WHERE status IN ('ready', 'processing')"):
                out[row[0]] = row[1:]
        finally:
            db.close()
        return out
    for sub in ("incoming", "processing"):
        for d, _, files in os.walk(os.path.join(spool, sub)):
            for n in files:
                if not n.endswith(".json"):
                    continue
                p = os.path.join(d, n)
                try:
                    st = os.lstat(p)
                    with open(p, "rb") as f:
                        data = f.read()
                except OSError:
                    continue            # (it moved while we looked)
                jid = n.partition("+")[0]
                jid = jid[:-5] if jid.endswith(".json") else jid
                out[jid] = (st.st_ino, st.st_mtime_ns, data)
    return out


def whole(spool, store):
    """A snapshot with every job in it (a walk can miss the probe's job
    as it moves between processing/ and its lane: then once more)."""
    return wait_for(lambda: (lambda s: s if len(s) == N else None)(
        snapshot(spool, store)), what="a snapshot of every job")


def same_but_schedule(a, b, store):
    """A probe's job: all but its place in line (mtime, available_at) and
    its claim's own columns."""
    if store == "sqlite":
        return a[:6] == b[:6]
    return a[0] == b[0] and a[2] == b[2]


@both
def test_failed_probes_rewrite_no_waiting_job(spool, store, http_servers,
                                              procs, tmp_path):
    server = http_servers(default=lambda h: answer(h, 503, b"down"))
    held_with_probes(spool, server, procs, tmp_path)
    n0 = len(server.requests)
    # (settled: the probe in flight went back)
    assert server.wait(lambda: len(server.requests) >= n0 + 1, timeout=30)
    before = whole(spool, store)
    n1 = len(server.requests)
    assert server.wait(lambda: len(server.requests) >= n1 + 4, timeout=30)
    after = whole(spool, store)
    probed = set(j for ids in probes(server, n1 - 1) for j in ids)
    assert len(before) == N and set(after) == set(before)
    changed = sorted(j for j in before if j not in probed
                     and before[j] != after[j])
    assert changed == [], (len(changed), changed[:5])
    for j in probed:
        assert same_but_schedule(before[j], after[j], store), j


@pytest.mark.parametrize("store", ["files"], indirect=True)
def test_a_claim_writes_no_data_block_for_its_lease(spool):
    """The claim is a rename and an mtime (the lease's end): the file's
    bytes stay the job's; `myq show` and the worker's record say who holds
    it (myq-spool(5) CLAIMS)."""
    sp = myq.open_store(spool)
    jid = sp.enqueue("t", {"n": 1})
    path = os.path.join(spool, "incoming", jid + ".json")
    with open(path, "rb") as f:
        data = f.read()
    ino = os.lstat(path).st_ino
    me = myq.Identity(sp, lease=60)
    me.register()
    try:
        t0 = myq._now()
        c = sp.claims.claim(jid + ".json", me)
        assert c is not None
        st = os.lstat(c.path)
        with open(c.path, "rb") as f:
            assert f.read() == data             # nothing appended
        assert st.st_size == len(data) and st.st_ino == ino
        assert t0 + 59 <= st.st_mtime <= myq._now() + 61   # the lease's end
        lease = show(call_myq, spool, jid)["lease"]
        assert lease["worker"] == me.wid and lease["pid"] == os.getpid()
        assert lease["attempt"] == 1 and lease["token"] == c.token
        assert abs(lease["leased_until"] - st.st_mtime) < 0.01
        rec = json.loads(open(os.path.join(
            spool, "locks", "workers", me.wid + ".json")).read())
        assert rec["pid"] == os.getpid()
        # taken back (its worker gone), it counts the attempt it began
        me.unregister()
        assert sp.claims.reap() == 1
        job = show(call_myq, spool, jid)
        assert job["state"] == "ready" and job["attempts"] == 1, job
    finally:
        me.unregister()


@pytest.mark.parametrize("store", ["files"], indirect=True)
def test_a_file_the_worker_cannot_date_gets_its_lease_as_a_line(
        spool, monkeypatch):
    """A group member's 0660 file: only its owner sets its times, so the
    claim appends the lease as before, and such a claim is not put back
    unchanged (the line would make it a forgery in incoming/)."""
    import errno

    def refused(fd, path, t):
        raise OSError(errno.EPERM, "not the owner")
    monkeypatch.setattr(myq, "_futime", refused)
    sp = myq.open_store(spool)
    jid = sp.enqueue("t", {"n": 1})
    me = myq.Identity(sp, lease=60)
    me.register()
    try:
        c = sp.claims.claim(jid + ".json", me)
        assert c is not None and c.trailers is None
        text = open(c.path).read()
        assert '"leased_until"' in text and '"worker":"%s"' % me.wid in text
        assert sp.claims._until_of(c.path) > myq._now() + 50
        me.unregister()
        assert sp.claims.reap() == 1
        job = show(call_myq, spool, jid)
        assert job["state"] == "ready" and job["attempts"] == 1, job
    finally:
        me.unregister()
