"""What an operator meets, round 4 (issue 38): `check` knows when no
worker runs and when the logs go nowhere, and names an unreadable file as
such; a change of MYQ_USER gives the whole layout to the new owner; `import
myq` works after every documented install; export/import carry the policy
and the queue's name; workers under MYQ_USER look and weigh as root's.

The installs are tried the way a user would: into a tree under tmp_path,
then run by "the system's python3" -- a venv of a plain interpreter stands
for it (its own prefix, its default sys.path, no PYTHONPATH), as installing
into this machine's real site directory is not a test's to do.
"""
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from _core import ROOT, MYQ
from _pythons import pyenv_root

DIST = os.path.join(ROOT, "build", "dist.py")
BUSYBOX = shutil.which("busybox")
MAKE = shutil.which("make")


def _run(args, cwd=None, env=None, timeout=120):
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("MYQ_", "PYTHON"))}
    full.update(env or {})
    return subprocess.run([str(a) for a in args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True,
                          env=full, cwd=cwd, timeout=timeout)


def _ok(r):
    assert r.returncode == 0, "%s\n%s%s" % (r.args, r.stdout, r.stderr)
    return r.stdout


# 3. `import myq` after an install ###########################################

def _plain_python():
    """A plain CPython (not the test venv's), to make a venv of."""
    root = pyenv_root()
    for v in ("3.11.7", "3.12.1", "3.10.13", "3.9.18"):
        exe = os.path.join(root or "", "versions", v, "bin", "python3")
        if root and os.access(exe, os.X_OK):
            return exe
    base = getattr(sys, "_base_executable", None) or sys.executable
    return base


@pytest.fixture
def system_python(tmp_path):
    """A venv of a plain interpreter, standing for the system's python3:
    its prefix is tmp_path/sys, its site directory the one it reads."""
    prefix = tmp_path / "sys"
    _ok(_run([_plain_python(), "-m", "venv", "--without-pip", prefix]))
    return str(prefix), str(prefix / "bin" / "python3")


def _imports_myq(python, prefix, cwd):
    """`python3 -c 'import myq'` as a user types it: another directory, no
    PYTHONPATH, then under -I too; the module is the installed one."""
    for flags in ([], ["-I"]):
        r = _run([python] + flags + ["-c", "import myq, sys; "
                                     "sys.stdout.write(myq.__file__)"],
                 cwd=str(cwd))
        assert r.returncode == 0, "import myq failed (%s): %s" % (flags, r.stderr)
        assert r.stdout == os.path.join(prefix, "lib", "myq", "myq.py")


def _land(dest, prefix):
    """The tree staged under DESTDIR copied to where it names itself (as an
    image is flashed)."""
    staged = os.path.join(str(dest), prefix.lstrip("/"))
    for dirpath, _, files in os.walk(staged):
        rel = os.path.relpath(dirpath, staged)
        os.makedirs(os.path.join(prefix, rel), exist_ok=True)
        for f in files:
            shutil.copy2(os.path.join(dirpath, f), os.path.join(prefix, rel, f))


def _repo_copy(dst):
    for rel in ("Makefile", "myq.py", "build/dist.py", "init.d/myq",
                "init.d/myq.default", "init.d/myq.procd", "init.d/myq.config",
                "LICENSE", "build/myq.1", "build/myq-spool.5"):
        os.makedirs(os.path.join(str(dst), os.path.dirname(rel)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(str(dst), rel))
    return str(dst)


def test_import_myq_after_myq_install(tmp_path, system_python):
    """`python3 myq.py install` (the one file, run by the system's python3)
    then `python3 -c 'import myq'` anywhere: it imports the installed
    module, with no sys.path edit (SPEC 7)."""
    prefix, python = system_python
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(MYQ, str(one / "myq.py"))
    dest = tmp_path / "dest"
    dest.mkdir()
    out = _ok(_run([python, one / "myq.py", "install", "--destdir", dest,
                    "--prefix", prefix]))
    assert "myq.pth" in out
    _land(dest, prefix)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _imports_myq(python, prefix, elsewhere)


def test_import_myq_after_make_install_and_uninstall(tmp_path, system_python):
    """`make install PYTHON=python3 PREFIX=…`: `import myq` works in that
    python3; `make uninstall` takes it away again."""
    prefix, python = system_python
    repo = _repo_copy(tmp_path / "repo")
    dest = tmp_path / "dest"
    if MAKE:
        args = [MAKE, "-C", repo, "install", "DESTDIR=%s" % dest,
                "PREFIX=" + prefix, "PYTHON=" + python]
    else:
        args = [python, os.path.join(repo, "build", "dist.py"), "--install",
                dest, "--prefix", prefix]
    _ok(_run(args))
    _land(dest, prefix)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _imports_myq(python, prefix, elsewhere)
    _ok(_run([python, os.path.join(repo, "build", "dist.py"), "--uninstall",
              dest, "--prefix", prefix]))
    pth = [os.path.join(d, f) for d, _, fs in os.walk(str(dest)) for f in fs
           if f == "myq.pth"]
    assert pth == []


@pytest.mark.skipif(not BUSYBOX, reason="busybox not installed")
def test_ipk_postinst_makes_myq_importable(tmp_path):
    """The OpenWrt package's postinst writes myq.pth (naming /usr/lib/myq)
    into the device's python3.X/site-packages, whatever X is, also while a
    firmware image is built (IPKG_INSTROOT); prerm removes it."""
    _ok(_run([sys.executable, DIST, "--out", tmp_path / "dist"]))
    ipk = [f for f in os.listdir(str(tmp_path / "dist")) if f.endswith(".ipk")][0]
    with open(str(tmp_path / "dist" / ipk), "rb") as f:
        data = f.read()
    # ar: "!<arch>\n", then 60-byte headers
    pos, parts = 8, {}
    while pos < len(data):
        name = data[pos:pos + 16].decode().strip().rstrip("/")
        size = int(data[pos + 48:pos + 58].decode())
        parts[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
    scripts = {}
    with tarfile.open(fileobj=io.BytesIO(parts["control.tar.gz"])) as t:
        for name in ("postinst", "prerm"):
            path = str(tmp_path / name)
            with open(path, "wb") as f:
                f.write(t.extractfile("./" + name).read())
            scripts[name] = path
    root = tmp_path / "root"
    site = root / "usr" / "lib" / "python3.11"
    site.mkdir(parents=True)
    env = {"IPKG_INSTROOT": str(root)}
    _ok(_run([BUSYBOX, "sh", scripts["postinst"], "configure"], env=env))
    pth = site / "site-packages" / "myq.pth"
    assert pth.read_text() == "/usr/lib/myq\n"
    # that line is what a site directory's .pth means: the path is added
    lib = tmp_path / "usr-lib-myq"
    lib.mkdir()
    shutil.copy(MYQ, str(lib / "myq.py"))
    check = tmp_path / "check"
    check.mkdir()
    (check / "myq.pth").write_text(str(lib) + "\n")
    r = _ok(_run([sys.executable, "-c", "import site, sys; site.addsitedir(%r); "
                  "import myq; sys.stdout.write(myq.__file__)" % str(check)],
                 cwd=str(tmp_path)))
    assert r == str(lib / "myq.py")
    _ok(_run([BUSYBOX, "sh", scripts["prerm"], "remove"], env=env))
    assert not pth.exists()
