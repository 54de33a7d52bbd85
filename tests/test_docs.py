"""The documentation made from one source: myq.py's table of the init
settings (_INIT_SETTINGS) is what init.d/myq.default, init.d/myq.config
and myq(1)'s INIT SCRIPTS list say (`make docs` writes them), and the
init scripts read exactly those settings with those defaults."""
import os
import re
import shutil
import subprocess
import sys

import pytest

import myq
from _core import ROOT
from test_dist import _dist_module


def _read(rel, root=ROOT):
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        return f.read()


def test_generated_files_are_what_the_table_makes():
    for rel, text in sorted(_dist_module().generated().items()):
        assert _read(rel) == text, "%s differs from myq.py's _INIT_SETTINGS: " \
            "run make docs" % rel


def test_the_init_scripts_read_the_tables_settings_and_defaults():
    """init.d/myq: NAME=${MYQ_KEY:-DEFAULT} for every setting; the procd
    script: config_get KEY main KEY DEFAULT for each but the pidfile."""
    table = dict((k, d) for k, d, _, _ in myq._INIT_SETTINGS)
    sysv = dict((k.lower(), d) for k, d in re.findall(
        r"^\w+=\$\{MYQ_(\w+):-([^}]*)\}", _read("init.d/myq"), re.M))
    assert sysv.pop("defaults") == "/etc/default/myq"   # (where they are)
    assert sysv == table
    procd = dict((k, "" if d == "''" else d) for k, d in re.findall(
        r"config_get (\w+) main \1 (\S+)", _read("init.d/myq.procd")))
    assert procd == dict((k, d) for k, d in table.items() if k != "pidfile")


def test_each_file_speaks_of_its_own_init_system():
    """[procd: ...] in UCI's file alone, [sysv: ...] (the pidfile) in the
    SysV file and the manual alone; `name` as each names the setting."""
    sysv, uci = (myq._init_settings_file(s) for s in ("sysv", "procd"))
    roff = myq._init_settings_roff()
    assert "it becomes this user itself" in uci
    assert "becomes this user itself" not in sysv + roff
    assert "pidfile" not in re.sub(r"(?s)^.*?\n\n", "", uci, 1)  # (the head says none)
    assert "#MYQ_PIDFILE=/var/run/myq.pid" in sysv and "MYQ_PIDFILE" in roff
    assert "(in MYQ_ARGS)" in sysv and "(in args)" in uci
    assert "(in \\fBMYQ_ARGS\\fR)" in roff
    assert "[" not in "".join(t for _, _, _, t in myq._INIT_SETTINGS).replace(
        "[ADDR]", "").replace("[sysv: ", "").replace("[procd: ", "")


def test_make_docs_writes_an_edit_of_the_table(tmp_path):
    """A default changed in the table: `build/dist.py --docs` rewrites the
    three files, and says nothing the second time."""
    repo = tmp_path / "repo"
    for rel in ("myq.py", "build/dist.py", "build/myq.1", "init.d/myq.default",
                "init.d/myq.config"):
        (repo / os.path.dirname(rel)).mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(ROOT, rel), str(repo / rel))
    src = (repo / "myq.py").read_text()
    old = '("workers", "1", "",'
    assert src.count(old) == 1
    (repo / "myq.py").write_text(src.replace(old, '("workers", "3", "",'))
    docs = [sys.executable, str(repo / "build" / "dist.py"), "--docs"]
    out = subprocess.check_output(docs, universal_newlines=True)
    assert sorted(re.findall(r"^(\S+): written", out, re.M)) == [
        "build/myq.1", "init.d/myq.config", "init.d/myq.default"]
    assert "#MYQ_WORKERS=3\n" in (repo / "init.d/myq.default").read_text()
    assert "\t#option workers '3'\n" in (repo / "init.d/myq.config").read_text()
    assert "\\fBMYQ_WORKERS\\fR (\\fB3\\fR)" in (repo / "build/myq.1").read_text()
    assert subprocess.check_output(docs, universal_newlines=True) == ""


