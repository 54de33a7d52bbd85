"""What an operator meets on the command line:
durations with units, --help that says defaults and variables, list
filters, retry --now, bulk delete, failed files by either name, stats
--prometheus and the worker's --textfile, errors that say what is wrong
(permissions, no /dev/log, Python 2), --drain below --min-free."""
import json
import os
import re
import time

import pytest

from _core import (call_myq, enqueue, ls, one_line_error, run_myq, show, sql,
                   world_python)

BAD_FORMS = "500ms, 30s, 15m, 1h, 7d"


# 1. Durations with units ####################################################

@pytest.mark.parametrize("text,seconds", [
    ("0.2", 0.2), ("90", 90.0), ("30s", 30.0), ("15m", 900.0),
    ("1h", 3600.0), ("7d", 7 * 86400.0), ("500ms", 0.5), ("1.5h", 5400.0),
    (" 2m ", 120.0), ("0", 0.0), ("1e-05", 1e-05),
])
def test_parse_seconds_takes_units(myq, text, seconds):
    assert myq.parse_seconds(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["1x", "h", "1 hour", "-1s", "-5", "inf",
                                  "nan", "1h30", "", "1H"])
def test_parse_seconds_refuses_with_the_forms(myq, text):
    with pytest.raises(ValueError) as e:
        myq.parse_seconds(text)
    assert BAD_FORMS in str(e.value)


WORKER_DURATIONS = ["--lease", "--timeout", "--backoff-base", "--backoff-max",
                    "--poll", "--stats-interval", "--grace"]
GUARD_DURATIONS = ["--dedupe-window", "--keep-done", "--keep-dead",
                   "--keep-failed"]


def _resolved(myq, command, argv, table, env=None):
    args = myq._parser(command).parse_args([command] + argv)
    return myq._resolve(args, table, env or {})


@pytest.mark.parametrize("flag", WORKER_DURATIONS)
def test_worker_durations_take_units_as_flags_and_variables(myq, flag):
    dest = flag[2:].replace("-", "_")
    o = _resolved(myq, "worker", [flag, "15m"], myq.WORKER_OPTIONS)
    assert o[dest] == 900.0
    o = _resolved(myq, "worker", [], myq.WORKER_OPTIONS,
                  {"MYQ_" + dest.upper(): "1h"})
    assert o[dest] == 3600.0
    o = _resolved(myq, "worker", [flag, "0.2"], myq.WORKER_OPTIONS)
    assert o[dest] == 0.2


@pytest.mark.parametrize("flag", GUARD_DURATIONS)
def test_guard_durations_take_units(myq, flag):
    dest = flag[2:].replace("-", "_")
    for command in ("prune", "check", "worker"):
        o = _resolved(myq, command, [flag, "7d"], myq.GUARD_OPTIONS)
        assert o[dest] == 7 * 86400.0
    o = _resolved(myq, "prune", [], myq.GUARD_OPTIONS,
                  {"MYQ_" + dest.upper(): "30s"})
    assert o[dest] == 30.0


def test_prune_keep_done_with_a_unit_runs(spool):
    cp = call_myq("--spool", spool, "prune", "--keep-done", "1d",
                  "--keep-dead", "30d", "--keep-failed", "12h",
                  "--dedupe-window", "7d")
    assert cp.returncode == 0, cp.stderr
    assert "done=0" in cp.stdout


def test_worker_runs_with_durations_in_units(spool):
    cp = run_myq("--spool", spool, "worker", "--once", "--lease", "1m",
                 "--timeout", "5m", "--poll", "500ms", "--stats-interval",
                 "1h", "--grace", "2s", "--backoff-base", "1s",
                 "--backoff-max", "1h", env={"MYQ_KEEP_DONE": "1d"})
    assert cp.returncode == 0, cp.stderr


def test_enqueue_delay_and_timeout_take_units(spool):
    jid = enqueue(call_myq, spool, "t", "null", "--delay", "1h",
                  "--timeout", "15m")
    job = show(call_myq, spool, jid)
    assert job["state"] == "scheduled"
    assert job["available_at"] - job["created_at"] == pytest.approx(3600, abs=1)
    assert job["timeout"] == 900.0
    jid = enqueue(call_myq, spool, "t", "null", "--delay", "0.2")
    job = show(call_myq, spool, jid)
    assert job["available_at"] - job["created_at"] == pytest.approx(0.2, abs=0.01)


def test_supervise_stop_timeout_takes_a_unit(spool):
    cp = call_myq("--spool", spool, "supervise", "--dry-run",
                  "--stop-timeout", "1m", "--lease", "2m")
    assert cp.returncode == 0, cp.stderr


