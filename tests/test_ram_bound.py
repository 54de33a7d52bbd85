"""The RAM tier's moves against power cuts and slow workers (myq(1) RAM
FIRST; the power cuts' ubifs-ram part found each under TCG): a job moved
to the spool is never seen there before its bytes are durable.  Both
stores (the `spool` fixture)."""
import os

import pytest

from _core import cli, ok, listed


@pytest.fixture
def ram(tmp_path, small_tmpfs):
    try:
        return os.path.join(small_tmpfs("16m"), "ram")
    except pytest.skip.Exception:
        if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
            raise
        import tempfile
        return os.path.join(tempfile.mkdtemp(dir="/dev/shm"), "ram")


def _in_spool(spool, jid):
    return any(r["id"] == jid and r.get("tier") != "ram"
               for st in ("ready", "scheduled", "held")
               for r in listed(spool, st))


@pytest.mark.parametrize("way", ["unnamed", "tmp"])
@pytest.mark.parametrize("n", [1, 5])
def test_a_move_names_no_job_before_its_bytes_are_durable(
        spool, ram, tmp_path, monkeypatch, way, n):
    """A RAM job moved to the spool gets its name there only after its
    file's fsync: a power cut then leaves it whole or absent.  Named first
    (a batched enqueue's order: link, then fsync), UBIFS kept the name and
    the length of files whose bytes it had not written (the ubifs-ram
    part: 614 NUL bytes where a job was, its RAM copy gone with the same
    cut).  O_TMPFILE's way and tmp/'s, one job and a batch (explicit ids
    among them: a link, not a rename)."""
    import myq
    if way == "tmp":
        monkeypatch.setattr(myq, "_TMPFILE", 0)
    elif not getattr(myq, "_TMPFILE", 0):
        pytest.skip("O_TMPFILE is refused here")
    ok(cli(spool, "init", "--ram", ram))
    ok(cli(spool, "policy", "tele", "durable=outage"))
    store = myq.open_store(spool)
    store.ram.make()
    ids = store.ram.enqueue_many([
        dict({"type": "tele", "payload": {"n": i}}, **({"id": "x-%d" % i}
                                                       if i % 2 else {}))
        for i in range(n)], False)
    steps = []
    monkeypatch.setattr(myq, "_hook", lambda op, path, when: steps.append(
        (op, path, when)))
    store.ram.spill(final=True)
    monkeypatch.setattr(myq, "_hook", None)
    store.close()
    assert all(_in_spool(spool, jid) for jid in ids)
    synced = set()
    for op, path, when in steps:
        if not path.startswith(spool + "/") or not path.endswith(".json"):
            continue                    # (the RAM tier's own steps)
        if op == "fsync" and when == "after":
            synced.add(path)
        elif op in ("link", "rename") and when == "before" and \
                os.path.basename(path)[:-5] in ids:
            assert path in synced, "%s named before its fsync" % path
