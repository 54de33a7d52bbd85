"""RAM first (myq(1) RAM FIRST): a type of durable=outage is kept and
delivered from the RAM tier (`init --ram DIR`, a tmpfs) with nothing
written to the spool's filesystem, and moves to the spool (id, attempts,
priority, created_at kept) when a run fails, when it waited spill_after,
past ram_max and when its worker stops; a killed worker loses nothing, a
reboot only what the bound allows; list, show, stats, delete and export see
both tiers.  Both stores (the `spool` fixture)."""
import json
import os
import signal
import time

import pytest

from _core import (FAST, cli, ok, start_worker, stop, wait_for, listed,
                   listening)

HANDLER = r'''
import json, os
def tele(job):
    with open(os.environ["RAM_TEST_OUT"], "a") as f:
        f.write(json.dumps(job["payload"]) + "\n")
    if os.path.exists(os.environ["RAM_TEST_OUT"] + ".fail"):
        raise RuntimeError("the link is down")
    if os.path.exists(os.environ["RAM_TEST_OUT"] + ".block"):
        import time
        while os.path.exists(os.environ["RAM_TEST_OUT"] + ".block"):
            time.sleep(0.02)
'''



class Tier(object):
    """A spool with a RAM tier, its type `tele` of durable=outage, and a
    worker delivering it through HANDLER (start(), stop())."""

    def __init__(self, spool, ram, tmp_path, **rules):
        self.spool, self.ram, self.tmp = spool, ram, tmp_path
        self.out = str(tmp_path / "delivered")
        self.log = str(tmp_path / "worker.log")
        mod = tmp_path / "h.py"
        mod.write_text(HANDLER)
        self.module = str(mod)
        ok(cli(spool, "init", "--ram", ram))
        pairs = dict(durable="outage", spill_after="1h")
        pairs.update(rules)
        ok(cli(spool, "policy", "tele", *("%s=%s" % kv for kv in pairs.items())))
        self.proc = None

    def start(self, *opts):
        if "--log" not in opts:
            opts += ("--log", self.log)
        self.proc = start_worker(
            self.spool, "--module", self.module, *(FAST + opts),
            env={"RAM_TEST_OUT": self.out},
            stderr=open(str(self.tmp / "worker.err"), "ab"))
        wait_for(lambda: os.path.isdir(os.path.join(self.ram, "incoming"))
                 and listening(self.spool), what="the worker listening")
        return self.proc

    def stop(self, sig=signal.SIGTERM):
        return stop(self.proc, sig)

    def enqueue(self, payload, type_="tele", *opts):
        return ok(cli(self.spool, "enqueue", type_, json.dumps(payload),
                      *opts)).stdout.strip()

    def delivered(self):
        try:
            with open(self.out) as f:
                return [json.loads(l) for l in f if l.strip()]
        except OSError:
            return []

    def in_ram(self):
        """The ids of the job files in the RAM tier (waiting or running)."""
        out = []
        for root, _, files in os.walk(self.ram):
            if "/done" in root or "/locks" in root:
                continue
            out += [f.partition("+")[0].rpartition(".json")[0] or
                    f.partition("+")[0] for f in files if ".json" in f]
        return sorted(out)

    def in_spool(self, state=None):
        """The ids of the spool's own jobs (not the tier's), by list."""
        rows = []
        for st in ([state] if state else ["ready", "scheduled", "held",
                                          "processing", "done", "dead"]):
            rows += [r for r in listed(self.spool, st) if r.get("tier") != "ram"]
        return sorted(r["id"] for r in rows)


def _not_ram(tmp_path):
    """A directory on a filesystem that is not RAM (the checkout's: the
    tests' own files may be on a tmpfs, make test's TEST_TMPDIR)."""
    import myq
    from _core import ROOT
    for d in (str(tmp_path), ROOT, "/var/tmp"):
        if os.path.isdir(d) and myq.fs_type(d) not in myq.RAM_FILESYSTEMS:
            return os.path.join(d, "not-ram-%d" % os.getpid())
    pytest.skip("no directory here that is not on a RAM filesystem")


def test_init_refuses_a_directory_not_on_a_ram_filesystem(spool, tmp_path):
    cp = cli(spool, "init", "--ram", _not_ram(tmp_path))
    assert cp.returncode == 78, cp
    assert "not a RAM filesystem" in cp.stderr and "tmpfs" in cp.stderr
    assert not os.path.exists(os.path.join(spool, "ram"))


