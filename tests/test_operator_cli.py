"""What an operator meets on the command line (issue 16, SPEC §4, §6):
durations with units, --help that says defaults and variables, list
filters, retry --now, bulk delete, failed files by either name, stats
--prometheus and the worker's --textfile, errors that say what is wrong
(permissions, no /dev/log, Python 2), --drain below --min-free."""
import json
import os
import re
import time

import pytest

from _core import call_myq, enqueue, one_line_error, run_myq, show

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
