"""The RAM parts' checker can fail (no VM, no root): the loss bound's
classification (ramcheck.py), doubles and corrupt deliveries, the run
that proved nothing, the receiver's link states against myq's own http
handler, and the part's line and exit status (powercut.report_ram)."""
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pytest  # noqa: E402

import powercut  # noqa: E402
import ramcheck  # noqa: E402
import receiver  # noqa: E402
import replay  # noqa: E402

MYQ = os.path.join(os.path.dirname(os.path.dirname(HERE)), "myq.py")
D = ramcheck.Delivery
S, MARGIN = 2.0, 1.0


def _payload(n):
    blob = "%x" % (n * 7919 + 12345)
    return {"n": n, "blob": blob,
            "sum": hashlib.sha256(blob.encode()).hexdigest()[:16]}


def _ledger(jobs):
    """jobs: {id: (ret, durable)}; each promised with its own payload's sum."""
    led = ramcheck.Ledger()
    for n, (jid, (ret, durable)) in enumerate(sorted(jobs.items())):
        led.promise(jid, _payload(n)["sum"], ret, durable)
    return led


# the bound ----------------------------------------------------------------

def test_a_lost_job_promised_long_before_the_cut_is_beyond_the_bound():
    led = _ledger({"old": (100.0, "outage")})
    res = ramcheck.classify(["old"], led.promised, cut=110.0, bound=S, margin=MARGIN)
    assert res["lost_beyond_bound"] == 1 and res["beyond"] == ["old"]
    assert res["lost_within_bound"] == 0 and res["ages"]["old"] == 10.0


def test_a_lost_job_promised_within_spill_after_is_within_the_bound():
    led = _ledger({"new": (109.0, "outage"), "edge": (107.0, "outage")})
    res = ramcheck.classify(["new", "edge"], led.promised, cut=110.0, bound=S,
                            margin=MARGIN)
    # 3.0 s = spill_after + margin exactly: still within (beyond is "more than")
    assert res["lost_within_bound"] == 2 and res["lost_beyond_bound"] == 0


def test_just_past_the_margin_is_beyond():
    led = _ledger({"j": (106.99, "outage")})
    res = ramcheck.classify(["j"], led.promised, cut=110.0, bound=S, margin=MARGIN)
    assert res["beyond"] == ["j"]


def test_a_lost_durable_always_job_is_beyond_the_bound_however_new():
    led = _ledger({"a": (109.9, "always")})
    res = ramcheck.classify(["a"], led.promised, cut=110.0, bound=S, margin=MARGIN)
    assert res["lost_beyond_bound"] == 1


def test_delivered_or_spooled_or_redelivered_jobs_are_not_lost():
    led = _ledger({"got": (100.0, "outage"), "spooled": (100.0, "outage"),
                   "again": (100.0, "outage"), "gone": (100.0, "outage"),
                   "later": (111.0, "outage")})
    led.add([D(0, 100.5, "got", led.promised["got"][0], "ok")])
    # the recovery did not find got (delivered from RAM: not in the spool),
    # again (delivered from the spool during recovery), gone, later (after
    # the cut: not promised then)
    not_in_spool = ["got", "again", "gone", "later"]
    lost = ramcheck.lost_after(led, 0, 110.0, not_in_spool, redelivered=["again"])
    assert lost == ["gone"]
    res = ramcheck.classify(lost, led.promised, 110.0, S, MARGIN)
    assert res["lost_beyond_bound"] == 1        # 10 s old: the bound broken


def test_a_delivery_after_the_cut_epoch_does_not_count_as_before_it():
    led = _ledger({"j": (100.0, "outage")})
    led.add([D(1, 120.0, "j", led.promised["j"][0], "ok")])
    assert "j" in led.outstanding(0, 110.0)
    assert "j" not in led.outstanding(1, 130.0)


# doubles and corrupt deliveries ---------------------------------------------

def test_twice_in_one_epoch_is_doubled_across_a_cut_is_not():
    led = _ledger({"j": (1.0, "outage"), "k": (1.0, "outage")})
    sj, sk = led.promised["j"][0], led.promised["k"][0]
    assert led.add([D(0, 2, "j", sj, "ok"), D(1, 3, "j", sj, "ok")]) == (0, 0)
    assert led.add([D(1, 4, "k", sk, "ok"), D(1, 5, "k", sk, "ok")]) == (1, 0)
    assert led.doubled_ids == ["k"]


def test_a_bad_payload_or_another_sum_is_corrupt():
    led = _ledger({"j": (1.0, "outage"), "k": (1.0, "outage")})
    assert led.add([D(0, 2, "j", led.promised["j"][0], "bad"),
                    D(0, 2, "k", "0" * 16, "ok")]) == (0, 2)
    assert sorted(led.corrupt_ids) == ["j", "k"]


