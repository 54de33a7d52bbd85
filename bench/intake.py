#!/usr/bin/env python3
"""What intake costs (SPEC 12, issue 27): CPU per message taken in, its
memory, and whether taking in 200 QoS 1 messages a second delays a
worker's deliveries; each figure beside its baseline measured in the same
run, medians of --runs runs.

    python3 bench/intake.py [--quick] [--runs N] [--n N] [--seconds S]

Standard library only, plus the `mosquitto` broker for the MQTT figures
(without it they are skipped).  Spools on tmpfs (/dev/shm) unless --dir:
the CPU is what is measured, not the disk.

- CPU per message: `myq intake --subscribe` as its own process takes N
  QoS 1 messages (published back to back by a bare publisher, at most 500
  ahead of the jobs made) until N jobs are in incoming/; its CPU time (utime +
  stime from /proc) per message, against the baseline `Spool.enqueue()`
  of the same payload N times in this process (process_time per job):
  what the network side adds to an enqueue.
- The same over HTTP: N `POST /jobs/TYPE` of one job each on one
  keep-alive connection, `myq intake --listen`'s CPU per request.
- Memory: the intake process's VmRSS at the end of those runs.
- Delay: a worker (`myq worker --module`, no-op handlers) delivers probe
  jobs enqueued 20 a second; a probe's latency is from its enqueue to its
  handler's start.  Median and 95th percentile with the intake taking in
  200 messages a second (jobs the same worker delivers too, as a bridge
  does) against the same without any intake load, interleaved.
"""

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MYQ = os.path.join(ROOT, "myq.py")
sys.path.insert(0, ROOT)

import myq  # noqa: E402

MOSQUITTO = shutil.which("mosquitto") or next(
    (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")
     if os.access(p, os.X_OK)), None)
PAYLOAD = b'{"sensor": "k1", "t": 21.5, "seq": %d}'
TICK = os.sysconf("SC_CLK_TCK")


def log(msg):
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait(pred, timeout=60, what="condition"):
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise SystemExit("timed out waiting for " + what)
        time.sleep(0.005)


def start_broker(d):
    port = free_port()
    conf = os.path.join(d, "mosquitto.conf")
    with open(conf, "w") as f:
        f.write("listener %d 127.0.0.1\nallow_anonymous true\npersistence false\n"
                "log_dest none\nmax_inflight_messages 100\n%s"
                % (port, "user root\n" if os.geteuid() == 0 else ""))
    p = subprocess.Popen([MOSQUITTO, "-c", conf], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)

    def up():
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return True
        except OSError:
            return False
    wait(up, 15, "mosquitto")
    return p, port


