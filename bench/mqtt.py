#!/usr/bin/env python3
"""MQTT QoS 1 from one worker to a local mosquitto (SPEC 10): messages/s,
each beside its floor measured in the same run; medians of --runs runs.

    python3 bench/mqtt.py [--quick] [--runs N] [--n N] [--window W]

`make bench` runs it.  Standard library only, plus the `mosquitto` broker
(Debian: apt-get install mosquitto); without it the script says so and
exits 0.  The broker runs on a free loopback port with its own config in a
temporary directory, logging nothing, no subscriber (what is measured is
the publisher's side: each message done on its PUBACK).

What is measured (interleaved with its floor, run after run, so that a
noisy machine hits both alike):

- one at a time: `Worker.mqtt_batch([job])` for N jobs (a window of one:
  PUBLISH, wait for its PUBACK), against a bare loop over a socket that
  sends a prebuilt PUBLISH and reads the 4-byte PUBACK.
- windowed: `Worker.mqtt_batch(jobs)` with W jobs in flight, against the
  bare loop sending W prebuilt PUBLISHes in one write and reading W
  PUBACKs (with TCP_QUICKACK while more are due, as myq does: mosquitto
  does not set TCP_NODELAY by default, so without it each window waits
  for a 40 ms delayed ACK).
- through the spool: N `mqtt` jobs in a tmpfs spool drained by
  `Worker(spool, mqtt=URL).run(drain=True)` (claim, publish, done, as
  `myq worker --drain --mqtt URL` does), against the same worker draining
  the same jobs with a no-op handler for the type: what publishing adds to
  a job's run.
"""

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import myq  # noqa: E402

MOSQUITTO = shutil.which("mosquitto") or next(
    (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")
     if os.access(p, os.X_OK)), None)