def test_policy_keys_are_checked(spool):
    assert cli(spool, "policy", "tele", "durable=sometimes").returncode == 64
    assert cli(spool, "policy", "tele", "spill_after=0").returncode == 64
    assert cli(spool, "policy", "tele", "ram_max=lots").returncode == 64
    ok(cli(spool, "policy", "tele", "durable=outage", "spill_after=5s",
           "ram_max=2M"))
    ok(cli(spool, "policy", "tele", "ram_max=50"))
    out = ok(cli(spool, "policy", "tele")).stdout
    assert "durable=outage" in out and "spill_after=5s" in out
    assert "ram_max=50" in out


def test_delivered_from_ram_nothing_in_the_spool(spool, ram, tmp_path):
    t = Tier(spool, ram, tmp_path)
    t.start()
    try:
        ids = [t.enqueue({"n": i}) for i in range(5)]
        wait_for(lambda: len(t.delivered()) == 5, what="5 deliveries")
        assert sorted(d["n"] for d in t.delivered()) == list(range(5))
        # not one of them was ever the spool's
        assert t.in_spool() == []
        assert not set(ids) & set(os.listdir(os.path.join(spool, "done")))
    finally:
        t.stop()


def test_a_failed_run_moves_the_job_to_the_spool_as_it_was(spool, ram, tmp_path):
    t = Tier(spool, ram, tmp_path)
    open(t.out + ".fail", "w").close()
    t.start()
    try:
        jid = t.enqueue({"n": 1}, "tele", "--priority", "3")
        made = ok(cli(spool, "show", jid))
        wait_for(lambda: jid in t.in_spool(), what="the job in the spool")
        job = json.loads(ok(cli(spool, "show", jid)).stdout)
        assert "tier" not in job and job["attempts"] == 1
        assert job["last_error"] and "the link is down" in job["last_error"]
        assert job["priority"] == 3
        assert job["created_at"] == json.loads(made.stdout)["created_at"]
        assert t.in_ram() == []
    finally:
        t.stop()


def test_a_job_waits_in_ram_at_most_spill_after(spool, ram, tmp_path):
    t = Tier(spool, ram, tmp_path, spill_after="2s")
    ok(cli(spool, "pause", "tele"))
    t.start()
    try:
        t0 = time.monotonic()
        jid = t.enqueue({"n": 1})
        where = t.in_ram(), t.in_spool()
        job = json.loads(ok(cli(spool, "show", jid)).stdout)
        if time.monotonic() - t0 < 1.5:
            # (looked at within its spill_after, which a loaded machine's
            # enqueue and show may outlast: the checks below still hold)
            assert where == ([jid], [])
            assert job["tier"] == "ram" and job["state"] == "ready"
        wait_for(lambda: jid in t.in_spool() and not t.in_ram(), timeout=10,
                 what="the spill")
        # moved within its spill_after of its making, by the worker's clock
        made = json.loads(ok(cli(spool, "show", jid)).stdout)["created_at"]
        moved = [l for l in open(t.log) if "event=moved" in l][0]
        import calendar
        stamp = moved.split()[0]
        when = calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) \
            + float("0" + stamp[19:-1])
        assert 0 < when - made < 2.0, (when - made)
    finally:
        t.stop()


def test_past_ram_max_the_oldest_move(spool, ram, tmp_path):
    t = Tier(spool, ram, tmp_path, ram_max="2")
    ok(cli(spool, "pause", "tele"))
    t.start()
    try:
        ids = [t.enqueue({"n": i}) for i in range(5)]
        wait_for(lambda: len(t.in_spool()) == 3 and len(t.in_ram()) == 2,
                 what="3 moved")
        assert t.in_spool() == sorted(ids[:3])      # the oldest
        assert t.in_ram() == sorted(ids[3:])
    finally:
        t.stop()


def test_a_stopping_worker_moves_what_ram_holds(spool, ram, tmp_path):
    t = Tier(spool, ram, tmp_path)
    ok(cli(spool, "pause", "tele"))
    t.start()
    ids = [t.enqueue({"n": i}) for i in range(3)]
    assert sorted(ids) == t.in_ram()
    assert t.stop() == 0
    assert t.in_spool() == sorted(ids) and t.in_ram() == []


