"""The spool's budget and its capacity, on both stores: the shed order (done/ first, then
drop-oldest types, lowest priority then earliest made, across types), a
reject type refused at the budget while drop-oldest types give way, dead
jobs never shed, never more than one job over, delivery at 100 %,
dropped_by, the capacity's figures and check --warn-capacity."""
import json
import os
import time

import pytest

from _core import call_myq, worker

pytestmark = pytest.mark.parametrize("store", ["files", "sqlite"],
                                     indirect=True)

PAYLOAD = json.dumps("x" * 3000)        # a job of ~3 KiB


def _myq(spool, *args):
    return call_myq("--spool", spool, *args)


def _ok(spool, *args):
    cp = _myq(spool, *args)
    assert cp.returncode == 0, (args, cp.returncode, cp.stderr)
    return cp.stdout


def _budget(spool, size, **types):
    """The budget, and each type's policy (KEY=VALUE words).  (The sizes
    below count init's reserve, locks/room: 64K of every spool.)"""
    _ok(spool, "policy", "--budget", size)
    for t, words in types.items():
        _ok(spool, "policy", t, *words.split())


def _enqueue(spool, type_, *opts):
    """(exit status, id or error)."""
    cp = _myq(spool, "enqueue", type_, PAYLOAD, *opts)
    return cp.returncode, (cp.stdout.strip() or cp.stderr.strip())


def _stats(spool):
    return json.loads(_ok(spool, "stats", "--json"))


def _ids(spool, state, type_=None):
    rows = [json.loads(l) for l in _ok(spool, "list", state, "--json").split("\n")
            if l.strip()]
    return [r["id"] for r in rows if type_ is None or r["type"] == type_]


def _waiting(spool, type_=None):
    return _ids(spool, "ready", type_) + _ids(spool, "scheduled", type_)


def _measured(myq, spool):
    """What the spool keeps now, as du(1) counts it (not myq's figure)."""
    total = os.lstat(spool).st_blocks * 512
    for top, dirs, files in os.walk(spool):
        for name in dirs + files:
            total += os.lstat(os.path.join(top, name)).st_blocks * 512
    return total


def _one_job(myq, spool):
    """What one job of PAYLOAD adds, as the budget counts it."""
    sp = myq.open_store(spool)
    return sp.budget.cost(len(PAYLOAD) + 200)


def _handlers(tmp_path, **bodies):
    d = tmp_path / "handlers"
    d.mkdir(exist_ok=True)
    for name, body in bodies.items():
        p = d / name
        p.write_text("#!/bin/sh\ncat >/dev/null\n" + body + "\n")
        p.chmod(0o755)
    return str(d)


def test_budget_is_set_by_init_and_policy_and_an_empty_value_removes_it(
        tmp_path, store, myq):
    path = str(tmp_path / "s")
    _ok(path, "init", "--store", store, "--budget", "2M")
    assert _stats(path)["budget_bytes"] == 2 << 20
    assert "@spool budget=2M" in _ok(path, "policy")
    _ok(path, "policy", "--budget", "512K")
    assert _stats(path)["budget_bytes"] == 512 << 10
    assert _myq(path, "policy", "--budget", "lots").returncode == 64
    _ok(path, "policy", "--budget", "")
    assert _stats(path)["budget_bytes"] is None


def test_shed_order_done_first_then_drop_oldest_lowest_priority_earliest(
        spool, run_myq, tmp_path, myq):
    hd = _handlers(tmp_path, ok="exit 0")
    _budget(spool, "400K", low="overflow=drop-oldest priority=-1",
            high="overflow=drop-oldest priority=2")
    done = [_enqueue(spool, "ok")[1] for _ in range(3)]
    cp = worker(run_myq, spool, handlers=hd)
    assert cp.returncode == 0, cp.stderr
    assert sorted(_ids(spool, "done")) == sorted(done)
    low, high = [], []
    for i in range(8):      # made in turns: low, high, low, high, ...
        low.append(_enqueue(spool, "low")[1])
        high.append(_enqueue(spool, "high")[1])
    for _ in range(300):
        rc, out = _enqueue(spool, "crit")
        if rc != 0:
            break
        left_done = _ids(spool, "done")
        left_low, left_high = _waiting(spool, "low"), _waiting(spool, "high")
        if len(left_low) < len(low) or len(left_high) < len(high):
            assert left_done == [], "a waiting job went before done/ did"
        if len(left_high) < len(high):
            assert left_low == [], "a priority-2 job went before priority -1"
        # the earliest made go first: what is left is the latest made
        assert sorted(left_low) == low[len(low) - len(left_low):]
        assert sorted(left_high) == high[len(high) - len(left_high):]
    assert rc == 75, (rc, out)
    assert _waiting(spool, "low") == [] and _waiting(spool, "high") == []
    by = _stats(spool)["dropped_by"]
    assert by["low"] == {"budget": 8} and by["high"] == {"budget": 8}


