#!/usr/bin/env python3
"""Flush after an outage over a slow link (issue 13): how many requests,
bytes and seconds myq spends forwarding a backlog of small events.

    python3 bench/forward.py [--quick] [--events N] [--sample K] [--runs R]
                             [--dir PATH] [--json FILE]

`make bench` runs it (`--quick` for a short check).  Standard library only.

The link: a TCP proxy (a child process, so that its timing does not share
the worker's interpreter) between myq and a local HTTP/1.1 receiver.  Each
direction is a 1 Mbit/s link with 100 ms of delay, shared by all
connections: a chunk leaves when the link is free (a token bucket of one
packet, 1,460 bytes) and arrives 100 ms later.  A new connection first
costs one round trip (the TCP handshake): nothing the client sends leaves
before accept + 200 ms.  This kernel has no netem, hence the proxy.
Counted at the proxy: connections and the bytes of both directions (TCP
payload: the TCP/IP headers and handshake packets, which would only add to
the rows with more connections and requests, are not counted).  Counted at
the receiver: requests and events (a batch is a JSON array, maybe gzipped).

The backlog: N (10,000) events of ~90 bytes of JSON, each an `http` job,
queued with Spool.enqueue_many into a fresh spool per row, on tmpfs
(--dir, default /dev/shm): the figures are the link's, not the disk's (on
ext4 here the worker's fsyncs add ~4 ms a job to the ~200-400 ms of link
time).  Rows:

- batch=1, no keep-alive: a myq Worker (the API, --concurrency 1) whose
  http pool has size 0 (a fresh connection per job: myq before keep-alive).
- batch=1, keep-alive: the same Worker as it is now (one kept connection).
- batch=100 + gzip, worker: the same Worker, the events of type
  `telemetry` with `myq policy telemetry handler=http batch=100 gzip=true`
  (SPEC 10), draining the whole backlog.
- batch=100 + gzip, driver loop: no worker: a small loop reads the queued
  jobs (Spool.list), sends them 100 at a time with myq.http_batch(...,
  gzip=True) over one kept connection, and deletes each sent group
  (Spool.delete): the link's share of the worker row (the time it spends
  in the spool is shown).

The two batch=1 rows take ~0.4 s and ~0.2 s a job (round trips), so they
run over the first K (--sample, 100) jobs of the backlog and their figures
are scaled to N (marked ~); the batch rows send all N.  Per-event figures
are the medians of --runs runs (3); the ratios are those of the medians
against the batch=1, no keep-alive row.
"""
import argparse
import contextlib
import gzip
import http.server
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

RATE = 1000000 / 8.0        # bytes/s each way (1 Mbit/s)
DELAY = 0.100               # one way
PACKET = 1460


# The network side (child process) ############################################

class Link(object):
    """One direction of the link, shared by every connection."""

    def __init__(self):
        self.lock = threading.Lock()
        self.free_at = 0.0
        self.bytes = 0

    def arrival(self, n, not_before):
        with self.lock:
            start = max(time.monotonic(), self.free_at, not_before)
            self.free_at = start + n / RATE
            self.bytes += n
            return self.free_at + DELAY


class Pipe(object):
    """src -> dst through `link`; the first byte not before `not_before`."""

    def __init__(self, src, dst, link, not_before, done):
        self.src, self.dst, self.link = src, dst, link
        self.not_before, self.done = not_before, done
        self.queue, self.cond = [], threading.Condition()
        for fn in (self.read, self.write):
            t = threading.Thread(target=fn)
            t.daemon = True
            t.start()

    def read(self):
        while True:
            try:
                data = self.src.recv(65536)
            except OSError:
                data = b""
            for i in range(0, len(data), PACKET):
                piece = data[i:i + PACKET]
                at = self.link.arrival(len(piece), self.not_before)
                with self.cond:
                    self.queue.append((at, piece))
                    self.cond.notify()
            if not data:
                at = self.link.arrival(0, self.not_before)
                with self.cond:
                    self.queue.append((at, None))
                    self.cond.notify()
                return

    def write(self):
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                at, piece = self.queue.pop(0)
            wait = at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if piece is None:
                    self.dst.shutdown(socket.SHUT_WR)
                else:
                    self.dst.sendall(piece)
                    continue
            except OSError:
                pass
            self.done()
            return


class Proxy(object):
    def __init__(self, target):
        self.target = target
        self.up, self.down = Link(), Link()
        self.connections = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        t = threading.Thread(target=self.serve)
        t.daemon = True
        t.start()

    def serve(self):
        while True:
            c, _ = self.sock.accept()
            self.connections += 1
            s = socket.create_connection(self.target)
            for x in (c, s):
                x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            left = [2]
            lock = threading.Lock()

            def done(c=c, s=s, left=left, lock=lock):
                with lock:
                    left[0] -= 1
                    if left[0]:
                        return
                for x in (c, s):
                    x.close()
            handshake = time.monotonic() + 2 * DELAY
            Pipe(c, s, self.up, handshake, done)
            Pipe(s, c, self.down, 0.0, done)


