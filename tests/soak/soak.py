#!/usr/bin/env python3
"""myq's soak (issue 23): the field trial as a harness, time-compressed.

    python3 tests/soak/soak.py [--minutes N] [--dir DIR] [--keep]
    python3 tests/soak/soak.py --bridge [--dir DIR] [--keep]    (bridge.py)

`make soak` runs the short version (about 4 minutes); `make soak
SOAK_MINUTES=N` stretches every phase so that the timeline lasts about N
minutes.  Root only (network namespaces, a loop mount).  See README.md
beside this file for what it does and what the summary's fields mean.

Exit status: 0 every check passed; 1 a promise was broken (lost > 0 or
dup_unexplained > 0); 2 the harness could not check what it claims (a
receiver never reached, a fault that did not take effect, a count that is
not this run's); 3 it cannot run here (not root, no netns, no mosquitto,
...), said on a line starting `soak: cannot run here:`; 4 the capacity
forecast was off (est_drain_s beyond +-25 % of the drain measured after it:
`forecast=off` on the last line, `soak: forecast off: ...` before it).
"""
import argparse
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MYQ_SRC = os.path.join(REPO, "myq.py")

RATE = 20.0                 # readings a second, all paths together
PATHS = ("py", "sh", "cli")
HTTP_POLICY = ["handler=http", "batch=100", "batch_wait=5s", "gzip=true",
               "order=live-first", "live=15s", "backlog_share=50"]
MQTT_POLICY = ["handler=mqtt", "batch=50"]
BATCH, BATCH_WAIT = 100, 5.0
UPLINK = "32K/s"            # the worker's --uplink-rate: the link capped (issue 41)
DELAY, LOSS, RATE_LIMIT = 0.1, 0.015, "1mbit"
# A request the worker sent before a fault may reach the receiver after it
# (100 ms each way, loss spikes up to 0.6 s, a queue at 1 Mbit/s): a
# duplicate is explained by a fault that had its job in flight and came
# between its previous delivery (or at most this long before it) and this one.
LINK_GRACE = 2.0
# The capacity forecast (issue 37): after the mid-drain restart, once a
# type's deliveries are seen again and this long has passed, `myq stats
# --json` is asked for its est_drain_s (2 s: two of the worker's rate lines,
# not the probe's one job alone); the time until every reading of that
# type waiting then was delivered is measured against it.
FORECAST_AFTER, FORECAST_POLL, FORECAST_TOL = 2.0, 0.5, 25.0
# Live data first (issue 41): the lag of the readings made in this window
# after link-up, while the backlog drains beside them.
LIVE_WINDOW = 30.0
SUBNET = ("10.213.7.1", "10.213.7.2")       # device, server (inside the netns only)
HTTP_PORT, MQTT_PORT = 8080, 1883           # the server's
HTTP_PORT_B, L_HTTP_B = 8081, 18081         # the second receiver's (tele's url B)
L_HTTP, L_MQTT = 18080, 11883               # the link's, on the device's loopback

# The timeline of the short run, seconds; --minutes scales every phase.
BASE = [("warm", 8), ("steady", 25), ("kill1", 1), ("settle-kill1", 12),
        ("503", 15), ("settle-503", 12), ("broker-down", 6), ("settle-broker", 12),
        ("disk-full", 12), ("settle-full", 12), ("link-down", 40), ("steady-b", 12)]
BASE_S = sum(s for _, s in BASE)

SHELL_RECIPE = r'''set -e
printf '%s\n' "$JOB" > "$SPOOL/tmp/$ID.json"
mv "$SPOOL/tmp/$ID.json" "$SPOOL/incoming/$ID.json"
'''


class CannotRun(Exception):
    pass


