"""Packaging: `make dist` (build/dist.py), `make install`, `make uninstall`,
`make clean`, and the manual pages.

The release tarball unpacks onto a root as usr/lib/myq/myq.py (myq.py,
unchanged), usr/bin/myq (a launcher that imports it, so that Python caches
its bytecode), etc/init.d/myq and etc/default/myq, plus the manual pages
and LICENSE under usr/share; myq runs from there; SHA256SUMS verifies; two
builds are byte-identical; the ipk has the same program files (no manual
pages: OpenWrt has no man), `License: MIT` and a Maintainer in its control
file, and scripts that compile and remove the bytecode; `make install
DESTDIR=…` lays out the same files plus a .pyc that Python really loads, and
`make uninstall` removes them all again. The manual pages render without a
warning (where groff is installed) and name every command, option and
MYQ_* variable of myq.py. The Makefile runs in a copy of the repository
under tmp_path, so the tests never write into the working tree (nor /etc,
/usr).

The launcher names /usr/lib/myq (the target's path). Tests that run an
unpacked tarball point Python at the unpacked copy with PYTHONPATH (and skip
when this machine has a /usr/lib/myq of its own, which would be imported
first); `make install` tests install for a PREFIX under tmp_path instead.
"""
import argparse
import ast
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import time

import pytest

from _core import ROOT

DIST = os.path.join(ROOT, "build", "dist.py")
BUSYBOX = shutil.which("busybox")
MAKE = shutil.which("make")

sys.path.insert(0, ROOT)
import myq  # noqa: E402
from _pythons import IDS, PYTHONS  # noqa: E402

VERSION = myq.__version__
TARBALL = "myq-%s.tar.gz" % VERSION
IPK = "myq_%s_all.ipk" % VERSION
# the SysV init script reads /etc/default/myq (tarball, make install)
LAYOUT = {"usr/bin/myq": 0o755, "usr/lib/myq/myq.py": 0o644,
          "etc/init.d/myq": 0o755, "etc/default/myq": 0o644}
# the ipk: the procd init script reads UCI, /etc/config/myq; no
# /etc/default/myq
IPK_LAYOUT = {"usr/bin/myq": 0o755, "usr/lib/myq/myq.py": 0o644,
              "etc/init.d/myq": 0o755, "etc/config/myq": 0o644}
# the documentation: in the tarball and `make install`, never in the ipk;
# with the OpenWrt files, for an install from the tarball there
DOCS = {"usr/share/man/man1/myq.1": "build/myq.1",
        "usr/share/man/man5/myq-spool.5": "build/myq-spool.5",
        "usr/share/doc/myq/LICENSE": "LICENSE",
        "usr/share/doc/myq/myq.procd": "init.d/myq.procd",
        "usr/share/doc/myq/myq.config": "init.d/myq.config"}
TAR_LAYOUT = dict(LAYOUT, **{n: 0o644 for n in DOCS})
MAN_PAGES = ["build/myq.1", "build/myq-spool.5"]
GROFF = shutil.which("groff")
TAG = sys.implementation.cache_tag
SHELLCHECK = shutil.which("shellcheck")
needs_busybox = pytest.mark.skipif(
    not BUSYBOX, reason="busybox not installed (apt-get install busybox)")
needs_shellcheck = pytest.mark.skipif(
    not SHELLCHECK, reason="shellcheck not installed (apt-get install shellcheck)")