class Receiver(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # As servers do on keep-alive connections: else the body of an answer
    # (a second write) waits for the proxy's delayed ACK of its headers.
    disable_nagle_algorithm = True

    def log_message(self, *a):
        pass

    def do_POST(self):
        st = self.server.st
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            value = json.loads(body.decode("utf-8"))
            ids = self.headers.get("X-Myq-Ids")
            n = 1
            if ids is not None:
                n = len(value)
                if n != len(ids.split(",")):
                    raise ValueError("X-Myq-Ids does not match the array")
        except ValueError:
            st["bad"] += 1
            n = 0
        st["requests"] += 1
        st["events"] += n
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


def serve():
    """The child: print the proxy's port, then answer `stats` on stdin."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    srv.daemon_threads = True
    srv.st = {"requests": 0, "events": 0, "bad": 0}
    t = threading.Thread(target=srv.serve_forever)
    t.daemon = True
    t.start()
    proxy = Proxy(srv.server_address)
    print(proxy.port, flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            out = dict(srv.st, connections=proxy.connections,
                       up=proxy.up.bytes, down=proxy.down.bytes)
            print(json.dumps(out), flush=True)
    srv.shutdown()


# The myq side ################################################################

class Net(object):
    def __init__(self):
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                   "--serve"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, universal_newlines=True)
        self.port = int(self.p.stdout.readline())

    def stats(self):
        self.p.stdin.write("stats\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait(10)


def backlog(myq, path, url, n, type="http"):
    myq.main(["--spool", path, "init"])
    rnd = random.Random(13)
    sp = getattr(myq, 'open_store', myq.Spool)(path)
    specs = [{"type": type, "payload": {"url": url, "body": {
        "dev": "edge-0042", "seq": i, "ts": 1767225600 + 7 * i,
        "temp": round(18 + rnd.random() * 8, 2),
        "door": rnd.choice(("open", "closed")), "rssi": -rnd.randint(50, 95)}}}
        for i in range(n)]
    for i in range(0, n, 1000):
        sp.enqueue_many(specs[i:i + 1000])


def delta(a, b):
    return dict((k, b[k] - a[k]) for k in a)


def worker_row(myq, net, path, sample, keepalive):
    """A Worker over the backlog until `sample` jobs are done."""
    seen = {"done": 0, "t": None, "stats": None}

    def log(event, **kv):
        if event == "done":
            seen["done"] += 1
            if seen["done"] == sample:
                seen["t"] = time.monotonic()
                seen["stats"] = net.stats()
                os.kill(os.getpid(), signal.SIGTERM)    # stop it: graceful
        elif event in ("retry", "dead", "error", "lost"):
            seen.setdefault("unexpected", []).append((event, kv))
    w = myq.Worker(path, jitter=0, log=log, stats_interval=0)
    if not keepalive:
        w.resolver.http.pool = myq.HttpPool(0)
    before = net.stats()
    t0 = time.monotonic()
    w.run()
    if seen["t"] is None or seen.get("unexpected"):
        raise SystemExit("bench: the worker stopped after %d jobs (%s)"
                         % (seen["done"], seen.get("unexpected")))
    d = delta(before, seen["stats"])
    d["seconds"] = seen["t"] - t0
    d["jobs"] = sample
    return d


def worker_batch_row(myq, net, path):
    """The worker with `myq policy telemetry handler=http batch=100
    gzip=true`, over the whole backlog."""
    bad, done = [], [0]

    def log(event, **kv):
        if event == "done":
            done[0] += 1
        elif event in ("retry", "dead", "error", "lost"):
            bad.append((event, kv))
    w = myq.Worker(path, jitter=0, log=log, stats_interval=0)
    before = net.stats()
    t0 = time.monotonic()
    w.run(drain=True)
    t = time.monotonic() - t0
    if bad:
        raise SystemExit("bench: %s" % bad[:3])
    d = delta(before, net.stats())
    d["seconds"] = t
    d["jobs"] = done[0]
    return d


def batch_row(myq, net, path, size):
    """DRIVER LOOP (not the worker): http_batch in groups of `size`."""
    sp = getattr(myq, 'open_store', myq.Spool)(path)
    pool = myq.HttpPool(1)
    before = net.stats()
    t0 = time.monotonic()
    jobs = list(sp.list("ready"))
    spool_time = time.monotonic() - t0
    for i in range(0, len(jobs), size):
        group = jobs[i:i + size]
        key = myq.http_group_key(group[0])
        assert all(myq.http_group_key(j) == key for j in group)
        myq.http_batch(group, pool=pool, gzip=True)
        t1 = time.monotonic()
        sp.delete([j["id"] for j in group])
        spool_time += time.monotonic() - t1
    t = time.monotonic() - t0
    pool.close()
    d = delta(before, net.stats())
    d["seconds"] = t
    d["spool_seconds"] = spool_time
    d["jobs"] = len(jobs)
    return d


def median(xs):
    xs = sorted(xs)
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2.0


ROWS = [("batch=1, no keep-alive (worker, pool size 0)", "noka"),
        ("batch=1, keep-alive (worker)", "ka"),
        ("batch=100 + gzip (worker, policy)", "wbatch"),
        ("batch=100 + gzip (driver loop: http_batch)", "batch")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="1,000 events, a sample of 50, 1 run (~1 min; "
                    "default: 10,000, 100, 3 runs, ~6 min)")
    ap.add_argument("--events", type=int, default=None)
    ap.add_argument("--sample", type=int, default=None)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the spools go (default /dev/shm)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve()
    n = a.events or (1000 if a.quick else 10000)
    sample = min(n, a.sample or (50 if a.quick else 100))
    runs = a.runs or (1 if a.quick else 3)
    import myq
    net = Net()
    url = "http://127.0.0.1:%d/ev" % net.port
    tmp = tempfile.mkdtemp(prefix="myq-forward-", dir=a.dir)
    results = dict((k, []) for _, k in ROWS)
    print("forward: %d events, %d run(s), link 1 Mbit/s and 100 ms each way; "
          "batch=1 rows over the first %d jobs, scaled" % (n, runs, sample))
    try:
        for r in range(runs):
            for label, key in ROWS:
                path = os.path.join(tmp, "%s-%d" % (key, r))
                if key == "wbatch":
                    # The policy first, as on a device set up before the
                    # outage: jobs queued before their type had a policy
                    # are not batched (they wait outside its lane).
                    myq.main(["--spool", path, "init"])
                    with contextlib.redirect_stdout(io.StringIO()):
                        myq.main(["--spool", path, "policy", "telemetry",
                                  "handler=http", "batch=100", "gzip=true"])
                    backlog(myq, path, url, n, "telemetry")
                    d = worker_batch_row(myq, net, path)
                else:
                    backlog(myq, path, url, n)
                if key == "wbatch":
                    pass
                elif key == "batch":
                    d = batch_row(myq, net, path, 100)
                else:
                    d = worker_row(myq, net, path, sample, key == "ka")
                if d["bad"] or d["events"] != d["jobs"]:
                    raise SystemExit("bench: the receiver got %d events for %d "
                                     "jobs (%d bad)" % (d["events"], d["jobs"], d["bad"]))
                results[key].append(d)
                shutil.rmtree(path)
                print("  run %d %-46s %6.1fs for %d jobs" % (r + 1, label,
                                                         d["seconds"], d["jobs"]),
                      flush=True)
    finally:
        net.close()
        shutil.rmtree(tmp, ignore_errors=True)
    table = {}
    for label, key in ROWS:
        per = lambda f: median([f(d) / float(d["jobs"]) for d in results[key]])  # noqa: E731
        table[key] = {
            "label": label, "scaled": key in ("noka", "ka"),
            "jobs": results[key][0]["jobs"],
            "connections": median([d["connections"] for d in results[key]]),
            "requests": per(lambda d: d["requests"]) * n,
            "bytes": per(lambda d: d["up"] + d["down"]) * n,
            "up": per(lambda d: d["up"]) * n,
            "seconds": per(lambda d: d["seconds"]) * n,
        }
    base = table["noka"]
    print()
    print("%-46s %6s %5s %10s %11s %9s   %s" % (
        "flush of %d events" % n, "sent", "conns", "requests", "wire bytes",
        "seconds", "fewer than batch=1 (requests, bytes, time)"))
    for label, key in ROWS:
        t = table[key]
        m = "~" if t["scaled"] else " "
        print("%-46s %6d %5d %s%9.0f %s%10.0f %s%8.1f   %.1fx, %.1fx, %.1fx" % (
            label, t["jobs"], t["connections"], m, t["requests"], m, t["bytes"],
            m, t["seconds"], base["requests"] / t["requests"],
            base["bytes"] / t["bytes"], base["seconds"] / t["seconds"]))
    b = table["wbatch"]
    print("(the driver loop's Spool.list and Spool.delete: %.1f s of its %.1f s)"
          % (median([d["spool_seconds"] for d in results["batch"]]),
             table["batch"]["seconds"]))
    goals = [("requests", 20), ("bytes", 3), ("seconds", 5)]
    print()
    print("goals (batch=100+gzip, worker, vs batch=1): " + ", ".join(
        "%s >= %dx fewer: %.1fx %s" % (k, g, base[k] / b[k],
                                       "met" if base[k] / b[k] >= g else "MISSED")
        for k, g in goals))
    print("sent, conns: what one run sent and opened; ~: measured over those "
          "jobs, scaled to %d" % n)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"events": n, "sample": sample, "runs": runs,
                       "table": table, "raw": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
