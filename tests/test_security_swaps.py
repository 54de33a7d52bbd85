"""Attack tests, part 1: the spool's owner puts symlinks and
FIFOs in place of spool entries, and root's commands must neither follow
them nor hang on them.  The threat model, the other attacks and the shared
box (_sec.Box): test_security.py.  (A file of its own so that pytest-xdist's
--dist loadfile runs it beside the rest: together they were the longest
file of the suite.)
"""
import json
import time

import pytest

from _sec import (SECRET, Box, box, needs_root, one_error_line,  # noqa: F401
                  owner, traceback_in)                              # (fixtures)


# 1. Symlinks and FIFOs in place of spool entries ############################

JOB = {"type": "t", "payload": "owner's job"}
CLAIM = "jp+w-1-abc.1.json"


def populate(box):
    """A spool with one job in each state (files of the owner)."""
    now = time.time()

    def job(jid, **kw):
        j = dict(JOB, id=jid, attempts=0, created_at=now, updated_at=now,
                 available_at=now, last_error=None)
        j.update(kw)
        return json.dumps(j) + "\n"

    box.owner_file("incoming/ji.json", job("ji"))
    box.owner_file("processing/" + CLAIM, job("jp") + json.dumps(
        {"lease": {"worker": "w-1-abc", "pid": 999999, "start": 1,
                   "boot_id": "x", "token": "w-1-abc.1", "attempt": 1,
                   "leased_until": now - 10}}) + "\n")
    box.owner_file("locks/workers/w-1-abc.json", json.dumps(
        {"worker": "w-1-abc", "pid": 999999, "start": 1, "boot_id": "x",
         "pidns": "", "host": "elsewhere", "lease": 1}))
    box.owner_file("done/jd.json", job("jd"))
    box.owner_file("dlq/jx.json", job("jx", attempts=5, failed_at=now))
    box.owner_file("failed/jf.json", "not json")
    box.owner_file("failed/jf.json.reason", "bad JSON\n")
    box.owner_file("failed/jr.json", "not json either")
    box.owner_file("failed/jr.json.reason", "bad JSON\n")
    box.owner_file("locks/ok/ji", "")
    box.owner_file("locks/retries", "%d\n" % now)


IDS = ("ji", "jp", "jd", "jx", "jf", "jr")
DIR_IDS = {"incoming": ("ready", "scheduled"), "processing": ("processing",),
           "done": ("done",), "dlq": ("dead",), "failed": ("failed",)}
POPULATED = {"incoming": "ji", "processing": "jp", "done": "jd", "dlq": "jx",
             "failed": "jf"}


def root_commands(owner_name, dirname=None, fifo=False):
    """The commands root may run on the spool (init last: the others
    first meet what the owner left).  With `dirname` (the directory the
    owner replaced): the ones that may touch it, and job J (the victim
    directory holds J.json, J and a claim J+w-1-abc.1.json)."""
    if dirname is None:
        states = ("ready", "scheduled", "processing", "done", "dead", "failed")
        ids = IDS
    else:
        states = DIR_IDS.get(dirname, ())
        ids = ("J",) + ((POPULATED[dirname],) if dirname in POPULATED else ())
    cmds = [("stats",), ("stats", "--json"), ("list",), ("list", "--json")]
    cmds += [("list", s) for s in states]
    if "failed" in states:
        cmds += [("list", "failed", "--json")]
    cmds += [("show", i) for i in ids]
    cmds += [("check",), ("enqueue", "t", '"root was here"'),
             ("enqueue", "t", "null", "--id", "fromroot"), ("reap",)]
    cmds += [("retry", i) for i in ids if i in ("jx", "jf", "jr", "J")]
    cmds += [("delete", i) for i in ids if i in ("ji", "jd", "J")]
    cmds += [("delete", "--force", i) for i in ids if i in ("jp", "J")]
    cmds += [("prune", "--keep-done", "0", "--keep-dead", "0",
              "--keep-failed", "0"),
             ("init",), ("init", "--owner", owner_name)]
    if fifo:        # a FIFO in place of a directory: the short list
        cmds = [c for c in cmds if c[0] not in ("list", "stats") or len(c) == 1]
    return cmds