def test_reject_type_refused_at_the_budget_while_drop_oldest_gives_way(
        spool, myq):
    _budget(spool, "264K", tele="overflow=drop-oldest")
    for _ in range(120):            # far more than the budget holds
        rc, out = _enqueue(spool, "tele")
        assert rc == 0, out
    kept = len(_waiting(spool, "tele"))
    assert 0 < kept < 60
    assert _stats(spool)["dropped_by"]["tele"]["budget"] == 120 - kept
    crit = 0
    while True:
        rc, out = _enqueue(spool, "crit")
        if rc != 0:
            break
        crit += 1
        assert crit < 200
    assert rc == 75
    assert "budget" in out and "crit" in out and "\n" not in out
    assert crit >= kept - 1 and _waiting(spool, "tele") == []
    assert len(_waiting(spool, "crit")) == crit     # never shed
    cp = _myq(spool, "enqueue", "tele", PAYLOAD)
    assert cp.returncode == 75                  # nothing left to shed
    with pytest.raises(myq.SpoolFull):
        myq.open_store(spool).enqueue("crit", "x" * 3000)


def test_dead_jobs_are_never_shed_but_count(spool, run_myq, tmp_path, myq):
    hd = _handlers(tmp_path, bad="exit 65")
    _budget(spool, "300K", bad="overflow=drop-oldest",
            tele="overflow=drop-oldest")
    dead = [_enqueue(spool, "bad")[1] for _ in range(10)]
    cp = worker(run_myq, spool, handlers=hd)
    assert cp.returncode == 0, cp.stderr
    assert sorted(_ids(spool, "dead")) == sorted(dead)
    before = _stats(spool)["used_bytes"]
    for _ in range(150):
        assert _enqueue(spool, "tele")[0] == 0
    assert sorted(_ids(spool, "dead")) == sorted(dead)
    assert before >= 10 * 3000
    kept = len(_waiting(spool, "tele"))
    while _enqueue(spool, "crit")[0] == 0:
        pass
    assert sorted(_ids(spool, "dead")) == sorted(dead)
    assert kept < 150 and _waiting(spool, "tele") == []


def test_never_more_than_one_job_over_the_budget(spool, myq):
    budget = 256 << 10
    _budget(spool, str(budget), tele="overflow=drop-oldest",
            low="overflow=drop-oldest priority=-3")
    one = _one_job(myq, spool)
    worst = 0
    for i in range(150):
        _enqueue(spool, ("tele", "low", "crit")[i % 3])
        used = _measured(myq, spool)
        worst = max(worst, used)
        assert used <= budget + one, (i, used, budget, one)
    st = _stats(spool)
    assert st["used_bytes"] <= budget + one
    assert worst > budget // 2         # (it did fill up)
    # the API's many jobs at once: the same bound
    sp = myq.open_store(spool)
    for _ in range(3):
        try:
            sp.enqueue_many([{"type": "tele", "payload": "y" * 3000}] * 5)
        except myq.SpoolFull:
            pass
        assert _measured(myq, spool) <= budget + one


