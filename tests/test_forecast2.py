"""The capacity forecast under the worker's --uplink-rate (myq-spool(5)
CAPACITY; the soak's forecast=off): est_drain_s is not the first burst
after an outage extrapolated when the cap allows less; the worker records
its cap (locks/uplink) and the bytes it sent by type (the d lines of
locks/rates); the first second's line is not counted in the rate; tenths
below 10 s; on both stores."""
import json
import os
import time

import pytest

from _core import call_myq, listed, policy
from _http import http_servers  # noqa: F401 (a fixture)
from test_forecast import _lines, _stats

pytestmark = pytest.mark.parametrize("store", ["files", "sqlite"],
                                     indirect=True)


def _outage(spool, type_, now):
    """95 s held (20 a second arrive, nothing delivered)."""
    _lines(spool, [(t, "a", type_, 20, 6000) for t in range(now - 100, now - 5)])


def test_the_drain_is_not_faster_than_the_uplink_rate_allows(spool, myq):
    for _ in range(300):
        myq.enqueue(spool, "up", "x")
    now = int(time.time())
    _outage(spool, "up", now)
    # the link back: a burst of 100 a second these last 4 s, 300 bytes
    # each on the uplink (the window's budget spent), 300 wait
    _lines(spool, [(t, "d", "up", 100, 30000) for t in range(now - 3, now + 1)])
    # no cap known: the burst's rate (100 a second after its first line)
    assert _stats(spool)["up"]["est_drain_s"] == 3.0
    # a worker's cap of 1000 bytes a second: 90,000 bytes take 90 s
    with open(os.path.join(spool, "locks", "uplink"), "w") as f:
        f.write("1000\n")
    assert 85 <= _stats(spool)["up"]["est_drain_s"] <= 95


def test_the_uplink_window_left_goes_at_once(spool, myq):
    for _ in range(30):
        myq.enqueue(spool, "up", "x")
    now = int(time.time())
    # 100 delivered before the outage (their 30,000 bytes out of the 10 s
    # window), then the last 4 s 10 a second at 10 bytes each: the
    # window's 100,000 bytes less 400 left; the 30 waiting (7,000 bytes at
    # the window's bytes a job) go within it
    _lines(spool, [(now - 200, "d", "up", 100, 30000)])
    _outage(spool, "up", now)
    _lines(spool, [(t, "d", "up", 10, 100) for t in range(now - 3, now + 1)])
    with open(os.path.join(spool, "locks", "uplink"), "w") as f:
        f.write("10000\n")
    e = _stats(spool)["up"]["est_drain_s"]
    assert 2 <= e <= 4, e           # the rate's (10 a second), not the cap's


def test_the_first_seconds_line_is_not_in_the_rate(spool, myq):
    for _ in range(100):
        myq.enqueue(spool, "back", "x")
    now = int(time.time())
    _outage(spool, "back", now)
    # the probe's one job, then 50 a second: 100 waiting take 2 s, not
    # 100 x 4 / 151 (the old figure, whole seconds: 3)
    _lines(spool, [(now - 3, "d", "back", 1, 0)])
    # (the probe's line alone, then the first batches: no rate yet, not
    # 100 x 1 / 1 or 100 x 3 / 101)
    assert _stats(spool)["back"]["est_drain_s"] is None
    _lines(spool, [(now - 2, "d", "back", 50, 0), (now - 1, "d", "back", 50, 0)])
    assert _stats(spool)["back"]["est_drain_s"] is None
    _lines(spool, [(now, "d", "back", 50, 0)])
    assert _stats(spool)["back"]["est_drain_s"] == 2.0


def test_a_worker_records_its_cap_and_the_bytes_it_sent(spool, http_servers, myq):
    s = http_servers()
    policy(spool, "up", "url=" + s.url("/up"))
    for i in range(3):
        call_myq("--spool", spool, "enqueue", "up", json.dumps("x" * 90))
    w = myq.Worker(spool, uplink_rate=myq.parse_uplink("64K/s"), poll=0.05,
                   timeout=5, log=myq.Log(stream=open(os.devnull, "w")))
    w.run(drain=True)
    assert len(listed(spool, "done")) == 3
    with open(os.path.join(spool, "locks", "uplink")) as f:
        assert f.read() == "65536\n"
    sent = [l.split() for l in open(os.path.join(spool, "locks", "rates"))
            if l.split()[1:3] == ["d", "up"]]
    assert sum(int(f[3]) for f in sent) == 3
    assert sum(int(f[4]) for f in sent) == 3 * 90       # (sent as text)
    # a worker without a cap removes it
    myq.Worker(spool, poll=0.05, log=myq.Log(stream=open(os.devnull, "w"))
               ).run(drain=True)
    assert not os.path.exists(os.path.join(spool, "locks", "uplink"))
