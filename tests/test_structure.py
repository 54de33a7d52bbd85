"""The house's rules, read off myq.py itself: it reads top to
bottom (no section refers to a later one), every function fits on a
screen or two (80 lines), every class is a room one can hold in mind
(750 lines), no object (its class statements, its bases' among them)
grows past MAX_OBJECT, and the map in the module docstring names the
sections as they are, in their order."""
import ast
import os
import re

from _core import MYQ

HEADER = re.compile(r"^# (.+?) #{5,}$")
MAX_FUNCTION, MAX_CLASS = 80, 750
# An object is the sum of the class statements of its inheritance chain
# (mixins sharing one `self` are one object).  The aim is 900: the worker's
# parts are there (the scheduler 644, the worker 418); the stores are not
# (the SQLite store 3,066 lines, the file store 2,328, of which 2,075 the
# spool directory's code both share: _DirStore's _Producing, _Upkeep and
# _Reading): this bar holds them where they are, to come down.
MAX_OBJECT = 3250


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
