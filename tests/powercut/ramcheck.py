"""The RAM tier's loss bound, checked (the ext4-ram and ubifs-ram parts;
SPEC 13): pure functions, no VM, so that test_ram_checker.py can show
that each of them can fail.

After a cut at moment T (this machine's monotonic clock) and the reboot,
every job whose enqueue returned (the producer's record: `ret`, the same
clock) is

  delivered   the receiver has it (an answer 200, recorded before it was
              sent: receiver.py's log, from any epoch up to the cut's), or
  in the spool  the recovery found it there (check.recover_and_check: not
              lost), or delivered it from there (the receiver's log of the
              epoch after the cut),
  else LOST:  `lost_beyond_bound` when it was promised more than
              bound + margin seconds before T (`bound`: the type's
              spill_after; `margin`: how late the harness may see the cut,
              stated with the result), or when its type is durable=always
              (no bound: nothing of it may be lost); else
              `lost_within_bound`, what SPEC 13 allows a power cut to take.

doubled: a job the receiver answered 200 twice in one epoch (no cut
between to explain it; a delivery before a cut and one after it, of a job
the spool still had, is at-least-once).  corrupt: a delivery whose payload
fails its checksum or is not the one promised.
"""

import collections

Delivery = collections.namedtuple("Delivery", "epoch t id sum verdict")


def read_deliveries(path, offset=0):
    """([Delivery], new offset) of receiver.py's log from `offset`; a torn
    last line is left for the next read."""
    out = []
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return out, offset
    end = data.rfind(b"\n") + 1
    for line in data[:end].decode("utf-8", "replace").splitlines():
        p = line.split()
        if len(p) != 5:
            continue
        try:
            out.append(Delivery(int(p[0]), float(p[1]), p[2], p[3], p[4]))
        except ValueError:
            continue
    return out, offset + end


class Ledger(object):
    """What was promised and what the receiver has, over all rounds."""

    def __init__(self):
        self.promised = {}      # id -> (sum, ret, durable: "outage"/"always")
        self.delivered = {}     # id -> [epoch, ...]
        self.seen = set()       # (epoch, id) answered 200
        self.doubled_ids = []
        self.corrupt_ids = []
        self.unpromised = 0
        self.reused = []        # ids promised twice
        self.gone = set()       # lost ids, forgotten
        self.settled = set()    # ids a recovery found finished (done, dead)

    def promise(self, jid, sum_, ret, durable="outage"):
        """A job whose enqueue returned at `ret`.  An id promised before
        is another job given the same id (the ledger would lose one):
        counted in `reused`, which fails the run."""
        if jid in self.promised or jid in self.delivered or jid in self.gone:
            self.reused.append(jid)
        self.promised[jid] = (sum_, ret, durable)

    def forget(self, jid):
        """A lost job, counted once: not checked again."""
        del self.promised[jid]
        self.gone.add(jid)

    def settle(self, jid):
        """A promised job a recovery found finished in the spool (done or
        dead: nothing moves it again): no longer looked for after a cut
        (a durable=always job never reaches the receiver; a delivered one
        is settled by its delivery)."""
        self.settled.add(jid)

    def add(self, deliveries):
        """Book the receiver's new lines; returns (doubled, corrupt) among them."""
        doubled = corrupt = 0
        for d in deliveries:
            key = (d.epoch, d.id)
            if key in self.seen:
                doubled += 1
                self.doubled_ids.append(d.id)
            self.seen.add(key)
            self.delivered.setdefault(d.id, []).append(d.epoch)
            want = self.promised.get(d.id)
            if want is None:
                self.unpromised += 1
            if d.verdict != "ok" or (want is not None and want[0] != d.sum):
                corrupt += 1
                self.corrupt_ids.append(d.id)
        return doubled, corrupt

    def delivered_by(self, epoch):
        """Ids the receiver had answered 200 in epochs up to `epoch`."""
        return set(i for i, eps in self.delivered.items()
                   if any(e <= epoch for e in eps))

    def outstanding(self, epoch, cut):
        """{id: sum} promised before `cut` and not delivered by `epoch`: what
        must be in the spool after the cut."""
        got = self.delivered_by(epoch)
        return dict((i, v[0]) for i, v in self.promised.items()
                    if v[1] < cut and i not in got and i not in self.settled)


