"""An installed `myq` command's start: what it reads, makes and leaves
behind, so that a `myq enqueue` costs little more than the interpreter's
own start.

- The byte code an install writes (`myq install`, build/dist.py's
  `make install`) is hash-based and unchecked (PEP 552): the import
  trusts it without reading myq.py (a checked one read and hashed the
  whole source at every start: 2.5 M instructions, 1 in 23 of a
  `myq enqueue`), whatever the source's mtime becomes in an image.  So a
  source the install did not write is not what runs: the byte code the
  install compiled is, until the next install.
- The launcher exits by myq.end(myq.main()): the atexit functions run and
  standard output and error are flushed, as at the interpreter's exit,
  then os._exit, without the teardown that frees what the import made
  (2.9 M instructions a start).  So main closes the store it opened for
  its own process too (a SQLite store's connection: its WAL checkpointed
  and removed, as the finalizer did).  Where that cannot be (another
  thread still running, a status that is no number, a flush that fails)
  it is sys.exit, the interpreter's own exit.
- The classes a `myq enqueue` on a spool of files never uses (the SQLite
  store's, the RAM tier's, HTTP's, intake's, the worker's parts) are made
  at their first use, not at import (~60 k instructions each); until
  then a stand-in takes the class's name and is the class to a call, an
  attribute, isinstance, a subclass statement, monkeypatch.
"""
import os
import subprocess
import sys

import pytest

from _core import MYQ, ROOT

TAG = sys.implementation.cache_tag
DIST = os.path.join(ROOT, "build", "dist.py")


def _myq_install(tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    subprocess.run([sys.executable, MYQ, "install", "--destdir", str(dest),
                    "--prefix", "/usr"], check=True, stdout=subprocess.DEVNULL)
    return dest / "usr"


def _dist_install(tmp_path):
    dest = tmp_path / "dest"
    subprocess.run([sys.executable, DIST, "--install", str(dest), "--prefix",
                    "/usr"], check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return dest / "usr"


@pytest.mark.skipif(not TAG, reason="this Python caches no byte code")
@pytest.mark.parametrize("how", [_myq_install, _dist_install],
                         ids=["myq-install", "make-install"])
def test_installed_bytecode_is_trusted_without_its_source(tmp_path, how):
    prefix = how(tmp_path)
    lib = prefix / "lib" / "myq"
    pyc = lib / "__pycache__" / ("myq.%s.pyc" % TAG)
    with open(str(pyc), "rb") as f:
        head = f.read(16)
    # PEP 552's flags word: bit 0 hash-based, bit 1 check_source
    assert int.from_bytes(head[4:8], "little") == 0b01
    # a source the install did not write: Python never reads it (a checked
    # .pyc would be found stale, myq.py compiled and this line run)
    with open(str(lib / "myq.py"), "a") as f:
        f.write("\nraise SystemExit('the source was read')\n")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, "
                        "%r); import myq; print(myq.__version__)" % str(lib)],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def _run_end(body, tmp_path):
    """A process that imports myq (this tree's) and runs `body`."""
    prog = tmp_path / "prog.py"
    prog.write_text("import sys, atexit, threading, time\n"
                    "sys.path.insert(0, %r)\nimport myq\n"
                    "class Teardown(object):\n"
                    "    def __del__(self):\n"
                    "        sys.stdout.write('teardown\\n')\n"
                    "        sys.stdout.flush()\n"
                    "kept = Teardown()\n" % ROOT + body)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, str(prog)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True)


def test_end_is_the_exit_without_the_teardown(tmp_path):
    r = _run_end("atexit.register(lambda: sys.stdout.write('atexit\\n'))\n"
                 "sys.stdout.write('out ')\nsys.stderr.write('err ')\n"
                 "myq.end(3)\n", tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out atexit\n", "err ")
    r = _run_end("sys.stdout.write('out')\nmyq.end(None)\n", tmp_path)
    assert (r.returncode, r.stdout) == (0, "out")


def test_end_is_the_interpreters_exit_where_it_must_be(tmp_path):
    # another thread still running: it is waited for, as by sys.exit
    r = _run_end("t = threading.Thread(target=lambda: (time.sleep(0.3), "
                 "sys.stdout.write('thread\\n')))\nt.start()\n"
                 "myq.end(4)\n", tmp_path)
    assert r.returncode == 4 and r.stdout.startswith("thread\n"), r
    # a status that is no number: said on stderr, exit status 1
    r = _run_end("myq.end('myq: said')\n", tmp_path)
    assert (r.returncode, r.stderr) == (1, "myq: said\n")
    assert "teardown" in r.stdout


def test_installed_command_leaves_its_store_closed(tmp_path):
    """The installed `myq enqueue` on a spool of the SQLite store: the
    connection closed by main (nothing is left to a finalizer), so the
    WAL is checkpointed and gone, as it was when the teardown closed it."""
    pytest.importorskip("sqlite3")
    prefix = _myq_install(tmp_path)
    launcher = prefix / "bin" / "myq"
    lib = prefix / "lib" / "myq"
    launcher.write_text(launcher.read_text().replace(repr("/usr/lib/myq"),
                                                     repr(str(lib))))
    assert launcher.read_text().rstrip().endswith("myq.end(myq.main())")
    spool = str(tmp_path / "spool")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)

    def myq_(*words):
        return subprocess.run([sys.executable, str(launcher), "--spool", spool]
                              + list(words), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True)
    assert myq_("init", "--store", "sqlite").returncode == 0
    r = myq_("enqueue", "t", '{"n": 1}')
    assert r.returncode == 0 and r.stdout.strip() and r.stderr == "", r
    assert not os.path.exists(os.path.join(spool, "queue.db-wal"))
    r = myq_("show", r.stdout.strip())
    assert r.returncode == 0 and '"state": "ready"' in r.stdout, r
    r = myq_("enqueue", "bad name!", "1")
    assert r.returncode == 65 and r.stderr.startswith("myq: "), r
