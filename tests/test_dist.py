"""Packaging: `make dist` (build/dist.py) and `make install`.

The release tarball unpacks onto a root as usr/bin/myq, etc/init.d/myq and
etc/default/myq; myq runs from there; SHA256SUMS verifies; two builds are
byte-identical; `make install DESTDIR=…` lays out the same files. The
Makefile runs in a copy of the repository under tmp_path, so the tests never
write into the working tree (nor /etc, /usr).
"""
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST = os.path.join(ROOT, "build", "dist.py")
BUSYBOX = shutil.which("busybox")
MAKE = shutil.which("make")

sys.path.insert(0, ROOT)
import myq  # noqa: E402

VERSION = myq.__version__
TARBALL = "myq-%s.tar.gz" % VERSION
IPK = "myq_%s_all.ipk" % VERSION
LAYOUT = {"usr/bin/myq": 0o755, "etc/init.d/myq": 0o755,
          "etc/default/myq": 0o644}


def run(args, **kw):
    kw.setdefault("timeout", 120)
    env = kw.pop("env", None)
    full = {k: v for k, v in os.environ.items() if not k.startswith("MYQ_")}
    full.update(env or {})
    return subprocess.run([str(a) for a in args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True,
                          env=full, **kw)


def ok(r):
    assert r.returncode == 0, "%s\n%s%s" % (r.args, r.stdout, r.stderr)
    return r.stdout


def repo_copy(dst):
    """The files `make dist` and `make install` need, copied to dst."""
    for rel in ("Makefile", "myq.py", "build/dist.py", "init.d/myq",
                "init.d/myq.default", "init.d/myq.procd"):
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
    assert sorted(m.name for m in members) == sorted(LAYOUT)
    for m in members:
        assert m.isfile()
        assert stat.S_IMODE(m.mode) == LAYOUT[m.name], m.name
        assert (m.uid, m.gid, m.uname, m.gname) == (0, 0, "root", "root")
    with tarfile.open(os.path.join(built, TARBALL)) as t:
        assert t.extractfile("usr/bin/myq").read() == \
            open(os.path.join(ROOT, "myq.py"), "rb").read()
        assert t.extractfile("etc/init.d/myq").read() == \
            open(os.path.join(ROOT, "init.d", "myq"), "rb").read()
        assert t.extractfile("etc/default/myq").read() == \
            open(os.path.join(ROOT, "init.d", "myq.default"), "rb").read()


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
    bin_ = os.path.join(root, "usr", "bin", "myq")
    assert os.stat(bin_).st_mode & 0o777 == 0o755
    assert ok(run([sys.executable, bin_, "version"])).strip() == "myq " + VERSION
    # executable as it is, through its #! line (python3 found in PATH)
    if shutil.which("python3"):
        assert ok(run([bin_, "version"])).strip() == "myq " + VERSION
    spool = str(tmp_path / "spool")
    hdir = tmp_path / "handlers"
    hdir.mkdir()
    (hdir / "greet").write_text('#!/bin/sh\ncat >> "%s"\n' % (tmp_path / "out"))
    (hdir / "greet").chmod(0o755)
    ok(run([sys.executable, bin_, "--spool", spool, "init"]))
    jid = ok(run([sys.executable, bin_, "--spool", spool, "enqueue", "greet",
                  '"from the tarball"'])).strip()
    ok(run([sys.executable, bin_, "--spool", spool, "worker", "--handlers",
            hdir, "--drain"]))
    job = json.loads(ok(run([sys.executable, bin_, "--spool", spool, "show", jid])))
    assert job["state"] == "done"
    assert json.loads((tmp_path / "out").read_text()) == "from the tarball"


@pytest.mark.skipif(not BUSYBOX, reason="busybox not installed (apt-get install busybox)")
def test_busybox_tar_unpack_and_upgrade_keeps_settings(tmp_path, built):
    """What the README says to type on the device, with BusyBox tar: a fresh
    unpack creates the directories; an upgrade that names the two program
    files leaves the operator's /etc/default/myq alone."""
    root = tmp_path / "root"
    root.mkdir()
    tarball = os.path.join(built, TARBALL)
    ok(run([BUSYBOX, "tar", "-xzf", tarball, "-C", root]))
    for name, mode in LAYOUT.items():
        assert stat.S_IMODE(os.stat(str(root / name)).st_mode) == mode, name
    (root / "etc" / "default" / "myq").write_text("MYQ_WORKERS=3\n")
    ok(run([BUSYBOX, "tar", "-xzf", tarball, "-C", root,
            "usr/bin/myq", "etc/init.d/myq"]))
    assert (root / "etc" / "default" / "myq").read_text() == "MYQ_WORKERS=3\n"


@pytest.mark.skipif(not BUSYBOX, reason="busybox not installed (apt-get install busybox)")
def test_unpacked_init_script_runs_the_service(tmp_path, built):
    """The tarball's init script and program, with the tarball's settings
    file (extended with paths under tmp_path): start, a job, stop."""
    root = unpack(os.path.join(built, TARBALL), tmp_path / "root")
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
                    spool, os.path.join(root, "usr", "bin", "myq"),
                    tmp_path / "myq.pid", tmp_path / "myq.log", hdir))
    env = {"PATH": str(bb), "MYQ_DEFAULTS": defaults}
    script = os.path.join(root, "etc", "init.d", "myq")
    try:
        assert "OK" in ok(run([BUSYBOX, "sh", script, "start"], env=env))
        pid = int(open(str(tmp_path / "myq.pid")).read())
        cmd = open("/proc/%d/cmdline" % pid, "rb").read().split(b"\0")
        assert cmd[1].decode() == os.path.join(root, "usr", "bin", "myq")
        jid = ok(run([sys.executable, os.path.join(root, "usr", "bin", "myq"),
                      "--spool", spool, "enqueue", "t"])).strip()
        end = time.monotonic() + 15
        while True:
            job = json.loads(ok(run([sys.executable, os.path.join(
                root, "usr", "bin", "myq"), "--spool", spool, "show", jid])))
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


