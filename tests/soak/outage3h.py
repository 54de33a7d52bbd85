#!/usr/bin/env python3
"""After a 3-hour outage (issue 41, SPEC 10 live data first): live readings'
lag and the backlog's drain under the uplink's cap, time-compressed.

    python3 tests/soak/outage3h.py [--store files|sqlite] [--hours 3]
        [--rate 10] [--cap 32K/s] [--live-s 90] [--speed 300] [--dir DIR]
    make soak-3h

The goal: live p99 lag <= 2 x batch_wait while the backlog drains at
>= (1 - backlog_share) of the cap.  See README.md beside this file
("The 3-hour outage") for what it does and its summary line.

Exit status: 0 both goals met; 1 a live reading lost (accepted, never
delivered, not waiting in the spool) or refused; 4 a goal missed; 2
could not check (no 3-hour backlog made, too few live readings, the cap
never bound, ...: `outage3h: could not check: ...`); 3 cannot run here
(no libfaketime, ...).  Needs no root.
"""
import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MYQ_SRC = os.path.join(REPO, "myq.py")

BATCH, BATCH_WAIT, LIVE, SHARE = 100, 5.0, 15, 50
POLICY = ["handler=http", "batch=%d" % BATCH, "batch_wait=%gs" % BATCH_WAIT,
          "order=live-first", "live=%ds" % LIVE, "backlog_share=%d" % SHARE]
PROBE_MAX = "5s"        # the held destination's probes: the link's return seen soon


class CannotRun(Exception):
    pass


class NotChecked(Exception):
    pass


def reading(rid, nonce, seq, t):
    """The soak's reading: ~300 bytes of JSON (tests/soak/soak.py)."""
    body = {"rid": rid, "run": nonce, "seq": seq, "path": "py", "t": t,
            "sensor": "edge-%02d" % (seq % 7),
            "temp_c": round(18 + (seq % 97) / 10.0, 1),
            "rh": (seq * 7) % 100, "batt_mv": 3700 + seq % 400, "pad": ""}
    body["pad"] = "x" * max(0, 300 - len(json.dumps(body)))
    return body


def import_myq():
    sys.path.insert(0, os.path.dirname(MYQ_SRC))
    import myq
    return myq


# The producers (run as this script's sub-commands) ##########################

def produce_backlog(a):
    """Under faketime (its clock starts `hours` ago and runs `speed` times
    as fast): readings at `rate` a second of its clock through the Python
    API, as a producer through an outage, until its clock reaches the
    outage's end.  Its ids, created_at and file times are of its clock."""
    myq = import_myq()
    sp = myq.Spool(a.spool)
    now = time.time()
    if not a.t0 <= now < a.t0 + 3600:
        print("backlog producer: the clock is %.0f s from where it started "
              "(faketime not in effect?)" % (now - a.t0))
        return 2
    while time.time() < a.begin:
        os.sched_yield()
    start = a.begin
    end = start + a.hours * 3600.0
    made, first, last = 0, None, None
    while True:
        now = time.time()
        due = int((min(now, end) - start) * a.rate) + 1
        if due > made:
            sp.enqueue_many([{"type": "tele", "payload": reading(
                "b-%d" % i, a.nonce, i, now)} for i in range(made, due)])
            first = now if first is None else first
            made, last = due, now
        if now >= end:
            break
        os.sched_yield()    # (no sleep: libfaketime's at this speed fails, EINVAL)
    print(json.dumps({"made": made, "first": first, "last": last}))
    return 0


def produce_live(a):
    """Readings at `rate` a second of the real clock, each logged with the
    time enqueue returned (accepted), until SIGTERM."""
    myq = import_myq()
    sp = myq.Spool(a.spool)
    stop = []
    signal.signal(signal.SIGTERM, lambda *x: stop.append(1))
    out = open(a.log, "a")
    t0, i = time.monotonic(), 0
    while not stop:
        nxt = t0 + i / a.rate
        d = nxt - time.monotonic()
        if d > 0:
            time.sleep(d)
            continue
        t = time.time()
        try:
            jid = sp.enqueue("tele", reading("l-%d" % i, a.nonce, i, t))
            out.write(json.dumps({"rid": "l-%d" % i, "id": jid, "t": t,
                                  "acc": time.time()}) + "\n")
        except Exception as e:      # noqa: BLE001 - counted by the harness
            out.write(json.dumps({"rid": "l-%d" % i, "error": str(e)}) + "\n")
        out.flush()
        i += 1
    return 0