def _around(text):
    i = text.find(SECRET)
    return text[max(0, i - 150):i + len(SECRET) + 20]


def attack(box, dirname=None, fifo=False):
    """Run the root commands; return the problems seen (empty: safe)."""
    problems = []
    for cmd in root_commands(box.pw.pw_name, dirname, fifo):
        line = "myq " + " ".join(cmd)
        try:
            r = box.root(*cmd)
        except AssertionError as e:
            problems.append(str(e))
            continue
        if SECRET in r.stdout or SECRET in r.stderr:
            problems.append("%s printed a root-only secret: ...%r"
                            % (line, _around(r.stdout + r.stderr)))
        if traceback_in(r.stderr):
            problems.append("%s: traceback: %s"
                            % (line, r.stderr.strip().splitlines()[-1]))
        diffs = box.changed()
        if diffs:
            problems.append("%s changed root's files: %s"
                            % (line, "; ".join(diffs)))
            box.restore_victims()
    return problems


DIRS = ("tmp", "incoming", "processing", "done", "dlq", "failed", "locks",
        "locks/ok", "locks/workers")


def init_refuses(box, entry, what):
    r = box.root("init", "--owner", box.pw.pw_name)
    if r.returncode != 78:
        return ["init --owner over a %s in place of %s: exit %d (want 78, a "
                "clear refusal)" % (what, entry, r.returncode)]
    if not (r.stderr.startswith("myq: ") and r.stderr.count("\n") == 1):
        return ["init --owner: not one error line: %r" % r.stderr]
    return []


@needs_root
@pytest.mark.parametrize("entry", DIRS)
def test_dir_replaced_by_symlink(box, entry):
    """The owner replaces a directory of the layout by a symlink to a root
    directory (holding job-like secrets); root runs every command.  Fails
    today: init --owner chowns the victim dir, enqueue writes into it,
    show/list print its secrets, reap/prune/delete/retry rename or remove
    its files."""
    populate(box)
    box.replace(entry, "symlink", box.victim_dir)
    problems = attack(box, entry)
    problems += init_refuses(box, entry + "/", "symlink")
    assert not problems, "\n".join(problems)


@needs_root
def test_dirs_replaced_by_fifos(box):
    """Guard (passes today): a FIFO in place of each directory of the
    layout, one at a time: no root command hangs or dies with a traceback,
    init --owner refuses."""
    problems = []
    for entry in DIRS:
        b = Box(box.pw, box.python)
        try:
            populate(b)
            b.replace(entry, "fifo")
            problems += attack(b, entry, fifo=True)
            problems += init_refuses(b, entry + "/", "FIFO")
        finally:
            b.cleanup()
    assert not problems, "\n".join(problems)


FILES = {
    # spool entry: what the symlink points at
    "incoming/ji.json": "secret_json",
    "processing/" + CLAIM: "secret_json",
    "locks/workers/w-1-abc.json": "secret_json",
    "done/jd.json": "secret_json",
    "dlq/jx.json": "secret_json",
    "failed/jf.json": "secret",
    "failed/jr.json.reason": "secret",
    "locks/ok/ji": "victim",
    "locks/wake": "victim",
    "locks/retries": "victim",
}


@needs_root
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_files_replaced_by_symlinks_or_fifos(box, kind):
    """Every job file, claim, worker record, .reason, idempotency record,
    locks/wake and locks/retries replaced at once by a symlink to a root
    file or by a FIFO.  Fails today: `show jr` prints the secret through
    the symlinked .reason, enqueue writes a byte into the victim through
    locks/wake, stats hangs on a FIFO locks/retries."""
    populate(box)
    for rel, target in FILES.items():
        box.replace(rel, kind, getattr(box, target))
    problems = attack(box)
    assert not problems, "\n".join(problems)


@needs_root
def test_init_owner_refuses_a_symlinked_layout_entry(box):
    """`init --owner` through a symlink in place of locks/ok: exit 78, one
    line; the victim is not handed to the owner.  Fails today (exit 0, the
    victim directory chowned to the owner)."""
    box.replace("locks/ok", "symlink", box.victim_dir)
    r = box.root("init", "--owner", box.pw.pw_name)
    assert box.changed() == []
    one_error_line(r, (78,))