class Soak(object):
    def __init__(self, args):
        self.args = args
        self.scale = (args.minutes * 60.0 / BASE_S) if args.minutes else 1.0
        self.nonce = "%x%04x" % (int(time.time()) & 0xffffff, random.randrange(1 << 16))
        self.py = sys.executable
        self.procs = {}            # name -> Popen (all we started)
        self.events = []
        self.problems = []         # what the harness could not check
        self.lock = threading.Lock()
        self.accepted = {}         # id -> (t_accepted, path, type)
        self.refused = {p: {} for p in PATHS}     # path -> reason -> count
        self.attempts = {p: 0 for p in PATHS}
        self.first = {}            # id -> first delivery time (live tail)
        self.deliveries = 0
        self.stop_producing = threading.Event()
        self.stop_all = threading.Event()
        self.worker = None
        self.worker_lives = []     # {"pid", "start", "end", "cpu_s", "hwm_kb", "how"}
        self.worker_hwm = 0
        self.inodes_max = 0
        self.inodes_base = None
        self.mounted = self.loopdev = None
        self.netns = []
        self.phase = "setup"
        self.phases = []           # (t_start, name)
        self.fault = {}            # name -> details
        self.last_delivery = 0.0   # time of the latest delivery seen
        self.outage_cpu_pct = self.outage_mb_per_h = None
        self.t_drained = self.t_up = None
        self.probe_s = 0.0
        self.cpu_samples = []      # (time, worker pid, its CPU seconds so far)
        self.worker_dead_seen = False
        self.forecasts = {}        # type -> {"t", "est", "waiting", "stats_s"}

    # ------------------------------------------------------------------ util
    def say(self, *a):
        print("soak: " + " ".join(str(x) for x in a), flush=True)

    def event(self, ev, **kw):
        kw["t"] = time.time()
        kw["ev"] = ev
        kw["phase"] = self.phase
        with self.lock:
            self.events.append(kw)
            self.evf.write(json.dumps(kw, sort_keys=True) + "\n")
            self.evf.flush()
        return kw

    def problem(self, text):
        self.problems.append(text)
        self.say("CHECK FAILED:", text)

    def run(self, cmd, check=True, **kw):
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           universal_newlines=True, **kw)
        if check and r.returncode != 0:
            raise RuntimeError("%s: exit %d: %s" % (" ".join(cmd), r.returncode,
                                                   r.stdout.strip()[-500:]))
        return r

    def spawn(self, name, cmd, ns=None, log=None, **kw):
        if ns:
            cmd = ["ip", "netns", "exec", ns] + cmd
        out = open(log or os.path.join(self.dir, name + ".out"), "ab")
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, cwd=self.dir, **kw)
        out.close()
        self.procs[name] = p
        return p

    def wait_until(self, cond, timeout, what, step=0.05):
        end = time.time() + timeout
        while time.time() < end:
            v = cond()
            if v:
                return v
            time.sleep(step)
        raise RuntimeError("timed out after %.0f s waiting for %s" % (timeout, what))

    def sleep(self, seconds):
        end = time.time() + seconds
        while not self.stop_all.is_set():
            left = end - time.time()
            if left <= 0:
                return
            time.sleep(min(left, 0.1))

    def set_phase(self, name):
        self.phase = name
        self.phases.append((time.time(), name))
        self.event("phase", name=name)

    def dur(self, name):
        return dict(BASE)[name] * self.scale

    # ------------------------------------------------------------ preflight
    def preflight(self):
        if os.geteuid() != 0:
            raise CannotRun("needs root (network namespaces, a loop mount)")
        for tool in ("ip", "tc", "mount", "umount"):
            if shutil.which(tool) is None:
                raise CannotRun("no %s" % tool)
        self.mosquitto = shutil.which("mosquitto") or next(
            (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")
             if os.access(p, os.X_OK)), None)
        if self.mosquitto is None:
            raise CannotRun("no mosquitto (apt-get install mosquitto)")
        if sys.version_info < (3, 7):
            raise CannotRun("the harness needs Python 3.7+")

    # ----------------------------------------------------------------- setup
    def setup_dirs(self):
        base = self.args.dir or "/var/tmp/myq-soak"
        os.makedirs(base, exist_ok=True)
        runs = sorted(n for n in os.listdir(base) if n.startswith("run-"))
        for old in runs[:-4]:               # the logs of the last 5 runs stay
            shutil.rmtree(os.path.join(base, old), ignore_errors=True)
        self.dir = os.path.join(base, "run-%s-%s" % (time.strftime("%Y%m%dT%H%M%S"), self.nonce))
        os.makedirs(self.dir)
        last = os.path.join(base, "last")
        try:
            os.unlink(last)
        except OSError:
            pass
        os.symlink(self.dir, last)
        self.evf = open(os.path.join(self.dir, "events.jsonl"), "a")
        # the module layout of the README (/usr/lib/myq + a launcher), so
        # that `myq enqueue` starts from bytecode as on a device
        lib = os.path.join(self.dir, "lib")
        os.makedirs(lib)
        shutil.copy2(MYQ_SRC, os.path.join(lib, "myq.py"))
        want = hashlib.sha256(open(MYQ_SRC, "rb").read()).hexdigest()
        got = hashlib.sha256(open(os.path.join(lib, "myq.py"), "rb").read()).hexdigest()
        if want != got:
            raise RuntimeError("the copy of myq.py differs from %s" % MYQ_SRC)
        self.myq_sha = want[:12]
        self.myq = os.path.join(self.dir, "bin", "myq")
        os.makedirs(os.path.dirname(self.myq))
        with open(self.myq, "w") as f:
            f.write("#!%s\nimport sys\nsys.path.insert(0, %r)\nimport myq\n"
                    "sys.exit(myq.main())\n" % (self.py, lib))
        os.chmod(self.myq, 0o755)
        # the bytecode cache that `myq version` as root writes on a device
        # (written here whatever PYTHONDONTWRITEBYTECODE says)
        self.run([self.py, "-c", "import py_compile,sys; py_compile.compile(sys.argv[1], "
                  "doraise=True)", os.path.join(lib, "myq.py")])
        self.run([self.py, self.myq, "version"])
        if not os.listdir(os.path.join(lib, "__pycache__")):
            raise RuntimeError("no bytecode cache was written")
        sys.path.insert(0, lib)
        import myq
        if os.path.realpath(myq.__file__) != os.path.realpath(os.path.join(lib, "myq.py")):
            raise RuntimeError("imported myq from %s, not the copy" % myq.__file__)
        self.myqmod = myq

    def setup_fs(self):
        """The spool on its own small ext4 on a loop device (tmpfs where no
        loop device can be had), verified to be where it should."""
        self.mnt = os.path.join(self.dir, "mnt")
        os.makedirs(self.mnt)
        size_mb = int(96 * max(1.0, self.scale / 2))
        inodes = 32768 * max(1, int(self.scale / 2))
        img = os.path.join(self.dir, "spool.img")
        kind = None
        if shutil.which("losetup") and shutil.which("mkfs.ext4"):
            try:
                with open(img, "wb") as f:
                    f.truncate(size_mb << 20)
                self.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-N", str(inodes), img])
                self.loopdev = self.run(["losetup", "-f", "--show", img]).stdout.strip()
                self.run(["mount", "-t", "ext4", self.loopdev, self.mnt])
                self.mounted = self.mnt
                kind = "ext4"
            except (RuntimeError, OSError) as e:
                self.say("warning: no loop ext4 (%s); using tmpfs" % e)
                if self.loopdev:
                    self.run(["losetup", "-d", self.loopdev], check=False)
                    self.loopdev = None
        if kind is None:
            self.run(["mount", "-t", "tmpfs", "-o", "size=%dm,nr_inodes=%d,mode=0755"
                      % (size_mb, inodes), "myq-soak", self.mnt])
            self.mounted = self.mnt
            kind = "tmpfs"
        # verify: the mount table says so, and the spool's device is the mount's
        src = fstype = None
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if parts[4] == self.mnt:
                    i = parts.index("-")
                    fstype, src = parts[i + 1], parts[i + 2]
        if fstype != kind or (kind == "ext4" and src != self.loopdev):
            raise RuntimeError("the spool's mount is %s on %s, not %s" % (fstype, src, kind))
        self.spool = os.path.join(self.mnt, "spool")
        self.run([self.py, self.myq, "--spool", self.spool, "init"])
        if os.stat(self.spool).st_dev != os.stat(self.mnt).st_dev or \
                os.stat(self.spool).st_dev == os.stat(self.dir).st_dev:
            raise RuntimeError("the spool is not on the soak's filesystem")
        st = os.statvfs(self.spool)
        self.fs_desc = "%s on %s (%d MiB, %d inodes)" % (kind, src, st.f_blocks * st.f_frsize >> 20,
                                                         st.f_files)
        self.inodes_base = st.f_files - st.f_ffree
        for t, pol in (("tele", HTTP_POLICY), ("reading", MQTT_POLICY)):
            self.run([self.py, self.myq, "--spool", self.spool, "policy", t] + pol)
        self.event("fs", desc=self.fs_desc)

    def setup_net(self):
        tag = "%d" % os.getpid()
        self.ns_dev, self.ns_srv = "myqsoak-dev-" + tag, "myqsoak-srv-" + tag
        self.veth_dev, self.veth_srv = "msk%sd" % tag[-7:], "msk%ss" % tag[-7:]
        for ns in (self.ns_dev, self.ns_srv):
            r = self.run(["ip", "netns", "add", ns], check=False)
            if r.returncode != 0:
                raise CannotRun("ip netns add failed: %s" % r.stdout.strip())
            self.netns.append(ns)
        r = self.run(["ip", "link", "add", self.veth_dev, "netns", self.ns_dev, "type", "veth",
                      "peer", "name", self.veth_srv, "netns", self.ns_srv], check=False)
        if r.returncode != 0:
            raise CannotRun("no veth pair: %s" % r.stdout.strip())
        for ns, dev, addr in ((self.ns_dev, self.veth_dev, SUBNET[0]),
                              (self.ns_srv, self.veth_srv, SUBNET[1])):
            self.run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self.run(["ip", "-n", ns, "addr", "add", addr + "/30", "dev", dev])
            self.run(["ip", "-n", ns, "link", "set", dev, "up"])
        # netem where the kernel has it; else the user-space link (link.py)
        netem = self.run(["ip", "netns", "exec", self.ns_dev, "tc", "qdisc", "add", "dev",
                          self.veth_dev, "root", "netem", "delay", "%dms" % (DELAY * 1000),
                          "loss", "%.1f%%" % (LOSS * 100), "rate", RATE_LIMIT], check=False)
        self.netem = netem.returncode == 0
        if self.netem:
            self.run(["ip", "netns", "exec", self.ns_srv, "tc", "qdisc", "add", "dev",
                      self.veth_srv, "root", "netem", "delay", "%dms" % (DELAY * 1000),
                      "loss", "%.1f%%" % (LOSS * 100), "rate", RATE_LIMIT])
            self.link_desc = "netem (delay %d ms each way, loss %.1f %%, %s)" % (
                DELAY * 1000, LOSS * 100, RATE_LIMIT)
        else:
            for ns, dev in ((self.ns_dev, self.veth_dev), (self.ns_srv, self.veth_srv)):
                self.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                          "tbf", "rate", RATE_LIMIT, "burst", "8kb", "latency", "500ms"])
            self.link_desc = ("no sch_netem in this kernel: rate %s by tbf on the veth pair, "
                              "delay %d ms each way and %.1f %% loss (as delay spikes) by "
                              "tests/soak/link.py" % (RATE_LIMIT, DELAY * 1000, LOSS * 100))
        for ns, dev in ((self.ns_dev, self.veth_dev), (self.ns_srv, self.veth_srv)):
            q = self.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev]).stdout
            if ("netem" if self.netem else "tbf") not in q:
                raise RuntimeError("no qdisc on %s: %s" % (dev, q))
        self.event("net", desc=self.link_desc)

    def start_servers(self):
        srv, dev = self.ns_srv, self.ns_dev
        self.recv_log = os.path.join(self.dir, "receiver.jsonl")
        self.recv_log_b = os.path.join(self.dir, "receiver-b.jsonl")
        self.sub_log = os.path.join(self.dir, "subscriber.jsonl")
        self.link_log = os.path.join(self.dir, "link.jsonl")
        self.spawn("receiver", [self.py, os.path.join(HERE, "receiver.py"), "--listen",
                                "0.0.0.0:%d" % HTTP_PORT, "--run", self.nonce,
                                "--log", self.recv_log], ns=srv)
        self.spawn("receiver-b", [self.py, os.path.join(HERE, "receiver.py"), "--listen",
                                  "0.0.0.0:%d" % HTTP_PORT_B, "--run", self.nonce,
                                  "--log", self.recv_log_b], ns=srv)
        self.broker_conf = os.path.join(self.dir, "mosquitto.conf")
        self.broker_log = os.path.join(self.dir, "mosquitto.log")
        with open(self.broker_conf, "w") as f:
            f.write("listener %d\nallow_anonymous true\npersistence false\n"
                    "log_dest file %s\nlog_type all\nconnection_messages true\n"
                    "log_timestamp true\nuser root\n" % (MQTT_PORT, self.broker_log))
        self.start_broker()
        self.spawn("subscriber", [self.py, os.path.join(HERE, "subscriber.py"),
                                  "--port", str(MQTT_PORT), "--topic", "soak/%s/#" % self.nonce,
                                  "--run", self.nonce, "--log", self.sub_log], ns=srv)
        if not self.netem:
            self.spawn("link", [self.py, os.path.join(HERE, "link.py"),
                                "--map", "127.0.0.1:%d=%s:%d" % (L_HTTP, SUBNET[1], HTTP_PORT),
                                "--map", "127.0.0.1:%d=%s:%d" % (L_MQTT, SUBNET[1], MQTT_PORT),
                                "--map", "127.0.0.1:%d=%s:%d" % (L_HTTP_B, SUBNET[1],
                                                                 HTTP_PORT_B),
                                "--delay", str(DELAY), "--loss", str(LOSS),
                                "--seed", str(int(self.nonce, 16)), "--log", self.link_log],
                       ns=dev)
            self.http_url = "http://127.0.0.1:%d/ingest" % L_HTTP
            self.http_url_b = "http://127.0.0.1:%d/ingest" % L_HTTP_B
            self.mqtt_url = "mqtt://127.0.0.1:%d" % L_MQTT
            self.wait_until(lambda: any('"ev": "start"' in l for l in _lines(self.link_log)),
                            10, "the link emulator")
        else:
            self.http_url = "http://%s:%d/ingest" % (SUBNET[1], HTTP_PORT)
            self.http_url_b = "http://%s:%d/ingest" % (SUBNET[1], HTTP_PORT_B)
            self.mqtt_url = "mqtt://%s:%d" % (SUBNET[1], MQTT_PORT)
        for log in (self.recv_log, self.recv_log_b):
            self.wait_until(lambda: any(json.loads(l).get("run") == self.nonce
                                        for l in _lines(log) if '"start"' in l),
                            10, "the receiver")
        # tele goes to receiver A, failing over to B (SPEC 10: producers
        # send only the body)
        self.run([self.py, self.myq, "--spool", self.spool, "policy", "tele",
                  "url=%s %s" % (self.http_url, self.http_url_b)])
        self.wait_until(lambda: any('"suback"' in l for l in _lines(self.sub_log)),
                        15, "the MQTT subscriber's SUBACK")
        for name, ns in (("receiver", srv), ("receiver-b", srv), ("broker", srv),
                         ("subscriber", srv), ("link", dev)):
            if name in self.procs:
                self.check_ns(self.procs[name].pid, ns, "the " + name)
        # the path through the link, from the device's namespace
        probe = ("import time,urllib.request as u;t=time.time();"
                 "r=u.urlopen(u.Request(%r,data=b'[]',headers={'Content-Type':"
                 "'application/json','Idempotency-Key':'probe-%s'}),timeout=20);"
                 "print(r.status,round(time.time()-t,3))" % (
                     self.http_url.replace("/ingest", "/probe"), self.nonce))
        r = self.run(["ip", "netns", "exec", dev, self.py, "-c", probe], check=False)
        out = r.stdout.split()
        if r.returncode != 0 or not out or out[0] != "200":
            raise RuntimeError("the receiver cannot be reached from the device "
                               "namespace: %s" % r.stdout.strip()[-300:])
        self.probe_s = float(out[1])
        if self.probe_s < 3 * DELAY:
            self.problem("a request through the link took %.3f s: the delay is not in effect"
                         % self.probe_s)
        if not any('"/probe"' in l for l in _lines(self.recv_log)):
            self.problem("the probe request did not reach this run's receiver")
        self.event("probe", seconds=self.probe_s)

    def start_broker(self):
        p = self.spawn("broker", [self.mosquitto, "-c", self.broker_conf], ns=self.ns_srv)
        n = self.broker_starts = getattr(self, "broker_starts", 0) + 1
        self.wait_until(lambda: sum(1 for l in _lines(self.broker_log)
                                    if re.search(r"mosquitto version \S+ running", l)) >= n,
                        15, "mosquitto to start")
        return p

    # ---------------------------------------------------------------- worker
    def start_worker(self, how="start"):
        wl = os.path.join(self.dir, "worker.log")
        cmd = [self.py, self.myq, "--spool", self.spool, "worker",
               "--mqtt", self.mqtt_url, "--concurrency", "2", "--timeout", "20",
               "--max-attempts", "50", "--backoff-max", "900", "--stats-interval", "5",
               "--uplink-rate", UPLINK, "--log", wl]
        p = self.spawn("worker", cmd, ns=self.ns_dev)
        # `ip netns exec` execs: the pid becomes the worker's own
        self.wait_until(lambda: b"worker" in _read(b"/proc/%d/cmdline" % p.pid)
                        and not _read(b"/proc/%d/cmdline" % p.pid).startswith(b"ip\0"),
                        10, "the worker to start")
        self.check_ns(p.pid, self.ns_dev, "the worker")
        self.worker = p
        self.worker_lives.append({"pid": p.pid, "start": time.time(), "how": how})
        self.event("worker-start", pid=p.pid, how=how)

    def check_ns(self, pid, ns, what):
        """`what` (pid) runs in network namespace ns, not the host's."""
        try:
            mine = os.stat("/proc/%d/ns/net" % pid).st_ino
            want = os.stat("/run/netns/%s" % ns).st_ino
        except OSError as e:
            self.problem("cannot tell the namespace of %s: %s" % (what, e))
            return
        if mine != want:
            self.problem("%s (pid %d) is not in the namespace %s" % (what, pid, ns))

    def worker_cpu_now(self, w=None):
        """utime+stime+cutime+cstime of the live worker, seconds."""
        w = w or self.worker
        if w is None:
            return None
        f = _read(b"/proc/%d/stat" % w.pid).decode()
        if not f:
            return None
        v = f.rsplit(")", 1)[1].split()
        return sum(int(x) for x in v[11:15]) / float(os.sysconf("SC_CLK_TCK"))

    def sectors_now(self):
        """Sectors written so far to the spool's loop device, after a
        sync (None on tmpfs: no device to read)."""
        if not self.loopdev:
            return None
        os.sync()
        name = os.path.basename(self.loopdev)
        return int(_read(("/sys/block/%s/stat" % name).encode()).split()[6])

    def sample_worker(self):
        w = self.worker
        if w is None:
            return
        st = _read(b"/proc/%d/status" % w.pid).decode()
        m = re.search(r"VmHWM:\s+(\d+) kB", st)
        if m:
            self.worker_hwm = max(self.worker_hwm, int(m.group(1)))
            self.worker_lives[-1]["hwm_kb"] = max(self.worker_lives[-1].get("hwm_kb", 0),
                                                  int(m.group(1)))

    def reap_worker(self, sig):
        p = self.worker
        self.sample_worker()
        self.worker = None          # (the monitor: not a death of its own)
        os.kill(p.pid, sig)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        t = time.time()
        life = self.worker_lives[-1]
        life.update(end=t, cpu_s=ru.ru_utime + ru.ru_stime, status=p.returncode,
                    maxrss_kb=ru.ru_maxrss)
        # (not ru_maxrss: it holds what the harness had when it forked)
        self.worker_dead_seen = False
        del self.procs["worker"]
        self.event("worker-end", **life)
        return t, p.returncode

    def inflight(self):
        """The ids of the jobs claimed now (processing/: ID+TOKEN.*, and
        the ids recorded for batches)."""
        ids = set()
        d = os.path.join(self.spool, "processing")
        for name in os.listdir(d):
            if name.endswith(".batch"):
                try:
                    ids.update(json.loads(_read(os.path.join(d, name).encode())
                                          .decode() or "{}").get("ids") or ())
                except ValueError:
                    pass
            if "+" in name:
                ids.add(name.split("+", 1)[0])
        return ids

    def kill_worker(self, name, require_inflight=True):
        """kill -9 while jobs are in flight (waits up to 10 s for a claim)."""
        if require_inflight:
            try:
                self.wait_until(lambda: any("+" in n for n in
                                            os.listdir(os.path.join(self.spool, "processing"))),
                                10, "a claim to kill the worker in", step=0.01)
            except RuntimeError:
                pass
        t, rc = self.reap_worker(signal.SIGKILL)
        ids = self.inflight()
        if rc != -signal.SIGKILL:
            self.problem("%s: the worker ended %s, not by SIGKILL" % (name, rc))
        e = self.event("fault", kind="worker_kill", name=name, t_kill=t, inflight=sorted(ids))
        self.fault[name] = e
        self.say("%s: kill -9 at +%.1f s, %d jobs in flight" % (name, t - self.t0, len(ids)))
        return e

    # ------------------------------------------------------------- producers
    def reading(self, seq, path, jid, kind):
        body = {"rid": jid, "run": self.nonce, "seq": seq, "path": path, "t": time.time(),
                "sensor": "edge-%02d" % (seq % 7), "temp_c": round(18 + (seq % 97) / 10.0, 1),
                "rh": (seq * 7) % 100, "batt_mv": 3700 + seq % 400}
        body["pad"] = ""
        n = len(json.dumps(body))
        body["pad"] = "x" * max(0, 300 - n)
        if kind == "tele":
            return body         # (the type's url says where)
        return {"topic": "soak/%s/%s" % (self.nonce, path), "message": body}

    def produce(self, k, path):
        myq = self.myqmod
        start = self.t_prod
        i = 0
        plog = open(os.path.join(self.dir, "producer-%s.jsonl" % path), "a")
        while not self.stop_producing.is_set():
            seq = i * len(PATHS) + k
            due = start + seq / RATE
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)
                if self.stop_producing.is_set():
                    break
            i += 1
            kind = "tele" if seq % 2 == 0 else "reading"
            jid = "%s-%s-%07d" % (self.nonce, path, seq)
            payload = self.reading(seq, path, jid, kind)
            ok, why = False, None
            try:
                if path == "py":
                    myq.enqueue(self.spool, kind, payload, id=jid)
                    ok = True
                elif path == "sh":
                    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SPOOL": self.spool,
                           "ID": jid, "JOB": json.dumps({"type": kind, "payload": payload})}
                    r = subprocess.run(["/bin/sh", "-c", SHELL_RECIPE], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                    ok = r.returncode == 0
                    why = None if ok else "exit %d: %s" % (r.returncode,
                                                         r.stdout.decode(errors="replace")[-80:].strip())
                else:
                    r = subprocess.run([self.py, self.myq, "--spool", self.spool, "enqueue",
                                        kind, json.dumps(payload), "--id", jid],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                    ok = r.returncode == 0 and r.stdout.decode().strip() == jid
                    why = None if ok else "exit %d" % r.returncode
            except myq.MyqError as e:
                why = type(e).__name__
            except OSError as e:
                why = "OSError %s" % errno.errorcode.get(e.errno, e.errno)
            t = time.time()
            with self.lock:
                self.attempts[path] += 1
                if ok:
                    self.accepted[jid] = (t, path, kind)
                else:
                    key = re.sub(r":.*", "", why or "?")
                    self.refused[path][key] = self.refused[path].get(key, 0) + 1
            plog.write(json.dumps({"t": t, "id": jid, "ok": ok, "why": why,
                                   "phase": self.phase}) + "\n")
        plog.close()

    # --------------------------------------------------------------- monitor
    def monitor(self):
        """Every 0.25 s: the worker's memory, the spool's inodes; and the
        receivers' logs, read as they grow (first delivery of each id)."""
        offs = {self.recv_log: 0, self.recv_log_b: 0, self.sub_log: 0}
        while not self.stop_all.is_set():
            try:
                self.sample_worker()
                w = self.worker
                if w is not None and not self.worker_dead_seen:
                    stat = _read(b"/proc/%d/stat" % w.pid).decode()
                    if stat and stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        self.worker_dead_seen = True
                        self.problem("the worker (pid %d) died by itself at +%.1f s"
                                     % (w.pid, time.time() - self.t0))
                c = self.worker_cpu_now(w) if w is not None else None
                if c is not None:
                    self.cpu_samples.append((time.time(), w.pid, c))
                st = os.statvfs(self.spool)
                self.inodes_max = max(self.inodes_max, st.f_files - st.f_ffree)
            except (OSError, ValueError, IndexError):
                pass
            for path in offs:
                with open(path) as f:
                    f.seek(offs[path])
                    data = f.read()
                cut = data.rfind("\n") + 1
                offs[path] += len(data[:cut].encode())
                for line in data[:cut].splitlines():
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    for jid, t in _delivered(rec):
                        with self.lock:
                            self.deliveries += 1
                            self.first.setdefault(jid, t)
                            self.last_delivery = max(self.last_delivery, t)
            time.sleep(0.25)

    # ---------------------------------------------------------------- faults
    def fault_503(self):
        rp = self.procs["receiver"].pid
        os.kill(rp, signal.SIGUSR1)
        t0 = time.time()
        self.sleep(self.dur("503"))
        os.kill(rp, signal.SIGUSR2)
        t1 = time.time()
        self.fault["503"] = self.event("fault", kind="503", t_on=t0, t_off=t1)
        n = sum(1 for r in _recs(self.recv_log) if r.get("status") == 503)
        # the primary's outage: tele fails over to receiver B meanwhile
        nb = sum(len(r.get("rids") or ()) for r in _recs(self.recv_log_b)
                 if r.get("status") == 200 and t0 <= r.get("t0", 0) <= t1 + LINK_GRACE)
        self.fault["503"]["to_b"] = nb
        self.say("503: %.0f s of 503s, %d requests answered 503; %d readings to receiver B"
                 % (t1 - t0, n, nb))
        if n == 0:
            self.problem("the receiver answered no 503 while told to")
        if nb == 0:
            self.problem("nothing failed over to receiver B while A answered 503")

    def fault_broker(self):
        p = self.procs["broker"]
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        t = time.time()
        ids = self.inflight()
        self.fault["broker"] = self.event("fault", kind="broker_kill", name="broker",
                                          t_kill=t, inflight=sorted(ids))
        self.sleep(self.dur("broker-down"))
        self.start_broker()
        t1 = time.time()
        self.say("broker: kill -9 at +%.1f s (%d jobs in flight), restarted after %.1f s"
                 % (t - self.t0, len(ids), t1 - t))
        self.fault["broker"]["t_restart"] = t1

    def fault_disk_full(self):
        filler = os.path.join(self.mnt, "filler")
        fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
        off = 0
        st = os.statvfs(self.mnt)
        chunk = st.f_bavail * st.f_frsize
        while chunk >= 4096:
            try:
                os.posix_fallocate(fd, off, chunk)
                off += chunk
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                chunk //= 2
        # tmpfs and ext4 alike: the last blocks with plain writes
        try:
            while True:
                os.pwrite(fd, b"\0" * 4096, off)
                off += 4096
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        os.fsync(fd)
        os.close(fd)
        st = os.statvfs(self.mnt)
        t0 = time.time()
        with self.lock:
            before = sum(sum(r.values()) for r in self.refused.values())
        self.say("disk full: filler of %d MiB, %d KiB left" % (off >> 20, st.f_bavail * st.f_frsize >> 10))
        free_min = st.f_bavail * st.f_frsize
        end = t0 + self.dur("disk-full")
        while time.time() < end:
            time.sleep(0.2)
            st = os.statvfs(self.mnt)
            free_min = min(free_min, st.f_bavail * st.f_frsize)
        os.unlink(filler)
        t1 = time.time()
        with self.lock:
            refused = sum(sum(r.values()) for r in self.refused.values()) - before
        self.fault["disk-full"] = self.event("fault", kind="disk_full", t_on=t0, t_off=t1,
                                             filler_bytes=off, refused=refused,
                                             free_left=free_min)
        self.say("disk full: %.0f s, %d readings refused meanwhile" % (t1 - t0, refused))
        if refused == 0:
            self.problem("the full disk refused no reading: the fault did not take effect")
        if free_min > (1 << 20):
            self.problem("the filler left %d KiB free" % (free_min >> 10))

    def link(self, up):
        if self.netem:
            for ns, dev in ((self.ns_dev, self.veth_dev), (self.ns_srv, self.veth_srv)):
                self.run(["ip", "-n", ns, "link", "set", dev, "up" if up else "down"])
        else:
            lp = self.procs["link"].pid
            if up:
                self.run(["ip", "-n", self.ns_dev, "link", "set", self.veth_dev, "up"])
                self.run(["ip", "-n", self.ns_srv, "link", "set", self.veth_srv, "up"])
                self.wait_until(lambda: "LOWER_UP" in self.run(
                    ["ip", "-n", self.ns_dev, "link", "show", self.veth_dev]).stdout,
                    10, "the veth carrier")
                os.kill(lp, signal.SIGUSR2)
                for ns, dev in ((self.ns_dev, self.veth_dev), (self.ns_srv, self.veth_srv)):
                    q = self.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev",
                                  dev]).stdout
                    if "tbf" not in q:
                        self.problem("after link-up %s has no tbf: %s" % (dev, q.strip()))
            else:
                os.kill(lp, signal.SIGUSR1)
                self.run(["ip", "-n", self.ns_dev, "link", "set", self.veth_dev, "down"])
                self.run(["ip", "-n", self.ns_srv, "link", "set", self.veth_srv, "down"])

    def fault_link(self):
        self.link(False)
        t0 = time.time()
        ids = self.inflight()
        c0, s0 = self.worker_cpu_now(), self.sectors_now()
        self.fault["link"] = e = self.event("fault", kind="link_down", name="link",
                                            t_kill=t0, inflight=sorted(ids))
        self.say("link down at +%.1f s (%d jobs in flight)" % (t0 - self.t0, len(ids)))
        self.sleep(self.dur("link-down"))
        c1, s1 = self.worker_cpu_now(), self.sectors_now()
        t1 = time.time()
        self.link(True)
        self.t_up = time.time()
        e.update(t_up=self.t_up, cpu_s=(c1 - c0) if c0 is not None and c1 is not None else None,
                 wall_s=t1 - t0)
        self.event("link-up", t_down=t0, t_up=self.t_up, cpu_s=e["cpu_s"], wall_s=t1 - t0)
        self.outage_cpu_pct = 100.0 * e["cpu_s"] / (t1 - t0) if e["cpu_s"] is not None else None
        # the flash an hour of this outage costs: the arrivals' own jobs and
        # what the hold writes (the spool's loop device, from a sync to one)
        if s0 is not None and s1 is not None:
            self.outage_mb_per_h = (s1 - s0) * 512.0 / (t1 - t0) * 3600 / 1e6
        # it was down: nothing arrived in the middle of the outage
        mid = [r for r in _recs(self.recv_log) + _recs(self.recv_log_b) + _recs(self.sub_log)
               if r.get("ev") in ("req", "msg") and t0 + 1.0 < r.get("t0", r.get("t", 0)) < t1]
        if mid:
            self.problem("%d deliveries arrived while the link was down" % len(mid))
        self.say("link up at +%.1f s after %.0f s down; worker CPU %.2f %% meanwhile"
                 % (self.t_up - self.t0, t1 - t0, self.outage_cpu_pct or -1))

    def drain_after_link(self):
        """Kill the worker mid-drain (at the first delivery after link-up),
        then wait until every reading accepted before link-up arrived."""
        t_up = self.t_up
        with self.lock:
            backlog = {j for j, (t, _, _) in self.accepted.items() if t < t_up}
        cap = max(120.0, 60 * self.scale)
        try:
            self.wait_until(lambda: self.last_delivery > t_up, cap,
                            "a delivery after link-up", step=0.02)
        except RuntimeError as e:
            self.problem(str(e))
            return
        # then kill -9 while jobs are in flight and the backlog is not
        # yet delivered (a claim within 10 s)
        d = os.path.join(self.spool, "processing")
        end = time.time() + 10
        while time.time() < end:
            with self.lock:
                left = len([j for j in backlog if j not in self.first])
            if left == 0 or any(n.endswith(".json") and "+" in n for n in os.listdir(d)):
                break
            time.sleep(0.01)
        e = self.kill_worker("kill2-mid-drain", require_inflight=False)
        e["backlog_left"] = left
        if left == 0:
            self.problem("the mid-drain kill came after the backlog had drained")
        else:
            self.say("kill2-mid-drain: %d of the %d backlog readings not yet delivered"
                     % (left, len(backlog)))
        time.sleep(0.5)
        self.start_worker("restart")
        fc_stop = threading.Event()
        fc = threading.Thread(target=self.forecast_watch, args=(time.time(), fc_stop),
                              daemon=True)
        fc.start()
        try:
            self.wait_until(lambda: all(j in self.first for j in backlog), cap,
                            "the backlog to drain", step=0.1)
            self.t_drained = time.time()
        except RuntimeError as e:
            self.t_drained = None
            self.problem(str(e))
        fc.join(30)
        fc_stop.set()

    def forecast_watch(self, t_restart, stop):
        """Each type's forecast (myq stats --json: est_drain_s) once its
        deliveries are seen again after the restart (FORECAST_AFTER later),
        while it has jobs waiting."""
        want = ("tele", "reading")
        end = time.time() + max(120.0, 60 * self.scale)
        while not stop.is_set() and time.time() < end and len(self.forecasts) < len(want):
            with self.lock:
                seen = {}
                for j, t in self.first.items():
                    a = self.accepted.get(j)
                    if a and t > t_restart and t < seen.get(a[2], 1e18):
                        seen[a[2]] = t
            ready = [k for k in want if k not in self.forecasts and k in seen
                     and time.time() >= seen[k] + FORECAST_AFTER]
            if ready:
                t0 = time.time()
                r = self.run([self.py, self.myq, "--spool", self.spool, "stats", "--json"],
                             check=False)
                t1 = time.time()
                try:
                    types = json.loads(r.stdout).get("types") or {}
                except ValueError:
                    types = {}
                for k in ready:
                    c = types.get(k) or {}
                    jobs = (c.get("waiting") or {}).get("jobs") or 0
                    if c.get("est_drain_s") is not None and jobs > 0:
                        self.forecasts[k] = f = {
                            "t": (t0 + t1) / 2, "est": float(c["est_drain_s"]),
                            "waiting": jobs, "stats_s": t1 - t0,
                            "delivered_per_s": c.get("delivered_per_s"),
                            "arrival_per_s": c.get("arrival_per_s"),
                            "since_first_s": (t0 + t1) / 2 - seen[k]}
                        self.event("forecast", type=k, t_forecast=f["t"], **dict((a, b) for a, b in f.items() if a != "t"))
            time.sleep(FORECAST_POLL)

    def forecast_check(self):
        """{type: (forecast_s, drained_s, err_pct)}: the drain measured from
        each forecast's moment until every reading of its type accepted
        before it and not yet delivered then was delivered."""
        out = {}
        for k in ("tele", "reading"):
            f = self.forecasts.get(k)
            if f is None:
                self.problem("no forecast for %s (est_drain_s null, or nothing waiting, "
                             "once its deliveries started again)" % k)
                continue
            t = f["t"]
            with self.lock:
                left = [j for j, a in self.accepted.items()
                        if a[2] == k and a[0] < t and self.first.get(j, 1e18) >= t]
                last = [self.first.get(j) for j in left]
            if not left:
                self.problem("%s drained before its forecast was taken" % k)
                continue
            if None in last:
                self.problem("%s: the backlog at its forecast never drained" % k)
                continue
            drained = max(last) - t
            err = 100.0 * (f["est"] - drained) / max(drained, 0.1)
            if k == "tele" and len(left) < BATCH:
                # less than a batch waits its batch_wait, not the rate
                self.say("forecast %s: not judged: %d readings waiting at it, less than a "
                         "batch of %d (they wait batch_wait %.0f s; est_drain_s=%.0f, "
                         "drained_s=%.1f)" % (k, len(left), BATCH, BATCH_WAIT, f["est"],
                                              drained))
                continue
            out[k] = (f["est"], drained, err)
            self.say("forecast %s: est_drain_s=%.0f (waiting %d, delivered_per_s %s, "
                     "arrival_per_s %s, %.1f s after its first delivery after the restart; "
                     "stats took %.2f s) drained_s=%.1f (%d readings) err=%+.0f %%" % (
                         k, f["est"], f["waiting"], f["delivered_per_s"], f["arrival_per_s"],
                         f["since_first_s"], f["stats_s"], drained, len(left), err))
        return out

    # ------------------------------------------------------------------ main
    def timeline(self):
        self.t0 = time.time()
        self.start_worker()
        self.t_prod = time.time()
        self.producers = [threading.Thread(target=self.produce, args=(k, p), daemon=True)
                          for k, p in enumerate(PATHS)]
        for t in self.producers:
            t.start()
        self.mon = threading.Thread(target=self.monitor, daemon=True)
        self.mon.start()
        self.net0 = self.net_bytes()
        self.set_phase("warm")
        self.sleep(self.dur("warm"))
        self.set_phase("steady")
        self.sleep(self.dur("steady"))
        self.set_phase("kill1")
        self.kill_worker("kill1")
        self.sleep(self.dur("kill1"))
        self.start_worker("restart")
        self.set_phase("settle-kill1")
        self.sleep(self.dur("settle-kill1"))
        self.set_phase("503")
        self.fault_503()
        self.set_phase("settle-503")
        self.sleep(self.dur("settle-503"))
        self.set_phase("broker-down")
        self.fault_broker()
        self.set_phase("settle-broker")
        self.sleep(self.dur("settle-broker"))
        self.set_phase("disk-full")
        self.fault_disk_full()
        self.set_phase("settle-full")
        self.sleep(self.dur("settle-full"))
        self.set_phase("link-down")
        self.fault_link()
        self.set_phase("drain")
        self.drain_after_link()
        self.set_phase("steady-b")
        self.sleep(self.dur("steady-b"))
        self.set_phase("final")
        self.stop_producing.set()
        for t in self.producers:
            t.join(30)
        t_stop = time.time()
        with self.lock:
            want = set(self.accepted)
        try:
            self.wait_until(lambda: all(j in self.first for j in want), 60 + 30 * self.scale,
                            "the last readings to arrive", step=0.2)
        except RuntimeError:
            pass            # counted as lost below
        # and the spool says the same: nothing ready, nothing claimed
        try:
            self.wait_until(lambda: self.spool_idle(), 20, "the spool to be idle", step=0.5)
        except RuntimeError:
            pass
        time.sleep(1.0)     # the last records of the receivers
        self.net1 = self.net_bytes()
        self.event("stopped", final_wait_s=time.time() - t_stop)
        _, rc = self.reap_worker(signal.SIGTERM)
        if rc != 0:
            self.problem("the worker exited %s on SIGTERM, not 0" % rc)
        self.stop_all.set()
        self.mon.join(5)

    def spool_idle(self):
        s = json.loads(self.run([self.py, self.myq, "--spool", self.spool, "stats",
                                 "--json"]).stdout)
        self.final_stats = s
        return s.get("ready") == 0 and s.get("processing") == 0 and s.get("scheduled") == 0

    def net_bytes(self):
        ns, dev = self.ns_dev, self.veth_dev
        j = json.loads(self.run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev]).stdout)
        s = j[0]["stats64"]
        return s["rx"]["bytes"] + s["tx"]["bytes"]

    # ---------------------------------------------------------------- report
    def report(self):
        recs = _recs(self.recv_log) + _recs(self.recv_log_b)
        msgs = [r for r in _recs(self.sub_log) if r.get("ev") == "msg"]
        reqs = [r for r in recs if r.get("ev") == "req" and r.get("path") != "/probe"]
        starts = [r for r in recs if r.get("ev") == "start"]
        if len(starts) != 2 or any(s.get("run") != self.nonce for s in starts):
            self.problem("the receivers' logs are not this run's alone")
        prefix = self.nonce + "-"
        # every delivery: (time, id, channel)
        deliv = {}
        foreign = 0
        mismatched = []         # requests not in the batch form (SPEC 10)
        for r in reqs:
            if r.get("status") != 200:
                continue
            if r.get("ids") != r.get("rids") or not r.get("array"):
                mismatched.append(r)
            if r.get("runs") != [self.nonce]:
                foreign += 1
            for jid, t in _delivered(r):
                deliv.setdefault(jid, []).append((t, "http", r.get("key")))
        for m in msgs:
            if m.get("run") != self.nonce:
                foreign += 1
            for jid, t in _delivered(m):
                deliv.setdefault(jid, []).append((t, "mqtt", None))
        foreign += sum(1 for j in deliv if not j.startswith(prefix))
        if foreign:
            self.problem("%d deliveries are not this run's" % foreign)
        if mismatched:
            # myq's contract (SPEC 10: a type with batch= always sends the
            # batch form, X-Myq-Ids in body order), not the harness's: said
            # loudly; the readings count by the ids in their bodies
            r = mismatched[0]
            self.say("WARNING: %d HTTP requests not in the batch form (a JSON array with "
                     "X-Myq-Ids listing its ids), e.g. at +%.1f: X-Myq-Ids=%s body ids=%s "
                     "Idempotency-Key=%s" % (len(mismatched), r["t0"] - self.t0,
                                             ",".join(r.get("ids") or []) or "(none)",
                                             ",".join(r.get("rids") or []), r.get("key")))
        accepted = set(self.accepted)
        delivered = set(deliv)
        lost_ids = sorted(accepted - delivered)
        unaccepted = sorted(delivered - accepted)
        # duplicates: each delivery after an id's first; explained when a
        # fault came between it and the one before with the job in flight
        faults = [e for e in self.events if e.get("ev") == "fault" and "inflight" in e]
        infl = [(e["t_kill"], e["kind"], set(e["inflight"])) for e in faults]
        dup = unexplained = 0
        by = {"worker_kill": 0, "broker_kill": 0, "link_down": 0}
        unexpl_ids = []
        for jid, ds in deliv.items():
            ds.sort()
            for prev, cur in zip(ds, ds[1:]):
                dup += 1
                why = next((k for t, k, ids in infl
                            if jid in ids and prev[0] - LINK_GRACE <= t <= cur[0]), None)
                if why:
                    by[why] += 1
                else:
                    unexplained += 1
                    unexpl_ids.append((jid, prev, cur))
        # what the de-duplicating receiver stored twice (a batch sent again
        # under another Idempotency-Key)
        # (receivers A and B as one store, as SPEC 10's failover assumes: a
        # key either of them stored is not stored again by the other)
        stored, keys_seen = {}, set()
        for r in sorted(reqs, key=lambda r: r.get("t1", r["t0"])):
            if r.get("status") == 200 and r.get("key") not in keys_seen:
                keys_seen.add(r.get("key"))
                for jid in r.get("rids") or ():
                    stored[jid] = stored.get(jid, 0) + 1
        stored_twice = sum(n - 1 for n in stored.values() if n > 1)
        keys = {}
        key_changed = 0
        for r in reqs:
            if r.get("status") == 200:
                keys.setdefault(tuple(r.get("rids") or ()), set()).add(r.get("key"))
        key_changed = sum(1 for k in keys.values() if len(k) > 1)
        # steady-state requests: a full batch, or one that waited batch_wait
        steady = [r for r in reqs if r.get("status") == 200 and
                  _phase_at(self.phases, r["t0"]).startswith(("steady", "settle"))]
        full = [r for r in steady if len(r.get("rids") or ()) >= BATCH or
                r["t0"] - r.get("tmin", r["t0"]) >= BATCH_WAIT - 0.05]
        frac = len(full) / float(len(steady)) if steady else 0.0
        if not steady:
            self.problem("no steady-state HTTP request to measure")
        cpu = sum(l.get("cpu_s", 0) for l in self.worker_lives)
        ndel = len(delivered)
        bytes_job = (self.net1 - self.net0) / float(ndel) if ndel else 0
        http_jobs = sum(len(r.get("rids") or ()) for r in reqs if r.get("status") == 200)
        http_wire = sum(r.get("wire", 0) for r in reqs if r.get("status") == 200)
        drained = (self.t_drained - self.t_up) if getattr(self, "t_drained", None) else -1
        if not reqs:
            self.problem("the HTTP receiver got no request")
        if not msgs:
            self.problem("the MQTT subscriber got no message")
        self.check_broker_order()
        st = getattr(self, "final_stats", {})
        for k in ("dead", "failed"):
            if st.get(k):
                self.say("warning: the spool has %s=%d at the end" % (k, st[k]))

        for p in PATHS:
            acc = sum(1 for v in self.accepted.values() if v[1] == p)
            self.say("path %-3s attempts=%d accepted=%d refused=%s" % (
                p, self.attempts[p], acc, json.dumps(self.refused[p], sort_keys=True)))
        self.say("http: requests=%d (status 200: %d, 503: %d) jobs=%d wire_bytes_per_job=%.0f; "
                 "mqtt: messages=%d" % (
                     len(reqs), sum(1 for r in reqs if r.get("status") == 200),
                     sum(1 for r in reqs if r.get("status") == 503), http_jobs,
                     http_wire / float(http_jobs or 1), len(msgs)))
        self.say("dup_by worker_kill=%d broker_kill=%d link_down=%d unexplained=%d; "
                 "receiver stored_twice=%d batches_with_two_keys=%d delivered_unaccepted=%d" % (
                     by["worker_kill"], by["broker_kill"], by["link_down"], unexplained,
                     stored_twice, key_changed, len(unaccepted)))
        for jid, prev, cur in unexpl_ids[:10]:
            self.say("  unexplained dup %s: %s at +%.2f, again %s at +%.2f" % (
                jid, prev[1], prev[0] - self.t0, cur[1], cur[0] - self.t0))
        for jid in lost_ids[:10]:
            self.say("  lost %s (accepted at +%.2f by %s, %s)" % (
                jid, self.accepted[jid][0] - self.t0, self.accepted[jid][1],
                self.accepted[jid][2]))
        self.say("worker: lives=%d cpu_s=%.2f vmhwm_kb=%d; spool %s; link: %s; probe %.2f s" % (
            len(self.worker_lives), cpu, self.worker_hwm, self.fs_desc, self.link_desc,
            self.probe_s))
        self.say("worker cpu % by phase: " + " ".join(
            "%s=%.1f" % kv for kv in self.cpu_by_phase()))
        lag50, lag99, nlive, back_s, marked = self.live_first(reqs)
        self.say("live first (tele order=live-first live=15s backlog_share=50, "
                 "--uplink-rate %s): %d live readings in the %.0f s after link-up, "
                 "lag p50=%.1f s p99=%.1f s (<= 2 x batch_wait); the backlog drained "
                 "%.1f s after link-up; %d requests marked X-Myq-Backlog"
                 % (UPLINK, nlive, LIVE_WINDOW * self.scale, lag50, lag99, back_s, marked))
        fcs = self.forecast_check()
        if not fcs:
            self.problem("no forecast could be judged")
        # the line's figures: the type whose forecast was furthest off
        worst = max(fcs.items(), key=lambda kv: abs(kv[1][2]))[1] if fcs else None
        off = sorted(k for k, v in fcs.items() if abs(v[2]) > FORECAST_TOL)
        self.say("goals: linkup_to_drained_s=%.1f (<= 60)  http_full_window=%.3f (%d of %d "
                 "steady-state requests; >= 0.95)  forecast %s (within +-%.0f %%)" % (
                     drained, frac, len(full), len(steady),
                     " ".join("%s=%.0f/%.1f s %+.0f %%" % (k, v[0], v[1], v[2])
                              for k, v in sorted(fcs.items())) or "none",
                     FORECAST_TOL))
        self.say("logs: %s (myq.py %s, python %s)" % (self.dir, self.myq_sha,
                                                      sys.version.split()[0]))
        if self.problems:
            self.say("could not check: " + "; ".join(self.problems))
        if off:
            self.say("forecast off: " + "; ".join(
                "%s est_drain_s=%.0f, drained in %.1f s (%+.0f %%, beyond +-%.0f %%)" % (
                    k, fcs[k][0], fcs[k][1], fcs[k][2], FORECAST_TOL) for k in off))
        print("soak: accepted=%d delivered=%d lost=%d dup=%d dup_unexplained=%d requests=%d "
              "bytes_per_job=%d cpu_ms_per_job=%.1f outage_cpu_pct=%.2f rss_mb=%.1f "
              "inodes_max=%d linkup_to_drained_s=%.1f outage_mb_per_h=%.1f "
              "forecast_s=%.0f drained_s=%.1f forecast_err_pct=%.0f forecast=%s "
              "live_lag_p50_s=%.1f live_lag_p99_s=%.1f backlog_drain_s=%.1f" % (
                  len(accepted), ndel, len(lost_ids), dup, unexplained, len(reqs),
                  round(bytes_job), 1000.0 * cpu / ndel if ndel else 0,
                  self.outage_cpu_pct if self.outage_cpu_pct is not None else -1,
                  self.worker_hwm / 1024.0, self.inodes_max, drained,
                  self.outage_mb_per_h if self.outage_mb_per_h is not None else -1,
                  worst[0] if worst else -1, worst[1] if worst else -1,
                  worst[2] if worst else 0,
                  "off" if off else "ok" if fcs else "none", lag50, lag99, back_s),
              flush=True)
        if lost_ids or unexplained:
            return 1
        if off:
            return 4
        return 2 if self.problems else 0

    def live_first(self, reqs):
        """tele's live data first after the outage: the delivery lag (first
        delivery - accepted) of the readings accepted in the LIVE_WINDOW
        after link-up, p50 and p99 (-1: none); the seconds from link-up to
        the last first delivery of tele's backlog (accepted before link-up);
        the requests marked X-Myq-Backlog."""
        t_up = self.t_up or 0.0
        end = t_up + LIVE_WINDOW * self.scale
        with self.lock:
            lags = sorted(self.first[j] - t for j, (t, _, kind) in self.accepted.items()
                          if kind == "tele" and t_up <= t < end and j in self.first)
            back = [self.first.get(j) for j, (t, _, kind) in self.accepted.items()
                    if kind == "tele" and t < t_up]
        if not lags:
            self.problem("no live tele reading after link-up to measure")

        def pct(p):
            return lags[min(len(lags) - 1, int(p / 100.0 * len(lags)))] if lags else -1
        drain = max(back) - t_up if back and None not in back and t_up else -1
        marked = sum(1 for r in reqs if r.get("status") == 200 and r.get("backlog"))
        return pct(50), pct(99), len(lags), drain, marked

    def cpu_by_phase(self):
        """The worker's CPU over wall time in each phase (from the samples:
        consecutive ones of one worker process)."""
        acc = {}
        for (t0, p0, c0), (t1, p1, c1) in zip(self.cpu_samples, self.cpu_samples[1:]):
            if p0 != p1:
                continue
            name = _phase_at(self.phases, t0)
            a = acc.setdefault(name, [0.0, 0.0])
            a[0] += c1 - c0
            a[1] += t1 - t0
        return [(name, 100.0 * acc[name][0] / acc[name][1]) for _, name in self.phases
                if name in acc and acc[name][1] > 0]

    def check_broker_order(self):
        """Each time the broker started, the subscriber subscribed before
        the first publish from the worker arrived (else the broker would
        drop those publishes with no subscriber, and count them ours)."""
        sections, cur = [], None
        for line in _lines(self.broker_log):
            if re.search(r"mosquitto version \S+ running", line):
                cur = []
                sections.append(cur)
            elif cur is not None:
                cur.append(line)
        for i, sec in enumerate(sections):
            sub = next((n for n, l in enumerate(sec) if "Received SUBSCRIBE from soak-sub" in l),
                       None)
            pub = next((n for n, l in enumerate(sec) if "Received PUBLISH from" in l), None)
            if pub is not None and (sub is None or pub < sub):
                self.problem("broker start %d: a publish arrived before the subscriber "
                             "had subscribed" % (i + 1))

    # --------------------------------------------------------------- cleanup
    def cleanup(self):
        self.stop_all.set()
        self.stop_producing.set()
        for name, p in list(self.procs.items()):
            if p.poll() is None:
                try:
                    p.terminate()
                    p.wait(5)
                except (subprocess.TimeoutExpired, OSError):
                    try:
                        p.kill()
                        p.wait(5)
                    except (OSError, subprocess.TimeoutExpired):
                        pass
                except ChildProcessError:
                    pass
        for ns in self.netns:
            self.run(["ip", "netns", "del", ns], check=False)
        if self.mounted:
            for _ in range(20):
                if self.run(["umount", self.mounted], check=False).returncode == 0:
                    break
                time.sleep(0.25)
        if self.loopdev:
            self.run(["losetup", "-d", self.loopdev], check=False)
        img = os.path.join(getattr(self, "dir", "/nonexistent"), "spool.img")
        if os.path.exists(img) and not self.args.keep:
            os.unlink(img)


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _lines(path):
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _recs(path):
    out = []
    for line in _lines(path):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _delivered(rec):
    """(id, time) of what a receiver's log record delivered: an HTTP request
    answered 200 (each id of X-Myq-Ids), an MQTT message."""
    if rec.get("ev") == "req" and rec.get("status") == 200 and rec.get("path") != "/probe":
        # the ids in the body (what the receiver got); X-Myq-Ids is
        # compared with them in report()
        return [(j, rec["t0"]) for j in rec.get("rids") or () if j]
    if rec.get("ev") == "msg" and rec.get("rid"):
        return [(rec["rid"], rec["t"])]
    return []