@pytest.mark.parametrize("args,name", [
    (("worker", "--lease", "1x"), "--lease"),
    (("worker", "--timeout", "5 min"), "--timeout"),
    (("worker", "--backoff-base", "soon"), "--backoff-base"),
    (("worker", "--backoff-max", "1w"), "--backoff-max"),
    (("worker", "--poll", "fast"), "--poll"),
    (("worker", "--stats-interval=-1m"), "--stats-interval"),
    (("worker", "--grace", "1hour"), "--grace"),
    (("prune", "--keep-done", "1y"), "--keep-done"),
    (("check", "--keep-dead", "forever"), "--keep-dead"),
    (("prune", "--keep-failed", "x"), "--keep-failed"),
    (("enqueue", "t", "--dedupe-window", "1week"), "--dedupe-window"),
    (("enqueue", "t", "--delay", "1x"), "--delay"),
    (("enqueue", "t", "--timeout", "soon"), "--timeout"),
    (("supervise", "--dry-run", "--stop-timeout", "1x"), "--stop-timeout"),
], ids=lambda a: " ".join(a) if isinstance(a, tuple) else a)
def test_a_bad_duration_is_64_naming_the_option_and_the_forms(spool, args, name):
    cp = call_myq("--spool", spool, *args)
    assert cp.returncode == 64, (cp.returncode, cp.stderr)
    err = one_line_error(cp)
    assert name in err and BAD_FORMS in err, err
    assert "could not convert" not in err and "invalid literal" not in err, err


def test_a_bad_duration_variable_is_64_naming_the_variable(spool):
    cp = run_myq("--spool", spool, "worker", "--once",
                 env={"MYQ_LEASE": "1 hour"})
    assert cp.returncode == 64, cp.stderr
    err = one_line_error(cp)
    assert "MYQ_LEASE" in err and BAD_FORMS in err, err


@pytest.mark.parametrize("args", [
    ("worker", "--concurrency", "two"), ("worker", "--jitter", "lots"),
    ("worker", "--scan-cache", "many"), ("prune", "--keep-done-max", "x"),
    ("check", "--min-free-inodes", "few"),
])
def test_bad_numbers_say_what_is_wanted_not_python_internals(spool, args):
    cp = call_myq("--spool", spool, *args)
    assert cp.returncode == 64, cp.stderr
    err = one_line_error(cp)
    assert args[1] in err and "invalid literal" not in err \
        and "could not convert" not in err, err


# 2. --help ##################################################################

def _subparsers(myq):
    import argparse
    top = myq._parser()
    sub = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub[0].choices)


def test_every_shown_option_has_help(myq):
    """Every option and argument --help shows says what it is for."""
    import argparse
    for name, p in _subparsers(myq).items():
        for action in p._actions:
            if action.help == argparse.SUPPRESS:
                continue
            assert action.help and action.help.strip(), \
                "%s %s has no help" % (name, action.option_strings or action.dest)


@pytest.mark.parametrize("command", ["worker", "supervise"])
def test_worker_and_guard_options_say_default_and_variable(myq, command):
    p = _subparsers(myq)[command]
    helps = {o: a.help for a in p._actions for o in a.option_strings}
    for flag, typ, default, _ in myq.WORKER_OPTIONS + myq.GUARD_OPTIONS:
        var = "MYQ_" + flag[2:].replace("-", "_").upper()
        assert var in helps[flag], (flag, helps[flag])
        if typ not in (None, "append", str) or default not in (None, False, []):
            assert "default " in helps[flag], (flag, helps[flag])


def test_help_shows_durations_and_sizes_with_units(myq):
    p = _subparsers(myq)["worker"]
    helps = {o: a.help for a in p._actions for o in a.option_strings}
    assert helps["--lease"] == \
        "claim lease, renewed by heartbeats (default 60s; MYQ_LEASE)"
    assert "default 1h;" in helps["--backoff-max"]
    assert "default 7d;" in helps["--dedupe-window"]
    assert "default 30d;" in helps["--keep-dead"]
    assert "default 1M;" in helps["--min-free"]
    assert "default 256K;" in helps["--max-job-bytes"]


def _help(command):
    cp = call_myq(command, "--help")
    assert cp.returncode == 0, cp.stderr
    return set(re.findall(r"(--[a-z][a-z-]*)", cp.stdout))


def test_each_command_shows_only_the_guards_it_concerns():
    guards = {"--min-free", "--min-free-inodes", "--max-job-bytes",
              "--dedupe-window"}
    retention = {"--keep-done", "--keep-done-max", "--keep-dead",
                 "--keep-dead-max", "--keep-failed"}
    shown = _help("enqueue")
    assert guards <= shown and not retention & shown, shown
    assert {"--id", "--delay", "--max-attempts", "--timeout"} <= shown
    shown = _help("prune")
    assert retention | {"--dedupe-window"} <= shown
    assert not {"--min-free", "--min-free-inodes", "--max-job-bytes"} & shown
    shown = _help("check")
    assert retention | {"--min-free", "--min-free-inodes"} <= shown
    for command in ("worker", "supervise"):
        assert guards | retention <= _help(command)


