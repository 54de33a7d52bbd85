"""The one-file copy (`cp myq.py /usr/bin/myq`) is
compiled at every command, all of it, before its first line runs (a
script's byte code is never cached; bench/device.py: ~60 MB and ~17x the
instructions of the installed layout, on every CPython 3.7-3.13), so it
says once what makes it cheap: `myq install` (README: Install).

Once per user, on a terminal only, remembered by ~/.cache/myq/install-hint
(or $XDG_CACHE_HOME's); never where that file cannot be made or its
directories are not the user's alone; never from the installed layout,
whose launcher imports myq.py from its byte code.  Standard error is a
pseudo-terminal here (pty), as it is for a user at a shell.
"""
import os
import pty
import shutil
import subprocess
import sys

import pytest

from _core import MYQ, clean_env
from _pythons import IDS, PYTHONS

HINT = b"lays myq out to start from byte code"


def on_tty(argv, env, cwd=None):
    """Run argv with standard error a terminal -> (status, stdout, stderr)."""
    master, slave = pty.openpty()
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=slave,
                           stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                           timeout=120)
    finally:
        os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:                 # EIO: the terminal's other end closed
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    return p.returncode, p.stdout, err


def home_env(home, **extra):
    env = clean_env(dict(HOME=str(home)))
    env.pop("XDG_CACHE_HOME", None)
    env.update(extra)
    return env


@pytest.fixture
def copy(tmp_path):
    """The one-file copy, as a user makes it: bin/myq, mode 755."""
    os.mkdir(str(tmp_path / "bin"))
    path = str(tmp_path / "bin" / "myq")
    shutil.copyfile(MYQ, path)
    os.chmod(path, 0o755)
    home = tmp_path / "home"
    home.mkdir()
    return path, home


@pytest.mark.parametrize("ident,python", [(i, p[1]) for i, p in zip(IDS, PYTHONS)],
                         ids=IDS)
def test_hint_once_per_user(copy, ident, python):
    path, home = copy
    status, out, err = on_tty([python, path, "version"], home_env(home))
    assert status == 0 and out.startswith(b"myq "), (out, err)
    assert HINT in err and path.encode() in err, err
    assert err.count(b"\n") == 1, err           # one line
    marker = home / ".cache" / "myq" / "install-hint"
    assert marker.exists()
    assert (os.stat(str(marker.parent)).st_mode & 0o777) == 0o700
    status, out, err = on_tty([python, path, "version"], home_env(home))
    assert status == 0 and out.startswith(b"myq ") and err == b"", err


def test_xdg_cache_home(copy, tmp_path):
    path, home = copy
    cache = tmp_path / "cache"
    status, _, err = on_tty([sys.executable, path, "version"],
                            home_env(home, XDG_CACHE_HOME=str(cache)))
    assert status == 0 and HINT in err
    assert (cache / "myq" / "install-hint").exists()
    assert not (home / ".cache").exists()


def test_no_hint_without_a_terminal(copy):
    """A script's or cron's standard error: nothing said, nothing
    remembered (the one hint is kept for a person)."""
    path, home = copy
    p = subprocess.run([sys.executable, path, "version"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=home_env(home))
    assert p.returncode == 0 and p.stderr == b""
    assert not (home / ".cache").exists()


def test_installed_layout_says_nothing(copy, tmp_path):
    """`install` itself does not hint, and the launcher it writes, which
    imports myq.py from byte code, never does."""
    path, home = copy
    root = tmp_path / "root"
    root.mkdir()
    status, _, err = on_tty([sys.executable, path, "install", "--destdir", str(root),
                             "--prefix", "/usr"], home_env(home))
    assert status == 0 and HINT not in err, err
    launcher = root / "usr" / "bin" / "myq"
    lib = str(root / "usr" / "lib" / "myq")
    launcher.write_text(launcher.read_text().replace(repr("/usr/lib/myq"), repr(lib)))
    status, out, err = on_tty([sys.executable, str(launcher), "version"], home_env(home))
    assert status == 0 and out.startswith(b"myq ") and err == b"", err
    assert not (home / ".cache").exists()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown "
                                "to another user)")


@needs_root
@pytest.mark.parametrize("case", ["foreign", "symlink", "group-writable",
                                  "foreign-home"])
def test_directories_not_ours_alone_are_refused(copy, tmp_path, case):
    """A cache directory another user owns or could write, or a symlink
    (root must not create files where another user points it), or a HOME
    that is another user's (sudo kept it): no hint, nothing made."""
    path, home = copy
    cache = home / ".cache"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if case == "foreign-home":
        os.chown(str(home), 65534, 65534)
    else:
        cache.mkdir()
        if case == "symlink":
            os.symlink(str(elsewhere), str(cache / "myq"))
        else:
            (cache / "myq").mkdir()
            if case == "foreign":
                os.chown(str(cache / "myq"), 65534, 65534)
            else:
                os.chmod(str(cache / "myq"), 0o770)
    status, out, err = on_tty([sys.executable, path, "version"], home_env(home))
    assert status == 0 and out.startswith(b"myq ") and err == b"", err
    assert not (cache / "myq" / "install-hint").exists()
    assert os.listdir(str(elsewhere)) == []
    assert case != "foreign-home" or not cache.exists()


def test_the_program_freezes_what_its_import_made(tmp_path):
    """main() run for the process's own command line (the launcher, the
    script) puts what the import made out of the collector's reach (gc.
    freeze: its full collections and the exit's stop walking ~1,000
    functions and their classes); main(argv) called by a program leaves
    that program's collector alone."""
    code = ("import gc, sys; sys.path.insert(0, %r); import myq\n"
            "sys.argv = ['myq', 'version']\n"
            "assert gc.get_freeze_count() == 0\n"
            "myq.main(%s)\n"
            "sys.stderr.write('frozen=%%d' %% gc.get_freeze_count())\n")
    root = os.path.dirname(MYQ)
    for argv, frozen in (("", True), ("['version']", False)):
        p = subprocess.run([sys.executable, "-c", code % (root, argv)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=clean_env(), universal_newlines=True)
        assert p.returncode == 0, p.stderr
        count = int(p.stderr.rsplit("frozen=", 1)[1])
        assert (count > 1000) == frozen, (argv, count)


FAKE_MYQ = """\
import gc, sys
AT_IMPORT = gc.isenabled()


def main():
    sys.stdout.write("import=%s main=%s" % (AT_IMPORT, gc.isenabled()))
    return 0


def end(status):
    sys.exit(status)
"""


def test_launcher_loads_myq_with_no_collection(tmp_path):
    """`myq install`'s launcher (build/dist.py's, word for word) loads the
    module with the collector off (unmarshalling ~1,000 functions set off
    collections worth 6 in 100 of a `myq enqueue`) and runs main() with it
    on again."""
    import myq
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "myq.py").write_text(FAKE_MYQ)
    launcher = tmp_path / "launcher"
    launcher.write_text(myq._LAUNCHER % {"lib": str(lib)})
    p = subprocess.run([sys.executable, str(launcher)], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=clean_env(),
                       universal_newlines=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "import=False main=True"