def classify(lost, promised, cut, bound, margin):
    """Lost ids (after a cut at `cut`) split by the bound: a dict with
    lost_beyond_bound, lost_within_bound (counts), beyond, within (ids),
    ages ({id: seconds from its promise to the cut})."""
    res = {"lost_beyond_bound": 0, "lost_within_bound": 0, "beyond": [],
           "within": [], "ages": {}}
    for jid in sorted(lost):
        _, ret, durable = promised[jid]
        age = cut - ret
        res["ages"][jid] = round(age, 3)
        if durable != "outage" or age > bound + margin:
            res["lost_beyond_bound"] += 1
            res["beyond"].append(jid)
        else:
            res["lost_within_bound"] += 1
            res["within"].append(jid)
    return res


def lost_after(ledger, epoch, cut, not_in_spool, redelivered=()):
    """The ids lost by the cut ending `epoch`: promised before it, not
    delivered by then, not found in the spool by the recovery
    (`not_in_spool`: check.recover_and_check's lost ids, asked about the
    outstanding ones), and not delivered from the spool in the epoch after
    (`redelivered`)."""
    out = ledger.outstanding(epoch, cut)
    return sorted(i for i in not_in_spool if i in out and i not in set(redelivered))


# What a run must show, or it proved nothing (each a failure, said loudly)
def problems(t, want_cuts):
    """Why a RAM part's totals fail it: a broken promise, or a run that
    could not check what it claims.  [] when it passed."""
    out = []
    for k in ("lost_beyond_bound", "doubled", "corrupt", "stuck", "in_failed",
              "recover", "fsck"):
        if t.get(k):
            out.append("%s=%d" % (k, t[k]))
    if t.get("cuts", 0) < want_cuts:
        out.append("%d cuts, fewer than the %d asked for" % (t.get("cuts", 0),
                                                           want_cuts))
    if not t.get("ram_seen"):
        out.append("no job was ever seen in the RAM tier (RAM-first did not "
                   "happen: nothing of the bound was checked)")
    if t.get("not_tmpfs"):
        out.append("the RAM tier's directory was not on a tmpfs in %d rounds"
                   % t["not_tmpfs"])
    if t.get("empty_rounds"):
        out.append("%d rounds produced no job" % t["empty_rounds"])
    if t.get("cuts", 0) and not t.get("spooled"):
        out.append("no durable=outage job was ever found in the spool after a "
                   "cut (the spill was never exercised)")
    if t.get("cuts", 0) and not t.get("down_rounds"):
        out.append("the link was never down or flapping in a round")
    if t.get("reused_ids"):
        out.append("%d ids were given to two jobs" % t["reused_ids"])
    if t.get("producer_errors"):
        out.append("%d enqueues failed with no cut to explain them"
                   % t["producer_errors"])
    if t.get("bound_wrong"):
        out.append("myq stats did not state the bound set (%s)" % t["bound_wrong"])
    return out


def summary(fs, t):
    """The part's line: the five fields the issue asks for, then the rest."""
    line = ("powercut: fs=%s cuts=%d lost_beyond_bound=%d lost_within_bound=%d "
            "doubled=%d corrupt=%d" % (fs, t.get("cuts", 0),
                                       t.get("lost_beyond_bound", 0),
                                       t.get("lost_within_bound", 0),
                                       t.get("doubled", 0), t.get("corrupt", 0)))
    for k in ("stuck", "in_failed", "recover", "fsck", "rounds", "down_rounds",
              "promised", "delivered", "spooled", "ram_seen",
              "max_lost_in_a_cut", "recovery_runs", "corrupt_ids"):
        if k in t:
            line += " %s=%s" % ("recover_errors" if k == "recover" else
                                "fs_errors" if k == "fsck" else k, t[k])
    for k in ("oldest_lost_s", "bound_s", "margin_s"):
        if k in t:
            line += " %s=%s" % (k, t[k])
    return line
