#!/usr/bin/env python3
"""The soak's user-space link emulator: a TCP proxy for what this kernel
cannot do (no sch_netem here, no tc classifiers for a random drop).

    python3 link.py --map 127.0.0.1:18080=10.213.7.2:8080 [--map ...]
                    --delay 0.1 --loss 0.015 --log FILE [--seed N]

It runs in the device's network namespace: the worker connects to it on
loopback; its upstream connections leave through the veth pair, whose tbf
qdiscs (kernel) make the 1 Mbit/s.  Here:

- delay: every chunk, each direction, leaves `--delay` seconds after it
  was read (first data of a connection: after one more round trip, the
  TCP handshake).  Order is kept (a spike delays what follows too).
- loss: TCP turns a lost segment into a retransmission, so a loss is a
  delay spike: a chunk of k segments (1,460 bytes) gets one with
  probability 1 - (1 - loss)^k, of 0.2-0.6 s (an RTO).
- down (SIGUSR1) / up (SIGUSR2): a black hole.  While down nothing is
  forwarded in either direction (what is read is thrown away, as a link
  without signal does) and new connections get no upstream; at up every
  connection that lived through the outage is reset (RST both ways: after
  minutes the far end and the carrier's NAT have forgotten the flow).
  The harness also takes the veth down, so that nothing queued in the
  kernel gets through either.

Log: one JSON object a line ({"t": epoch, "ev": ...}): start, conn,
down, up (with the connections reset), close, stats (every 5 s and at
exit: bytes each way, chunks, spikes, bytes thrown away).  SIGTERM ends it.
"""
import argparse
import asyncio
import json
import random
import signal
import socket
import struct
import sys
import time