def test_kill_9_loses_nothing(spool, ram, tmp_path):
    t = Tier(spool, ram, tmp_path)
    open(t.out + ".block", "w").close()
    t.start()
    a = t.enqueue({"n": 1})
    wait_for(lambda: t.delivered(), what="the run started")
    ok(cli(spool, "pause", "tele"))
    b = t.enqueue({"n": 2})
    t.stop(signal.SIGKILL)
    assert sorted([a, b]) == t.in_ram()         # (the tier outlived it)
    os.unlink(t.out + ".block")
    ok(cli(spool, "resume", "tele"))
    t.start()
    try:
        wait_for(lambda: len(set(d["n"] for d in t.delivered())) == 2,
                 what="both delivered")
    finally:
        t.stop()


def test_a_reboot_loses_only_what_the_bound_allows(spool, ram, tmp_path):
    """Every myq process SIGKILLed, the tmpfs gone: the durable type's
    jobs and the moved ones stay; the tier is made again at the next
    start."""
    t = Tier(spool, ram, tmp_path)
    ok(cli(spool, "pause", "tele"))
    ok(cli(spool, "pause", "alarm"))
    ok(cli(spool, "policy", "tele", "ram_max=1"))
    t.start()
    alarm = t.enqueue({"a": 1}, "alarm")
    moved = t.enqueue({"n": 1})
    kept = t.enqueue({"n": 2})          # younger than spill_after: in RAM
    wait_for(lambda: moved in t.in_spool() and t.in_ram() == [kept],
             what="the first moved (ram_max), the second in RAM")
    t.stop(signal.SIGKILL)
    import shutil
    shutil.rmtree(ram)                  # (the power went)
    assert sorted(t.in_spool()) == sorted([alarm, moved])
    ok(cli(spool, "resume", "tele"))
    t.start()
    try:
        wait_for(lambda: [d.get("n") for d in t.delivered()] == [1],
                 what="the moved one delivered")
    finally:
        t.stop()
    assert 2 not in [d.get("n") for d in t.delivered()]


def test_no_worker_no_ram(spool, ram, tmp_path):
    """With no worker listening a job goes to the spool: nothing would
    move it out of RAM within its bound."""
    t = Tier(spool, ram, tmp_path)
    jid = t.enqueue({"n": 1})
    assert t.in_spool() == [jid]


def test_the_commands_see_both_tiers(spool, ram, tmp_path):
    t = Tier(spool, ram, tmp_path, spill_after="7s")
    ok(cli(spool, "pause", "tele"))
    t.start()
    try:
        a, b = t.enqueue({"n": 1}), t.enqueue({"n": 2})
        s = json.loads(ok(cli(spool, "stats", "--json")).stdout)
        assert s["ready"] == 2 and s["ram"] == 2 and s["ram_bound_s"] == 7
        line = ok(cli(spool, "stats")).stdout
        assert " ram=2 ram_bound_s=7" in line
        rows = listed(spool, "ready")
        assert sorted(r["id"] for r in rows) == sorted([a, b])
        assert all(r["tier"] == "ram" for r in rows)
        exported = [json.loads(l) for l in ok(cli(spool, "export")).stdout
                    .splitlines() if '"spool"' not in l[:10]]
        assert sorted(j["id"] for j in exported) == sorted([a, b])
        ok(cli(spool, "delete", a))
        assert t.in_ram() == [b]
    finally:
        t.stop()


def _settled(sectors):
    """The sectors written, once the worker's start has nothing more to
    write (two syncs 0.3 s apart saw the same count)."""
    last = [None]

    def same():
        os.sync()
        now = sectors()
        was, last[0] = last[0], now
        return was == now

    wait_for(same, interval=0.3, what="the start's writes done")
    return last[0]


def _sectors(dev):
    with open("/sys/block/%s/stat" % os.path.basename(dev)) as f:
        return int(f.read().split()[6])


@pytest.fixture
def ext4(tmp_path):
    """An ext4 image of 4 KiB blocks on a loop device: (mount point, the
    device's sectors written so far).  Root only."""
    from _core import ext4_image
    with ext4_image(tmp_path) as (mnt, dev):
        yield mnt, lambda: _sectors(dev)


