"""A producer with nothing but a shell (write to tmp/, mv into incoming/)."""
import json
import os

from _core import ls, show, worker, write_incoming
from _core import call_myq


def test_minimal_file_is_shown_before_any_worker(spool):
    write_incoming(spool, "NAME.json", {"type": "greet", "payload": {"who": "sh"}})
    job = show(call_myq, spool, "NAME")
    assert job["state"] == "ready"
    assert job["attempts"] == 0
    assert job["id"] == "NAME"
    assert job["type"] == "greet"
    assert job["payload"] == {"who": "sh"}
    cp = call_myq("--spool", spool, "list", "ready")
    assert cp.returncode == 0, cp.stderr
    assert [l.split()[0] for l in cp.stdout.splitlines()] == ["NAME"]


def test_shell_job_without_payload_gets_defaults(spool):
    write_incoming(spool, "only-type.json", {"type": "t"})
    job = show(call_myq, spool, "only-type")
    assert job["state"] == "ready"
    assert job["attempts"] == 0
    assert job.get("payload") is None


def test_worker_runs_a_shell_produced_job(run_myq, spool, handlers_dir, tmp_path):
    out = tmp_path / "out"
    handlers_dir("greet", 'cat > "%s"; echo "$MYQ_JOB_ID" >> "%s.id"' % (out, out))
    write_incoming(spool, "from-sh.json", {"type": "greet", "payload": [1, "two"]})
    cp = worker(run_myq, spool, handlers=handlers_dir.path)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(out.read_text()) == [1, "two"]
    assert (tmp_path / "out.id").read_text() == "from-sh\n"
    job = show(call_myq, spool, "from-sh")
    assert job["state"] == "done"
    assert job["attempts"] == 1
    assert ls(spool, "incoming") == []


def test_names_not_ending_in_json_are_ignored(run_myq, spool, handlers_dir, tmp_path):
    marker = tmp_path / "ran"
    handlers_dir("t", 'echo "$MYQ_JOB_ID" >> "%s"' % marker)
    ignored = ["half.json.part", "noext", "x.JSON", "y.json~", "z.tmp"]
    for name in ignored:
        with open(os.path.join(spool, "incoming", name), "w") as f:
            json.dump({"type": "t"}, f)
    write_incoming(spool, "real.json", {"type": "t"})
    cp = worker(run_myq, spool, handlers=handlers_dir.path)
    assert cp.returncode == 0, cp.stderr
    assert marker.read_text() == "real\n"
    assert ls(spool, "incoming") == sorted(ignored)
    assert ls(spool, "failed") == []
    cp = call_myq("--spool", spool, "list", "--json")
    ids = [json.loads(l)["id"] for l in cp.stdout.splitlines()]
    assert ids == ["real"]
