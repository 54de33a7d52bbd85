#!/usr/bin/env python3
"""The soak's MQTT receiver: a QoS 1 subscriber (MQTT 3.1.1, its own code,
not myq's) on the broker's loopback, in the server's namespace.

    python3 subscriber.py --port 1883 --topic 'soak/NONCE/#' --run NONCE --log FILE

It reconnects (every 50 ms) whenever the connection drops (the broker is
killed and restarted in the soak) and subscribes again on every connect.
Log: {"ev": "start"}, {"ev": "connack"}, {"ev": "suback", "n"}, one
{"ev": "msg", "t", "rid", "run", "dup", "topic", "tmin"} per PUBLISH (each
acknowledged with its PUBACK after the line is written), {"ev": "lost"}
when a connection ends.
"""
import argparse
import json
import os
import socket
import struct
import sys
import time


def enc_len(n):
    out = bytearray()
    while True:
        n, b = n >> 7, n & 127
        out.append(b | 128 if n else b)
        if not n:
            return bytes(out)


def s16(b):
    return struct.pack(">H", len(b)) + b


def read_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def read_packet(sock):
    h = read_exact(sock, 1)[0]
    mult, n = 1, 0
    while True:
        b = read_exact(sock, 1)[0]
        n += (b & 127) * mult
        mult *= 128
        if not b & 128:
            break
    return h, read_exact(sock, n) if n else b""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1883)
    p.add_argument("--topic", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--log", required=True)
    a = p.parse_args()
    logf = open(a.log, "a", buffering=1)

    def log(ev, **kw):
        kw["ev"] = ev
        kw.setdefault("t", round(time.time(), 4))
        logf.write(json.dumps(kw, sort_keys=True) + "\n")

    log("start", run=a.run, pid=os.getpid())
    cid = ("soak-sub-%d" % os.getpid()).encode()
    pid_n = 1
    while True:
        try:
            sock = socket.create_connection((a.host, a.port), 2)
        except OSError:
            time.sleep(0.05)
            continue
        try:
            sock.settimeout(60)
            # CONNECT: clean session, keepalive 30 s
            vh = s16(b"MQTT") + bytes([4, 0x02]) + struct.pack(">H", 30)
            pl = s16(cid)
            sock.sendall(bytes([0x10]) + enc_len(len(vh + pl)) + vh + pl)
            h, body = read_packet(sock)
            if h >> 4 != 2 or body[1] != 0:
                raise ConnectionError("connack %r" % body)
            log("connack")
            pl = struct.pack(">H", pid_n) + s16(a.topic.encode()) + b"\x01"
            pid_n = pid_n % 65535 + 1
            sock.sendall(bytes([0x82]) + enc_len(len(pl)) + pl)
            last_ping = time.time()
            sock.settimeout(5)
            while True:
                try:
                    h, body = read_packet(sock)
                except socket.timeout:
                    h = None
                if time.time() - last_ping > 10:
                    sock.sendall(b"\xc0\x00")       # PINGREQ
                    last_ping = time.time()
                if h is None:
                    continue
                kind = h >> 4
                if kind == 9:
                    log("suback", granted=list(body[2:]))
                elif kind == 3:
                    qos = (h >> 1) & 3
                    tl = struct.unpack(">H", body[:2])[0]
                    topic = body[2:2 + tl].decode("utf-8", "replace")
                    off = 2 + tl
                    mid = None
                    if qos:
                        mid = struct.unpack(">H", body[off:off + 2])[0]
                        off += 2
                    msg = body[off:]
                    rec = {"topic": topic, "dup": bool(h & 8), "qos": qos,
                           "bytes": len(msg)}
                    try:
                        m = json.loads(msg)
                        rec["rid"] = m.get("rid")
                        rec["run"] = m.get("run")
                        rec["tmin"] = m.get("t")
                    except (ValueError, AttributeError) as e:
                        rec["error"] = str(e)
                    log("msg", **rec)
                    if qos == 1:
                        sock.sendall(b"\x40\x02" + struct.pack(">H", mid))
                elif kind == 13:
                    pass                                # PINGRESP
        except (OSError, ConnectionError, IndexError) as e:
            log("lost", why=str(e))
            try:
                sock.close()
            except OSError:
                pass
            time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
