#!/usr/bin/env python3
"""Build myq's release files, or install myq into a file system tree.

    python3 build/dist.py [--out DIR]          (make dist)
    python3 build/dist.py --install DESTDIR [--prefix /usr]   (make install)

`make dist` writes, into dist/ (or --out):

- myq-VERSION.tar.gz: unpacks onto / (`tar -xzf myq-VERSION.tar.gz -C /`) as
  usr/bin/myq (mode 755), etc/init.d/myq (755), etc/default/myq (644);
- myq_VERSION_all.ipk: an OpenWrt package (ar archive of debian-binary,
  control.tar.gz, data.tar.gz) with the procd init script as
  /etc/init.d/myq and /etc/default/myq as a conffile;
- SHA256SUMS: `sha256sum -c SHA256SUMS` checks both.

VERSION is myq.__version__, read from the source (not imported). The
archives are reproducible: sorted members, owner root:root (0:0), every
mtime SOURCE_DATE_EPOCH (default 2000-01-01), tar headers written here (the
same bytes from every Python version), gzip without name or time.

`make install` copies the three files under DESTDIR (default /): PREFIX/bin/myq,
/etc/init.d/myq (its MYQ_BIN default follows PREFIX), and /etc/default/myq
only when there is none yet (the operator's settings are kept). Each file
is written aside and renamed into place, so running programs never see a
half-written file. Standard library only.
"""
import argparse
import gzip
import hashlib
import io
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_EPOCH = 946684800           # 2000-01-01T00:00:00Z

# (source in the repository, path in the archive, mode)
FILES = [
    ("myq.py", "usr/bin/myq", 0o755),
    ("init.d/myq", "etc/init.d/myq", 0o755),
    ("init.d/myq.default", "etc/default/myq", 0o644),
]
IPK_FILES = [
    ("myq.py", "usr/bin/myq", 0o755),
    ("init.d/myq.procd", "etc/init.d/myq", 0o755),
    ("init.d/myq.default", "etc/default/myq", 0o644),
]
CONFFILES = ["/etc/default/myq"]

POSTINST = """#!/bin/sh
[ "${IPKG_NO_SCRIPT}" = "1" ] && exit 0
[ -s "${IPKG_INSTROOT}/lib/functions.sh" ] || exit 0
. "${IPKG_INSTROOT}/lib/functions.sh"
default_postinst "$0" "$@"
"""
PRERM = """#!/bin/sh
[ -s "${IPKG_INSTROOT}/lib/functions.sh" ] || exit 0
. "${IPKG_INSTROOT}/lib/functions.sh"
default_prerm "$0" "$@"
"""