class Link(object):
    def __init__(self, args):
        self.delay = args.delay
        self.loss = args.loss
        self.rng = random.Random(args.seed)
        self.up = True
        self.epoch = 0          # bumped at every down
        self.conns = set()
        self.next_id = 0
        self.st = {"up_bytes": 0, "down_bytes": 0, "chunks": 0, "spikes": 0,
                   "spike_s": 0.0, "dropped_bytes": 0, "conns": 0,
                   "resets": 0, "refused": 0}
        self.logf = open(args.log, "a", buffering=1)

    def log(self, ev, **kw):
        kw["t"] = round(time.time(), 4)
        kw["ev"] = ev
        self.logf.write(json.dumps(kw, sort_keys=True) + "\n")

    def spike(self, n):
        k = max(1, (n + 1459) // 1460)
        if self.loss > 0 and self.rng.random() < 1 - (1 - self.loss) ** k:
            s = self.rng.uniform(0.2, 0.6)
            self.st["spikes"] += 1
            self.st["spike_s"] += s
            return s
        return 0.0

    def go_down(self):
        if not self.up:
            return
        self.up = False
        self.epoch += 1
        for c in self.conns:
            c.doomed = True
        self.log("down", conns=len(self.conns))

    def go_up(self):
        if self.up:
            return
        self.up = True
        doomed = [c for c in self.conns if c.doomed]
        for c in doomed:
            c.reset("outage")
        self.log("up", reset=len(doomed))


def _rst(writer):
    """Close with RST (SO_LINGER 0)."""
    if writer is None:
        return
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                            struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        writer.transport.abort()
    except Exception:
        pass


class Conn(object):
    def __init__(self, link, reader, writer, target):
        self.link = link
        self.id = link.next_id
        link.next_id += 1
        self.lr, self.lw = reader, writer
        self.ur = self.uw = None
        self.target = target
        self.doomed = not link.up
        self.closed = False
        self.t_accept = time.time()
        self.tasks = []

    def reset(self, why):
        if self.closed:
            return
        self.closed = True
        self.link.st["resets"] += 1
        _rst(self.lw)
        _rst(self.uw)
        for t in self.tasks:
            t.cancel()
        self.link.conns.discard(self)
        self.link.log("close", id=self.id, why=why)

    def finish(self, why):
        if self.closed:
            return
        self.closed = True
        for w in (self.lw, self.uw):
            if w is not None:
                try:
                    w.close()
                except Exception:
                    pass
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        self.link.conns.discard(self)
        self.link.log("close", id=self.id, why=why)

    async def run(self):
        link = self.link
        link.conns.add(self)
        link.st["conns"] += 1
        # the handshake: one round trip before the first byte can leave
        ready_at = self.t_accept + 2 * link.delay
        up_q = asyncio.Queue()
        down_q = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self.pump_in(self.lr, up_q, "up", ready_at)),
                      asyncio.ensure_future(self.connect_and_out(up_q, down_q, ready_at))]
        lport = self.lw.get_extra_info("peername")[1]
        link.log("conn", id=self.id, client_port=lport, target="%s:%d" % self.target,
                 doomed=self.doomed)
        try:
            await asyncio.gather(*self.tasks)
        except asyncio.CancelledError:
            pass
        except Exception as e:
            self.reset("error %r" % e)

    async def pump_in(self, reader, q, direction, not_before):
        """Read a side; queue each chunk with its release time."""
        link = self.link
        last = 0.0
        while True:
            try:
                data = await reader.read(65536)
            except (ConnectionError, OSError):
                data = None
            now = time.time()
            if not link.up or self.doomed:
                if data:
                    link.st["dropped_bytes"] += len(data)
                    continue
                if data is None or not data:
                    # an end seen in a black hole: nothing reaches the
                    # other side; the reset at up closes the rest
                    await asyncio.sleep(3600)
                    return
            rel = max(now, not_before, last) + link.delay
            if data:
                rel += link.spike(len(data))
                link.st["chunks"] += 1
            last = rel
            await q.put((rel, data))
            if not data:
                return

    async def pump_out(self, q, writer, direction):
        link = self.link
        while True:
            rel, data = await q.get()
            wait = rel - time.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not link.up or self.doomed:
                if data:
                    link.st["dropped_bytes"] += len(data)
                continue
            if data is None:                # a reset on the other side
                self.reset("reset by %s" % ("client" if direction == "up" else "server"))
                return
            if not data:                    # an orderly end: pass it on
                self.finish("eof from %s" % ("client" if direction == "up" else "server"))
                return
            writer.write(data)
            link.st["up_bytes" if direction == "up" else "down_bytes"] += len(data)
            try:
                await writer.drain()
            except (ConnectionError, OSError):
                self.reset("write error %s" % direction)
                return

    async def connect_and_out(self, up_q, down_q, ready_at):
        link = self.link
        wait = ready_at - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        while self.doomed or not link.up:
            await asyncio.sleep(3600)       # a black hole; reset at up
        try:
            self.ur, self.uw = await asyncio.wait_for(
                asyncio.open_connection(*self.target), 10)
        except (OSError, asyncio.TimeoutError) as e:
            link.st["refused"] += 1
            await asyncio.sleep(link.delay)      # the RST travels back
            self.reset("connect failed: %s" % e)
            return
        if self.doomed:
            self.reset("outage")
            return
        t_in = asyncio.ensure_future(self.pump_in(self.ur, down_q, "down", 0))
        t_up = asyncio.ensure_future(self.pump_out(up_q, self.uw, "up"))
        t_down = asyncio.ensure_future(self.pump_out(down_q, self.lw, "down"))
        self.tasks += [t_in, t_up, t_down]
        await asyncio.gather(t_in, t_up, t_down)


async def main_async(args):
    link = Link(args)
    loop = asyncio.get_event_loop()
    loop.add_signal_handler(signal.SIGUSR1, link.go_down)
    loop.add_signal_handler(signal.SIGUSR2, link.go_up)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    servers = []
    for m in args.map:
        local, remote = m.split("=")
        lh, lp = local.rsplit(":", 1)
        rh, rp = remote.rsplit(":", 1)
        target = (rh, int(rp))

        def handler(r, w, target=target):
            return Conn(link, r, w, target).run()
        servers.append(await asyncio.start_server(handler, lh, int(lp)))
    link.log("start", maps=args.map, delay=args.delay, loss=args.loss)

    async def stats():
        while True:
            await asyncio.sleep(5)
            link.log("stats", **link.st)
    st = asyncio.ensure_future(stats())
    await stop.wait()
    st.cancel()
    for s in servers:
        s.close()
    for c in list(link.conns):
        c.reset("exit")
    link.log("stats", final=True, **link.st)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--map", action="append", required=True,
                   help="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    p.add_argument("--delay", type=float, default=0.1)
    p.add_argument("--loss", type=float, default=0.015)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--log", required=True)
    args = p.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
