#!/usr/bin/env python3
"""Reorder myq.py's sections: Part I (the core), then Part II (the
extensions), then the script's start; deterministic and idempotent.

    python3 reorder.py [--check] [--part2 TITLE ...] MYQ_PY [OUT]

A section is what follows a banner `# TITLE #####...` up to the next one;
the lines above the first banner (docstring, imports, constants) stay
first.  Part II is the sections named in PART_II (and --part2), in that
order; START is the last section, wherever it stood; every other section
is Part I, in the order it has in the input (so a section added since,
such as the RAM tier, stays where its author put it, among the core).
Before the first section of each part goes its banner (BANNER_I,
BANNER_II: comment lines of `=`, which are no section banner); the
module docstring's map is reordered the same way, with a line naming
each part.

What it checks, else it writes nothing and exits 1:
- the multiset of the file's lines is unchanged, apart from the part
  banners and the map (each map entry is moved whole: the map's multiset
  apart from the parts' lines is unchanged too);
- every Part II title named was found (--allow-missing: warn only);
- the result parses (ast), and no section uses a name that a later
  section defines (the rule tests/test_structure.py holds), and no Part I
  section names a Part II symbol: each is reported (as the test words it);
- run twice, it changes nothing (it is run again on its own output).

OUT defaults to MYQ_PY (rewritten in place).  --check: only say whether
MYQ_PY is already in order (exit 0) or not (exit 1).
"""

import argparse
import ast
import collections
import re
import sys

HEADER = re.compile(r"^# (.+?) #{5,}$")

# The extensions, in their order (titles of their section banners); the
# list of tests/test_structure.py beside MYQ_PY (PART_II there) when it
# has one, else this one.
PART_II = [
    "The SQLite store: its database",
    "The SQLite store: its drop box and claims",
    "The SQLite store",
    "HTTP forwarding",
    "MQTT",
    "Intake: HTTP",
    "Intake: MQTT",
    "Install",
    "The process image",
]
START = "Run as a script"

RULE = "# " + "=" * 77
BANNER_I = [
    RULE,
    "# PART I: THE CORE",
    "#",
    "# What runs every job, and what an auditor reads first: the platform,",
    "# errors, values, the door to the disk, processes, the job model, the",
    "# store contract and the store of files, policy, the breaker, logging,",
    "# exec and Python handlers, the scheduler and the worker, supervision,",
    "# the core commands.  No section of Part I names anything of Part II;",
    "# each extension registers itself in one of Part I's tables (stores:",
    "# _STORES; built-in types: _BUILTIN_TYPES; commands: _COMMAND_TABLE,",
    "# _COMMAND_OPTIONS; a supervisor's children: _CHILDREN; the process",
    "# image: _IMAGE).",
    RULE,
    "",
]
BANNER_II = [
    RULE,
    "# PART II: THE EXTENSIONS",
    "#",
    "# Each uses Part I and registers itself in its tables; remove one (and",
    "# its registration) and the core still runs.",
    RULE,
    "",
]
MAP_I = "Part I, the core:"
MAP_II = "Part II, the extensions:"
MAP_START = "The start:"
MAP_PART_LINES = (MAP_I, MAP_II, MAP_START)


def split_sections(lines):
    """(preamble lines, [(title, lines)]), the part banners taken out."""
    banners = set(BANNER_I[:-1] + BANNER_II[:-1])
    heads = [i for i, l in enumerate(lines) if HEADER.match(l)]
    if not heads:
        raise SystemExit("reorder: no section banner in the file")
    pre = lines[:heads[0]]
    secs = []
    for k, i in enumerate(heads):
        j = heads[k + 1] if k + 1 < len(heads) else len(lines)
        secs.append((HEADER.match(lines[i]).group(1), lines[i:j]))
    # the part banners (and the blank line that follows each) out
    out = []
    for title, body in [("", pre)] + secs:
        keep, i = [], 0
        while i < len(body):
            if body[i] == RULE and i + 1 < len(body) and \
                    body[i + 1] in ("# PART I: THE CORE", "# PART II: THE EXTENSIONS"):
                j = i + 2
                while j < len(body) and body[j] != RULE:
                    j += 1
                i = j + 1
                if i < len(body) and body[i] == "":
                    i += 1
                continue
            keep.append(body[i])
            i += 1
        out.append((title, keep))
    del banners
    return out[0][1], out[1:]