def test_an_id_promised_twice_is_counted():
    led = _ledger({"j": (1.0, "outage")})
    led.promise("j", "x", 2.0)
    led.promise("k", "y", 2.0)
    led.forget("k")
    led.promise("k", "z", 3.0)
    assert led.reused == ["j", "k"]


def test_the_receivers_log_is_read_whole_lines_only(tmp_path):
    p = tmp_path / "log"
    p.write_text("0 1.5 a s ok\n1 2.5 b s bad\n2 3.")
    got, off = ramcheck.read_deliveries(str(p))
    assert [d.id for d in got] == ["a", "b"] and got[1].verdict == "bad"
    with open(str(p), "a") as f:
        f.write("5 c s ok\n")
    more, _ = ramcheck.read_deliveries(str(p), off)
    assert more == [D(2, 3.5, "c", "s", "ok")]


# a run that proved nothing fails ----------------------------------------------

GOOD = dict(cuts=200, rounds=200, lost_beyond_bound=0, lost_within_bound=37,
            doubled=0, corrupt=0, stuck=0, in_failed=0, recover=0, fsck=0,
            ram_seen=500, spooled=80, down_rounds=150, empty_rounds=0,
            not_tmpfs=0)


def test_a_clean_run_passes():
    assert ramcheck.problems(GOOD, 200) == []


@pytest.mark.parametrize("change, says", [
    ({"lost_beyond_bound": 1}, "lost_beyond_bound=1"),
    ({"doubled": 2}, "doubled=2"),
    ({"corrupt": 1}, "corrupt=1"),
    ({"cuts": 150}, "fewer than the 200"),
    ({"ram_seen": 0}, "RAM tier"),
    ({"not_tmpfs": 3}, "not on a tmpfs"),
    ({"empty_rounds": 1}, "produced no job"),
    ({"spooled": 0}, "spill was never exercised"),
    ({"down_rounds": 0}, "never down"),
    ({"bound_wrong": "ram_bound_s=10"}, "did not state the bound"),
    ({"producer_errors": 2}, "enqueues failed"),
    ({"reused_ids": 1}, "given to two jobs"),
])
def test_a_run_that_broke_the_bound_or_checked_nothing_fails(change, says):
    wrong = ramcheck.problems(dict(GOOD, **change), 200)
    assert any(says in w for w in wrong), wrong


def _result(**totals):
    return {"stage": "end", "totals": dict(GOOD, **totals), "kinds": {"timed": 100},
            "modes": {"up": 50}, "max_cut_lag_s": 0.2, "vm_seconds": 300,
            "cpu_seconds": 290}


def _report(capsys, results):
    class A(object):
        ram_cuts = 200
    t = powercut.report_ram(A(), results, fs="ext4")
    return t, capsys.readouterr().out


def test_the_parts_line_and_exit_status(capsys):
    t, out = _report(capsys, [_result(cuts=100), _result(cuts=100)])
    line = [l for l in out.splitlines() if l.startswith("powercut: fs=ext4-ram ")]
    assert line and line[0].startswith(
        "powercut: fs=ext4-ram cuts=200 lost_beyond_bound=0 "
        "lost_within_bound=74 doubled=0 corrupt=0 ")
    assert not any(t.get(k) for k in replay.BAD)       # exit 0
    t, out = _report(capsys, [_result(cuts=100, lost_beyond_bound=1),
                              _result(cuts=100)])
    assert "lost_beyond_bound=1 " in out and "FAILED" in out
    assert any(t.get(k) for k in replay.BAD)           # exit 1
    # ci's grep of a broken promise sees it
    import re
    ci = open(os.path.join(os.path.dirname(os.path.dirname(HERE)), ".ci", "run")).read()
    pat = re.search(r"grep -Eq '(\^powercut: fs=[^']+)'", ci).group(1)
    assert [l for l in out.splitlines() if re.search(pat, l)]


def test_a_part_with_no_job_in_ram_fails_loudly(capsys):
    t, out = _report(capsys, [_result(cuts=100, ram_seen=0), _result(cuts=100, ram_seen=0)])
    assert "FAILED" in out and "RAM tier" in out
    assert any(t.get(k) for k in replay.BAD)


# the receiver, against myq's own http handler ----------------------------------

def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def link(tmp_path):
    """(set(mode, epoch), port, log path): a receiver.py in a thread."""
    ctl, log = str(tmp_path / "ctl.json"), str(tmp_path / "deliveries")
    port = _free_port()

    def set_(mode, epoch=0, period=0.5, stall=3.0):
        with open(ctl + ".tmp", "w") as f:
            json.dump({"epoch": epoch, "mode": mode, "period": period,
                       "stall": stall, "t0": time.monotonic()}, f)
        os.rename(ctl + ".tmp", ctl)
    set_("up")
    stop = threading.Event()
    out = open(log, "a")
    th = threading.Thread(target=receiver.serve, args=(port, receiver.Control(ctl),
                                                       out, stop), daemon=True)
    th.start()
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            break
        except OSError:
            time.sleep(0.05)
    yield set_, port, log
    stop.set()
    th.join(5)
    out.close()


