"""The power-cut harness's own checker can fail: each broken promise that
check.recover_and_check looks for, made by hand on a spool in a temp dir
(no VM, no root).  And the UBIFS part's sharing of cuts among its VMs."""
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pytest  # noqa: E402

import check  # noqa: E402
import powercut  # noqa: E402

MYQ = os.path.join(os.path.dirname(os.path.dirname(HERE)), "myq.py")


def _payload(n):
    blob = "%x" % (n * 7919 + 12345)
    return {"n": n, "blob": blob,
            "sum": hashlib.sha256(blob.encode()).hexdigest()[:16]}


def _enqueue(myq, spool, n, **kw):
    p = _payload(n)
    jid = myq.open_store(spool).enqueue("ok", p, **kw)
    return jid, p["sum"]


def _check(spool, promised, tmp_path):
    res = check.recover_and_check(spool, promised, MYQ, str(tmp_path), fork=True)
    return {k: res[k] for k in ("lost", "doubled", "corrupt", "stuck", "recover",
                                "in_failed", "nul_tails")}, res["notes"]


CLEAN = dict(lost=0, doubled=0, corrupt=0, stuck=0, recover=0, in_failed=0,
             nul_tails=0)

# The checker of the file layout, given files made by hand (in done/, dlq/,
# failed/, processing/): the SQLite store's own are the test_sqlite_* below.
FILES = pytest.mark.files_only("the checker of the file layout")


@FILES
def test_a_recovered_spool_with_every_promised_job_is_clean(myq, spool, tmp_path):
    promised = dict(_enqueue(myq, spool, n) for n in range(5))
    counts, notes = _check(spool, promised, tmp_path)
    assert counts == CLEAN, notes
    assert sorted(os.listdir(os.path.join(spool, "done"))) == sorted(
        jid + ".json" for jid in promised)


def test_a_promised_job_that_is_nowhere_is_lost(myq, spool, tmp_path):
    promised = dict(_enqueue(myq, spool, n) for n in range(3))
    promised["1796000000000-deadbeef"] = _payload(99)["sum"]
    counts, notes = _check(spool, promised, tmp_path)
    assert counts == dict(CLEAN, lost=1), notes
    assert any("lost: 1796000000000-deadbeef" in n for n in notes)


@FILES
def test_a_pruned_done_job_is_no_loss_only_when_the_workload_saw_it_done(
        myq, spool, tmp_path):
    """A done job whose id myq generated keeps no record once retention
    removes its done file: the workload lists done/ before each prune, and
    only an id in that list may be nowhere."""
    promised = dict(_enqueue(myq, spool, n) for n in range(3))
    counts, notes = _check(spool, promised, tmp_path)
    assert counts == CLEAN, notes
    done = sorted(n[:-5] for n in os.listdir(os.path.join(spool, "done")))
    assert sorted(promised) == done
    assert myq.open_store(spool, keep_done=0).prune()["done"] == 3
    assert os.listdir(os.path.join(spool, "locks", "ok")) == []
    res = check.recover_and_check(spool, promised, MYQ, str(tmp_path), fork=True,
                                  pruned=set(done[:2]))
    assert res["lost"] == 1, res["notes"]
    assert any("lost: %s" % done[2] in n for n in res["notes"]), res["notes"]
    res = check.recover_and_check(spool, promised, MYQ, str(tmp_path), fork=True,
                                  pruned=set(done))
    assert res["lost"] == 0, res["notes"]


@FILES
def test_a_payload_that_does_not_match_its_checksum_is_corrupt(myq, spool, tmp_path):
    jid, want = _enqueue(myq, spool, 1)
    path = os.path.join(spool, "incoming", jid + ".json")
    with open(path) as f:
        job = json.load(f)
    job["payload"]["blob"] = "0" + job["payload"]["blob"][1:]
    with open(path, "w") as f:
        json.dump(job, f)
    counts, notes = _check(spool, {jid: want}, tmp_path)
    assert counts["corrupt"] == 1, notes


@FILES
def test_a_valid_job_in_failed_is_counted_and_lost(myq, spool, tmp_path):
    jid, want = _enqueue(myq, spool, 1)
    os.rename(os.path.join(spool, "incoming", jid + ".json"),
              os.path.join(spool, "failed", jid + ".json"))
    counts, notes = _check(spool, {jid: want}, tmp_path)
    # and `myq check` says so (a failed recovery)
    assert counts == dict(CLEAN, in_failed=1, lost=1, recover=1), notes