def _phase_at(phases, t):
    name = "setup"
    for t0, n in phases:
        if t0 <= t:
            name = n
    return name


def stale_cleanup():
    """Namespaces left by a soak that was killed (its pid gone)."""
    r = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, universal_newlines=True)
    for line in r.stdout.splitlines():
        m = re.match(r"(myqsoak-(?:dev|srv)-(\d+))", line)
        if m and not os.path.exists("/proc/%s" % m.group(2)):
            subprocess.run(["ip", "netns", "del", m.group(1)], stderr=subprocess.DEVNULL)


def main():
    if "--bridge" in sys.argv[1:]:
        import bridge       # myq intake beside a Mosquitto bridge (issue 27)
        return bridge.main()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES") or 0),
                   help="stretch the timeline to about this many minutes "
                        "(default: the short run, ~%.0f s of faults)" % BASE_S)
    p.add_argument("--dir", help="where the runs' logs go (default /var/tmp/myq-soak)")
    p.add_argument("--keep", action="store_true", help="keep the spool's image")
    args = p.parse_args()
    s = Soak(args)
    rc = 2

    def stop(sig, frame):
        raise KeyboardInterrupt("signal %d" % sig)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        s.preflight()
        stale_cleanup()
        s.setup_dirs()
        s.setup_fs()
        s.setup_net()
        s.start_servers()
        s.say("run %s: %s; spool %s; timeline x%.2f (%.0f s of phases)" % (
            s.nonce, s.link_desc, s.fs_desc, s.scale, BASE_S * s.scale))
        s.timeline()
        rc = s.report()
    except CannotRun as e:
        print("soak: cannot run here: %s" % e, flush=True)
        rc = 3
    except KeyboardInterrupt as e:
        print("soak: could not check: interrupted (%s)" % (e or "SIGINT"), flush=True)
        rc = 2
    except Exception as e:          # noqa: BLE001 - a loud failure, not a pass
        import traceback
        traceback.print_exc()
        print("soak: could not check: the harness failed: %s: %s" % (type(e).__name__, e),
              flush=True)
        rc = 2
    finally:
        s.cleanup()
    return rc


if __name__ == "__main__":
    sys.exit(main())
