"""The worker runs as MYQ_USER; producers may be root (root or not).

`myq enqueue` as root hands each file to the spool's owner; a file the
worker cannot open is quarantined with a reason, never left in processing/.
"""
import json
import os
import pwd
import subprocess
import sys

import pytest

from _core import MYQ, clean_env, ls, world_python, write_incoming

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root to run a worker as another user")


@pytest.fixture
def nobody():
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")




def as_user(pw, myq_copy, *args):
    def drop():
        os.setgid(pw.pw_gid)
        os.setgroups([])
        os.setuid(pw.pw_uid)
    python = world_python()
    if python is None:
        pytest.skip("no python3 that another user may run")
    return subprocess.run([python, myq_copy] + list(args), preexec_fn=drop,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, env=clean_env(), timeout=60)


@pytest.fixture
def base():
    import pathlib
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="myq-own-")     # traversable by another user
    os.chmod(d, 0o755)
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_root_enqueue_into_a_users_spool(base, nobody, handlers_dir):
    spool = str(base / "spool")
    cp = subprocess.run([sys.executable, MYQ, "--spool", spool, "init", "--owner", "nobody"],
                        stderr=subprocess.PIPE, universal_newlines=True)
    assert cp.returncode == 0, cp.stderr
    import shutil
    myq_copy = str(base / "myq.py")
    shutil.copy(MYQ, myq_copy)
    os.chmod(myq_copy, 0o755)
    hdir = str(base / "handlers")
    os.mkdir(hdir, 0o755)
    with open(os.path.join(hdir, "t"), "w") as f:
        f.write("#!/bin/sh\ncat >/dev/null\n")
    os.chmod(os.path.join(hdir, "t"), 0o755)
    cp = subprocess.run([sys.executable, MYQ, "--spool", spool, "enqueue", "t", "1",
                         "--id", "from-root"], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, universal_newlines=True)
    assert cp.returncode == 0, cp.stderr
    st = os.stat(os.path.join(spool, "incoming", "from-root.json"))
    assert st.st_uid == nobody.pw_uid       # handed over
    # A root shell producer that forgot to chown: quarantined, with the reason.
    write_incoming(spool, "raw.json", {"type": "t"})
    os.chmod(os.path.join(spool, "incoming", "raw.json"), 0o600)
    cp = as_user(nobody, myq_copy, "--spool", spool, "worker", "--drain", "--handlers", hdir,
                 "--poll", "0.05")
    assert cp.returncode == 0, cp.stderr
    assert ls(spool, "done") == ["from-root.json"]
    assert ls(spool, "processing") == []
    assert "raw.json" in ls(spool, "failed")
    with open(os.path.join(spool, "failed", "raw.json.reason")) as f:
        assert "permission denied" in f.read()
    cp = as_user(nobody, myq_copy, "--spool", spool, "list", "failed", "--json")
    assert [json.loads(l)["id"] for l in cp.stdout.splitlines()] == ["raw"]


def test_a_producer_in_the_spools_group_enqueues_with_myq(base, nobody, handlers_dir):
    """The README's producer setup: the spool's owner is `nobody`, tmp/ and
    incoming/ are group-writable (g+ws) for the spool's group, and a
    producer (another uid, in that group) runs `myq enqueue`: its file is
    group-writable (0660), so the owner's worker can append its lease and
    run the job (it used to be 0640 and quarantined)."""
    import grp
    import shutil
    spool = str(base / "spool")
    group = grp.getgrgid(nobody.pw_gid).gr_name
    cp = subprocess.run([sys.executable, MYQ, "--spool", spool, "init", "--owner",
                         "nobody:%s" % group], stderr=subprocess.PIPE,
                        universal_newlines=True)
    assert cp.returncode == 0, cp.stderr
    for sub in ("", "tmp", "incoming"):
        os.chmod(os.path.join(spool, sub), 0o2770 if sub else 0o750)
    os.chmod(os.path.join(spool, "locks", "wake"), 0o660)
    myq_copy = str(base / "myq.py")
    shutil.copy(MYQ, myq_copy)
    os.chmod(myq_copy, 0o755)
    python = world_python()
    if python is None:
        pytest.skip("no python3 that another user may run")
    producer_uid = 54321                    # no passwd entry needed

    def as_producer():
        os.setgroups([nobody.pw_gid])       # a member of the spool's group
        os.setgid(nobody.pw_gid)
        os.setuid(producer_uid)
    cp = subprocess.run([python, myq_copy, "--spool", spool, "enqueue", "t", "1",
                         "--id", "from-producer"], preexec_fn=as_producer,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        universal_newlines=True, env=clean_env(), timeout=60)
    assert cp.returncode == 0, cp.stderr
    st = os.stat(os.path.join(spool, "incoming", "from-producer.json"))
    assert st.st_uid == producer_uid and st.st_mode & 0o777 == 0o660, oct(st.st_mode)
    hdir = str(base / "handlers")
    os.mkdir(hdir, 0o755)
    with open(os.path.join(hdir, "t"), "w") as f:
        f.write("#!/bin/sh\ncat >/dev/null\n")
    os.chmod(os.path.join(hdir, "t"), 0o755)
    cp = as_user(nobody, myq_copy, "--spool", spool, "worker", "--drain",
                 "--handlers", hdir, "--poll", "0.05")
    assert cp.returncode == 0, cp.stderr
    assert ls(spool, "done") == ["from-producer.json"], ls(spool, "failed")
