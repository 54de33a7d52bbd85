#!/usr/bin/env python3
"""The soak's HTTP receiver: the README's example receiver (standard
library; gzip; a batch is a JSON array; de-duplicates on Idempotency-Key),
plus a log of every request for the harness to count.

    python3 receiver.py --listen 0.0.0.0:8080 --run NONCE --log FILE

SIGUSR1: answer 503 (Retry-After: 5) to every request from now on, storing
nothing; SIGUSR2: answer normally again.  SIGTERM ends it.

Log: one JSON object a line.  First {"ev": "start", "run": NONCE, "pid"};
then one {"ev": "req"} per request: t0 (the request line read), t1 (the
answer sent), status, key (Idempotency-Key), ids (X-Myq-Ids), rids (the
"rid" of each event in the body, in order), runs (the distinct "run" of the
events), new_key (the key was not seen before: the receiver stored the
batch), wire (bytes of the body as sent), body (bytes decompressed),
peer port, backlog (X-Myq-Backlog: 1, the sender's backlog after an
outage), and error (what did not parse).
"""
import argparse
import gzip
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"503": False}
LOCK = threading.Lock()
SEEN = set()
LOG = None


def log(rec):
    line = json.dumps(rec, sort_keys=True) + "\n"
    with LOCK:
        LOG.write(line)
        LOG.flush()


class Events(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"               # keep-alive

    def log_message(self, *a):
        pass

    def do_POST(self):
        t0 = time.time()
        rec = {"ev": "req", "t0": round(t0, 4), "path": self.path,
               "peer": self.client_address[1]}
        try:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n)
            rec["t_body"] = round(time.time(), 4)
            rec["wire"] = len(raw)
            body = raw
            rec["gz"] = self.headers.get("Content-Encoding") == "gzip"
            if rec["gz"]:
                body = gzip.decompress(raw)
            rec["body"] = len(body)
            key = self.headers.get("Idempotency-Key")
            rec["key"] = key
            rec["ids"] = [i for i in (self.headers.get("X-Myq-Ids") or "").split(",") if i]
            rec["backlog"] = self.headers.get("X-Myq-Backlog") == "1"
            try:
                events = json.loads(body)
                rec["array"] = isinstance(events, list)
                if not isinstance(events, list):
                    events = [events]
                rec["rids"] = [e.get("rid") if isinstance(e, dict) else None
                               for e in events]
                rec["runs"] = sorted({str(e.get("run")) for e in events
                                      if isinstance(e, dict)})
                ts = [e.get("t") for e in events if isinstance(e, dict)
                      and isinstance(e.get("t"), (int, float))]
                if ts:
                    rec["tmin"] = min(ts)
            except ValueError as e:
                rec["error"] = "bad json: %s" % e
        except Exception as e:      # noqa: BLE001 - logged for the harness
            rec["error"] = "%s: %s" % (type(e).__name__, e)
            self.close_connection = True
        if STATE["503"]:
            status = 503
        elif "error" in rec:
            status = 400
        else:
            status = 200
            with LOCK:
                rec["new_key"] = key not in SEEN   # at-least-once: drop repeats
                SEEN.add(key)
        self.send_response(status)
        if status == 503:
            self.send_header("Retry-After", "5")
        self.send_header("Content-Length", "0")
        self.end_headers()
        try:
            self.wfile.flush()
        except OSError as e:
            rec["send_error"] = str(e)
        rec["status"] = status
        rec["t1"] = round(time.time(), 4)
        log(rec)


def main():
    global LOG
    p = argparse.ArgumentParser()
    p.add_argument("--listen", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--log", required=True)
    a = p.parse_args()
    LOG = open(a.log, "a")
    host, port = a.listen.rsplit(":", 1)

    def on(sig, frame):
        STATE["503"] = sig == signal.SIGUSR1
        log({"ev": "mode", "t": round(time.time(), 4), "503": STATE["503"]})
    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGUSR2, on)
    srv = ThreadingHTTPServer((host, int(port)), Events)
    srv.daemon_threads = True

    def stop(sig, frame):
        threading.Thread(target=srv.shutdown, daemon=True).start()
    signal.signal(signal.SIGTERM, stop)
    log({"ev": "start", "run": a.run, "pid": os.getpid(), "t": round(time.time(), 4),
         "listen": a.listen})
    srv.serve_forever(poll_interval=0.2)
    log({"ev": "exit", "t": round(time.time(), 4)})


if __name__ == "__main__":
    sys.exit(main())