def test_ipk(built, tmp_path):
    """The OpenWrt package: ar of debian-binary, control.tar.gz, data.tar.gz;
    the procd init script; /etc/default/myq is a conffile."""
    members = ar_members(open(os.path.join(built, IPK), "rb").read())
    assert [n for n, _ in members] == ["debian-binary", "control.tar.gz",
                                       "data.tar.gz"]
    parts = dict(members)
    assert parts["debian-binary"] == b"2.0\n"
    with tarfile.open(fileobj=io.BytesIO(parts["control.tar.gz"])) as t:
        control = t.extractfile("./control").read().decode()
        conffiles = t.extractfile("./conffiles").read().decode()
        assert stat.S_IMODE(t.getmember("./postinst").mode) == 0o755
    fields = dict(line.split(": ", 1) for line in control.splitlines())
    assert fields["Package"] == "myq" and fields["Version"] == VERSION
    assert fields["Architecture"] == "all"
    assert "python3-light" in fields["Depends"]
    assert conffiles.split() == ["/etc/default/myq"]
    with tarfile.open(fileobj=io.BytesIO(parts["data.tar.gz"])) as t:
        files = {m.name: m for m in t.getmembers() if m.isfile()}
        assert sorted(files) == sorted("./" + n for n in LAYOUT)
        for n, mode in LAYOUT.items():
            assert stat.S_IMODE(files["./" + n].mode) == mode
        procd = t.extractfile("./etc/init.d/myq").read()
    assert procd == open(os.path.join(ROOT, "init.d", "myq.procd"), "rb").read()
    assert procd.startswith(b"#!/bin/sh /etc/rc.common\n")


