"""The worker is objects, not mixins: it holds a scheduler, a runner, its
side of the holds, the finishing of claims and its handlers, each making
its own state in its own __init__ and given what it works with; no object
(the class statements of its inheritance chain) is over 900 lines."""
import ast

from _core import MYQ

PARTS = ("_Scheduler", "_Runner", "_Holds", "_Finishing", "_Resolver", "Worker")
MAX_OBJECT = 900


def _classes():
    with open(MYQ) as f:
        tree = ast.parse(f.read())
    return dict((n.name, n) for n in tree.body if isinstance(n, ast.ClassDef))


def _object_lines(classes, name):
    """The lines of a class and of every class of myq.py it inherits."""
    node = classes[name]
    n = node.end_lineno - node.lineno + 1
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            n += _object_lines(classes, base.id)
    return n


def _option_names(classes):
    keys = [x for x in classes["WorkerOptions"].body if isinstance(x, ast.Assign)
            and x.targets[0].id == "KEYS"][0].value
    return [e.elts[0].value for e in keys.elts]


def test_no_object_of_the_worker_passes_900_lines():
    classes = _classes()
    names = PARTS + ("HttpHandler", "MqttHandler", "WorkerOptions")
    big = ["%s: %d" % (n, _object_lines(classes, n)) for n in names
           if _object_lines(classes, n) > MAX_OBJECT]
    assert not big, big
    assert classes["Worker"].bases[0].id == "object"


def test_each_part_makes_its_state_in_its_init():
    """Every attribute a part reads of itself is a method or class
    attribute, or set in its __init__ (none made later and guarded with
    getattr)."""
    classes = _classes()
    late = []
    for name in PARTS:
        node = classes[name]
        have = set()
        for x in node.body:
            if isinstance(x, ast.FunctionDef):
                have.add(x.name)
            elif isinstance(x, ast.Assign):
                have.update(t.id for t in x.targets if isinstance(t, ast.Name))
        init = [x for x in node.body if isinstance(x, ast.FunctionDef)
                and x.name == "__init__"][0]
        for x in ast.walk(init):
            if isinstance(x, ast.Attribute) and isinstance(x.ctx, ast.Store) \
                    and isinstance(x.value, ast.Name) and x.value.id == "self":
                have.add(x.attr)
            if isinstance(x, ast.Call) and getattr(x.func, "id", None) == \
                    "setattr":      # (Worker: the options, each its own)
                have.update(_option_names(classes))
        for x in ast.walk(node):
            if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) \
                    and x.value.id == "self" and x.attr not in have:
                late.append("%s.%s" % (name, x.attr))
            if isinstance(x, ast.Call) and getattr(x.func, "id", None) == \
                    "getattr" and isinstance(x.args[0], ast.Name) \
                    and x.args[0].id == "self":
                late.append("%s: getattr(self, ...)" % name)
    assert not late, sorted(set(late))


def test_the_parts_are_given_what_they_use_not_the_worker(myq, spool):
    w = myq.Worker(spool, handlers={"t": lambda job: None},
                   log=lambda *a, **k: None)
    parts = [w.sched, w.runner, w.holds, w.finish, w.resolver]
    for part in parts:
        assert not any(v is w for v in vars(part).values()), part
    assert w.sched.holds is w.holds and w.holds.sched is w.sched
    assert w.runner.runs is w.runs is w.sched.runs
    assert w.sched.delays is w.holds.delays is w.finish.delays is w.delays
    # the built-in handlers hold their connections, one set per worker
    other = myq.Worker(spool, log=lambda *a, **k: None)
    assert isinstance(w.resolver.http.pool, myq.HttpPool)
    assert w.http_pool is w.resolver.http.pool
    assert other.http_pool is not w.http_pool
    assert w.resolver.mqtt.clients == [] and w.resolver.mqtt.client is None
    assert w.resolver.mqtt.uplink is w.http_pool.uplink
    assert w.resolver.resolve("t")[0].target is w.handlers["t"]
    assert w.resolver.resolve("http")[0] is w.resolver.http


def test_a_worker_runs_and_drains_through_its_parts(myq, spool):
    ran = []
    sp = myq.open_store(spool)
    ids = [sp.enqueue("t", {"n": i}) for i in range(5)]
    w = myq.Worker(sp, handlers={"t": lambda job: ran.append(job["id"])},
                   log=lambda *a, **k: None, stats_interval=0)
    assert w.run(drain=True) == 0
    assert sorted(ran) == sorted(ids)
    assert w.sched._wake_fds == [] and w.runner._null is None
    assert w.finish._pending == 0 and w.finish._stuck == []