def test_bench_device_rewrites_the_readme_device_table(tmp_path):
    """bench/device.py's figures of this tree replace the README's device
    rows they are of (all of them for a full run, the flash row alone
    for --skip=memory,cpu,start,arm); the soak's and bench-wear's rows stay;
    the flash row still reads as test_operator4 reads it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "device", os.path.join(ROOT, "bench", "device.py"))
    device = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(device)
    readme = tmp_path / "README.md"
    shutil.copy(os.path.join(ROOT, "README.md"), str(readme))
    before = readme.read_text()
    res = {"this": {"flash": {"source_kb": 700.4, "bytecode_kb": 1000.6}}}
    device.rewrite_readme(res, str(readme))
    after = readme.read_text()
    assert "\n| flash | 700 KB `myq.py` + 1001 KB cached byte code |\n" in after
    assert re.search(r"^\| flash \| ([\d.]+) KB `myq\.py` \+ ([\d.]+) KB cached "
                     r"byte code \|$", after, re.M)
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines())
               if a != b]
    assert len(changed) == 1 and len(before.splitlines()) == len(after.splitlines())
    res["this"].update(idle_pss=16 * 1024, busy_pss=24 * 1024,
                       cpu={"enqueue": 130e3, "drain": 250e3},
                       start={"installed_instr": 50e6, "installed_kb": 12 * 1024,
                              "bare_instr": 35e6, "bare_kb": 8 * 1024,
                              "onefile_instr": 700e6, "onefile_kb": 44 * 1024})
    res["arm"] = {"this": {"installed_ms": 380, "bare_ms": 420, "onefile_ms": 1700}}
    device.rewrite_readme(res, str(readme))
    after = readme.read_text()
    for row in ("| RAM, supervisor + 1 worker (PSS) | 16.0 MB idle, 24.0 MB draining",
                "| instructions | 130 k a durable enqueue, 250 k a delivered job |",
                "| `myq enqueue` start-up | installed 50 M instructions, 12.0 MB peak "
                "(bare interpreter 35.0 M, 8.0 MB); one file 700 M, 44.0 MB; armv7l "
                "0.38 s (bare 0.42), one file 1.7 s |"):
        assert "\n" + row in after, row
    for label in ("| worker CPU, field workload |", "| flash written, link down"):
        row = [l for l in before.splitlines() if l.startswith(label)]
        assert row and row[0] in after.splitlines()


def test_readme_is_the_tour_and_the_manual_pages_the_reference():
    """The README stays within 35 KB: whole topics live in the manual pages
    (the security model in myq(1), SECURITY; the init settings in INIT
    SCRIPTS), which it links to."""
    text = _read("README.md")
    assert len(text.encode("utf-8")) <= 35 * 1024
    assert "(build/myq.1)" in text and "(build/myq-spool.5)" in text
    page = _read("build/myq.1")
    for section in ("INIT SCRIPTS", "SECURITY"):
        assert "\n.SH %s\n" % section in page
        assert "[myq(1)](build/myq.1), %s" % section in text, section


def _layout_section():
    text = _read("build/myq-spool.5")
    return text[text.index("\n.SH LAYOUT\n"):text.index("\n.SH STATES\n")]


@pytest.mark.parametrize("store", ["files", "sqlite"])
def test_every_file_myq_makes_in_a_spool_is_in_myq_spool_5(tmp_path, store):
    """A spool after init, an enqueue, a policy and a worker's drain: each
    entry at its top and in locks/ is named (bold) in myq-spool(5)'s
    LAYOUT, locks/room (the disk guard's reserve) included."""
    if store == "sqlite":
        pytest.importorskip("sqlite3")
    spool = str(tmp_path / "spool")
    myq.main(["--spool", spool, "init", "--store", store, "--name", "q"])
    myq.main(["--spool", spool, "policy", "t", "max_queued=5"])
    myq.enqueue(spool, "t", {"n": 1})
    myq.Worker(spool, handlers={"t": lambda job: None}).run(drain=True)
    layout = _layout_section()
    seen = set()
    for sub in ("", "locks", "incoming"):
        for name in os.listdir(os.path.join(spool, sub)):
            rel = os.path.join(sub, name)
            if sub == "incoming" and name != "lanes":
                continue                    # (jobs)
            seen.add(rel)
            rel_, name_ = (n.replace("-", "\\-") for n in (rel, name))
            assert ("\\fB%s" % rel_) in layout or re.search(
                r"\\fB%s(\\fR|/|\\-)" % re.escape(name_), layout), rel
    assert "locks/used" in seen and "intake.token" in seen
    assert os.path.exists(os.path.join(spool, "locks", "room")) <= (
        "locks/room" in seen)


def test_each_spool_method_myq_1_documents_exists():
    """PYTHON API: every .name( of the Spool entry is a method of
    myq.Spool (Spool.held() was documented after it had gone)."""
    text = _read("build/myq.1")
    api = text[text.index("\n.SH PYTHON API\n"):text.index("\n.SH EXIT STATUS\n")]
    entry = api[api.index("\\fBSpool("):api.index("\\fBWorker(")]
    names = re.findall(r"\\fB\.(\w+)\(", entry)
    assert "enqueue_many" in names and "check" in names
    assert [n for n in names if not callable(getattr(myq.Spool, n, None))] == []