def cpu_of(pid):
    """utime + stime of a process, in seconds."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def hwm_kb(pid, what="VmRSS:"):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(what):
                return int(line.split()[1])
    return 0


def count(spool):
    return sum(1 for n in os.listdir(os.path.join(spool, "incoming"))
               if n.endswith(".json"))


def new_spool(base, name):
    path = os.path.join(base, name)
    shutil.rmtree(path, ignore_errors=True)
    for ext in (".log", ".marks", ".handlers.py"):      # an earlier run's
        if os.path.exists(path + ext):
            os.unlink(path + ext)
    getattr(myq, 'open_store', myq.Spool)(path).init()
    return path


def intake(spool, *args):
    logf = spool + ".log"
    p = subprocess.Popen([sys.executable, MYQ, "--spool", spool, "intake",
                          "--log", logf] + list(args),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def started():
        try:
            return "event=intake_start" in open(logf).read() and (
                "--subscribe" not in args or "intake_connected" in open(logf).read())
        except OSError:
            return False
    wait(started, 30, "the intake")
    time.sleep(0.3)         # (its SUBSCRIBE reaches the broker)
    return p


def stop(p):
    p.terminate()
    p.wait(15)


# A bare QoS 1 publisher (not myq's code) ---------------------------------------

def _s(b):
    return len(b).to_bytes(2, "big") + b


def _len(n):
    out = bytearray()
    while True:
        n, b = n >> 7, n & 127
        out.append(b | 128 if n else b)
        if not n:
            return bytes(out)


class Publisher(object):
    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), 10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        vh = _s(b"MQTT") + bytes([4, 2]) + (0).to_bytes(2, "big")
        pl = _s(("bench-pub-%d" % os.getpid()).encode())
        self.sock.sendall(b"\x10" + _len(len(vh) + len(pl)) + vh + pl)
        assert self.sock.recv(4)[:1] == b"\x20"
        self.acked = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            self.acked += len(data) // 4

    def publish(self, seq, topic=b"s/k1"):
        pid = seq % 65535 + 1
        body = _s(topic) + pid.to_bytes(2, "big") + PAYLOAD % seq
        self.sock.sendall(b"\x32" + _len(len(body)) + body)

    def close(self):
        try:
            self.sock.sendall(b"\xe0\x00")
            self.sock.close()
        except OSError:
            pass


# The figures -----------------------------------------------------------------

def enqueue_cpu(base, n):
    spool = new_spool(base, "floor")
    sp = getattr(myq, 'open_store', myq.Spool)(spool)
    t = time.process_time()
    for i in range(n):
        sp.enqueue("r", {"topic": "s/k1", "message": {"sensor": "k1", "t": 21.5,
                                                      "seq": i}})
    return (time.process_time() - t) / n


def mqtt_cpu(base, port, n):
    spool = new_spool(base, "mqtt")
    p = intake(spool, "--mqtt", "mqtt://127.0.0.1:%d" % port,
               "--mqtt-client-id", "bench-intake", "--subscribe", "s/#=r")
    try:
        pub = Publisher(port)
        c0 = cpu_of(p.pid)
        for i in range(n):
            # at most 500 ahead of the intake: mosquitto drops what it
            # queues for a subscriber past max_queued_messages (1000)
            while i % 50 == 0 and i - count(spool) >= 500:
                time.sleep(0.001)
            pub.publish(i)
        wait(lambda: count(spool) >= n, 120, "%d jobs" % n)
        cpu = (cpu_of(p.pid) - c0) / n
        pub.close()
        return cpu, hwm_kb(p.pid)
    finally:
        stop(p)


def http_cpu(base, n):
    spool = new_spool(base, "http")
    port = free_port()
    p = intake(spool, "--listen", "127.0.0.1:%d" % port)
    try:
        s = socket.create_connection(("127.0.0.1", port), 10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c0 = cpu_of(p.pid)
        for i in range(n):
            body = PAYLOAD % i
            s.sendall(b"POST /jobs/r HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                      b"\r\n%s" % (len(body), body))
            got = b""
            while not got.endswith(b"\n") or b"\r\n\r\n" not in got:
                got += s.recv(4096)
            assert got.startswith(b"HTTP/1.1 202"), got
        cpu = (cpu_of(p.pid) - c0) / n
        s.close()
        return cpu, hwm_kb(p.pid)
    finally:
        stop(p)


HANDLERS = '''import os, time
FD = os.open(%r, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

def x(job):
    os.write(FD, ("%%s %%.6f\\n" %% (job["payload"]["at"], time.time())).encode())

def r(job):
    pass
'''


def delays(base, port, seconds, load):
    """Latencies (s) of probe jobs, 20 a second, with or without 200
    messages a second taken in beside them."""
    spool = new_spool(base, "delay-%s" % load)
    marks = spool + ".marks"
    mod = spool + ".handlers.py"
    with open(mod, "w") as f:
        f.write(HANDLERS % marks)
    w = subprocess.Popen([sys.executable, MYQ, "--spool", spool, "worker",
                          "--module", mod, "--poll", "1", "--stats-interval", "0"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    p = pub = None
    stopping = []
    try:
        if load:
            p = intake(spool, "--mqtt", "mqtt://127.0.0.1:%d" % port,
                       "--mqtt-client-id", "bench-delay", "--subscribe", "s/#=r")
            pub = Publisher(port)

            def feed():
                t0, i = time.monotonic(), 0
                while not stopping:
                    pub.publish(i)
                    i += 1
                    time.sleep(max(0.0, t0 + i / 200.0 - time.monotonic()))
            threading.Thread(target=feed, daemon=True).start()
            time.sleep(1.0)
        sp = getattr(myq, 'open_store', myq.Spool)(spool)
        t0, n = time.monotonic(), int(seconds * 20)
        for i in range(n):
            sp.enqueue("x", {"at": "%.6f" % time.time()})
            time.sleep(max(0.0, t0 + (i + 1) / 20.0 - time.monotonic()))

        def all_in():
            try:
                return len(open(marks).read().splitlines()) >= n
            except OSError:
                return False
        wait(all_in, 60, "the probes")
        stopping.append(1)
        lines = open(marks).read().split()
        return [float(b) - float(a) for a, b in zip(lines[0::2], lines[1::2])]
    finally:
        stopping.append(1)
        if pub is not None:
            pub.close()
        if p is not None:
            stop(p)
        stop(w)


def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.95))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm")
                    else None)
    a = ap.parse_args()
    if a.quick:
        a.runs, a.n, a.seconds = 1, 500, 4.0
    base = tempfile.mkdtemp(prefix="myq-bench-intake-", dir=a.dir)
    broker = None
    try:
        port = None
        if MOSQUITTO:
            broker, port = start_broker(base)
        else:
            log("no mosquitto (apt-get install mosquitto): MQTT figures skipped")
        rows = {"enqueue": [], "mqtt": [], "http": [], "mqtt_kb": [], "http_kb": [],
                "idle50": [], "idle95": [], "load50": [], "load95": []}
        for run in range(a.runs):
            rows["enqueue"].append(enqueue_cpu(base, a.n))
            cpu, kb = http_cpu(base, a.n)
            rows["http"].append(cpu)
            rows["http_kb"].append(kb)
            if port:
                cpu, kb = mqtt_cpu(base, port, a.n)
                rows["mqtt"].append(cpu)
                rows["mqtt_kb"].append(kb)
                idle = delays(base, port, a.seconds, False)
                load = delays(base, port, a.seconds, True)
                rows["idle50"].append(statistics.median(idle))
                rows["idle95"].append(p95(idle))
                rows["load50"].append(statistics.median(load))
                rows["load95"].append(p95(load))
            log("run %d: %s" % (run + 1, " ".join(
                "%s=%.6g" % (k, v[-1]) for k, v in rows.items() if v)))
        med = dict((k, statistics.median(v)) for k, v in rows.items() if v)
        print("myq %s, CPython %s, %d runs, N=%d, spools in %s" % (
            myq.__version__, sys.version.split()[0], a.runs, a.n, a.dir or "/tmp"))
        e = med["enqueue"]
        print("baseline Spool.enqueue() CPU per job: %.3f ms" % (e * 1e3))
        print("HTTP intake CPU per request: %.3f ms (%.2fx an enqueue), "
              "VmRSS %d KiB after" % (med["http"] * 1e3, med["http"] / e, med["http_kb"]))
        if "mqtt" in med:
            print("MQTT intake CPU per message: %.3f ms (%.2fx an enqueue), "
                  "VmRSS %d KiB after" % (med["mqtt"] * 1e3, med["mqtt"] / e,
                                    med["mqtt_kb"]))
            print("probe latency, enqueue to handler (20/s): idle p50 %.1f ms "
                  "p95 %.1f ms; with 200 msg/s taken in p50 %.1f ms p95 %.1f ms "
                  "(p50 %.2fx, p95 %.2fx)" % (
                      med["idle50"] * 1e3, med["idle95"] * 1e3,
                      med["load50"] * 1e3, med["load95"] * 1e3,
                      statistics.median([l / i for l, i in zip(rows["load50"],
                                                               rows["idle50"])]),
                      statistics.median([l / i for l, i in zip(rows["load95"],
                                                               rows["idle95"])])))
    finally:
        if broker is not None:
            broker.terminate()
            broker.wait(10)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