def run(args, **kw):
    kw.setdefault("timeout", 120)
    env = kw.pop("env", None)
    full = {k: v for k, v in os.environ.items() if not k.startswith("MYQ_")}
    full.update(env or {})
    for k in [k for k, v in full.items() if v is None]:
        del full[k]             # env={"NAME": None}: not in the environment
    return subprocess.run([str(a) for a in args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True,
                          env=full, **kw)


def ok(r):
    assert r.returncode == 0, "%s\n%s%s" % (r.args, r.stdout, r.stderr)
    return r.stdout


def ok_r(r):
    ok(r)
    return r


def repo_copy(dst):
    """The files `make dist` and `make install` need, copied to dst."""
    for rel in ("Makefile", "myq.py", "build/dist.py", "init.d/myq",
                "init.d/myq.default", "init.d/myq.procd", "init.d/myq.config", "LICENSE",
                "build/myq.1", "build/myq-spool.5"):
        os.makedirs(os.path.join(str(dst), os.path.dirname(rel)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(str(dst), rel))
    return str(dst)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """dist/ as `make dist` makes it (in a copy of the repository)."""
    repo = repo_copy(tmp_path_factory.mktemp("repo"))
    if MAKE:
        ok(run([MAKE, "-C", repo, "dist", "PYTHON=" + sys.executable]))
    else:
        ok(run([sys.executable, os.path.join(repo, "build", "dist.py")]))
    return os.path.join(repo, "dist")


def unpack(tarball, root):
    with tarfile.open(tarball) as t:
        t.extractall(str(root))
    return str(root)


def unpacked_env(root):
    """The environment that runs an unpacked usr/bin/myq against the
    unpacked usr/lib/myq (the launcher names the target's /usr/lib/myq)."""
    if os.path.exists("/usr/lib/myq"):
        pytest.skip("this machine has a /usr/lib/myq: the launcher would "
                    "import that one, not the unpacked copy")
    return {"PYTHONPATH": os.path.join(str(root), "usr", "lib", "myq")}


def check_launcher(data, lib):
    """usr/bin/myq is the small launcher: a #! line for python3, lib first
    on sys.path, `import myq`, exit with myq.end(myq.main()); no import but sys and
    gc (builtins: the collector is off while myq loads)."""
    text = data.decode("utf-8")
    assert text.startswith("#!/usr/bin/env python3\n")
    assert len(data) < 1024
    tree = ast.parse(text)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert imported == {"gc", "sys", "myq"}
    assert "sys.path.insert(0, %r)" % lib in text
    assert text.rstrip().endswith("myq.end(myq.main())")


def loaded_from(stderr, pyc):
    """Whether `python3 -v` output says the module came from pyc."""
    return ("code object from %r" % pyc) in stderr


def test_dist_files_and_version(built):
    assert sorted(os.listdir(built)) == sorted([TARBALL, IPK, "SHA256SUMS"])
    # the version comes from the source text, without importing it
    sys.path.insert(0, os.path.join(ROOT, "build"))
    try:
        import dist
    finally:
        sys.path.pop(0)
    assert dist.version() == VERSION


def test_tarball_layout(built):
    with tarfile.open(os.path.join(built, TARBALL)) as t:
        members = t.getmembers()
    assert sorted(m.name for m in members) == sorted(TAR_LAYOUT)
    for m in members:
        assert m.isfile()
        assert stat.S_IMODE(m.mode) == TAR_LAYOUT[m.name], m.name
        assert (m.uid, m.gid, m.uname, m.gname) == (0, 0, "root", "root")
    with tarfile.open(os.path.join(built, TARBALL)) as t:
        # no bytecode: the tarball cannot know the target's Python
        assert not any(m.name.endswith(".pyc") or "__pycache__" in m.name
                       for m in t.getmembers())
        assert t.extractfile("usr/lib/myq/myq.py").read() == \
            open(os.path.join(ROOT, "myq.py"), "rb").read()
        check_launcher(t.extractfile("usr/bin/myq").read(), "/usr/lib/myq")
        assert t.extractfile("etc/init.d/myq").read() == \
            open(os.path.join(ROOT, "init.d", "myq"), "rb").read()
        assert t.extractfile("etc/default/myq").read() == \
            open(os.path.join(ROOT, "init.d", "myq.default"), "rb").read()
        # the manual pages and the licence, as they are in the repository
        for name, src in DOCS.items():
            assert t.extractfile(name).read() == \
                open(os.path.join(ROOT, src), "rb").read(), name


def test_sha256sums_verify(built):
    lines = open(os.path.join(built, "SHA256SUMS")).read().splitlines()
    assert len(lines) == 2
    for line in lines:
        digest, name = line.split("  ")
        with open(os.path.join(built, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest
    tool = ([BUSYBOX, "sha256sum"] if BUSYBOX else
            [shutil.which("sha256sum")] if shutil.which("sha256sum") else None)
    if tool:
        assert "OK" in ok(run(tool + ["-c", "SHA256SUMS"], cwd=built))


def test_reproducible(tmp_path, built):
    """Same sources, other file times: byte-identical archives."""
    repo = repo_copy(tmp_path / "repo")
    for dirpath, _, files in os.walk(repo):
        for f in files:
            os.utime(os.path.join(dirpath, f), (1e9, 1e9))
    ok(run([sys.executable, os.path.join(repo, "build", "dist.py"),
            "--out", tmp_path / "out"]))
    for name in (TARBALL, IPK, "SHA256SUMS"):
        assert open(os.path.join(built, name), "rb").read() == \
            open(str(tmp_path / "out" / name), "rb").read(), name
    # SOURCE_DATE_EPOCH sets every member's time
    ok(run([sys.executable, os.path.join(repo, "build", "dist.py"),
            "--out", tmp_path / "sde"], env={"SOURCE_DATE_EPOCH": "1700000000"}))
    with tarfile.open(str(tmp_path / "sde" / TARBALL)) as t:
        assert {m.mtime for m in t.getmembers()} == {1700000000}


def test_unpacked_myq_runs(tmp_path, built):
    """Unpack onto an empty root, then use myq from there: version, init,
    enqueue, a worker that drains the queue."""
    root = unpack(os.path.join(built, TARBALL), tmp_path / "root")
    env = unpacked_env(root)
    bin_ = os.path.join(root, "usr", "bin", "myq")
    assert os.stat(bin_).st_mode & 0o777 == 0o755

    def myq_(*args):
        return ok(run([sys.executable, bin_] + list(args), env=env))

    assert myq_("version").strip() == "myq " + VERSION
    # executable as it is, through its #! line (python3 found in PATH)
    if shutil.which("python3"):
        assert ok(run([bin_, "version"], env=env)).strip() == "myq " + VERSION
    # the one file alone is still a program (cp myq.py /usr/bin/myq)
    assert ok(run([sys.executable, os.path.join(root, "usr", "lib", "myq",
                                                "myq.py"), "version"])).strip() \
        == "myq " + VERSION
    spool = str(tmp_path / "spool")
    hdir = tmp_path / "handlers"
    hdir.mkdir()
    (hdir / "greet").write_text('#!/bin/sh\ncat >> "%s"\n' % (tmp_path / "out"))
    (hdir / "greet").chmod(0o755)
    myq_("--spool", spool, "init")
    jid = myq_("--spool", spool, "enqueue", "greet", '"from the tarball"').strip()
    myq_("--spool", spool, "worker", "--handlers", hdir, "--drain")
    job = json.loads(myq_("--spool", spool, "show", jid))
    assert job["state"] == "done"
    assert json.loads((tmp_path / "out").read_text()) == "from the tarball"


@needs_busybox
def test_busybox_tar_unpack_and_upgrade_keeps_settings(tmp_path, built):
    """What the README says to type on the device, with BusyBox tar: a fresh
    unpack creates the directories; an upgrade that names the three program
    files (after removing the old bytecode) leaves the operator's
    /etc/default/myq alone."""
    root = tmp_path / "root"
    root.mkdir()
    tarball = os.path.join(built, TARBALL)
    ok(run([BUSYBOX, "tar", "-xzf", tarball, "-C", root]))
    for name, mode in TAR_LAYOUT.items():
        assert stat.S_IMODE(os.stat(str(root / name)).st_mode) == mode, name
    (root / "etc" / "default" / "myq").write_text("MYQ_WORKERS=3\n")
    cache = root / "usr" / "lib" / "myq" / "__pycache__"
    cache.mkdir()
    (cache / ("myq.%s.pyc" % TAG)).write_bytes(b"old")
    ok(run([BUSYBOX, "rm", "-rf", cache]))
    ok(run([BUSYBOX, "tar", "-xzf", tarball, "-C", root,
            "usr/bin/myq", "usr/lib/myq/myq.py", "etc/init.d/myq"]))
    assert (root / "etc" / "default" / "myq").read_text() == "MYQ_WORKERS=3\n"
    assert not cache.exists()


@needs_busybox
def test_unpacked_init_script_runs_the_service(tmp_path, built):
    """The tarball's init script and program, with the tarball's settings
    file (extended with paths under tmp_path): start, a job, stop. The
    service runs the launcher (cmdline), which imports the unpacked module."""
    root = unpack(os.path.join(built, TARBALL), tmp_path / "root")
    unpacked = unpacked_env(root)
    bin_ = os.path.join(root, "usr", "bin", "myq")
    bb = tmp_path / "bb"
    bb.mkdir()
    ok(run([BUSYBOX, "--install", "-s", bb]))
    if os.path.lexists(str(bb / "python3")):
        os.unlink(str(bb / "python3"))
    os.symlink(sys.executable, str(bb / "python3"))
    spool = str(tmp_path / "spool")
    hdir = tmp_path / "handlers"
    hdir.mkdir()
    (hdir / "t").write_text("#!/bin/sh\nexit 0\n")
    (hdir / "t").chmod(0o755)
    defaults = os.path.join(root, "etc", "default", "myq")
    with open(defaults, "a") as f:
        f.write("MYQ_SPOOL=%s\nMYQ_BIN=%s\nMYQ_PIDFILE=%s\nMYQ_LOG=%s\n"
                "MYQ_ARGS='--handlers %s --poll 0.2'\n" % (
                    spool, bin_, tmp_path / "myq.pid", tmp_path / "myq.log",
                    hdir))
    env = dict(unpacked, PATH=str(bb), MYQ_DEFAULTS=defaults)
    script = os.path.join(root, "etc", "init.d", "myq")
    try:
        assert "OK" in ok(run([BUSYBOX, "sh", script, "start"], env=env))
        pid = int(open(str(tmp_path / "myq.pid")).read())
        cmd = open("/proc/%d/cmdline" % pid, "rb").read().split(b"\0")
        assert cmd[1].decode() == bin_
        jid = ok(run([sys.executable, bin_, "--spool", spool, "enqueue", "t"],
                     env=unpacked)).strip()
        end = time.monotonic() + 15
        while True:
            job = json.loads(ok(run([sys.executable, bin_, "--spool", spool,
                                     "show", jid], env=unpacked)))
            if job["state"] == "done":
                break
            assert time.monotonic() < end, "the job was not done in time"
            time.sleep(0.05)
    finally:
        ok(run([BUSYBOX, "sh", script, "stop"], env=env))
    r = run([BUSYBOX, "sh", script, "status"], env=env)
    assert r.returncode == 3


def ar_members(data):
    assert data[:8] == b"!<arch>\n"
    pos, out = 8, []
    while pos < len(data):
        head = data[pos:pos + 60]
        assert head[58:60] == b"`\n"
        name = head[:16].decode().strip().rstrip("/")
        size = int(head[48:58])
        out.append((name, data[pos + 60:pos + 60 + size]))
        pos += 60 + size + (size % 2)
    return out


def ipk_parts(built):
    members = ar_members(open(os.path.join(built, IPK), "rb").read())
    assert [n for n, _ in members] == ["debian-binary", "control.tar.gz",
                                       "data.tar.gz"]
    return dict(members)


def ipk_scripts(built, dst):
    """The ipk's postinst and prerm, written to dst; their paths."""
    parts = ipk_parts(built)
    out = {}
    with tarfile.open(fileobj=io.BytesIO(parts["control.tar.gz"])) as t:
        for name in ("postinst", "prerm"):
            path = os.path.join(str(dst), "myq." + name)
            with open(path, "wb") as f:
                f.write(t.extractfile("./" + name).read())
            os.chmod(path, 0o755)
            out[name] = path
    return out


def test_ipk(built, tmp_path):
    """The OpenWrt package: ar of debian-binary, control.tar.gz, data.tar.gz;
    the program files of the tarball (launcher + module, no bytecode), the
    procd init script; /etc/config/myq (UCI) is its one conffile, and
    there is no /etc/default/myq (the SysV script's, which procd's does not
    read)."""
    parts = ipk_parts(built)
    assert parts["debian-binary"] == b"2.0\n"
    with tarfile.open(fileobj=io.BytesIO(parts["control.tar.gz"])) as t:
        control = t.extractfile("./control").read().decode()
        conffiles = t.extractfile("./conffiles").read().decode()
        assert stat.S_IMODE(t.getmember("./postinst").mode) == 0o755
        assert stat.S_IMODE(t.getmember("./prerm").mode) == 0o755
    fields = dict(line.split(": ", 1) for line in control.splitlines())
    assert fields["Package"] == "myq" and fields["Version"] == VERSION
    assert fields["Architecture"] == "all"
    assert "python3-light" in fields["Depends"]
    assert fields["License"] == "MIT"
    # a maintainer, with an address, that is no real person's
    assert re.match(r"[^<>]+ <[^<>@\s]+@[^<>@\s]+>\Z", fields["Maintainer"])
    assert conffiles.split() == ["/etc/config/myq"]
    with tarfile.open(fileobj=io.BytesIO(parts["data.tar.gz"])) as t:
        files = {m.name: m for m in t.getmembers() if m.isfile()}
        # the program files only: no manual pages (OpenWrt has no man)
        assert sorted(files) == sorted("./" + n for n in IPK_LAYOUT)
        assert not any("/share/" in m.name or "/default" in m.name
                       for m in t.getmembers())
        for n, mode in IPK_LAYOUT.items():
            assert stat.S_IMODE(files["./" + n].mode) == mode
        procd = t.extractfile("./etc/init.d/myq").read()
        assert t.extractfile("./etc/config/myq").read() == \
            open(os.path.join(ROOT, "init.d", "myq.config"), "rb").read()
        assert t.extractfile("./usr/lib/myq/myq.py").read() == \
            open(os.path.join(ROOT, "myq.py"), "rb").read()
        check_launcher(t.extractfile("./usr/bin/myq").read(), "/usr/lib/myq")
        t.extractall(str(tmp_path / "root"))
    assert procd == open(os.path.join(ROOT, "init.d", "myq.procd"), "rb").read()
    assert procd.startswith(b"#!/bin/sh /etc/rc.common\n")
    root = tmp_path / "root"
    assert ok(run([sys.executable, root / "usr/bin/myq", "version"],
                  env=unpacked_env(root))).strip() == "myq " + VERSION


@needs_shellcheck
def test_ipk_scripts_shellcheck(built, tmp_path):
    scripts = ipk_scripts(built, tmp_path)
    r = run([SHELLCHECK, "-s", "sh", scripts["postinst"], scripts["prerm"]])
    assert r.returncode == 0, r.stdout


FUNCTIONS_SH = """
default_postinst() { echo "default_postinst $*" >>"$CALLS"; return 0; }
default_prerm() { echo "default_prerm $*" >>"$CALLS"; return "${PRERM_RC:-0}"; }
"""


def fake_root(tmp_path, built, functions=True):
    """The ipk's files unpacked into tmp_path/root (as opkg leaves them
    before postinst), optionally with a stub /lib/functions.sh that logs
    the calls to tmp_path/calls."""
    root = tmp_path / "root"
    with tarfile.open(fileobj=io.BytesIO(ipk_parts(built)["data.tar.gz"])) as t:
        t.extractall(str(root))
    if functions:
        (root / "lib").mkdir()
        (root / "lib" / "functions.sh").write_text(FUNCTIONS_SH)
    return root


@needs_busybox
def test_ipk_scripts_under_an_image_build(tmp_path, built):
    """IPKG_INSTROOT set (building a firmware image): postinst removes stale
    bytecode under it and compiles nothing (no python3 runs: the build
    host's Python is not the device's); prerm removes the bytecode; both
    hand over to OpenWrt's default_postinst / default_prerm."""
    scripts = ipk_scripts(built, tmp_path)
    root = fake_root(tmp_path, built)
    cache = root / "usr/lib/myq/__pycache__"
    cache.mkdir()
    (cache / "myq.cpython-30.pyc").write_bytes(b"stale")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python3").write_text("#!/bin/sh\necho ran >>%s\nexit 1\n"
                                  % (tmp_path / "python3-ran"))
    (bin_ / "python3").chmod(0o755)
    env = {"IPKG_INSTROOT": str(root), "CALLS": str(tmp_path / "calls"),
           "PATH": "%s:%s" % (bin_, os.environ.get("PATH", ""))}
    ok(run([BUSYBOX, "sh", scripts["postinst"], "configure"], env=env))
    assert not cache.exists()
    assert not (tmp_path / "python3-ran").exists()
    cache.mkdir()
    (cache / ("myq.%s.pyc" % TAG)).write_bytes(b"x")
    ok(run([BUSYBOX, "sh", scripts["prerm"], "remove"], env=env))
    assert not cache.exists()
    assert (root / "usr/lib/myq/myq.py").is_file()      # opkg removes that
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == ["default_postinst %s configure" % scripts["postinst"],
                     "default_prerm %s remove" % scripts["prerm"]]
    # default_prerm's status is the script's; the bytecode goes regardless
    cache.mkdir()
    r = run([BUSYBOX, "sh", scripts["prerm"], "remove"],
            env=dict(env, PRERM_RC="3"))
    assert r.returncode == 3 and not cache.exists()
    # without OpenWrt's functions (not an OpenWrt root): no failure
    os.unlink(str(root / "lib" / "functions.sh"))
    cache.mkdir()
    ok(run([BUSYBOX, "sh", scripts["postinst"], "configure"], env=env))
    cache.mkdir()
    ok(run([BUSYBOX, "sh", scripts["prerm"], "remove"], env=env))
    assert not cache.exists()
    # IPKG_NO_SCRIPT=1: postinst does nothing at all
    cache.mkdir()
    ok(run([BUSYBOX, "sh", scripts["postinst"], "configure"],
           env=dict(env, IPKG_NO_SCRIPT="1")))
    assert cache.exists()


@needs_busybox
def test_ipk_postinst_says_etc_default_myq_is_not_read(tmp_path, built):
    """An /etc/default/myq that an older package left behind: postinst says
    that OpenWrt's myq reads /etc/config/myq, and leaves the file (the
    operator's settings) and the install alone; none, no word."""
    scripts = ipk_scripts(built, tmp_path)
    root = fake_root(tmp_path, built)
    env = {"IPKG_INSTROOT": str(root), "CALLS": str(tmp_path / "calls")}
    r = ok_r(run([BUSYBOX, "sh", scripts["postinst"], "configure"], env=env))
    assert r.stderr == ""
    (root / "etc" / "default").mkdir()
    (root / "etc" / "default" / "myq").write_text("MYQ_WORKERS=3\n")
    r = ok_r(run([BUSYBOX, "sh", scripts["postinst"], "configure"], env=env))
    assert "/etc/default/myq is not read" in r.stderr
    assert "/etc/config/myq" in r.stderr
    assert (root / "etc" / "default" / "myq").read_text() == "MYQ_WORKERS=3\n"
    assert (tmp_path / "calls").read_text().count("default_postinst") == 2


@needs_busybox
def test_ipk_postinst_compiles_on_the_device(tmp_path, built):
    """On the device (no IPKG_INSTROOT), postinst compiles /usr/lib/myq/myq.py
    with the device's python3, even when PYTHONDONTWRITEBYTECODE is set; the
    launcher then loads that .pyc. A python3 that fails, or none at all,
    never fails the install. This machine's /usr/lib/myq is the fake root's:
    the python3 in PATH is a wrapper that maps the path (and records its
    arguments), then execs this Python."""
    if os.path.exists("/usr/lib/myq"):
        pytest.skip("this machine has a /usr/lib/myq of its own; the postinst "
                    "would work on it")
    scripts = ipk_scripts(built, tmp_path)
    root = fake_root(tmp_path, built, functions=False)
    lib = str(root / "usr/lib/myq")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python3").write_text(
        "#!%s -I\nimport os, sys\n"
        "with open(%r, 'a') as f:\n    f.write(repr(sys.argv[1:]) + '\\n')\n"
        "if os.environ.get('FAIL'):\n    sys.exit(1)\n"
        "args = [a.replace('/usr/lib/myq', %r) for a in sys.argv[1:]]\n"
        "os.execv(sys.executable, [sys.executable] + args)\n"
        % (sys.executable, str(tmp_path / "argv"), lib))
    (bin_ / "python3").chmod(0o755)
    env = {"PATH": "%s:%s" % (bin_, os.path.dirname(BUSYBOX)),
           "PYTHONDONTWRITEBYTECODE": "1"}
    ok(run([BUSYBOX, "sh", scripts["postinst"], "configure"], env=env))
    assert (tmp_path / "argv").read_text().count("\n") == 1
    pyc = os.path.join(lib, "__pycache__", "myq.%s.pyc" % TAG)
    assert os.path.isfile(pyc)
    r = ok_r(run([sys.executable, "-v", root / "usr/bin/myq", "version"],
                 env={"PYTHONPATH": lib}))
    assert r.stdout.strip() == "myq " + VERSION
    assert loaded_from(r.stderr, pyc)
    # a python3 that fails, then no python3 at all: the install goes on
    ok(run([BUSYBOX, "sh", scripts["postinst"], "configure"],
           env=dict(env, FAIL="1")))
    assert (tmp_path / "argv").read_text().count("\n") == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    ok(run([BUSYBOX, "sh", scripts["postinst"], "configure"],
           env={"PATH": str(empty)}))


def make_install(repo, destdir, prefix=None):
    if MAKE:
        args = [MAKE, "-C", repo, "install", "DESTDIR=%s" % destdir,
                "PYTHON=" + sys.executable]
        if prefix:
            args.append("PREFIX=" + prefix)
    else:
        args = [sys.executable, os.path.join(repo, "build", "dist.py"),
                "--install", destdir, "--prefix", prefix or "/usr"]
    return ok(run(args))


def installed_files(dest):
    got = {}
    for dirpath, _, files in os.walk(str(dest)):
        for f in files:
            p = os.path.join(dirpath, f)
            got[os.path.relpath(p, str(dest))] = stat.S_IMODE(os.stat(p).st_mode)
    return got


def test_make_install_layout(tmp_path):
    repo = repo_copy(tmp_path / "repo")
    dest = tmp_path / "dest"
    make_install(repo, dest)
    pyc = "usr/lib/myq/__pycache__/myq.%s.pyc" % TAG
    # and myq.pth, naming /usr/lib/myq, where this python3 imports from
    pth = _dist_module().site_dir("/usr").lstrip("/") + "/myq.pth"
    assert (dest / pth).read_text() == "/usr/lib/myq\n"
    assert installed_files(dest) == dict(TAR_LAYOUT, **{pyc: 0o644, pth: 0o644})
    for name, src in DOCS.items():
        assert (dest / name).read_bytes() == \
            open(os.path.join(ROOT, src), "rb").read(), name
    assert (dest / "usr/lib/myq/myq.py").read_bytes() == \
        open(os.path.join(ROOT, "myq.py"), "rb").read()
    # the launcher names the target's path, without DESTDIR
    check_launcher((dest / "usr/bin/myq").read_bytes(), "/usr/lib/myq")
    assert (dest / "etc/init.d/myq").read_bytes() == \
        open(os.path.join(ROOT, "init.d", "myq"), "rb").read()
    # a second install keeps the operator's settings, replaces the program
    # files by a rename (a new inode: a running reader never sees a mix),
    # and removes other interpreters' bytecode (stale: a new myq.py)
    (dest / "etc/default/myq").write_text("MYQ_WORKERS=4\n")
    old = dest / "usr/lib/myq/__pycache__/myq.cpython-30.pyc"
    old.write_bytes(b"stale")
    other = dest / "usr/lib/myq/__pycache__/handlers.cpython-30.pyc"
    other.write_bytes(b"not ours")
    inodes = {n: os.stat(str(dest / n)).st_ino
              for n in ("usr/bin/myq", "usr/lib/myq/myq.py")}
    out = make_install(repo, dest)
    for n, ino in inodes.items():
        assert os.stat(str(dest / n)).st_ino != ino, n
    assert "kept" in out
    assert (dest / "etc/default/myq").read_text() == "MYQ_WORKERS=4\n"
    assert not old.exists() and other.read_bytes() == b"not ours"
    other.unlink()
    assert installed_files(dest) == dict(TAR_LAYOUT, **{pyc: 0o644, pth: 0o644})
    r = ok_r(run([sys.executable, "-v", dest / "usr/bin/myq", "version"],
                 env={"PYTHONPATH": str(dest / "usr/lib/myq")}))
    assert r.stdout.strip() == "myq " + VERSION
    assert loaded_from(r.stderr, str(dest / pyc))


def test_make_install_prefix(tmp_path):
    """PREFIX=/usr/local: the program goes to /usr/local/bin, the module to
    /usr/local/lib/myq, the launcher imports it from there and the init
    script's MYQ_BIN default follows."""
    repo = repo_copy(tmp_path / "repo")
    dest = tmp_path / "dest"
    make_install(repo, dest, prefix="/usr/local")
    assert (dest / "usr/local/lib/myq/myq.py").is_file()
    assert (dest / ("usr/local/lib/myq/__pycache__/myq.%s.pyc" % TAG)).is_file()
    check_launcher((dest / "usr/local/bin/myq").read_bytes(),
                   "/usr/local/lib/myq")
    for name in DOCS:
        assert (dest / name.replace("usr/", "usr/local/", 1)).is_file(), name
    assert not (dest / "usr/bin").exists() and not (dest / "usr/lib").exists()
    assert not (dest / "usr/share").exists()
    script = (dest / "etc/init.d/myq").read_text()
    assert "BIN=${MYQ_BIN:-/usr/local/bin/myq}" in script
    assert "/usr/bin/myq}" not in script


def image_install(tmp_path, python=sys.executable):
    """`make install DESTDIR=dest PREFIX=<tmp>/target/usr` with `python`, then
    the staged tree copied to the place it names, as an image build does, with
    new file times (Buildroot and Yocto may reset them). Returns the
    installed PREFIX."""
    repo = repo_copy(tmp_path / "repo")
    dest = str(tmp_path / "dest")
    target = str(tmp_path / "target")
    prefix = os.path.join(target, "usr")
    if MAKE:
        ok(run([MAKE, "-C", repo, "install", "DESTDIR=" + dest,
                "PREFIX=" + prefix, "PYTHON=" + python]))
    else:
        ok(run([python, os.path.join(repo, "build", "dist.py"), "--install",
                dest, "--prefix", prefix]))
    staged = os.path.join(dest, prefix.lstrip("/"))
    shutil.copytree(staged, prefix, copy_function=shutil.copy)
    later = time.time() + 3600
    for dirpath, _, files in os.walk(prefix):
        for f in files:
            os.utime(os.path.join(dirpath, f), (later, later))
    return prefix


def test_make_install_runs_with_its_bytecode(tmp_path):
    """The installed launcher (no PYTHONPATH: it finds PREFIX/lib/myq by
    itself) loads the installed .pyc, under -I too, and never rewrites it;
    a real spool: init, enqueue, a draining worker, show."""
    prefix = image_install(tmp_path)
    bin_ = os.path.join(prefix, "bin", "myq")
    pyc = os.path.join(prefix, "lib", "myq", "__pycache__", "myq.%s.pyc" % TAG)
    before = os.stat(pyc)
    # Python may write bytecode here (as it does on the device)
    writes = {"PYTHONDONTWRITEBYTECODE": None}
    for flags in ([], ["-I"], ["-I", "-B"]):
        r = ok_r(run([sys.executable] + flags + ["-v", bin_, "version"],
                     env=writes))
        assert r.stdout.strip() == "myq " + VERSION, flags
        assert loaded_from(r.stderr, pyc), (flags, r.stderr[-3000:])
    # directly, through its #! line
    if shutil.which("python3"):
        assert ok(run([bin_, "version"])).strip() == "myq " + VERSION
    spool = str(tmp_path / "spool")
    hdir = tmp_path / "handlers"
    hdir.mkdir()
    (hdir / "greet").write_text('#!/bin/sh\ncat >> "%s"\n' % (tmp_path / "out"))
    (hdir / "greet").chmod(0o755)

    def myq_(*args):
        return ok(run([sys.executable, bin_] + list(args), env=writes))

    myq_("--spool", spool, "init")
    jid = myq_("--spool", spool, "enqueue", "greet", '"installed"').strip()
    myq_("--spool", spool, "worker", "--handlers", hdir, "--drain")
    assert json.loads(myq_("--spool", spool, "show", jid))["state"] == "done"
    assert json.loads((tmp_path / "out").read_text()) == "installed"
    after = os.stat(pyc)
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == \
        (before.st_ino, before.st_mtime_ns, before.st_size)
    assert os.listdir(os.path.dirname(pyc)) == [os.path.basename(pyc)]


def importtime_modules(stderr):
    """The module names `-X importtime` reports."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.split("|")[-1].strip()
            if name != "package":           # the header line
                names.add(name)
    return names


def test_launcher_imports_nothing_but_myq(tmp_path):
    """Everything `python3 -X importtime` sees through the launcher, myq
    imports itself: the launcher adds no module to the start."""
    prefix = image_install(tmp_path)
    lib = os.path.join(prefix, "lib", "myq")
    via_launcher = run([sys.executable, "-I", "-X", "importtime",
                        os.path.join(prefix, "bin", "myq"), "version"])
    ok(via_launcher)
    direct = run([sys.executable, "-I", "-X", "importtime", "-c",
                  "import sys; sys.path.insert(0, %r); import myq; "
                  "sys.exit(myq.main(['version']))" % lib])
    ok(direct)
    got = importtime_modules(via_launcher.stderr)
    assert "myq" in got
    assert got == importtime_modules(direct.stderr)


@pytest.mark.parametrize("ident", IDS)
def test_make_install_every_python(tmp_path, ident):
    """dist.py installs with every CPython 3.7+ here, each writing the .pyc
    for itself, which its launcher run then loads."""
    python = {i: exe for i, exe, _ in PYTHONS}[ident]
    prefix = image_install(tmp_path, python=python)
    tag = ok(run([python, "-c", "import sys; print(sys.implementation.cache_tag)"]))
    pyc = os.path.join(prefix, "lib", "myq", "__pycache__",
                       "myq.%s.pyc" % tag.strip())
    r = ok_r(run([python, "-I", "-v", os.path.join(prefix, "bin", "myq"),
                  "version"]))
    assert r.stdout.strip() == "myq " + VERSION
    assert loaded_from(r.stderr, pyc)


def make_uninstall(repo, destdir, prefix=None):
    if MAKE:
        args = [MAKE, "-C", repo, "uninstall", "DESTDIR=%s" % destdir,
                "PYTHON=" + sys.executable]
        if prefix:
            args.append("PREFIX=" + prefix)
    else:
        args = [sys.executable, os.path.join(repo, "build", "dist.py"),
                "--uninstall", destdir, "--prefix", prefix or "/usr"]
    return ok(run(args))


@pytest.mark.parametrize("prefix", [None, "/usr/local"])
def test_make_uninstall_leaves_nothing(tmp_path, prefix):
    """install then uninstall (same DESTDIR and PREFIX): no file is left,
    nor the directories that are myq's own; a second uninstall is a no-op."""
    repo = repo_copy(tmp_path / "repo")
    dest = tmp_path / "dest"
    make_install(repo, dest, prefix=prefix)
    assert installed_files(dest)
    make_uninstall(repo, dest, prefix=prefix)
    assert installed_files(dest) == {}
    p = (prefix or "/usr").lstrip("/")
    for own in ("lib/myq", "share/doc/myq"):
        assert not (dest / p / own).exists(), own
    make_uninstall(repo, dest, prefix=prefix)
    assert installed_files(dest) == {}


def test_make_uninstall_keeps_what_is_not_its_own(tmp_path):
    """An edited /etc/default/myq stays (the operator's settings), and so
    does a file of someone else's in PREFIX/lib/myq (with its directory);
    every file that install wrote goes, bytecode of other Pythons too."""
    repo = repo_copy(tmp_path / "repo")
    dest = tmp_path / "dest"
    make_install(repo, dest)
    (dest / "etc/default/myq").write_text("MYQ_WORKERS=2\n")
    (dest / "usr/lib/myq/handlers.py").write_text("def t(job): pass\n")
    (dest / "usr/lib/myq/__pycache__/myq.cpython-30.pyc").write_bytes(b"old")
    out = make_uninstall(repo, dest)
    assert installed_files(dest) == {"etc/default/myq": 0o644,
                                     "usr/lib/myq/handlers.py": 0o644}
    assert (dest / "etc/default/myq").read_text() == "MYQ_WORKERS=2\n"
    assert "kept" in out
    assert not (dest / "usr/lib/myq/__pycache__").exists()


@pytest.mark.skipif(not MAKE, reason="make not installed")
def test_make_clean(tmp_path):
    """make clean removes what builds and test runs leave (dist/, the venv,
    .pytest_cache/, .hypothesis/, every __pycache__/) and nothing else."""
    repo = repo_copy(tmp_path / "repo")
    made = ["dist/x.tar.gz", ".venv/bin/python", ".pytest_cache/v",
            ".hypothesis/examples/x", "__pycache__/myq.cpython-311.pyc",
            "tests/__pycache__/t.pyc", "bench/__pycache__/b.pyc",
            "build/__pycache__/dist.cpython-311.pyc", "demo/incoming/x.json",
            "tests/sub/__pycache__/s.pyc"]
    for rel in made:
        path = os.path.join(repo, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()
    before = installed_files(repo)
    ok(run([MAKE, "-C", repo, "clean", "PYTHON=" + sys.executable]))
    after = installed_files(repo)
    assert sorted(after) == sorted(set(before) - set(made))
    for d in ("dist", ".venv", ".pytest_cache", ".hypothesis", "__pycache__",
              "tests/__pycache__", "bench/__pycache__", "build/__pycache__",
              "tests/sub/__pycache__"):
        assert not os.path.exists(os.path.join(repo, d)), d


def test_license():
    text = open(os.path.join(ROOT, "LICENSE")).read()
    assert text.startswith("MIT License\n")
    assert "Copyright (c) 2026 the myq authors" in text
    assert "THE SOFTWARE IS PROVIDED \"AS IS\"" in text


def roff_text(path):
    """A manual page's source with the escapes for '-' and fonts undone."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    return re.sub(r"\\f[BIRP]|\\&", "", text.replace("\\-", "-"))


def section(text, name):
    m = re.search(r"^\.SH %s\n(.*?)(?=^\.SH )" % re.escape(name), text,
                  re.M | re.S)
    assert m, "no section %s" % name
    return m.group(1)


@pytest.mark.skipif(not GROFF, reason="groff not installed "
                    "(apt-get install groff-base)")
@pytest.mark.parametrize("page", MAN_PAGES)
def test_man_page_renders_without_warnings(page):
    """groff with every warning on says nothing; rendered for a terminal,
    no line is wider than 78 columns (a serial console)."""
    path = os.path.join(ROOT, page)
    r = run([GROFF, "-man", "-Tutf8", "-ww", "-z", path])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = run([GROFF, "-man", "-Tutf8", "-ww", "-P-c", "-P-b", "-P-u", path])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "NAME" in r.stdout and "SEE ALSO" in r.stdout
    wide = [line for line in r.stdout.splitlines() if len(line) > 78]
    assert not wide, wide


def parsers():
    """{command: its argparse parser}, from myq.py's own command line."""
    top = myq._parser()
    sub = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub[0].choices)


def test_myq_1_documents_the_command_line():
    """myq(1) has an entry for every command (and none that is gone), names
    every option of each, the MYQ_* variable of every worker and guard
    option, and every exit status that myq's errors use."""
    text = roff_text("build/myq.1")
    commands = section(text, "COMMANDS").split(".SS ")[0]
    documented = set(re.findall(r"^\.TP\n(\w+)", commands, re.M))
    cmds = parsers()
    assert documented == set(cmds)
    for name, p in cmds.items():
        for action in p._actions:
            for opt in action.option_strings:
                if opt in ("-h", "--help") or action.help == argparse.SUPPRESS:
                    continue
                assert re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(opt),
                                 text), "%s %s" % (name, opt)
    for flag, _, _, _ in myq.WORKER_OPTIONS + myq.GUARD_OPTIONS:
        env = "MYQ_" + flag[2:].replace("-", "_").upper()
        assert re.search(r"\b%s\b" % env, text), env
    for env in ("MYQ_SPOOL", "MYQ_WORKERS", "MYQ_JOB_ID", "MYQ_JOB_TYPE",
                "MYQ_ATTEMPT", "MYQ_MAX_ATTEMPTS"):
        assert re.search(r"\b%s\b" % env, text), env
    status = set(re.findall(r"^\.TP\n(\d+)\n", section(text, "EXIT STATUS"),
                            re.M))
    codes = {str(c.code) for c in (myq.UsageError, myq.InvalidJob,
                                   myq.NoSuchJob, myq.DuplicateJob,
                                   myq.SpoolFull, myq.SpoolBusy,
                                   myq.ConfigError)}
    assert codes | {"0", "1"} <= status
    for name in ("SYNOPSIS", "DESCRIPTION", "HANDLERS", "ENVIRONMENT",
                 "FILES", "SEE ALSO"):
        assert "\n.SH %s\n" % name in text
    assert "myq-spool(5)" in section(text + ".SH ", "SEE ALSO")


def test_myq_spool_5_documents_the_layout():
    """myq-spool(5) describes every directory of the layout and every state."""
    text = roff_text("build/myq-spool.5")
    layout = set(re.findall(r"^\.TP\n(\w+)/\n", section(text, "LAYOUT"), re.M))
    assert layout == set(myq.SUBDIRS)
    states = section(text, "STATES")
    for state in myq.STATES:
        assert re.search(r"^\.TP\n.*\b%s\b" % state, states, re.M), state
    assert "myq(1)" in section(text + ".SH ", "SEE ALSO")


# `python3 myq.py install`: the one file lays out the same program files
# with the init files it carries ##########################################

def _dist_module():
    sys.path.insert(0, os.path.join(ROOT, "build"))
    try:
        import dist
    finally:
        sys.path.pop(0)
    return dist


def test_embedded_init_files_are_init_d():
    """myq._INIT_FILES is init.d/ as it is (else: make embed)."""
    got = {}
    for rel in _dist_module().EMBEDDED:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            got[os.path.basename(rel)] = f.read()
    assert myq._INIT_FILES == got, "init.d/ changed: run make embed"
    assert myq._LAUNCHER == _dist_module().LAUNCHER


def test_make_embed_writes_init_d_into_myq_py(tmp_path):
    repo = repo_copy(tmp_path / "repo")
    embed = [sys.executable, os.path.join(repo, "build", "dist.py"), "--embed"]
    with open(os.path.join(repo, "myq.py"), "rb") as f:
        before = f.read()
    assert "already" in ok(run(embed))
    with open(os.path.join(repo, "init.d", "myq"), "a") as f:
        f.write('# an edit: "quoted", \\ and \ttab, caf\u00e9\n')
    assert "written" in ok(run(embed))
    out = ok(run([sys.executable, "-c", "import sys; sys.path.insert(0, %r); "
                  "import myq; sys.stdout.write(myq._INIT_FILES['myq'])" % repo]))
    with open(os.path.join(repo, "init.d", "myq"), encoding="utf-8") as f:
        assert out == f.read()
    with open(os.path.join(repo, "myq.py"), "rb") as f:
        after = f.read()
    assert after != before and len(after) - len(before) < 200


def one_file_install(tmp_path, *args, python=sys.executable, me=None):
    """A copy of myq.py alone (no init.d/ beside it) runs `install --destdir
    dest --prefix <tmp>/target/usr ARGS`; returns (dest, prefix, output)."""
    if me is None:
        one = tmp_path / "one"
        one.mkdir(exist_ok=True)
        me = str(one / "myq.py")
        shutil.copy(os.path.join(ROOT, "myq.py"), me)
    dest = tmp_path / "dest"
    dest.mkdir(exist_ok=True)
    prefix = str(tmp_path / "target" / "usr")
    out = ok(run([python, me, "install", "--destdir", dest, "--prefix", prefix]
                 + list(args), env={"PYTHONDONTWRITEBYTECODE": None}))
    return dest, prefix, out


def staged(dest, prefix, rel):
    return os.path.join(str(dest), prefix.lstrip("/"), rel)


def test_one_file_install_layout_and_run(tmp_path):
    dest, prefix, out = one_file_install(tmp_path)
    p = prefix.lstrip("/")
    pyc = p + "/lib/myq/__pycache__/myq.%s.pyc" % TAG
    pth = _dist_module().site_dir(prefix).lstrip("/") + "/myq.pth"
    assert installed_files(dest) == {
        p + "/bin/myq": 0o755, p + "/lib/myq/myq.py": 0o644, pyc: 0o644,
        "etc/init.d/myq": 0o755, "etc/default/myq": 0o644, pth: 0o644}
    assert all(str(dest / n) in out for n in installed_files(dest))
    with open(staged(dest, prefix, "lib/myq/myq.py"), "rb") as f, \
            open(os.path.join(ROOT, "myq.py"), "rb") as g:
        assert f.read() == g.read()
    with open(staged(dest, prefix, "bin/myq"), "rb") as f:
        launcher = f.read()
    check_launcher(launcher, prefix + "/lib/myq")
    assert launcher == _dist_module().launcher(prefix)
    script = (dest / "etc/init.d/myq").read_text()
    with open(os.path.join(ROOT, "init.d", "myq")) as f:
        assert script == f.read().replace(
            "BIN=${MYQ_BIN:-/usr/bin/myq}", "BIN=${MYQ_BIN:-%s/bin/myq}" % prefix)
    with open(os.path.join(ROOT, "init.d", "myq.default")) as f:
        assert (dest / "etc/default/myq").read_text() == f.read()
    # the staged tree where it names itself (an image, new file times): the
    # launcher starts from the bytecode: enqueue, a draining worker
    shutil.copytree(staged(dest, prefix, ""), prefix, copy_function=shutil.copy)
    bin_, spool = os.path.join(prefix, "bin", "myq"), str(tmp_path / "spool")
    hdir = tmp_path / "handlers"
    hdir.mkdir()
    (hdir / "greet").write_text('#!/bin/sh\ncat >> "%s"\n' % (tmp_path / "out"))
    (hdir / "greet").chmod(0o755)
    ok(run([sys.executable, bin_, "--spool", spool, "init"]))
    r = ok_r(run([sys.executable, "-v", bin_, "--spool", spool, "enqueue",
                  "greet", '"one file"']))
    assert loaded_from(r.stderr, os.path.join(prefix, pyc[len(p) + 1:]))
    assert "argparse" not in importtime_modules(ok_r(run(
        [sys.executable, "-I", "-X", "importtime", bin_, "--spool", spool,
         "enqueue", "greet", '"two"'])).stderr)
    ok(run([sys.executable, bin_, "--spool", spool, "worker", "--handlers", hdir,
            "--drain"]))
    assert (tmp_path / "out").read_text().splitlines() == ['"one file"', '"two"']


def test_one_file_install_again_keeps_the_settings(tmp_path):
    """Again, from the installed copy itself: the same files (program files
    replaced by a rename), another Python's stale bytecode gone, the
    operator's settings kept."""
    dest, prefix, _ = one_file_install(tmp_path)
    (dest / "etc/default/myq").write_text("MYQ_WORKERS=4\n")
    stale = staged(dest, prefix, "lib/myq/__pycache__/myq.cpython-30.pyc")
    with open(stale, "wb") as f:
        f.write(b"stale")
    files = installed_files(dest)
    ino = os.stat(staged(dest, prefix, "bin/myq")).st_ino
    _, _, out = one_file_install(tmp_path, me=staged(dest, prefix, "lib/myq/myq.py"))
    assert "kept" in out and (dest / "etc/default/myq").read_text() == "MYQ_WORKERS=4\n"
    assert not os.path.exists(stale)
    del files[os.path.relpath(stale, str(dest))]
    assert installed_files(dest) == files
    assert os.stat(staged(dest, prefix, "bin/myq")).st_ino != ino
    with open(staged(dest, prefix, "lib/myq/myq.py"), "rb") as f, \
            open(os.path.join(ROOT, "myq.py"), "rb") as g:
        assert f.read() == g.read()


def test_one_file_install_procd(tmp_path):
    """--init procd (and by default where the target has /etc/rc.common):
    OpenWrt's script, naming PREFIX/bin/myq, and /etc/config/myq."""
    (tmp_path / "dest" / "etc").mkdir(parents=True)
    (tmp_path / "dest" / "etc" / "rc.common").write_text("#!/bin/sh\n")
    for args in ([], ["--init", "procd"]):
        dest, prefix, out = one_file_install(tmp_path, *args)
        script = (dest / "etc/init.d/myq").read_text()
        with open(os.path.join(ROOT, "init.d", "myq.procd")) as f:
            assert script == f.read().replace(
                "bin main bin /usr/bin/myq", "bin main bin %s/bin/myq" % prefix)
        with open(os.path.join(ROOT, "init.d", "myq.config")) as f:
            assert (dest / "etc/config/myq").read_text() == f.read()
        assert not (dest / "etc/default").exists()
    dest, _, _ = one_file_install(tmp_path, "--init", "sysv")
    assert "BIN=${MYQ_BIN:-" in (dest / "etc/init.d/myq").read_text()


def test_one_file_install_refuses_what_it_cannot_do(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    me = str(one / "myq.py")
    shutil.copy(os.path.join(ROOT, "myq.py"), me)
    (tmp_path / "dest").mkdir()
    (tmp_path / "file").write_text("")
    for args, code, said in [
            (["--prefix", "usr"], 64, "--prefix must be an absolute path, not 'usr'"),
            (["--prefix", ""], 64, "--prefix must be an absolute path"),
            (["--destdir", tmp_path / "none"], 64, "is not a directory"),
            (["--destdir", tmp_path / "file"], 64, "is not a directory"),
            (["--init", "systemd"], 64, "invalid choice")]:
        r = run([sys.executable, me, "install"] + args)
        assert r.returncode == code, (args, r.stderr)
        assert said in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
    # a file where a directory of the layout goes: said, exit 73
    (tmp_path / "dest" / "usr").write_text("")
    r = run([sys.executable, me, "install", "--destdir", tmp_path / "dest"])
    assert r.returncode == 73, r.stderr
    assert r.stderr.startswith("myq: cannot write %s" % (tmp_path / "dest" / "usr")), r.stderr
    assert os.listdir(str(tmp_path / "dest")) == ["usr"]