def _myq(spool, *args):
    return subprocess.run([sys.executable, MYQ, "--spool", spool] + list(args),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=60)


def test_the_receiver_takes_jobs_only_while_the_link_is_up(link, tmp_path):
    set_, port, log = link
    got = {}
    # a spool each (a destination that failed is held for a while)
    for n, (mode, said) in enumerate((("down", "http 503"),
                                      ("unreachable", "Connection refused"),
                                      ("up", "event=done"))):
        spool = str(tmp_path / mode)
        assert _myq(spool, "init").returncode == 0
        assert _myq(spool, "policy", "tel",
                    "url=http://127.0.0.1:%d/" % port).returncode == 0
        p = _payload(n)
        jid = _myq(spool, "enqueue", "tel", json.dumps(p)).stdout.decode().split()[-1]
        got[mode] = (jid, p["sum"])
        set_(mode, epoch=n)
        time.sleep(0.2)         # (the receiver's loop sees the file)
        out = _myq(spool, "worker", "--drain").stdout.decode()
        assert said in out
    delivered = ramcheck.read_deliveries(log)[0]
    assert [(d.epoch, d.id, d.sum, d.verdict) for d in delivered] == [
        (2, got["up"][0], got["up"][1], "ok")]


def test_a_stalled_link_answers_late_and_has_the_job(link):
    """stall: 200, but late (nothing fails: only spill_after moves what
    waits behind it); the delivery is booked in the epoch it came in."""
    import urllib.request
    set_, port, log = link
    set_("stall", epoch=4, stall=0.6)
    time.sleep(0.2)
    p = _payload(5)
    req = urllib.request.Request("http://127.0.0.1:%d/" % port,
                                 data=json.dumps(p).encode(),
                                 headers={"Idempotency-Key": "j5"})
    t = time.monotonic()
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
    assert time.monotonic() - t >= 0.6
    got = ramcheck.read_deliveries(log)[0]
    assert [(d.epoch, d.id, d.verdict) for d in got] == [(4, "j5", "ok")]


def test_flapping_goes_through_up_down_up_unreachable_up_stall():
    ctl = {"mode": "flap", "period": 1.0, "t0": 100.0}
    assert [receiver.mode_at(ctl, 100.0 + k + 0.5) for k in range(7)] == [
        "up", "down", "up", "unreachable", "up", "stall", "up"]


def test_a_tampered_body_is_bad():
    p = _payload(3)
    assert receiver.verdict(json.dumps(p).encode()) == (p["sum"], "ok")
    p["blob"] += "0"
    assert receiver.verdict(json.dumps(p).encode())[1] == "bad"
    assert receiver.verdict(b"{not json")[1] == "bad"


def test_a_job_waiting_in_its_lane_is_in_the_spool(tmp_path):
    """A type with a policy waits in incoming/lanes/TYPE@P/ (where a spill
    puts a durable=outage job): the checker finds it there, not lost."""
    import check
    spool = str(tmp_path / "spool")
    assert _myq(spool, "init").returncode == 0
    # nothing listens there: the recovery's drain leaves the job waiting
    assert _myq(spool, "policy", "tel", "url=http://127.0.0.1:%d/"
                % _free_port()).returncode == 0
    p = _payload(9)
    jid = _myq(spool, "enqueue", "tel", json.dumps(p)).stdout.decode().split()[-1]
    # where the RAM tier's spill puts it (seen: incoming/lanes/tel@0/ID.json)
    lane = os.path.join(spool, "incoming", "lanes", "tel@0")
    os.makedirs(lane, exist_ok=True)
    os.rename(os.path.join(spool, "incoming", jid + ".json"),
              os.path.join(lane, jid + ".json"))
    where = check.scan(spool, check._myq(MYQ))[0]
    assert [(s, n) for s, n, _ in where[jid]] == [
        ("incoming", "lanes/tel@0/%s.json" % jid)]
    res = check.recover_and_check(spool, {jid: p["sum"]}, MYQ, str(tmp_path),
                                  fork=True)
    assert (res["lost"], res["corrupt"], res["doubled"]) == (0, 0, 0), res["notes"]