@FILES
def test_a_job_in_two_places_is_doubled(myq, spool, tmp_path):
    jid, want = _enqueue(myq, spool, 1)
    counts, notes = _check(spool, {jid: want}, tmp_path)
    assert counts == CLEAN, notes
    with open(os.path.join(spool, "done", jid + ".json"), "rb") as f:
        data = f.read()
    with open(os.path.join(spool, "dlq", jid + ".json"), "wb") as f:
        f.write(data)
    counts, notes = _check(spool, {jid: want}, tmp_path)
    assert counts["doubled"] == 1, notes
    assert any("in 2 places after recovery" in n for n in notes), notes


@FILES
def test_a_torn_lease_append_is_counted_and_the_claim_recovers(myq, spool, tmp_path):
    """What a power cut leaves on ext4: the claim's file kept its new length
    but not the appended lease line."""
    jid, want = _enqueue(myq, spool, 1)
    claim = os.path.join(spool, "processing", "%s+w-1-abcdef.1.json" % jid)
    os.rename(os.path.join(spool, "incoming", jid + ".json"), claim)
    with open(claim, "ab") as f:
        f.write(b"\0" * 40)
    counts, notes = _check(spool, {jid: want}, tmp_path)
    assert counts == dict(CLEAN, nul_tails=1), notes
    assert os.listdir(os.path.join(spool, "done")) == [jid + ".json"]


def test_the_ubifs_vms_share_every_cut_and_fault_round():
    for total in (0, 1, 6, 199, 200, 201):
        for n in (1, 2, 3):
            shares = [powercut._share(n, k, total) for k in range(n)]
            assert sum(shares) == total
            assert max(shares) - min(shares) <= 1


def test_the_ubifs_report_adds_up_the_vms_and_flags_missing_cuts(capsys):
    class A(object):
        cuts = 4

    def res(cuts, ro, lost):
        t = dict(lost=lost, doubled=0, corrupt=0, stuck=0, recover=0, rerun=0,
                 in_failed=0, nul_tails=0, nul_cuts=0, fsck=0, cuts=cuts,
                 rounds=cuts + ro, ro_rounds=ro)
        return {"cut_totals": dict(t), "totals": dict(t), "stage": "end",
                "cut_seconds": 1, "promised": 10, "vm_seconds": 2,
                "cpu_seconds": 1, "want_cuts": 2}
    merged = powercut.report_ubifs(A(), [res(2, 1, 0), res(1, 0, 1)])
    out = capsys.readouterr().out
    line = [l for l in out.splitlines() if l.startswith("powercut: fs=ubifs ")][0]
    assert " cuts=3 lost=1 " in line and " ro_rounds=1 " in line, line
    assert "1 cuts fewer than the 4 asked for" in out
    assert merged["lost"] == 1 and merged["recover"] == 1


# The SQLite store: the checker reads queue.db (sqlite3, read-only) ##########

def _sql_spool(myq, tmp_path):
    path = str(tmp_path / "sqlspool")
    myq.main(["--spool", path, "init", "--store", "sqlite"])
    return path


def _sql(spool, sql, args=()):
    import sqlite3
    db = sqlite3.connect(os.path.join(spool, "queue.db"), isolation_level=None)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def _check_sql(spool, promised, tmp_path, **kw):
    res = check.recover_and_check(spool, promised, MYQ, str(tmp_path), fork=True,
                                  store="sqlite", **kw)
    return {k: res[k] for k in ("lost", "doubled", "corrupt", "stuck", "recover",
                                "in_failed", "nul_tails")}, res["notes"]


def test_sqlite_a_recovered_spool_is_clean_and_its_pruned_jobs_count_by_ok(
        myq, tmp_path):
    spool = _sql_spool(myq, tmp_path)
    promised = dict(_enqueue(myq, spool, n) for n in range(4))
    promised.update([_enqueue(myq, spool, 9, id="x-9")])
    counts, notes = _check_sql(spool, promised, tmp_path)
    assert counts == CLEAN, notes
    assert sorted(r[0] for r in _sql(spool, "SELECT id FROM jobs WHERE "
                                     "status='done'")) == sorted(promised)
    assert check.done_ids(spool) == sorted(promised)
    assert os.listdir(os.path.join(spool, "done")) == []
    # retention: x-9 keeps its ok row; the generated ids count only when
    # the workload saw them done before the prune
    assert myq.open_store(spool, keep_done=0).prune()["done"] == 5
    assert _sql(spool, "SELECT id FROM ok") == [("x-9",)]
    counts, notes = _check_sql(spool, promised, tmp_path)
    assert counts == dict(CLEAN, lost=4), notes
    counts, notes = _check_sql(spool, promised, tmp_path,
                               pruned=set(promised) - {"x-9"})
    assert counts == CLEAN, notes