def test_hidden_guards_are_still_accepted(spool):
    cp = call_myq("--spool", spool, "enqueue", "t", "--keep-done", "1d",
                  "--keep-dead-max", "5")
    assert cp.returncode == 0, cp.stderr
    cp = call_myq("--spool", spool, "prune", "--min-free", "1K",
                  "--max-job-bytes", "1M")
    assert cp.returncode == 0, cp.stderr


@pytest.mark.parametrize("command,flags", [
    ("stats", ["--json"]), ("list", ["--json"]), ("retry", ["--all"]),
    ("delete", ["--force"]), ("supervise", ["--workers", "--stop-timeout"]),
    ("enqueue", ["--id", "--delay", "--max-attempts", "--timeout"]),
])
def test_command_options_have_help(command, flags):
    cp = call_myq(command, "--help")
    for flag in flags:
        line = re.search(r"^\s+%s\b.*$" % re.escape(flag), cp.stdout, re.M)
        assert line, (flag, cp.stdout)
        # the help is on the option's line or the next one
        rest = cp.stdout[line.end():].split("\n")[1] if line else ""
        words = re.sub(r"^\s*%s(\s+[A-Z.]+)?" % re.escape(flag), "",
                       line.group(0)).strip() or rest.strip()
        assert words and not words.startswith("--"), (flag, cp.stdout)


# 3. list filters, retry --now, delete in bulk ###############################

def _ids(cp):
    assert cp.returncode == 0, cp.stderr
    return [line.split()[0] for line in cp.stdout.splitlines()]


def test_list_filters_by_type_and_limits(spool):
    for i in range(3):
        enqueue(call_myq, spool, "a", str(i), "--id", "a%d" % i)
        enqueue(call_myq, spool, "b", str(i), "--id", "b%d" % i)
    enqueue(call_myq, spool, "a", "null", "--id", "later", "--delay", "1h")
    assert sorted(_ids(call_myq("--spool", spool, "list", "--type", "a"))) == \
        ["a0", "a1", "a2", "later"]
    assert _ids(call_myq("--spool", spool, "list", "ready", "--type", "a")) \
        == ["a0", "a1", "a2"]
    assert _ids(call_myq("--spool", spool, "list", "scheduled", "--type", "b")) \
        == []
    assert len(_ids(call_myq("--spool", spool, "list", "--limit", "2"))) == 2
    assert _ids(call_myq("--spool", spool, "list", "--type", "b",
                         "--limit", "2")) == ["b0", "b1"]
    cp = call_myq("--spool", spool, "list", "--type", "a", "--limit", "1",
                  "--json")
    rows = [json.loads(line) for line in cp.stdout.splitlines()]
    assert [(r["id"], r["type"]) for r in rows] == [("a0", "a")]


@pytest.mark.parametrize("limit", ["0", "-1", "x"])
def test_list_bad_limit_is_64(spool, limit):
    cp = call_myq("--spool", spool, "list", "--limit=" + limit)
    assert cp.returncode == 64, cp.stderr
    assert "--limit" in one_line_error(cp)


def test_retry_now_makes_a_scheduled_job_ready(spool, handlers_dir, tmp_path):
    jid = enqueue(call_myq, spool, "t", '{"n": 1}', "--id", "s1",
                  "--delay", "1h")
    before = show(call_myq, spool, jid)
    assert before["state"] == "scheduled"
    cp = call_myq("--spool", spool, "retry", "s1")
    assert cp.returncode == 66, cp.stderr
    assert "--now" in one_line_error(cp)
    cp = call_myq("--spool", spool, "retry", "--now", "s1")
    assert (cp.returncode, cp.stdout) == (0, "retried=1\n"), cp.stderr
    after = show(call_myq, spool, jid)
    assert after["state"] == "ready"
    assert after["available_at"] <= time.time()
    assert {k: after[k] for k in ("payload", "created_at", "attempts")} == \
        {k: before[k] for k in ("payload", "created_at", "attempts")}
    assert ls(spool, "incoming") == ["s1.json"]
    assert ls(spool, "processing") == []
    out = tmp_path / "ran"
    d = handlers_dir("t", 'cat >> "%s"' % out)
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", d)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(out.read_text()) == {"n": 1}


