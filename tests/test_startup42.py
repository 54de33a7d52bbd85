"""An installed `myq` command's start (issue 42, item 3: installed, at most
1.5x a bare interpreter's instructions).

- The byte code an install writes (`myq install`, build/dist.py's
  `make install`) is hash-based and unchecked (PEP 552): the import
  trusts it without reading myq.py (a checked one read and hashed the
  whole source at every start: 2.5 M instructions, 1 in 23 of a
  `myq enqueue`), whatever the source's mtime becomes in an image.  So a
  source the install did not write is not what runs: the byte code the
  install compiled is, until the next install.
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