# The harness ##################################################################

def pct(values, p):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100.0 * (len(v) - 1))))]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def size_of(text):
    n, unit = text.split("/")[0], 1
    if n[-1:].upper() in "KM" and n[-1:]:
        unit = 1024 if n[-1].upper() == "K" else 1 << 20
        n = n[:-1]
    return float(n) * unit


def faketime_lib():
    """libfaketime, preloaded (not the faketime wrapper: its semaphore is
    named by its pid, and one left by a killed run makes it fail)."""
    import glob
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1",
                    "/usr/lib/faketime/libfaketime.so.1",
                    "/usr/local/lib/faketime/libfaketime.so.1",
                    "/usr/lib64/faketime/libfaketime.so.1"):
        found = glob.glob(pattern)
        if found:
            return found[0]
    raise CannotRun("no libfaketime (apt-get install faketime)")


def faketime_env(lib, spec):
    env = dict(os.environ, LD_PRELOAD=lib, FAKETIME=spec,
               FAKETIME_DONT_FAKE_MONOTONIC="1")
    env.pop("FAKETIME_TIMESTAMP_FILE", None)
    return env


class Run(object):

    def __init__(self, a):
        self.a = a
        self.nonce = "%08x" % random.getrandbits(32)
        self.procs = {}
        self.python = a.python or sys.executable

    def say(self, *words):
        print("outage3h:", *words, flush=True)

    def myq(self, *args, check=True):
        r = subprocess.run([self.python, MYQ_SRC, "--spool", self.spool] +
                           list(args), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True)
        if check and r.returncode != 0:
            raise RuntimeError("myq %s: exit %d: %s" % (
                " ".join(args), r.returncode, r.stdout[-500:]))
        return r.stdout

    def spawn(self, name, cmd, env=None):
        out = open(os.path.join(self.dir, name + ".out"), "ab")
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, cwd=self.dir,
                             env=env, start_new_session=True)
        out.close()
        self.procs[name] = p
        return p

    def stop(self, name, timeout=20):
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def setup(self):
        a = self.a
        faketime = faketime_lib()
        base = a.dir or "/var/tmp/myq-soak-3h"
        os.makedirs(base, exist_ok=True)
        for old in sorted(n for n in os.listdir(base) if n.startswith("run-"))[:-4]:
            shutil.rmtree(os.path.join(base, old), ignore_errors=True)
        self.dir = os.path.join(base, "run-%s-%s" % (
            time.strftime("%Y%m%dT%H%M%S"), self.nonce))
        os.makedirs(self.dir)
        last = os.path.join(base, "last")
        if os.path.islink(last):
            os.unlink(last)
        if not os.path.exists(last):
            os.symlink(self.dir, last)
        # the spool in RAM where there is some (/dev/shm): 3 hours of
        # readings are 100,000 files, whose fsyncs on a shared disk take
        # minutes to make; the scheduler reads the same directory either way
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access(
            "/dev/shm", os.W_OK) else None
        self.spool_parent = tempfile.mkdtemp(prefix="myq-3h-", dir=shm)
        self.spool = os.path.join(self.spool_parent, "spool")
        self.myq("init", "--store", a.store)
        self.port = free_port()
        self.url = "http://127.0.0.1:%d/ingest" % self.port
        self.myq("policy", "tele", "url=" + self.url, *POLICY)
        # is faketime in effect for a Python child here?
        r = subprocess.run([self.python, "-c", "import time; print(time.time())"],
                           stdout=subprocess.PIPE, universal_newlines=True,
                           env=faketime_env(faketime, "-365d"))
        try:
            ok = abs(float(r.stdout.strip()) + 365 * 86400 - time.time()) < 600
        except ValueError:
            ok = False
        if not ok:
            raise CannotRun("faketime has no effect on %s here" % self.python)
        self.faketime = faketime

    def make_backlog(self):
        a = self.a
        # Its clock runs `speed` times as fast from its exec (libfaketime's
        # start); it makes nothing until it reads `begin` (its interpreter
        # and myq loaded by then), then readings for `hours` of its clock,
        # the last LIVE + 10 s before the real clock's now: the newest of
        # the backlog is not live when the link is back.
        lead = 2.0 * a.speed            # (2 s of its start, at that speed)
        dur = a.hours * 3600.0 + lead
        e = time.time()
        t0 = int(e + dur / a.speed - (LIVE + 10) - dur)
        spec = "@%s x%g" % (time.strftime("%Y-%m-%d %H:%M:%S",
                                          time.localtime(t0)), a.speed)
        env = faketime_env(self.faketime, spec)
        t = time.time()
        p = subprocess.run(
            [self.python, os.path.abspath(__file__),
             "--backlog-producer", "--myq", MYQ_SRC, "--spool", self.spool, "--t0",
             repr(float(t0)), "--begin", repr(t0 + lead), "--hours",
             repr(a.hours), "--rate",
             repr(a.rate), "--nonce", self.nonce],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            universal_newlines=True, env=env, timeout=600)
        if p.returncode != 0:
            raise NotChecked("the backlog producer failed: %s" % p.stdout[-500:])
        res = json.loads(p.stdout.strip().splitlines()[-1])
        self.backlog_made = res["made"]
        self.say("backlog: %d readings made in %.1f s, their clock %s .. %s "
                 "(now %s)" % (res["made"], time.time() - t, _iso(res["first"]),
                               _iso(res["last"]), _iso(time.time())))
        return res

    def check_backlog(self, res):
        """The backlog the worker sees: ready jobs, created over the outage."""
        a, now = self.a, time.time()
        want = int(a.hours * 3600 * a.rate)
        st = json.loads(self.myq("stats", "--json"))
        ready = st.get("ready")
        span = (res["last"] or 0) - (res["first"] or 0)
        self.say("backlog: stats ready=%s, oldest_ready_s=%s, want %d over %.2f h; "
                 "made over %.2f h, newest %.0f s ago" % (
                     ready, st.get("oldest_ready_s"), want, a.hours,
                     span / 3600.0, now - res["last"]))
        if res["made"] < want * 0.99 or (ready or 0) < want * 0.99:
            raise NotChecked("the backlog is %s ready jobs (%d made), not the "
                             "%d of %.1f hours" % (ready, res["made"], want, a.hours))
        if span < a.hours * 3600 * 0.95 or now - res["first"] < a.hours * 3600 * 0.95:
            raise NotChecked("the backlog's readings were made over %.2f h, the "
                             "first %.2f h ago: not a %.1f-hour outage's" % (
                                 span / 3600.0, (now - res["first"]) / 3600.0, a.hours))
        if now - res["last"] <= LIVE:
            raise NotChecked("the backlog's newest reading is %.0f s old: live "
                             "(live=%ds), not the backlog" % (now - res["last"], LIVE))
        return st

    def run(self):
        a = self.a
        self.setup()
        self.say("dir %s, spool %s (%s), cap %s, rate %g/s, %g h at x%g" % (
            self.dir, self.spool, a.store, a.cap, a.rate, a.hours, a.speed))
        wlog = os.path.join(self.dir, "worker.log")
        # the worker runs through the outage: its destination held (nothing
        # listens), its probes failing, as on a device whose link is down
        self.spawn("worker", [self.python, MYQ_SRC, "--spool", self.spool,
                              "worker", "--concurrency", "2", "--timeout", "20",
                              "--uplink-rate", a.cap, "--probe-max", PROBE_MAX,
                              "--max-attempts", "50", "--log", wlog])
        res = self.make_backlog()
        time.sleep(1.0)
        wait = LIVE + 5 - (time.time() - res["last"])
        if 0 < wait < 120:      # the newest of the backlog, live no more
            time.sleep(wait)
        self.check_backlog(res)
        # the link is back: the receiver answers, live readings flow
        rlog = os.path.join(self.dir, "receiver.jsonl")
        llog = os.path.join(self.dir, "live.jsonl")
        self.spawn("receiver", [self.python, os.path.join(HERE, "receiver.py"),
                                "--listen", "127.0.0.1:%d" % self.port,
                                "--run", self.nonce, "--log", rlog])
        self.t_up = time.time()
        self.spawn("live", [self.python, os.path.abspath(__file__),
                            "--live-producer", "--myq", MYQ_SRC, "--spool", self.spool,
                            "--rate", repr(a.rate), "--nonce", self.nonce,
                            "--log", llog])
        self.say("link up at %s; live readings at %g/s for %g s" % (
            _iso(self.t_up), a.rate, a.live_s))
        end = self.t_up + a.live_s
        while time.time() < end:
            if self.procs["worker"].poll() is not None:
                raise NotChecked("the worker exited (%s): see %s" % (
                    self.procs["worker"].returncode, wlog))
            time.sleep(0.2)
        self.stop("live")
        self.t_live_end = time.time()
        live = _jsonl(llog)
        ids = set(r["rid"] for r in live if "error" not in r)
        # every live reading arrives: they go first
        deadline = time.time() + 4 * BATCH_WAIT + 20
        while time.time() < deadline:
            got = set(rid for r in _jsonl(rlog) if r.get("status") == 200
                      for rid in r.get("rids") or ())
            if ids <= got:
                break
            time.sleep(0.5)
        self.t_end = time.time()
        self.stop("worker")
        self.stop("receiver")
        return self.judge(live, _jsonl(rlog))

    def judge(self, live, reqs):
        a = self.a
        cap = size_of(a.cap)
        accepted = dict((r["rid"], r["acc"]) for r in live if "error" not in r)
        errors = [r for r in live if "error" in r]
        ok = [r for r in reqs if r.get("ev") == "req" and r.get("status") == 200]
        first = {}
        for r in ok:
            for rid in r.get("rids") or ():
                first.setdefault(rid, r["t1"])
        if not ok:
            raise NotChecked("the receiver answered no request")
        # the drain: from the first backlog reading delivered after link-up
        # (the release by the worker's probe) to the end of the live phase
        back = [r for r in ok if any(str(x).startswith("b-") for x in r.get("rids") or ())]
        if not back:
            raise NotChecked("no backlog reading was delivered")
        t_rel = min(r["t1"] for r in ok)
        win = [r for r in ok if t_rel < r["t0"] <= self.t_live_end]
        span = self.t_live_end - t_rel

        def share_bytes(r, prefix):
            rids = r.get("rids") or ()
            n = sum(1 for x in rids if str(x).startswith(prefix))
            return r.get("wire", 0) * n / float(len(rids) or 1)
        back_b = sum(share_bytes(r, "b-") for r in win)
        live_b = sum(share_bytes(r, "l-") for r in win)
        if span < 30:
            raise NotChecked("the drain was watched %.0f s only (the release "
                             "came %.0f s after link-up)" % (span, t_rel - self.t_up))
        back_bps, live_bps = back_b / span, live_b / span
        # live readings accepted after the release, while the backlog drains
        judged = [rid for rid, t in accepted.items() if t >= t_rel]
        inf = float("inf")      # (one not delivered: its lag has no end)
        lags = [first.get(rid, inf) - accepted[rid] for rid in judged]
        late = [rid for rid in accepted if rid not in first]
        jids = dict((r["rid"], r.get("id")) for r in live)
        lost = [rid for rid in late[:10] if not self.queued(jids.get(rid))]
        all_lags = [first[rid] - accepted[rid] for rid in accepted if rid in first]
        if len(judged) < a.rate * 20:
            raise NotChecked("only %d live readings were made while the backlog "
                             "drained" % len(judged))
        if (back_bps + live_bps) < 0.8 * cap:
            raise NotChecked("the cap did not bind: %.0f B/s sent of %.0f B/s (the "
                             "worker's pace, not the cap's, was measured)"
                             % (back_bps + live_bps, cap))
        marked = [r for r in win if r.get("backlog")]
        marked_ok = sum(1 for r in marked if all(
            str(x).startswith("b-") for x in r.get("rids") or ()))
        back_delivered = len(set(rid for r in ok for rid in r.get("rids") or ()
                                 if str(rid).startswith("b-")))
        left = self.backlog_made - back_delivered
        # created_at order: the most readings a backlog reading came behind
        # one made after it (b-N: the N-th made); two slots, batches of
        # 100: about 200 when the backlog drains oldest first
        behind, most = 0, -1
        for r in sorted(ok, key=lambda r: r["t1"]):
            nums = [int(str(x)[2:]) for x in r.get("rids") or ()
                    if str(x).startswith("b-") and str(x)[2:].isdigit()]
            for k in nums:
                behind = max(behind, most - k)
            most = max([most] + nums)
        p50, p99 = pct(lags, 50), pct(lags, 99)
        goal_lag = 2 * BATCH_WAIT
        goal_share = (100 - SHARE) / 100.0
        share = back_bps / cap
        lag_ok = p99 is not None and p99 <= goal_lag
        drain_ok = share >= goal_share
        self.say("release %.1f s after link-up; drain watched %.0f s; %d requests "
                 "(%d marked X-Myq-Backlog, %d of them all backlog)" % (
                     t_rel - self.t_up, span, len(win), len(marked), marked_ok))
        self.say("live: %d accepted (%d refused), %d after the release, lag of "
                 "all p50 %.2f s p99 %.2f s max %.2f s" % (
                     len(accepted), len(errors), len(judged),
                     pct(all_lags, 50) or -1, pct(all_lags, 99) or -1,
                     max(all_lags or [-1])))
        self.say("bytes/s: backlog %.0f, live %.0f, together %.0f of the cap "
                 "%.0f; the backlog left %d of %d (at this pace %.0f s more)" % (
                     back_bps, live_bps, back_bps + live_bps, cap, left,
                     self.backlog_made, left / (back_delivered / span)
                     if back_delivered else -1))
        if not lag_ok:
            self.say("goal missed: live p99 lag %.2f s > 2 x batch_wait = %g s"
                     % (p99, goal_lag))
        if not drain_ok:
            self.say("goal missed: the backlog drained at %.2f of the cap < %.2f"
                     % (share, goal_share))
        if late:
            self.say("live readings not delivered by the end: %d, e.g. %s; "
                     "of the first 10, not waiting in the spool (lost): %d" % (
                         len(late), ", ".join(sorted(late)[:5]), len(lost)))
        self.say("store=%s backlog_jobs=%d backlog_h=%g live_accepted=%d "
                 "live_judged=%d live_late=%d live_lost=%d live_lag_p50_s=%.2f "
                 "live_lag_p99_s=%.2f goal_lag_s=%g backlog_Bps=%.0f live_Bps=%.0f "
                 "cap_Bps=%.0f backlog_of_cap=%.2f goal_of_cap=%.2f "
                 "backlog_behind=%d result=%s" % (
                     a.store, self.backlog_made, a.hours, len(accepted),
                     len(judged), len(late), len(lost), p50, p99, goal_lag,
                     back_bps, live_bps, cap, share, goal_share, behind,
                     "lost" if lost or errors else "ok" if lag_ok and drain_ok
                     else "missed"))
        return 1 if lost or errors else 0 if lag_ok and drain_ok else 4

    def queued(self, jid):
        """Whether live job `jid` is still in the spool (late, not lost)."""
        if not jid:
            return False
        r = subprocess.run([self.python, MYQ_SRC, "--spool", self.spool, "show",
                            jid], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           universal_newlines=True)
        try:
            return json.loads(r.stdout).get("state") in (
                "ready", "scheduled", "processing")
        except ValueError:
            return False

    def cleanup(self):
        for name in list(self.procs):
            self.stop(name, timeout=5)
        if getattr(self, "spool_parent", None):
            shutil.rmtree(self.spool_parent, ignore_errors=True)