def test_retry_now_keeps_attempts_and_error_of_a_backed_off_job(spool,
                                                               handlers_dir):
    d = handlers_dir("t", 'echo "boom" >&2; exit 1')
    jid = enqueue(call_myq, spool, "t", "null", "--max-attempts", "3")
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", d,
                 "--backoff-base", "1h", "--jitter", "0", "--poll", "0.05")
    assert cp.returncode == 0, cp.stderr
    job = show(call_myq, spool, jid)
    assert (job["state"], job["attempts"]) == ("scheduled", 1)
    cp = call_myq("--spool", spool, "retry", "--now", jid)
    assert cp.returncode == 0, cp.stderr
    job = show(call_myq, spool, jid)
    assert (job["state"], job["attempts"]) == ("ready", 1)
    assert "boom" in job["last_error"]
    d = handlers_dir("t", "exit 0")
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", d,
                 "--poll", "0.05")
    assert cp.returncode == 0, cp.stderr
    assert show(call_myq, spool, jid)["state"] == "done"


def test_retry_now_of_a_ready_or_unknown_job(spool):
    enqueue(call_myq, spool, "t", "null", "--id", "r1")
    cp = call_myq("--spool", spool, "retry", "--now", "r1")
    assert (cp.returncode, cp.stdout) == (0, "retried=1\n"), cp.stderr
    assert show(call_myq, spool, "r1")["state"] == "ready"
    cp = call_myq("--spool", spool, "retry", "--now", "nope")
    assert cp.returncode == 66
    one_line_error(cp)


def _old_job(spool, jid, type_, age):
    """A job a shell producer wrote `age` seconds ago (created_at says so)."""
    from _core import write_incoming
    t = time.time() - age
    write_incoming(spool, jid + ".json", {
        "id": jid, "type": type_, "payload": None, "created_at": t,
        "updated_at": t, "available_at": t})


def test_delete_in_bulk_by_state_type_and_age(spool):
    _old_job(spool, "old-a", "a", 2 * 86400)
    _old_job(spool, "old-b", "b", 2 * 86400)
    enqueue(call_myq, spool, "a", "null", "--id", "new-a")
    enqueue(call_myq, spool, "a", "null", "--id", "later-a", "--delay", "1h")
    cp = call_myq("--spool", spool, "delete", "--state", "ready", "--type",
                  "a", "--older-than", "1d")
    assert (cp.returncode, cp.stdout) == (0, "deleted=1\n"), cp.stderr
    assert sorted(_ids(call_myq("--spool", spool, "list"))) == \
        ["later-a", "new-a", "old-b"]
    cp = call_myq("--spool", spool, "delete", "--state", "ready", "--json")
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout) == {"deleted": 2}
    assert _ids(call_myq("--spool", spool, "list")) == ["later-a"]
    cp = call_myq("--spool", spool, "delete", "--state", "scheduled",
                  "--type", "b")
    assert cp.stdout == "deleted=0\n"
    cp = call_myq("--spool", spool, "delete", "--state", "scheduled")
    assert cp.stdout == "deleted=1\n"
    assert [n for n in os.listdir(os.path.join(spool, "incoming"))
            if n != "lanes"] == []


def test_delete_in_bulk_done_dead_and_failed(spool, handlers_dir):
    from _core import write_incoming
    d = handlers_dir("ok", "exit 0")
    handlers_dir("no", "exit 65")
    for i in range(3):
        enqueue(call_myq, spool, "ok", "null", "--id", "ok%d" % i)
    enqueue(call_myq, spool, "no", "null", "--id", "no1")
    write_incoming(spool, "bad1.json", None, raw=b"{not json")
    cp = run_myq("--spool", spool, "worker", "--drain", "--handlers", d,
                 "--poll", "0.05")
    assert cp.returncode == 0, cp.stderr
    assert len(_ids(call_myq("--spool", spool, "list", "done"))) == 3
    cp = call_myq("--spool", spool, "delete", "--state", "done",
                  "--older-than", "1h")
    assert cp.stdout == "deleted=0\n", cp.stderr        # finished just now
    cp = call_myq("--spool", spool, "delete", "--state", "done")
    assert cp.stdout == "deleted=3\n", cp.stderr
    cp = call_myq("--spool", spool, "delete", "--state", "dead", "--type", "ok")
    assert cp.stdout == "deleted=0\n", cp.stderr
    cp = call_myq("--spool", spool, "delete", "--state", "dead", "--type", "no")
    assert cp.stdout == "deleted=1\n", cp.stderr
    cp = call_myq("--spool", spool, "delete", "--state", "failed",
                  "--older-than", "1d")
    assert cp.stdout == "deleted=0\n", cp.stderr
    cp = call_myq("--spool", spool, "delete", "--state", "failed")
    assert cp.stdout == "deleted=1\n", cp.stderr
    assert os.listdir(os.path.join(spool, "failed")) == []
    assert _ids(call_myq("--spool", spool, "list")) == []


