#!/usr/bin/env python3
"""Build myq's release files, or install myq into a file system tree.

    python3 build/dist.py [--out DIR]          (make dist)
    python3 build/dist.py --install DESTDIR [--prefix /usr]   (make install)
    python3 build/dist.py --uninstall DESTDIR [--prefix /usr] (make uninstall)
    python3 build/dist.py --embed    (make embed: init.d/ into myq.py)
    python3 build/dist.py --docs     (make docs: myq.py's init settings out)

`make dist` writes, into dist/ (or --out):

- myq-VERSION.tar.gz: unpacks onto / (`tar -xzf myq-VERSION.tar.gz -C /`) as
  usr/lib/myq/myq.py (mode 644: myq.py itself, unchanged), usr/bin/myq (755:
  the launcher, below), etc/init.d/myq (755), etc/default/myq (644), and
  the documentation (644): usr/share/man/man1/myq.1,
  usr/share/man/man5/myq-spool.5 (build/, roff),
  usr/share/doc/myq/LICENSE, and the OpenWrt files for whoever installs
  from the tarball there: usr/share/doc/myq/myq.procd (the procd init
  script) and usr/share/doc/myq/myq.config (its UCI settings). Not as
  etc/config/myq: the tarball's /etc/init.d/myq is the SysV script, which
  reads /etc/default/myq, and a /etc/config/myq beside it would be
  settings that nothing reads;
- myq_VERSION_all.ipk: an OpenWrt package (ar archive of debian-binary,
  control.tar.gz, data.tar.gz) with the same program files, the procd init
  script as /etc/init.d/myq and its UCI settings (init.d/myq.config) as
  /etc/config/myq, a conffile (opkg keeps the operator's edits). No
  /etc/default/myq: the procd script reads UCI only; the postinst says so
  when an older package left one behind. Its postinst compiles myq.py on
  the device and writes myq.pth (naming /usr/lib/myq, so that `import myq`
  works) into the site-packages of each python3.X beside the device's
  python3 (/usr/lib/python3.X); its prerm removes both. No manual pages and no
  LICENSE file (OpenWrt ships no man(1), and flash is scarce): its control
  file says `License: MIT`;
- SHA256SUMS: `sha256sum -c SHA256SUMS` checks both.

Why a launcher: Python compiles a script (`python3 /usr/bin/myq` when that
file is myq.py) from source on every run, but caches the bytecode of an
imported module in __pycache__/. PREFIX/bin/myq is a few lines that put
PREFIX/lib/myq first on sys.path, `import myq` and exit with myq.main():
a `myq enqueue` process then costs about 1.3x a bare `python3 -I -c 'import
json'` instead of 2x (see README, Install). It imports nothing but sys, and
it does not depend on sys.path[0] (`python3 -I` leaves the script's
directory out of it on 3.11+). Copying myq.py alone to /usr/bin/myq still
works; it is only slower to start.

The tarball carries no bytecode and no myq.pth (it cannot know the
target's Python): `myq install` after unpacking writes both (the first run
as root writes /usr/lib/myq/__pycache__/ too). Its member times are all
SOURCE_DATE_EPOCH, and Python checks a cached .pyc by the source's mtime and
size only, so an upgrade over an old tarball must remove that directory
(README says so); the ipk's postinst does.

VERSION is myq.__version__, read from the source (not imported). The
archives are reproducible: sorted members, owner root:root (0:0), every
mtime SOURCE_DATE_EPOCH (default 2000-01-01), tar headers written here (the
same bytes from every Python version), gzip without name or time.

`make install` writes under DESTDIR (default /): PREFIX/lib/myq/myq.py,
PREFIX/lib/myq/__pycache__/myq.TAG.pyc compiled by the installing
interpreter (TAG: its sys.implementation.cache_tag, e.g. cpython-311; other
versions' stale ones are removed), PREFIX/bin/myq (the launcher, naming
PREFIX/lib/myq: the path on the target, without DESTDIR), myq.pth naming
PREFIX/lib/myq in the installing interpreter's site directory under PREFIX
(site_dir: so that the target's python3 can `import myq`), /etc/init.d/myq
(its MYQ_BIN default follows PREFIX), and /etc/default/myq only when there
is none yet (the operator's settings are kept), and the documentation:
PREFIX/share/man/man1/myq.1, PREFIX/share/man/man5/myq-spool.5,
PREFIX/share/doc/myq/LICENSE, myq.procd and myq.config (the OpenWrt
init script and its UCI settings, as examples). The .pyc is hash-based and
unchecked (PEP 552): valid whatever myq.py's mtime becomes in an image
(Buildroot and Yocto may reset file times), and never checked against the
source, which only an install replaces, with it (checked, every start read
and hashed the whole source: 1 in 23 of a `myq enqueue`'s instructions); build
with the target's Python version, or it is ignored and the target compiles
myq.py itself. Each file is written aside and renamed into place, so running
programs never see a half-written file.

`make uninstall` (same DESTDIR and PREFIX) removes what `make install`
wrote: the program files, every myq.*.pyc beside the module, the init
script, the documentation, the directories that are myq's own
(PREFIX/lib/myq and its __pycache__, PREFIX/share/doc/myq) when nothing else
is left in them, and /etc/default/myq only while it is the shipped example
unchanged (an operator's settings are kept, and it says so). It stops no
running service. Standard library only; runs on CPython 3.7+.
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

LIB = "lib/myq"         # under PREFIX: myq.py and its __pycache__/
DOC = "share/doc/myq"   # under PREFIX: LICENSE, the OpenWrt files

# Documentation: (source in the repository, path under PREFIX, mode). In the
# tarball and `make install`, never in the ipk.
DOCS = [
    ("build/myq.1", "share/man/man1/myq.1", 0o644),
    ("build/myq-spool.5", "share/man/man5/myq-spool.5", 0o644),
    ("LICENSE", DOC + "/LICENSE", 0o644),
    ("init.d/myq.procd", DOC + "/myq.procd", 0o644),
    ("init.d/myq.config", DOC + "/myq.config", 0o644),
]
LICENSE = "MIT"
MAINTAINER = "myq authors <myq@localhost>"

# The program a user runs. %(lib)s is PREFIX/lib/myq as a Python literal.
LAUNCHER = """#!/usr/bin/env python3
# myq launcher: runs %(lib)s/myq.py as a module, so that Python keeps its
# compiled bytecode in __pycache__/ there (a script is compiled again on
# every run). Installed by myq's build/dist.py; imports nothing but sys and
# gc: no collection runs while the module loads (its ~1,000 functions cost
# 3 M instructions of collections a start, 6 in 100 of a `myq enqueue`),
# and myq.end exits without the teardown of what it loaded (2.9 M more).
import gc
import sys
gc.disable()
sys.path.insert(0, %(lib)r)
import myq
gc.enable()
myq.end(myq.main())
"""

# (source in the repository, or None for the launcher; path in the archive,
# mode)
FILES = [
    (None, "usr/bin/myq", 0o755),
    ("myq.py", "usr/" + LIB + "/myq.py", 0o644),
    ("init.d/myq", "etc/init.d/myq", 0o755),
    ("init.d/myq.default", "etc/default/myq", 0o644),
] + [(src, "usr/" + dst, mode) for src, dst, mode in DOCS]
IPK_FILES = [
    (None, "usr/bin/myq", 0o755),
    ("myq.py", "usr/" + LIB + "/myq.py", 0o644),
    ("init.d/myq.procd", "etc/init.d/myq", 0o755),
    ("init.d/myq.config", "etc/config/myq", 0o644),
]
CONFFILES = ["/etc/config/myq"]

# Bytecode is compiled on the device, for its python3 (python3-light may lack
# compileall and py_compile: importing the module writes it). An old version's cache goes
# first: every packaged file has the same mtime (SOURCE_DATE_EPOCH), and
# Python takes a .pyc as current when the source's mtime and size match.
# Never fails the install: without bytecode myq only starts slower.
POSTINST = """#!/bin/sh
[ "${IPKG_NO_SCRIPT}" = "1" ] && exit 0
rm -rf "${IPKG_INSTROOT}/usr/lib/myq/__pycache__"
# `import myq` in python3 (SPEC 7): a myq.pth in the site-packages of each
# python3.X beside the python3 in PATH (/usr/bin -> /usr/lib; the image's
# /usr/lib while one is built): the package cannot know the version
if [ -n "${IPKG_INSTROOT}" ]; then
	lib="${IPKG_INSTROOT}/usr/lib"
