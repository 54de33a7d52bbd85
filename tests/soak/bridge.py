#!/usr/bin/env python3
"""The bridge soak (issue 27): myq intake beside a Mosquitto bridge, one
reading stream, the same link, the same outage and kills.

    python3 tests/soak/bridge.py [--dir DIR] [--keep]    (or soak.py --bridge)

Producers (producer.py) publish every reading at QoS 1 to two local
brokers in the device's namespace, both real mosquitto with persistence on:

- side myq: broker A, subscribed by `myq intake` (its persistent session),
  whose jobs a `myq worker` (handler=mqtt, batch=50) forwards upstream;
- side bridge: broker B, with a `connection` section (QoS 1, cleansession
  false) that forwards the same readings upstream itself.

Upstream is the soak's broker and subscriber (subscriber.py) in the
server's namespace, behind the emulated cellular link (link.py, tbf).
The link goes down for 45 s; during it `kill -9` of intake and worker
(restarted 1 s later, as a supervisor would) and, later, of both local
brokers at once (restarted 3 s later).  Each side counts per reading id:
accepted (PUBACKed to the producer), delivered upstream, lost,
duplicates.  The last lines, one per side:

    soak-bridge: side=myq accepted=N delivered=N lost=N ... dup_unexplained=N ...
    soak-bridge: side=bridge accepted=N delivered=N lost=N ...

Exit status: 0 myq's side lost nothing and doubled nothing without a kill
or cut to explain it, and every check held; 1 myq's side lost or doubled
(CI fails); 2 the harness could not check what it claims (`soak-bridge:
could not check: ...`: nothing accepted, a kill that did not happen, a
side the receiver never saw, ...); 3 it cannot run here.  What the bridge
loses is measured, not judged.  See README.md beside this file.
"""
import argparse
import json
import math
import os
import re
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import soak                     # noqa: E402  (the soak's setup: fs, netns, link, upstream)
from soak import CannotRun, HERE, LINK_GRACE, L_MQTT, _lines, _read, _recs  # noqa: E402

RATE = 10.0                     # readings a second, each to both sides
PORTS = {"myq": 1884, "bridge": 1885}      # the local brokers, device's loopback
PHASES = [("warm", 5), ("steady", 20), ("link-down", 45), ("steady-b", 10)]
KILL_MYQ_AT, MYQ_DOWN = 12.0, 1.0          # s into the outage; s until restarted
KILL_BROKERS_AT, BROKERS_DOWN = 30.0, 3.0
SIDES = ("myq", "bridge")