def test_delete_in_bulk_never_takes_running_jobs_without_force(spool,
                                                              handlers_dir,
                                                              tmp_path):
    from _core import blocking_handler, start_worker, stop, wait_for
    body, started, release = blocking_handler(tmp_path)
    d = handlers_dir("slow", body)
    enqueue(call_myq, spool, "slow", "null", "--id", "run1")
    w = start_worker(spool, "--handlers", d, "--poll", "0.05")
    try:
        wait_for(lambda: (started / "run1").exists(),
                 what="the handler to start")
        cp = call_myq("--spool", spool, "delete", "--state", "processing")
        assert cp.returncode == 75, cp.stderr
        assert "--force" in one_line_error(cp)
        assert show(call_myq, spool, "run1")["state"] == "processing"
        cp = call_myq("--spool", spool, "delete", "--state", "processing",
                      "--force")
        assert cp.stdout == "deleted=1\n", cp.stderr
        cp = call_myq("--spool", spool, "show", "run1")
        assert cp.returncode == 66
    finally:
        release.write_text("")
        stop(w)


@pytest.mark.parametrize("args", [
    ("delete",), ("delete", "x", "--state", "done"),
    ("delete", "--type", "a"), ("delete", "x", "--older-than", "1d"),
    ("delete", "--state", "bogus"), ("delete", "--state", "done",
                                     "--older-than", "soon"),
], ids=" ".join)
def test_delete_usage_errors(spool, args):
    cp = call_myq("--spool", spool, *args)
    assert cp.returncode == 64, cp.stderr
    one_line_error(cp)


# 4. A failed file by the name list shows, or by its file name ################

def _quarantined(spool, names):
    """Files that are not jobs, moved into failed/ by a worker."""
    from _core import write_incoming
    for name in names:
        write_incoming(spool, name, None, raw=b"{not json")
    cp = run_myq("--spool", spool, "worker", "--drain", "--poll", "0.05")
    assert cp.returncode == 0, cp.stderr
    cp = call_myq("--spool", spool, "list", "failed", "--json")
    return sorted(json.loads(line)["id"] for line in cp.stdout.splitlines())


NAMES = [("bad1", "bad1.json"), ("bad 2", "bad 2.json"),
         (".hidden", ".hidden.json")]


@pytest.mark.parametrize("listed,file", NAMES)
@pytest.mark.parametrize("use", ["listed", "file"])
@pytest.mark.parametrize("command", ["show", "retry", "delete"])
def test_failed_files_answer_to_both_names(spool, command, use, listed, file):
    assert _quarantined(spool, [file]) == [listed]
    ref = listed if use == "listed" else file
    cp = call_myq("--spool", spool, command, ref)
    assert cp.returncode == 0, (ref, cp.stderr)
    if command == "show":
        job = json.loads(cp.stdout)
        assert (job["state"], job["id"]) == ("failed", listed)
        assert job["content"] == "{not json"
    elif command == "retry":
        assert [n for n in os.listdir(os.path.join(spool, "incoming"))
                if n != "lanes"] == [file]
    if command != "show":
        assert os.listdir(os.path.join(spool, "failed")) == []


def test_a_second_quarantined_file_of_the_same_name(spool):
    """Two files named bad1.json quarantined: the second gets a suffix;
    each answers to the name list shows."""
    assert _quarantined(spool, ["bad1.json"]) == ["bad1"]
    ids = _quarantined(spool, ["bad1.json"])
    assert len(ids) == 2 and "bad1" in ids
    other = [i for i in ids if i != "bad1"][0]
    for ref in (other, other + ".json"):
        cp = call_myq("--spool", spool, "show", ref)
        assert cp.returncode == 0, cp.stderr
    cp = call_myq("--spool", spool, "delete", other, "bad1.json")
    assert cp.stdout == "deleted=2\n", cp.stderr
    assert os.listdir(os.path.join(spool, "failed")) == []


# 5. stats --prometheus, worker --textfile ###################################

PROM_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
PROM_SAMPLE = re.compile(r'^(%s)\{((?:[a-zA-Z_]\w*="(?:[^"\\\n]|\\.)*",?)*)\} '
                         r'(\S+)$' % PROM_NAME)


def parse_prometheus(text):
    """The text exposition format, strictly enough for node_exporter:
    {name: (type, help, {frozenset(labels): value})}."""
    metrics = {}
    helps, types = {}, {}
    assert text.endswith("\n") and "\n\n" not in text
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help = line[7:].partition(" ")
            assert re.match(PROM_NAME + r"\Z", name) and help, line
            assert name not in helps, "HELP twice: " + line
            helps[name] = help
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in ("gauge", "counter"), line
            assert name in helps and name not in types, line
            types[name] = kind
        else:
            m = PROM_SAMPLE.match(line)
            assert m, "not a sample: %r" % line
            name, labels, value = m.groups()
            assert name in types, "sample before its TYPE: " + line
            if types[name] == "counter":
                assert name.endswith("_total"), name
            labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
            samples = metrics.setdefault(name, (types[name], helps[name], {}))[2]
            assert labels not in samples, "sample twice: " + line
            samples[labels] = float(value)
    return metrics