@pytest.mark.parametrize("handler", ["python", "exec"])
def test_delivered_ram_jobs_write_nothing_to_the_flash(store, ram, tmp_path,
                                                       ext4, handler):
    """The device's sectors, counted while 40 jobs are made and delivered:
    durable=always writes for each, durable=outage nothing (the worker's
    heartbeat aside: a lease of 10 minutes keeps it out of the window),
    with a Python function and with an executable (its run record is the
    RAM tier's)."""
    mnt, sectors = ext4
    written = {}
    for mode in ("always", "outage"):
        spool = os.path.join(mnt, mode)
        ok(cli(spool, "init", "--store", store))
        t = Tier(spool, ram + "-" + mode, tmp_path, durable=mode)
        opts = ("--lease", "600", "--stats-interval", "0", "--log",
                str(tmp_path / (mode + ".log")))
        if handler == "exec":
            d = tmp_path / "handlers"
            d.mkdir(exist_ok=True)
            (d / "tele").write_text("#!/bin/sh\n(cat; echo) >> %s\n" % t.out)
            (d / "tele").chmod(0o755)
            t.proc = start_worker(spool, "--handlers", str(d), *(FAST + opts))
            wait_for(lambda: listening(spool), what="the worker listening")
        else:
            t.start(*opts)
        try:
            before = _settled(sectors)
            for i in range(40):
                t.enqueue({"n": i})
            wait_for(lambda: len(t.delivered()) == 40, what="40 delivered")
            os.sync()
            written[mode] = sectors() - before
        finally:
            t.stop()
            os.unlink(t.out)
    assert written["always"] > 40 * 8, written      # (the control: a block a job)
    assert written["outage"] <= 16, written


def test_a_run_longer_than_the_bound_leaves_a_copy_in_the_spool(spool, ram,
                                                                tmp_path):
    """A job still running from RAM at its spill_after gets a copy in the
    spool (a power cut then takes nothing older than the bound); its
    success removes the copy."""
    t = Tier(spool, ram, tmp_path, spill_after="2s")
    block, runs = tmp_path / "block", tmp_path / "runs"
    block.touch()
    # (a process: the worker's loop goes on while it runs; a Python
    # handler runs inline)
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "tele").write_text("#!/bin/sh\necho run >> %s\nwhile [ -e %s ]; "
                                   "do sleep 0.05; done\n" % (runs, block))
    (handlers / "tele").chmod(0o755)
    t.module = None
    t.proc = start_worker(spool, "--handlers", str(handlers), *FAST)
    wait_for(lambda: listening(spool), what="the worker listening")
    try:
        jid = t.enqueue({"n": 1})
        wait_for(runs.exists, what="the run started")
        wait_for(lambda: jid in t.in_spool(), timeout=10, what="the copy")
        job = [r for r in listed(spool, "scheduled") if r.get("tier") != "ram"]
        assert [r["id"] for r in job] == [jid]       # (due at the lease's end)
        block.unlink()
        wait_for(lambda: jid not in t.in_spool() and not t.in_ram(),
                 what="the copy gone with the success")
        assert runs.read_text() == "run\n"
    finally:
        t.stop()


def test_intake_answers_once_the_job_is_in_ram(spool, ram, tmp_path):
    """The HTTP intake's 202 for a durable=outage type: the job in the RAM
    tier (the manual says so beside the intake), not the spool."""
    from test_intake import Intake, post, auth
    t = Tier(spool, ram, tmp_path)
    ok(cli(spool, "pause", "tele"))
    t.start()
    i = Intake(spool, tmp_path, "--listen", "127.0.0.1:0").started()
    try:
        status, _, answer = post(i.port, "tele", b'{"n": 1}', auth(spool))
        assert status == 202, answer
        assert t.in_ram() == answer["ids"] and t.in_spool() == []
    finally:
        i.stop()
        t.stop()


def test_priority_then_creation_order_across_both_tiers(spool, ram, tmp_path):
    """One worker, both tiers waiting: the higher priority first, then
    the earlier made, whichever tier holds it."""
    t = Tier(spool, ram, tmp_path)
    # (alarm in a lane of its own, as tele is in the tier: a job in
    # incoming/ itself, after a poke the scheduler drained at a claim, is
    # seen at the next poll tick, and a later job of its priority in a
    # lane can go first: not the tiers' order, and open)
    ok(cli(spool, "policy", "alarm", "durable=always"))
    with open(t.module, "a") as f:
        f.write("alarm = tele\n")
    open(t.out + ".block", "w").close()
    t.start()
    try:
        t.enqueue({"n": 0}, "alarm", "--priority", "9")     # runs, blocks
        wait_for(lambda: t.delivered(), what="the first run")
        # (each made once files are stamped after the one before: see
        # _file_clock_past)
        for n, type_, opts in [(1, "alarm", ()),              # spool, 0
                               (2, "tele", ()),               # RAM, 0
                               (3, "tele", ("--priority", "5")),   # RAM, 5
                               (4, "alarm", ("--priority", "5")),  # spool, 5
                               (5, "alarm", ())]:             # spool, 0
            _file_clock_past(os.path.dirname(ram), time.time())
            t.enqueue({"n": n}, type_, *opts)
        assert len(t.in_ram()) == 2
        os.unlink(t.out + ".block")
        wait_for(lambda: len(t.delivered()) == 6, what="all delivered")
        assert [d["n"] for d in t.delivered()] == [0, 3, 4, 1, 2, 5]
    finally:
        t.stop()


