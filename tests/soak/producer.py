#!/usr/bin/env python3
"""The bridge soak's producers: one reading stream published at QoS 1 to
each local broker (MQTT 3.1.1, our own code, neither myq's nor a library's),
in the device's namespace.

    python3 producer.py --side myq=1884 --side bridge=1885 --rate 10
                        --start EPOCH --run NONCE --log FILE

Every side gets the same readings (the same id, the same bytes) on
`soak/NONCE/SIDE/sN`, one at a time: the next goes once the broker has
answered the last.  A reading is *accepted* when its PUBACK came; a
connection that fails (the broker killed) is made again every 0.1 s and
the reading sent again (DUP set), until --give-up seconds after it was
due.  Readings due meanwhile wait and go late, in order.  SIGTERM: stop
after the reading in hand.

Log, one JSON object a line: {"ev": "start"}, {"ev": "conn", "side"},
{"ev": "acc", "side", "rid", "seq", "t", "due", "tries"}, {"ev": "gave_up",
"side", "rid"}, {"ev": "lost", "side", "why"} (a connection ended),
{"ev": "end", "side", "acc", "gave_up"}.
"""
import argparse
import json
import os
import signal
import socket
import struct
import sys
import threading
import time

STOP = threading.Event()


def enc_len(n):
    out = bytearray()
    while True:
        n, b = n >> 7, n & 127
        out.append(b | 128 if n else b)
        if not n:
            return bytes(out)


def s16(b):
    return struct.pack(">H", len(b)) + b


def read_packet(sock):
    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed by the broker")
            buf += chunk
        return buf
    h = exact(1)[0]
    mult, n = 1, 0
    while True:
        b = exact(1)[0]
        n += (b & 127) * mult
        mult *= 128
        if not b & 128:
            break
    return h, exact(n) if n else b""


def reading(run, seq, due):
    rid = "%s-%07d" % (run, seq)
    body = {"id": rid, "rid": rid, "run": run, "seq": seq, "t": round(due, 4),
            "sensor": "edge-%02d" % (seq % 7), "temp_c": round(18 + (seq % 97) / 10.0, 1),
            "rh": (seq * 7) % 100, "batt_mv": 3700 + seq % 400, "pad": ""}
    body["pad"] = "x" * max(0, 300 - len(json.dumps(body)))
    return rid, json.dumps(body, sort_keys=True).encode()


class Side(object):
    def __init__(self, name, port, a, log):
        self.name, self.port, self.a, self.log = name, port, a, log
        self.sock = None
        self.pid = 0
        self.acc = self.gave_up = 0

    def connect(self):
        sock = socket.create_connection(("127.0.0.1", self.port), 1.0)
        sock.settimeout(3.0)
        cid = ("soak-prod-%s-%d" % (self.name, os.getpid())).encode()
        vh = s16(b"MQTT") + bytes([4, 0x02]) + struct.pack(">H", 30)    # clean session
        sock.sendall(bytes([0x10]) + enc_len(len(vh) + len(s16(cid))) + vh + s16(cid))
        h, body = read_packet(sock)
        if h >> 4 != 2 or len(body) < 2 or body[1] != 0:
            sock.close()
            raise ConnectionError("CONNACK %r" % body)
        self.sock = sock
        self.log("conn", side=self.name)

    def drop(self, why):
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None
            self.log("lost", side=self.name, why=str(why))

    def publish(self, topic, payload, dup):
        self.pid = self.pid % 65535 + 1
        vh = s16(topic.encode()) + struct.pack(">H", self.pid)
        self.sock.sendall(bytes([0x32 | (8 if dup else 0)]) +
                          enc_len(len(vh) + len(payload)) + vh + payload)
        while True:
            h, body = read_packet(self.sock)
            if h >> 4 == 4 and struct.unpack(">H", body[:2])[0] == self.pid:
                return
            if h >> 4 != 13:
                raise ConnectionError("unexpected packet %#x" % h)

    def run(self):
        a = self.a
        seq = 0
        last_ping = time.time()
        while not STOP.is_set():
            due = a.start + seq / a.rate
            while not STOP.is_set() and time.time() < due:
                time.sleep(min(0.05, max(0.0, due - time.time())))
                if self.sock is not None and time.time() - last_ping > 10:
                    try:
                        self.sock.sendall(b"\xc0\x00")
                        last_ping = time.time()
                    except OSError as e:
                        self.drop(e)
            if STOP.is_set():
                break
            rid, payload = reading(a.run, seq, due)
            topic = "soak/%s/%s/s%d" % (a.run, self.name, seq % 3)
            tries = 0
            while True:
                if time.time() > due + a.give_up:
                    self.gave_up += 1
                    self.log("gave_up", side=self.name, rid=rid, seq=seq)
                    break
                try:
                    if self.sock is None:
                        self.connect()
                    tries += 1
                    self.publish(topic, payload, tries > 1)
                    last_ping = time.time()
                    self.acc += 1
                    self.log("acc", side=self.name, rid=rid, seq=seq, due=round(due, 4),
                             tries=tries)
                    break
                except (OSError, ConnectionError, IndexError, struct.error) as e:
                    self.drop(e)
                    time.sleep(0.1)
            seq += 1
        self.log("end", side=self.name, acc=self.acc, gave_up=self.gave_up)
        self.drop("end")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--side", action="append", required=True, help="NAME=PORT")
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--start", type=float, default=0.0)
    p.add_argument("--give-up", type=float, default=15.0)
    p.add_argument("--run", required=True)
    p.add_argument("--log", required=True)
    a = p.parse_args()
    a.start = a.start or time.time()
    logf = open(a.log, "a", buffering=1)
    lock = threading.Lock()

    def log(ev, **kw):
        kw["ev"] = ev
        kw.setdefault("t", round(time.time(), 4))
        line = json.dumps(kw, sort_keys=True) + "\n"
        with lock:
            logf.write(line)

    signal.signal(signal.SIGTERM, lambda s, f: STOP.set())
    log("start", run=a.run, pid=os.getpid(), sides=a.side)
    sides = []
    for spec in a.side:
        name, _, port = spec.partition("=")
        sides.append(Side(name, int(port), a, log))
    threads = [threading.Thread(target=s.run) for s in sides]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