def _age(spool, jid, seconds):
    """Ready job `jid` `seconds` earlier in the order workers take jobs in:
    its file's mtime; on an SQLite spool, its row's available_at."""
    n = sql(spool, "UPDATE jobs SET available_at=available_at-? WHERE id=? "
            "AND status='ready'", (seconds, jid))
    if n is None:
        t = time.time() - seconds
        os.utime(os.path.join(spool, "incoming", jid + ".json"), (t, t))
    else:
        assert n == 1, jid


def test_stats_prometheus_has_the_figures_of_stats_json(spool, handlers_dir):
    d = handlers_dir("no", "exit 65")
    enqueue(call_myq, spool, "no", "null", "--id", "dead1")    # --once: this one
    # ...the earliest: enqueues a clock tick apart can share an mtime
    # (coarse on tmpfs) or an available_at, and then the name decides.
    _age(spool, "dead1", 60)
    for i in range(3):
        enqueue(call_myq, spool, "t", "null")
    enqueue(call_myq, spool, "t", "null", "--delay", "1h")
    cp = run_myq("--spool", spool, "worker", "--once", "--handlers", d)
    assert cp.returncode == 0, cp.stderr
    want = json.loads(call_myq("--spool", spool, "stats", "--json").stdout)
    cp = call_myq("--spool", spool, "stats", "--prometheus")
    assert cp.returncode == 0, cp.stderr
    m = parse_prometheus(cp.stdout)
    q = ("queue", want["queue"])
    kind, _, jobs = m["myq_jobs"]
    assert kind == "gauge"
    assert {dict(k)["state"]: v for k, v in jobs.items()} == {
        s: want[s] for s in ("ready", "scheduled", "processing", "done",
                             "dead", "failed")}
    assert all(q in k for k in jobs)
    assert jobs[frozenset([q, ("state", "dead")])] == 1
    oldest = m["myq_oldest_ready_seconds"][2][frozenset([q])]
    assert want["oldest_ready_s"] <= oldest <= want["oldest_ready_s"] + 2
    assert m["myq_retries_1m"][2] == {frozenset([q]): want["retries_1m"]}
    assert m["myq_free_bytes"][0] == "gauge"
    assert m["myq_free_bytes"][2][frozenset([q])] > 0


def test_prometheus_labels_are_escaped(myq):
    text = myq.prometheus_text({
        "queue": 'a"b\\c\nd', "ready": 1, "dropped": {"t": 3},
        "paused": ["p1"], "held": [{"dest": "host:80", "until": 12.5}]})
    m = parse_prometheus(text)
    q = ("queue", 'a\\"b\\\\c\\nd')
    assert m["myq_jobs"][2][frozenset([q, ("state", "ready")])] == 1
    assert m["myq_dropped_total"][0] == "counter"
    assert m["myq_dropped_total"][2] == {frozenset([q, ("type", "t")]): 3}
    assert m["myq_paused"][2] == {frozenset([q, ("type", "p1")]): 1}
    assert m["myq_held"][2] == {frozenset([q, ("destination", "host:80")]): 12.5}


def test_stats_json_and_prometheus_together_is_64(spool):
    cp = call_myq("--spool", spool, "stats", "--json", "--prometheus")
    assert cp.returncode == 64
    one_line_error(cp)


def test_worker_textfile_is_written_by_rename_every_interval(spool, tmp_path):
    from _core import start_worker, stop, wait_for
    out = tmp_path / "textfile"
    out.mkdir()
    name = "myq_%s.prom" % os.path.basename(spool)
    enqueue(call_myq, spool, "t", "null", "--delay", "1h")
    w = start_worker(spool, "--poll", "0.05", "--stats-interval", "200ms",
                     env={"MYQ_TEXTFILE": str(out)})
    try:
        path = out / name
        wait_for(path.exists, what="the textfile")
        first = path.stat().st_ino
        m = parse_prometheus(path.read_text())
        q = ("queue", os.path.basename(spool))
        assert m["myq_jobs"][2][frozenset([q, ("state", "scheduled")])] == 1
        assert oct(path.stat().st_mode & 0o777) == oct(0o644)
        enqueue(call_myq, spool, "t", "null", "--delay", "1h")
        # a new file each time (renamed over), with the new figures
        wait_for(lambda: path.stat().st_ino != first and parse_prometheus(
            path.read_text())["myq_jobs"][2][
                frozenset([q, ("state", "scheduled")])] == 2,
            what="the next textfile")
        assert sorted(os.listdir(str(out))) == [name]     # no temporary left
    finally:
        assert stop(w) == 0