def _file_clock_past(d, t):
    """Wait until a file written in directory `d` is stamped later than
    `t` (time.time()).  A job in the RAM tier is due at its file's mtime,
    which the kernel stamps from its tick clock, up to a tick (4 ms at
    HZ=250) behind time.time(); one in an SQLite spool at the time its
    producer read: two jobs made within a tick, one in each tier, start
    in either order (myq(1) RAM FIRST)."""
    probe = os.path.join(d, "clock-probe")

    def later():
        with open(probe, "w") as f:
            f.write("x")
        return os.stat(probe).st_mtime > t
    wait_for(later, interval=0.001, what="the file clock past %f" % t)
    os.unlink(probe)


def test_check_says_when_the_tier_is_not_on_a_ram_filesystem(spool, ram,
                                                             tmp_path):
    """After a boot where the directory is on flash (no tmpfs mounted
    there): check names it; a worker keeps every job in the spool."""
    Tier(spool, ram, tmp_path)
    assert ok(cli(spool, "check")).returncode == 0
    with open(os.path.join(spool, "ram"), "w") as f:
        f.write(_not_ram(tmp_path) + "\n")
    cp = cli(spool, "check")
    assert cp.returncode == 1 and "not a RAM filesystem" in cp.stdout


def test_a_held_destination_s_jobs_move_together(spool, ram, tmp_path):
    """With the destination held, the arrivals gather in RAM and move to
    the spool in one commit when the oldest is due (event=moved jobs=5),
    not one commit each (as many as durable=always makes): when a lane's
    oldest is due, the jobs behind it go with it."""
    t = Tier(spool, ram, tmp_path, spill_after="3s")
    with open(t.module, "a") as f:
        f.write("import myq\n"
                "def tele(job):\n"
                "    raise myq.DestinationDown(None, 'the link is down')\n")
    t.start()
    try:
        first = [t.enqueue({"n": i}) for i in range(3)]   # (the streak)
        wait_for(lambda: "event=hold " in open(t.log).read() and
                 t.in_spool() == sorted(first) and not t.in_ram(),
                 what="the destination held, its streak's jobs moved")
        moved = len([l for l in open(t.log) if "event=moved" in l])
        ids = [t.enqueue({"n": i}) for i in range(10, 15)]
        assert sorted(ids) == t.in_ram()
        wait_for(lambda: set(ids) <= set(t.in_spool()), timeout=15,
                 what="the five in the spool")
        wait_for(lambda: any("event=moved jobs=5 " in l for l in
                             list(open(t.log))[moved:]),
                 what="one move of the five (its log line)")
    finally:
        t.stop()


def test_jobs_behind_a_stalled_run_move_at_their_bound(spool, ram, tmp_path):
    """A run that takes its time in the worker's own thread (a Python
    function, an http request: inline) does not keep the jobs behind it
    in RAM past their spill_after: they move, and the running one gets its
    copy (the power cuts' stalled link found it)."""
    t = Tier(spool, ram, tmp_path, spill_after="2s")
    open(t.out + ".block", "w").close()
    t.start()
    try:
        a = t.enqueue({"n": 1})
        wait_for(lambda: t.delivered(), what="the run started")
        b, c = t.enqueue({"n": 2}), t.enqueue({"n": 3})
        wait_for(lambda: {a, b, c} <= set(t.in_spool()), timeout=10,
                 what="the two behind it moved, the running one copied")
        assert os.path.exists(t.out + ".block")     # (still running)
    finally:
        if os.path.exists(t.out + ".block"):
            os.unlink(t.out + ".block")
        t.stop()