def version(root=ROOT):
    """myq.__version__, parsed from myq.py."""
    with open(os.path.join(root, "myq.py"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    if not m:
        raise SystemExit("dist: no __version__ = \"…\" line in myq.py")
    return m.group(1)


def epoch():
    raw = os.environ.get("SOURCE_DATE_EPOCH", "")
    try:
        return int(raw) if raw else DEFAULT_EPOCH
    except ValueError:
        raise SystemExit("dist: SOURCE_DATE_EPOCH must be whole seconds, not %r"
                         % raw)


def read(rel, root=ROOT):
    with open(os.path.join(root, rel), "rb") as f:
        return f.read()


def tar_header(name, size, mode, mtime, dir=False):
    """One ustar header block, written here rather than by tarfile, whose
    output differs between Python versions (devmajor fields)."""
    if len(name) > 99:
        raise ValueError("tar member name too long: " + name)

    def num(value, width):
        return ("%0*o" % (width - 1, value)).encode("ascii") + b"\0"

    head = b"".join([
        name.encode("utf-8").ljust(100, b"\0"), num(mode, 8), num(0, 8),
        num(0, 8), num(size, 12), num(mtime, 12), b" " * 8,
        b"5" if dir else b"0", b"\0" * 100, b"ustar\x0000",
        b"root".ljust(32, b"\0"), b"root".ljust(32, b"\0"),
        num(0, 8), num(0, 8), b"\0" * 155]).ljust(512, b"\0")
    chksum = ("%06o" % sum(head)).encode("ascii") + b"\0 "
    return head[:148] + chksum + head[156:]


def targz(members, mtime, dirs=False, prefix=""):
    """A reproducible .tar.gz: members is [(name, bytes, mode)]. With dirs,
    directory entries are added for every parent (packages want them; a
    tarball meant for `tar -C /` must not carry /etc's or /usr's mode)."""
    entries = {}
    for name, data, mode in members:
        entries[prefix + name] = (data, mode)
        if dirs:
            parts = name.split("/")[:-1]
            for i in range(len(parts)):
                entries.setdefault(prefix + "/".join(parts[:i + 1]) + "/",
                                   (None, 0o755))
    if dirs and prefix:
        entries.setdefault(prefix, (None, 0o755))
    blocks = []
    for name in sorted(entries):
        data, mode = entries[name]
        if data is None:
            blocks.append(tar_header(name, 0, mode, mtime, dir=True))
        else:
            blocks.append(tar_header(name, len(data), mode, mtime))
            blocks.append(data + b"\0" * (-len(data) % 512))
    raw = b"".join(blocks) + b"\0" * 1024
    raw += b"\0" * (-len(raw) % 10240)         # whole records, as tar(1) does
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0,
                       compresslevel=9) as gz:
        gz.write(raw)
    return out.getvalue()


def ar(members, mtime):
    """A System V / GNU `ar` archive, as dpkg and opkg read it."""
    out = [b"!<arch>\n"]
    for name, data in members:
        if len(name) > 15:
            raise ValueError("ar member name too long: " + name)
        out.append(("%-16s%-12d%-6d%-6d%-8o%-10d`\n" % (
            name, mtime, 0, 0, 0o100644, len(data))).encode("ascii"))
        out.append(data)
        if len(data) % 2:
            out.append(b"\n")
    return b"".join(out)


def tarball(ver, mtime, root=ROOT):
    return targz([(dst, read(src, root), mode) for src, dst, mode in FILES],
                 mtime)


def ipk(ver, mtime, root=ROOT):
    files = [(dst, read(src, root), mode) for src, dst, mode in IPK_FILES]
    size = sum(len(d) for _, d, _ in files)
    control = "".join("%s: %s\n" % kv for kv in [
        ("Package", "myq"),
        ("Version", ver),
        ("Depends", "python3-light"),
        ("Source", "myq"),
        ("Section", "utils"),
        ("Architecture", "all"),
        ("Installed-Size", str(size)),
        ("Description", "job queue worker for small Linux devices: one spool "
                        "directory, one file per job"),
    ]).encode("utf-8")
    ctl = targz([("control", control, 0o644),
                 ("conffiles", "".join(c + "\n" for c in CONFFILES).encode(), 0o644),
                 ("postinst", POSTINST.encode(), 0o755),
                 ("prerm", PRERM.encode(), 0o755)], mtime, dirs=True, prefix="./")
    data = targz(files, mtime, dirs=True, prefix="./")
    return ar([("debian-binary", b"2.0\n"), ("control.tar.gz", ctl),
               ("data.tar.gz", data)], mtime)


def write(path, data, mode=0o644):
    """Write aside, then rename into place."""
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.rename(tmp, path)


def dist(out, root=ROOT):
    ver = version(root)
    mtime = epoch()
    made = [("myq-%s.tar.gz" % ver, tarball(ver, mtime, root)),
            ("myq_%s_all.ipk" % ver, ipk(ver, mtime, root))]
    sums = []
    for name, data in made:
        write(os.path.join(out, name), data)
        sums.append("%s  %s\n" % (hashlib.sha256(data).hexdigest(), name))
    write(os.path.join(out, "SHA256SUMS"), "".join(sums).encode("ascii"))
    for name, _ in made:
        print(os.path.join(out, name))
    print(os.path.join(out, "SHA256SUMS"))
    return 0


def install(destdir, prefix, root=ROOT):
    top = destdir or "/"
    if not prefix.startswith("/"):
        raise SystemExit("dist: --prefix must be absolute, not %r" % prefix)
    binpath = os.path.join(prefix, "bin", "myq")
    script = read("init.d/myq", root)
    default_bin = b"BIN=${MYQ_BIN:-/usr/bin/myq}"
    if default_bin not in script:
        raise SystemExit("dist: init.d/myq has no %s line" % default_bin.decode())
    script = script.replace(default_bin, ("BIN=${MYQ_BIN:-%s}" % binpath).encode())

    def at(path):
        return os.path.join(top, path.lstrip("/"))

    write(at(binpath), read("myq.py", root), 0o755)
    print(at(binpath))
    write(at("/etc/init.d/myq"), script, 0o755)
    print(at("/etc/init.d/myq"))
    conf = at("/etc/default/myq")
    if os.path.exists(conf):
        print("%s kept (the shipped example is init.d/myq.default)" % conf)
    else:
        write(conf, read("init.d/myq.default", root), 0o644)
        print(conf)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "dist"),
                   help="where release files go (default: dist/)")
    p.add_argument("--install", metavar="DESTDIR", default=None,
                   help="install into DESTDIR instead ('' means /)")
    p.add_argument("--prefix", default="/usr", help="default /usr")
    a = p.parse_args(argv)
    if a.install is not None:
        return install(a.install, a.prefix)
    return dist(a.out)


if __name__ == "__main__":
    sys.exit(main())