def test_worker_textfile_must_be_a_directory(spool, tmp_path):
    cp = run_myq("--spool", spool, "worker", "--once", "--textfile",
                 str(tmp_path / "nope"))
    assert cp.returncode == 78
    assert "--textfile" in one_line_error(cp)
    cp = call_myq("--spool", spool, "supervise", "--dry-run", "--textfile",
                  str(tmp_path / "nope"))
    assert cp.returncode == 78


# 6. Errors a user meets #####################################################



@pytest.fixture
def stranger(tmp_path):
    """run(*args): myq as user nobody, from a copy of myq.py it may read,
    on a spool under a directory it may enter (not the spool itself)."""
    import pwd
    import shutil
    import subprocess
    import tempfile
    from _core import MYQ, clean_env
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root, to run myq as another user")
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    python = world_python()
    if python is None:
        pytest.skip("no python3 that another user may run")
    base = tempfile.mkdtemp(prefix="myq-perm-")
    os.chmod(base, 0o755)
    shutil.copy(MYQ, os.path.join(base, "myq.py"))
    os.chmod(os.path.join(base, "myq.py"), 0o644)

    def drop():
        os.setgid(pw.pw_gid)
        os.setgroups([])
        os.setuid(pw.pw_uid)

    def run(*args):
        return subprocess.run(
            [python, os.path.join(base, "myq.py")] + [str(a) for a in args],
            preexec_fn=drop, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            universal_newlines=True, env=clean_env(), timeout=60)
    run.base = base
    yield run
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("args", [("stats",), ("stats", "--json"), ("list",),
                                  ("enqueue", "t"), ("show", "x")],
                         ids=" ".join)
def test_a_user_without_access_is_told_so(stranger, args):
    spool = os.path.join(stranger.base, "spool")
    assert call_myq("--spool", spool, "init").returncode == 0     # 0750 root
    cp = stranger("--spool", spool, *args)
    assert cp.returncode == 78, (cp.returncode, cp.stdout, cp.stderr)
    err = one_line_error(cp)
    assert "permission denied" in err and "uid" in err, err
    assert "not initialised" not in err and "does not exist" not in err, err
    assert [n for n in os.listdir(os.path.join(spool, "incoming"))
            if n != "lanes"] == []


@pytest.mark.parametrize("args", [("stats",), ("list",), ("enqueue", "t")],
                         ids=" ".join)
def test_a_user_who_may_enter_but_not_read_or_write_is_told_so(stranger, args):
    spool = os.path.join(stranger.base, "spool")
    assert call_myq("--spool", spool, "init").returncode == 0
    os.chmod(spool, 0o755)              # the sub-directories stay 0750
    cp = stranger("--spool", spool, *args)
    assert cp.returncode == 78, (cp.returncode, cp.stdout, cp.stderr)
    err = one_line_error(cp)
    assert "permission denied" in err, err
    assert "try again" not in err, err


def test_a_spool_below_a_file_is_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    cp = call_myq("--spool", str(f / "spool"), "stats")
    assert cp.returncode == 78
    err = one_line_error(cp)
    assert "not a directory" in err, err


def test_a_missing_spool_still_says_init(tmp_path):
    cp = call_myq("--spool", str(tmp_path / "nope"), "stats")
    assert cp.returncode == 78
    assert "myq --spool %s init" % (tmp_path / "nope") in one_line_error(cp)


def test_syslog_without_dev_log_warns_once(myq, monkeypatch, tmp_path):
    import io
    monkeypatch.setattr(myq, "_DEV_LOG", str(tmp_path / "no-dev-log"))
    err = io.StringIO()
    myq.Log(syslog=True, stream=err)
    assert err.getvalue() == (
        "myq: warning: logs go nowhere: there is no %s, so every syslog line "
        "is dropped; start syslogd (BusyBox: syslogd; OpenWrt: logd), or log "
        "to a file (MYQ_LOG=/var/log/myq/myq.log, or --log FILE) and restart\n"
        % (tmp_path / "no-dev-log"))
    import socket       # a syslogd's socket: nothing to say
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "dev-log"))
    try:
        monkeypatch.setattr(myq, "_DEV_LOG", str(tmp_path / "dev-log"))
        err = io.StringIO()
        myq.Log(syslog=True, stream=err)
        assert err.getvalue() == ""
    finally:
        s.close()


@pytest.mark.skipif(os.path.exists("/dev/log"), reason="this machine has /dev/log")
def test_worker_syslog_without_dev_log_warns_on_stderr(spool):
    cp = run_myq("--spool", spool, "worker", "--once", "--syslog")
    assert cp.returncode == 0, cp.stderr
    assert cp.stderr.startswith("myq: warning: logs go nowhere: there is no "
                                "/dev/log, so every syslog line is dropped; ")
    assert cp.stderr.count("\n") == 1


