#!/usr/bin/env python3
"""The destination of the RAM parts' jobs (ext4-ram, ubifs-ram): an HTTP
receiver whose link the harness turns up, down and flapping.

    receiver.py --port P --control FILE --log FILE

It runs in the guest beside the spool (the VMs have no network; loopback
stands for the link), in a process of its own that the harness's power
cuts do not touch: what it has, it has, as a server on the far side of a
real link would.  FILE (JSON, replaced whole by the harness) says

    {"epoch": E, "mode": M, "period": SECONDS, "stall": SECONDS,
     "t0": MONOTONIC}

M: "up" (200 for every job), "down" (503: the destination answers that it
cannot take the job), "unreachable" (the port closed: connection refused,
and a kept connection closed without an answer), "stall" (200, but only
`stall` seconds after the request: a slow link, which fails nothing, so
that only spill_after moves the jobs waiting behind it), "flap" (up, down,
up, unreachable, up, stall, ..., each `period` seconds from t0).  E: the harness's count
of power cuts so far; two deliveries of a job in one epoch have no cut
between them to explain them.

Every job answered 200 is first appended to the log, one line:

    EPOCH MONOTONIC ID SUM VERDICT

(MONOTONIC: this machine's CLOCK_MONOTONIC, the harness's clock too; ID
the request's Idempotency-Key, the job's id; SUM the payload's `sum`;
VERDICT "ok" when the payload's blob matches its sum, else "bad").
"""

import argparse
import hashlib
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn

FLAP = ("up", "down", "up", "unreachable", "up", "stall")


def mode_at(ctl, now):
    """The link's state at `now` under the control object `ctl`."""
    m = ctl.get("mode", "up")
    if m != "flap":
        return m
    period = max(0.05, float(ctl.get("period") or 0.5))
    k = int(max(0.0, now - float(ctl.get("t0") or 0)) / period)
    return FLAP[k % len(FLAP)]


def verdict(body):
    """(sum, "ok" or "bad") of a delivered body: the payload's blob must
    match its sum (a list: a batch, each checked)."""
    try:
        p = json.loads(body.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return "-", "bad"
    try:
        good = hashlib.sha256(p["blob"].encode()).hexdigest()[:16] == p["sum"]
        return str(p["sum"]), "ok" if good else "bad"
    except (KeyError, TypeError, AttributeError):
        return "-", "bad"


class Control(object):
    def __init__(self, path):
        self.path = path
        self.stamp = None
        self.ctl = {"epoch": 0, "mode": "up"}
        self.lock = threading.Lock()

    def get(self):
        with self.lock:
            try:
                st = os.stat(self.path)
                stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
                if stamp != self.stamp:
                    with open(self.path) as f:
                        self.ctl = json.load(f)
                    self.stamp = stamp
            except (OSError, ValueError):
                pass
            return dict(self.ctl)


class Server(ThreadingMixIn, HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):
        """A client killed mid-request (every power cut kills the worker):
        nothing to say."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, socket.timeout)):
            HTTPServer.handle_error(self, request, client_address)


def make_handler(control, log):
    lock = threading.Lock()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # the answer's head and body are two writes: with Nagle the body
        # waits for the client's delayed ACK (40 ms a job)
        disable_nagle_algorithm = True

        def log_message(self, *a):
            pass

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n)
            if len(body) != n:      # the sender died mid-request: not delivered
                self.close_connection = True
                return
            ctl = control.get()
            m = mode_at(ctl, time.monotonic())
            if m == "unreachable":
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            if m == "down":
                msg = b"down (on purpose)"
                self.send_response(503)
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)
                return
            if m == "stall":
                time.sleep(float(ctl.get("stall") or 3))
            jid = self.headers.get("Idempotency-Key") or "-"
            s, v = verdict(body)
            with lock:      # recorded before the answer: 200 means "have it"
                log.write("%d %.6f %s %s %s\n" % (int(ctl.get("epoch", 0)),
                                                   time.monotonic(), jid, s, v))
                log.flush()
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        do_PUT = do_POST
    return H


def serve(port, control, log, stop=None):
    """Until stop (a threading.Event) is set: listening while the link is
    up or down, the port closed while it is unreachable."""
    H = make_handler(control, log)
    srv = None
    try:
        while stop is None or not stop.is_set():
            m = mode_at(control.get(), time.monotonic())
            if m == "unreachable":
                if srv is not None:
                    srv.server_close()
                    srv = None
                time.sleep(0.02)
                continue
            if srv is None:
                srv = Server(("127.0.0.1", port), H)
                srv.timeout = 0.05
            srv.handle_request()
    finally:
        if srv is not None:
            srv.server_close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--control", required=True)
    ap.add_argument("--log", required=True)
    a = ap.parse_args(argv)
    log = open(a.log, "a")
    serve(a.port, Control(a.control), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
