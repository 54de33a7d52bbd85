"""Live data first after an outage of hours (myq(1) "Live
data first", the uplink's budget): what the 3-hour outage's proof
(tests/soak/outage3h.py) found, each case made small.

1. A deep backlog on the file store is read a slice at a time (a pass of
   the scan); a live job that arrived meanwhile waited for the pass to
   reach it or end: minutes after 3 hours of readings (live p50 57 s, p99
   73 s after half an hour's).  The lane's live jobs were then looked
   for beside the pass; a live-first lane is now read by age, no pass
   (its oldest and its live jobs at each read: tests/test_backlog_order.py).
2. Under --uplink-rate, sends went in bursts each time the 10 s window
   emptied, and live runs queued behind backlog runs for the uplink: a
   live batch waited up to a window.  Sends are now paced at the rate, and
   a backlog's send waits behind live ones.
"""
import os
import threading

import pytest

import myq
from _core import call_myq
from _http import answer, http_servers  # noqa: F401 (a fixture)
from test_live import backlog


def _quiet():
    return myq.Log(stream=open(os.devnull, "w"))


def test_a_live_job_is_not_kept_behind_a_pass_over_a_deep_backlog(
        small_tmpfs, http_servers):
    """60 backlog jobs, a scan cache of 4 (the lane is deep: a pass reads
    it 4 at a time, as 100,000 jobs are read 2,048 at a time); a live job
    comes while the third backlog request is answered.  It goes within the
    next few requests, not after the pass (on tmpfs, as on any directory
    where a new name sorts before the pass's place, it went last)."""
    spool = os.path.join(small_tmpfs("16m"), "spool")
    myq.main(["--spool", spool, "init"])
    came = []

    def route(h):
        came.append(1)
        if len(came) == 3:
            myq.enqueue(spool, "tele", {"l": 0})
        answer(h)
    srv = http_servers(default=route)
    p = call_myq("--spool", spool, "policy", "tele", "url=" + srv.url("/in"),
                 "order=live-first")
    assert p.returncode == 0, p.stderr
    backlog(spool, 60)
    w = myq.Worker(spool, scan_cache=4, poll=0.05, concurrency=1, log=_quiet())
    w.run(drain=True)
    bodies = [r["body"] for r in srv.requests]
    assert len(bodies) == 61, bodies
    at = [i for i, b in enumerate(bodies) if b'"l"' in b][0]
    assert 3 <= at <= 8, (at, bodies)


def test_uplink_sends_are_paced_not_sent_in_bursts():
    """200 B/s over a 10 s window (2,000 B): five sends of 400 B go one
    every 2 s, not all five at once (a window's burst, then nothing for
    10 s).  A clock of our own: no sleep."""
    up = myq.Uplink(200.0, window=10.0)
    now = 1000.0
    assert up._delay(400, now) == 0.0
    assert up._delay(400, now + 0.1) == pytest.approx(1.9)
    assert up._delay(400, now + 2.0) == 0.0
    # the window holds too: after a long pause a send goes at once
    assert up._delay(400, now + 30.0) == 0.0


def test_a_backlog_send_waits_behind_a_live_one_for_the_uplink():
    """A backlog run waits for its turn; a live run that comes after it
    goes first; the backlog's turn comes after."""
    up = myq.Uplink(1000.0, window=1.0)
    up.wait(1000)                       # the window full: the next wait
    order, started = [], threading.Event()

    def send(name, later):
        started.set()
        up.wait(300, later=later)
        order.append(name)
    back = threading.Thread(target=send, args=("backlog", True))
    back.start()
    assert started.wait(5)
    with up._cond:                      # the backlog run waits its turn
        up._cond.wait_for(lambda: up._turns, 5)
    live = threading.Thread(target=send, args=("live", False))
    live.start()
    back.join(10)
    live.join(10)
    assert order == ["live", "backlog"]