@pytest.mark.skipif(not BUSYBOX, reason="busybox not installed (apt-get install busybox)")
def test_procd_script_start_service(tmp_path):
    """The procd script under BusyBox sh with procd's functions stubbed:
    the spool is created and the instance is "myq supervise" with the
    settings of MYQ_DEFAULTS; reload sends SIGHUP."""
    spool = str(tmp_path / "spool")
    defaults = tmp_path / "myq.default"
    defaults.write_text("MYQ_SPOOL=%s\nMYQ_BIN=%s\nMYQ_PYTHON=%s\nMYQ_WORKERS=2\n"
                        "MYQ_ARGS='--handlers /etc/myq/handlers'\n"
                        "MYQ_LOG=%s\nMYQ_STOP_TIMEOUT=20\n"
                        % (spool, os.path.join(ROOT, "myq.py"), sys.executable,
                           tmp_path / "log" / "myq.log"))
    stub = r'''
procd_open_instance() { echo open; }
procd_close_instance() { echo close; }
procd_set_param() { printf 'param'; printf ' <%s>' "$@"; echo; }
procd_send_signal() { echo "signal $*"; }
. "$1"
start_service
reload_service
'''
    out = ok(run([BUSYBOX, "sh", "-c", stub, "sh",
                  os.path.join(ROOT, "init.d", "myq.procd")],
                 env={"MYQ_DEFAULTS": str(defaults)}))
    assert os.path.isdir(os.path.join(spool, "incoming"))
    assert (tmp_path / "log" / "myq.log").is_file()
    expect = "param <command> <%s> <%s> <--spool> <%s> <supervise> <--workers> " \
        "<2> <--handlers> </etc/myq/handlers> <--log> <%s>" % (
            sys.executable, os.path.join(ROOT, "myq.py"), spool,
            tmp_path / "log" / "myq.log")
    assert expect in out.splitlines(), out
    assert "param <term_timeout> <20>" in out
    assert "param <user> <root>" in out
    assert "signal myq * HUP" in out
    assert out.splitlines()[0] == "open" and "close" in out


@pytest.mark.skipif(not shutil.which("shellcheck"),
                    reason="shellcheck not installed (apt-get install shellcheck)")
def test_procd_script_shellcheck():
    r = run(["shellcheck", "-s", "sh", os.path.join(ROOT, "init.d", "myq.procd")])
    assert r.returncode == 0, r.stdout


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


def test_make_install_layout(tmp_path):
    repo = repo_copy(tmp_path / "repo")
    dest = tmp_path / "dest"
    make_install(repo, dest)
    got = {}
    for dirpath, _, files in os.walk(str(dest)):
        for f in files:
            p = os.path.join(dirpath, f)
            got[os.path.relpath(p, str(dest))] = stat.S_IMODE(os.stat(p).st_mode)
    assert got == LAYOUT
    assert (dest / "usr/bin/myq").read_bytes() == \
        open(os.path.join(ROOT, "myq.py"), "rb").read()
    assert (dest / "etc/init.d/myq").read_bytes() == \
        open(os.path.join(ROOT, "init.d", "myq"), "rb").read()
    # a second install keeps the operator's settings, and replaces the
    # program by a rename (a new inode: a running reader never sees a mix)
    (dest / "etc/default/myq").write_text("MYQ_WORKERS=4\n")
    inode = os.stat(str(dest / "usr/bin/myq")).st_ino
    out = make_install(repo, dest)
    assert os.stat(str(dest / "usr/bin/myq")).st_ino != inode
    assert "kept" in out
    assert (dest / "etc/default/myq").read_text() == "MYQ_WORKERS=4\n"
    assert ok(run([sys.executable, dest / "usr/bin/myq", "version"])).strip() \
        == "myq " + VERSION


def test_make_install_prefix(tmp_path):
    """PREFIX=/usr/local: the program goes to /usr/local/bin and the init
    script's MYQ_BIN default follows it."""
    repo = repo_copy(tmp_path / "repo")
    dest = tmp_path / "dest"
    make_install(repo, dest, prefix="/usr/local")
    assert (dest / "usr/local/bin/myq").is_file()
    script = (dest / "etc/init.d/myq").read_text()
    assert "BIN=${MYQ_BIN:-/usr/local/bin/myq}" in script
    assert "/usr/bin/myq}" not in script