def test_a_round_check_counts_an_old_lost_job_beyond_the_bound(tmp_path):
    """ram_guest's check after a cut, on a spool made by hand (no VM, no
    RAM tier: a fake of what a cut leaves): a job in the spool is not
    lost, a delivered one is not, one promised 10 s before the cut and
    found nowhere is beyond the bound, one promised 0.5 s before is
    within, and a lost job is counted once."""
    import argparse
    import ram_guest
    a = argparse.Namespace(fs="ext4", myq=MYQ, out=str(tmp_path), seed=1,
                           spill_after=S, margin=MARGIN)
    run = ram_guest.RamRun(a)
    run.spool = str(tmp_path / "spool")
    run.deliveries = str(tmp_path / "deliveries")
    assert _myq(run.spool, "init").returncode == 0
    import myq
    cut = time.monotonic()
    p = _payload(1)
    kept = myq.open_store(run.spool).enqueue("ok", p)
    led = run.ledger
    led.promise(kept, p["sum"], cut - 30, "outage")     # in the spool
    led.promise("sent", _payload(2)["sum"], cut - 30, "outage")
    led.promise("old", _payload(3)["sum"], cut - 10, "outage")
    led.promise("new", _payload(4)["sum"], cut - 0.5, "outage")
    with open(run.deliveries, "w") as f:
        f.write("0 %.6f sent %s ok\n" % (cut - 20, _payload(2)["sum"]))
    run.epoch = 1                   # (the reboot that ended epoch 0)
    run.check(0, cut, "down", "timed", 0, str(tmp_path))
    t = run.totals
    assert (t["lost_beyond_bound"], t["lost_within_bound"]) == (1, 1), run.found
    assert run.found[0]["beyond"] == [("old", 10.0)]
    assert (t["doubled"], t["corrupt"], t["recover"]) == (0, 0, 0)
    # a file of a promised job, all NUL (a spill cut short): corrupt, by id
    with open(os.path.join(run.spool, "incoming", "spilled.json"), "wb") as f:
        f.write(b"\0" * 64)
    led.promise("spilled", _payload(5)["sum"], cut - 1, "outage")
    run.epoch = 2
    run.check(1, cut + 1, "up", "timed", 0, str(tmp_path))
    run.save("cuts")
    assert (t["corrupt"], t["corrupt_ids"]) == (1, 1)
    assert " corrupt_ids=1" in ramcheck.summary("ext4-ram", t)
    os.unlink(os.path.join(run.spool, "incoming", "spilled.json"))
    led.forget("spilled")
    run.epoch = 3
    run.check(2, cut + 5, "up", "timed", 0, str(tmp_path))
    assert (t["lost_beyond_bound"], t["lost_within_bound"]) == (1, 1)


def test_a_job_found_finished_is_settled_one_waiting_is_not(tmp_path):
    """A promised job the recovery finished (done) is settled: not looked
    for after the next cut; one still waiting in the spool is.  Reading
    only the promised ones' files, the checker still finds a promised
    job's bad file (corrupt) and a promised job in two places (doubled)."""
    import check
    spool = str(tmp_path / "spool")
    assert _myq(spool, "init").returncode == 0
    assert _myq(spool, "policy", "tel", "url=http://127.0.0.1:%d/"
                % _free_port()).returncode == 0
    p, q, r = _payload(1), _payload(2), _payload(3)
    done = _myq(spool, "enqueue", "ok", json.dumps(p)).stdout.decode().split()[-1]
    wait = _myq(spool, "enqueue", "tel", json.dumps(q)).stdout.decode().split()[-1]
    promised = {done: p["sum"], wait: q["sum"]}
    res = check.recover_and_check(spool, promised, MYQ, str(tmp_path),
                                  fork=True, only_promised=True)
    assert res["finished"] == [done], res["notes"]
    assert (res["lost"], res["corrupt"], res["doubled"]) == (0, 0, 0), res["notes"]
    led = ramcheck.Ledger()
    led.promise(done, p["sum"], 1.0, "always")
    led.promise(wait, q["sum"], 1.0, "outage")
    for jid in res["finished"]:
        led.settle(jid)
    assert set(led.outstanding(0, 2.0)) == {wait}
    # a promised job's bad file, and one in two places: still seen
    bad = _myq(spool, "enqueue", "tel", json.dumps(r)).stdout.decode().split()[-1]
    with open(os.path.join(spool, "incoming", bad + ".json"), "wb") as f:
        f.write(b'{"id": "%s", "type": "tel", "payload": {"n": 3}}' % bad.encode())
    with open(os.path.join(spool, "done", wait + ".json"), "w") as f:
        json.dump({"id": wait, "type": "tel", "payload": q}, f)
    res = check.recover_and_check(spool, {wait: q["sum"], bad: r["sum"]}, MYQ,
                                  str(tmp_path), fork=True, only_promised=True)
    assert res["ids"]["corrupt"] == [bad], res["notes"]
    assert res["ids"]["doubled"] == [wait], res["notes"]
