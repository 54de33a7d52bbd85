"""The RAM tier's moves against power cuts and slow workers (myq(1) RAM
FIRST; the power cuts' ubifs-ram part found each under TCG): a job waits
in RAM at most its spill_after whatever else the worker is doing between
its runs, and whatever a type's first job costs; a job moved to the spool
is never seen there before its bytes are durable.  Both stores (the
`spool` fixture)."""
import calendar
import json
import os
import subprocess
import sys
import time

import pytest

from _core import (FAST, ROOT, clean_env, cli, ok, stop, wait_for, listed,
                   listening)

HANDLER = r'''
import os
def tele(job):
    if os.path.exists(os.environ["RAM_TEST_OUT"] + ".fail"):
        raise RuntimeError("the link is down")
def idle(job):
    pass
'''

# A worker of myq.py made slow where a slow device is: `resolve`, the
# first resolve of type tele takes 3 s (an http type's first job imports
# http.client and its email parser: ~1 s on a router, 0.3-0.9 s under
# TCG); `finish`, every run's end takes 50 ms (a claim and a finish on a
# loaded flash).
WORKER = r'''
import sys, time
sys.path.insert(0, %r)
import myq
if sys.argv[1] == "resolve":
    real = myq._Resolver.resolve
    first = set(["tele"])
    def resolve(self, type, rules=None):
        if type in first:
            first.discard(type)
            time.sleep(3)
        return real(self, type, rules)
    myq._Resolver.resolve = resolve
else:
    real = myq._Finishing._finish
    def _finish(self, run, *args, **kw):
        time.sleep(0.05)
        return real(self, run, *args, **kw)
    myq._Finishing._finish = _finish
sys.exit(myq.main(sys.argv[2:]))
''' % ROOT



def _slow_worker(spool, ram, tmp_path, how):
    """Types tele (durable=outage, spill_after 1h: its jobs run) and idle
    (durable=outage, spill_after 2s, paused: its job waits, then moves),
    a worker made slow as `how` says; (process, its log)."""
    mod = tmp_path / "h.py"
    mod.write_text(HANDLER)
    ok(cli(spool, "init", "--ram", ram))
    ok(cli(spool, "policy", "tele", "durable=outage", "spill_after=1h"))
    ok(cli(spool, "policy", "idle", "durable=outage", "spill_after=2s"))
    ok(cli(spool, "pause", "idle"))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    log = str(tmp_path / "worker.log")
    proc = subprocess.Popen(
        [sys.executable, str(script), how, "--spool", spool, "worker",
         "--module", str(mod), "--log", log] + list(FAST),
        env=clean_env({"RAM_TEST_OUT": str(tmp_path / "out")}),
        stdout=subprocess.DEVNULL, stderr=open(str(tmp_path / "err"), "ab"),
        start_new_session=True)
    wait_for(lambda: os.path.isdir(os.path.join(ram, "incoming"))
             and listening(spool), what="the worker listening")
    return proc, log


def _in_spool(spool, jid):
    return any(r["id"] == jid and r.get("tier") != "ram"
               for st in ("ready", "scheduled", "held")
               for r in listed(spool, st))


def _first_move(log):
    """The wall time of the log's first event=moved (said after the move)."""
    wait_for(lambda: any("event=moved" in l for l in open(log)),
             what="the move's log line")
    line = [l for l in open(log) if "event=moved" in l][0]
    stamp = line.split()[0]
    return calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) \
        + float("0" + stamp[19:-1])


def _moved_in_time(spool, log, jid):
    wait_for(lambda: _in_spool(spool, jid), timeout=20, what="the spill")
    made = json.loads(ok(cli(spool, "show", jid)).stdout)["created_at"]
    return _first_move(log) - made


def test_a_first_job_slow_to_resolve_keeps_no_job_past_its_bound(
        spool, ram, tmp_path):
    """The handlers of the RAM tier's types are resolved before the worker
    listens: a type's first job that took the worker seconds (an http
    type's modules imported) kept the jobs that came with it in RAM past
    their spill_after (ubifs-ram: 3 jobs lost 3.23 s old, bound 2 s)."""
    proc, log = _slow_worker(spool, ram, tmp_path, "resolve")
    try:
        sp = __import__("myq").open_store(spool)
        idle, tele = sp.enqueue_many([{"type": "idle", "payload": 1},
                                      {"type": "tele", "payload": 2}])
        sp.close()
        assert _moved_in_time(spool, log, idle) < 2.0
    finally:
        stop(proc)


def test_runs_back_to_back_keep_no_job_past_its_bound(spool, ram, tmp_path):
    """A worker that claims and runs job after job (each failing: nothing
    to commit) takes the store's turn when it is due, between two runs: a
    flood of failures kept a waiting job in RAM until the flood was over."""
    open(str(tmp_path / "out.fail"), "w").close()
    proc, log = _slow_worker(spool, ram, tmp_path, "finish")
    try:
        sp = __import__("myq").open_store(spool)
        ids = sp.enqueue_many([{"type": "idle", "payload": 0}] + [
            {"type": "tele", "payload": n} for n in range(120)])
        sp.close()
        assert _moved_in_time(spool, log, ids[0]) < 2.0
    finally:
        stop(proc)


@pytest.mark.parametrize("way", ["unnamed", "tmp"])
@pytest.mark.parametrize("n", [1, 5])
def test_a_move_names_no_job_before_its_bytes_are_durable(
        spool, ram, tmp_path, monkeypatch, way, n):
    """A RAM job moved to the spool gets its name there only after its
    file's fsync: a power cut then leaves it whole or absent.  Named first
    (a batched enqueue's order: link, then fsync), UBIFS kept the name and
    the length of files whose bytes it had not written (the ubifs-ram
    part: 614 NUL bytes where a job was, its RAM copy gone with the same
    cut).  O_TMPFILE's way and tmp/'s, one job and a batch (explicit ids
    among them: a link, not a rename)."""
    import myq
    if way == "tmp":
        monkeypatch.setattr(myq, "_TMPFILE", 0)
    elif not getattr(myq, "_TMPFILE", 0):
        pytest.skip("O_TMPFILE is refused here")
    ok(cli(spool, "init", "--ram", ram))
    ok(cli(spool, "policy", "tele", "durable=outage"))
    store = myq.open_store(spool)
    store.ram.make()
    ids = store.ram.enqueue_many([
        dict({"type": "tele", "payload": {"n": i}}, **({"id": "x-%d" % i}
                                                       if i % 2 else {}))
        for i in range(n)], False)
    steps = []
    monkeypatch.setattr(myq, "_hook", lambda op, path, when: steps.append(
        (op, path, when)))
    store.ram.spill(final=True)
    monkeypatch.setattr(myq, "_hook", None)
    store.close()
    assert all(_in_spool(spool, jid) for jid in ids)
    synced = set()
    for op, path, when in steps:
        if not path.startswith(spool + "/") or not path.endswith(".json"):
            continue                    # (the RAM tier's own steps)
        if op == "fsync" and when == "after":
            synced.add(path)
        elif op in ("link", "rename") and when == "before" and \
                os.path.basename(path)[:-5] in ids:
            assert path in synced, "%s named before its fsync" % path