def test_sqlite_a_lost_row_a_doubled_job_and_a_corrupt_payload_are_found(
        myq, tmp_path):
    spool = _sql_spool(myq, tmp_path)
    promised = dict(_enqueue(myq, spool, n) for n in range(3))
    a, b, c = sorted(promised)
    _sql(spool, "DELETE FROM jobs WHERE id=?", (a,))                 # lost
    counts, notes = _check_sql(spool, promised, tmp_path)
    assert counts == dict(CLEAN, lost=1), notes
    assert any("lost: %s" % a in n for n in notes), notes
    # doubled: a done job in a state directory beside its row (which stay
    # empty in this store) ...
    row = _sql(spool, "SELECT payload FROM jobs WHERE id=?", (b,))[0][0]
    with open(os.path.join(spool, "dlq", b + ".json"), "w") as f:
        json.dump({"id": b, "type": "ok", "payload": json.loads(row)}, f)
    counts, notes = _check_sql(spool, promised, tmp_path)
    assert counts["doubled"] == 1 and counts["lost"] == 1, notes
    assert any("in 2 places after recovery" in n and "db:done/queue.db:" + b in n
               for n in notes), notes
    os.unlink(os.path.join(spool, "dlq", b + ".json"))
    # ... and a job done before recovery that runs again during it (its
    # done row replaced by a file in the drop box past the de-duplication
    # window)
    _sql(spool, "UPDATE jobs SET finished_at=1000 WHERE id=?", (c,))
    row = _sql(spool, "SELECT payload FROM jobs WHERE id=?", (c,))[0][0]
    with open(os.path.join(spool, "incoming", c + ".json"), "w") as f:
        json.dump({"type": "ok", "payload": json.loads(row)}, f)
    counts, notes = _check_sql(spool, promised, tmp_path)
    assert counts == dict(CLEAN, lost=1, doubled=1), notes
    assert any("ran again although done/dead before recovery: %s" % c in n
               for n in notes), notes
    # a payload that does not match its checksum
    p = json.loads(row)
    p["blob"] = "0" + p["blob"][1:]
    _sql(spool, "UPDATE jobs SET payload=? WHERE id=?", (json.dumps(p), b))
    counts, notes = _check_sql(spool, promised, tmp_path)
    assert counts == dict(CLEAN, lost=1, corrupt=1), notes


def test_sqlite_a_valid_job_in_a_failed_row_is_counted_and_lost(myq, tmp_path):
    spool = _sql_spool(myq, tmp_path)
    promised = dict(_enqueue(myq, spool, n) for n in range(2))
    a = sorted(promised)[0]
    _sql(spool, "UPDATE jobs SET status='failed', last_error='x' WHERE id=?", (a,))
    counts, notes = _check_sql(spool, promised, tmp_path)
    # and `myq check` says so (a failed recovery)
    assert counts == dict(CLEAN, in_failed=1, lost=1, recover=1), notes


def test_sqlite_a_database_sqlite_cannot_read_fails_the_recovery(myq, tmp_path):
    spool = _sql_spool(myq, tmp_path)
    promised = dict(_enqueue(myq, spool, n) for n in range(2))
    _sql(spool, "PRAGMA wal_checkpoint(TRUNCATE)")
    with open(os.path.join(spool, "queue.db"), "r+b") as f:
        f.write(b"\xff" * 100)          # the header gone
    counts, notes = _check_sql(spool, promised, tmp_path)
    assert counts["recover"] >= 1 and counts["lost"] == 2, notes
    assert any("sqlite3 could not read" in n for n in notes), notes


def test_busy_counts_jobs_not_the_directories_init_makes(myq, spool):
    """A spool as init makes it (incoming/lanes/ among its directories) is
    not busy; a job waiting in incoming/ or in a lane is."""
    assert check.busy(spool) == 0
    myq.open_store(spool).enqueue("ok", {})
    assert check.busy(spool) == 1
