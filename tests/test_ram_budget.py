"""The spool's budget counts what its RAM tier holds: each job there must
find room in the spool when it moves (a failure, spill_after, a stop), so
the tier takes a job only within what the budget leaves it, and past that
the spool sheds or refuses as for any job; `stats` counts both.  Both
stores (the `spool` fixture)."""
import json

import myq
from _core import cli, ok, stats
from test_ram import Tier

PAYLOAD = {"x": "y" * 3000}         # a block a job, where it is counted


def _budget_for(spool, jobs):
    """A budget with room for about `jobs` more jobs of PAYLOAD (and the
    budget's two spare blocks) above what the spool uses now."""
    used = stats(spool)["used_bytes"]
    one = myq.open_store(spool).budget.cost(len(json.dumps(PAYLOAD)) + 300)
    ok(cli(spool, "policy", "--budget", "%dK" % (
        (used + one * jobs + 2 * 4096) // 1024)))


def test_the_ram_tier_takes_jobs_only_within_the_budget(spool, ram, tmp_path):
    t = Tier(spool, ram, tmp_path, overflow="reject")
    ok(cli(spool, "policy", "alarm", "overflow=reject"))
    ok(cli(spool, "pause", "tele"))         # they wait, in RAM (spill_after 1h)
    t.start()
    try:
        _budget_for(spool, 6)
        took, refused = [], 0
        for i in range(30):
            cp = cli(spool, "enqueue", "tele", json.dumps(dict(PAYLOAD, n=i)))
            if cp.returncode == 75:
                refused += 1
                assert "budget" in cp.stderr, cp.stderr
                continue
            ok(cp)
            took.append(cp.stdout.strip())
        # what was taken is in RAM, not on the flash: the budget held it all
        assert refused and 3 <= len(took) <= 8, (len(took), refused)
        assert sorted(took) == t.in_ram() and t.in_spool() == []
        # a durable type finds the budget full too: RAM's jobs count
        cp = cli(spool, "enqueue", "alarm", json.dumps(PAYLOAD))
        assert cp.returncode == 75 and "budget" in cp.stderr, cp
        s = stats(spool)
        assert s["used_bytes"] <= s["budget_bytes"]
    finally:
        t.stop()
    # every job the tier held found its room in the spool at the stop
    assert t.in_ram() == [] and sorted(t.in_spool()) == sorted(took)


def test_what_the_tier_drops_is_counted_with_the_spool(spool, ram, tmp_path):
    t = Tier(spool, ram, tmp_path, overflow="drop-oldest", max_queued="2")
    ok(cli(spool, "pause", "tele"))
    t.start()
    try:
        ids = [ok(cli(spool, "enqueue", "tele", json.dumps({"n": i}))
                  ).stdout.strip() for i in range(5)]
        assert t.in_ram() == sorted(ids[3:]) and t.in_spool() == []
        s = stats(spool)
        assert s["dropped"] == 3
        assert s["dropped_by"] == {"tele": {"overflow": 3}}
    finally:
        t.stop()
