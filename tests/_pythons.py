"""The CPython interpreters to test myq with (CPython 3.7 - 3.13).

Every `$(pyenv root)/versions/*/bin/python3` that is CPython >= 3.7 is used,
called directly (never through the pyenv shim).  Where pyenv is absent (a CI
machine without it) only `sys.executable` is tested, and its test id says so.
"""
import glob
import os
import subprocess
import sys

MIN = (3, 7)


def pyenv_root():
    """`pyenv root`, else $PYENV_ROOT, else ~/.pyenv; None when none exists."""
    try:
        out = subprocess.run(["pyenv", "root"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, universal_newlines=True,
                             timeout=20)
        root = out.stdout.strip()
        if out.returncode == 0 and root and os.path.isdir(root):
            return root
    except (OSError, subprocess.SubprocessError):
        pass
    for root in (os.environ.get("PYENV_ROOT"), os.path.expanduser("~/.pyenv")):
        if root and os.path.isdir(os.path.join(root, "versions")):
            return root
    return None


def _probe(exe):
    """(implementation, (major, minor, micro)) of an interpreter, or None."""
    try:
        out = subprocess.run(
            [exe, "-S", "-c", "import sys; print(sys.implementation.name, "
             "*sys.version_info[:3])"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            universal_newlines=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    parts = out.stdout.split()
    if out.returncode != 0 or len(parts) != 4:
        return None
    return parts[0], tuple(int(p) for p in parts[1:])


def _discover():
    found = []
    root = pyenv_root()
    if root:
        for exe in sorted(glob.glob(os.path.join(root, "versions", "*", "bin",
                                                 "python3"))):
            info = _probe(exe)
            if info and info[0] == "cpython" and info[1][:2] >= MIN:
                found.append((info[1], exe))
    found.sort()
    if found:
        return [("py%d.%d.%d" % v, exe, v) for v, exe in found], root
    v = tuple(sys.version_info[:3])
    return [("sys.executable-py%d.%d.%d-no-pyenv" % v, sys.executable, v)], None


PYTHONS, PYENV_ROOT = _discover()
IDS = [p[0] for p in PYTHONS]


def by_minor(minor):
    """The interpreter of 3.`minor`, or None."""
    for ident, exe, v in PYTHONS:
        if v[:2] == (3, minor):
            return exe
    if tuple(sys.version_info[:2]) == (3, minor):
        return sys.executable
    return None


def start_parallel(request, tmp_path_factory, test_name, flow):
    """Start flow(python, tmp_dir) in a thread for every interpreter whose
    `test_name[ident]` test is selected; each thread drives its own
    subprocesses, so the machine's cores work in parallel.  Returns a handle
    for `result_of`.  Under pytest-xdist the tests of `test_name` must run
    in one process (`make test` uses --dist loadfile), or every process that
    runs one of them starts the flows of all."""
    import threading
    wanted = {item.callspec.params["ident"] for item in request.session.items
              if getattr(item, "originalname", None) == test_name
              and item.module is request.module}
    results = {}

    def one(ident, py):
        try:
            flow(py, tmp_path_factory.mktemp("%s-%s" % (test_name[5:], ident)))
            results[ident] = None
        except BaseException as e:      # re-raised by the test of `ident`
            results[ident] = e

    threads = [threading.Thread(target=one, args=(ident, py), daemon=True)
               for ident, py, _ in PYTHONS if ident in wanted]
    for t in threads:
        t.start()
    return threads, results


def result_of(handle, ident, timeout=600):
    """Wait for the flows; re-raise the failure of `ident`, if any."""
    threads, results = handle
    for t in threads:
        t.join(timeout)
    assert ident in results, "the flow of %s did not finish" % ident
    if results[ident] is not None:
        raise results[ident]
