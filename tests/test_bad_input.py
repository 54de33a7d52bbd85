"""failed/: whatever lands in incoming/ and is not a job, the worker
quarantines it (its reason beside it) and goes on."""
import json
import os
import stat

import pytest

from _core import ls, show, worker, write_incoming
from _core import call_myq

RAW = {
    "nonjson.json": b"this is {not json",
    "array.json": b'[{"type": "t"}]',
    "string.json": b'"t"',
    "notype.json": b'{"payload": 1}',
    "typenum.json": b'{"type": 5}',
    "badid.json": b'{"id": "../x", "type": "t"}',
    "dotid.json": b'{"id": ".hidden", "type": "t"}',
    "badtype.json": b'{"type": "a b"}',
    "bad name.json": b'{"type": "t"}',
    "badutf8.json": b'{"type": "t", "payload": "\xff\xfe"}',
    "oversize.json": json.dumps({"type": "t", "payload": "x" * 300000}).encode(),
    "nested.json": b'{"type": "t", "payload": ' + b"[" * 100000 + b"]" * 100000 + b"}",
    "unclosed.json": b"[" * 100000,
}


def stem(name):
    return name[:-len(".json")]


def quarantined(spool, name):
    """(file in failed/, reason text) for an incoming name."""
    files = ls(spool, "failed")
    reasons = [f for f in files if f.endswith(".reason") and f.startswith(stem(name) + ".")]
    others = [f for f in files if not f.endswith(".reason") and f.startswith(name)]
    assert reasons, (name, files)
    assert others, (name, files)
    with open(os.path.join(spool, "failed", reasons[0])) as f:
        reason = f.read().strip()
    assert reason, name
    return os.path.join(spool, "failed", others[0]), reason


@pytest.fixture
def bad_spool(spool, tmp_path, handlers_dir):
    marker = tmp_path / "ran"
    h = handlers_dir("t", 'echo "$MYQ_JOB_ID" >> "%s"' % marker)
    for name, data in RAW.items():
        write_incoming(spool, name, None, raw=data)
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"type": "t", "payload": "outside"}))
    os.chmod(str(outside), 0o644)
    before = (outside.read_bytes(), os.stat(str(outside)).st_mtime_ns,
              os.stat(str(outside)).st_mode)
    os.symlink(str(outside), os.path.join(spool, "incoming", "x.json"))
    os.mkfifo(os.path.join(spool, "incoming", "y.json"))
    os.mkdir(os.path.join(spool, "incoming", "z.json"))
    write_incoming(spool, "good1.json", {"type": "t", "payload": 1})
    write_incoming(spool, "good2.json", {"type": "t", "payload": 2})
    return spool, h, marker, outside, before


def test_bad_files_are_quarantined_and_good_jobs_run(run_myq, bad_spool):
    spool, h, marker, outside, before = bad_spool
    cp = worker(run_myq, spool, handlers=h, timeout=30)  # a FIFO must not block
    assert cp.returncode == 0, cp.stderr
    assert sorted(marker.read_text().split()) == ["good1", "good2"]
    assert show(call_myq, spool, "good1")["state"] == "done"
    assert show(call_myq, spool, "good2")["state"] == "done"
    assert ls(spool, "incoming") == []
    assert ls(spool, "processing") == []
    for name in list(RAW) + ["x.json", "y.json", "z.json"]:
        quarantined(spool, name)


def test_quarantine_keeps_the_bytes(run_myq, bad_spool):
    spool, h, _, _, _ = bad_spool
    assert worker(run_myq, spool, handlers=h, timeout=30).returncode == 0
    for name in ("nonjson.json", "badutf8.json", "nested.json", "array.json"):
        path, _ = quarantined(spool, name)
        with open(path, "rb") as f:
            assert f.read() == RAW[name], name


def test_special_files_are_not_followed(run_myq, bad_spool):
    spool, h, _, outside, before = bad_spool
    assert worker(run_myq, spool, handlers=h, timeout=30).returncode == 0
    after = (outside.read_bytes(), os.stat(str(outside)).st_mtime_ns,
             os.stat(str(outside)).st_mode)
    assert after == before
    x, _ = quarantined(spool, "x.json")
    assert os.path.islink(x)
    y, _ = quarantined(spool, "y.json")
    assert stat.S_ISFIFO(os.lstat(y).st_mode)
    z, _ = quarantined(spool, "z.json")
    assert os.path.isdir(z)


