"""The house's rules, read off myq.py itself: it reads top to
bottom (no section refers to a later one), every function fits on a
screen or two (80 lines), every class is a room one can hold in mind
(750 lines), no object (its class statements, its bases' among them)
grows past MAX_OBJECT nor a section past MAX_SECTION, the map in the
module docstring names the sections as they are, in their order, and no
section of Part I (the core) names a symbol of Part II (the extensions),
which come after it once the file is reordered."""
import ast
import os
import re

from _core import MYQ

HEADER = re.compile(r"^# (.+?) #{5,}$")
MAX_FUNCTION, MAX_CLASS = 80, 750
# An object is the sum of the class statements of its inheritance chain
# (mixins sharing one `self` are one object); a section is what follows
# its banner up to the next one.  A store's objects hold their parts
# rather than grow: the SQLite claims their drop box (_SqlDropBox), every
# store's claims their handlers' records (_RunRecords).
MAX_OBJECT, MAX_SECTION = 900, 1200
# Part I is the core, Part II the extensions (the titles of their sections,
# in their order), then the script's start: no section of Part I names a
# symbol of Part II (an extension registers itself in one of the core's
# tables: _STORES, _BUILTIN_TYPES, _COMMAND_TABLE, _COMMAND_OPTIONS,
# _CHILDREN, _IMAGE).  The sections are put in that order by a script that
# reads this list (build/reorder.py: sections moved whole, the
# parts' banners, the map).
PART_II = (
    "The SQLite store: its database",
    "The SQLite store: its drop box and claims",
    "The SQLite store",
    "The RAM tier",
    "HTTP forwarding",
    "MQTT",
    "Intake: HTTP",
    "Intake: MQTT",
    "Install",
    "The process image",
)
START = "Run as a script"
PART_II_BANNER = "# PART II: THE EXTENSIONS"


def _source():
    with open(MYQ) as f:
        return f.read()


def _sections(src):
    return [(i + 1, m.group(1)) for i, line in enumerate(src.split("\n"))
            for m in [HEADER.match(line)] if m]


def _section_of(heads, lineno):
    k = -1
    for j, (ln, _) in enumerate(heads):
        if ln <= lineno:
            k = j
    return k


def _bound(node):
    """Names a top-level definition binds for itself (arguments, locals,
    nested functions): a use of one of them is not a use of the module's."""
    out = set()
    for x in ast.walk(node):
        if isinstance(x, (ast.FunctionDef, ast.ClassDef)) and x is not node:
            out.add(x.name)
        elif isinstance(x, ast.arg):
            out.add(x.arg)
        elif isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store):
            out.add(x.id)
    return out


def _defined(node):
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    return []


def test_no_section_refers_to_a_later_one():
    src = _source()
    heads = _sections(src)
    tree = ast.parse(src)
    where = {}
    for node in tree.body:
        for name in _defined(node):
            where.setdefault(name, _section_of(heads, node.lineno))
    later = []
    for node in tree.body:
        if not _defined(node):
            continue
        mine, local = _section_of(heads, node.lineno), _bound(node)
        for x in ast.walk(node):
            if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load) \
                    and x.id not in local and where.get(x.id, -1) > mine:
                later.append("%s (%s) uses %s (%s)" % (
                    _defined(node)[0], heads[mine][1], x.id,
                    heads[where[x.id]][1]))
    assert not later, "\n".join(sorted(set(later)))


def test_functions_and_classes_stay_small():
    tree = ast.parse(_source())
    big = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            n = node.end_lineno - node.lineno + 1
            most = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            if n > most:
                big.append("%s: %d lines (at most %d)" % (node.name, n, most))
    assert not big, "\n".join(big)


def object_sizes(tree):
    """{class: the lines of its class statement and of every base's in
    myq.py (each once)}."""
    classes = dict((n.name, n) for n in tree.body if isinstance(n, ast.ClassDef))

    def chain(name, seen):
        if name in classes and name not in seen:
            seen.append(name)
            for b in classes[name].bases:
                if isinstance(b, ast.Name):
                    chain(b.id, seen)
        return seen
    return dict((name, sum(classes[c].end_lineno - classes[c].lineno + 1
                           for c in chain(name, [])))
                for name in classes)


def test_objects_stay_within_their_bar():
    sizes = object_sizes(ast.parse(_source()))
    big = ["%s: %d lines with its bases (at most %d)" % (n, k, MAX_OBJECT)
           for n, k in sorted(sizes.items()) if k > MAX_OBJECT]
    assert not big, "\n".join(big)
    probe = ast.parse("class A:\n    x = 1\n\n\nclass B(A):\n    y = 2\n")
    assert object_sizes(probe) == {"A": 2, "B": 4}