else
	lib=$(command -v python3) && lib="${lib%/bin/*}/lib" || lib=/nonexistent
fi
for d in "$lib"/python3.[0-9]*; do
	if [ -d "$d" ] && [ ! -L "$d" ]; then
		mkdir -p "$d/site-packages" && echo /usr/lib/myq >"$d/site-packages/myq.pth"
	fi
done
if [ -z "${IPKG_INSTROOT}" ]; then
	python3 -I -c 'import sys; sys.path.insert(0, "/usr/lib/myq"); import myq' \
		>/dev/null 2>&1 || true
fi
if [ -e "${IPKG_INSTROOT}/etc/default/myq" ]; then
	echo "myq: /etc/default/myq is not read on OpenWrt: the settings are in" >&2
	echo "myq: /etc/config/myq (uci show myq); move yours there, then remove it" >&2
fi
[ -s "${IPKG_INSTROOT}/lib/functions.sh" ] || exit 0
# shellcheck source=/dev/null # OpenWrt's, on the device
. "${IPKG_INSTROOT}/lib/functions.sh"
default_postinst "$0" "$@"
"""
# The bytecode is no packaged file: remove it, so that removing the package
# leaves nothing behind (after default_prerm stopped the service).
PRERM = """#!/bin/sh
rc=0
if [ -s "${IPKG_INSTROOT}/lib/functions.sh" ]; then
	# shellcheck source=/dev/null # OpenWrt's, on the device
	. "${IPKG_INSTROOT}/lib/functions.sh"
	default_prerm "$0" "$@" || rc=$?