def test_list_failed_shows_the_reason(run_myq, bad_spool):
    spool, h, _, _, _ = bad_spool
    assert worker(run_myq, spool, handlers=h, timeout=30).returncode == 0
    cp = call_myq("--spool", spool, "list", "failed")
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    for name in ("nonjson.json", "notype.json", "oversize.json", "x.json", "z.json"):
        hits = [l for l in lines if l.split()[0] in (name, stem(name))]
        assert len(hits) == 1, (name, lines)
        assert len(hits[0].split()) >= 2, hits  # the reason follows the name
    st = json.loads(call_myq("--spool", spool, "stats", "--json").stdout)
    assert st["done"] == 2


def test_oversize_limit_is_configurable(run_myq, spool, handlers_dir, tmp_path):
    h = handlers_dir("t", "exit 0")
    write_incoming(spool, "small.json", {"type": "t", "payload": "x" * 500})
    write_incoming(spool, "large.json", {"type": "t", "payload": "x" * 5000})
    cp = worker(run_myq, spool, "--max-job-bytes", "2K", handlers=h)
    assert cp.returncode == 0, cp.stderr
    assert show(call_myq, spool, "small")["state"] == "done"
    quarantined(spool, "large.json")


# An empty file holds no job (an enqueue that a power cut ended between its
# rename and its fsync, or a producer between its create and its write) ####

@pytest.mark.parametrize("data", [b"", b"\0" * 300, b"\n"])
def test_an_empty_file_waits_then_goes_never_quarantined(myq, spool, monkeypatch,
                                                          data):
    write_incoming(spool, "late.json", None, raw=data)
    write_incoming(spool, "good.json", {"type": "t", "payload": 1})
    ran = []
    log = os.path.join(spool, "..", "w.log")

    def drain():
        w = myq.Worker(spool, handlers={"t": lambda job: ran.append(job["id"])},
                       log=myq.Log(path=log))
        assert w.run(drain=True) == 0
    drain()
    assert ran == ["good"]
    assert ls(spool, "failed") == []
    assert ls(spool, "incoming") == ["late.json"]
    st = os.stat(os.path.join(spool, "incoming", "late.json"))
    assert st.st_mtime > st.st_ctime + 50      # waits a minute, on purpose
    cp = call_myq("--spool", spool, "check")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    # a minute later, still empty: removed, logged; never in failed/
    real = myq._now
    monkeypatch.setattr(myq, "_now", lambda: real() + 120)
    drain()
    assert ls(spool, "incoming") == [] and ls(spool, "failed") == []
    with open(log) as f:
        text = f.read()
    assert "event=deferred" in text and "event=removed" in text, text
    assert "empty" in text


def test_an_empty_file_made_before_this_boot_goes_at_once(myq, spool):
    """No producer can still be writing a file older than the boot: a
    batch (a RAM tier's move) that a power cut ended.  Its waiting minute
    is a change a later cut can take again, so it goes at once (the power
    cuts found such files left for good)."""
    boot = myq.boot_time()
    if not boot:
        pytest.skip("no btime in /proc/stat")
    path = write_incoming(spool, "cut.json", None, raw=b"\0" * 300)
    os.utime(path, (boot - 100, boot - 100))
    log = os.path.join(spool, "..", "w.log")
    w = myq.Worker(spool, handlers={"t": lambda job: None},
                   log=myq.Log(path=log))
    assert w.run(drain=True) == 0
    assert ls(spool, "incoming") == [] and ls(spool, "failed") == []
    with open(log) as f:
        text = f.read()
    assert "event=removed" in text and "event=deferred" not in text, text


def test_an_empty_file_written_within_the_minute_runs(myq, spool, monkeypatch):
    write_incoming(spool, "late.json", None, raw=b"")
    ran = []

    def drain():
        w = myq.Worker(spool, handlers={"t": lambda job: ran.append(job["payload"])},
                       log=myq.Log(path=os.devnull))
        assert w.run(drain=True) == 0
    drain()
    assert ran == []
    with open(os.path.join(spool, "incoming", "late.json"), "r+") as f:
        f.write(json.dumps({"type": "t", "payload": "written late"}))
    real = myq._now
    monkeypatch.setattr(myq, "_now", lambda: real() + 120)
    drain()
    assert ran == ["written late"]
    assert ls(spool, "failed") == []
