"""The capacity forecast after an outage (myq-spool(5)
CAPACITY): est_drain_s counts the deliveries since they restarted after a
job waited DRAIN_GAP seconds with nothing delivered, not the window's
average with the outage's silence in it; a type delivered now and then
without waiting is not "restarted" at each delivery; on both stores."""
import json
import os
import time

import pytest

from _core import call_myq

pytestmark = pytest.mark.parametrize("store", ["files", "sqlite"],
                                     indirect=True)


def _stats(spool):
    cp = call_myq("--spool", spool, "stats", "--json")
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)["types"]


def _lines(spool, lines):
    with open(os.path.join(spool, "locks", "rates"), "a") as f:
        f.write("".join("%d %s %s %d %d\n" % l for l in lines))


def test_the_drain_after_an_outage_is_at_the_rate_since_it_restarted(spool, myq):
    now = int(time.time())
    # 1 a second delivered for 300 s, then 95 s held (20 a second arrive,
    # nothing delivered), then 20 a second delivered these last 5 s
    _lines(spool, [(t, k, "back", n, n * 400 if k == "a" else 0)
                   for t in range(now - 400, now - 100) for k, n in (("a", 1), ("d", 1))])
    _lines(spool, [(t, "a", "back", 20, 8000) for t in range(now - 100, now - 5)])
    _lines(spool, [(t, "d", "back", 20, 0) for t in range(now - 5, now)])
    for _ in range(40):
        myq.enqueue(spool, "back", "x")
    b = _stats(spool)["back"]
    assert b["waiting"]["jobs"] == 40
    # 40 at 20 a second (the window's average, ~1 a second, would say 40)
    assert 1 <= b["est_drain_s"] <= 3, b


def test_a_type_delivered_now_and_then_keeps_its_rate(spool, myq):
    now = int(time.time())
    # one job a minute, each delivered a second after it came
    _lines(spool, [l for i in range(10) for l in (
        (now - 590 + 60 * i, "a", "few", 1, 400),
        (now - 589 + 60 * i, "d", "few", 1, 0))])
    myq.enqueue(spool, "few", "x")
    f = _stats(spool)["few"]
    assert f["waiting"]["jobs"] == 1
    assert 50 <= f["est_drain_s"] <= 70, f          # a job a minute
