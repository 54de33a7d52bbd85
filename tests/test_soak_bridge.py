"""The bridge soak's counting (tests/soak/bridge.py): what it
calls accepted, lost and doubled, per side, from its producer's and its
subscriber's logs, and that a run with nothing to count is no pass.  The
soak itself (root, network namespaces, two real brokers) is `make
soak-bridge`; here only its arithmetic, on logs written by the test."""
import argparse
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak"))
import bridge  # noqa: E402

RUN = "abc123"
T_DOWN, T_UP = 1000.0, 1045.0


def _bridge(tmp_path, prod, sub, faults=()):
    b = bridge.Bridge(argparse.Namespace(dir=str(tmp_path), keep=False))
    b.nonce, b.dir, b.t0, b.t_down, b.t_up = RUN, str(tmp_path), 900.0, T_DOWN, T_UP
    b.myq_sha, b.link_desc = "x", "y"
    b.prod_log = str(tmp_path / "producer.jsonl")
    b.sub_log = str(tmp_path / "subscriber.jsonl")
    b.evf = open(str(tmp_path / "events.jsonl"), "a")
    b.intake_start_cpu = 0.0
    with open(b.prod_log, "w") as f:
        for r in [{"ev": "start", "run": RUN}] + list(prod):
            f.write(json.dumps(r) + "\n")
    with open(b.sub_log, "w") as f:
        for r in sub:
            f.write(json.dumps(r) + "\n")
    b.faults = [dict(f) for f in faults]
    return b


def acc(side, n, t):
    return {"ev": "acc", "side": side, "rid": "%s-%07d" % (RUN, n), "t": t}


def msg(side, n, t, run=RUN):
    return {"ev": "msg", "topic": "soak/%s/%s/s0" % (RUN, side), "rid": "%s-%07d" % (RUN, n),
            "run": run, "t": t}


def test_lost_is_per_side_and_not_hidden_by_the_other_side(tmp_path):
    prod = [acc(s, n, 990.0 + n) for s in ("myq", "bridge") for n in range(3)]
    # the bridge side delivers 0 and 1; reading 2 reached upstream only by myq
    sub = [msg("myq", n, 995.0 + n) for n in range(3)] + [msg("bridge", n, 995.0 + n)
                                                          for n in range(2)]
    b = _bridge(tmp_path, prod, sub)
    for r in bridge._recs(b.prod_log) + bridge._recs(b.sub_log):
        b.record(r)
    m, br = b.side_counts("myq"), b.side_counts("bridge")
    assert (m["accepted"], m["delivered"], m["lost"]) == (3, 3, [])
    assert (br["accepted"], br["delivered"]) == (3, 2)
    assert br["lost"] == ["%s-0000002" % RUN]


def test_a_duplicate_is_explained_only_by_a_fault_that_had_it_in_flight(tmp_path):
    rid = "%s-%07d" % (RUN, 0)
    prod = [acc("myq", 0, 990.0), acc("myq", 1, 990.1)]
    sub = [msg("myq", 0, 995.0), msg("myq", 0, 1050.0),     # across the cut, in flight
           msg("myq", 1, 995.0), msg("myq", 1, 996.0)]      # twice, nothing between
    b = _bridge(tmp_path, prod, sub, [{"kind": "link_down", "t": T_DOWN, "inflight": [rid]}])
    for r in bridge._recs(b.prod_log) + bridge._recs(b.sub_log):
        b.record(r)
    c = b.side_counts("myq")
    assert (c["dup"], c["unexplained"]) == (2, 1)


def test_lost_or_doubled_on_myqs_side_fails_and_says_so(tmp_path, capsys):
    prod = [acc(s, n, 990.0 + n) for s in ("myq", "bridge") for n in range(2)]
    sub = [msg("myq", 0, 995.0), msg("bridge", 0, 995.0), msg("bridge", 1, 995.0)]
    b = _bridge(tmp_path, prod, sub)
    assert b.report() == 1
    last = capsys.readouterr().out.splitlines()
    line = next(l for l in last if l.startswith("soak-bridge: side=myq "))
    assert " accepted=2 delivered=1 lost=1 " in line


@pytest.mark.parametrize("what", ["nothing accepted", "foreign", "no kills"])
def test_a_run_with_nothing_to_judge_is_not_a_pass(tmp_path, what, capsys):
    prod = [acc(s, n, 990.0 + n) for s in ("myq", "bridge") for n in range(2)]
    sub = [msg(s, n, 995.0 + n) for s in ("myq", "bridge") for n in range(2)]
    if what == "nothing accepted":
        prod = []
    if what == "foreign":
        sub.append(msg("myq", 5, 996.0, run="other"))
    b = _bridge(tmp_path, prod, sub)
    if what != "no kills":
        b.faults = [{"kind": k, "t": T_DOWN + 1, "inflight": [], "t_restart": T_DOWN + 5,
                     "untaken": [], "recent": 0}
                    for k in ("link_down", "myq_kill", "broker_kill", "link_up")]
    rc = b.report()
    out = capsys.readouterr().out
    assert rc == 2, out
    assert "soak-bridge: could not check: " in out
    want = {"nothing accepted": "no reading was accepted", "foreign": "not this run's",
            "no kills": "the fault myq_kill did not happen"}[what]
    assert want in out