def split_map(pre):
    """(before, [(title, entry lines)], after) of the docstring's map: an
    entry is a line `  TITLE  what...` and the lines indented under it."""
    try:
        start = next(i for i, l in enumerate(pre) if l.startswith("The map:"))
    except StopIteration:
        raise SystemExit("reorder: no 'The map:' in the module docstring")
    i = start + 1
    while i < len(pre) and not re.match(r"^  \S", pre[i]) \
            and pre[i].strip() not in MAP_PART_LINES:
        i += 1
    before = pre[:i]
    entries = []
    while i < len(pre):
        line = pre[i]
        m = re.match(r"^  (\S.*?)  +\S.*$", line)
        if m:
            entries.append((m.group(1), [line]))
        elif line.strip() in MAP_PART_LINES or line == "":
            if line == "" and entries:
                # a blank line ends the map, unless a part's line follows
                nxt = pre[i + 1] if i + 1 < len(pre) else ""
                if nxt.strip() not in MAP_PART_LINES and not re.match(r"^  \S", nxt):
                    break
        elif line.startswith("   ") and entries:
            entries[-1][1].append(line)
        else:
            break
        i += 1
    return before, entries, pre[i:]


def order(secs, part2):
    titles = [t for t, _ in secs]
    dup = [t for t, n in collections.Counter(titles).items() if n > 1]
    if dup:
        raise SystemExit("reorder: two sections named %s" % ", ".join(dup))
    p1 = [t for t in titles if t not in part2 and t != START]
    p2 = [t for t in part2 if t in titles]
    end = [START] if START in titles else []
    return p1, p2, end


def reorder(text, part2, allow_missing=False):
    lines = text.split("\n")
    pre, secs = split_sections(lines)
    body = dict(secs)
    p1, p2, end = order(secs, part2)
    missing = [t for t in part2 if t not in body]
    if missing and not allow_missing:
        raise SystemExit("reorder: no section titled %s (--allow-missing to go on)"
                         % "; ".join(repr(t) for t in missing))
    for t in missing:
        sys.stderr.write("reorder: warning: no section titled %r\n" % t)
    # the map
    before, entries, after = split_map(pre)
    by_title = collections.OrderedDict(entries)
    if list(by_title) != [t for t, _ in secs]:
        sys.stderr.write("reorder: warning: the map's entries are not the "
                         "sections in order (map: %s)\n" % list(by_title))

    def map_of(ts):
        out = []
        for t in ts:
            out += by_title.pop(t, [])
        return out
    new_map = ([MAP_I] + map_of(p1) + ["", MAP_II] + map_of(p2) +
               ["", MAP_START] + map_of(end))
    new_map += [l for e in by_title.values() for l in e]   # (none: kept)
    new_pre = before + new_map + after
    out = list(new_pre)
    for k, t in enumerate(p1):
        if k == 0:
            out += BANNER_I
        out += body[t]
    for k, t in enumerate(p2):
        if k == 0:
            out += BANNER_II
        out += body[t]
    for t in end:
        out += body[t]
    # every section's last lines: keep its blank lines as they were, but
    # the file ends as it did
    return "\n".join(out), (p1, p2, end)


def check_lines(old, new):
    """The multiset of lines, apart from the banners and the map's part
    lines, unchanged."""
    ignore = set(BANNER_I + BANNER_II + [MAP_I, MAP_II, MAP_START, ""])
    a = collections.Counter(l for l in old.split("\n") if l not in ignore)
    b = collections.Counter(l for l in new.split("\n") if l not in ignore)
    if a != b:
        diff = (a - b) + (b - a)
        raise SystemExit("reorder: the lines changed: %s"
                         % list(diff.items())[:10])