def test_sections_stay_within_their_bar():
    src = _source()
    heads = _sections(src)
    ends = [ln for ln, _ in heads[1:]] + [src.count("\n") + 1]
    big = ["%s: %d lines (at most %d)" % (t, end - ln, MAX_SECTION)
           for (ln, t), end in zip(heads, ends) if end - ln > MAX_SECTION]
    assert not big, "\n".join(big)


def test_the_docstring_maps_the_sections_as_they_are():
    src = _source()
    doc = ast.get_docstring(ast.parse(src))
    mapped = re.findall(r"^  (\S.*?)  +\S.*$", doc.split("The map:", 1)[1],
                        re.M) if "The map:" in doc else []
    assert mapped == [title for _, title in _sections(src)], (
        "the module docstring's map (after 'The map:', one line per section:"
        " two spaces, its title, two spaces or more, what it holds) does not"
        " list the sections in order")


def test_the_structure_test_sees_sections_at_all():
    """(A test that could not fail would prove nothing: the file has its
    rooms, and a forward reference is seen where there is one.)"""
    src = _source()
    assert len(_sections(src)) >= 10
    probe = "# A #####\n\ndef f():\n    return g()\n\n# B #####\n\ndef g():\n" \
            "    return 1\n"
    heads = _sections(probe)
    tree = ast.parse(probe)
    f = tree.body[0]
    assert _section_of(heads, f.lineno) == 0
    assert _section_of(heads, tree.body[1].lineno) == 1
    assert "g" not in _bound(f)
    assert os.path.basename(MYQ) == "myq.py"

def _names_by_section(src):
    """(heads, where: {name: its section's index}, [(section index, the
    definition's name, names it loads)] of each top-level statement)."""
    heads = _sections(src)
    tree = ast.parse(src)
    where = {}
    for node in tree.body:
        for name in _defined(node):
            where.setdefault(name, _section_of(heads, node.lineno))
    uses = []
    for node in tree.body:
        local = _bound(node) if _defined(node) else set()
        loads = set(x.id for x in ast.walk(node) if isinstance(x, ast.Name)
                    and isinstance(x.ctx, ast.Load) and x.id not in local)
        who = (_defined(node) or ["line %d" % node.lineno])[0]
        uses.append((_section_of(heads, node.lineno), who, loads))
    return heads, where, uses


def test_no_part_i_section_names_a_part_ii_symbol():
    src = _source()
    heads, where, uses = _names_by_section(src)
    titles = [t for _, t in heads]
    assert set(PART_II) <= set(titles), set(PART_II) - set(titles)
    ext = set(i for i, t in enumerate(titles) if t in PART_II)
    crossing = ["%s (%s) names %s (%s)" % (who, titles[k], n, titles[where[n]])
                for k, who, loads in uses
                if k not in ext and titles[k] != START
                for n in sorted(loads) if where.get(n) in ext]
    assert not crossing, "\n".join(crossing)


def test_the_parts_are_in_order_once_marked():
    """Once the file has its Part II banner, Part I's sections are above
    it and Part II's below it, in PART_II's order, the start last."""
    src = _source()
    lines = src.split("\n")
    if PART_II_BANNER not in lines:
        return          # (not reordered yet: reorder.py marks the parts)
    at = lines.index(PART_II_BANNER) + 1
    heads = _sections(src)
    after = [t for ln, t in heads if ln > at]
    assert after == list(PART_II) + [START]
    assert heads[-1][1] == START


def test_the_part_check_sees_a_crossing():
    probe = ("# A #####\n\ndef f():\n    return g()\n\n# B #####\n\n"
             "def g():\n    return 1\n")
    heads, where, uses = _names_by_section(probe)
    assert where["g"] == 1 and (0, "f", set(["g"])) in uses



# What a test file proves, in its own words: not which issue, contract
# section or review round it came from (history: git log and the notes).
HISTORY = re.compile(r"\b(issue \d+|SPEC ?§? ?\d+|round \d+)", re.I)


def test_the_tests_say_what_they_prove_not_where_they_came_from():
    here = os.path.dirname(os.path.abspath(__file__))
    found = []
    for name in sorted(os.listdir(here)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        if re.search(r"\d\d\.py$", name):
            found.append("%s: a name after an issue, not a room" % name)
        with open(os.path.join(here, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node) or ""
                for m in HISTORY.finditer(doc):
                    found.append("%s (%s): %r" % (
                        name, getattr(node, "name", "module"), m.group(0)))
    assert not found, "\n".join(found)