class Bridge(soak.Soak):
    def __init__(self, args):
        args.minutes = 0
        soak.Soak.__init__(self, args)
        self.acc = {s: {} for s in SIDES}       # side -> rid -> t accepted
        self.gave_up = {s: 0 for s in SIDES}
        self.deliv = {s: {} for s in SIDES}     # side -> rid -> [t, ...]
        self.lives = []     # {"name", "pid", "start", "end", "cpu_s", "hwm_kb", "status"}
        self.hwm = {}       # name -> peak VmHWM kB over its lives
        self.faults = []    # {"kind", "t", "inflight"}

    def say(self, *a):
        print("soak-bridge: " + " ".join(str(x) for x in a), flush=True)

    # ------------------------------------------------------------ processes
    def start_proc(self, name, cmd, ns):
        p = self.spawn(name, cmd, ns=ns)
        self.wait_until(lambda: _read(b"/proc/%d/cmdline" % p.pid) and not
                        _read(b"/proc/%d/cmdline" % p.pid).startswith(b"ip\0"),
                        10, "%s to start" % name)
        self.check_ns(p.pid, ns, "the " + name)
        life = {"name": name, "pid": p.pid, "start": time.time()}
        with self.lock:
            self.lives.append(life)
        self.event("start", name=name, pid=p.pid)
        return p

    def life(self, name):
        return next(l for l in reversed(self.lives) if l["name"] == name)

    def sample(self, name):
        p = self.procs.get(name)
        if p is None or p.returncode is not None:
            return
        m = re.search(r"VmHWM:\s+(\d+) kB", _read(b"/proc/%d/status" % p.pid).decode())
        if m:
            kb = int(m.group(1))
            life = self.life(name)
            life["hwm_kb"] = max(life.get("hwm_kb", 0), kb)
            self.hwm[name] = max(self.hwm.get(name, 0), kb)

    def reap(self, name, sig):
        """Signal `name`, wait for it: (time, exit status); its CPU (wait4:
        all its threads) and VmHWM (its own, sampled just before) kept."""
        p = self.procs[name]
        self.sample(name)
        os.kill(p.pid, sig)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        t = time.time()
        life = self.life(name)
        life.update(end=t, cpu_s=ru.ru_utime + ru.ru_stime, user_s=ru.ru_utime,
                    sys_s=ru.ru_stime, status=p.returncode)
        self.event("end", **life)
        if sig == signal.SIGKILL and p.returncode != -signal.SIGKILL:
            self.problem("%s ended %s, not by the kill -9" % (name, p.returncode))
        return t, p.returncode

    def cpu(self, name):
        return sum(l.get("cpu_s", 0.0) for l in self.lives if l["name"] == name)

    # ---------------------------------------------------------------- setup
    def local_conf(self, side):
        d = os.path.join(self.dir, "local-" + side)
        os.makedirs(d, exist_ok=True)
        conf = os.path.join(d, "mosquitto.conf")
        text = ("listener %d 127.0.0.1\nallow_anonymous true\n"
                "persistence true\npersistence_location %s/\npersistence_file broker.db\n"
                "log_dest file %s/mosquitto.log\nlog_type error\nlog_type warning\n"
                "log_type notice\nlog_type information\nlog_type subscribe\n"
                "connection_messages true\nlog_timestamp true\nuser root\n"
                % (PORTS[side], d, d))
        if side == "bridge":
            text += ("\nconnection soak-bridge\naddress 127.0.0.1:%d\n"
                     "topic soak/%s/bridge/# out 1\ncleansession false\n"
                     "remote_clientid soak-bridge-%s\nlocal_clientid soak-bridge-local-%s\n"
                     "bridge_protocol_version mqttv311\nnotifications false\n"
                     "start_type automatic\n" % (L_MQTT, self.nonce, self.nonce, self.nonce))
            # (its reconnects on mosquitto's defaults, restart_timeout 5 30
            # and keepalive_interval 60, as myq's worker runs on its own:
            # --backoff-base 5, --probe-max 30)
        with open(conf, "w") as f:
            f.write(text)
        return conf, os.path.join(d, "mosquitto.log"), os.path.join(d, "broker.db")

    def start_local(self, side):
        conf, log, _ = self.local_conf(side)
        n = sum(1 for l in _lines(log) if re.search(r"mosquitto version \S+ running", l))
        self.start_proc("local-" + side, [self.mosquitto, "-c", conf], self.ns_dev)
        self.wait_until(lambda: sum(1 for l in _lines(log) if re.search(
            r"mosquitto version \S+ running", l)) > n, 15, "the %s broker to start" % side)

    def intake_cmd(self):
        return [self.py, self.myq, "--spool", self.spool, "intake",
                "--subscribe", "soak/%s/myq/#=reading" % self.nonce,
                "--mqtt", "mqtt://127.0.0.1:%d" % PORTS["myq"],
                "--log", os.path.join(self.dir, "intake.log")]

    def worker_cmd(self):
        return [self.py, self.myq, "--spool", self.spool, "worker",
                "--mqtt", self.mqtt_url, "--concurrency", "2", "--timeout", "20",
                "--max-attempts", "50", "--backoff-max", "900", "--stats-interval", "5",
                "--log", os.path.join(self.dir, "worker.log")]

    def count(self, path, pattern):
        return sum(1 for l in _lines(path) if re.search(pattern, l))

    def setup_sides(self):
        """Both local brokers, intake subscribed and the bridge connected
        upstream; then both brokers stopped and started again (SIGTERM:
        each saves its database, with the sessions in it, as a broker in
        service has after a reboot), and connected again."""
        ilog = os.path.join(self.dir, "intake.log")
        alog = self.local_conf("myq")[1]
        for side in SIDES:
            self.start_local(side)
        self.start_proc("intake", self.intake_cmd(), self.ns_dev)
        up = r"New (client|bridge) connected .* as soak-bridge-%s " % self.nonce
        for rnd in (1, 2):
            self.wait_until(lambda: self.count(ilog, "event=intake_connected") >= rnd, 20,
                            "intake to connect to the local broker")
            self.wait_until(lambda: self.count(alog, r" soak/%s/myq/# *$" % self.nonce
                                               ) >= rnd, 20, "intake's subscription")
            self.wait_until(lambda: self.count(self.broker_log, up) >= rnd, 30,
                            "the bridge to connect upstream")
            if rnd == 2:
                break
            for side in SIDES:
                _, rc = self.reap("local-" + side, signal.SIGTERM)
                db = self.local_conf(side)[2]
                if rc != 0 or not os.path.exists(db):
                    raise RuntimeError("the %s broker stopped %s without its database %s"
                                       % (side, rc, db))
                self.start_local(side)
        self.start_proc("worker", self.worker_cmd(), self.ns_dev)

    # -------------------------------------------------------------- monitor
    def monitor(self):
        offs = {}
        plog, slog = self.prod_log, self.sub_log
        while not self.stop_all.is_set():
            for name in ("intake", "worker", "local-myq", "local-bridge"):
                try:
                    self.sample(name)
                except (OSError, ValueError, StopIteration):
                    pass
            for path in (plog, slog):
                try:
                    with open(path) as f:
                        f.seek(offs.get(path, 0))
                        data = f.read()
                except OSError:
                    continue
                cut = data.rfind("\n") + 1
                offs[path] = offs.get(path, 0) + len(data[:cut].encode())
                for line in data[:cut].splitlines():
                    try:
                        self.record(json.loads(line))
                    except (ValueError, KeyError, IndexError):
                        pass
            time.sleep(0.25)

    def record(self, r):
        with self.lock:
            if r["ev"] == "acc":
                self.acc[r["side"]][r["rid"]] = r["t"]
            elif r["ev"] == "gave_up":
                self.gave_up[r["side"]] += 1
            elif r["ev"] == "msg" and r.get("rid"):
                side = r["topic"].split("/")[2]
                if r.get("run") != self.nonce or side not in SIDES:
                    self.foreign = getattr(self, "foreign", 0) + 1
                    return
                self.deliv[side].setdefault(r["rid"], []).append(r["t"])

    # --------------------------------------------------------------- faults
    def mark(self, kind, **kw):
        e = dict(kw, kind=kind, t=time.time(), inflight=sorted(self.inflight()))
        self.faults.append(e)
        self.event("fault", **e)
        return e

    def kill_myq(self):
        for name in ("intake", "worker"):
            self.reap(name, signal.SIGKILL)
        e = self.mark("myq_kill")      # (what it left claimed)
        self.say("kill -9 of intake and worker at +%.1f s (%d jobs in flight)"
                 % (e["t"] - self.t0, len(e["inflight"])))
        time.sleep(MYQ_DOWN)
        n = self.count(os.path.join(self.dir, "intake.log"), "event=intake_connected")
        self.start_proc("intake", self.intake_cmd(), self.ns_dev)
        self.start_proc("worker", self.worker_cmd(), self.ns_dev)
        self.wait_until(lambda: self.count(os.path.join(self.dir, "intake.log"),
                                           "event=intake_connected") > n, 20,
                        "intake to connect again after its kill")

    def kill_brokers(self):
        """kill -9 of both local brokers at once, midway between two
        readings: no reading is then between broker A's PUBACK to its
        producer and intake's PUBACK to broker A (mosquitto acknowledges a
        producer before its subscriber has the message; that window, a
        few ms, is the broker's and no subscriber can close it); checked
        after the kill."""
        k = math.ceil((time.time() - self.t_prod) * RATE)
        at = self.t_prod + (k + 0.5) / RATE
        time.sleep(max(0.0, at - time.time()))
        e = self.mark("broker_kill")
        for side in SIDES:
            self.reap("local-" + side, signal.SIGKILL)
        time.sleep(0.3)
        with self.lock:
            recent = [j for j, t in self.acc["myq"].items() if e["t"] - 3 < t <= e["t"]]
        sp = self.myqmod.open_store(self.spool)
        e["untaken"] = [j for j in recent if sp.find_id(j) is None]
        e["recent"] = len(recent)
        self.say("kill -9 of both local brokers at +%.1f s; of the %d readings accepted "
                 "by broker A in the 3 s before, %d not yet taken in by intake"
                 % (e["t"] - self.t0, len(recent), len(e["untaken"])))
        time.sleep(BROKERS_DOWN)
        for side in SIDES:
            self.start_local(side)
        e["t_restart"] = time.time()

    def outage(self):
        self.link(False)
        t_down = time.time()
        self.mark("link_down")
        self.say("link down at +%.1f s" % (t_down - self.t0))
        self.sleep(t_down + KILL_MYQ_AT - time.time())
        self.kill_myq()
        self.sleep(t_down + KILL_BROKERS_AT - time.time())
        self.kill_brokers()
        self.sleep(t_down + dict(PHASES)["link-down"] - time.time())
        t1 = time.time()
        self.link(True)
        self.t_up = time.time()
        self.mark("link_up")
        self.t_down = t_down
        mid = [r for r in _recs(self.sub_log) if r.get("ev") == "msg" and
               t_down + 1.0 < r["t"] < t1]
        if mid:
            self.problem("%d messages arrived upstream while the link was down" % len(mid))
        self.say("link up at +%.1f s after %.0f s down" % (self.t_up - self.t0, t1 - t_down))

    # ----------------------------------------------------------------- main
    def timeline(self):
        self.prod_log = os.path.join(self.dir, "producer.jsonl")
        self.setup_sides()
        self.t0 = time.time()
        self.t_prod = self.t0 + 0.5
        # intake's CPU before the first message: the cost of a start
        st = _read(b"/proc/%d/stat" % self.procs["intake"].pid).decode().rsplit(")", 1)[1].split()
        self.intake_start_cpu = sum(int(x) for x in st[11:13]) / float(os.sysconf("SC_CLK_TCK"))
        self.start_proc("producer", [self.py, os.path.join(HERE, "producer.py"), "--rate", str(RATE),
                                "--start", "%.4f" % self.t_prod, "--run", self.nonce,
                                "--log", self.prod_log] +
                        sum((["--side", "%s=%d" % (s, PORTS[s])] for s in SIDES), []),
                        self.ns_dev)
        self.mon = threading.Thread(target=self.monitor, daemon=True)
        self.mon.start()
        for name, secs in PHASES:
            self.set_phase(name)
            if name != "link-down":
                self.sleep(secs)
            else:
                self.outage()
                self.set_phase("drain")
                with self.lock:
                    backlog = [j for j, t in self.acc["myq"].items() if t < self.t_up]
                try:
                    self.wait_until(lambda: all(j in self.deliv["myq"] for j in backlog), 90,
                                    "myq's backlog to drain", step=0.1)
                except RuntimeError as e:
                    self.problem(str(e))
        self.set_phase("final")
        self.reap("producer", signal.SIGTERM)
        time.sleep(0.5)
        with self.lock:
            want = set(self.acc["myq"])
        quiet = lambda: time.time() - max([0] + [max(v) for s in SIDES  # noqa: E731
                                                 for v in self.deliv[s].values()]) > 5
        try:
            self.wait_until(lambda: all(j in self.deliv["myq"] for j in want) and quiet(),
                            60, "the last readings to arrive", step=0.25)
        except RuntimeError:
            pass            # counted as lost below
        time.sleep(1.0)
        for name in ("intake", "worker", "local-myq", "local-bridge"):
            _, rc = self.reap(name, signal.SIGTERM)
            if rc != 0:
                self.problem("%s exited %s on SIGTERM, not 0" % (name, rc))
        self.stop_all.set()
        self.mon.join(5)

    # --------------------------------------------------------------- report
    def side_counts(self, side):
        acc, deliv = self.acc[side], self.deliv[side]
        lost = sorted(set(acc) - set(deliv))
        dup = unexplained = 0
        infl = [(f["t"], f["kind"], set(f["inflight"])) for f in self.faults]
        for jid, ts in deliv.items():
            ts.sort()
            for prev, cur in zip(ts, ts[1:]):
                dup += 1
                if not any(jid in ids and prev - LINK_GRACE <= t <= cur for t, _, ids in infl):
                    unexplained += 1
        pre = [min(deliv[j]) for j, t in acc.items() if t < self.t_up and j in deliv]
        drained = max(pre) - self.t_up if pre else -1.0
        return {"accepted": len(acc), "delivered": len(set(acc) & set(deliv)), "lost": lost,
                "dup": dup, "unexplained": unexplained, "drained": drained,
                "unaccepted": len(set(deliv) - set(acc))}

    def report(self):
        # the logs once more, whole (the monitor may have stopped mid-line)
        self.acc = {s: {} for s in SIDES}
        self.deliv = {s: {} for s in SIDES}
        self.gave_up = {s: 0 for s in SIDES}
        self.foreign = 0
        for r in _recs(self.prod_log) + _recs(self.sub_log):
            try:
                self.record(r)
            except (KeyError, IndexError):
                pass
        starts = [r for r in _recs(self.prod_log) if r.get("ev") == "start"]
        if len(starts) != 1 or starts[0].get("run") != self.nonce:
            self.problem("the producer's log is not this run's alone")
        if self.foreign:
            self.problem("%d messages upstream are not this run's" % self.foreign)
        c = {s: self.side_counts(s) for s in SIDES}
        for s in SIDES:
            if not c[s]["accepted"]:
                self.problem("side %s: no reading was accepted" % s)
            if not self.deliv[s]:
                self.problem("side %s: the upstream receiver saw nothing" % s)
            before = [j for j, t in self.acc[s].items() if t < self.t_down - 1]
            if not any(j in self.deliv[s] and min(self.deliv[s][j]) < self.t_down
                       for j in before):
                self.problem("side %s: nothing crossed the link before the outage" % s)
        kinds = [f["kind"] for f in self.faults]
        for k in ("link_down", "myq_kill", "broker_kill", "link_up"):
            if k not in kinds:
                self.problem("the fault %s did not happen" % k)
        kb = next((f for f in self.faults if f["kind"] == "broker_kill"), None)
        if kb is not None:
            plog = _recs(self.prod_log)
            for s in SIDES:
                if not any(r.get("ev") == "conn" and r.get("side") == s and
                           r["t"] > kb["t_restart"] - BROKERS_DOWN for r in plog):
                    self.problem("side %s: the producer never connected again after the "
                                 "broker kill" % s)
            for s in SIDES:
                log = self.local_conf(s)[1]
                if self.count(log, r"mosquitto version \S+ running") != 3:
                    self.problem("the %s broker did not start 3 times" % s)
        n_myq = c["myq"]["accepted"] or 1
        n_br = c["bridge"]["accepted"] or 1
        mb = lambda name: self.hwm.get(name, 0) / 1024.0  # noqa: E731
        self.say("producer: gave up myq=%d bridge=%d (never PUBACKed in 15 s)" % (
            self.gave_up["myq"], self.gave_up["bridge"]))
        for f in self.faults:
            self.say("fault %s at +%.1f s: %d jobs in flight%s" % (
                f["kind"], f["t"] - self.t0, len(f["inflight"]),
                "; untaken by intake: %d of %d" % (len(f["untaken"]), f["recent"])
                if "untaken" in f else ""))
        for s in SIDES:
            for jid in c[s]["lost"][:5]:
                self.say("  %s lost %s (accepted at +%.2f)" % (s, jid, self.acc[s][jid] - self.t0))
        il = [l for l in self.lives if l["name"] == "intake"]
        self.say("intake: %d lives, cpu %.2f s (user %.2f, sys %.2f), %.2f s of it before "
                 "the first message; worker: cpu %.2f s" % (
                     len(il), self.cpu("intake"), sum(l.get("user_s", 0) for l in il),
                     sum(l.get("sys_s", 0) for l in il), self.intake_start_cpu,
                     self.cpu("worker")))
        self.say("lives: " + " ".join("%s(pid %d, %.2f s cpu, %d kB, %s)" % (
            l["name"], l["pid"], l.get("cpu_s", -1), l.get("hwm_kb", 0), l.get("status"))
            for l in self.lives))
        self.say("logs: %s (myq.py %s, python %s; %s)" % (
            self.dir, self.myq_sha, sys.version.split()[0], self.link_desc))
        if self.problems:
            self.say("could not check: " + "; ".join(self.problems))
        m, b = c["myq"], c["bridge"]
        print("soak-bridge: side=myq accepted=%d delivered=%d lost=%d lost_pct=%.1f dup=%d "
              "dup_unexplained=%d linkup_to_drained_s=%.1f intake_cpu_ms_per_msg=%.2f "
              "worker_cpu_ms_per_msg=%.2f intake_hwm_mb=%.1f worker_hwm_mb=%.1f" % (
                  m["accepted"], m["delivered"], len(m["lost"]),
                  100.0 * len(m["lost"]) / n_myq, m["dup"], m["unexplained"], m["drained"],
                  1000 * self.cpu("intake") / n_myq, 1000 * self.cpu("worker") / n_myq,
                  mb("intake"), mb("worker")), flush=True)
        print("soak-bridge: side=bridge accepted=%d delivered=%d lost=%d lost_pct=%.1f dup=%d "
              "linkup_to_drained_s=%.1f broker_cpu_ms_per_msg=%.2f broker_hwm_mb=%.1f" % (
                  b["accepted"], b["delivered"], len(b["lost"]), 100.0 * len(b["lost"]) / n_br,
                  b["dup"], b["drained"], 1000 * self.cpu("local-bridge") / n_br,
                  mb("local-bridge")), flush=True)
        if m["lost"] or m["unexplained"]:
            return 1
        return 2 if self.problems else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", help="where the runs' logs go (default /var/tmp/myq-soak-bridge)")
    p.add_argument("--keep", action="store_true", help="keep the spool's image")
    p.add_argument("--bridge", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.dir = args.dir or "/var/tmp/myq-soak-bridge"
    s = Bridge(args)
    s.t_down = None

    def stop(sig, frame):
        raise KeyboardInterrupt("signal %d" % sig)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    rc = 2
    try:
        s.preflight()
        soak.stale_cleanup()
        s.setup_dirs()
        s.setup_fs()
        s.setup_net()
        s.start_servers()
        s.say("bridge run %s: %s; spool %s" % (s.nonce, s.link_desc, s.fs_desc))
        s.timeline()
        rc = s.report()
    except CannotRun as e:
        print("soak-bridge: cannot run here: %s" % e, flush=True)
        rc = 3
    except KeyboardInterrupt as e:
        print("soak-bridge: could not check: interrupted (%s)" % (e or "SIGINT"), flush=True)
        rc = 2
    except Exception as e:          # noqa: BLE001 - a loud failure, not a pass
        import traceback
        traceback.print_exc()
        print("soak-bridge: could not check: the harness failed: %s: %s"
              % (type(e).__name__, e), flush=True)
        rc = 2
    finally:
        s.cleanup()
    return rc


if __name__ == "__main__":
    sys.exit(main())