def _old_pythons():
    import glob
    from _pythons import pyenv_root
    root = pyenv_root()
    found = sorted(glob.glob(os.path.join(root, "versions", "2.*", "bin", "python"))
                   + glob.glob(os.path.join(root, "versions", "3.[0-6].*",
                                            "bin", "python3"))) if root else []
    for p in ("/usr/bin/python2", "/usr/bin/python2.7"):  # never pyenv's shims
        if os.path.exists(p) and not found:
            found.append(p)
    return found or [None]


@pytest.mark.parametrize("python", _old_pythons(), ids=lambda p: re.sub(
    r".*/versions/([^/]+)/.*", r"\1", p) if p else "none")
def test_an_old_python_is_told_to_use_python3(spool, python):
    """`python2 myq.py`: one line and exit 78, not a SyntaxError: the whole
    file must stay parseable by Python 2.7 up to its version check."""
    if python is None:
        pytest.skip("no Python 2 or 3.0-3.6 on this machine")
    import subprocess
    from _core import MYQ, clean_env
    cp = subprocess.run([python, MYQ, "--spool", spool, "stats"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        universal_newlines=True, env=clean_env(), timeout=60)
    assert cp.returncode == 78, cp.stderr
    assert cp.stdout == ""
    err = one_line_error(cp)
    assert err.startswith("myq needs Python 3.7 or later"), err
    cp = subprocess.run([python, "-c", "import myq"], cwd=os.path.dirname(MYQ),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        universal_newlines=True, env=clean_env(), timeout=60)
    assert cp.returncode != 0
    assert "ImportError: myq needs Python 3.7 or later" in cp.stderr


# 7. Below --min-free: --drain exits, init warns ##############################

HUGE = "100000G"        # more than any test machine has free


def test_drain_below_min_free_delivers_the_backlog(spool, handlers_dir):
    """Below a guard the worker keeps delivering (the backlog that
    filled the flash is how it gets its room back): --drain runs the ready
    jobs and exits 0, with one disk_low line; enqueue is refused."""
    handlers_dir("t", "exit 0")
    ids = [enqueue(call_myq, spool, "t", "null") for _ in range(3)]
    cp = run_myq("--spool", spool, "worker", "--drain", "--poll", "0.05",
                 "--handlers", handlers_dir.path, "--min-free", HUGE, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert cp.stderr.count("event=disk_low") == 1, cp.stderr
    assert [show(call_myq, spool, j)["state"] for j in ids] == ["done"] * 3
    cp = call_myq("--spool", spool, "enqueue", "t", "null", "--min-free", HUGE)
    assert cp.returncode == 75 and "--min-free" in cp.stderr, cp.stderr
    jid = enqueue(call_myq, spool, "t", "null")
    cp = run_myq("--spool", spool, "worker", "--drain", "--poll", "0.05",
                 "--handlers", handlers_dir.path,
                 env={"MYQ_MIN_FREE_INODES": str(2 ** 62)}, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert "--min-free-inodes" in cp.stderr, cp.stderr
    assert show(call_myq, spool, jid)["state"] == "done"


def test_drain_below_min_free_with_nothing_ready_exits_0(spool):
    enqueue(call_myq, spool, "t", "null", "--delay", "1h")
    cp = run_myq("--spool", spool, "worker", "--drain", "--poll", "0.05",
                 "--min-free", HUGE, timeout=30)
    assert cp.returncode == 0, cp.stderr


def test_init_below_min_free_warns_and_succeeds(tmp_path):
    spool = str(tmp_path / "spool")
    cp = call_myq("--spool", spool, "init", "--min-free", HUGE)
    assert cp.returncode == 0, cp.stderr
    assert cp.stderr.startswith("myq: warning: only ") and \
        "--min-free" in cp.stderr, cp.stderr
    assert cp.stderr.count("\n") == 1
    assert os.path.isdir(os.path.join(spool, "incoming"))
    cp = run_myq("--spool", spool, "init", env={"MYQ_MIN_FREE": HUGE})
    assert cp.returncode == 0 and "warning" in cp.stderr, cp.stderr
    cp = call_myq("--spool", spool, "init")
    assert (cp.returncode, cp.stderr) == (0, "")


def test_init_help_shows_the_free_space_guards_only():
    shown = _help("init")
    assert {"--min-free", "--min-free-inodes", "--owner"} <= shown
    assert not {"--keep-done", "--max-job-bytes", "--dedupe-window"} & shown


def test_check_tells_a_user_without_access_so(stranger):
    """check, too, says "permission denied" (exit 1, one line), not seven
    "missing; run init" lines."""
    spool = os.path.join(stranger.base, "spool")
    assert call_myq("--spool", spool, "init").returncode == 0     # 0750 root
    cp = stranger("--spool", spool, "check")
    assert cp.returncode == 1, (cp.returncode, cp.stdout, cp.stderr)
    lines = cp.stdout.splitlines()
    assert len(lines) == 1 and "permission denied" in lines[0], lines
    assert "missing" not in cp.stdout