fi
rm -rf "${IPKG_INSTROOT}/usr/lib/myq/__pycache__"
if [ -n "${IPKG_INSTROOT}" ]; then
	lib="${IPKG_INSTROOT}/usr/lib"
else
	lib=$(command -v python3) && lib="${lib%/bin/*}/lib" || lib=/nonexistent
fi
rm -f "$lib"/python3.[0-9]*/site-packages/myq.pth
exit "$rc"
"""


def launcher(prefix="/usr"):
    """The launcher's bytes, for myq.py in PREFIX/lib/myq."""
    lib = prefix.rstrip("/") + "/" + LIB
    return (LAUNCHER % {"lib": lib}).encode("utf-8")


def payload(files, root=ROOT):
    """[(path in the archive, bytes, mode)] for FILES or IPK_FILES."""
    return [(dst, launcher() if src is None else read(src, root), mode)
            for src, dst, mode in files]


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
    return targz(payload(FILES, root), mtime)


def ipk(ver, mtime, root=ROOT):
    files = payload(IPK_FILES, root)
    size = sum(len(d) for _, d, _ in files)
    control = "".join("%s: %s\n" % kv for kv in [
        ("Package", "myq"),
        ("Version", ver),
        ("Depends", "python3-light"),
        ("Source", "myq"),
        ("License", LICENSE),
        ("Section", "utils"),
        ("Maintainer", MAINTAINER),
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


def compile_pyc(source):
    """Write source's bytecode where the installing interpreter's import
    looks for it (__pycache__/NAME.TAG.pyc beside it), hash-based and
    unchecked (the docstring above says why); remove
    the other .pyc files of that module (other versions', now stale)."""
    import py_compile
    cache = os.path.join(os.path.dirname(source), "__pycache__")
    name = os.path.splitext(os.path.basename(source))[0]
    tag = sys.implementation.cache_tag
    if not tag:
        return None                     # this Python caches no bytecode
    pyc = os.path.join(cache, "%s.%s.pyc" % (name, tag))
    if os.path.isdir(cache):
        for f in os.listdir(cache):
            if f.startswith(name + ".") and f.endswith(".pyc") and \
                    os.path.join(cache, f) != pyc:
                os.unlink(os.path.join(cache, f))
    # named here: importlib.util.cache_from_source would follow the
    # PYTHONPYCACHEPREFIX of whoever runs make install; the target looks
    # beside the source. py_compile writes aside and renames, like write().
    py_compile.compile(source, cfile=pyc, doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    return pyc


def site_dir(prefix):
    """Where this Python, were it installed under PREFIX, imports modules
    from with no sys.path edit: the first of its site directories under
    PREFIX/lib/ (Debian's /usr/lib/python3/dist-packages, a venv's or
    OpenWrt's lib/python3.X/site-packages), else PREFIX/lib/python3.X/
    site-packages (a cross build's target).  myq.py's _site_dir, word for
    word but for the name."""
    lib = prefix.rstrip("/") + "/lib/"
    try:
        import site
        dirs = site.getsitepackages()
    except (ImportError, AttributeError):
        dirs = []
    for d in dirs:
        if d.startswith(lib):
            return d
    return "%spython%d.%d/site-packages" % (lib, sys.version_info[0],
                                           sys.version_info[1])


def check_prefix(prefix):
    if not prefix.startswith("/"):
        raise SystemExit("dist: --prefix must be absolute, not %r" % prefix)
    if "\n" in prefix:
        raise SystemExit("dist: --prefix with a newline: %r" % prefix)
    return prefix.rstrip("/") or "/"


def under(destdir):
    """DESTDIR/path, for a path on the target."""
    top = destdir or "/"
    return lambda path: os.path.join(top, path.lstrip("/"))


def install(destdir, prefix, root=ROOT):
    prefix = check_prefix(prefix)
    binpath = os.path.join(prefix, "bin", "myq")
    libdir = os.path.join(prefix, LIB)
    script = read("init.d/myq", root)
    default_bin = b"BIN=${MYQ_BIN:-/usr/bin/myq}"
    if default_bin not in script:
        raise SystemExit("dist: init.d/myq has no %s line" % default_bin.decode())
    script = script.replace(default_bin, ("BIN=${MYQ_BIN:-%s}" % binpath).encode())
    at = under(destdir)

    # the module and its bytecode first, then the launcher that imports it
    module = at(os.path.join(libdir, "myq.py"))
    write(module, read("myq.py", root), 0o644)
    print(module)
    pyc = compile_pyc(module)
    if pyc:
        print(pyc)
    write(at(binpath), launcher(prefix), 0o755)
    print(at(binpath))
    # `import myq` in this python3, with no sys.path edit (SPEC 7)
    pth = at(os.path.join(site_dir(prefix), "myq.pth"))
    write(pth, (libdir + "\n").encode("utf-8"), 0o644)
    print(pth)
    write(at("/etc/init.d/myq"), script, 0o755)
    print(at("/etc/init.d/myq"))
    conf = at("/etc/default/myq")
    if os.path.exists(conf):
        print("%s kept (the shipped example is init.d/myq.default)" % conf)
    else:
        write(conf, read("init.d/myq.default", root), 0o644)
        print(conf)
    for src, dst, mode in DOCS:
        path = at(os.path.join(prefix, dst))
        write(path, read(src, root), mode)
        print(path)
    return 0


def uninstall(destdir, prefix, root=ROOT):
    """Remove what install() wrote (see the module's docstring)."""
    prefix = check_prefix(prefix)
    at = under(destdir)
    libdir = at(os.path.join(prefix, LIB))
    cache = os.path.join(libdir, "__pycache__")

    def remove(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        print("removed " + path)

    def rmdir(path):
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return
        except OSError:
            print("%s kept (not empty)" % path)
            return
        print("removed " + path + "/")

    remove(at(os.path.join(prefix, "bin", "myq")))
    pth = at(os.path.join(site_dir(prefix), "myq.pth"))
    remove(pth)
    remove(os.path.join(libdir, "myq.py"))
    if os.path.isdir(cache):
        for name in sorted(os.listdir(cache)):
            if name.startswith("myq.") and name.endswith(".pyc"):
                remove(os.path.join(cache, name))
    rmdir(cache)
    rmdir(libdir)
    remove(at("/etc/init.d/myq"))
    conf = at("/etc/default/myq")
    try:
        with open(conf, "rb") as f:
            same = f.read() == read("init.d/myq.default", root)
    except FileNotFoundError:
        same = None
    if same:
        remove(conf)
    elif same is not None:
        print("%s kept (changed: the operator's settings)" % conf)
    for _, dst, _ in DOCS:
        remove(at(os.path.join(prefix, dst)))
    rmdir(at(os.path.join(prefix, DOC)))
    return 0


# The init scripts that myq.py carries for `myq install` (the one file has no
# init.d/ beside it): between these lines of myq.py, as _INIT_FILES. Their
# settings files are made from myq.py's _INIT_SETTINGS (docs(), below).
EMBEDDED = ["init.d/myq", "init.d/myq.procd"]
EMBED_BEGIN, EMBED_END = "# _INIT_FILES begin\n", "# _INIT_FILES end\n"


def embedded_block(root=ROOT):
    """_INIT_FILES as Python source: a string literal a line (JSON's
    quoting, which Python reads the same), checked to read back."""
    import ast
    import json
    out = ["_INIT_FILES = {\n"]
    files = {}
    for rel in EMBEDDED:
        text = read(rel, root).decode("utf-8")
        files[os.path.basename(rel)] = text
        out.append("    %s: (\n" % json.dumps(os.path.basename(rel)))
        out.extend("        %s\n" % json.dumps(line, ensure_ascii=False)
                   for line in text.splitlines(True) or [""])
        out.append("    ),\n")
    out.append("}\n")
    block = "".join(out)
    if ast.literal_eval(block.partition("=")[2].strip()) != files:
        raise SystemExit("dist: the embedded init files do not read back")
    return block


def embed(root=ROOT):
    """Write embedded_block() into myq.py, between its markers; say whether
    anything changed."""
    path = os.path.join(root, "myq.py")
    text = read("myq.py", root).decode("utf-8")
    head, sep, rest = text.partition(EMBED_BEGIN)
    _, sep2, tail = rest.partition(EMBED_END)
    if not sep or not sep2:
        raise SystemExit("dist: myq.py has no %r ... %r block"
                         % (EMBED_BEGIN.strip(), EMBED_END.strip()))
    new = head + EMBED_BEGIN + embedded_block(root) + EMBED_END + tail
    if new == text:
        print("myq.py: the embedded init files are init.d/'s already")
        return 0
    st = os.stat(path)
    write(path, new.encode("utf-8"), st.st_mode & 0o7777)
    print("myq.py: the embedded init files written from init.d/")
    return 0


# What `make docs` writes from myq.py's _INIT_SETTINGS (the init scripts'
# settings): the two settings files whole, and in myq(1) the lines between
# these markers (INIT SCRIPTS' list).
DOCS_BEGIN = '.\\" _INIT_SETTINGS begin: make docs writes this list\n'
DOCS_END = '.\\" _INIT_SETTINGS end\n'


def generated(root=ROOT):
    """{path under root: the text _INIT_SETTINGS of root's myq.py makes}."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "myq_docs", os.path.join(root, "myq.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    page = read("build/myq.1", root).decode("utf-8")
    head, sep, rest = page.partition(DOCS_BEGIN)
    _, sep2, tail = rest.partition(DOCS_END)
    if not sep or not sep2:
        raise SystemExit("dist: build/myq.1 has no %r ... %r block"
                         % (DOCS_BEGIN.strip(), DOCS_END.strip()))
    return {"init.d/myq.default": m._init_settings_file("sysv"),
            "init.d/myq.config": m._init_settings_file("procd"),
            "build/myq.1": head + DOCS_BEGIN + m._init_settings_roff()
            + DOCS_END + tail}


def docs(root=ROOT):
    """Write generated(); say what changed."""
    for rel, text in sorted(generated(root).items()):
        path = os.path.join(root, rel)
        if read(rel, root).decode("utf-8") == text:
            continue
        write(path, text.encode("utf-8"), os.stat(path).st_mode & 0o7777)
        print("%s: written from myq.py's _INIT_SETTINGS" % rel)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--embed", action="store_true",
                   help="write init.d/'s files into myq.py (make embed)")
    p.add_argument("--docs", action="store_true", help="write the settings "
                   "files and myq(1)'s list from myq.py (make docs)")
    p.add_argument("--out", default=os.path.join(ROOT, "dist"),
                   help="where release files go (default: dist/)")
    p.add_argument("--install", metavar="DESTDIR", default=None,
                   help="install into DESTDIR instead ('' means /)")
    p.add_argument("--uninstall", metavar="DESTDIR", default=None,
                   help="remove what --install put into DESTDIR")
    p.add_argument("--prefix", default="/usr", help="default /usr")
    a = p.parse_args(argv)
    if a.embed:
        return embed()
    if a.docs:
        return docs()
    if a.install is not None and a.uninstall is not None:
        p.error("--install or --uninstall, not both")
    if a.install is not None:
        return install(a.install, a.prefix)
    if a.uninstall is not None:
        return uninstall(a.uninstall, a.prefix)
    return dist(a.out)


if __name__ == "__main__":
    sys.exit(main())