def check_structure(text, part2):
    """(later, crossing): uses of a later section's names; Part I's uses
    of Part II's names."""
    lines = text.split("\n")
    heads = [(i + 1, HEADER.match(l).group(1)) for i, l in enumerate(lines)
             if HEADER.match(l)]

    def section(lineno):
        k = -1
        for j, (ln, _) in enumerate(heads):
            if ln <= lineno:
                k = j
        return k
    tree = ast.parse(text)

    def defined(node):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            return [node.name]
        if isinstance(node, ast.Assign):
            return [t.id for t in node.targets if isinstance(t, ast.Name)]
        return []

    def bound(node):
        out = set()
        for x in ast.walk(node):
            if isinstance(x, (ast.FunctionDef, ast.ClassDef)) and x is not node:
                out.add(x.name)
            elif isinstance(x, ast.arg):
                out.add(x.arg)
            elif isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store):
                out.add(x.id)
        return out
    where = {}
    for node in tree.body:
        for n in defined(node):
            where.setdefault(n, section(node.lineno))
    p2 = set(i for i, (_, t) in enumerate(heads) if t in part2)
    later, crossing = set(), set()
    for node in tree.body:
        mine = section(node.lineno)
        local = bound(node) if defined(node) else set()
        for x in ast.walk(node):
            if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load) \
                    and x.id not in local and x.id in where:
                w = where[x.id]
                who = (defined(node) or ["(statement at line %d)" % node.lineno])[0]
                if defined(node) and w > mine:
                    later.add("%s (%s) uses %s (%s)" % (
                        who, heads[mine][1], x.id, heads[w][1]))
                if mine not in p2 and heads[mine][1] != START and w in p2:
                    crossing.add("%s (%s) names %s (%s)" % (
                        who, heads[mine][1], x.id, heads[w][1]))
    return sorted(later), sorted(crossing)


def part2_of(myq_path):
    """PART_II of tests/test_structure.py beside `myq_path`, or None."""
    import os
    t = os.path.join(os.path.dirname(os.path.abspath(myq_path)), "tests",
                     "test_structure.py")
    try:
        with open(t) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(x, ast.Name) and x.id == "PART_II" for x in node.targets):
            return [ast.literal_eval(node.value)][0] and list(
                ast.literal_eval(node.value))
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("myq")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--part2", action="append", default=[],
                    help="one more Part II section (its banner's title)")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--allow-missing", action="store_true")
    a = ap.parse_args(argv)
    base = part2_of(a.myq) or PART_II
    if base is not PART_II:
        sys.stderr.write("reorder: Part II as tests/test_structure.py lists it\n")
    part2 = base + [t for t in a.part2 if t not in base]
    with open(a.myq) as f:
        old = f.read()
    new, (p1, p2, end) = reorder(old, part2, a.allow_missing)
    check_lines(old, new)
    again, _ = reorder(new, part2, True)
    if again != new:
        raise SystemExit("reorder: not idempotent (a second run changes it)")
    later, crossing = check_structure(new, set(part2))
    for x in later:
        sys.stderr.write("reorder: a section uses a later one's name: %s\n" % x)
    for x in crossing:
        sys.stderr.write("reorder: Part I names Part II: %s\n" % x)
    if a.check:
        print("in order" if new == old else "not in order")
        return 0 if new == old else 1
    if later:
        sys.stderr.write("reorder: nothing written\n")
        return 1
    with open(a.out or a.myq, "w") as f:
        f.write(new)
    sys.stderr.write("reorder: Part I %d sections, Part II %d (%s), then %s; "
                     "%d crossing(s)\n" % (len(p1), len(p2), ", ".join(p2),
                                           ", ".join(end) or "-", len(crossing)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