def test_producers_at_once_stay_within_one_job(spool, myq):
    """Four producers enqueue at once (each its own Spool: its own
    descriptors and connection): they take the figure's lock in turn."""
    import threading
    budget = 256 << 10
    _budget(spool, str(budget), tele="overflow=drop-oldest")
    errors = []

    def produce():
        sp = myq.open_store(spool)
        try:
            for _ in range(40):
                sp.enqueue("tele", "x" * 3000)
        except Exception as e:          # (reported below)
            errors.append(e)
        finally:
            sp.close()
    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert _measured(myq, spool) <= budget + _one_job(myq, spool)
    st = _stats(spool)
    assert st["dropped_by"]["tele"]["budget"] == 160 - len(_waiting(spool))


def test_delivery_goes_on_at_100_percent(spool, run_myq, tmp_path, myq):
    hd = _handlers(tmp_path, crit="exit 0")
    _budget(spool, "264K")
    n = 0
    while _enqueue(spool, "crit")[0] == 0:
        n += 1
        assert n < 200
    assert n > 5
    full = _stats(spool)
    assert full["used_bytes"] > full["budget_bytes"] - 4 * _one_job(myq, spool)
    cp = worker(run_myq, spool, handlers=hd)
    assert cp.returncode == 0, cp.stderr
    assert len(_ids(spool, "done")) == n and _waiting(spool) == []
    # what the deliveries wrote (an SQLite log) stays within the bound too
    assert _measured(myq, spool) <= 264 * 1024 + _one_job(myq, spool)
    # done/ makes room at once for what comes next
    assert _enqueue(spool, "crit")[0] == 0
    assert _stats(spool)["types"]["crit"]["delivered_per_s"] > 0


def test_the_worker_sheds_what_came_past_the_producers(spool, run_myq, myq):
    """A shell producer's files (or a producer who may not write
    locks/used) are measured by the worker's walk and shed."""
    budget = 224 << 10
    _budget(spool, str(budget), tele="overflow=drop-oldest")
    for _ in range(5):
        assert _enqueue(spool, "tele")[0] == 0
    sp = myq.open_store(spool)
    sp.set_policy("@spool", {"budget": None})
    for _ in range(100):     # (on a tmpfs a directory takes no block: 80
        sp.enqueue("tele", "x" * 3000)      # were 420 KiB, ext4's 500 KiB)
    sp.set_policy("@spool", {"budget": budget})
    assert _measured(myq, spool) > 2 * budget
    sp = myq.open_store(spool)
    sp.upkeep_budget(time.monotonic())
    assert _measured(myq, spool) <= budget + _one_job(myq, spool)
    assert _stats(spool)["dropped_by"]["tele"]["budget"] > 30


def test_dropped_by_counts_per_type_and_reason(spool, run_myq, tmp_path, myq):
    hd = _handlers(tmp_path, old="exit 0")
    _budget(spool, "264K", tele="overflow=drop-oldest",
            few="overflow=drop-oldest max_queued=2 priority=1", old="ttl=1")
    for _ in range(5):
        assert _enqueue(spool, "few")[0] == 0
    jid = _enqueue(spool, "old", "--ttl", "0.05")[1]
    time.sleep(0.1)     # (its expiry passes: nothing to await)
    cp = worker(run_myq, spool, handlers=hd)
    assert cp.returncode == 0, cp.stderr
    assert jid in _ids(spool, "dead")
    for _ in range(80):
        assert _enqueue(spool, "tele")[0] == 0
    st = _stats(spool)
    shed = st["dropped_by"]["tele"]["budget"]
    assert shed == 80 - len(_waiting(spool, "tele")) and shed > 0
    assert st["dropped_by"]["few"] == {"overflow": 3}
    assert st["dropped_by"]["old"] == {"ttl": 1}
    assert st["dropped"] == shed + 3
    prom = _ok(spool, "stats", "--prometheus")
    assert 'myq_dropped_by_total{queue="spool",type="tele",reason="budget"} ' \
        '%d' % shed in prom
    assert 'type="few",reason="overflow"} 3' in prom