def _iso(t):
    return time.strftime("%H:%M:%S", time.gmtime(t)) if t else "-"


def _jsonl(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", choices=("files", "sqlite"), default="files")
    p.add_argument("--hours", type=float, default=3.0)
    p.add_argument("--rate", type=float, default=10.0,
                   help="readings a second, through the outage and after")
    p.add_argument("--cap", default="32K/s",
                   help="the worker's --uplink-rate (the soak's)")
    p.add_argument("--live-s", type=float, default=90.0,
                   help="seconds of live readings after the link is back")
    p.add_argument("--speed", type=float, default=300.0,
                   help="how much faster the backlog producer's clock runs")
    p.add_argument("--python", help="the interpreter of myq and its producers")
    p.add_argument("--myq", help="the myq.py to run (default: this tree's)")
    p.add_argument("--dir", help="where the logs go (default /var/tmp/myq-soak-3h)")
    p.add_argument("--backlog-producer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--live-producer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spool", help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    p.add_argument("--begin", type=float, help=argparse.SUPPRESS)
    p.add_argument("--nonce", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    global MYQ_SRC
    MYQ_SRC = os.path.abspath(a.myq or MYQ_SRC)
    if a.backlog_producer:
        return produce_backlog(a)
    if a.live_producer:
        return produce_live(a)
    run = Run(a)
    # a timeout's SIGTERM: the processes stopped, the spool removed (finally)
    signal.signal(signal.SIGTERM, lambda *x: sys.exit(2))
    try:
        return run.run()
    except CannotRun as e:
        print("outage3h: cannot run here: %s" % e, flush=True)
        return 3
    except NotChecked as e:
        print("outage3h: could not check: %s" % e, flush=True)
        return 2
    except Exception as e:      # noqa: BLE001 - the harness failed: said
        import traceback
        traceback.print_exc()
        print("outage3h: could not check: the harness failed: %s" % e, flush=True)
        return 2
    finally:
        run.cleanup()


if __name__ == "__main__":
    sys.exit(main())