def log(msg):
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def start_broker(d):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    conf = os.path.join(d, "mosquitto.conf")
    with open(conf, "w") as f:
        f.write("listener %d 127.0.0.1\nallow_anonymous true\npersistence false\n"
                "log_dest none\n%s" % (port, "user root\n" if os.geteuid() == 0
                                       else ""))
    p = subprocess.Popen([MOSQUITTO, "-c", conf], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return p, port
        except OSError:
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("mosquitto did not start")
            time.sleep(0.02)


def jobs(n, tag):
    return [{"id": "%s%d" % (tag, i), "timeout": 30,
             "payload": {"topic": "bench/%s" % tag, "message": {"n": i, "v": 21.5}}}
            for i in range(n)]


# floors: the bare protocol on a socket ---------------------------------------

def bare_connect(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    cid = b"floor-%d" % os.getpid()
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(cid).to_bytes(2, "big") + cid
    s.sendall(b"\x10" + bytes((len(body),)) + body)
    assert s.recv(4) == b"\x20\x02\x00\x00"
    return s


def publish_packet(i):
    topic = b"bench/floor"
    data = b'{"n":%d,"v":21.5}' % i
    head = len(topic).to_bytes(2, "big") + topic + ((i % 65535) + 1).to_bytes(2, "big")
    return b"\x32" + myq._mqtt_len(len(head) + len(data)) + head + data


def recv_exactly(s, n):
    got = 0
    while got < n:
        if n > 4:           # more PUBACKs due: ACK at once, as myq does
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        b = s.recv(n - got)
        if not b:
            raise SystemExit("the broker closed the connection")
        got += len(b)


def floor_one(port, n):
    s = bare_connect(port)
    packets = [publish_packet(i) for i in range(n)]
    t = time.perf_counter()
    for p in packets:
        s.sendall(p)
        recv_exactly(s, 4)
    dt = time.perf_counter() - t
    s.close()
    return n / dt


def floor_window(port, n, w):
    s = bare_connect(port)
    groups = [b"".join(publish_packet(i) for i in range(k, min(n, k + w)))
              for k in range(0, n, w)]
    t = time.perf_counter()
    for k, g in enumerate(groups):
        s.sendall(g)
        recv_exactly(s, 4 * min(w, n - k * w))
    dt = time.perf_counter() - t
    s.close()
    return n / dt


# myq ---------------------------------------------------------------------------

def myq_one(worker, n, tag):
    js = jobs(n, tag)
    worker.mqtt_batch(js[:1])               # connected before the clock starts
    t = time.perf_counter()
    for j in js:
        if worker.mqtt_batch([j]) != [None]:
            raise SystemExit("a publish failed")
    return n / (time.perf_counter() - t)


def myq_window(worker, n, w, tag):
    js = jobs(n, tag)
    worker.mqtt_batch(js[:1])
    t = time.perf_counter()
    for k in range(0, n, w):
        out = worker.mqtt_batch(js[k:k + w])
        if any(e is not None for e in out):
            raise SystemExit("a publish failed: %r" % out)
    return n / (time.perf_counter() - t)


def drain(base, port, n, publish):
    """jobs/s of Worker.run(drain=True) over n mqtt jobs, in a child
    process (signal handlers, a fresh spool), publishing or not."""
    spool = tempfile.mkdtemp(dir=base)
    sp = getattr(myq, 'open_store', myq.Spool)(spool)
    sp.init()
    sp.enqueue_many([{"type": "mqtt", "payload": {"topic": "bench/drain",
                                                  "message": {"n": i, "v": 21.5}}}
                     for i in range(n)], sync=False)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 1
        try:
            kw = {"mqtt": "mqtt://127.0.0.1:%d" % port} if publish else \
                {"handlers": {"mqtt": lambda job: None}}
            wk = myq.Worker(spool, log=myq.Log(path=os.devnull), poll=0.05,
                            stats_interval=0, **kw)
            t = time.perf_counter()
            wk.run(drain=True)
            dt = time.perf_counter() - t
            done = len(os.listdir(os.path.join(spool, "done")))
            os.write(w, ("%d %.9f" % (done, dt)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    out = b""
    while True:
        b = os.read(r, 100)
        if not b:
            break
        out += b
    os.close(r)
    _, status = os.waitpid(pid, 0)
    shutil.rmtree(spool, ignore_errors=True)
    if status or not out:
        raise SystemExit("the drain child failed (status %d)" % status)
    done, dt = out.split()
    if int(done) != n:
        raise SystemExit("the drain finished %s of %d jobs" % (done.decode(), n))
    return n / float(dt)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller N, 3 runs")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n", type=int, default=None, help="messages per figure "
                    "(default 3000; 1000 with --quick)")
    ap.add_argument("--window", type=int, default=100)
    a = ap.parse_args()
    if MOSQUITTO is None:
        log("bench/mqtt.py: skipped: needs the mosquitto broker "
            "(apt-get install mosquitto)")
        return 0
    n = a.n or (1000 if a.quick else 3000)
    runs = max(3, a.runs)
    d = tempfile.mkdtemp(prefix="myq-bench-mqtt-")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else d
    base = tempfile.mkdtemp(prefix="myq-bench-mqtt-", dir=shm)
    broker, port = start_broker(d)
    rows = {"one": [], "window": [], "drain": []}
    try:
        worker = myq.Worker(tempfile.mkdtemp(dir=base), timeout=30,
                            mqtt="mqtt://127.0.0.1:%d" % port,
                            mqtt_client_id="bench-myq-%d" % os.getpid())
        for run in range(runs):
            log("run %d/%d" % (run + 1, runs))
            # floor and figure alternate which goes first
            pairs = [("one", lambda: floor_one(port, n),
                      lambda: myq_one(worker, n, "o%d" % run)),
                     ("window", lambda: floor_window(port, n, a.window),
                      lambda: myq_window(worker, n, a.window, "w%d" % run)),
                     ("drain", lambda: drain(base, port, n, False),
                      lambda: drain(base, port, n, True))]
            for key, fl, fig in pairs:
                if run % 2:
                    y, x = fig(), fl()
                else:
                    x, y = fl(), fig()
                rows[key].append((x, y))
        worker.resolver.mqtt.client.close()
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(10)
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)

    names = {
        "one": ("QoS 1 msgs/s, one at a time (mqtt_batch([job]))", "bare socket loop"),
        "window": ("QoS 1 msgs/s, window %d (mqtt_batch(jobs))" % a.window,
                   "bare socket, %d a write" % a.window),
        "drain": ("QoS 1 jobs/s, worker drain through the spool (tmpfs)",
                  "same drain, no-op handler"),
    }
    print("myq %s, Python %s, mosquitto on 127.0.0.1, N=%d, medians of %d runs"
          % (myq.__version__, sys.version.split()[0], n, runs))
    print()
    print("| figure | floor | floor is | myq | myq/floor (range) |")
    print("|---|---:|---|---:|---:|")
    for key in ("one", "window", "drain"):
        xs = rows[key]
        ratios = sorted(y / x for x, y in xs)
        print("| %s | %s | %s | %s | %.2fx (%.2f-%.2f) |" % (
            names[key][0], "{:,.0f}".format(statistics.median(x for x, _ in xs)),
            names[key][1], "{:,.0f}".format(statistics.median(y for _, y in xs)),
            statistics.median(ratios), ratios[0], ratios[-1]))
    one = statistics.median(y for _, y in rows["one"])
    print()
    print("goal: >= 1,000 QoS 1 messages/s from one worker, one at a time: %s"
          % ("met" if one >= 1000 else "MISSED"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