def _history(spool, type_, arrived, delivered, size, now=None):
    """A fake history in locks/rates: `arrived` jobs of `size` bytes and
    `delivered` jobs of `type_` spread over the last 10 minutes."""
    now = int(time.time() if now is None else now)
    with open(os.path.join(spool, "locks", "rates"), "a") as f:
        for i in range(60):
            t = now - 595 + i * 10
            f.write("%d a %s %d %d\n" % (t, type_, arrived // 60,
                                         arrived // 60 * size))
            f.write("%d d %s %d 0\n" % (t, type_, delivered // 60))


def test_capacity_fields_are_there_and_sane(spool, myq):
    budget = 4 << 20
    _budget(spool, str(budget))
    for _ in range(5):
        assert _enqueue(spool, "tele")[0] == 0
    assert _enqueue(spool, "idle")[0] == 0
    _history(spool, "tele", arrived=600, delivered=300, size=5000)
    st = _stats(spool)
    t = st["types"]["tele"]
    assert t["waiting"]["jobs"] == 5
    assert 5 * 3000 <= t["waiting"]["bytes"] <= 5 * 4000
    assert 0 <= t["oldest_s"] <= 60
    assert t["arrival_per_s"] == pytest.approx(1.0, abs=0.02)
    assert t["delivered_per_s"] == pytest.approx(0.5, abs=0.01)
    assert t["est_drain_s"] == 10             # 5 jobs at 300 in ~600 s
    assert st["types"]["idle"]["est_drain_s"] is None
    # deliveries that began a minute ago (an outage before): the drain at
    # their rate, not at the 10 minutes' average
    for _ in range(6):
        assert _enqueue(spool, "back")[0] == 0
    now = int(time.time())
    with open(os.path.join(spool, "locks", "rates"), "a") as f:
        for i in range(6):
            f.write("%d d back 10 0\n" % (now - 55 + i * 10))
    b = _stats(spool)["types"]["back"]
    assert b["delivered_per_s"] == pytest.approx(0.1)
    assert 4 <= b["est_drain_s"] <= 7
    assert st["types"]["idle"]["delivered_per_s"] == 0
    st = _stats(spool)
    assert st["budget_bytes"] == budget
    used = st["used_bytes"]
    assert 0 < used < budget
    # (an SQLite spool counts its log at least at its cap: a 32nd of it)
    du = _measured(myq, spool)
    assert du <= used <= du + budget // 32 * 1.03 + 3 * _one_job(myq, spool)
    rate = (600 * 5000 + 12 * _one_job(myq, spool)) / 600.0
    assert st["outage_capacity_s"] == pytest.approx((budget - used) / rate,
                                                    rel=0.05)
    line = _ok(spool, "stats").strip()
    assert " capacity_s=%d" % st["outage_capacity_s"] in line
    prom = _ok(spool, "stats", "--prometheus")
    for name in ("myq_budget_bytes", "myq_used_bytes",
                 "myq_outage_capacity_seconds", "myq_waiting_jobs",
                 "myq_waiting_bytes", "myq_oldest_waiting_seconds",
                 "myq_arrival_per_second", "myq_delivered_per_second",
                 "myq_est_drain_seconds"):
        assert "\n%s{" % name in prom, name
    assert 'myq_est_drain_seconds{queue="spool",type="tele"} 10' in prom
    # without a budget: the free space above --min-free
    _ok(spool, "policy", "--budget", "")
    st = _stats(spool)
    assert st["budget_bytes"] is None and st["used_bytes"] > 0
    assert st["outage_capacity_s"] > (budget - used) / rate
    # no arrivals at all: no forecast
    os.unlink(os.path.join(spool, "locks", "rates"))
    st = _stats(spool)
    assert st["outage_capacity_s"] is None
    assert " capacity_s=- " in _ok(spool, "stats").strip() + " "


def test_check_warns_when_the_outage_capacity_is_short(spool):
    _budget(spool, "1M")
    assert _enqueue(spool, "tele")[0] == 0
    _ok(spool, "check")                                 # no history: fine
    _history(spool, "tele", arrived=6000, delivered=0, size=4096)
    cp = _myq(spool, "check")                           # ~20 s of room
    assert cp.returncode == 1
    assert "outage capacity" in cp.stdout and "--warn-capacity" in cp.stdout
    _ok(spool, "check", "--warn-capacity", "1s")
    cp = _myq(spool, "check", "--warn-capacity", "10m")
    assert cp.returncode == 1
    assert _myq(spool, "check", "--warn-capacity", "soon").returncode == 64
