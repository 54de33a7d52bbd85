#!/usr/bin/env python3
# -*- coding: utf-8 -*-
"""myq - a job queue worker for small Linux devices, in one file.

    myq [--spool DIR] init | enqueue TYPE [PAYLOAD] | worker | supervise |
                      intake | stats | list | show | retry | delete | reap |
                      prune | check | export [STATE...] | import [FILE] |
                      version | install

One spool directory is one queue; every state is a directory and every job
one JSON file, so `ls` and `cat` show everything.  CPython 3.7-3.13, standard
library only; at import time only modules of OpenWrt's python3-light.

The spool protocol (every step is one rename(2), so a crash leaves each job
in exactly one place):

- enqueue: write an unnamed file in incoming/ (O_TMPFILE), then linkat(2)
  it to incoming/ID.json (EEXIST means duplicate), fsync the file, fsync
  incoming/ (the file's fsync after the link: on ext4 one journal commit
  holds data, inode and name).  Where O_TMPFILE is refused: create
  tmp/NAME exclusively (O_EXCL|O_NOFOLLOW), write, then link(2) (explicit
  id) or rename(2) it into place, the same fsyncs.  The file's mtime is its
  `available_at`: the directory itself is the schedule, and a scan needs no
  open().  A byte written to the FIFO locks/wake wakes an idle worker.
- claim: rename incoming/ID.json -> processing/ID+TOKEN.json.  The token
  names the worker (locks/workers/WID.json: pid, process start time, boot
  id) and is unique per claim; a worker whose claim was taken back finds its
  own name gone, so it can never finish, retry or move the new owner's claim.
  The lease is the claim itself: its name (the token), its mtime (the
  lease's end, set by the claim with futimens(2), renewed by heartbeats)
  and its attempt (the file's + 1): an inode change, no data block; the
  file's bytes stay the job's (`ls -l processing/`, the worker's record).
- finish: success renames the claim to done/ID.json, which is the job's
  idempotency record while it stays (a record locks/ok/ID outlives it only
  when retention or delete removes it within the de-duplication window and
  the id is not one myq made); directory fsyncs are group-committed (a
  power cut may re-run a job, never lose one).  Retry and dead-letter write the
  new job beside the claim, processing/ID+TOKEN.new (fsync; the owner's
  directory), rename the claim to ID+TOKEN.fin (ownership),
  rename the new file into incoming/ (mtime = next attempt) or dlq/, then
  unlink the .fin.
- liveness: a claim whose worker is gone (no record, pid dead, pid reused,
  other boot) is taken back at once; a live owner on this host is never
  robbed unless its heartbeat (the record's mtime, on the monotonic clock;
  with a RAM tier, the later of it and the tier's locks/workers/WID.beat)
  stopped for longer than its lease.  A worker beats only while it holds
  or makes claims (its beat vouches for them alone), and a claim beats
  first when the last beat is older than lease/3: an idle worker writes
  nothing; the wall-clock lease decides only where
  liveness cannot be checked (another host or pid namespace, no /proc).
- recovery: a .fin or claim left by a dead worker is requeued (counting the
  attempt it began) or removed when its job already sits elsewhere.
- hold: a job of a held destination is not rewritten: a probe is one job,
  and a failed probe's job (or one claimed as the hold began) is renamed
  back unchanged, its mtime its place in line; a held type's lane is not
  looked into until its probe (SPEC 9: a hold writes nothing per job).
- time: stored times are wall clock; every duration and sleep is monotonic.
  A file whose ctime lies in the future (the clock went back) gets its mtime
  moved to now + the delay it had left.

The map: the sections, in file order, each using only those above it
(tests/test_structure.py keeps it so), and where each is tested.

Part I, the core:
  Platform and process state   feature flags, every mutable global
                    (test_structure, test_light)
  Errors            the exceptions and their exit codes (test_bad_input)
  Small helpers     time, names, formats; values: one parser per kind
                    (Kind: BOOL, COUNT, SIZE, SECONDS, ...), for flags,
                    MYQ_* variables and policy files alike (test_clock,
                    test_policy, test_operator_cli)
  Filesystem steps: the one door to the disk   _Door, every step on a
                    spool's file by directory descriptor (test_door,
                    test_security, test_crashpoints, test_storage_faults)
  Processes         /proc, process start times, kill_run, become
                    (test_liveness, test_ownership)
  The job model     parse, normalize, job files (test_hostile, test_enqueue)
  Per-type policy            Policy: its keys, each a Kind; a policy
                    file checked, in canonical form (test_policy)
  The spool         the spool's own files (layout, ownership), Store (the
                    contract of a store), Identity, Claim, Breaker (holds'
                    records), batches (test_store, test_spool_layout,
                    test_breaker)
  The claim protocol   Claims (claim, finish, retry, dead letter, put
                    back, take back, recovery), FileClaims (over job
                    files) (test_store, test_retry_dlq, test_crashpoints)
  Producing         Producer (a store's producer: job files written,
                    the guard, idempotency records) (test_enqueue)
  Upkeep            Upkeep (retry, delete, prune, check) (test_operator)
  Reading and export   Backlog, FileBacklog (export, import: JSON lines),
                    metrics' text, Reader (locate, show, list, stats)
                    (test_export, test_api, test_operator)
  The spool's budget (myq-spool(5) BUDGET)   Budget, FileBudget (the
                    budget's figure and shed, capacity: locks/used,
                    locks/rates) (test_budget, test_forecast)
  The store of files   _Layout (what init makes), SpoolPolicy (the
                    policy file, each type's rules, where a job waits),
                    _DirStore (what every store of a spool directory
                    shares: lanes, totals; its parts made and held),
                    FileUpkeep,
                    FileStore, open_store, enqueue, Spool (myq(1)'s Python
                    API, handed to its store) (test_store, test_api,
                    test_spool_layout)
  Logging           Log and its file (test_initd)
  Handlers          Handler (how a type's jobs run: time limit,
                    destination, batch key, how it runs) and the core's
                    kinds, ExecHandler and PyHandler; --module files; a
                    type's destinations; Uplink (--uplink-rate)
                    (test_handlers_exec, test_handlers_module)
  A run's pieces    _Run, Backoff (every retry delay), _Resolver (a
                    worker's handlers by type: --handlers, --module, the
                    built-in types of _BUILTIN_TYPES), outcomes, pipes
                    (test_handlers_exec, test_http_forward)
  The scheduler     _Scheduler: lanes, scan caches, gates, rates, probes
                    (test_scan, test_scheduler)
  Running a job     _Runner: handlers started, outcomes collected
                    (test_handlers_*)
  Holds, the worker's side   _Holds: held types and destinations, a
                    destination's failures, failover to a type's next
                    destination (test_breaker, test_outage, test_field,
                    test_destinations)
  The worker        WorkerOptions (what a worker is told, made once of
                    flags or keywords), _Finishing (a claim's end: done,
                    retry, dead letter, put back, group commit), Worker:
                    the loop, signals, heartbeat, holding the parts above,
                    each with its own state (test_worker_modes,
                    test_timeouts_shutdown, test_chaos, test_worker_parts)
  Supervision       Supervisor, supervise --daemon (test_initd, test_procd)
  Options and parsers   the options' tables, each command's arguments
                    declared once: argparse's parser, or a _Spec that
                    parses the usual forms without it (test_operator_cli,
                    test_fast_cli)
  Command line      the parser, a command's start (a worker or supervisor
                    made of its options), the commands, _COMMAND_TABLE,
                    main (test_operator_cli)

Part II, the extensions:
  The SQLite store: its database   the schema and statements, _SqlDb
                    (the connection to queue.db, its transactions, the
                    log's walk) (test_sqlite, test_sql_flow)
  The SQLite store: its drop box and claims   _SqlDropBox (the drop box
                    taken in), _SqlClaims, claims of many jobs in one
                    statement (_sql_claim_many) (test_sqlite,
                    test_drain_deferred, and the store-parametrised tests)
  The SQLite store  SqlStore and its other parts: _SqlUpkeep, _SqlReader,
                    SqlBudget, SqlBacklog, _SqlProducer (its jobs INSERTed,
                    the drop box's files else): the same contract over queue.db
                    (myq init --store sqlite) (test_sqlite, and the
                    store-parametrised tests)
  The RAM tier      RamStore (a file store on a tmpfs, whose jobs move to
                    the spool when they must wait), RamClaims,
                    _TieredClaims (a worker's claims over both tiers),
                    init_ram (myq init --ram) (test_ram)
  HTTP forwarding   requests, answers, http_dest, HttpPool, batches,
                    Kafka's body, HttpHandler (the http type, registered
                    in _BUILTIN_TYPES) (test_http, test_http_forward,
                    test_destinations)
  MQTT              MqttClient, MqttHandler (the mqtt type, registered in
                    _BUILTIN_TYPES) (test_mqtt)
  Intake: HTTP      take_in, HttpIntake (test_intake)
  Intake: MQTT      MqttIntake, run_intake, `myq intake` (its options, its
                    command, the child supervise keeps: registered in
                    _COMMAND_TABLE, _COMMAND_OPTIONS, _CHILDREN)
                    (test_intake)
  Install           `myq install`: the module layout, the init files
                    embedded, its command (test_dist)
  The process image   byte-code cache, heap, a worker's command, the
                    launcher's exit (end) (test_script_start,
                    test_installed_start)

The start:
  Run as a script   the script's start, its one hint (test_script_start,
                    test_light, test_onefile)
"""

import errno
import gc
import os
import stat
import sys
import time

if sys.version_info < (3, 7):
    # Python 2 parses this whole file (so: the coding line above, and no
    # f-strings, keyword-only arguments, nonlocal, `raise from`, `yield
    # from`; tests/test_operator_cli.py checks) and stops here.
    if __name__ != "__main__":
        raise ImportError("myq needs Python 3.7 or later")
    sys.stderr.write("myq needs Python 3.7 or later; this is Python %d.%d "
                     "(run it with python3)\n" % tuple(sys.version_info[:2]))
    sys.exit(78)

import _thread  # noqa: E402  (Python 2 names it thread)
import _weakref  # noqa: E402  (weakref.proxy is _weakref's: weakref costs 4 M)


# json and re are imported at their first use, not at load: together they
# cost a `myq enqueue` about 30 M instructions (re pulls in enum and its
# classes), as much as the interpreter's own start; a producer needs
# neither (its JSON goes through _json's C parts, a name is checked by
# _is_name).  Regular expressions are compiled at their first use too.

class _OnFirstUse(object):
    """A module imported at its first use: `json = _OnFirstUse("json")`.
    The first attribute asked for imports it and rebinds the module's
    global to the real module, so that every later use is a plain global
    lookup of it."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        module = __import__(self._name)
        globals()[self._name] = module
        return getattr(module, attr)


json = _OnFirstUse("json")
re = _OnFirstUse("re")


class _Later(object):
    """An object made by make() at its first use (a compiled expression,
    a JSON decoder).  Then the module's globals that named this one name
    the object itself (an attribute of an object whose class has
    __getattr__ costs more to look up, at every use: 8,000 instructions a
    drained job); a reference kept elsewhere gets its attributes, copied
    into this one."""

    def __init__(self, make):
        self._make = make

    def __getattr__(self, name):
        obj = self._make()
        for n in dir(obj):
            if not n.startswith("__"):
                self.__dict__[n] = getattr(obj, n)
        g = globals()
        for k in [k for k, v in g.items() if v is self]:
            g[k] = obj
        return getattr(obj, name)


def _Pattern(pattern, flags=0):
    """re.compile(pattern, flags), at its first use."""
    return _Later(lambda: re.compile(pattern, flags))

__version__ = "0.1.0"

__all__ = [
    "MyqError", "UsageError", "InvalidJob", "NoSuchJob", "DuplicateJob",
    "SpoolFull", "SpoolBusy", "ConfigError", "PermanentError", "RetryLater",
    "DestinationDown",
    "Spool", "Worker", "Log", "enqueue", "main", "__version__",
]

DEFAULT_SPOOL = "/var/spool/myq"
SUBDIRS = ("tmp", "incoming", "processing", "done", "dlq", "failed", "locks")
INTAKE_TOKEN = "intake.token"   # the HTTP intake's bearer token, made by init
STATES = ("ready", "scheduled", "processing", "done", "dead", "failed")
STATE_DIRS = {"ready": "incoming", "scheduled": "incoming",
              "processing": "processing", "done": "done", "dead": "dlq",
              "failed": "failed"}

# Guards and retention (myq(1) guards); every one is also a MYQ_<OPTION> variable.
DEFAULTS = {
    "min_free": 1 << 20, "min_free_inodes": 64, "max_job_bytes": 256 << 10,
    "dedupe_window": 7 * 86400.0, "keep_done": 86400.0, "keep_done_max": 1000,
    "keep_dead": 30 * 86400.0, "keep_dead_max": 10000,
    "keep_failed": 30 * 86400.0, "keep_tmp": 3600.0, "keep_ok_max": 100000,
}

EX_USAGE, EX_DATAERR, EX_NOINPUT = 64, 65, 66
EX_OSERR, EX_CANTCREAT, EX_TEMPFAIL, EX_CONFIG = 71, 73, 75, 78

NAME_RE = _Pattern(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}\Z")
GENERATED_ID_RE = _Pattern(r"[0-9]{13}-[0-9a-f]{8}\Z")     # _new_id's
STDERR_TAIL = 2000          # bytes of a handler's stderr kept for last_error
ERROR_MAX = 1000            # characters of last_error stored
SLACK = 16384               # what a worker may add to a job (error, lease lines)


# =============================================================================
# PART I: THE CORE
#
# What runs every job, and what an auditor reads first: the platform,
# errors, values, the door to the disk, processes, the job model, the
# store contract and the store of files, policy, the breaker, logging,
# exec and Python handlers, the scheduler and the worker, supervision,
# the core commands.  No section of Part I names anything of Part II;
# each extension registers itself in one of Part I's tables (stores:
# _STORES; built-in types: _BUILTIN_TYPES; commands: _COMMAND_TABLE,
# _COMMAND_OPTIONS; a supervisor's children: _CHILDREN; the process
# image: _IMAGE).
# =============================================================================

# Platform and process state ##################################################
#
# What this platform has, read once at import, and every module-level name
# that changes after import, each with what changes it: a reader finds the
# process's state here, not spread over the file.  They stay plain globals
# (one dictionary lookup on the hot paths; a list or dict is changed in
# place, a flag by `global` in the one function named).

# Platform: flags of os.open() this system may lack (0: not there).
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
# mknod(2) makes an empty file in one call; _create_empty sets it False at
# the first refusal (a sandbox: EPERM, ENOSYS, EINVAL) and opens instead.
_MKNOD = hasattr(os, "mknod") and sys.platform.startswith("linux")
# posix_fadvise(2): enqueue_many starts each file's writeback with it.
_FADVISE = hasattr(os, "posix_fadvise")
# O_TMPFILE (Linux >= 3.11): a new job is written as an unnamed file in its
# directory and linked there once whole (linkat through /proc/self/fd), so
# its name can only ever point to the inode written, and nothing is left in
# tmp/ by a crash.  Producer._unnamed sets it False at the first refusal
# (EOPNOTSUPP: a filesystem without it; EISDIR, EINVAL: an older kernel;
# ENOENT at the link: no /proc), and enqueues go through tmp/ from then on.
_TMPFILE = getattr(os, "O_TMPFILE", 0) if sys.platform.startswith("linux") else 0

# The test hook of every step on a spool's file (Filesystem steps):
# `_hook(op, path, "before"|"after")`, set by the crash and fault tests.
_hook = None

# This boot's id (/proc/sys/kernel/random/boot_id), read once by boot_id().
_BOOT_ID = None

# iso(): [the second, its strftime], so the time is formatted once a second.
_ISO_CACHE = [None, ""]

# _replace(): a counter for the names of its temporary files.
_SEQ = [0]

# _new_id(): [the last millisecond, its count], so that ids sort in order.
_LAST_ID = [0, 0]

# normalize(): the type names it found good (at most 1,024), each checked
# once, not at every claim.
_TYPES_OK = set()

# [this process's pid], and random numbers for _new_id taken from the
# kernel 16 at a time: both renewed in a forked child (_forked), which
# must neither name its files with its parent's pid nor repeat its ids.
_PID = [os.getpid()]
_RANDOM = []

# _decode(): [_json's scanner], made at the first use.
_SCANNER = []

# A spool's path -> True: every spool this process uses (Filesystem steps:
# a path inside one goes through the door).
_TOPS = {}


class _Here(_thread._local):
    """A thread's own doors: a descriptor one thread holds is never closed
    by another (a worker closes some at each poll tick while a --module
    handler's thread enqueues; shared, that thread's next step went through
    a closed or reused number).  Dropped, and closed, when the thread ends."""

    def __init__(self):
        self.doors = {}     # a spool's path -> this thread's _Door of it
        self.heads = {}     # a directory's path -> (its _Door or None, sub)
        self.tops = 0       # len(_TOPS) when heads was filled


_HERE = _Here()

# spool path -> the _mono() time before which a producer does not look for a
# listening worker again (Spool.poke)
_UNHEARD = {}

# enqueue(): a path -> its Spool, kept for the next call.
_SPOOLS = {}

# The stores a spool may keep its jobs in, besides files: name -> the
# Spool class (the SQLite store registers itself, below the spool).
_STORES = {}

# The built-in types (myq(1) HANDLERS), each an extension that registers
# itself: name -> (the policy key whose value makes a type one of it,
# make(options, uplink): its Handler, one a worker; check(kw): a worker's
# command-line options of its own checked, or None).
_BUILTIN_TYPES = {}

# Database connections a forked child inherited: never closed in the child
# (closing may end the parent's locks), never used.
_FORKED_DBS = []

# The HTTPSConnection subclass (HTTP forwarding), made on first use.
_tls_class = []

# [True] once run as a script, so compiled at its start (The process image,
# Run as a script); the launcher of a cached byte code sets _FROM_CACHE.
_COMPILED_AT_START = []


def _forked():
    """In a child of os.fork() (the supervisor's workers, a daemon, a
    --module handler's own fork): what is this process's alone starts
    again.  The forking thread's doors are closed (the child's copies of
    the descriptors; the parent keeps its own) and opened again, and
    checked, at the child's first step; the caches of spools and wakes
    go; the id counter starts over, so that two children of one parent
    never count up from the same random number in one millisecond.
    _TOPS stays: its entries are paths, still spools in the child, whose
    steps must go on through the door."""
    doors, _HERE.doors, _HERE.heads, _HERE.tops = _HERE.doors, {}, {}, 0
    for door in doors.values():
        door.close()
    _SPOOLS.clear()
    _UNHEARD.clear()
    _LAST_ID[:] = [0, 0]
    _PID[0] = os.getpid()
    del _RANDOM[:]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


# Errors ######################################################################

class MyqError(Exception):
    """Base of myq's errors.  `code` is the exit status (sysexits.h)."""
    code = 1


class UsageError(MyqError):
    code = EX_USAGE


class InvalidJob(MyqError, ValueError):
    code = EX_DATAERR


class NoSuchJob(MyqError, LookupError):
    code = EX_NOINPUT


class DuplicateJob(MyqError):
    code = EX_CANTCREAT


class SpoolFull(MyqError):
    code = EX_TEMPFAIL


class SpoolBusy(MyqError):
    code = EX_TEMPFAIL


class ConfigError(MyqError):
    code = EX_CONFIG


class PermanentError(Exception):
    """Raised by a handler: the job goes to dlq/ at once."""


class _Unsent(PermanentError):
    """A built-in handler's request that the job itself made unsendable (a
    header value with a newline, a path that is not ASCII): nothing
    reached the destination, so it is the job's own failure, which neither
    trips nor releases a hold (myq(1) holds)."""


class RetryLater(Exception):
    """Raised by a handler: run the job again after `seconds`."""

    def __init__(self, seconds=None, message=""):
        self.seconds = None if seconds is None else max(0.0, float(seconds))
        Exception.__init__(self, message or (
            "retry later" if seconds is None else "retry in %gs" % self.seconds))


class DestinationDown(RetryLater):
    """Raised by a handler (the built-in ones too): the destination failed,
    not the job (network error, time-out, HTTP 408/425/429/5xx, an MQTT
    broker that refused).  The circuit breaker counts it (myq(1) holds); it costs a
    job no attempt unless it starts a streak."""


class _Timeout(BaseException):
    """Raised inside an in-process handler that ran past its time limit."""


class _Shutdown(BaseException):
    """Raised inside an in-process handler when the shutdown grace is over."""


# Small helpers ###############################################################

def _now():
    return time.time()


def _mono():
    return time.monotonic()


def _ms_repr(t):
    """repr(round(t, 3)) at a third of its cost: "%.3f" rounds the same
    way, and below 1e12 (15 significant digits at most) the shortest
    repr of the result is those digits without trailing zeros."""
    if -1e12 < t < 1e12:
        s = ("%.3f" % t).rstrip("0")
        return s + "0" if s[-1] == "." else s
    return repr(round(t, 3))


# 10**k for k = 6 .. 1 (floats: the products stay below 2**53, exact)
_TENS = (1e6, 1e5, 1e4, 1e3, 1e2, 1e1)


def _time_repr_len(t):
    """len(repr(t)) for a time of these years (2**30 <= t < 2**31: 2004 to
    2038) without repr, whose shortest digits cost 7,000 instructions:
    there t's fraction is F / 2**22 (F an integer), a float there
    stands for every number within 2**-23 of it, and its repr has the
    fewest decimals k (at least 1, at most 7) that some number of k
    decimals within that reach has (never at its edge: that would need
    k >= 23).  Else repr's own."""
    if not 1073741824.0 <= t < 2147483648.0:
        return len(repr(t))
    p = t % 1.0 * 8388608.0                 # the fraction, in 2**-23 s
    k = 7
    for ten in _TENS:
        r = p * ten % 8388608.0
        if ten < r < 8388608.0 - ten:
            break                           # none of k - 1 decimals
        k -= 1
    return 11 + k


def iso(t=None, frac=True):
    """ISO 8601 UTC ending in Z, with milliseconds unless frac is false."""
    t = _now() if t is None else t
    sec = int(t // 1)
    if _ISO_CACHE[0] != sec:        # strftime once a second, not per line
        _ISO_CACHE[:] = [sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))]
    if frac:
        return "%s.%03dZ" % (_ISO_CACHE[1], int((t - sec) * 1000))
    return _ISO_CACHE[1] + "Z"


def parse_size(text):
    """'256K' -> 262144.  Binary suffixes K, M, G; a plain number is bytes
    (a JSON integer too)."""
    if text.__class__ is int and 0 <= text < 1 << 60:
        return text
    if not isinstance(text, str):
        raise ValueError("not a size (use e.g. 512K, 1M, 2G): %r" % (text,))
    m = re.match(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)[iI]?[bB]?\s*\Z", str(text))
    if not m:
        raise ValueError("not a size (use e.g. 512K, 1M, 2G): %r" % text)
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    v = float(m.group(1)) * mult
    if not v < 1 << 60:
        raise ValueError("too large a size: %r" % text)
    return int(v)


_DURATION_RE = _Pattern(r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*(ms|s|m|h|d)\s*\Z")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
DURATION_FORMS = "seconds such as 0.2 or 90, or a unit: 500ms, 30s, 15m, 1h, 7d"


def parse_duration(text):
    """'0.2', '90', '500ms', '30s', '15m', '1h', '7d' -> seconds (a float,
    not range-checked: a caller that takes a job's delay judges it).  A
    JSON number too, never a boolean."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    if not isinstance(text, str):
        raise ValueError("not a duration (use %s)" % DURATION_FORMS)
    try:
        return float(text)
    except ValueError:
        m = _DURATION_RE.match(str(text))
        if not m:
            raise ValueError("not a duration (use %s)" % DURATION_FORMS)
        return float(m.group(1)) * _UNITS[m.group(2)]


def parse_seconds(text, positive=False, most=float("inf")):
    """A duration (parse_duration) that is >= 0 (with `positive`: > 0)
    and below `most` (so finite)."""
    v = parse_duration(text)
    if not (v > 0 if positive else v >= 0) or not v < most:
        raise ValueError("not a duration %s (use %s)" % (
            "> 0" if positive else ">= 0", DURATION_FORMS))
    return v


def parse_bool(v):
    """True or false: a JSON boolean, or 1/0, true/false, yes/no, on/off
    in any case."""
    if isinstance(v, bool):
        return v
    t = str(v).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError("not true or false: %r" % (v,))


def parse_int(v, lo=None, hi=None):
    """A whole number from lo to hi (None: no bound): a JSON integer, or
    its digits (a sign and blanks around them allowed)."""
    if isinstance(v, str):
        # re.match(r"\s*[-+]?\d+\s*\Z", v) without re (see _OnFirstUse)
        t = v.strip()
        if t[1:].isdecimal() and t[0] in "+-" or t.isdecimal():
            v = int(v)
    if v.__class__ is not int or (lo is not None and v < lo) or (
            hi is not None and v > hi):
        raise ValueError("not a whole number in range: %r" % (v,))
    return v


def parse_fraction(v):
    """A number from 0 to 1."""
    f = None if isinstance(v, bool) else float(v)
    if f is None or not 0 <= f <= 1:
        raise ValueError("not a fraction: %r" % (v,))
    return f


def _rand_hex(n=4):
    return os.urandom(n).hex()


def _uniform():
    """A float in [0, 1) without importing random (it pulls in hashlib)."""
    return int.from_bytes(os.urandom(7), "big") / float(1 << 56)


def _bare(s):
    """Can `s` stand bare in a log line (a value, `myq list`'s id)?  One
    or more of printable ASCII but the space, '"', '=' and '\\' (what
    [\\x21\\x23-\\x3c\\x3e-\\x5b\\x5d-\\x7e]+ matches), told without re."""
    return s.isascii() and s.isprintable() and s != "" and not (
        " " in s or '"' in s or "=" in s or "\\" in s)


def _kv(value):
    """A log value: bare when it has no blanks or quotes, else JSON-quoted."""
    if value.__class__ is int:
        return str(value)
    if value is None:
        return "-"
    if isinstance(value, float):
        value = "%.3f" % value
    s = str(value)
    if _bare(s):
        return s
    return json.dumps(s, ensure_ascii=False)


_CONTROL = _Pattern(u"[\x00-\x1f\x7f-\x9f]")


def _plain(text, more=None):
    """`text` as an operator's terminal may show it: control characters
    (and those `more` matches) as \\xNN, so that a server's answer or a
    producer's name can neither move the cursor nor forge a field or a
    line (status line, check, Prometheus labels; list and show escape
    theirs with JSON)."""
    text = str(text)
    if text.isprintable() and (more is not _FIELD or not (
            " " in text or "," in text or "=" in text)):
        # (no control character, nor one of _FIELD's: a printable text
        # has no whitespace but the space; `myq stats` imports no re)
        return text
    sub = lambda m: "\\x%02x" % ord(m.group())     # noqa: E731
    text = _CONTROL.sub(sub, text)
    return more.sub(sub, text) if more is not None else text


_FIELD = _Pattern(r"[\s,=]")     # what would end a status line's field


def pid_namespace():
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _format_duration(v):
    """3600.0 -> '1h', 90.0 -> '90s', 0.2 -> '0.2s': what --help shows."""
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if v >= max(n, 120) and v % n == 0:
            return "%d%s" % (v // n, unit)
    return "%gs" % v


def _format_size(v):
    for unit, n in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if v >= n and v % n == 0:
            return "%d%s" % (v // n, unit)
    return str(v)


class Kind(object):
    """One kind of value, read the same way from a flag, a MYQ_* variable
    and a policy file: kind(value) is its canonical form, else a
    ValueError that says what it takes (the caller names the key and the
    value).  "" is a value of no kind: where empty means something (a
    MYQ_* variable: unset; a policy VALUE: remove the key) the caller
    decides that before it parses.  `show` writes a value as --help and
    `myq policy` print it, `metavar` names it in --help."""
    __slots__ = ("parse", "takes", "metavar", "show")

    def __init__(self, parse, takes, metavar="V", show=str):
        self.parse, self.takes = parse, takes
        self.metavar, self.show = metavar, show

    def __call__(self, value):
        try:
            return self.parse(value)
        except (ValueError, TypeError, AttributeError, OverflowError):
            raise ValueError("it takes " + self.takes)


def _whole(v):
    """A policy's canonical number: 3600, not 3600.0."""
    return int(v) if v == int(v) else v


BOOL = Kind(parse_bool, "true or false (or 1/0, yes/no, on/off)",
            show=lambda v: "true" if v else "false")
COUNT = Kind(lambda v: parse_int(v, 1), "a whole number >= 1", "N")
NATURAL = Kind(lambda v: parse_int(v, 0), "a whole number >= 0", "N")
PRIORITY = Kind(lambda v: parse_int(v, -9, 9), "an integer from -9 to 9", "P")
SIZE = Kind(parse_size, "a size such as 512K, 1M or 2G", "SIZE", _format_size)
SECONDS = Kind(parse_seconds, "a duration >= 0: " + DURATION_FORMS, "S",
               _format_duration)
POSITIVE_SECONDS = Kind(lambda v: parse_seconds(v, positive=True),
                        "a duration > 0: " + DURATION_FORMS, "S",
                        _format_duration)
DURATION = Kind(parse_duration, "a duration: " + DURATION_FORMS, "S")
FRACTION = Kind(parse_fraction, "a fraction from 0 to 1, such as 0.1", "F")


def _syslog_problem(path="/dev/log"):
    """None when a syslog daemon takes datagrams on `path` (syslog(3)'s
    socket), else why every line sent there is lost: no socket, or one
    that no daemon listens on (a syslogd that died, a container's stale
    /dev/log).  syslog(3) itself drops the lines without a word."""
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.connect(path)
        return None
    except OSError as e:
        why = ("there is no %s" % path if e.errno == errno.ENOENT else
               "nothing listens on %s (%s)" % (path, e.strerror or e))
    finally:
        s.close()
    return ("logs go nowhere: %s, so every syslog line is dropped; start "
            "syslogd (BusyBox: syslogd; OpenWrt: logd), or log to a file "
            "(MYQ_LOG=/var/log/myq/myq.log, or --log FILE) and restart"
            % why)


def _chain(*iterables):
    for it in iterables:
        for x in it:
            yield x


# Filesystem steps: the one door to the disk #################################
#
# Every step on a spool's files goes through these helpers, and each of them
# reaches a path inside a spool through the spool's door (_Door): the
# descriptor of the path's directory, opened component by component from
# the spool's own directory without following a link, checked to be on the
# spool's filesystem and, unless it is tmp/ or incoming/ (where producers
# write), to be the owner's alone; the step is then made relative to that
# descriptor (renameat, unlinkat, openat with O_NOFOLLOW, ...).  So no step
# of any feature, old or new, goes through a link a producer made, nor
# writes into a directory a producer can write but tmp/ and incoming/.  A
# path outside every spool this process uses is taken as it is (the log,
# the pidfile, /proc).  The crash and fault tests can stop or fail the
# program just before or just after any step:
# `_hook(op, path, "before"|"after")` may call os._exit() or raise OSError.

_DIR_FLAGS = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | os.O_NONBLOCK | O_CLOEXEC
_WAKE_FLAGS = os.O_WRONLY | os.O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC
_SHARED = ("tmp", "incoming")   # the directories where producers write


def _other_fs(sub, top):
    return ("%s is on a different filesystem than %s: rename() between them "
            "would not be atomic; keep the whole spool on one filesystem "
            "(unmount or move %s)" % (sub, top, sub))


def _step(op, path, when):
    if _hook is not None:
        _hook(op, path, when)
# (the helpers below, which run per job, test _hook inline: no call)


class _Refused(OSError, ConfigError):
    """A directory of the spool that the door will not use: a link, not a
    directory, on another filesystem, or writable by others where only the
    owner may write.  An OSError to the steps (a job's step fails, it is
    not taken for a job's fault); a ConfigError to the command line."""

    def __init__(self, message):
        OSError.__init__(self, errno.EPERM, message)

    def __str__(self):
        return self.strerror


def _open_dir(name, dir_fd=None, show=None):
    """A descriptor of directory `name` (in `dir_fd`), never through a
    symlink; _Refused when it is not a directory."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _Refused("%s is not a directory (a symlink or another file "
                           "stands in its place); remove it and run myq init"
                           % (show or name))
        raise


class _Door(object):
    """The descriptors of one spool's directories, each opened through its
    parent's without following a link and checked once: `door("incoming")`
    is incoming/'s, `door.at(path)` (descriptor, name) for a step on a path
    in the spool.  The descriptors are kept until close(): a worker keeps
    them (`kept`) and looks at them again at its poll ticks (recheck), so
    that a directory replaced meanwhile is opened (and checked) again; a
    producer's call or a command closes them at its end (a process that
    enqueued keeps nothing of the spool's filesystem busy)."""

    def __init__(self, top):
        self.top = top
        self._pre = top + "/"
        self.fds = {}
        self._seen = {}             # sub -> what _check saw (recheck)
        self.looked = {}            # sub -> its stat at the last recheck
        self.kept = 0
        self.uid = self.dev = None
        self._owner = False
        self._incoming = None
        self._euid = os.geteuid()

    @classmethod
    def of(cls, top):
        """This thread's door of the spool at `top`."""
        doors = _HERE.doors
        door = doors.get(top)
        if door is None:
            # Another spool: the descriptors of those no worker of this
            # thread keeps go (opened again, and checked again, when one
            # is used again), so that a process that goes through many
            # spools (a test suite, a script) does not run out of them.
            for other in doors.values():
                if not other.kept:
                    other.close()
            door = doors[top] = cls(top)
            _TOPS[top] = True       # (paths below it are the spool's now)
        return door

    def __call__(self, sub=""):
        fd = self.fds.get(sub)
        if fd is not None:
            return fd
        if sub:
            parent, _, name = sub.rpartition("/")
            if name in ("", ".", ".."):
                raise _Refused("%s: not a directory of the spool" % sub)
            pfd = self(parent)
            fd = _open_dir(name, pfd, self._pre + sub)
        else:
            fd = self._open_top()
        try:
            seen = self._check(sub, fd)
        except BaseException:
            os.close(fd)
            raise
        self.fds[sub] = fd
        parent, _, name = sub.rpartition("/")
        self._seen[sub] = (parent, name, seen)
        return fd

    def _open_top(self):
        """The spool's own path is the caller's: a symlink there is followed
        only when root or this user made it (as init allows)."""
        try:
            return os.open(self.top, _DIR_FLAGS)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            st = os.lstat(self.top)
            if not stat.S_ISLNK(st.st_mode) or st.st_uid not in (0, self._euid):
                raise _Refused("%s is not a directory (or a symlink another "
                               "user made); give the real directory as --spool"
                               % self.top)
            return os.open(self.top, _DIR_FLAGS & ~O_NOFOLLOW)

    def _check(self, sub, fd):
        """Refused unless the directory may be used; what it is (_seen)."""
        st = os.fstat(fd)
        seen = (st.st_dev, st.st_ino, st.st_uid, st.st_gid, st.st_mode)
        if not sub:
            self.uid, self.dev = st.st_uid, st.st_dev
            return seen
        if st.st_dev != self.dev:
            raise _Refused(_other_fs(self._pre + sub, self.top))
        if sub in _SHARED:
            if sub == "incoming":   # (owner() and file_mode() ask it)
                self._incoming = (st.st_uid, st.st_gid)
            return seen
        # The owner's alone: a directory a producer made, or one others may
        # write, is never used (its entries could be a producer's links).
        if st.st_uid not in (self.uid, 0):
            raise _Refused(
                "%s%s belongs to uid %d, not to the spool's owner (uid %d): "
                "only tmp/ and incoming/ may hold others' files; remove it "
                "(myq init makes it again)" % (self._pre, sub, st.st_uid,
                                               self.uid))
        if st.st_mode & 0o022:
            if self._euid not in (0, st.st_uid):
                raise _Refused(
                    "%s%s is writable by others (mode %04o): only tmp/ and "
                    "incoming/ may be; run: chmod go-w %s%s" % (
                        self._pre, sub, stat.S_IMODE(st.st_mode), self._pre, sub))
            # (a lane made before they were the owner's took incoming/'s mode)
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)
            seen = seen[:4] + (st.st_mode & ~0o022,)
        return seen

    def fresh(self, sub=""):
        """A new descriptor of `sub`, checked; the caller closes it."""
        if sub:
            parent, _, name = sub.rpartition("/")
            fd = _open_dir(name, self(parent), self._pre + sub)
        else:
            fd = self._open_top()
        try:
            self._check(sub, fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def at(self, path):
        """(descriptor of the directory of `path`, its last part)."""
        head, _, name = path.rpartition("/")
        if head == self.top:
            return self(""), name
        return self(head[len(self._pre):].strip("/")), name

    def mkdir(self, sub, mode=0o750):
        """Make the owner's directory `sub` (its parents must be there):
        given to the spool's owner when root makes it; its descriptor."""
        fd = self.fds.get(sub)
        if fd is not None:
            return fd
        parent, _, name = sub.rpartition("/")
        pfd = self(parent)
        try:
            os.mkdir(name, mode, dir_fd=pfd)
            made = True
        except FileExistsError:
            made = False
        if made and self._euid == 0 and self.uid != 0:
            fd = _open_dir(name, pfd, self._pre + sub)
            try:
                st = os.fstat(pfd)
                os.fchown(fd, self.uid, st.st_gid)
            finally:
                os.close(fd)
        return self(sub)

    def owner(self):
        """(uid, gid) that new files must belong to: the spool's, when we
        are root and the spool is someone else's; else None."""
        if self._owner is False:
            self._owner = None
            if self._euid == 0:
                uid, gid = self.incoming()
                if uid != 0:
                    self._owner = (uid, gid)
        return self._owner

    def incoming(self):
        """(uid, gid) of incoming/, as its descriptor was checked."""
        if "incoming" not in self.fds:
            self("incoming")
        return self._incoming

    def owns(self):
        """May this process write the owner's directories (lanes, locks/)?"""
        self("")
        return self._euid in (0, self.uid)

    def file_mode(self):
        """0640, or 0660 for a producer who is not the spool's owner (in a
        group-writable incoming/): the owner's worker must be able to
        append its lease to the file."""
        if self._euid == 0 or self.incoming()[0] == self._euid:
            return 0o640
        return 0o660

    # What a poll tick itself looks into (and the lanes, incoming/...):
    # kept and rechecked; the others closed at each tick, as before.
    TICKED = frozenset(("", "incoming", "locks", "locks/held"))

    def recheck(self):
        """A worker's poll tick: is each kept descriptor the tick uses
        (TICKED) still the directory its path names, as it was checked
        (device, inode, owner, group, mode)?  One stat each, through its
        parent's descriptor (checked just before); the spool's own path as
        given.  At the first that is not, all are closed, opened (and
        checked) again when next used; the others are closed at each tick.
        (All closed and opened again at every tick, they cost an idle
        worker three times the system calls.)  The stats are kept
        (`looked`): the tick's keys of incoming/ and locks/ need none."""
        fds, stat_, self.looked, looked = self.fds, os.stat, {}, {}
        try:
            # (sorted: a parent before its children)
            for sub, (parent, name, seen) in sorted(self._seen.items()):
                if sub not in self.TICKED and sub[:9] != "incoming/":
                    del self._seen[sub]
                    os.close(fds.pop(sub))
                    continue
                st = looked[sub] = stat_(name, dir_fd=fds[parent],
                                         follow_symlinks=False) \
                    if sub else stat_(self.top)
                if (st.st_dev, st.st_ino, st.st_uid, st.st_gid,
                        st.st_mode) != seen:
                    break
            else:
                self.looked = looked
                return True
        except (OSError, KeyError):
            pass
        self.close()
        return False

    def close(self):
        fds, self.fds = self.fds, {}
        self._seen, self.looked = {}, {}
        self._owner = False
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def release(self):
        """The end of a call: the descriptors go, unless a worker of this
        thread keeps them."""
        if not self.kept:
            self.close()

    __del__ = close         # (a thread's doors go with it)


def _door_of(path):
    """(the door of the spool that `path` lies in, the sub-directory of its
    directory); (None, None) outside every spool this process uses."""
    head = path.rpartition("/")[0]
    here = _HERE
    heads = here.heads
    if here.tops != len(_TOPS):     # (a spool new since: paths below it
        heads.clear()               # were taken as outside)
        here.tops = len(_TOPS)
    hit = heads.get(head)
    if hit is None:
        hit = (None, None)
        p = head
        while p:
            if p in _TOPS:
                sub = head[len(p) + 1:].strip("/")
                if ".." in sub.split("/") or "." in sub.split("/"):
                    raise _Refused("%s: not a path of the spool %s" % (path, p))
                hit = (_Door.of(p), sub)
                break
            p = p.rpartition("/")[0]
        if len(heads) > 4096:
            heads.clear()
        heads[head] = hit
    return hit


def _at(path):
    """(directory descriptor, name) for a step on `path`: in a spool, its
    directory's descriptor from the spool's door; elsewhere (None, path)."""
    door, sub = _door_of(path)
    if door is None:
        return None, path
    return door(sub), path.rpartition("/")[2]


def _dir_fd(path):
    """The door's descriptor of directory `path` itself, or None outside
    every spool."""
    path = path.rstrip("/")
    if path in _TOPS:
        return _Door.of(path)("")
    door, sub = _door_of(path + "/.")
    return None if door is None else door(sub)


def _create(path, data, sync=True, mtime=None, mode=0o640, dir_fd=None,
            owner=None, keep=False):
    """Write a new file: exclusively, never through a symlink; fsync when the
    file must survive a power cut before it is renamed into place.  With
    `dir_fd`, the file is created in that directory (its name is the last
    part of `path`); with `owner` (uid, gid), the new file is given away
    through its own descriptor, so no one can swap it for a link first.
    Returns its inode number; with `keep`, (inode, the open descriptor)."""
    _step("create", path, "before")
    if dir_fd is None:
        dir_fd, name = _at(path)
    else:
        name = path.rpartition("/")[2]
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW
                 | O_CLOEXEC, mode, dir_fd=dir_fd)
    _step("create", path, "after")
    try:
        if owner is not None:
            os.fchown(fd, owner[0], owner[1])
        if mode & 0o020:            # group-writable on purpose: past the umask
            os.fchmod(fd, mode)
        if data:
            _step("write", path, "before")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            _step("write", path, "after")
        if mtime is not None:       # before the fsync: the schedule is durable too
            _step("utime", path, "before")
            os.utime(fd, (mtime, mtime))
            _step("utime", path, "after")
        if sync:
            _step("fsync", path, "before")
            os.fsync(fd)
            _step("fsync", path, "after")
        ino = os.fstat(fd).st_ino
    except BaseException:
        os.close(fd)
        _quiet_unlink(path, dir_fd)
        raise
    if keep:
        return ino, fd
    os.close(fd)
    return ino


def _replace(path, data, sync=False, mode=0o640):
    """Put a new version of a file only the owner writes (the policy, a
    worker's or a hold's record, the totals) in place: written beside it,
    in its own directory, which the door checked is the owner's alone (no
    producer can swap the new file before its rename, as one could in
    tmp/), then renamed over it.  With `sync`, fsync'd first and the
    directory after (a record that must survive a power cut whole)."""
    _SEQ[0] += 1
    head, _, name = path.rpartition("/")
    tmp = "%s/.%s.%d.%d.tmp" % (head, name, _PID[0], _SEQ[0])
    _create(tmp, data, sync=sync, mode=mode)
    try:
        _rename(tmp, path)
    except BaseException:
        _quiet_unlink(tmp)
        raise
    if sync:
        _fsync_dir(head)


def _create_empty(path, mode=0o640):
    """An empty new file (EEXIST when the name exists, never through a
    symlink): one mknod() where the kernel allows it, else open + close."""
    global _MKNOD
    if _hook is not None:
        _hook("create", path, "before")
    dfd, name = _at(path)
    if _MKNOD:
        try:
            os.mknod(name, stat.S_IFREG | mode, dir_fd=dfd)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOSYS, errno.EINVAL):
                raise
            _MKNOD = False          # a sandbox that refuses it
    if not _MKNOD:
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | O_NOFOLLOW | O_CLOEXEC, mode, dir_fd=dfd))
    if _hook is not None:
        _hook("create", path, "after")


def _rename(src, dst, src_fd=None, dst_fd=None):
    """rename(2) of the paths' last parts, relative to their directories'
    descriptors (given, or the door's)."""
    if _hook is not None:
        _hook("rename", dst, "before")
    if src_fd is None:
        src_fd, sname = _at(src)
        dst_fd, dname = _at(dst)
    else:
        sname, dname = src.rpartition("/")[2], dst.rpartition("/")[2]
    os.rename(sname, dname, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
    if _hook is not None:
        _hook("rename", dst, "after")


def _take(src, dst):
    """Rename src to dst; False when src is gone (another worker, a
    reaper or an operator took it first).  How a job changes hands."""
    try:
        _rename(src, dst)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def _link(src, dst, src_fd=None, dst_fd=None):
    if _hook is not None:
        _hook("link", dst, "before")
    if src_fd is None:
        src_fd, sname = _at(src)
        dst_fd, dname = _at(dst)
    else:
        sname, dname = src.rpartition("/")[2], dst.rpartition("/")[2]
    os.link(sname, dname, src_dir_fd=src_fd, dst_dir_fd=dst_fd,
            follow_symlinks=False)
    if _hook is not None:
        _hook("link", dst, "after")


def _unlink(path):
    if _hook is not None:
        _hook("unlink", path, "before")
    dfd, name = _at(path)
    os.unlink(name, dir_fd=dfd)
    if _hook is not None:
        _hook("unlink", path, "after")


def _quiet_unlink(path, dir_fd=None):
    try:
        if dir_fd is None:
            dir_fd, name = _at(path)
        else:
            name = path.rpartition("/")[2]
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _utime(path, t):
    """Set a file's times; a symlink's own, never its target's."""
    if _hook is not None:
        _hook("utime", path, "before")
    dfd, name = _at(path)
    os.utime(name, (t, t), dir_fd=dfd, follow_symlinks=False)
    if _hook is not None:
        _hook("utime", path, "after")


def _futime(fd, path, t):
    """_utime by the open descriptor of the file at `path` (a claim's)."""
    if _hook is not None:
        _hook("utime", path, "before")
    os.utime(fd, (t, t))
    if _hook is not None:
        _hook("utime", path, "after")


def _lstat(path):
    """lstat(2) through the door."""
    dfd, name = _at(path)
    return os.stat(name, dir_fd=dfd, follow_symlinks=False)


def _owner_mode(path):
    """(uid, permission bits) of a file, (-1, 0) when it cannot be seen."""
    try:
        st = _lstat(path)
        return st.st_uid, stat.S_IMODE(st.st_mode)
    except OSError:
        return -1, 0


def _lexists(path):
    try:
        _lstat(path)
        return True
    except OSError:
        return False


def _open(path, flags, mode=0o640):
    """open(2) of a file (never through a symlink) through the door."""
    dfd, name = _at(path)
    return os.open(name, flags | O_NOFOLLOW | O_CLOEXEC, mode, dir_fd=dfd)


def _open_reg(path, flags, mode=0o640):
    """A regular file opened (created) without blocking on a FIFO:
    OSError EINVAL for anything else that stands there."""
    fd = _open(path, flags | os.O_NONBLOCK, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock(path, block=True):
    """An flock'd descriptor of the lock file `path` (created; a regular
    file, never a link); None when `block` is False and another holds it.
    Closing it (or dying) frees it."""
    import fcntl
    # The owner's alone (0600): flock needs only a descriptor, so whoever
    # may open a lock file may hold it for ever (review: a producer's).
    fd = _open_reg(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077 and st.st_uid == os.geteuid():
            os.fchmod(fd, 0o600)        # (made before it was so)
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except OSError as e:
        os.close(fd)
        if not block and e.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _own_mode(name, dfd, uid, mode):
    """The regular file `name` in `dfd`, when it is `uid`'s alone (one
    link), given `mode` if it allows more; anything else is left as it
    is (never followed, never adopted)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC,
                     dir_fd=dfd)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid and st.st_nlink == 1 \
                and stat.S_IMODE(st.st_mode) & ~mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _append(path, data, fd=None):
    """Append one record with a single O_APPEND write."""
    if _hook is not None:
        _hook("append", path, "before")
    if fd is None:
        fd2 = _open_reg(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd2, data)
        finally:
            os.close(fd2)
    else:
        os.write(fd, data)
    if _hook is not None:
        _hook("append", path, "after")


def _fsync_dir(path, fd=None):
    """Commit the directory's entries (the renames into it) to disk."""
    if _hook is not None:
        _hook("fsync", path + "/", "before")
    if fd is None:
        fd = _dir_fd(path)
    if fd is not None:
        os.fsync(fd)
    else:
        fd = os.open(path, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if _hook is not None:
        _hook("fsync", path + "/", "after")


def _exists(name, where):
    """Is there an entry `name` in directory `where` (a path or a
    descriptor)?  A symlink counts; it is not followed."""
    try:
        if where.__class__ is int:
            os.stat(name, dir_fd=where, follow_symlinks=False)
        else:
            _lstat(where.rstrip("/") + "/" + name)
        return True
    except OSError:
        return False


def _read_small(path, limit=4096, tail=False):
    """Up to `limit` bytes of a regular file (/proc, a .reason, a record),
    or with `tail` its last `limit` bytes; None when it cannot be read.
    Never follows a symlink, never blocks on a FIFO."""
    try:
        fd = _open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if not tail:
            return os.read(fd, limit)
        if st.st_size > limit:
            os.lseek(fd, st.st_size - limit, 0)
        chunks = []
        while True:
            b = os.read(fd, 65536)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    except OSError:
        return None
    finally:
        os.close(fd)


def _fresh_dir(path):
    """A new descriptor of directory `path`, which the caller closes: in a
    spool through its door (and checked as the door checks), with an offset
    of its own (a scan beside another, or a sweep kept open, reads its
    own)."""
    path = path.rstrip("/")
    if path in _TOPS:
        return _Door.of(path).fresh("")
    door, sub = _door_of(path + "/.")
    if door is None:
        return os.open(path, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    return door.fresh(sub)


def _listdir(path):
    try:
        fd = _fresh_dir(path)
    except OSError:
        return []
    try:
        return os.listdir(fd)
    except OSError:
        return []
    finally:
        os.close(fd)


def _scandir(path):
    """The entries of a directory (DirEntry.path is the name alone: join
    it with `path`; an entry's stat() works while the scan runs, and keeps
    what it found after)."""
    try:
        fd = _fresh_dir(path)
    except OSError:
        return
    try:
        # (the iterator reads a duplicate of fd, and its entries' stat()
        # uses fd itself: it stays open until the iterator is done)
        with os.scandir(fd) as it:
            for e in it:
                yield e
    except OSError:
        return
    finally:
        os.close(fd)


def _dir_stat(path):
    """stat of a directory of the spool, through its descriptor."""
    fd = _dir_fd(path)
    return os.stat(path) if fd is None else os.fstat(fd)


def _space_error(exc):
    return isinstance(exc, OSError) and exc.errno in (
        errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


# Processes ###################################################################

def boot_id():
    global _BOOT_ID
    if _BOOT_ID is None:
        data = _read_small("/proc/sys/kernel/random/boot_id")
        _BOOT_ID = data.decode().strip() if data else ""
    return _BOOT_ID


def boot_time():
    """When this boot began, on the wall clock (/proc/stat's btime), or
    None."""
    data = _read_small("/proc/stat", 1 << 16) or b""
    for line in data.split(b"\n"):
        if line.startswith(b"btime "):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def _before_boot(path, st=None):
    """Was the file at `path` last written before this boot (5 s of the
    clock's slack), so that no process can be writing it now?"""
    boot = boot_time()
    try:
        st = st or _lstat(path)
    except OSError:
        return False
    return bool(boot) and st.st_mtime < boot - 5


def proc_start(pid, living=False):
    """The process's start time in clock ticks since boot (field 22 of
    /proc/PID/stat), or None when there is no such process (or no /proc);
    with `living`, None too for a zombie (killed, not yet waited for: it
    runs nothing and holds nothing)."""
    data = _read_small("/proc/%d/stat" % pid, 1024)
    if not data:
        return None
    try:
        f = data[data.rindex(b")") + 2:].split()
        if living and f[0] in (b"Z", b"X"):
            return None
        return int(f[19])
    except (ValueError, IndexError):
        return None


def _proc_table():
    """{pid: (ppid, pgrp, session)} of every live process, from /proc."""
    table = {}
    for name in _listdir("/proc"):
        if not name.isdigit():
            continue
        data = _read_small("/proc/%s/stat" % name, 1024)
        try:
            f = data[data.rindex(b")") + 2:].split()
            if f[0] not in (b"Z", b"X"):
                table[int(name)] = (int(f[1]), int(f[2]), int(f[3]))
        except (AttributeError, ValueError, IndexError):
            continue            # gone meanwhile
    return table


def run_processes(leader, token=None, start=None):
    """The processes of one handler run: its process group and session
    (`leader` started them with setsid), every descendant of those, and
    every process that carries the run's MYQ_CLAIM=token in its environment
    (a child that called setsid and was re-parented to init still has it).
    With `start` (a record read from disk, not our own child), the group
    counts only while the leader is that very process: its pid may have
    been handed out again.  Standard library only: no cgroups, no prctl."""
    table = _proc_table()
    found = set()
    if start is None or _pid_alive(leader, start):
        found.update(p for p, (_, pgrp, sid) in table.items()
                     if leader in (p, pgrp, sid))
    if token:
        marker = ("MYQ_CLAIM=" + token).encode()
        for p in table:
            if p not in found:
                env = _read_small("/proc/%d/environ" % p, 1 << 20)
                if env and marker in env.split(b"\0"):
                    found.add(p)
    more = True
    while more:             # descendants, to the last generation
        more = False
        for p, (ppid, _, _) in table.items():
            if ppid in found and p not in found:
                found.add(p)
                more = True
    found.difference_update((0, 1, os.getpid(), os.getppid()))
    return found


def kill_run(leader, sig, token=None, start=None):
    """Signal everything a handler run started (see run_processes).
    Returns how many processes were signalled."""
    n = 0
    for p in run_processes(leader, token, start):
        try:
            os.kill(p, sig)
            n += 1
        except OSError:
            pass
    return n


def _writer_lives(name):
    """Does the process that is writing .NAME.PID.N.tmp still run?  Such a
    file is a crash's leftover only once it does not: by its age alone, a
    process whose clock jumped a year ahead took another's record from
    under its rename (seen in test_clock)."""
    pid = name.split(".")[-3:-2]
    return bool(pid) and pid[0].isascii() and pid[0].isdigit() \
        and int(pid[0]) > 1 \
        and proc_start(int(pid[0]), living=True) is not None


def _pid_alive(pid, start):
    """True when `pid` runs and is the process that started at `start`.
    A record's values are checked here: a pid that is not a number above 1
    (or a start that is not a number) is never alive."""
    if pid.__class__ is not int or pid <= 1 or start.__class__ is not int:
        return False
    s = proc_start(pid, living=True)
    return s is not None and s == start


def _kill_hung(pid, start):
    """SIGKILL the process `pid` that started at `start` (a hung worker):
    True when it was sent."""
    if not _pid_alive(pid, start):
        return False
    try:
        os.kill(pid, 9)
    except OSError:         # (another user's: taken back all the same)
        return False
    return True


def _user_ids(owner):
    """'USER[:GROUP]' (names or numbers) -> (uid, gid)."""
    import pwd
    import grp
    user, _, group = owner.partition(":")
    try:
        pw = pwd.getpwnam(user) if not user.isdigit() else pwd.getpwuid(int(user))
        gid = pw.pw_gid
        if group:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except (KeyError, ValueError):
        raise ConfigError("no such user or group %r; give --owner USER[:GROUP]"
                          % owner)
    return pw.pw_uid, gid


def become(uid, gid):
    """Switch this process to uid/gid for good (from root): its groups too.
    json and re, imported at their first use (a producer's fast start),
    are imported first: the interpreter's library may be one the new user
    cannot read (a Python under /root), and the command goes on to use
    them (a long-running one: _readable_library)."""
    import pwd
    json.loads, re.compile
    try:
        os.initgroups(pwd.getpwuid(uid).pw_name, gid)
    except (KeyError, OSError):
        os.setgroups([gid])
    os.setgid(gid)
    os.setuid(uid)


def _readable_library(uid):
    """A worker, an intake or a supervisor that became `uid` imports much
    more than json and re: ConfigError when it cannot read this Python's
    library (a worker died of "No module named 'select'", a supervisor's
    restarted without a word: review)."""
    lib = os.path.dirname(os.__file__)
    if not os.access(lib, os.R_OK | os.X_OK):
        raise ConfigError("uid %d cannot read this Python's library (%s): run "
                          "myq with a Python installed where that user can "
                          "read it (not under /root)" % (uid, lib))


# How myq starts and titles a process of its own, as the core does it: a
# child is `python3 myq.py WORDS` (start), exec'd (area: no room known to
# retitle a forked child; title, env_block: none made; retitle: refused),
# the heap as the interpreter leaves it.  The process image (Part II)
# registers its own: a worker from the cached byte code, a forked child
# retitled, the compiler's heap given back.
_IMAGE = {
    "start": lambda python=None, cached=False: [
        python or sys.executable, os.path.abspath(__file__)],
    "area": lambda: None,
    "title": lambda area, words, need: None,
    "env_block": lambda area, env: None,
    "retitle": lambda area, title, env: False,
    "dumpable": lambda: False,
    "prog": lambda: os.path.abspath(__file__),
    "give_back_heap": lambda reexec=False: None,
}


# The job model ###############################################################

def _reject_constant(name):
    raise ValueError("%s is not valid JSON" % name)


def _finite_float(text):
    v = float(text)
    if v - v:           # inf - inf is nan (true); a finite v gives 0.0
        raise ValueError("number %s is out of range" % text[:40])
    return v


_DECODER = _Later(lambda: json.JSONDecoder(parse_constant=_reject_constant,
                                            parse_float=_finite_float))
_WS = _Pattern(r"[ \t\n\r]*")
_SURROGATE = _Pattern(r"\\u[dD][89a-fA-F]")
MAX_DEPTH = 64              # nesting of a job; far below any recursion limit
MAX_TIME = 1e11             # epoch seconds (year 5138): beyond is a mistake


def _check_depth(obj, depth=1):
    """Refuse nesting deeper than MAX_DEPTH (obj itself at `depth`).
    Iterative: no recursion."""
    stack = [(obj, depth)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, (list, tuple)):
            continue
        if depth > MAX_DEPTH:
            raise InvalidJob("JSON nested deeper than %d levels" % MAX_DEPTH)
        for x in v:
            if isinstance(x, (dict, list, tuple)):
                stack.append((x, depth + 1))


def _check_value(obj, text):
    """Refuse what parses but cannot be stored again: nesting deeper than
    MAX_DEPTH, lone surrogates (\\ud800).  `text` is what obj was parsed
    from: with few brackets, or no \\uD8xx escape, there is nothing to walk."""
    if text.count("{") + text.count("[") > MAX_DEPTH:
        _check_depth(obj)
    if "\\u" in text and _SURROGATE.search(text):   # (no escape: no re)
        dumps(obj)


_ENCODER = _Later(lambda: json.JSONEncoder(ensure_ascii=False, allow_nan=False,
                                            separators=(",", ":")))


def dumps(job):
    """The bytes of a job file: one line of UTF-8 JSON.  Raises InvalidJob
    for what JSON cannot hold (NaN, a lone surrogate, a set …)."""
    try:
        return (_encode_value(job) + "\n").encode("utf-8")
    except UnicodeError:
        raise InvalidJob("JSON string with a lone surrogate (\\ud800…)")
    except (ValueError, TypeError, RecursionError) as e:
        raise InvalidJob("job cannot be stored as JSON: %s" % e)


_NEW_KEYS = ("id", "type", "payload", "attempts", "available_at", "created_at",
             "updated_at", "last_error")
_NEW_FORMAT = ('{"id":"%s","type":"%s","payload":%s,"attempts":0,'
               '"available_at":%s,"created_at":%s,"updated_at":%s,'
               '"last_error":null}\n')


# json.encoder's C parts, taken from _json itself: importing json.encoder
# imports json, and json imports re (see _OnFirstUse).
try:
    from _json import make_encoder as _c_make_encoder, \
        encode_basestring as _encode_basestring, make_scanner as _c_make_scanner
except ImportError:
    _c_make_encoder = _c_make_scanner = None


def _not_json(o):
    """JSONEncoder.default's error, word for word (3.7-3.13)."""
    raise TypeError("Object of type %s is not JSON serializable"
                    % o.__class__.__name__)


def _encode_value(v):
    """_ENCODER.encode(v) without its Python layers (JSONEncoder.iterencode
    makes this very C encoder, with these arguments, in 3.7-3.13)."""
    if _c_make_encoder is None:
        return _ENCODER.encode(v)
    if v.__class__ is str:
        return _encode_basestring(v)    # what encode() does with a str
    return "".join(_c_make_encoder({}, _not_json, _encode_basestring,
                                   None, ":", ",", False, False, False)(v, 0))


# The same encoder made once, without a record of the containers it is in
# (a cycle ends in RecursionError where it said "Circular reference"): the
# SQLite store's usual enqueue, whose caller goes the general way on any
# error, which words it (3,600 instructions a job less than _encode_value).
_ENCODE_ONCE = _c_make_encoder and _c_make_encoder(
    None, _not_json, _encode_basestring, None, ":", ",", False, False, False)


class _ScanRules(object):
    """What _json.make_scanner reads of a JSONDecoder: _DECODER's rules."""
    strict, object_hook, object_pairs_hook = True, None, None
    parse_float, parse_int = staticmethod(_finite_float), int
    parse_constant = staticmethod(_reject_constant)


def _scanner():
    """_json's C scanner of _DECODER's rules, made once; None without it."""
    if not _SCANNER and _c_make_scanner is not None:
        _SCANNER.append(_c_make_scanner(_ScanRules()))
    return _SCANNER[0] if _SCANNER else None


def _decode(text):
    """_DECODER.decode(text), the same value, by _json's C scanner alone
    (json's Python layer is not imported); anything but a whole value,
    ended by blanks only: _DECODER.decode's own error (or value)."""
    scan = _SCANNER[0] if _SCANNER else _scanner()
    if scan is not None:
        start = len(text) - len(text.lstrip(" \t\n\r"))
        try:
            obj, end = scan(text, start)
        except Exception:   # (3.7-3.11: SystemError, as json.decoder, the
            obj, end = None, -1     # error's class, is not imported yet)
        if end >= 0 and not text[end:].strip(" \t\n\r"):
            return obj
    return _DECODER.decode(text)


def _dumps_new(job):
    """dumps() of a job new_job() made: the same bytes.  The usual shape
    (no options) in one format, each time formatted once (created_at =
    updated_at = available_at without a delay; repr of a float costs more
    than the rest of the encoding); the keys are new_job()'s and need no
    escaping, the id and type passed NAME_RE.  Any other: dumps()."""
    c = job["created_at"]
    if c.__class__ is float and tuple(job) == _NEW_KEYS:
        # the usual shape (no options): one format
        a, p, jid, t = job["available_at"], job["payload"], job["id"], job["type"]
        if a.__class__ is float and job["updated_at"] is c \
                and -MAX_TIME < c < MAX_TIME and -MAX_TIME < a < MAX_TIME \
                and jid.__class__ is str and t.__class__ is str \
                and job["attempts"].__class__ is int and job["attempts"] == 0 \
                and job["last_error"] is None:
            tc = c.__repr__()
            try:
                return (_NEW_FORMAT % (
                    jid, t, "null" if p is None else _encode_value(p),
                    tc if a == c and c else a.__repr__(), tc, tc)
                        ).encode("utf-8")
            except UnicodeError:
                raise InvalidJob("JSON string with a lone surrogate (\\ud800…)")
            except (ValueError, TypeError, RecursionError) as e:
                raise InvalidJob("job cannot be stored as JSON: %s" % e)
    return dumps(job)       # (options: the general encoder)


def parse(data):
    """Split a job file into (job object, [trailer records]).

    The job is the first JSON value; what follows are the lines a worker
    appended (`{"lease": …}`, `{"handler": …}`).  Anything else after the
    job makes the file invalid.  Raises InvalidJob."""
    if not data.strip(b"\0 \t\r\n"):
        raise InvalidJob("empty: a producer wrote nothing, or a crash or a "
                         "power cut ended an enqueue before it returned (and "
                         "before it promised anything)")
    try:
        text = data.decode("utf-8")
    except UnicodeError as e:
        raise InvalidJob("not UTF-8: %s" % e)
    scan = _SCANNER[0] if _SCANNER else _scanner()
    try:
        obj, end = scan(text, len(text) - len(text.lstrip(" \t\n\r")))
    except Exception:       # (not JSON, or no scanner: json's own words)
        try:
            obj, end = _DECODER.raw_decode(text, _WS.match(text).end())
        except RecursionError:
            raise InvalidJob("JSON nested too deep")
        except ValueError as e:
            raise InvalidJob("not JSON: %s" % e)
    _check_value(obj, text)
    tail = text[end:]
    if tail == "\n" or not tail:
        return obj, []          # (a job file as myq writes it)
    # A power cut can keep an append's new length but not its bytes (ext4's
    # delayed allocation): the file then ends in NULs, maybe after half a
    # line.  The job before it was fsynced whole; what the cut tore is a
    # worker's record, dropped here (the power-cut harness found this).
    torn = tail.endswith("\0")
    lines = tail.rstrip("\0").splitlines() if torn else tail.splitlines()
    trailers = []
    for i, line in enumerate(lines):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            rec = None
        if not (isinstance(rec, dict) and len(rec) == 1
                and ("lease" in rec or "handler" in rec)):
            if torn and i == len(lines) - 1:
                break
            raise InvalidJob("unexpected data after the job object")
        trailers.append(rec)
    return obj, trailers


def _check_ref(jid):
    """A job reference from the command line or the API: an id, or the
    name of a file in failed/ (any one path component).  Returns it, or
    raises InvalidJob before anything touches the disk."""
    if not isinstance(jid, str):
        raise InvalidJob("a job id is a string, not %s" % type(jid).__name__)
    if (not jid or jid in (".", "..") or "/" in jid or "\0" in jid
            or len(jid) > 255 or jid.endswith(".reason")):
        raise InvalidJob("bad job id %s: 1-128 characters of A-Z a-z 0-9 . _ -,"
                         " not starting with '.' (or a name from: myq list "
                         "failed)" % json.dumps(jid)[:140])
    return jid


def _ids(ids):
    """A list of job references; a single string is one id, not letters."""
    if isinstance(ids, str):
        return [ids]
    return list(ids)


def _is_name(value):
    """NAME_RE.match(value) for a str, without re (see _OnFirstUse); as
    fast (str.strip of the 65 name characters was a third slower: a search
    of them for each character)."""
    return 0 < len(value) <= 128 and value[0] != "." and value.isascii() and (
        value.replace("-", "").replace("_", "").replace(".", "").isalnum()
        or not value.strip("._-"))


def _is_generated_id(jid):
    """GENERATED_ID_RE.match(jid) for a str: without re until it is
    imported (a producer), then by it (a worker asks twice a claim)."""
    if re.__class__ is not _OnFirstUse:
        return GENERATED_ID_RE.match(jid) is not None
    return len(jid) == 22 and jid[13] == "-" and jid.isascii() \
        and jid[:13].isdigit() and not jid[14:].strip("0123456789abcdef")


def _check_name(value, what):
    # _is_name until re is imported (a producer), then the expression (a
    # worker checks two names a job: 2,600 instructions less a drained job)
    if not isinstance(value, str) or not (
            _is_name(value) if re.__class__ is _OnFirstUse else NAME_RE.match(value)):
        raise InvalidJob("bad %s %s: 1-128 characters of A-Z a-z 0-9 . _ -, "
                         "not starting with '.'" % (what, json.dumps(value)[:140]))


def _is_num(v):
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and v == v and abs(v) != float("inf"))


_NUM = (int, float)     # exactly: bool is not a number here


# One place per field rule: new_job() (producers) and normalize() (every
# file a worker reads) both call these.

def _check_max_attempts(m):
    if m is not None and (m.__class__ is not int or not 1 <= m < 10 ** 9):
        raise InvalidJob("max_attempts must be an integer >= 1 (below 1e9)")


def _check_timeout(t):
    if t is not None and (t.__class__ not in _NUM or t != t or not 0 < t < 1e9):
        raise InvalidJob("timeout must be a number of seconds > 0 (below 1e9)")


def _check_priority(p):
    if p is not None and (p.__class__ is not int or not -9 <= p <= 9):
        raise InvalidJob("priority must be an integer from -9 to 9")


def normalize(obj, stem=None, mtime=None, named=False):
    """Validate a job object and fill in the defaults of myq-spool(5) JOB FILES.

    `stem` is the file name without .json (the id when the job has none;
    `named`: a name checked already, the claim's); `mtime` stands in for
    a missing created_at (a shell producer's file).  Runs for every
    claim: kept to plain comparisons, a name checked once (the id's
    stem by the claim, a type at its first job: _TYPES_OK)."""
    if obj.__class__ is dict and named and tuple(obj) == _NEW_KEYS:
        # new_job()'s shape, claimed: its fields' types and ranges alone
        t, c, a, u = obj["type"], obj["created_at"], obj["available_at"], \
            obj["updated_at"]
        n, e = obj["attempts"], obj["last_error"]
        if obj["id"] == stem and t.__class__ is str and t in _TYPES_OK and \
                n.__class__ is int and 0 <= n < 10 ** 9 and \
                c.__class__ is float and a.__class__ is float and \
                u.__class__ is float and -MAX_TIME < c < MAX_TIME and \
                -MAX_TIME < a < MAX_TIME and -MAX_TIME < u < MAX_TIME and \
                (e is None or e.__class__ is str):
            return dict(obj)
    if not isinstance(obj, dict):
        raise InvalidJob("a job is a JSON object, not %s" % type(obj).__name__)
    job = dict(obj)
    jid = job.get("id")
    if jid is None:
        if stem is None:
            raise InvalidJob("job has no id")
        job["id"] = jid = stem
    if not named or jid != stem:
        _check_name(jid, "id")
    if stem is not None and jid != stem:
        raise InvalidJob("id %s does not match the file name %s.json"
                         % (jid, stem))
    if "type" not in job:
        raise InvalidJob("job has no type")
    t = job["type"]
    if t.__class__ is not str or t not in _TYPES_OK:
        _check_name(t, "type")
        if len(_TYPES_OK) < 1024:
            _TYPES_OK.add(t)
    job.setdefault("payload", None)
    a = job.setdefault("attempts", 0)
    if a.__class__ is not int or not 0 <= a < 10 ** 9:
        raise InvalidJob("attempts must be an integer >= 0 (below 1e9)")
    v = job.get("max_attempts")
    if v is not None:
        _check_max_attempts(v)
    created = job.get("created_at")
    avail = job.get("available_at")
    upd = job.get("updated_at")
    if not (created.__class__ is float and avail.__class__ is float
            and upd.__class__ is float and "expires_at" not in job
            and -MAX_TIME < created < MAX_TIME and -MAX_TIME < avail < MAX_TIME
            and -MAX_TIME < upd < MAX_TIME):        # (myq's own jobs are)
        for key in ("created_at", "available_at", "updated_at", "expires_at"):
            v = job.get(key)
            if v is not None and (v.__class__ not in _NUM
                                  or not -MAX_TIME < v < MAX_TIME):
                raise InvalidJob("%s must be a number of epoch seconds (below "
                                 "%g)" % (key, MAX_TIME))
        if created is None:
            job["created_at"] = created = mtime if mtime is not None else _now()
        if avail is None:
            job["available_at"] = created
        if upd is None:
            job["updated_at"] = created
    v = job.get("timeout")
    if v is not None:
        _check_timeout(v)
    v = job.get("priority")
    if v is not None:
        _check_priority(v)
    e = job.setdefault("last_error", None)
    if e is not None and not isinstance(e, str):
        job["last_error"] = str(e)
    return job


# The fields only myq writes (myq-spool(5) JOB FILES): a batch's identity,
# a claim's lease and token, a hold, the failures' history and times, the
# SQLite store's own columns.  A producer's file is never trusted with them
# (review: a producer's batch_of pulled other jobs in early, and an absolute
# one made the worker open any path): they are dropped when a worker takes
# in a file that is not the owner's (Claims._read_claimed, the drop box).
_MYQ_FIELDS = frozenset((
    "batch_of", "lease", "token", "held", "state", "failures", "failed_at",
    "retried_at", "worker_id", "leased_until", "finished_at", "status", "lane",
    "queue", "size", "extra"))


def _untrusted(job, uid, owner):
    """`job`, read from a file of `uid` in a spool of `owner`: without the
    fields only myq writes unless the file is the owner's (or root's)."""
    if uid != owner and uid != 0 and not _MYQ_FIELDS.isdisjoint(job):
        for k in _MYQ_FIELDS.intersection(job):
            del job[k]
    return job


def _is_batch_name(name):
    """A batch's name, LEAD+TOKEN (two names): never a path."""
    if name.__class__ is not str:
        return False
    lead, plus, token = name.partition("+")
    return bool(plus) and _is_name(lead) and _is_name(token)


def _new_id(now):
    """Millisecond time, then a random suffix that counts up within one
    process and millisecond, so that ids sort in creation order."""
    ms = int(now * 1000)
    if ms <= _LAST_ID[0]:
        ms, n = _LAST_ID[0], _LAST_ID[1] + 1
    else:
        if not _RANDOM:
            b = os.urandom(64)
            _RANDOM[:] = [int.from_bytes(b[i:i + 4], "big") >> 2
                          for i in range(0, 64, 4)]
        n = _RANDOM.pop()
    _LAST_ID[:] = [ms, n]
    # (13 digits since 2001 without the padding's cost: 500 instructions)
    return ("%d-%08x" if ms >= 1000000000000 else "%013d-%08x") % (ms, n)


def new_job(type, payload=None, id=None, delay=0, max_attempts=None,
            timeout=None, now=None, priority=None, ttl=None):
    """A fresh job object with the defaults of myq-spool(5) JOB FILES, validated as
    normalize() would (raises InvalidJob).  What JSON cannot hold (NaN, a
    lone surrogate, a set) is refused by dumps(), which every caller runs."""
    now = _now() if now is None else now
    if id is None:
        id = _new_id(now)
    else:
        _check_name(id, "id")
    _check_name(type, "type")
    if not ((delay.__class__ is int or delay.__class__ is float
             or _is_num(delay)) and 0 <= delay < 1e10):     # (nan, inf fail)
        raise InvalidJob("delay must be a number of seconds >= 0 (below 1e10)")
    if not -MAX_TIME < now < MAX_TIME - 1e10:
        raise InvalidJob("the clock says %r: not a time myq can store" % now)
    if isinstance(payload, (dict, list, tuple)):
        _check_depth(payload, 2)     # the job object is level 1
    if max_attempts is None and timeout is None and priority is None \
            and ttl is None:        # (the keys in the order below)
        return {"id": id, "type": type, "payload": payload, "attempts": 0,
                "available_at": now + delay, "created_at": now,
                "updated_at": now, "last_error": None}
    job = {"id": id, "type": type, "payload": payload, "attempts": 0}
    if max_attempts is not None:
        _check_max_attempts(max_attempts)
        job["max_attempts"] = max_attempts
    job["available_at"] = now + delay
    job["created_at"] = job["updated_at"] = now
    if timeout is not None:
        _check_timeout(timeout)
        job["timeout"] = timeout
    if priority is not None:
        _check_priority(priority)
        job["priority"] = priority
    if ttl is not None:
        if not (_is_num(ttl) and 0 < ttl < 1e10):
            raise InvalidJob("ttl must be a number of seconds > 0 (below 1e10)")
        job["expires_at"] = now + ttl
    job["last_error"] = None
    return job


FAILURES_KEPT = 5           # failures a job keeps for `show` (myq-spool(5) JOB FILES)


def _clip(text, limit=ERROR_MAX):
    """An error for last_error: how the run ended (the start: exit status,
    signal, HTTP status, exception type) and the end of its output, with
    the middle cut out when it is too long."""
    if len(text) <= limit:
        return text
    head = limit // 4
    return text[:head] + " … " + text[-(limit - head - 3):]


def note_failure(job, attempt, error, tb=None, now=None):
    """Record a failure in the job: last_error, and the history `failures`
    (the last FAILURES_KEPT, each {"at", "attempt", "error"} and, for a
    Python handler, the last lines of its traceback)."""
    job["last_error"] = error = _clip(error or "failed")
    rec = {"at": round(_now() if now is None else now, 3), "attempt": attempt,
           "error": _clip(error, 500)}
    if tb:
        rec["traceback"] = tb
    old = job.get("failures")
    job["failures"] = ((old if isinstance(old, list) else []) + [rec])[-FAILURES_KEPT:]


def _rewritten(obj):
    """Has a worker written this job (a retry, a release)?  Then it may have
    grown past --max-job-bytes by what the worker added (last_error, the
    defaults), and SLACK bytes more are allowed."""
    return (obj.get("attempts") not in (None, 0)
            or obj.get("updated_at") != obj.get("created_at"))


def _lease_of(trailers):
    for rec in reversed(trailers):
        if "lease" in rec and isinstance(rec["lease"], dict):
            return rec["lease"]
    return None


def _effective_available(job, now):
    """available_at, capped at now + the intended delay when the producer's
    clock was ahead (created_at in the future)."""
    avail = job["available_at"]
    created = job["created_at"]
    if avail > now and created > now:
        avail = min(avail, now + max(0.0, avail - created))
    return avail


def _claim_name(jid, token, ext="json"):
    """The name of a claim: ID+WID.SEQ.json (ext "fin": being finished,
    "new": its next version, beside it in processing/)."""
    return "%s+%s.%s" % (jid, token, ext)


def _claim_token(path):
    """'processing/ID+WID.SEQ.json' -> 'WID.SEQ'."""
    return os.path.basename(path).rpartition(".")[0].partition("+")[2]


def _claim_lease(path, st, job, trailers):
    """The lease of the claim at `path` (ID+WID.SEQ.json) whose lstat is
    `st`: the line an older myq appended, else what the claim itself says
    (myq-spool(5) CLAIMS): its token names the worker (its record
    locks/workers/WID.json), its mtime is the lease's end, and the attempt
    is the file's + 1 (a claim is a run begun: taken back, it counts).  Of
    a file in done/ (no token): its run's attempt while its mtime, the
    lease's end, is later than its ctime, the success's rename (else it
    did not run here: imported, or done already)."""
    lease = _lease_of(trailers)
    if lease is not None:
        return lease
    token = _claim_token(path)
    if not token and st.st_mtime <= st.st_ctime:
        return None
    return {"worker": token.rpartition(".")[0], "token": token,
            "attempt": job["attempts"] + 1,
            "leased_until": round(st.st_mtime, 3)}


def _split_claim(name):
    """'ID+WID.SEQ.json' -> (ID, WID, 'json'); None for other names."""
    base, dot, ext = name.rpartition(".")
    if not dot or ext not in ("json", "fin") or "+" not in base:
        return None
    jid, _, token = base.partition("+")
    wid = token.rpartition(".")[0]
    if not jid or not wid:
        return None
    return jid, wid, ext


# Per-type policy #############################################################
#
# The rules live in SPOOL/policy.json, {"*": {KEY: VALUE}, "TYPE": {...}},
# the values in canonical form (seconds, bytes, "N/PERIOD", true/false).
# Waiting jobs of a type whose rules need them apart (bounds, pause, limits,
# batches), or with a priority other than 0, live in a lane of their own,
# incoming/lanes/TYPE@PRIORITY/: a worker skips a paused or held type without
# reading its files, counts a type's backlog with one listing, and finds a
# priority-9 job among 100,000 others by looking in one small directory.

POLICY_FILE = "policy.json"
NAME_FILE = "name"          # the queue's name, when not the directory's
LANES = "incoming/lanes"
LANE_RE = _Pattern(r"([A-Za-z0-9_-][A-Za-z0-9._-]{0,127})@(-?[0-9])\Z")
_LANE_PRIORITIES = frozenset(s + str(d) for s in ("", "-") for d in range(10))


def _lane_of(name):
    """LANE_RE.match(name).groups(), or None, without re (see _OnFirstUse)."""
    stem, at, p = name.partition("@")
    return (stem, p) if at and p in _LANE_PRIORITIES and _is_name(stem) else None
_LANE_KEYS = ("max_queued", "max_bytes", "paused", "concurrency", "rate",
              "batch", "order", "durable")
_RATE_RE = _Pattern(r"\s*(\d+)\s*/\s*(\d*\.?\d*)\s*(ms|s|m|h|d)\s*\Z")
SANE_TIME = 1577836800.0    # 2020-01-01: a clock before it was never set
SPOOL_POLICY = "@spool"     # the policy file's entry of the spool's own rules



# The rules every store applies to a job and its type's policy (Store's
# implementations call these, so that the stores cannot disagree).

def job_expiry(job, ttl):
    """When a job expires (myq(1) policy), or None: its own expires_at,
    else (its retry, or its creation) + `ttl`, its type's.  Times from a
    clock that was never set (before 2020) expire nothing: a device
    without a real-time clock boots in 1970 and jumps at its first NTP
    sync."""
    e = job.get("expires_at")
    if e is None and ttl is None:
        return None
    since = job.get("retried_at") or job.get("created_at") or 0
    if since < SANE_TIME:
        return None
    return since + ttl if e is None else e


def revive(job, t, ttl):
    """A dead job made to wait again (retry): attempts from 0, due at `t`,
    its failure's time gone, and its ttl (its own or `ttl`, its type's)
    counting from `t`."""
    job.update(attempts=0, available_at=t)
    job.pop("failed_at", None)
    if job.pop("expires_at", None) is not None or ttl:
        job["retried_at"] = t
    return job


def dedupe_fresh(finished, window, now):
    """Whether a job finished at `finished` still holds its id against a
    producer's same id (the de-duplication window; a finish in the
    future, the clock set back, holds it)."""
    return finished + window > now or finished > now

def _choice(*allowed):
    def value(v):
        if v not in allowed:
            raise ValueError(v)
        return v
    return value


def rate_of(text):
    """'30/m' -> (30, 60.0): N starts per PERIOD seconds."""
    m = _RATE_RE.match(str(text))
    if not m or m.group(2) in (".",):
        raise ValueError(text)
    n, per = int(m.group(1)), float(m.group(2) or 1) * _UNITS[m.group(3)]
    if not 1 <= n <= 10 ** 6 or not 0 < per < 1e9:
        raise ValueError(text)
    return n, per


def url_origin(url):
    """The circuit breaker's destination of an http URL (myq(1) holds),
    "scheme://host:port" (lower case, the port explicit), or None when it
    is not an http or https URL with a host.  Without urllib (a policy is
    set where python3-light has none); http_dest() agrees with it."""
    scheme, sep, rest = str(url).partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("http", "https"):
        return None
    for ch in "/?#":
        rest = rest.partition(ch)[0]
    netloc = rest.rpartition("@")[2]
    if netloc.startswith("["):
        host, close, tail = netloc[1:].partition("]")
        if not close or tail and not tail.startswith(":"):
            return None
        port, host = tail[1:], "[%s]" % host.lower()
    else:
        host, _, port = netloc.partition(":")
        host = host.lower()
    if not host or host == "[]" or port and not (
            port.isascii() and port.isdigit() and int(port) <= 65535):
        return None
    port = int(port) if port else (443 if scheme == "https" else 80)
    return "%s://%s:%d" % (scheme, host, port)


def parse_urls(v):
    """A type's destinations (myq(1) policy `url`): one or more http or
    https URLs, in order, space-separated: canonical "A B", at most 8."""
    urls = str(v).split()
    if not 1 <= len(urls) <= 8 or len(set(urls)) != len(urls):
        raise ValueError(v)
    for u in urls:
        # (ASCII only: a path that is not would make every job of the type
        # unsendable, dead; a host that is not, never found: punycode it)
        if url_origin(u) is None or url_origin(u).endswith(":0") or any(
                not 33 <= ord(ch) <= 126 for ch in u):
            raise ValueError(v)
    return " ".join(urls)


def parse_topic(v):
    """A type's MQTT topic (myq(1) policy `topic`): no wildcard, no NUL."""
    if not isinstance(v, str) or not v or "+" in v or "#" in v or "\0" in v \
            or len(v.encode("utf-8", "surrogatepass")) > 65535:
        raise ValueError(v)
    return v


def parse_percent(v):
    """'50%' or 50 -> 50: a share from 0 to 100."""
    text = str(v).strip()
    return parse_int(text[:-1] if text.endswith("%") else text, 0, 100)


def _quoted(v):
    """A value as `myq policy` prints it: in double quotes when it has
    blanks or what a shell would take for its own (a query's & and ?, a
    $), `"`, `\\`, `$` and backquote escaped in them, so that the line
    can be given back to a shell."""
    if all(ch.isalnum() and ord(ch) < 128 or ch in "_./:@%+=,-" for ch in v):
        return v
    return '"%s"' % "".join("\\" + ch if ch in '"\\$`' else ch for ch in v)


_OWN_FORM = {"url": ("url", "method", "headers", "body", "timeout"),
             "topic": ("topic", "message", "qos", "retain")}


def own_destination(job, rules):
    """Why `job` may not be queued under its type's `url` or `topic`
    (myq(1) policy: the producer sends only the body), or None: its
    payload is an object that names a destination of its own: the http
    or mqtt job's form, its `url` (`topic`) and no key but that form's (a
    body that only has a "url" field among its data is a body)."""
    p = job.get("payload")
    if not isinstance(p, dict):
        return None
    for key, field in (("url", "url"), ("topic", "topic")):
        if rules.get(key) and field in p and all(
                k in _OWN_FORM[key] for k in p):
            return ("job %s of type %s names its own %s, but the type's policy "
                    "gives it (%s=%s): enqueue only the body as the payload"
                    % (job.get("id"), job.get("type"), field, key,
                       _clip(rules[key], 200)))
    return None


def parse_rate(v):
    """A rate's canonical text: '30 / 1m' -> '30/m' (rate_of: its numbers)."""
    rate_of(v)              # the check; then its canonical text
    n, per, unit = _RATE_RE.match(str(v)).groups()
    return "%s/%s%s" % (n, "" if per in ("", "1") else per, unit)


def parse_uplink(v):
    """--uplink-rate '16K/s' -> 16384.0 bytes a second (SIZE/PERIOD)."""
    size, slash, per = str(v).partition("/")
    per = per.strip()
    if not slash or per[-1:] not in ("s", "m", "h") or per[-2:] == "ms":
        raise ValueError(v)
    n = float(per[:-1] or 1) * _UNITS[per[-1]]
    rate = parse_size(size.strip()) / n
    if not 0 < rate < 1e15:
        raise ValueError(v)
    return rate


UPLINK = Kind(parse_uplink, "SIZE/s such as 16K/s (or /m, /h)", "SIZE/s",
              lambda v: "%s/s" % _format_size(int(v)) if v else "none")


def _parse_ram_max(v):
    """ram_max: a number of jobs (1000), or a size with its unit (1M)."""
    if v.__class__ is int or isinstance(v, str) and v.strip().isdigit():
        return parse_int(v, 1, 10 ** 6)
    if not isinstance(v, str) or not v.strip()[-1:].isalpha():
        raise ValueError(v)
    return _format_size(parse_size(v))


class Policy(object):
    """The per-type rules (myq(1) policy): its keys, each one Kind of value (the
    kinds the command line's options are, where they are the same), and
    a policy file's object checked and in canonical form (numbers whole
    where they are: 3600, not 3600.0).  The spool reads and writes the
    file (Spool.policy, rules, set_policy)."""

    KEYS = {
        "handler": Kind(_choice("http", "mqtt"), "http or mqtt"),
        "max_queued": Kind(lambda v: parse_int(v, 0, 10 ** 9),
                           "a number of jobs"),
        "max_bytes": Kind(parse_size, "a size such as 512K or 10M",
                          show=_format_size),
        "overflow": Kind(_choice("reject", "drop-oldest"),
                         "reject or drop-oldest"),
        "ttl": Kind(lambda v: _whole(parse_seconds(v, True, 1e10)),
                    "a duration such as 90s, 15m, 1h, 7d",
                    show=_format_duration),
        "priority": PRIORITY,
        "concurrency": Kind(lambda v: parse_int(v, 1, 10000),
                            "a number of runs >= 1"),
        "rate": Kind(parse_rate, "N/PERIOD such as 1/s, 30/m, 500/h"),
        "breaker": Kind(lambda v: parse_int(v, 0, 10 ** 6),
                        "a number of failures (0: off)"),
        "paused": BOOL,
        "batch": Kind(lambda v: parse_int(v, 1, 10000),
                      "a number of jobs >= 1"),
        "batch_bytes": Kind(parse_size, "a size such as 64K", show=_format_size),
        "batch_wait": Kind(lambda v: _whole(parse_seconds(v, False, 1e10)),
                           "a duration such as 0, 500ms, 5s",
                           show=_format_duration),
        "gzip": BOOL,
        "url": Kind(parse_urls, "one or more http or https URLs, in order, "
                    "space-separated (the first not held is used), at most 8, "
                    "ASCII (percent-encode a path, punycode a host)",
                    show=_quoted),
        "topic": Kind(parse_topic, "an MQTT topic without + or #",
                      show=_quoted),
        "format": Kind(_choice("json", "kafka"), "json or kafka"),
        "order": Kind(_choice("fifo", "live-first"), "fifo (the default) or "
                      "live-first"),
        "live": Kind(lambda v: _whole(parse_seconds(v, True, 1e10)),
                     "a duration > 0 such as 60s, 5m (default 60s)",
                     show=_format_duration),
        "backlog_share": Kind(parse_percent, "a percentage from 0 to 100 "
                              "such as 50 or 50% (default 50)",
                              show=lambda v: "%d%%" % v),
        "envelope": BOOL,
        "durable": Kind(_choice("always", "outage"), "always (the default: "
                        "on the spool's filesystem first) or outage (RAM "
                        "first: myq --spool DIR init --ram RAMDIR)"),
        "spill_after": Kind(lambda v: _whole(parse_seconds(v, True, 1e10)),
                            "a duration > 0 such as 10s (default 10s)",
                            show=_format_duration),
        "ram_max": Kind(_parse_ram_max, "a number of jobs such as 1000, or a "
                        "size with its unit such as 1M (defaults 1000 and 1M)"),
    }

    # The spool's own rules, kept in the same file under SPOOL_POLICY (a
    # name no type can have): the budget (myq(1) budget).
    SPOOL_KEYS = {
        "budget": Kind(lambda v: parse_size(v) or int(""),
                       "a size > 0 such as 512K, 64M or 2G",
                       show=_format_size),
    }

    @classmethod
    def value(cls, key, value, keys=None):
        """The canonical form of one value; UsageError (64) that names the
        key and the value when either is bad.  `keys`: SPOOL_KEYS."""
        kind = (keys or cls.KEYS).get(key)
        if kind is None:
            raise UsageError("unknown policy key %r; the keys are: %s"
                             % (key, " ".join(sorted(keys or cls.KEYS))))
        try:
            return kind(value)
        except ValueError:
            raise UsageError("bad value %s for policy key %s: %s"
                             % (_clip(json.dumps(value), 80), key,
                                "it takes " + kind.takes))

    @classmethod
    def check(cls, obj):
        """A policy file's object, validated and in canonical form."""
        if not isinstance(obj, dict):
            raise ValueError("the policy is a JSON object {TYPE: {KEY: VALUE}}")
        out = {}
        for name, keys in obj.items():
            if name not in ("*", SPOOL_POLICY):
                _check_name(name, "type")
            if not isinstance(keys, dict):
                raise ValueError("the policy of %s is not an object" % name)
            own = cls.SPOOL_KEYS if name == SPOOL_POLICY else None
            out[name] = dict((k, cls.value(k, v, own)) for k, v in keys.items())
            if own is None:
                cls.combined(out[name])
        return out

    @classmethod
    def combined(cls, keys):
        """`keys` of one type, when they go together: UsageError (64) if
        not (a type goes to a `url` or to a `topic`, not both)."""
        if keys.get("url") and keys.get("topic"):
            raise UsageError("policy keys url and topic do not go together: "
                             "a type goes to an http url (the http handler) "
                             "or to an MQTT topic, not both; remove one "
                             "(url= or topic=)")
        for key, kind in (("url", "http"), ("topic", "mqtt")):
            if keys.get(key) and keys.get("handler", kind) != kind:
                # (its jobs, only bodies, would all be dead)
                raise UsageError(
                    "policy key %s goes with handler=%s, not handler=%s: "
                    "remove one (%s= or handler=)"
                    % (key, kind, keys["handler"], key))
        return keys

    @classmethod
    def show(cls, key, v):
        """A value as `myq policy` prints it."""
        kind = cls.KEYS.get(key) or cls.SPOOL_KEYS.get(key)
        return kind.show(v) if kind is not None else str(v)


LIVE_DEFAULT, BACKLOG_SHARE_DEFAULT = 60.0, 50     # (myq(1) policy `order`)


def backlog_job(job, rules, now):
    """Is `job` of the backlog (myq(1) policy `order`): its type has
    order=live-first and it was made longer than `live` (default 60 s)
    before `now`?  A job without a created_at is not (nothing says it
    is old); one made "later" than now (a clock set back) is live."""
    if rules.get("order") != "live-first":
        return False
    t = job.get("created_at")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and \
        t < now - rules.get("live", LIVE_DEFAULT)


def _safe_dest(dest):
    """A destination as a file name: itself when it is a valid name, else
    its safe characters and a checksum (the file holds the real name)."""
    if NAME_RE.match(dest):
        return dest
    import binascii
    return "%s.%08x" % (re.sub(r"[^A-Za-z0-9._-]+", "_", dest)[:100].lstrip("."),
                        binascii.crc32(dest.encode("utf-8")) & 0xffffffff)


# The spool ###################################################################


# Files that are the spool's own and that a change of owner must take
# along (a spool first run as root, then under MYQ_USER): one stat each
# tells init whether to walk the whole layout.
_OWN_FILES = ("policy.json", "locks/policy.lock", "locks/room", "incoming/lanes",
              "locks/held", "locks/retries", "queue.db")
# What only the owner may open, whoever reads the rest (_Layout._files):
# what myq locks (SQLite locks the database and its log and index).
_PRIVATE = (("", "queue.db"), ("", "queue.db-wal"), ("", "queue.db-shm"),
            ("locks", "policy.lock"), ("locks", "totals.lock"),
            ("locks", "used"),
            ("locks/held", ".lock"))


def _give_layout(fds, ids):
    """init --owner's half for what is in the layout: when the spool, or one
    of its own files (_OWN_FILES), belongs to another user than `ids`,
    every entry of it that belongs to that former owner (see uids) is given
    to `ids` -- policy.json, lanes, locks, done files, queue.db -- each
    through its directory's descriptor without following a link, never a
    file with another hard link, never across a mount; producers' files
    stay theirs.  (The directories of the layout itself: the caller.)"""
    top = fds[""]
    st = os.fstat(top)
    # root's files too where root had the spool, or where it is the new
    # owner's already (root's leftovers); from one user to another, that
    # user's alone (it may have moved in a file of root's)
    uids = set([st.st_uid, 0]) if st.st_uid in (0, ids[0]) else set([st.st_uid])
    old = (uids - set([ids[0]]), set([st.st_gid, 0]))
    stale = st.st_uid != ids[0]
    for rel in _OWN_FILES if not stale else ():
        try:
            if os.stat(rel, dir_fd=top, follow_symlinks=False).st_uid in old[0]:
                stale = True
                break
        except OSError:
            pass
    if stale and old[0]:
        _give_tree(top, st.st_dev, old, ids, 0)


def _give_tree(fd, dev, old, ids, depth):
    """_give_layout's walk of one directory (descriptor `fd`)."""
    for e in list(os.scandir(fd)):
        try:
            st = e.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) or st.st_dev != dev:
                continue
            if stat.S_ISDIR(st.st_mode):
                if depth < 4:
                    sub = os.open(e.name, _DIR_FLAGS, dir_fd=fd)
                    try:
                        _give_tree(sub, dev, old, ids, depth + 1)
                    finally:
                        os.close(sub)
            elif st.st_nlink != 1:
                continue
            if st.st_uid in old[0]:
                os.chown(e.name, ids[0], ids[1] if st.st_gid in old[1] else -1,
                         dir_fd=fd, follow_symlinks=False)
        except OSError as e2:
            if e2.errno != errno.ENOENT:
                raise


def _file_kind(mode):
    """None for a regular file, else what it is."""
    if stat.S_ISREG(mode):
        return None
    for test, name in ((stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def _count(path, suffix):
    return sum(1 for e in _scandir(path) if e.name.endswith(suffix))


class Store(object):
    """What a store is: every operation the rest of myq asks of the place
    that keeps a spool's jobs, one line each (as mailbox.Mailbox is to
    Maildir and mbox).  FileStore (a file per job) and SqlStore (rows of
    queue.db) implement it, neither inheriting the other; what both keep
    in the spool directory (layout, name, policy, lanes, the budget's
    records, the drop box) is _DirStore's.  The claim protocol is the
    store's `claims` (Claims for files: claim, complete, move_on for a
    retry or the dead letters, put_back, take_back, reap, scan, extend,
    commit), its holds' records its `breaker`, its budget (what a job
    costs, what sheds first) its `budget`, its export and import its
    `backlog`, what the commands read its `reader` (READER), the
    operator's moves and retention its `upkeep` (UPKEEP), the writing of
    job files its `producer`.  A store is chosen by the
    spool's SPOOL/store through _STORES; a new one registers there."""

    store = None        # its name in SPOOL/store and _STORES
    READER = None       # the class of its reader (Reader's)
    UPKEEP = None       # the class of its upkeep (Upkeep's)
    CLAIMS = None       # the class of its claims (Claims' contract)
    BUDGET = None       # the class of its budget (Budget's)
    BACKLOG = None      # the class of its export and import (Backlog's)

    def _abstract(self):
        raise NotImplementedError("Method must be implemented by the store")

    # Making and opening ---------------------------------------------------

    def init(self, owner=None, store=None):
        """Make the spool's layout (idempotent); returns the store."""
        self._abstract()

    def require(self):
        """The store, or ConfigError unless it is made and usable."""
        self._abstract()

    def check_filesystem(self):
        """ConfigError unless every part of the store is on one filesystem
        and whole (at a worker's start)."""
        self._abstract()

    def close(self):
        """Close what this object keeps open (a worker's run ends so)."""
        self._abstract()

    # Producing -------------------------------------------------------------

    def enqueue(self, type, payload=None, id=None, delay=0, max_attempts=None,
                timeout=None, sync=True, priority=None, ttl=None):
        """Add one job durably; its id (DuplicateJob, SpoolFull, ...)."""
        self._abstract()

    def enqueue_many(self, specs, sync=True):
        """Add many jobs, durable together; their ids."""
        self._abstract()

    def find_id(self, jid, now=None, dirs=None):
        """Whether id `jid` is taken (a job, or an idempotency record)."""
        self._abstract()

    def ok_fresh(self, jid, now=None, dirs=None):
        """Whether `jid` finished within the de-duplication window."""
        self._abstract()

    def _enqueue(self, todo, sync, refused=None, done=None):
        """Place Producer.prepared's jobs of `todo`, durable when it returns."""
        self._abstract()

    def _enqueue_one(self, todo, sync):
        """Place one job of a generated id (the producer's usual call)."""
        self._abstract()

    def eager_types(self):
        """The types whose handlers a worker resolves before it listens
        (a RAM tier's: their bound counts from the first job)."""
        return ()

    def _move_in(self, todo, refused=None, done=None):
        """_enqueue of jobs promised already elsewhere (a RAM tier's moves):
        durable when it returns, and none seen before its bytes are durable
        (a power cut leaves each whole or absent: its other copy may go
        with the same cut).  A transaction is that already."""
        return self._enqueue(todo, True, refused, done)

    # The claim protocol's side of the store (self.claims) ------------------

    def lanes(self):
        """The lanes that hold waiting jobs (a scan looks into these)."""
        self._abstract()

    def _make_lane(self, sub, dirs=None):
        """Make the lane `sub` where jobs of a laned type wait."""
        self._abstract()

    def _waiting_of(self, type):
        """How many jobs of `type` wait (make_room's count)."""
        self._abstract()

    def _made(self, w, now):
        """Whether the waiting job `w` still is where make_room saw it."""
        self._abstract()

    def _drop_waiting(self, sub, name, dirs):
        """Drop one waiting job (drop-oldest's choice, made_room's)."""
        self._abstract()

    # Upkeep --------------------------------------------------------------

    def retry(self, ids=(), all=False, now=False):
        """Move dead (or failed) jobs back to the queue, attempts reset."""
        self._abstract()

    def delete(self, ids, force=False):
        """Remove jobs by id (a claimed one only with force)."""
        self._abstract()

    def delete_where(self, state, type=None, older_than=None, force=False,
                     now=None):
        """Remove the jobs of a state (and type, and age)."""
        self._abstract()

    def reap(self, me=None, max_attempts=5, dry_run=False):
        """Take back the claims of workers that are gone."""
        self._abstract()

    def beat_path(self, wid):
        """Where worker `wid` beats when not in its record (Identity.beat):
        None, its record alone (a store with a RAM tier: the tier's)."""
        return None

    def prune(self, now=None, full=True):
        """Apply retention (done, dlq, failed, records, strays)."""
        self._abstract()

    def make_space(self, n=256):
        """Below a guard: the oldest done jobs go, their ids kept."""
        self._abstract()

    def keep_room(self):
        """The room the spool keeps back (the reserve), made again."""
        self._abstract()

    def check(self, operator=True):
        """What is wrong with the spool, as lines for the operator."""
        self._abstract()

    # Reading -------------------------------------------------------------

    def locate(self, jid):
        """(state, where) of job `jid` (NoSuchJob)."""
        self._abstract()

    def show(self, jid):
        """Job `jid` as a dict, with its state."""
        self._abstract()

    def list(self, state=None):
        """Jobs as dicts, by state, then time, then id."""
        self._abstract()

    def stats(self, now=None, by_type=False, types=True):
        """The counters of the status line (myq-spool(5) STATISTICS)."""
        self._abstract()

    # Finishing -----------------------------------------------------------

    def complete(self, c):
        """Finish claim `c` as done (claims.complete), counted as delivered."""
        self._abstract()

    def upkeep_budget(self, now):
        """A worker's turn of the budget's upkeep (store.budget's)."""
        self._abstract()


class Identity:
    """Who holds a claim: locks/workers/WID.json (pid, process start time,
    boot id, pid namespace, host, lease).  The file's mtime is the last
    heartbeat on the monotonic clock, comparable across processes of one
    boot and immune to wall-clock jumps (with a RAM tier, the later of it
    and the tier's beat: beat()).  A beat vouches for the claims alone: a
    worker beats while it holds or makes them (Worker._heartbeat)."""

    def __init__(self, spool, lease=60.0, kind="w", log=None):
        self.spool = spool
        self.pid = os.getpid()
        self.start = proc_start(self.pid)
        self.lease = float(lease)
        self.wid = "%s-%d-%s" % (kind, self.pid, _rand_hex(3))
        self.path = spool.d("locks", "workers", self.wid + ".json")
        self.seq = 0
        self.registered = False
        self.log = log          # where it logs ("syslog", a path), for check
        self.mqtt = None        # a worker's --mqtt brokers in order, for stats
        self.beaten = None      # when it last beat (monotonic)

    def token(self):
        """A new claim's token; a beat first when the last is older than
        lease/3 (a worker that held nothing skipped its beats: its claims
        are what its beat vouches for, Worker._heartbeat)."""
        self.seq += 1
        if self.beaten is not None and _mono() - self.beaten > self.lease / 3:
            self.beat()
        return "%s.%d" % (self.wid, self.seq)

    def lease_line(self, token, attempt, until):
        """The `{"lease": …}` record a claim appends: what dumps() would
        write, formatted here (it is written for every job)."""
        return ('%s%s","attempt":%d,"leased_until":%s}}\n' % (
            self._lease_head(), token, attempt, _ms_repr(until))).encode("utf-8")

    def lease_parts(self, token, until):
        """lease_line's text around its attempt (the SQLite store's claim
        puts the row's next attempt between them)."""
        return ('%s%s","attempt":' % (self._lease_head(), token),
                ',"leased_until":%s}}' % _ms_repr(until))

    def _lease_head(self):
        head = getattr(self, "_head", None)
        if head is None:
            head = self._head = dumps({"lease": {
                "worker": self.wid, "pid": self.pid, "start": self.start,
                "boot_id": boot_id(), "token": ""}})[:-4].decode("utf-8")
        return head

    def record(self):
        rec = {"worker": self.wid, "pid": self.pid, "start": self.start,
               "boot_id": boot_id(), "pidns": pid_namespace(),
               "host": os.uname()[1], "lease": self.lease,
               "started_at": _now(), "log": self.log}
        if self.mqtt:
            rec["mqtt"] = self.mqtt
        return rec

    def register(self):
        # Through tmp/, fsync'd: a record is never seen half-written, not
        # even after a power cut (an empty record cannot be judged: the
        # claims of its dead worker would wait out their lease instead of
        # being taken back at once, as the UBIFS power cuts showed).
        # (beside it in locks/workers/, the owner's alone: a producer could
        # swap a record made in tmp/ before its rename)
        # (the SQLite store's mark of a clean stop goes first: SqlStore)
        mark = getattr(self.spool, "mark_clean", None)
        if mark is not None:
            mark(False)
        _replace(self.path, dumps(self.record()), sync=True)
        _utime(self.path, _mono())
        self.registered = True
        self.beat()

    def beat(self):
        """The heartbeat: the mtime of the spool's RAM tier's
        locks/workers/WID.beat where there is one (a tmpfs: an idle
        worker's time costs the flash nothing), else of the record (also
        when the tier's is out of reach).  The later of the two is the
        beat (Claims._owner_gone), on the monotonic clock."""
        now = _mono()
        beat = self.spool.beat_path(self.wid)
        if beat is not None:
            try:
                try:
                    _utime(beat, now)
                except OSError as e:
                    if e.errno != errno.ENOENT:
                        raise
                    _create(beat, b"", sync=False, mtime=now)
                self.beaten = now
                return
            except OSError:
                pass
        _utime(self.path, now)
        self.beaten = now

    @staticmethod
    def last_beat(store, wid, mtime):
        """Worker wid's last heartbeat: the later of its record's `mtime`
        and its beat's in the RAM tier (beat())."""
        beat = store.beat_path(wid)
        if beat is not None:
            try:
                return max(mtime, _lstat(beat).st_mtime)
            except OSError:
                pass
        return mtime

    def unregister(self):
        if self.registered:
            beat = self.spool.beat_path(self.wid)
            if beat is not None:
                _quiet_unlink(beat)
            _quiet_unlink(self.path)
            self.registered = False
            mark = getattr(self.spool, "mark_clean", None)
            if mark is not None:
                mark(True)


class Claim(object):
    """A job this process has claimed: processing/ID+TOKEN.json."""
    __slots__ = ("jid", "path", "job", "attempt", "token", "fd", "trailers",
                 "max_attempts", "batch", "mtime")

    def __init__(self, jid=None, path=None, job=None, token=None, fd=None,
                 trailers=None, max_attempts=None, attempt=None, mtime=None):
        self.jid, self.path, self.job = jid, path, job
        self.token, self.fd, self.trailers = token, fd, trailers
        self.max_attempts, self.attempt = max_attempts, attempt
        self.batch = None       # the record of the batch it runs in
        self.mtime = mtime      # when it was due, as claimed (put_back)


def _lease_claim(fd, path, me, c, until):
    """Claim c's lease: the claimed file's mtime, `until` (an inode change,
    no data block; _claim_lease reads it).  A file the worker may write but
    not date (a group member's, mode 0660: only its owner sets its times)
    gets it appended as a line instead, as a claim did before; its
    trailers are then None: it cannot go back unchanged (Worker._put_back)."""
    try:
        _futime(fd, path, until)
    except OSError as e:
        if e.errno != errno.EPERM:
            raise
        _append(path, me.lease_line(c.token, c.attempt, until), fd)
        c.trailers = None


def _noop_log(event, **kv):
    pass


class Breaker(object):
    """Holds (myq(1) holds): a destination that fails, or a type whose handler
    is missing, waits, and its probes say when it is back.  The records
    are the spool's (locks/held/: DEST.json the hold, DEST.jobs the jobs it
    put back, DEST.streak the failures in a row; cat-able), shared by its
    workers; a worker's own view of them is Worker._holds."""

    def __init__(self, spool):
        self.spool = _weakref.proxy(spool)  # (no cycle: a Spool goes with its last user)
        self._noted = {}            # dest -> the names note_job wrote
        self._held_cache = None     # records()' last look
        # no held/ at records()' last look: (), or locks/'s key before it
        self._none_held = ()

    def _path(self, dest, ext=".json"):
        return self.spool.d("locks", "held", _safe_dest(dest) + ext)

    def records(self, locks=None):
        """[{"dest", "why", "since", "until", "probes"}] of the held
        destinations, from locks/held/ (written by workers; cat-able).
        Read again only when the directory changed, and then only the
        records that changed: thousands of holds cost a poll one stat.
        No held/ yet: locks/'s key, the same as when it had none, says so
        (a stat, not an open that fails: an exception each poll tick;
        `locks`: its stat, taken just before by the caller)."""
        lk = None
        if self._none_held is not None:
            try:
                lk = locks or _dir_stat(self.spool.d("locks"))
                lk = (lk.st_mtime_ns, lk.st_ino, lk.st_mtime)
                if lk[:2] == self._none_held:
                    return ()
            except OSError:
                lk = None
        d = self.spool.d("locks", "held")
        try:
            st = _dir_stat(d)
            key = (st.st_mtime_ns, st.st_ino)
        except OSError:
            # (no holds ever: the same empty tuple each time, which a poll
            # tick's _load_holds knows as "nothing new", not a new list;
            # locks/'s key before kept, unless so recent it proves nothing)
            self._none_held = lk[:2] if lk and _now() - lk[2] >= 0.05 else ()
            return ()
        self._none_held = None
        cache = self._held_cache
        if cache is not None and cache[0] == key and cache[1] > st.st_mtime + 1:
            return cache[2]
        old = cache[3] if cache is not None else {}
        recs, out = {}, []
        for e in _scandir(d):
            name = e.name
            if not name.endswith(".json") or name[:1] == ".":
                continue
            try:
                s = e.stat(follow_symlinks=False)
                k = (s.st_mtime_ns, s.st_ino, s.st_size)
                rec = old.get(name)
                if rec is None or rec[0] != k:
                    rec = (k, json.loads(self.spool.read_file(d + "/" + name, 4096)[0]))
            except (OSError, ValueError, InvalidJob):
                continue
            recs[name] = rec
            r = rec[1]
            if isinstance(r, dict) and isinstance(r.get("dest"), str) \
                    and _is_num(r.get("until")):
                out.append(r)
        out.sort(key=lambda r: r["dest"])
        # (trusted while the directory has not changed since a second
        # before this look: a change within its mtime's granularity is seen)
        self._held_cache = (key, _now(), out, recs)
        return out

    def record(self, dest):
        try:
            rec = json.loads(self.spool.read_file(self._path(dest), 4096)[0])
        except (OSError, ValueError, InvalidJob):
            return None
        return rec if isinstance(rec, dict) and _is_num(rec.get("until")) else None

    def _dir(self):
        self.spool.fs.mkdir("locks/held")

    def write(self, rec):
        """Write a hold's record (locks/held/DEST.json, cat-able), beside
        it and renamed over the old one; no fsync (after a power cut a
        probe is due at once anyway)."""
        self._dir()
        _replace(self._path(rec["dest"]), dumps(rec))

    def _lock(self):
        self._dir()
        return _lock(self.spool.d("locks", "held", ".lock"))

    def note_job(self, dest, name):
        """A job of a held (or failing) destination waits at `name` (its
        path in the spool): the release makes it ready at once.  A name is
        written once per hold (this process remembers what it wrote; what
        several workers wrote twice is compacted by held_jobs), so that the
        record does not grow with the outage's length."""
        noted = self._noted.get(dest)
        if noted is None:
            if len(self._noted) > 1024:
                self._noted.clear()
            noted = self._noted[dest] = set()
        if name in noted:
            return
        try:
            self._dir()
            _append(self._path(dest, ".jobs"), (name + "\n").encode("utf-8"))
            if len(noted) < 1 << 17:
                noted.add(name)
        except OSError as e:        # it waits its own time instead
            self.spool.log("error", during="breaker", dest=dest,
                     error=e.strerror or str(e))


    def jobs(self, dest):
        """The jobs a hold put back (their paths in the spool), each once,
        in the order they were put back."""
        path = self._path(dest, ".jobs")
        data = _read_small(path, 1 << 22, tail=True)
        seen, out = set(), []
        names = (data or b"").decode("utf-8", "replace").split()
        for name in names:
            if name not in seen and name.startswith("incoming/") \
                    and name.endswith(".json") and ".." not in name.split("/"):
                seen.add(name)
                out.append(name)
        if len(names) > 256 and len(names) > 2 * len(out):
            # several workers (or restarts) wrote names twice: compacted,
            # so that the record stays one line per waiting job
            try:
                fd = self._lock()
                try:
                    _replace(path, "".join(n + "\n" for n in out).encode("utf-8"))
                finally:
                    os.close(fd)
            except OSError:
                pass
        return out

    def take_probe(self, dest, delay, job=None):
        """A hold's backoff is over: take the probe (one job of `dest` may
        start; the next probe is `delay(probes)` seconds later), unless
        another worker took it.  A hold from another boot is due at once.
        `job`: the path of the job that probes, kept as the hold's "last"
        (the next probe is the one after it, see Worker._probe_claim).
        Returns the hold's new until, 0 when it was released meanwhile, or
        None when the probe is not ours."""
        try:
            fd = self._lock()
        except OSError:
            return None
        try:
            rec = self.record(dest)
            if rec is None:
                return 0.0              # released meanwhile
            now = _now()
            if rec["until"] > now and rec.get("boot") == boot_id():
                return None
            n = rec.get("probes") if rec.get("probes").__class__ is int else 0
            until = now + delay(n + 2)
            rec.update(until=round(until, 3), probes=n + 1, boot=boot_id())
            if job is not None:
                rec["last"] = job
            self.write(rec)
            return until
        except OSError:
            return None
        finally:
            os.close(fd)

    def streak(self, dest, jid):
        """A destination failure of job `jid`: (whether it starts a streak,
        how many different jobs failed in the streak so far, how many
        failures in all)."""
        path = self._path(dest, ".streak")
        data = _read_small(path, 1 << 16, tail=True)
        seen = (data or b"").decode("utf-8", "replace").split()
        try:
            self._dir()
            if len(seen) >= 512:
                # bounded: the streak's last 256 failures say all it needs
                # (different jobs up to any breaker, the backoff's step)
                seen = seen[-256:]
                _replace(path, "".join(j + "\n" for j in seen + [jid])
                         .encode("utf-8"))
            else:
                _append(path, (jid + "\n").encode("utf-8"))
        except OSError as e:        # the breaker counts less: never a job
            self.spool.log("error", during="breaker", dest=dest,
                     error=e.strerror or str(e))
        return not data, len(set(seen + [jid])), len(seen) + 1

    def streaky(self):
        """The destinations with failures in a row, as file names
        (_safe_dest): one listing."""
        return set(n[:-7] for n in _listdir(self.spool.d("locks", "held"))
                   if n.endswith(".streak"))

    def dest_ok(self, dest):
        """An answer that is not the destination's failure: the streak
        ends, and a hold is released (True)."""
        _quiet_unlink(self._path(dest, ".streak"))
        if _lexists(self._path(dest)):
            self.release(dest)
            return True
        return False

    def release(self, dest):
        """End a hold: the jobs put back while it lasted are ready now."""
        jobs = self._path(dest, ".jobs")
        names = set((_read_small(jobs, 1 << 22, tail=True) or b"").decode("utf-8", "replace")
                    .split())
        now = _now()
        for name in names:
            if "/" not in name:
                name = "incoming/" + name
            parts = name.split("/")
            if parts[0] != "incoming" or ".." in parts or not name.endswith(".json"):
                continue
            self.spool.claims.due(name, now)
        _quiet_unlink(jobs)
        _quiet_unlink(self._path(dest, ".streak"))
        _quiet_unlink(self._path(dest))
        self._noted.pop(dest, None)
        self.spool.poke()

    def prune(self):
        """Holds of types whose jobs are gone (none of those it put back
        waits any more: run by a worker that has the handler, deleted,
        expired) are removed: a type that vanished holds nothing."""
        n = 0
        for h in self.records():
            dest = h["dest"]
            if "://" in dest and not h.get("missing"):
                continue        # a server's hold ends by its probes
            if h.get("since", 0) > _now() - 60:
                continue
            if not any(self.spool.claims.waits(name) for name in self.jobs(dest)):
                _quiet_unlink(self._path(dest, ".jobs"))
                _quiet_unlink(self._path(dest, ".streak"))
                _quiet_unlink(self._path(dest))
                self._noted.pop(dest, None)
                self.spool.log("release", dest=dest, why="no job of it waits")
                n += 1
        return n


def _job_entries(it, inc, now, bad, nread):
    """(due, name, scheduled) of the job files a directory iterator
    gives; what is not a regular file goes to `bad`, counted in
    nread[0] are the jobs."""
    for e in it:
        name = e.name
        if not name.endswith(".json"):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            bad.append((name, _file_kind(st.st_mode)))
            continue
        m = st.st_mtime
        # An mtime later than the ctime was set on purpose (by myq,
        # or `touch -d` before the mv): it IS the schedule.
        scheduled = m > st.st_ctime
        if st.st_ctime > now + 5 and m > now:
            # The clock went back since this file was scheduled:
            # keep the delay it had left, not the old date.
            m = now + max(0.0, m - st.st_ctime)
            scheduled = True
            try:
                _utime(inc + "/" + name, m)
            except OSError:
                pass
        nread[0] += 1
        yield (m, name, scheduled)


class _Named(object):
    """A name of the directory open as `fd`, as _job_entries reads a
    DirEntry (its name, its stat), once the scan that found it is done."""
    __slots__ = ("name", "fd")

    def __init__(self, name, fd):
        self.name, self.fd = name, fd

    def stat(self, follow_symlinks=False):
        return os.stat(self.name, dir_fd=self.fd,
                       follow_symlinks=follow_symlinks)


def _elsewhere(sp, jid, mine):
    """Where else than the claim at `mine` job `jid` of spool `sp` (of
    files) waits (a lane), runs or lies dead: a state, or None.  (A claim
    is ID+TOKEN.json; what a crash left of a finish, .fin and .new, is
    not a run: the reaper settles it.)"""
    for sub in sp.waiting_dirs():
        if sub != "incoming" and _lexists(sp.d(sub, jid + ".json")):
            return "queued"
    if _lexists(sp.d("dlq", jid + ".json")):
        return "dead"
    prefix, mine = jid + "+", mine.rpartition("/")[2]
    if any(n.startswith(prefix) and n.endswith(".json") and n != mine
           for n in _listdir(sp.d("processing"))):
        return "processing"
    return None


def _few(names, most=5):
    """A list in a status line: the first `most` names, then how many more
    (",+95"): hundreds of held types made a line of 19 KB a minute (review;
    stats --json has them all); "-" for none."""
    if len(names) > most:
        return ",".join(names[:most]) + ",+%d" % (len(names) - most)
    return ",".join(names) or "-"


# A batch of more than one job is recorded while it runs in
# processing/LEAD+TOKEN.batch (its ids in order; the owner's directory).
# When its jobs go back unfinished (a retry, a shutdown, a dead worker
# taken back), the record moves to locks/batches/ and each job's next
# version says "batch_of": the first of them claimed again takes the
# others that still wait, in the same order: the same ids, so the same
# Idempotency-Key, and a receiver that de-duplicates stores nothing
# twice.  A batch that ended (done, dead, split) drops its record.
class _Batches(object):
    """A batch's identity kept across a crash (myq(1) batches): the ids of
    the jobs that went together, in order, in processing/LEAD+TOKEN.batch
    while they run and in locks/batches/LEAD+TOKEN when a dead worker's
    jobs go back unfinished, so that they go again as that batch (same
    ids, same order, same Idempotency-Key).  A record's name is a name
    (LEAD+TOKEN), never a path.  The spool's, as spool.claims.batches."""

    def __init__(self, spool):
        self.spool = spool
        self.whole = {}     # a batch formed again short of its done jobs: its ids

    def note(self, claims):
        """Record a new batch's ids, of one job too (no fsync: a power cut
        ends it anyway)."""
        c = claims[0]
        if _is_batch_name(c.job.get("batch_of")):   # (formed again: recorded)
            name = c.job["batch_of"]
            self._short(name, claims)
        else:
            name = "%s+%s" % (c.jid, c.token)
            try:
                _create(self.spool.d("processing", name + ".batch"), json.dumps(
                    {"ids": [x.jid for x in claims]}).encode("utf-8"), sync=False)
            except OSError:
                return                      # it goes as a batch all the same
        for x in claims:
            x.batch = name

    def _short(self, name, claims):
        """A batch formed again without jobs that are done: its worker died
        while it finished them, after the receiver had answered for all.
        It goes under the key of all its ids (whole[name], for the http
        handler), as it first went, so that a receiver that de-duplicates
        on the key stores nothing twice.  Not when a job it lacks is not
        done (it waits elsewhere): a later send of that job under the key
        would be taken for one the receiver has."""
        ids, have = self.ids(name), set(x.jid for x in claims)
        left = [i for i in ids if i not in have]
        if left and have <= set(ids) and all(self.spool.ok_fresh(i)
                                             for i in left):
            self.whole[name] = ids

    def ids(self, name):
        """The ids of batch `name` in order ([] when its record is gone, or
        `name` is not a batch's: a name in locks/, never a path)."""
        if not _is_batch_name(name):
            return []
        for p in (self.spool.d("locks", "batches", name), self.spool.d("processing",
                                                           name + ".batch")):
            data = _read_small(p, 1 << 20)
            if data:
                try:
                    ids = json.loads(data.decode("utf-8")).get("ids")
                except (ValueError, AttributeError):
                    return []
                return [i for i in ids if isinstance(i, str) and NAME_RE.match(i)] \
                    if isinstance(ids, list) else []
        return []

    def keep(self, name):
        """Its jobs go back unfinished: the record to locks/batches/."""
        self.whole.pop(name, None)
        if not _is_batch_name(name):
            return
        src = self.spool.d("processing", name + ".batch")
        if _lexists(src):
            try:
                self.spool.fs.mkdir("locks/batches")
                _rename(src, self.spool.d("locks", "batches", name))
            except OSError:
                pass

    def end(self, name):
        self.whole.pop(name, None)
        if _is_batch_name(name):
            _quiet_unlink(self.spool.d("processing", name + ".batch"))
            _quiet_unlink(self.spool.d("locks", "batches", name))


class _RunRecords(object):
    """The records of the handlers' processes (locks/workers/TOKEN.run,
    where only the spool's owner writes): made at a run's start, removed
    at its end, read to signal what a run left behind (a reaper taking a
    claim back, a delete of a running job).  The spool's claims' (their
    `runs`, whose note_handler, end_handler, kill_handler are these)."""

    def __init__(self, spool):
        self.spool = spool

    def _run_record(self, token):

        return self.spool.d("locks", "workers", token + ".run")

    def note_handler(self, c, pid, start):
        """Record the handler's process in locks/workers/TOKEN.run, where
        only the spool's owner writes: a reaper kills what it names, so a
        producer must not be able to forge it (a line in the job file
        could be).  The record is a symlink that is never followed, its
        target "PID:START:BOOT_ID": one syscall, no data block."""
        path = self._run_record(c.token)
        try:
            _step("create", path, "before")
            fd, name = _at(path)
            os.symlink("%d:%s:%s" % (pid, start, boot_id()), name, dir_fd=fd)
            _step("create", path, "after")
        except OSError:
            pass

    def end_handler(self, token):
        _quiet_unlink(self._run_record(token))

    def kill_handler(self, token, sig):
        """Signal what a run recorded by another process started (see
        kill_run): only when the record is of this boot and its pid is
        still the very process it names.  A run with no record (its worker
        died between starting it and recording it) is found by its
        MYQ_CLAIM alone: it would go on beside the job's next run."""
        try:
            fd, name = _at(self._run_record(token))
            pid, start, boot = os.readlink(name, dir_fd=fd).split(":", 2)
            pid, start = int(pid), int(start)
        except OSError as e:
            return kill_run(0, sig, token, start=-1) \
                if e.errno == errno.ENOENT else 0
        except ValueError:
            return 0

        if boot != boot_id():
            return 0
        if not _pid_alive(pid, start):
            return kill_run(0, sig, token, start=-1)   # by its MYQ_CLAIM alone
        return kill_run(pid, sig, token, start=start)


# The claim protocol ##########################################################
#
# Claims: a job's claim, finish, retry, dead letter, put back, take back
# and recovery, by the protocol of the module's docstring; FileClaims over
# job files.


SCAN_NOTE = "scanned"       # in locks/: the lanes' soonest at a worker's stop


class Claims(object):
    """The claim protocol (myq-spool(5) CLAIMS): a job claimed by renaming it into
    processing/ with the claimer's token, its lease appended; finished by
    a new version put in place (done/, incoming/ for a retry, dlq/);
    handler records (locks/workers/TOKEN.run); a batch's identity kept
    across a crash; recovery (reap) of what a dead worker held; the
    quarantine of what cannot be a job.  The spool's, as spool.claims."""

    # Does a claim from incoming/ change change_key() (files: the rename
    # changes the directory's time)?  The scheduler then knows its own
    # claim's change from a producer's (_Scheduler._lane_claim).
    claim_changes_key = False
    # Do change_key() and lane_key() mean the same in another process and
    # after a restart (files: a directory's time and inode)?  A worker's
    # stop then notes each lane's soonest job (locks/scanned: SCAN_NOTE),
    # and the next start trusts it while the lane's key is the same, not
    # a pass over every entry (_Scheduler._use_note).
    lasting_key = False
    # Do finished claims wait for commit() to move (a RAM tier's)?
    owed = False

    def __init__(self, spool):
        self.spool = _weakref.proxy(spool)  # (no cycle: a Spool goes with its last user)
        self.batches = _Batches(self.spool)
        # its handlers' records, as the claims' own: whoever asks the
        # claims (a runner, a reaper, a delete) finds them here
        self.runs = r = _RunRecords(self.spool)
        self.note_handler, self.end_handler, self.kill_handler = \
            r.note_handler, r.end_handler, r.kill_handler

    # The contract: what each store's claims do (FileClaims, _SqlClaims) --

    def _abstract(self):
        raise NotImplementedError("Method must be implemented by the store")

    def claim(self, name, me, default_max_attempts=5, scheduled=False,
              sub="incoming", anytime=False):
        """Claim the waiting job `name` for `me`: a Claim, or None."""
        self._abstract()

    # Are a batch's jobs claimed in one statement (claim_many) and finished
    # in one transaction (complete_many)?  (_Runner._claim_more, _Finishing)
    bulk_claims = False

    def complete(self, c):
        """Finish claim `c` as done (its idempotency record kept)."""
        self._abstract()

    def move_on(self, c, job, dest, me, fin=None, until=None):
        """Finish claim `c` as `job` anew in `dest` (a retry, dead letters)."""
        self._abstract()

    def put_back(self, c, mtime):
        """Claim `c`'s job waits again, unchanged, due at `mtime`."""
        self._abstract()

    def reap(self, me=None, max_attempts=5, dry_run=False):
        """Take back the claims whose owner is gone."""
        self._abstract()

    def scan(self, L, n, tick):
        """Lane `L`'s cache of its `n` earliest waiting jobs."""
        self._abstract()

    def lanes_key(self, poked=False):
        """(key, racy): what changes when the set of lanes does."""
        self._abstract()

    def maybe_lanes(self):
        """Whether lanes may hold waiting jobs beside incoming/."""
        self._abstract()

    def lane_key(self, L):
        """What changes when lane `L`'s waiting jobs do."""
        self._abstract()

    def waits(self, rel):
        """Whether the job at `rel` (LANE/NAME) still waits."""
        self._abstract()

    def size(self, sub, name):
        """The bytes of the waiting job `name` of lane `sub`."""
        self._abstract()

    def due(self, rel, now):
        """Whether the job at `rel` is due at `now` (wall clock)."""
        self._abstract()

    def extend(self, claims, until):
        """Renew the leases of `claims` to `until`."""
        self._abstract()

    def commit(self):
        """Make the finished claims durable (group commit)."""
        self._abstract()

    def queued(self, jid):
        """Whether job `jid` waits."""
        self._abstract()

    def close(self, c):
        """Let go of claim `c`'s open file, if any."""
        self._abstract()

    def _done_already(self, jid, now, generated):
        """Whether job `jid` finished already (a claim is dropped);
        `generated`: an id myq made (_is_generated_id)."""
        self._abstract()

    def _until_of(self, path):
        """The lease's end of the claim at `path`."""
        self._abstract()

    def _read_claimed(self, path, src, name, scheduled, pfd, cname):
        """The job in the file just claimed at `path` (`cname` in the
        directory `pfd`): (job, trailers, fd open for the lease, stat), or
        None when it was quarantined or is not written yet."""
        stem = name[:-5]
        fd = None
        limit = self.spool.opt["max_job_bytes"]
        try:
            st = os.stat(cname, dir_fd=pfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidJob("not a regular file (%s)"
                                 % _file_kind(st.st_mode))
            if st.st_size > limit + SLACK:
                raise InvalidJob("too large: %d bytes (--max-job-bytes is %d)"
                                 % (st.st_size, limit))
            if st.st_nlink > 1:
                # Another name for this file exists.  Appending would change
                # it there too: refuse, unless the other name is an enqueue's
                # own tmp/ file (unlinked a moment after its link, or left by
                # a producer that died in between): drop that name.  Then
                # look again: the producer may have unlinked it itself since
                # the lstat (no tmp/ name found, one name left: a job).
                mine = [self.spool._tmp + e.name for e in _scandir(self.spool.d("tmp"))
                        if e.inode() == st.st_ino]
                for p in mine:
                    _quiet_unlink(p)
                if _lstat(path).st_nlink > 1:
                    raise InvalidJob("a hard link (%d names): copy the file "
                                 "instead of linking it" % st.st_nlink)
            # The name is ours alone (unique token) and lstat said regular;
            # O_NOFOLLOW|O_NONBLOCK still guard against a swap meanwhile.
            fd = os.open(cname, os.O_RDWR | os.O_APPEND | os.O_NONBLOCK
                         | O_NOFOLLOW | O_CLOEXEC, dir_fd=pfd)
            data = os.read(fd, st.st_size + 65536)
            if not data.strip(b"\0 \t\r\n"):
                os.close(fd)
                fd = None
                self._unwritten(path, src, name, scheduled)
                return None
            obj, trailers = parse(data)
            if trailers:
                raise InvalidJob("worker records (lease or handler lines) after "
                                 "the job: only a worker writes those; a "
                                 "producer's file holds the job object alone")
            if len(data) > limit and not (
                    isinstance(obj, dict) and _rewritten(obj)
                    and len(data) <= limit + SLACK):
                raise InvalidJob("too large: %d bytes (--max-job-bytes is %d)"
                                 % (len(data), limit))
            job = _untrusted(normalize(obj, stem, st.st_mtime, True), st.st_uid,
                             self.spool.fs.uid)
        except (InvalidJob, OSError) as e:
            if fd is not None:
                os.close(fd)
            if isinstance(e, OSError):
                if e.errno in (errno.EACCES, errno.EPERM):
                    e = InvalidJob(
                        "permission denied: the worker (uid %d) cannot read and "
                        "append to it (the file belongs to uid %d, mode %04o); "
                        "producers must write jobs as the spool's owner, or "
                        "give the file to it before the mv (or use myq "
                        "enqueue, which hands the file over); then: chown it "
                        "and myq retry" % ((os.geteuid(),) + _owner_mode(path)))
                elif e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR,
                                     errno.ENODEV):
                    raise
            self.quarantine(path, name, str(e))
            return None
        return job, trailers, fd, st

    def _admit(self, c, job, me, src, sub, size, scheduled, now):
        """May the job just read run now?  False when it went elsewhere:
        put back for later, done already, expired, or into its lane."""
        stem, name = c.jid, c.jid + ".json"
        generated = _is_generated_id(stem)
        if sub == "incoming" and not scheduled and not generated:
            # A producer's file of an id that waits, runs or lies dead
            # elsewhere: a duplicate (it ran twice at once, or replaced the
            # one in its lane: review), as the SQLite store's take-in says.
            where = _elsewhere(self.spool, stem, c.path)
            if where:
                self.close(c)
                self.quarantine(c.path, name, "duplicate: job %s is in the "
                                "spool already (%s)" % (stem, where))
                return False
        # `scheduled`: the file's mtime was the schedule and it is due now.
        # Otherwise (a producer's own file) the JSON says when, capped at
        # now + the intended delay when its clock was ahead.
        due = now if scheduled else _effective_available(job, now)
        if due > now + 0.5:
            # The producer's clock was ahead, or it wrote available_at
            # without the mtime: put it back with the mtime that schedules it.
            job["available_at"] = due
            self.move_on(c, job, "incoming", me)
            self.spool.log("deferred", id=stem, until=iso(due))
            return False
        if self._done_already(stem, now, generated):
            self.spool.log("skipped", id=stem, why="already done (idempotency record)")
            self.complete(c)
            return False
        rules = self.spool.rules(job["type"])
        own = sub == "incoming" and src is not None and ("url" in rules or
                                                         "topic" in rules) \
            and own_destination(job, rules)
        if own:     # a shell producer's file (myq(1) policy `url`)
            self.close(c)
            self.quarantine(c.path, name, own)
            return False
        exp = self.spool.expiry(job, rules)
        if exp is not None and now >= exp:
            self.refuse(c, job, me, "expired", "expired at %s, before any run "
                         "could start (ttl)" % iso(exp))
            return False
        home = self.spool.home(job, rules)
        if home != sub:
            # A producer's file (or one from before a policy) into its lane,
            # under the type's bounds, its priority fixed now; a job found
            # in a lane not its own goes to its own home first, so that its
            # own type's rules (pause, rate, concurrency, bounds) hold.
            if job.get("priority") is None:
                job["priority"] = rules.get("priority", 0)
                home = self.spool.home(job, rules)
            self.spool.intake = True
            try:
                full = home != "incoming" and self.spool.make_room(
                    job["type"], size, exclude=name)
                if full:
                    self.refuse(c, job, me, "rejected", full)
                else:
                    self.move_on(c, job, home, me)
            except OSError:
                if c.path.endswith(".json"):
                    try:                # give it back untouched
                        _rename(c.path, src)
                    except OSError:
                        pass
                raise
            return False
        return True

    def _unwritten(self, path, src, name, scheduled):
        """A job file with nothing in it (no bytes, or NULs): not written
        yet (a producer between its create and its write), or never (an
        enqueue that a crash or power cut ended before it returned: its
        rename came before its fsync).  It holds no job, so nothing is lost
        and nothing is quarantined: it waits a minute (its mtime then, on
        purpose), and at its next look, still empty, it is removed; at
        once when it was made before this boot (no producer can still be
        writing it: a batch a power cut ended, a RAM tier's move among
        them, whose waiting minute a cut can take again and again)."""
        if scheduled or _before_boot(path):
            _unlink(path)
            self.spool.log("removed", file=name, why="empty: nothing was written in "
                     "it (an enqueue that a crash or power cut ended before it "
                     "returned, or a producer that wrote nothing)")
            self.spool.count("removed", "empty")
            return

        until = _now() + 60
        _utime(path, until)
        _rename(path, src)
        self.spool.log("deferred", file=name, until=iso(until),
                 why="empty: not written yet")

    def refuse(self, c, job, me, what, why):
        """An expired or rejected job (myq(1) policy): to dlq/, logged, counted."""
        job = dict(job)
        job["last_error"] = what + ": " + why
        job["failed_at"] = _now()
        self.move_on(c, job, "dlq", me)
        self.spool.log(what, id=c.jid, type=job["type"], why=why)
        self.spool.count(what, job["type"])

    def quarantine(self, path, name, reason):
        """Move a file that is not a valid job to failed/, reason beside it."""
        name = name.replace("/", "_") or "unnamed"
        if len(os.fsencode(name)) > 200:        # room for ".reason"
            name = os.fsdecode(os.fsencode(name)[:180]) + "." + _rand_hex(3) + ".json"
        dst = self.spool.d("failed", name)
        if _lexists(dst) or _lexists(dst + ".reason"):
            dst = self.spool.d("failed", "%s.%s.json" % (name, _rand_hex(3)))
        _rename(path, dst)
        line = "%s %s\n" % (iso(), reason.replace("\n", " "))
        try:
            _create(dst + ".reason", line.encode("utf-8", "replace"), sync=False)
        except OSError:
            pass
        self.spool.log("quarantined", file=os.path.basename(dst), reason=reason)

    # Recovery ----------------------------------------------------------------

    def _owner_gone(self, wid, path, cache, now, mono, kill=False):
        """None when the claim's owner is (or may be) alive, else why not.
        `kill`: a hung owner (alive, silent past its lease) is killed first,
        as a watchdog would: a handler running in its process would go on
        beside the job's next run."""
        if wid not in cache:
            rp = self.spool.d("locks", "workers", wid + ".json")
            try:
                data, st = self.spool.read_file(rp, 65536)
                if not data.strip(b"\0 \t\r\n"):
                    # whole or absent since it is fsync'd (register); an
                    # empty one is from before that, cut by the power
                    rec = False
                else:
                    rec = json.loads(data.decode("utf-8"))
                    rec["_beat"] = Identity.last_beat(self.spool, wid, st.st_mtime)
            except (OSError, ValueError, InvalidJob):
                rec = None
            cache[wid] = rec
        rec = cache[wid]
        if rec is False:
            return "worker %s is gone (its record is empty)" % wid
        if rec is None:
            if not _lexists(self.spool.d("locks", "workers", wid + ".json")):
                return "worker %s is gone" % wid
            rec = {}
        host = os.uname()[1]
        same_host = rec.get("host") == host
        if same_host and rec.get("boot_id") and boot_id() \
                and rec.get("boot_id") != boot_id():
            return "worker %s died (the system rebooted)" % wid
        if (same_host and rec.get("pidns") == pid_namespace()
                and proc_start(os.getpid()) is not None
                and isinstance(rec.get("pid"), int)):
            if not _pid_alive(rec["pid"], rec.get("start")):
                return "worker %s (pid %d) died" % (wid, rec["pid"])
            if path.endswith(".fin"):
                return None
            lease = rec.get("lease") or 60.0
            if mono - rec.get("_beat", mono) > lease:
                why = ("worker %s (pid %d) stopped heartbeating for %ds (hung)"
                       % (wid, rec["pid"], mono - rec["_beat"]))
                if kill and rec.get("kill") is None:
                    rec["kill"] = _kill_hung(rec["pid"], rec.get("start"))
                return why + ("; killed" if rec.get("kill") else "")
            return None
        # Liveness cannot be checked: the wall-clock lease decides.
        until = self._until_of(path)
        if until < now:
            return "lease of worker %s expired at %s" % (wid, iso(until))
        return None

    def _dead_batches(self, names, me, cache, now, mono):
        """{jid: its batch} of the batches (processing/*.batch) whose
        workers are gone; their records kept (_Batches.keep)."""
        batches = {}        # a dead worker's batch: jid -> its record
        for name in names:
            if name.endswith(".batch") and "+" in name:
                wid = name[:-6].partition("+")[2].rpartition(".")[0]
                if wid and (me is None or wid != me.wid) and self._owner_gone(
                        wid, self.spool.d("processing", name), cache, now, mono,
                        kill=True):
                    for jid in self.batches.ids(name[:-6]):
                        batches[jid] = name[:-6]
                    self.batches.keep(name[:-6])
        return batches

    def own(self, path, jid, me):
        """Take a job file for `me` to finish it: rename it to
        processing/ID+TOKEN.fin.  (fin, token), or None when another took
        it first.  A crash from here on leaves it where a reaper finds it."""
        token = me.token()
        fin = self.spool.d("processing", _claim_name(jid, token, "fin"))
        return (fin, token) if _take(path, fin) else None

    def take_back(self, path, jid, me, why, max_attempts=5, batch=None):
        owned = self.own(path, jid, me)
        if owned is None:
            return False
        fin, token = owned
        try:
            job, trailers, _ = self.spool.load(fin, jid)
        except InvalidJob as e:
            self.quarantine(fin, jid + ".json", "taken back from a dead worker "
                            "but unreadable: %s" % e)
            return True
        old_token = _claim_token(path)
        self.kill_handler(old_token, 9)
        self.end_handler(old_token)
        # (a finish it had begun: the next version it wrote, not yet moved)
        _quiet_unlink(self.spool.d("processing", _claim_name(jid, old_token, "new")))
        c = Claim(jid=jid, path=fin, token=token, job=job)
        if self.spool.ok_fresh(jid):
            _rename(fin, self.spool.d("done", jid + ".json"))
            self.spool.log("recovered", id=jid, why=why, to="done")
            return True
        if (self.queued(jid)
                or _lexists(self.spool.d("dlq", jid + ".json"))):
            _unlink(fin)                # a finish that crashed after its move
            self.spool.log("recovered", id=jid, why=why, to="-")
            return True
        lease = _lease_of(trailers) or {}
        dest = "incoming"
        if lease or old_token[:2] == "w-":      # a worker's claim: a run begun
            attempt = lease.get("attempt")
            if not isinstance(attempt, int):
                attempt = job["attempts"] + 1
            job["attempts"] = attempt
            note_failure(job, attempt, "%s during attempt %d" % (why, attempt))
            if attempt >= (job.get("max_attempts") or max_attempts):
                dest = "dlq"
                job["failed_at"] = _now()
        job["available_at"] = _now()
        if batch and dest == "incoming":
            job["batch_of"] = batch     # it goes again as that batch
        self.move_on(c, job, dest, me, fin=fin)
        self.spool.log("requeued" if dest == "incoming" else "dead", id=jid, why=why)
        return True

    # What the scheduler sees of the waiting jobs -----------------------------
    #
    # The worker's scheduler (lanes, gates, rates, batches, probes) reads
    # the waiting jobs only through these, so that another store (the
    # SQLite one) plugs in under it unchanged.

    def change_key(self, st=None):
        """(key, racy): a key that changes when the waiting jobs of
        incoming/ may have; racy when it cannot prove they did not (`st`:
        incoming/'s stat, taken just before by the caller).  A
        directory's time has the kernel's coarse granularity (a jiffy): a
        change in the same jiffy as the one this key saw leaves it equal,
        so a time that recent proves nothing (git's "racily clean"
        entries)."""
        if st is None:
            try:
                # (the door's descriptor: asked twice a claim, _lane_claim)
                st = os.fstat(self.spool.fs("incoming"))
            except OSError:
                return None, False
        return (st.st_mtime_ns, st.st_ino), abs(_now() - st.st_mtime) < 0.05

    def arrived(self):
        """The lanes (their `sub`) that may have new jobs since the last
        call, or None: this store cannot say (a directory's key each)."""
        return None

    # A worker's side beyond the claims themselves (a RAM tier's claims,
    # _TieredClaims, add theirs) --------------------------------------------

    def worker_lanes(self):
        """The lanes a worker looks into: [(priority, type, sub)]."""
        return self.spool.lanes()

    def wake_paths(self):
        """The FIFOs a worker listens on (locks/wake)."""
        return [self.spool.producer._wake]

    def start(self):
        """At a worker's start (a RAM tier made again)."""

    def settle(self, final=False):
        """A worker's turn of what the claims do on their own (a RAM tier's
        moves; `final`: the worker stops): the monotonic time of the next,
        or None."""
        return None

    def quiet_mark(self, L, make=False):
        """The path of lane L's quiet mark, locks/quiet/LANE (`make`: its
        directory made), where its producers look (Producer.hushed)."""
        if make:
            self.spool.fs.mkdir("locks/quiet")
        return self.spool.d("locks", "quiet", L.sub.rpartition("/")[2])

def _by_age(inc, order, n, now, bad):
    """A live-first lane's cache (Scheduling: LiveFirst), of directory
    `inc`, `order` its LiveFirst: (its entries, whether one line was
    full).  The n oldest of its due backlog by the age LiveFirst gives a
    job (created_of: the millisecond at the head of an id that myq made,
    else the mtime), its n earliest due live jobs, and its n soonest not
    due, so that a
    backlog of any depth drains in created_at order (a pass in the
    directory's order drained 100,000 in the order of its slices).
    One read of the lane's names a refill, no pass: the names that myq
    made for the backlog are kept by name alone (the n first, 2n at
    most while it reads), and only the n first are stat'ed, at the
    end; another name, or a live one, is stat'ed as it is read (each
    line cut back to n at 2n: memory stays bounded).  A directory that
    lists the newest first (tmpfs) costs no more than another.  When
    some of those n wait (a retry's backoff), the made names after
    them are read again, stat'ed, for the due ones."""
    cut = order.live_cut(now)
    young = "%013d" % int(cut * 1000)  # a made name below it: backlog
    back, live, later, kept = [], [], [], []
    top = [None]        # the n-th first of `kept`, once cut back

    def others(it):     # the backlog's made names kept, the rest given
        for e in it:
            name = e.name
            if name[:13] < young and name[-5:] == ".json" and \
                    _is_generated_id(name[:-5]):
                if top[0] is None or name < top[0]:
                    kept.append(name)
                    if len(kept) >= 2 * n:
                        kept.sort()
                        del kept[n:]
                        top[0] = kept[-1]
                continue
            yield e
    def more():         # some of the n first wait: the due ones after
        if (top[0] is not None or len(kept) > n) and len(back) < n:
            for e in _made_after(inc, kept[n - 1], young, now, bad):
                yield e
    full = False
    for e in _chain(_job_entries(others(_scandir(inc)), inc, now, bad, [0]),
                    _stat_names(inc, kept, now, bad, n), more()):
        t = order.created_of(e[1], e[0]) if e[0] <= now else None
        if t is None:
            line = later
        elif t >= cut:
            line = live
        else:
            line, e = back, (t, e[1], e)
        line.append(e)
        if len(line) >= 2 * n:          # the n first of it kept
            line.sort()
            del line[n:]
            full = True
    full = full or top[0] is not None or len(kept) > n or \
        len(later) > n or len(live) > n or len(back) > n
    later.sort()
    live.sort()
    back.sort()
    best = later[:n] + live[:n] + [b[2] for b in back[:n]]
    best.sort()
    return best, full

def _stat_names(inc, names, now, bad, n):
    """_job_entries of the n first `names` of directory `inc` (a scan
    that kept them by name alone: stat'ed now, through a descriptor of
    its own, once the scan is done)."""
    names.sort()
    try:
        fd = _fresh_dir(inc)
    except OSError:
        return
    try:
        for e in _job_entries((_Named(name, fd) for name in names[:n]),
                              inc, now, bad, [0]):
            yield e
    finally:
        os.close(fd)

def _made_after(inc, after, young, now, bad):
    """_job_entries of the backlog's names that myq made after `after`
    in directory `inc` (each stat'ed)."""
    def made(it):
        for e in it:
            name = e.name
            if after < name and name[:13] < young and \
                    name[-5:] == ".json" and _is_generated_id(name[:-5]):
                yield e
    return _job_entries(made(_scandir(inc)), inc, now, bad, [0])


class FileClaims(Claims):
    """The file store's claims: a claim is a rename into processing/, a
    lane a directory, a scan a walk of the lanes' entries."""
    claim_changes_key = True
    lasting_key = True

    def claim(self, name, me, default_max_attempts=5, scheduled=False,
               sub="incoming", anytime=False):
        """Take NAME from incoming/ (or the lane `sub`) for `me`.  Returns a
        Claim, or None when the job was lost to another worker, quarantined,
        deferred, expired, moved to its lane, already done, or (scheduled:
        the scheduler saw it due by its schedule) scheduled again since,
        unless `anytime` (a held destination's probe runs it now)."""
        if not name.endswith(".json"):
            return None
        stem = name[:-5]
        src = self.spool._incoming + name if sub == "incoming" else self.spool.d(sub, name)
        if not NAME_RE.match(stem):
            try:
                self.quarantine(src, name, "bad file name: a job file is ID.json, "
                                "ID being 1-128 characters of A-Z a-z 0-9 . _ -")
            except OSError:
                if _lexists(src):
                    raise           # it stays: the worker logs why, backs off
            return None
        token = me.token()
        cname = _claim_name(stem, token)
        path = self.spool._processing + cname
        # by the door's descriptors of the two directories (the worker
        # keeps them), not their paths looked up at each step
        fs = self.spool.fs
        pfd = fs("processing")
        try:
            _rename(src, path, fs(sub), pfd)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return None             # another worker was faster
            raise
        got = self._read_claimed(path, src, name, scheduled, pfd, cname)
        if got is None:
            return None
        job, trailers, fd, st = got
        now = _now()
        if scheduled and not anytime and st.st_mtime > now + 0.5:
            # Another worker ran it and put it back with its backoff since
            # this one's scan saw it due (the mtime is the schedule): it
            # goes back untouched, to wait its time.
            os.close(fd)
            _rename(path, src, pfd, fs(sub))
            return None
        c = Claim(stem, path, job, token, fd, trailers,
                  job.get("max_attempts") or default_max_attempts, None,
                  st.st_mtime)      # (by position: keywords cost 3.5 k a job)
        if not self._admit(c, job, me, src, sub, st.st_size, scheduled, now):
            return None
        c.attempt = job["attempts"] + 1
        try:
            _lease_claim(fd, path, me, c, now + me.lease)
        except OSError:
            self.close(c)
            try:                        # give it back untouched
                _rename(path, src)
            except OSError:
                pass
            raise
        return c

    def _done_already(self, jid, now, generated):
        """Was the job just claimed done within the de-duplication window?
        An id myq generated has no locks/ok/ record (_outlive): without a
        done/ file (access(2): no exception's cost) it was not."""
        if generated:
            try:
                if not os.access(jid + ".json", os.F_OK, follow_symlinks=False,
                                 dir_fd=self.spool.fs("done")):
                    return False
            except OSError:
                pass                    # (ok_fresh says, as before)
        return self.spool.producer.ok_fresh(jid, now)

    def close(self, c):
        if c.fd is not None:
            try:
                os.close(c.fd)
            except OSError:
                pass
            c.fd = None

    def complete(self, c):
        """Success: the rename to done/, whose file is the job's idempotency
        record (see ok_fresh).  Returns False when the claim was taken back
        meanwhile."""
        self.close(c)
        fs = self.spool.fs
        try:
            _rename(c.path, self.spool._done + c.jid + ".json",
                    fs("processing"), fs("done"))
        except OSError as e:
            if e.errno == errno.ENOENT:
                return False
            raise
        return True

    def move_on(self, c, job, dest, me, fin=None, until=None):
        """Put a new version of a claimed job into incoming/ (mtime =
        available_at, or `until`) or dlq/.  The claim is first renamed to
        ID+TOKEN.fin: when that fails, the claim is no longer ours and
        nothing moves.

        `until`: a job put back for a destination that failed (myq(1) holds)
        waits until then by its mtime alone, while its available_at says
        now: a release sets the mtime to now, and a file whose mtime is not
        later than its ctime is due by its available_at (a producer's own
        file), so a release must not leave a later date there."""
        self.close(c)
        job = dict(job)
        job["updated_at"] = _now()
        job.pop("lease", None)
        job.pop("state", None)
        if dest == "incoming":
            dest = self.spool.home(job)       # its lane, when it has one
        waiting = dest.startswith("incoming")
        if waiting and dest != "incoming":
            self.spool._make_lane(dest)
        data = dumps(job)
        # The next version is written in processing/, the owner's alone
        # (not in tmp/, where a producer could swap it before the rename).
        tmp = self.spool.d("processing", _claim_name(c.jid, c.token, "new"))
        _quiet_unlink(tmp)              # left by an earlier failed try

        _create(tmp, data, sync=True, mtime=None if not waiting else
                job["available_at"] if until is None else until)
        if fin is None and c.path.endswith(".fin"):
            fin = c.path                # an earlier try got this far
        if fin is None:
            fin = self.spool.d("processing", _claim_name(c.jid, c.token, "fin"))
            try:
                _rename(c.path, fin)
            except OSError as e:
                _quiet_unlink(tmp)
                if e.errno == errno.ENOENT:
                    return False
                raise
            c.path = fin
        try:
            _rename(tmp, self.spool.d(dest, c.jid + ".json"))
        except OSError:
            _quiet_unlink(tmp)
            raise
        _unlink(fin)
        if waiting:
            self.spool.poke()
        return True

    def put_back(self, c, mtime):
        """The claim home unchanged, due at `mtime` (False: not ours now)."""
        home = self.spool.home(c.job)
        self.spool._make_lane(home)     # (incoming/ itself: there)
        if c.fd is not None:        # (kept open until it moved)
            _futime(c.fd, c.path, mtime)
        ok = _take(c.path, self.spool.d(home, c.jid + ".json"))
        self.close(c)
        return ok

    def _until_of(self, path):
        """The wall-clock end of the claim's lease: its mtime, or the line
        a claim appended (_lease_claim)."""
        try:
            data, st = self.spool.read_file(path)
            t = (_lease_of(parse(data)[1]) or {}).get("leased_until")
        except (OSError, InvalidJob):
            return 0.0
        return max(st.st_mtime, t) if _is_num(t) else st.st_mtime

    def reap(self, me=None, max_attempts=5, dry_run=False):
        """Take back claims whose owner is gone (or whose lease expired where
        liveness cannot be checked).  Returns how many were taken back."""
        self.spool.require()
        mine = me is None and not dry_run
        if mine:
            me = Identity(self.spool, kind="r")
            me.register()
        try:
            cache = {}
            now, mono = _now(), _mono()
            n = 0
            names = sorted(_listdir(self.spool.d("processing")))
            batches = {} if dry_run else self._dead_batches(
                names, me, cache, now, mono)
            for name in names:
                parts = _split_claim(name)
                if not parts or (me is not None and parts[1] == me.wid):
                    continue
                path = self.spool.d("processing", name)
                why = self._owner_gone(parts[1], path, cache, now, mono,
                                       kill=not dry_run)
                if why is None:
                    continue
                if dry_run:
                    n += 1
                elif self.take_back(path, parts[0], me, why, max_attempts,
                                     batches.get(parts[0])):
                    n += 1
            return n
        finally:
            if mine:
                me.unregister()

    def lanes_key(self, poked=False):
        """A key that changes when lanes come or go (None: no lanes).
        `poked`: a producer's poke waits in the worker's wake FIFO."""
        try:
            st = _dir_stat(self.spool.d(LANES))
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_ino)

    def maybe_lanes(self):
        """False when there is surely no lane (one cheap look)."""
        try:
            st = os.stat("lanes", dir_fd=self.spool.fs("incoming"),
                         follow_symlinks=False)
        except OSError:
            return False
        # (init makes it: empty, it has 2 links, as a directory without
        # sub-directories has where the filesystem counts them)
        return st.st_nlink != 2

    def lane_key(self, L):
        """(key, racy) of lane L, as change_key for incoming/."""
        try:
            st = _dir_stat(L.path)
        except OSError:
            return None, False
        return (st.st_mtime_ns, st.st_ino), abs(_now() - st.st_mtime) < 0.05

    def waits(self, rel):
        """Does a job wait at `rel` (LANE/ID.json)?"""
        return _lexists(self.spool.d(rel))

    def size(self, sub, name):
        """The bytes of the job NAME waiting in `sub` (OSError: gone)."""
        return _lstat(self.spool.d(sub, name)).st_size

    def due(self, rel, now):
        """The job waiting at `rel`, held by a breaker, is due now (a
        change of its time that no directory's key shows: the stop's note
        of the lanes' soonest no longer holds)."""
        _quiet_unlink(self.spool.d("locks", SCAN_NOTE))
        p = self.spool.d(rel)
        try:
            if _lstat(p).st_mtime > now:
                _utime(p, now)
        except OSError:
            pass

    def extend(self, claims, until):
        """The heartbeat: these claims' leases run until `until`."""
        for c in claims:
            try:
                _utime(c.path, until)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise

    def commit(self):
        """Group commit of what complete() did since the last (done/'s
        fsync; a lost rename runs a job again, as at-least-once allows)."""
        _fsync_dir(self.spool.d("done"))

    def scan(self, L, n, tick):
        """Refill lane L's scan cache (default: incoming/ itself) with its N
        earliest jobs (by mtime = available_at, then name): memory stays
        bounded whatever the depth of the queue.

        A directory of up to 4N entries is scanned whole; a deeper one, or
        one with more than N ready, is worked through in one pass of a
        directory iterator kept open (a "sweep"): the first refill takes the
        N earliest ready jobs of the first 4N entries, each later one the
        next N ready files, in order among themselves.  So the first job
        starts after 4N entries, not the whole directory; a refill costs N
        entries; every ready job is reached within one pass (or the next,
        for the ready ones of the first 4N beyond N).  A pass that saw jobs
        not yet due, or left ready ones, ends with a marker in the cache (at
        the soonest of them) that starts the next pass when it comes due.
        A live-first lane's (L.order) is read by age instead (_by_age)."""
        import heapq
        import itertools
        if getattr(L, "order", None) is not None:
            L.end_sweep()
            bad, inc = [], self.spool.d(L.sub)
            best, full = _by_age(inc, L.order, n, _now(), bad)
            return self._set_cache(L, best, full, inc, bad, tick)
        sp = self.spool
        now = _now()
        inc = sp.d(L.sub)
        bad = []
        nread = [0]                             # jobs entries() gave
        sweeping = L.sweep is not None          # new arrivals: next pass

        def entries(it):
            return _job_entries(it, inc, now, bad, nread)

        if not sweeping:
            it = _scandir(inc)
            best = heapq.nsmallest(n, itertools.islice(entries(it), 4 * n + 1))
            if nread[0] <= 4 * n:               # the whole directory
                it.close()
                if len(best) >= n and best[-1][0] <= now:
                    L.sweep = _scandir(inc)     # more ready than N
                    L.soonest = None
            else:                               # deep: a pass starts here
                L.sweep = it
                later = [e[0] for e in best if e[0] > now]
                best = [e for e in best if e[0] <= now]
                # All N ready: more may be, and later ones unseen: the
                # next pass must come right after this one.
                L.soonest = later[0] if later else now
        else:
            best = []
            soonest = L.soonest
            if L.dirty and (soonest is None or soonest > now):
                soonest = now           # arrivals the iterator may miss
            for ent in entries(L.sweep):
                if ent[0] <= now:
                    best.append(ent)
                    if len(best) >= n:
                        break
                elif soonest is None or ent[0] < soonest:
                    soonest = ent[0]
            else:
                L.end_sweep()
                if soonest is not None:         # wake for them: a new pass
                    best.append((soonest, "", False))
            L.soonest = soonest
            best.sort()
        self._set_cache(L, best, len(best) >= n or L.sweep is not None,
                        inc, bad, tick)

    def _set_cache(self, L, best, full, inc, bad, tick):
        """A scan's end: what is not a job file quarantined, lane L's cache
        `best` (in order: reversed, the next at its end)."""
        for name, kind in bad:
            tick()
            try:
                self.quarantine(os.path.join(inc, name), name,
                              "not a regular file (%s)" % kind)
            except OSError:
                pass
        best.reverse()
        L.cache = best
        L.cache_full = full
        L.dirty = False
        L.next_due = None

    def queued(self, jid):
        return any(_lexists(self.spool.d(sub, jid + ".json"))
                   for sub in self.spool.waiting_dirs())


# Producing ###################################################################
#
# A store's producer: job files written, the guard, the idempotency
# records.


class Producer(object):
    """A spool's producer of job files (a store's `producer`): a job
    written into incoming/ or its lane (O_TMPFILE, else through tmp/),
    fsync'd, a worker woken (locks/wake); the disk-free guard; the
    idempotency records (done/ and locks/ok/: where an id is, whether it
    was done within the window).  The file store's jobs, the SQLite
    store's drop box.  `store`: the spool it writes into (its layout, its
    policy's lanes and bounds, its budget, what an explicit id finds)."""

    def __init__(self, store):
        self.store = store
        self.path, self.opt = store.path, store.opt
        self._incoming, self._tmp = store._incoming, store._tmp
        self._ok = os.path.join(self.path, "locks", "ok", "")
        self._wake = os.path.join(self.path, "locks", "wake")
        self._seq = 0           # tmp/ names made by this process
        self._free_checked = (-1e9, True)     # low_on_space's
        self.room = (-1e9, 0, 0, 0)           # room_for's

    # Producers ---------------------------------------------------------------

    def free_problem(self):
        """None, or why the disk-free guard refuses writes now."""
        return self.free()[0]

    def free(self):
        """(None or why the disk-free guard refuses writes now, bytes free
        beyond --min-free, inodes free beyond --min-free-inodes, block
        size); (None, 0, 0, 0) when statvfs fails."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None, 0, 0, 0
        free = st.f_bavail * st.f_frsize
        files = st.f_favail - self.opt["min_free_inodes"] if st.f_files \
            else 1 << 62                # (no inode count: vfat, UBIFS)
        if free < self.opt["min_free"]:
            return ("only %d KiB free on the spool's filesystem (--min-free is "
                    "%d KiB); free some space or lower --min-free"
                    % (free // 1024, self.opt["min_free"] // 1024)), 0, 0, 0
        if files < 0:
            return ("only %d inodes free on the spool's filesystem "
                    "(--min-free-inodes is %d); remove files or prune"
                    % (st.f_favail, self.opt["min_free_inodes"])), 0, 0, 0
        return None, free - self.opt["min_free"], files, st.f_frsize or 4096

    def room_for(self, jobs):
        """The disk-free guard for a producer's new files (`jobs`: their
        bytes): None, or why it refuses them.  statvfs is asked at most once
        a second while this object's own files since stay within what it
        last saw free beyond the reserve (each counted a block more than
        its bytes, and an inode); else at once.  Like the worker's guard,
        what others write within that second is seen a second late."""
        t, room, files, block = self.room
        now = _mono()
        need = sum(jobs) + block * len(jobs)
        if now - t >= 1.0 or need > room or len(jobs) > files:
            problem, room, files, block = self.free()
            if problem:
                self.room = (-1e9, 0, 0, 0)
                return problem
            t = now
        self.room = (t, room - need, files - len(jobs), block)
        return None

    def low_on_space(self, now=None):
        """The guard, checked at most once a second (for the worker; `now`:
        its monotonic clock, read just before)."""
        t, problem = self._free_checked
        if (_mono() if now is None else now) - t > 1.0:
            problem = self.free_problem()
            self._free_checked = (_mono(), problem)
        return problem

    def prepared(self, job, explicit, delay):
        """(job, its bytes, explicit id, delay, its directory) for _enqueue;
        the type's priority fixed now (myq(1) policy).  Raises InvalidJob."""
        rules = self.store.rules(job["type"])
        own = own_destination(job, rules)
        if own:
            raise InvalidJob(own)
        if job.get("priority") is None:
            p = rules.get("priority")
            if p:
                job["priority"] = p     # fixed now (myq(1) policy)
        data = _dumps_new(job)
        if len(data) > self.opt["max_job_bytes"]:
            raise InvalidJob("job %s is %d bytes, more than --max-job-bytes "
                             "(%d); send a reference to the data instead"
                             % (job["id"], len(data), self.opt["max_job_bytes"]))
        return job, data, explicit, delay, self.store.home(job, rules)

    def place(self, todo, sync, refused=None, done=None, whole=False):
        """Place the jobs of `todo` (prepared's); their ids.  With
        `refused` (a list: import), a duplicate id or a type's bound
        refuses that job alone, (id, error) appended, and the rest go on;
        `done` (a list) gets (id, directory) of each placed, kept when an
        error ends the call.  `whole` (jobs promised already: a RAM tier's
        moves): durable, and no job named before its bytes are (_name_whole)."""
        problem = self.room_for([len(t[1]) for t in todo])
        if problem:
            raise SpoolFull("spool %s refuses the job: %s" % (self.path, problem))
        self.store.budget.charge([(t[0]["type"], len(t[1])) for t in todo],
                     [t[4] for t in todo])
        # Through descriptors of the directories, opened without following a
        # symlink: a root producer never writes outside a spool it does not
        # own, whatever its owner puts in place of tmp/ or incoming/.
        dirs = self.store.fs
        done = [] if done is None else done
        # Many jobs: each file's writeback is started (posix_fadvise) and its
        # fsync left for later (_fsync_later), so that the blocks of all are
        # allocated before the first fsync: its journal commit then holds
        # them all, and the other fsyncs find nothing to commit (ext4, 100
        # jobs: 1 commit, not 100).  The cost: their pages leave the page
        # cache, and the worker reads them from the disk.
        later = [] if whole or sync and len(todo) > 1 and _FADVISE else None
        try:
            try:
                for job, data, explicit, delay, sub in todo:
                    if sub.startswith(LANES):
                        full = self.store.make_room(job["type"], len(data), dirs)
                        if full and refused is not None:
                            refused.append((job["id"], SpoolFull(full)))
                            continue
                        if full:
                            raise SpoolFull(full)
                        if dirs.owns():
                            self.store._make_lane(sub, dirs)
                        else:
                            # lanes are the owner's: a producer drops into
                            # incoming/, and a worker moves it to its lane
                            sub = "incoming"
                    try:
                        self.place_new(job, data, explicit, delay, sync, dirs,
                                        sub, later, whole)
                    except DuplicateJob as e:
                        if refused is None:
                            raise
                        refused.append((job["id"], e))
                        continue
                    if whole:
                        if len(later) >= 256:           # descriptors
                            self._name_whole(later, done, refused)
                        continue
                    done.append((job["id"], sub))
                    if later and len(later) >= 256:     # descriptors
                        self._fsync_later(later, done)
                if whole and later:
                    self._name_whole(later, done, refused)
            except BaseException:
                if later and whole:     # (unnamed: nothing placed)
                    self._drop_whole(later)
                elif later:
                    try:                # the jobs placed before the error
                        self._fsync_later(later, done)
                    except MyqError:
                        pass            # (the first error is the one to say)
                if done and sync:
                    self.fsync_or_withdraw(done, dirs)
                raise
            if done:
                if later:
                    self._fsync_later(later, done)
                if sync:
                    self.fsync_or_withdraw(done, dirs)
                self.poke(dirs, often=True, subs=set(d[1] for d in done))
                self.arrived(todo, done)
        except OSError as e:        # opening the directories
            raise self._unwritable(e)
        finally:
            dirs.release()
        return [jid for jid, sub in done]

    def _unwritable(self, e):
        """What a producer raises when the spool's directories could not be
        opened (`e`): the door refused them (78), or the system (75)."""
        if isinstance(e, _Refused):
            return ConfigError("spool %s refuses the job: %s; nothing was "
                               "enqueued" % (self.path, e))
        return SpoolBusy("cannot write to %s: %s; nothing was enqueued"
                         % (self.path, e.strerror))

    def enqueue_one(self, todo, sync):
        """place() of one job into incoming/, without the batch's lists."""
        job, data, explicit, delay, sub = todo
        problem = self.room_for((len(data),))
        if problem:
            raise SpoolFull("spool %s refuses the job: %s" % (self.path, problem))
        self.store.budget.charge(((job["type"], len(data)),), (sub,))
        dirs = self.store.fs
        jid = job["id"]
        try:
            self.place_new(job, data, explicit, delay, sync, dirs)
            if sync:
                self.fsync_or_withdraw(((jid, sub),), dirs)
            self.poke(dirs, often=True)
            self.store.budget.note_arrival(job["type"], len(data), _mono())
        except OSError as e:        # opening the directories
            raise self._unwritable(e)
        finally:
            dirs.release()
        return jid

    def arrived(self, todo, done):
        """The arrivals of `todo` that `done` placed, into locks/rates."""
        ids = set(jid for jid, sub in done if sub not in ("done", "dlq"))
        counts = {}
        for t in todo:
            if t[0]["id"] in ids:
                c = counts.get(t[0]["type"], (0, 0))
                counts[t[0]["type"]] = (c[0] + 1, c[1] + self.store.budget.cost(len(t[1])))
        self.store.budget.note_arrivals(counts)

    def _fsync_later(self, later, done):
        """The fsyncs place_new left for later, in order, after one of the
        last file: it waits for the writeback started last, which ended
        after (nearly) all the others, so that the commit it makes holds
        them all (ext4's unwritten extents are converted when their write
        ends: in order, a file whose write ended after that commit needs
        another; 100 jobs: 1.7 commits, not 1).  The first that fails takes
        back its job and every one after it (not durable: not enqueued;
        `done` loses them), and raises as place_new would."""
        try:
            for i in ([-1] if len(later) > 1 else []) + [0] * len(later):
                jid, ino, dfd, fd, dst = later[i]
                try:
                    _step("fsync", dst, "before")
                    os.fsync(fd)
                    _step("fsync", dst, "after")
                except OSError as e:
                    for x in later:
                        self._withdraw(x[0], x[1], x[2], x[3])
                    gone = set(x[0] for x in later)
                    done[:] = [x for x in done if x[0] not in gone]
                    self._write_error(jid, e)
                if i == 0:
                    os.close(fd)
                    del later[0]
        finally:
            for x in later:
                os.close(x[3])
            del later[:]

    def _name_whole(self, later, done, refused):
        """The files of place()'s `whole`, written but not yet named
        (unnamed, or in tmp/): each fsync'd (the last first, as
        _fsync_later), then each named, (id, directory) into `done`: no
        name is ever made for bytes not yet durable.  Else a cut could
        leave a moved job's file with its length and not its bytes (UBIFS
        writes a file's data and its size to different journal heads; ext4
        an unwritten extent), the job's RAM copy gone with the same cut.
        It costs one commit more a batch (the names'), not one a job: the
        first fsync's commit holds every file's data (ext4; UBIFS: the
        data head's write buffer), the other fsyncs find nothing to write,
        an unnamed file's inode is not written (UBIFS) or is in it (ext4)."""
        try:
            for i in ([-1] if len(later) > 1 else []) + list(range(len(later))):
                jid, _, _, fd, dst = later[i][:5]
                try:
                    _step("fsync", dst, "before")
                    os.fsync(fd)
                    _step("fsync", dst, "after")
                except OSError as e:
                    self._write_error(jid, e)
            for jid, ino, dfd, fd, dst, sub, explicit, tmp, tfd in later:
                try:
                    if tmp is None:
                        if not self._link_unnamed(jid, fd, dfd, dst):
                            raise OSError(errno.ENOENT, "no /proc/self/fd")
                    else:
                        self._name_tmp(jid, explicit, tmp, tfd, dfd, dst, ino)
                except DuplicateJob as e:
                    if refused is None:
                        raise
                    refused.append((jid, e))
                    continue
                except OSError as e:
                    self._write_error(jid, e)
                done.append((jid, sub))
        finally:
            self._drop_whole(later)

    def _drop_whole(self, later):
        """_name_whole's files let go: descriptors closed, tmp/ names gone
        (a named job has its own; an unnamed file goes with its descriptor)."""
        for x in later:
            os.close(x[3])
            if x[7] is not None:
                _quiet_unlink(x[7], x[8])
        del later[:]

    def fsync_or_withdraw(self, placed, dirs):
        """Commit incoming/ (and the lanes used); when that fails the jobs
        are not durable, so take them back (an error must mean: nothing
        enqueued)."""
        try:
            for sub in sorted(set(sub for jid, sub in placed)) \
                    if len(placed) > 1 else (placed[0][1],):
                _fsync_dir(self.store.d(sub), dirs(sub))
        except OSError as e:
            for jid, sub in placed:
                _quiet_unlink(jid + ".json", dirs(sub))
            cls = SpoolFull if _space_error(e) else SpoolBusy
            raise cls("cannot commit to %s: %s; nothing was enqueued"
                      % (self.path, e.strerror))

    def _tmpname(self, jid):
        self._seq += 1
        return "%s%s.%d.%d.new" % (self._tmp, jid, _PID[0], self._seq)

    def place_new(self, job, data, explicit, delay, sync, dirs, sub="incoming",
                   later=None, whole=False):
        jid = job["id"]
        if explicit:
            where = self.store.find_id(jid, dirs=dirs)
            if where:
                raise DuplicateJob("job id %s already exists (%s); pick another "
                                   "id or delete the old job" % (jid, where))
        dst = (self._incoming if sub == "incoming" else self.store.d(sub, "")) + jid + ".json"
        tmp = tfd = fd = None
        try:
            dfd = dirs(sub)
            got = _TMPFILE and self._unnamed(job, data, delay, dirs, dfd, dst,
                                             not whole)
            if got:
                ino, fd = got
            else:
                tmp = self._tmpname(jid)
                tfd = dirs("tmp")
                ino, fd = self._through_tmp(job, data, explicit, delay, dirs,
                                            tmp, tfd, dfd, dst, not whole)
            if later is not None:       # (_enqueue: many jobs)
                if _FADVISE:
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    except OSError:
                        pass            # (its fsync will write it then)
                later.append((jid, ino, dfd, fd, dst) + (
                    (sub, explicit, tmp, tfd) if whole else ()))
                fd = None
                if whole:
                    tfd = None          # (its tmp/ name: _drop_whole's)
            elif sync:
                # The file's fsync comes after its rename into place: one
                # journal commit then holds its data, its inode and its new
                # name, and the directory's fsync that follows finds nothing
                # left to commit (ext4: one commit per enqueue, not two).  A
                # power cut before it returns may leave the name with no
                # data: an enqueue that never returned, which the worker
                # removes as an empty file (Spool._unwritten).
                try:
                    _step("fsync", dst, "before")
                    os.fsync(fd)
                    _step("fsync", dst, "after")
                except OSError:
                    self._withdraw(jid, ino, dfd, fd)
                    raise
            if explicit and tfd is not None:
                _quiet_unlink(tmp, tfd)     # (tmp/ orphans are pruned anyway)
        except MyqError:
            if tfd is not None:
                _quiet_unlink(tmp, tfd)
            raise
        except OSError as e:
            if tfd is not None:
                _quiet_unlink(tmp, tfd)
            self._write_error(jid, e)
        finally:
            if fd is not None:
                os.close(fd)

    def _unnamed(self, job, data, delay, dirs, dfd, dst, link=True):
        """The job written as an unnamed file in its directory (O_TMPFILE),
        then linked at `dst` once whole (`link` False: later, by
        _name_whole): nothing can be swapped for it, and a crash before the
        link leaves nothing behind.  (None, descriptor) for place_new (the
        inode asked only if it must be withdrawn), or None where the system
        refuses O_TMPFILE (never asked again)."""
        global _TMPFILE
        if not link and not os.path.isdir("/proc/self/fd"):
            _TMPFILE = 0            # (no /proc: no link of it later)
            return None
        _step("create", dst, "before")
        try:
            fd = os.open(".", os.O_WRONLY | _TMPFILE | O_CLOEXEC,
                         dirs.file_mode(), dir_fd=dfd)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            _TMPFILE = 0
            return None
        _step("create", dst, "after")
        try:
            owner = dirs.owner()
            if owner is not None:   # given away before it has a name
                os.fchown(fd, owner[0], owner[1])
            if dirs.file_mode() & 0o020:    # past the umask
                os.fchmod(fd, 0o660)
            _step("write", dst, "before")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            _step("write", dst, "after")
            if delay:               # (before the fsync: durable too)
                t = job["available_at"]
                _step("utime", dst, "before")
                os.utime(fd, (t, t))
                _step("utime", dst, "after")
            if link and not self._link_unnamed(job["id"], fd, dfd, dst):
                _TMPFILE = 0        # no /proc: through tmp/ from now on
                os.close(fd)
                return None
        except BaseException:
            os.close(fd)
            raise
        return None, fd

    def _link_unnamed(self, jid, fd, dfd, dst):
        """Link the unnamed file `fd` at `dst`: True, or False where there
        is no /proc to link it through (DuplicateJob: the name is taken)."""
        _step("link", dst, "before")
        try:
            os.link("/proc/self/fd/%d" % fd, dst.rpartition("/")[2],
                    dst_dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.EEXIST:
                raise DuplicateJob("job id %s is already queued; pick "
                                   "another id" % jid)
            if e.errno != errno.ENOENT or os.path.isdir("/proc/self/fd"):
                raise
            return False
        _step("link", dst, "after")
        return True

    def _through_tmp(self, job, data, explicit, delay, dirs, tmp, tfd, dfd, dst,
                     name=True):
        """The classic way, where O_TMPFILE is refused: written in tmp/,
        renamed (an explicit id: linked) into place (`name` False: later,
        by _name_whole), checked to be the file written.  (inode,
        descriptor)."""
        # Root enqueues into a spool that belongs to the worker's user:
        # the file is handed over through its own descriptor, before it
        # has a name anyone else could swap.
        ino, fd = _create(tmp, data, sync=False, dir_fd=tfd, keep=True,
                          owner=dirs.owner(), mode=dirs.file_mode(),
                          mtime=job["available_at"] if delay else None)
        if name:
            try:
                self._name_tmp(job["id"], explicit, tmp, tfd, dfd, dst, ino)
            except BaseException:
                os.close(fd)
                raise
        return ino, fd

    def _name_tmp(self, jid, explicit, tmp, tfd, dfd, dst, ino):
        """tmp/'s file of job `jid` renamed (an explicit id: linked) to
        `dst`, and checked to be the file written (`ino`)."""
        if not explicit:
            _rename(tmp, dst, tfd, dfd)
        else:
            try:
                _link(tmp, dst, tfd, dfd)   # EEXIST: the id is queued now
            except OSError as e:
                if e.errno == errno.EEXIST:
                    raise DuplicateJob("job id %s is already queued; pick "
                                       "another id" % jid)
                if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS,
                                   errno.EMLINK, errno.EXDEV):
                    raise
                if _exists(jid + ".json", dfd):  # no hard links (vfat)
                    raise DuplicateJob("job id %s is already queued" % jid)
                _rename(tmp, dst, tfd, dfd)
        self._placed(jid, ino, dfd)

    def _write_error(self, jid, e):
        """Raise the MyqError for OSError `e` while job `jid` was written."""
        if _space_error(e):
            raise SpoolFull("spool %s is full (%s); nothing was enqueued; "
                            "free space or prune" % (self.path, e.strerror))
        if e.errno in (errno.EACCES, errno.EPERM):
            raise ConfigError(
                "permission denied: uid %d may not write jobs into %s (%s); "
                "nothing was enqueued; run myq as the spool's owner%s, or "
                "give this user write access" % (os.geteuid(), self.path,
                                                 e.strerror, self.store._owner_hint()))
        raise SpoolBusy("cannot write job %s to %s: %s; nothing was enqueued"
                        % (jid, self.path, e.strerror))

    def _withdraw(self, jid, ino, dfd, fd=None):
        """An enqueue that cannot be made durable takes its file back (if no
        worker claimed it meanwhile): its error means nothing enqueued.
        `ino` None: the inode of the open descriptor `fd`."""
        name = jid + ".json"
        try:
            if ino is None:
                ino = os.fstat(fd).st_ino
            if os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino == ino:
                os.unlink(name, dir_fd=dfd)
        except OSError:
            pass

    def poke(self, dirs=None, often=False, subs=()):
        """Wake an idle worker: one byte into the FIFO locks/wake (never
        into anything else that may stand there).  `often` (a producer's
        enqueue): where no worker listened, look again 10 ms later, not at
        once (each look is a failed open; a starting worker scans incoming/
        anyway, and a job put in between waits at most for the next poke or
        the worker's --poll).  Nothing stays open between two pokes: a
        process that enqueued must not keep the spool's filesystem busy
        (umount).  `subs`: the lanes the jobs went to; none is poked for
        when all are hushed (_hushed)."""
        if often:
            t = _UNHEARD.get(self.path)
            if t is not None and _mono() < t:
                return
            if subs and self.hushed(subs):
                return
        fd = self._open_wake(dirs)
        if fd is None:
            if often:
                _UNHEARD[self.path] = _mono() + 0.01
            return
        try:
            os.write(fd, b"!")
        except OSError:     # EAGAIN: the pipe is full, it is awake anyway
            pass
        finally:
            os.close(fd)

    def hushed(self, subs):
        """Is every lane of `subs` one whose batch a worker waits out
        (locks/quiet/LANE, its mtime on the monotonic clock: until when,
        Worker._hush)?  Its jobs cannot start before, and it looks at the
        lane then: a poke would only wake it for nothing (issue 42: 5 a
        second cost it 0.5 ms each).  A mark is believed for at most the
        type's batch_wait (one of another boot, or a worker killed)."""
        now = _mono()
        for sub in subs:
            if not sub.startswith(LANES + "/"):
                return False
            name = sub[len(LANES) + 1:]
            wait = self.store.rules(name.rpartition("@")[0]).get("batch_wait")
            try:
                left = _lstat(self.store.d("locks", "quiet", name)).st_mtime - now
            except (OSError, MyqError):
                return False
            if not wait or not 0 < left <= wait:
                return False
        return True

    def _open_wake(self, dirs):
        """locks/wake open for writing, or None: no worker listens (ENXIO),
        or something else than a FIFO stands there."""
        try:
            fd = _open(self._wake, _WAKE_FLAGS)
        except (OSError, MyqError):     # ENXIO: no worker is listening
            return None
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                return fd
        except OSError:
            pass
        os.close(fd)
        return None

    # Idempotency records -----------------------------------------------------

    def mark_ok(self, jid, t=None):
        """A record in locks/ok/ that `jid` was done at `t` (default now)."""
        path = self._ok + jid
        try:
            _create_empty(path)
        except OSError as e:
            if e.errno != errno.EEXIST:
                raise
            t = _now() if t is None else t
        if t is not None:
            _utime(path, t)

    def outlive(self, path, now=None):
        """done/ID.json is about to go: keep the id's de-duplication in
        locks/ok/ when its window has not ended, unless the id is one myq
        generated (no producer chose it, none will send it again)."""
        jid = os.path.basename(path)[:-5]
        if GENERATED_ID_RE.match(jid) or not NAME_RE.match(jid):
            return
        try:
            t = _lstat(path).st_ctime
        except OSError:
            return
        now = _now() if now is None else now
        if t + self.opt["dedupe_window"] > now:
            try:
                self.mark_ok(jid, t)
            except OSError:
                pass        # what retention removes is not worth failing for

    def find_id(self, jid, now=None, dirs=None):
        """Where an id lives for de-duplication: a state name or None (the
        file store's find_id; the SQLite store's rows have their own)."""
        dirs = dirs or self.store.fs
        for sub in self.store.waiting_dirs():
            if _exists(jid + ".json", dirs(sub)):
                return "queued"
        if _exists(jid + ".json", dirs("dlq")):
            return "dead"
        prefix = jid + "+"
        for name in _listdir(self.store.d("processing")):
            if name.startswith(prefix):
                return "processing"
        if self.ok_fresh(jid, now):
            return "done within the de-duplication window"
        return None

    def ok_fresh(self, jid, now=None, dirs=None):
        """Was `jid` done within the de-duplication window?  Its done/ file
        is the record while it stays (its ctime: the rename that finished
        it); a record in locks/ok/ (mtime: when it was done) outlives it."""
        now = _now() if now is None else now
        window = self.opt["dedupe_window"]
        records = (("done", jid + ".json", "st_ctime"),)
        if not _is_generated_id(jid):
            # (an id myq generated never gets a locks/ok/ record: _outlive)
            records += (("locks/ok", jid, "st_mtime"),)
        for sub, name, when in records:
            try:
                # (every claim asks: access(2) says no without the cost of
                # an exception; it looks with the real uid, as good)
                fd = self.store.fs(sub)
                if not os.access(name, os.F_OK, dir_fd=fd,
                                 follow_symlinks=False):
                    continue
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if dedupe_fresh(getattr(st, when), window, now):
                return True
        return False

    def _placed(self, jid, ino, dfd):
        """What went into incoming/ must be the file written (the spool's
        owner may swap tmp/'s entry for a link between the write and the
        rename); else nothing was enqueued."""
        name = jid + ".json"
        try:
            ok = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino == ino
        except OSError as e:
            # Gone already: a worker claimed it (or the owner removed it,
            # which the owner may do to any job): what we wrote was placed.
            ok = e.errno == errno.ENOENT
        if not ok:
            _quiet_unlink(name, dfd)
            raise SpoolBusy("job %s was replaced in %s/tmp while it was written "
                            "(by the spool's owner?); nothing was enqueued"
                            % (jid, self.path))


# Upkeep ######################################################################
#
# A store's upkeep: the operator's moves, retention, check.


class Upkeep(object):
    """The operator's moves (retry, delete) and retention (prune, the
    guards' make_space, the reserve) and check, over a spool (a store's
    `upkeep`; FileUpkeep for files, _SqlUpkeep for queue.db).  `store`:
    the spool (its layout, claims, reader, producer, policy, budget)."""

    def __init__(self, store):
        self.store = store
        self._seq = 0           # processing/ names made by delete

    def _abstract(self):
        raise NotImplementedError("Method must be implemented by the store")

    def _retry(self, ids, missing, me, now=False):
        """retry's moves of the store's own jobs."""
        self._abstract()

    def _prune_jobs(self, now, full, out):
        """prune's part over the store's own finished jobs."""
        self._abstract()

    def make_space(self, n=256):
        """Below a guard: the oldest done jobs go, their ids kept."""
        self._abstract()

    # Operator moves ----------------------------------------------------------

    def _located(self, ids, missing):
        """(id, state, path) of each id that exists; the others go to
        `missing` (the caller reports them all at once, exit 66)."""
        for jid in ids:
            try:
                state, path = self.store.locate(jid)
            except NoSuchJob:
                missing.append(jid)
                continue
            yield jid, state, path

    def retry(self, ids=(), all=False, now=False):
        """Bring dead (or repaired failed) jobs back, attempts reset; with
        `now`, make waiting (scheduled) jobs ready now, attempts kept."""
        self.store.require()
        ids = [_check_ref(i) for i in _ids(ids)]
        if all:
            ids += [n[:-5] for n in sorted(_listdir(self.store.d("dlq")))
                    if n.endswith(".json")]
        missing = []
        me = Identity(self.store, kind="r")   # registered when a dead job moves
        try:
            n = self._retry(ids, missing, me, now)
        finally:
            me.unregister()
        if missing:
            raise NoSuchJob("no dead or failed job %s in %s (retry takes jobs "
                            "from dlq/ and failed/; retry --now also scheduled "
                            "ones)" % (", ".join(missing), self.store.path))
        return n

    def _unreadable_by_worker(self, path):
        """Why the spool's owner (whom its worker runs as) may not read and
        append to the file at `path`, or None: a root producer's 0600 file
        would be quarantined again at once."""
        try:
            st = _lstat(path)
            top = os.fstat(self.store.fs(""))
        except OSError:
            return None
        if top.st_uid == 0 or not stat.S_ISREG(st.st_mode):
            return None
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid == top.st_uid:
            ok = mode & 0o600 == 0o600
        elif st.st_gid == top.st_gid:
            ok = mode & 0o060 == 0o060
        else:
            ok = mode & 0o006 == 0o006
        if ok:
            return None
        return ("the file belongs to uid %d, mode %04o, and the worker (uid %d, "
                "the spool's owner) cannot read and append to it; give it to "
                "the owner first (chown %d %s) and retry" % (
                    st.st_uid, mode, top.st_uid, top.st_uid, path))

    def _make_ready(self, jid, path, me):
        """retry --now: a waiting job's new version, available now, replaces
        it the way a retry does (owned first, written in tmp/, renamed into
        incoming/): a worker never sees it half-written, never twice.  False
        when a worker took it first."""
        job, _, _ = self.store.load(path, jid)
        if job["available_at"] <= _now() and os.lstat(path).st_mtime <= _now():
            return True                 # ready already
        job["available_at"] = _now()
        if not me.registered:
            me.register()
        owned = self.store.claims.own(path, jid, me)
        if owned is None:
            return False
        fin, token = owned
        self.store.claims.move_on(Claim(jid=jid, path=fin, token=token, job=job),
                      job, "incoming", me, fin=fin)
        self.store.log("retry_now", id=jid)
        return True

    def delete(self, ids, force=False):
        self.store.require()
        ids = [_check_ref(i) for i in _ids(ids)]
        missing, n = [], 0
        for jid, state, path in self._located(ids, missing):
            r = self._delete_one(jid, state, path, force)
            if r == 0:
                # it moved since it was found (a worker claimed or finished
                # it): once more, where it is now (running: exit 75)
                again = list(self._located([jid], []))
                r = self._delete_one(*(again[0] + (force,))) if again else None
            if r is None:
                missing.append(jid)
                continue
            n += r
        if missing and self.store.ram is not None:     # (the RAM tier's)
            still = []
            for jid in missing:
                try:
                    n += self.store.ram.delete([jid], force)
                except NoSuchJob:
                    still.append(jid)
            missing = still
        if missing:
            raise NoSuchJob("no job %s in %s" % (", ".join(missing), self.store.path))
        return n

    def _delete_one(self, jid, state, path, force):
        """1 when the file went, 0 when it was gone already, None when a
        running job's claim went elsewhere first."""
        if state == "processing":
            if not force:
                raise SpoolBusy("job %s is running; wait for it, or delete "
                                "it with --force (its handler is killed)" % jid)
            # Take it from the worker first (its finish then fails with
            # ENOENT and moves nothing), then stop the handler.
            self._seq += 1
            gone = self.store.d("processing", "%s+deleted.%d.%d.new" % (
                jid, os.getpid(), self._seq))
            if not _take(path, gone):

                return None
            self.store.claims.kill_handler(_claim_token(path), 15)
            path = gone
        elif state == "done":
            self.store.producer.outlive(path)
        try:
            _unlink(path)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
            return 0
        finally:
            if state == "failed":
                _quiet_unlink(path + ".reason")
        return 1

    def delete_where(self, state, type=None, older_than=None, force=False,
                     now=None):
        """Delete in bulk (myq(1) guards): the jobs in `state`, of `type`, older
        than `older_than` seconds: counted from created_at for waiting and
        running jobs, from the finish for done and dead ones, from the
        quarantine for failed files.  Running jobs only with `force`.
        Returns how many went."""
        now = self._bulk_delete(state, force, now)
        sub = STATE_DIRS[state]
        subs = self.store.waiting_dirs() if sub == "incoming" else [sub]
        chosen = []
        for e in (e for d in subs for e in _scandir(self.store.d(d))):
            name = e.name
            if sub == "failed":
                if name.endswith(".reason"):
                    continue
                jid = name
            elif sub == "processing":
                if not _split_claim(name):
                    continue
                jid = _split_claim(name)[0]
            elif not name.endswith(".json"):
                continue
            else:
                jid = name[:-5]
            try:
                st = e.stat(follow_symlinks=False)
                p = self.store.d(sub, e.name)
                if sub == "failed":
                    job = {"state": "failed", "type": type and self._failed_type(p)}
                else:
                    job = self.store.reader._describe(state, p)
            except OSError:
                continue                # it moved while we looked
            except InvalidJob:
                continue                # not a job: a worker quarantines it
            if job["state"] != state or (type is not None and job["type"] != type):
                continue
            born = job["created_at"] if sub in ("incoming", "processing") \
                else st.st_ctime
            if older_than is not None and now - born < older_than:
                continue
            chosen.append((jid, self.store.d(sub, e.name)))
        n = 0
        for jid, path in chosen:
            n += self._delete_one(jid, state, path, force) or 0
        return n

    def _bulk_delete(self, state, force, now):
        """delete_where's checks of its words (either store's); its `now`."""
        self.store.require()
        if state not in STATES:
            raise UsageError("unknown state %r; one of: %s" % (state, " ".join(STATES)))
        if state == "processing" and not force:
            raise SpoolBusy("running jobs are deleted only with --force (their "
                            "handlers are killed)")
        return _now() if now is None else now

    def _failed_type(self, path):
        """The type a quarantined file names, if it is a JSON object at all."""
        try:
            obj, _ = parse(self.store.read_file(path)[0])
        except (OSError, InvalidJob, ValueError):
            return None
        return obj.get("type") if isinstance(obj, dict) else None

    # What retention removes (myq(1) guards): directory, the count's name, which
    # time says how old an entry is, the option of how long it stays, the
    # option of how many stay at most, and whether the worker's frequent
    # pass does it too.
    _RETENTION = (
        ("done", "done", "ctime", "keep_done", "keep_done_max", True),
        ("tmp", "tmp", "oldest", "keep_tmp", None, True),
        ("dlq", "dead", "ctime", "keep_dead", "keep_dead_max", False),
        ("failed", "failed", "ctime", "keep_failed", None, False),
        ("locks/ok", "ok", "mtime", "dedupe_window", "keep_ok_max", False),
    )

    def prune(self, now=None, full=True):
        """Apply retention: done/, dlq/, failed/, tmp/, idempotency records,
        records of dead workers.  Returns counts of what was removed.
        `full=False` (the worker's frequent pass) does done/ and tmp/ only."""
        self.store.require()
        now = _now() if now is None else now
        out = dict(done=0, dead=0, failed=0, tmp=0, ok=0, workers=0)
        bound = self._prune_jobs(now, full, out)
        # What is removed unrun is counted (stats removed=): tmp/ strays,
        # and idempotency records past their bound in count.
        for what, n in (("tmp", out["tmp"]), ("ok", bound.get("locks/ok", 0))):
            if n:
                self.store.log("removed", what=what, n=n, why="stray in tmp/"
                         if what == "tmp" else "past --keep-ok-max")
                self.store.count("removed", what, n)
        if full:
            for e in _scandir(self.store.d("failed")):      # reasons left alone
                p = self.store.d("failed", e.name)
                if e.name.endswith(".reason") and not _lexists(p[:-7]):
                    _quiet_unlink(p)
            out["workers"] = self._prune_workers(now)
            self._compact_retries(now)
            out["tmp"] += self._prune_strays(now)
            self.store.breaker.prune()
        return out

    # The reserve: locks/room, ROOM bytes the worker sets aside while there
    # is room (incompressible, so UBIFS keeps them too) and gives up when
    # retention frees nothing: a full disk (a backlog that filled the
    # flash, another program's file) still leaves a starting worker room
    # for its record and the backlog a way out (myq(1) guards).

    def keep_room(self):
        """Set the reserve aside when it is not and the guards allow."""
        path = self.store.d("locks", "room")
        if _lexists(path) or self.store.free_problem() or \
                not self.store.budget.budget_takes(self.store.ROOM):
            return False
        try:
            _replace(path, os.urandom(self.store.ROOM), mode=0o600)
        except OSError as e:
            self.store.log("error", during="reserve", error=e.strerror or str(e))
            return False
        return True

    def _free_room(self):
        try:
            _unlink(self.store.d("locks", "room"))
        except OSError:
            return False
        return True

    def _prune_strays(self, now):
        """What a crash left of the owner's own writes, older than
        --keep-tmp: a retry's or dead letter's next version in processing/
        (ID+TOKEN.new) and a record's new version (.NAME.PID.N.tmp)."""
        n = 0
        for sub, end, keep in (
                ("processing", ".new", "keep_tmp"), ("", ".tmp", "keep_tmp"),
                ("locks", ".tmp", "keep_tmp"), ("locks/workers", ".tmp", "keep_tmp"),
                ("locks/held", ".tmp", "keep_tmp"),
                ("locks/batches", "", "dedupe_window")):
            for e in _scandir(self.store.d(sub) if sub else self.store.path):
                if not e.name.endswith(end) or (end == ".tmp" and e.name[:1] != "."):
                    continue
                if end == ".tmp" and _writer_lives(e.name):
                    continue        # (old by a clock that jumped: in use)
                try:
                    if now - e.stat(follow_symlinks=False).st_ctime > self.store.opt[keep]:
                        _unlink(self.store.d(sub, e.name) if sub else self.store.d(e.name))
                        n += 1
                except OSError:
                    pass
        return n

    def aged(self, sub, age):
        """(time, name) of the entries of SUB that retention may remove, by
        their "ctime", "mtime" or the "oldest" of the two."""
        for e in _scandir(self.store.d(sub)):
            if sub == "failed" and e.name.endswith(".reason"):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            yield (st.st_ctime if age == "ctime" else st.st_mtime if age == "mtime"
                   else min(st.st_mtime, st.st_ctime)), e.name

    def _expire(self, sub, age, keep, most, now, bound=None):
        """Remove what in SUB is older than KEEP seconds, then the oldest
        beyond the newest MOST; returns how many went (`bound[sub]`: how
        many of them for MOST).  Memory stays bounded whatever the count:
        a second pass keeps a heap of at most 10,000 of the oldest (the
        rest goes at the next prune)."""
        import heapq
        n = left = 0
        for t, name in self.aged(sub, age):
            if now - t > keep:
                n += self.remove(sub, self.store.d(sub, name))
            else:
                left += 1
        if most is None or left <= most:
            return n
        oldest = heapq.nsmallest(min(left - most, 10000), self.aged(sub, age))
        m = sum(self.remove(sub, self.store.d(sub, name)) for _, name in oldest)
        if bound is not None:
            bound[sub] = m
        return n + m

    def remove(self, sub, path):
        """1 when the entry went (a quarantined directory whole, a failed
        file with its .reason), else 0."""
        try:
            if sub == "done" and path.endswith(".json"):
                self.store.producer.outlive(path)
            if sub == "failed" and stat.S_ISDIR(_lstat(path).st_mode):
                self._rmtree(path)
            else:
                _unlink(path)
        except OSError:
            return 0
        if sub == "failed":
            _quiet_unlink(path + ".reason")
        return 1

    def _prune_workers(self, now):
        """Records in locks/workers/ of workers that are gone (and hold no
        claim), and handler records whose claim has ended."""
        n = 0
        owners, tokens = self._holders()
        cache, mono = {}, _mono()
        for name in _listdir(self.store.d("locks", "workers")):
            path = self.store.d("locks", "workers", name)
            if name.endswith(".run"):
                if name[:-4] not in tokens:
                    n += self.remove("locks/workers", path)
            elif name.endswith(".json") and name[:-5] not in owners:
                why = self.store.claims._owner_gone(name[:-5], path, cache, now, mono)
                if why and "lease" not in why and "hung" not in why:
                    n += self.remove("locks/workers", path)
        ram = self.store.ram
        if ram is not None:
            # the tier's beats (Identity.beat) of workers whose record is
            # gone (a record is made before its beat, removed after it)
            for name in _listdir(ram.d("locks", "workers")):
                if name.endswith(".beat") and not _lexists(self.store.d(
                        "locks", "workers", name[:-5] + ".json")):
                    _quiet_unlink(ram.d("locks", "workers", name))
        return n

    def _holders(self):
        """(worker ids, tokens) of the claims held now."""
        claims = _listdir(self.store.d("processing"))
        return (set(p[1] for p in map(_split_claim, claims) if p),
                set(map(_claim_token, claims)))

    def _rmtree(self, path):
        """Remove a directory that a producer quarantined, with what is in
        it, through descriptors: never through a link inside."""
        fd = _fresh_dir(path)
        try:
            for e in os.scandir(fd):
                try:
                    if e.is_dir(follow_symlinks=False):
                        self._rmtree(path + "/" + e.name)
                    else:
                        os.unlink(e.name, dir_fd=fd)
                except OSError:
                    pass
        finally:
            os.close(fd)
        parent, _, name = path.rpartition("/")
        try:
            os.rmdir(name, dir_fd=_dir_fd(parent))
        except OSError:
            pass

    def _compact_retries(self, now):
        path = self.store.d("locks", "retries")
        try:
            if _lstat(path).st_size < 65536:
                return
            data = _read_small(path, 1 << 20, tail=True) or b""
            lines = [l for l in data.split(b"\n")
                     if l.strip().isdigit() and int(l) > now - 120]
            _replace(path, b"".join(l + b"\n" for l in lines))
        except OSError:
            pass

    def check(self, operator=True):
        """Health problems, one line each; [] when healthy.  With
        `operator`, also what waits for an operator (dead jobs, quarantined
        files, files in incoming/ no worker takes)."""
        if not os.path.isdir(self.store.path):
            self.store.require()              # exit 78: there is no spool at all
        ram = self.store.ram
        problems = [] if ram is None else ram.problems()
        for sub in SUBDIRS:
            if not os.path.isdir(self.store.d(sub)):
                try:
                    self.store._unusable(sub)     # there, but out of this user's reach
                except ConfigError as e:
                    return [str(e)]
                problems.append("%s/ is missing; run: myq --spool %s init"
                                % (self.store.d(sub), self.store.path))
        if problems:
            problem = self.store.free_problem()
            return problems + ([problem] if problem else [])
        try:
            self.store.check_filesystem()
        except ConfigError as e:
            problems.append(str(e))
        for sub in SUBDIRS + ("locks/ok", "locks/workers"):
            p = self.store.d(sub)
            if not os.path.isdir(p):
                problems.append("%s is missing; run: myq --spool %s init"
                                % (p, self.store.path))
            elif not os.access(p, os.W_OK | os.X_OK):
                problems.append("%s is not writable by uid %d; fix its owner "
                                "(myq init --owner USER)" % (p, os.getuid()))
        for sub in ("tmp", "incoming"):
            try:
                mode = os.stat(self.store.d(sub)).st_mode
            except OSError:
                continue
            if mode & 0o022 and not mode & stat.S_ISVTX:
                problems.append(
                    "%s is writable by others than its owner without the sticky "
                    "bit: a producer can rename the lanes and other producers' "
                    "jobs out of it; chmod +t %s" % (self.store.d(sub), self.store.d(sub)))
        problems += self._check_private()
        wake = self.store.d("locks", "wake")
        try:
            if not stat.S_ISFIFO(os.lstat(wake).st_mode):
                problems.append("%s is not a FIFO; remove it and run myq init"
                                % wake)
        except OSError:
            problems.append("%s is missing (workers poll instead of waking); "
                            "run myq init" % wake)
        problem = self.store.free_problem()
        if problem:
            problems.append(problem)
        self.store.policy()
        if self.store.policy_error:
            problems.append(self.store.policy_error)
        self.store.lanes()
        for sub, why in sorted(self.store.lane_problems.items()):
            if "Permission denied" in why and _lexists(self.store.d(sub)):
                continue                # (_unreadable_problems names it)
            problems.append("lane %s is not used: %s" % (sub, why))
        stale = self.store.reap(dry_run=True)
        if stale:
            problems.append("%d claim(s) in processing/ belong to dead workers or "
                            "expired leases; run: myq --spool %s reap"
                            % (stale, self.store.path))
        problems += self._unreadable_problems()
        problems += self._worker_problems()
        return problems + (self._needs_operator() if operator else [])

    def _live_workers(self):
        """The records (locks/workers/w-*.json) of this spool's workers
        that live; one whose liveness cannot be checked from here (another
        host or pid namespace) counts as living."""
        out = []
        host, ns = os.uname()[1], pid_namespace()
        for name in _listdir(self.store.d("locks", "workers")):
            if not (name.startswith("w-") and name.endswith(".json")):
                continue
            try:
                rec = json.loads(self.store.read_file(self.store.d("locks", "workers", name),
                                                65536)[0].decode("utf-8"))
            except (OSError, ValueError, InvalidJob):
                continue
            if not isinstance(rec, dict):
                continue
            if rec.get("host") == host and rec.get("pidns") == ns:
                if rec.get("boot_id") and boot_id() and \
                        rec.get("boot_id") != boot_id():
                    continue
                if not _pid_alive(rec.get("pid"), rec.get("start")):
                    continue
            out.append(rec)
        return out

    def _worker_problems(self):
        """check's word on the workers: ready jobs waiting over a minute
        with none alive; living ones logging to a syslog nobody reads."""
        workers = self._live_workers()
        if not workers:
            st = self.store.stats()
            if st["ready"] and st["oldest_ready_s"] > 60:
                return ["%d ready job(s) wait, the oldest for %ds, and no worker "
                        "runs; start the service: /etc/init.d/myq start (or a "
                        "worker: myq --spool %s worker --handlers DIR)"
                        % (st["ready"], st["oldest_ready_s"], self.store.path)]
            return []
        if any(w.get("log") == "syslog" for w in workers):
            problem = _syslog_problem()
            if problem:
                return ["the workers' " + problem]
        return []

    def _unreadable_problems(self):
        """The spool's own files that this user (its owner, as check runs)
        cannot read or write: each named, with the chown that fixes it."""
        out = []
        for rel, mode in (("locks/policy.lock", os.W_OK),
                          ("locks/room", os.R_OK | os.W_OK),
                          ("queue.db", os.R_OK | os.W_OK),
                          ("incoming/lanes", os.R_OK | os.W_OK | os.X_OK)):
            p = self.store.d(*rel.split("/"))
            if _lexists(p) and not os.access(p, mode):
                out.append("%s cannot be %s by uid %d (permission denied); give "
                           "the spool to its owner: %s" % (
                                   p, "used", os.geteuid(), self.store.chown_fix()))
        return out

    def _check_private(self):
        """What only the owner may open, open to others (a producer could
        lock it for ever); what init moved aside from incoming/lanes/."""
        out = []
        for sub, name in _PRIVATE:
            p = self.store.d(sub, name) if sub else self.store.d(name)
            try:
                mode = stat.S_IMODE(os.lstat(p).st_mode)
            except OSError:
                continue
            if mode & 0o077:
                out.append("%s may be opened by others (mode %04o): a producer "
                           "could lock it; run myq --spool %s init"
                           % (p, mode, self.store.path))
        for name in _listdir(self.store.d("incoming")):
            if name.startswith("lanes.refused-"):
                out.append("%s is what stood at incoming/lanes/, not the "
                           "owner's, moved aside (never used): look at it, "
                           "then remove it" % self.store.d("incoming", name))
        return out

    def _needs_operator(self):
        """What waits for an operator: dead jobs, quarantined files, files
        in incoming/ that no worker will take."""
        out = []
        spool = "myq --spool %s" % self.store.path
        dead = self.store.reader.counts(_now())[5]
        if dead:
            out.append("%d dead job(s) in dlq/; see: %s list dead; then retry "
                       "or delete them" % (dead, spool))
        failed = self.store.reader.counts(_now())[6]
        if failed:
            out.append("%d file(s) quarantined in failed/; see: %s list failed "
                       "(repair and retry, or delete)" % (failed, spool))
        for h in self.store.breaker.records():
            if h.get("missing"):
                out.append("type %s is held: %s; its jobs wait (no attempt "
                           "counts) and run once the handler is there"
                           % (h["dest"], h.get("why")))
                continue
            out.append("destination %s is held until %s: %s; its jobs wait (no "
                       "attempt counts), a probe is sent after each backoff, and "
                       "they run after its first success (now: %s resume --dest "
                       "%s)" % (h["dest"], iso(h.get("until") or 0, frac=False),
                                h.get("why"), spool, h["dest"]))
        for t, dests in self.store.dest_states().items():
            if len(dests) > 1 and any(d["state"] == "held" for d in dests):
                up = [d["dest"] for d in dests if d["state"] == "ok"]
                out.append("type %s fails over: %s; its jobs go to %s" % (
                    t, ", ".join("%s %s" % (d["dest"], d["state"])
                                 for d in dests),
                    up[0] if up else "none (every destination is held)"))
        for t in self.store.paused():
            out.append("%s is paused: no new job of it starts; resume with: %s "
                       "resume %s" % ("every type" if t == "*" else "type " + t,
                                      spool, "--all" if t == "*" else t))
        stray = [n for n in _listdir(self.store.d("incoming"))
                 if not n.endswith(".json") and not n.startswith(".")
                 and n != "lanes"]
        if stray:
            out.append("%d file(s) in incoming/ do not end in .json and are "
                       "never run (a producer must mv NAME.json into place), "
                       "e.g. %s" % (len(stray), _kv(stray[0])))
        return out


# Reading and export ##########################################################
#
# The backlog as JSON lines (export, import), the statistics' text
# forms, and a store's reader (locate, show, list, stats).


class Backlog(object):
    """export and import (myq(1) export): a backlog as JSON lines, one
    job a line with its state, between spools, stores and devices: a
    store's, as store.backlog; what export reads is its FileBacklog's or
    SqlBacklog's, the same lines."""

    EXPORTED = ("ready", "scheduled", "processing", "done", "dead")
    BATCH = 256                 # jobs an import places in one commit

    def __init__(self, store):
        self.store = _weakref.proxy(store)

    def export(self, states=(), type=None, skip=None):
        """The jobs of `states` (all: every one), of `type`, as dicts with
        their state, skipping the ids of `skip`."""
        raise NotImplementedError("Method must be implemented by the store")

    # Export ------------------------------------------------------------------

    def _export_args(self, states, skip):
        """export's words checked (both stores): the states as a set, and
        skip (a no-op when None)."""
        states = frozenset(states or self.EXPORTED)
        for s in states:
            if s not in STATES:
                raise UsageError("unknown state %r; one of: %s"
                                 % (s, " ".join(STATES)))
        return states, skip or (lambda path, why: None)

    def _exported(self, sub, name, skip):
        """The row of one entry of `sub`, or None (not a job file, gone)."""
        if sub == "processing":
            parts = _split_claim(name)
            if not parts or parts[2] != "json":
                return None             # (a .fin: being finished)
            stem = parts[0]
        elif name.endswith(".json"):
            stem = name[:-5]
        else:
            return None
        path = self.store.d(sub, name)
        try:
            job, trailers, st = self.store.load(path, stem)
        except OSError as e:
            if e.errno != errno.ENOENT:
                skip(path, e.strerror or str(e))
            return None                 # (it moved while we looked)
        except InvalidJob as e:
            skip(path, str(e))
            return None
        lease = _lease_of(trailers)
        if lease is None and sub in ("processing", "done"):
            lease = _claim_lease(path, st, job, trailers)
        if lease and isinstance(lease.get("attempt"), int):
            job["attempts"] = lease["attempt"]      # (as a reaper counts it)
        job.pop("lease", None)
        if sub.startswith("incoming"):
            # the file's mtime is its schedule when later than its ctime
            # (a retry's, a hold's); the same within a millisecond: the
            # job's own (what a utime to it made of the float)
            t = st.st_mtime
            if t > st.st_ctime and abs(t - job["available_at"]) > 1e-3:
                job["available_at"] = t
            state = "scheduled" if job["available_at"] > _now() else "ready"
        else:
            state = {"processing": "processing", "done": "done",
                     "dlq": "dead"}[sub]
        job["state"] = state
        return job

    def _exported_failed(self):
        """Quarantined files (asked for by name: not jobs): the file's
        name, its reason, its bytes as text when they are UTF-8."""
        for e in _scandir(self.store.d("failed")):
            if e.name.endswith(".reason"):
                continue
            path = self.store.d("failed", e.name)
            reason = _read_small(path + ".reason")
            try:
                text = self.store.read_file(path)[0].decode("utf-8")
            except (OSError, InvalidJob, UnicodeError):
                text = None
            yield {"state": "failed", "file": e.name,
                   "reason": reason.decode("utf-8", "replace").strip()
                   if reason else None, "bytes": text}

    # Import ------------------------------------------------------------------

    def spool_line(self, type=None):
        """export's first line: what the spool needs besides its jobs to
        work the same elsewhere -- its queue's name and its per-type
        policy (with `type`, that type's rules and the default's); None
        for a spool with neither a policy nor a name of its own (an
        export of jobs alone, as before)."""
        self.store.require()
        pol = self.store.policy()
        if type is not None:
            pol = dict((k, v) for k, v in pol.items() if k in (type, "*"))
        if not pol and not self.store.named():
            return None
        return {"spool": {"queue": self.store.name, "policy": pol}}

    def _import_spool(self, line, counts, policy):
        """An export's spool line: its policy applied (each type's rules
        replace this spool's for that type; other types are kept) unless
        not `policy`; its queue's name kept where this spool has none of
        its own and holds no job yet."""
        try:
            obj = _decode(line if isinstance(line, str) else line.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise InvalidJob("not JSON: %s" % e)
        obj = obj.get("spool") if isinstance(obj, dict) else None
        if not isinstance(obj, dict):
            raise InvalidJob("a spool line is {\"spool\": {\"queue\", \"policy\"}}")
        pol = obj.get("policy") or {}
        try:
            pol = Policy.check(pol)
        except (ValueError, MyqError) as e:
            raise InvalidJob("its policy: %s" % e)
        name = obj.get("queue")
        if policy:
            for t, rules in sorted(pol.items()):
                own = self.store.policy().get(t, {})
                changes = dict(rules)
                changes.update((k, None) for k in own if k not in rules)
                self.store.set_policy(t, changes)
            counts["policy"] = sorted(pol)
        if isinstance(name, str) and _is_name(name) and not self.store.named() \
                and name != self.store.name and not any(self.store.reader.counts(_now())[:-1]):
            self.store.set_name(name)
            counts["queue"] = name

    def import_jobs(self, lines, refuse=None, policy=True):
        """Add the jobs of export's lines (bytes or text, numbered from 1),
        each durable as enqueue makes it and with its state: ready,
        scheduled and processing ones wait (mtime = available_at; a
        claimed one as ready, its attempt kept), dead ones go to dlq/,
        done ones to done/ (there, the id's idempotency record).  An id
        the spool has is refused as enqueue refuses it, and the rest go
        on; so does a bad line (refuse(lineno, why) for either, a
        type's bound too).  Counts {"imported", "duplicate", "bad",
        "refused"}; the disk-free guard raises SpoolFull, its `counts`
        and `line` (the first not imported) set."""
        self.store.require()
        refuse = refuse or (lambda n, why: None)
        counts = dict(imported=0, duplicate=0, bad=0, refused=0)
        todo, nums = [], []
        for n, line in enumerate(lines, 1):
            try:
                if not isinstance(line, InvalidJob) and \
                        line.lstrip()[:9] in (b'{"spool":', '{"spool":'):
                    self._import_spool(line, counts, policy)
                    continue
                todo.append(self._imported(line))
            except InvalidJob as e:
                counts["bad"] += 1
                refuse(n, str(e))
                continue
            nums.append(n)
            if len(todo) >= self.BATCH:
                self._import_batch(todo, nums, counts, refuse)
                todo, nums = [], []
        if todo:
            self._import_batch(todo, nums, counts, refuse)
        return counts

    def _imported(self, line):
        """Producer.prepared's tuple for one line, or InvalidJob."""
        if isinstance(line, InvalidJob):
            raise line          # (a line too long to read: _bounded_lines)
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeError as e:
                raise InvalidJob("not UTF-8: %s" % e)
        if not line.strip():
            raise InvalidJob("an empty line")
        try:
            obj = _decode(line)
        except RecursionError:
            raise InvalidJob("JSON nested too deep")
        except ValueError as e:
            raise InvalidJob("not JSON: %s" % e)
        if not isinstance(obj, dict):
            raise InvalidJob("a job is a JSON object, not %s"
                             % type(obj).__name__)
        _check_value(obj, line)
        state = obj.pop("state", "ready")
        if state == "failed":
            raise InvalidJob("a quarantined file (failed/), not a job: "
                             "repair it, then enqueue it")
        if state not in self.EXPORTED:
            raise InvalidJob("unknown state %s; one of: %s" % (
                json.dumps(state)[:40], " ".join(self.EXPORTED)))
        if obj.get("id") is None:
            raise InvalidJob("job has no id (import keeps each job's id: "
                             "a second run must not add it again)")
        job = normalize(obj)
        job.pop("lease", None)
        data = dumps(job)
        most = self.store.opt["max_job_bytes"] + (SLACK if _rewritten(job) else 0)
        if len(data) > most:
            raise InvalidJob("job %s is %d bytes, more than --max-job-bytes "
                             "(%d)" % (job["id"], len(data), most))
        if state in ("dead", "done"):
            return job, data, True, 0, STATE_DIRS[state]
        delay = max(0.0, job["available_at"] - _now())
        return job, data, True, delay, self.store.home(job)

    def _import_batch(self, todo, nums, counts, refuse):
        """_enqueue of one batch (`nums`: the line of each), each refusal
        counted, and said unless it is a duplicate."""
        refused, placed = [], []
        try:
            self.store._enqueue(todo, True, refused, placed)
        except SpoolFull as e:
            counts["imported"] += len(placed)
            counts["duplicate"] += sum(
                1 for _, x in refused if isinstance(x, DuplicateJob))
            done = set(jid for jid, _ in placed) | set(j for j, _ in refused)
            e.counts = counts
            e.line = min([n for t, n in zip(todo, nums)
                          if t[0]["id"] not in done] or [nums[0]])
            raise
        counts["imported"] += len(placed)
        line = dict((t[0]["id"], n) for t, n in zip(todo, nums))
        for jid, e in refused:
            if isinstance(e, DuplicateJob):
                counts["duplicate"] += 1
            else:
                counts["refused"] += 1
                refuse(line[jid], str(e))


class FileBacklog(Backlog):
    """The file store's export: its files, state by state."""

    def export(self, states=(), type=None, skip=None):
        """The jobs in `states` (default: all but failed), of `type`, as
        dicts with their `state`: each as its file holds it, a waiting
        job's schedule its file's, a claimed one as a reaper would put it
        back (its lease gone, its attempt counted).  Streamed: one
        directory entry at a time, in no order within a state.  A file
        that is not a job is left out, and skip(path, why) called."""
        self.store.require()
        self.store._check_readable()
        states, skip = self._export_args(states, skip)
        subs = self.store.waiting_dirs() if states & {"ready", "scheduled"} else []
        subs += [STATE_DIRS[s] for s in ("processing", "done", "dead")
                 if s in states]
        for sub in subs:
            for e in _scandir(self.store.d(sub)):
                row = self._exported(sub, e.name, skip)
                if row is not None and row["state"] in states and (
                        type is None or row["type"] == type):
                    yield row
        if "failed" in states and type is None:
            for row in self._exported_failed():
                yield row


# stats() key -> (metric, type, help) of the Prometheus text format (myq-spool(5) STATISTICS)
_PROM_GAUGES = (
    ("oldest_ready_s", "myq_oldest_ready_seconds", "gauge",
     "How long the earliest ready job has waited since it became available."),
    ("retries_1m", "myq_retries_1m", "gauge",
     "Failed runs scheduled for a retry in the last 60 seconds, by any worker."),
)
_PROM_TOTALS = ("dropped", "expired", "rejected", "removed", "refused")


def _prom_label(value):
    """A label value, escaped as the format says (backslash, quote, line
    feed); any other control character as the text \\xNN, so that no
    terminal reading the file acts on it."""
    s = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"%s"' % _CONTROL.sub(lambda m: "\\\\x%02x" % ord(m.group()), s)


# capacity key -> (metric, help) (myq-spool(5) CAPACITY)
_PROM_SPOOL = (
    ("budget_bytes", "myq_budget_bytes", "The spool's budget (myq policy --budget)."),
    ("used_bytes", "myq_used_bytes", "Bytes the spool keeps, as the budget counts them."),
    ("outage_capacity_s", "myq_outage_capacity_seconds", "Seconds more of "
     "arrivals at the last 10 minutes' rate that the budget (or the free "
     "space) can take with nothing delivered."),
)
_PROM_TYPE = (
    (("waiting", "jobs"), "myq_waiting_jobs", "Jobs waiting, by type."),
    (("waiting", "bytes"), "myq_waiting_bytes", "Bytes of the jobs waiting, by type."),
    (("oldest_s",), "myq_oldest_waiting_seconds", "Age of the oldest waiting job."),
    (("arrival_per_s",), "myq_arrival_per_second", "Arrivals a second, last 10 minutes."),
    (("delivered_per_s",), "myq_delivered_per_second", "Deliveries a second, last 10 minutes."),
    (("est_drain_s",), "myq_est_drain_seconds", "Seconds to deliver what waits "
     "at the last 10 minutes' delivery rate."),
)


def _prom_capacity(stats, metric):
    """The capacity's figures (stats' budget_bytes ... types, dropped_by)."""
    for key, name, help in _PROM_SPOOL:
        if stats.get(key) is not None:
            metric(name, "gauge", help, [([], stats[key])])
    types = stats.get("types") or {}
    for path, name, help in _PROM_TYPE:
        samples = []
        for t, v in sorted(types.items()):
            for k in path:
                v = v.get(k) if isinstance(v, dict) else None
            if v is not None:
                samples.append((["type=" + _prom_label(t)], v))
        if samples:
            metric(name, "gauge", help, samples)
    by = stats.get("dropped_by") or {}
    if by:
        metric("myq_dropped_by_total", "counter", "Jobs removed unrun, by type "
               "and reason (budget, overflow, ttl).",
               [(["type=" + _prom_label(t), "reason=" + _prom_label(r)], n)
                for t, d in sorted(by.items()) for r, n in sorted(d.items())])


def prometheus_text(stats):
    """A spool's stats() in the Prometheus text exposition format (for
    node_exporter's textfile collector): # HELP and # TYPE, then the
    samples; job counts and the like are gauges, totals since init counters."""
    q = "queue=" + _prom_label(stats["queue"])
    out = []

    def metric(name, kind, help, samples):
        out.append("# HELP %s %s" % (name, help))
        out.append("# TYPE %s %s" % (name, kind))
        for labels, value in samples:
            out.append("%s{%s} %s" % (name, ",".join([q] + labels),
                                      "%d" % value if value == int(value)
                                      else repr(float(value))))

    metric("myq_jobs", "gauge", "Jobs in the spool, by state.",
           [(["state=" + _prom_label(st)], stats.get(st, 0)) for st in STATES])
    for key, name, kind, help in _PROM_GAUGES:
        metric(name, kind, help, [([], stats.get(key, 0))])
    if "free_kb" in stats:
        metric("myq_free_bytes", "gauge", "Bytes free on the spool's "
               "filesystem for an unprivileged writer.",
               [([], stats["free_kb"] * 1024)])
    for key in _PROM_TOTALS:
        v = stats.get(key)
        if isinstance(v, dict):         # by type
            samples = [(["type=" + _prom_label(t)], n)
                       for t, n in sorted(v.items())]
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            samples = [([], v)]
        else:
            continue
        metric("myq_%s_total" % key, "counter", "Jobs %s since myq init." % key
               if key != "removed" else "Files myq removed unrun since myq "
               "init: empty job names, tmp/ strays, records past their bound.",
               samples)
    _prom_capacity(stats, metric)
    if isinstance(stats.get("paused"), list):
        metric("myq_paused", "gauge", "1 for each job type that is paused.",
               [(["type=" + _prom_label(t)], 1) for t in stats["paused"]])
    if isinstance(stats.get("held"), list):
        metric("myq_held", "gauge", "Until when (epoch seconds) a destination "
               "is held by its circuit breaker.",
               [(["destination=" + _prom_label(h.get("dest"))],
                 h.get("until") or 1) for h in stats["held"]
                if isinstance(h, dict)])
    return "\n".join(out) + "\n"


def _write_textfile(w):
    """The worker's --textfile DIR: DIR/myq_QUEUE.prom, by write to a
    temporary name and rename (node_exporter never reads half a file)."""
    d = getattr(w, "textfile", None)
    if not d:
        return
    sp = w.spool
    name = "myq_%s.prom" % re.sub(r"[^A-Za-z0-9_.-]", "_", sp.name)
    tmp = os.path.join(d, ".%s.%d.tmp" % (name, os.getpid()))
    try:
        data = prometheus_text(sp.stats(by_type=True)).encode("utf-8", "replace")
        target = os.path.join(d, name)
        try:
            st = os.lstat(target)
        except OSError:
            st = None
        if st is not None and (st.st_uid != os.geteuid()
                               or not stat.S_ISREG(st.st_mode)):
            # another user's file (a shared, sticky directory): never
            # written through, never trusted to be ours
            raise OSError(errno.EEXIST, "%s belongs to uid %d, not to this "
                          "worker: remove it, or give --textfile a directory "
                          "of its own" % (target, st.st_uid))
        _quiet_unlink(tmp)
        _create(tmp, data, sync=False, mode=0o644)
        _rename(tmp, target)

    except OSError as e:
        _quiet_unlink(tmp)
        w.log("error", during="textfile", error="%s: %s" % (d, e.strerror or e))


class Reader(object):
    """What the commands read of a spool of files (a store's `reader`): a
    job file, where an id is, show, list, stats and the status line, the
    totals since init (locks/totals.json, written by the store's count)
    and the retries of the last minute (locks/retries).  `store`: the
    spool it reads (its layout, lanes, policy, holds' records, budget)."""

    def __init__(self, store):
        self.store = store
        self.opt = store.opt

    def read_file(self, path, limit=None):
        """(bytes, stat) of a regular file; never follows a symlink, never
        blocks on a FIFO, never opens a device.  Raises InvalidJob."""
        limit = self.opt["max_job_bytes"] if limit is None else limit
        st = _lstat(path)
        kind = _file_kind(st.st_mode)
        if kind:
            raise InvalidJob("not a regular file (%s)" % kind)
        if st.st_size > limit:
            raise InvalidJob("too large: %d bytes (--max-job-bytes is %d)"
                             % (st.st_size, limit))
        fd = _open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if _file_kind(st.st_mode):
                raise InvalidJob("not a regular file")
            data = os.read(fd, limit + 1 + 4096)
        finally:
            os.close(fd)
        if len(data) > limit + 4096:
            raise InvalidJob("too large")
        return data, st

    def load(self, path, stem=None):
        """(job, trailers, stat) of a job file, normalised."""
        data, st = self.read_file(path, self.opt["max_job_bytes"] + SLACK)
        obj, trailers = parse(data)
        return normalize(obj, stem, st.st_mtime), trailers, st

    def locate(self, jid):
        """(state, path) of a job id, or raise NoSuchJob.  A name that is not
        an id (myq-spool(5) JOB FILES) is looked up in failed/ only, where quarantined files
        keep the names they came with; InvalidJob when it could not be a
        name there either."""
        if not _is_name(_check_ref(jid)):
            for name in (jid, jid + ".json"):
                p = self.store.d("failed", name)
                if not name.endswith(".reason") and _lexists(p):
                    return "failed", p
        else:
            # (a job moves between these: a retry from processing/ back to
            # incoming/ between the two looks is missed by both; one that
            # moved while it was looked for is looked for again)
            for _ in range(3):
                for sub in self.store.waiting_dirs():
                    p = self.store.d(sub, jid + ".json")
                    try:
                        st = _lstat(p)
                        return ("scheduled" if st.st_mtime > _now() else
                                "ready"), p
                    except OSError:
                        pass
                prefix = jid + "+"
                for name in _listdir(self.store.d("processing")):
                    if name.startswith(prefix) and _split_claim(name):
                        return "processing", self.store.d("processing", name)
                for state, sub in (("dead", "dlq"), ("done", "done")):
                    p = self.store.d(sub, jid + ".json")
                    if _lexists(p):
                        return state, p
            for name in (jid, jid + ".json"):
                p = self.store.d("failed", name)
                if not name.endswith(".reason") and _lexists(p):
                    return "failed", p

        raise NoSuchJob("no job %s in %s; see: myq --spool %s list"
                        % (jid, self.store.path, self.store.path))

    def show(self, jid):
        try:
            return self._show(jid)
        except NoSuchJob:
            ram = self.store.ram
            if ram is None:
                raise
            try:
                job = ram.show(jid)
            except NoSuchJob:
                raise NoSuchJob("no job %s in %s or its RAM tier %s; see: myq "
                                "--spool %s list" % (jid, self.store.path,
                                                     ram.path, self.store.path))
            job["tier"] = "ram"
            return job

    def _show(self, jid):
        for _ in range(5):
            state, path = self.locate(jid)
            try:
                return self._describe(state, path, self._holding())
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
                # it moved on meanwhile (claimed, finished): look again
        return self._describe(*self.locate(jid))

    def _holding(self):
        """{path in the spool: hold record} of the waiting jobs that held
        destinations put back (list and show say "held" for them)."""
        out = {}
        for h in self.store.breaker.records():
            if h.get("missing"):        # all its type's jobs wait for it
                out[("type", h["dest"])] = h
                continue
            for rel in self.store.breaker.jobs(h["dest"]):
                out[rel] = h
        return out

    def _describe(self, state, path, holding=None):
        name = os.path.basename(path)
        if state == "failed":
            reason = _read_small(path + ".reason")
            info = {"id": name[:-5] if name.endswith(".json") else name,
                    "state": "failed", "type": None, "attempts": 0,
                    "available_at": None, "file": path,
                    "last_error": reason.decode("utf-8", "replace").strip()
                    if reason else None}
            try:
                info["content"] = self.read_file(path)[0].decode("utf-8", "replace")
            except (OSError, InvalidJob):
                pass
            return info
        stem = name[:-5] if state != "processing" else _split_claim(name)[0]
        job, trailers, st = self.load(path, stem)
        lease = _lease_of(trailers)
        if lease is None and state in ("processing", "done"):
            lease = _claim_lease(path, st, job, trailers)
            if lease is not None and state == "processing":
                # who holds it: the worker's record (pid, start, boot)
                try:
                    rec = json.loads(self.read_file(self.store.d(
                        "locks", "workers", lease["worker"] + ".json"), 65536)[0])
                    for k in ("pid", "start", "boot_id", "host"):
                        if k in rec:
                            lease[k] = rec[k]
                except (OSError, ValueError, InvalidJob, TypeError):
                    pass
        if lease:
            job["attempts"] = lease.get("attempt", job["attempts"])
            if state == "processing":
                job["lease"] = lease
        if state in ("ready", "scheduled"):
            if st.st_mtime > st.st_ctime:
                # the schedule (a job put back for a held destination says
                # "now" in its available_at: see _move_on)
                due = job["available_at"] = st.st_mtime
            else:
                due = max(st.st_mtime, _effective_available(job, _now()))
            state = "scheduled" if due > _now() else "ready"
            h = (holding.get(path[len(self.store._pre):]) or holding.get(
                ("type", job["type"]))) if holding else None
            if h is not None and (state == "scheduled" or h.get("missing")):
                # it waits for its destination, not for its own time
                state = "held"
                job["held"] = {"dest": h["dest"], "until": h.get("until"),
                               "why": h.get("why")}
        if state == "done":
            job["last_error"] = None        # it ended well: see `failures`
        job["state"] = state
        return job

    def list(self, state=None):
        """Jobs as dicts (with `state`), by state, then by the file's time
        (the schedule in incoming/, the finish elsewhere), then name.  Only
        (time, name) is held per job while sorting; each job is read when
        its turn comes: memory stays small at any depth."""
        if state is not None and state not in STATES + ("held",):
            raise UsageError("unknown state %r; one of: %s" % (
                state, " ".join(STATES + ("held",))))
        if self.store.ram is not None:
            return _chain(self._rows(state), self._ram_rows(state))
        return self._rows(state)

    def _ram_rows(self, state):
        """list's rows of the RAM tier's waiting and running jobs."""
        if state in (None, "ready", "scheduled", "processing"):
            for row in self.store.ram.reader._rows(state):
                if row["state"] in ("ready", "scheduled", "processing"):
                    row["tier"] = "ram"
                    yield row

    def _rows(self, state):
        now = _now()
        keys = []
        subs = ["processing", "done", "dlq", "failed"]
        if state in (None, "ready", "scheduled"):
            subs = self.store.waiting_dirs() + subs
        if state == "held":
            subs = self.store.waiting_dirs()
        holding = self._holding() if state in (None, "scheduled", "held") \
            else None
        for sub in subs:
            if state not in (None, "held") and \
                    STATE_DIRS[state] != sub.partition("/")[0]:
                continue
            for e in _scandir(self.store.d(sub)):
                name = e.name
                if sub == "failed":
                    if name.endswith(".reason"):
                        continue
                elif sub == "processing":
                    if not _split_claim(name):
                        continue
                elif not name.endswith(".json"):
                    continue
                try:
                    t = e.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue
                guess = STATES.index("failed" if sub == "failed" else
                                     "dead" if sub == "dlq" else
                                     ("scheduled" if t > now else "ready")
                                     if sub.startswith("incoming") else sub)
                keys.append((guess, t, name, sub))
        keys.sort()
        for guess, _, name, sub in keys:
            guess = STATES[guess]
            path = self.store.d(sub, name)
            try:
                row = self._describe(guess, path, holding)
            except (OSError, InvalidJob) as e:

                if isinstance(e, OSError) and e.errno == errno.ENOENT:
                    continue        # it moved while we looked
                row = {"id": name[:-5] if name.endswith(".json") else name,
                       "type": None, "state": guess, "attempts": None,
                       "available_at": None, "last_error": "unreadable: %s" % e}
            if state and row["state"] != state:
                continue
            yield row

    def stats(self, now=None, by_type=False, types=True):
        """The counters of the status line (myq-spool(5) STATISTICS), from
        the directories; the capacity's figures (without `types`, the
        spool's alone: the status line's)."""
        now = _now() if now is None else now
        ready, scheduled, oldest, processing, done, dead, failed = \
            self.counts(now)
        tot = self.totals()
        if self.store.ram is not None:      # (what its tier dropped, expired)
            for k, d in self.store.ram.reader.totals().items():
                mine = tot.setdefault(k, {})
                for t, n in d.items():
                    mine[t] = mine.get(t, 0) + n
        try:
            st = os.statvfs(self.store.path)
            free_kb = st.f_bavail * st.f_frsize // 1024
        except OSError:
            free_kb = 0
        out = {"queue": self.store.name, "ready": ready, "processing": processing,
                "done": done, "dead": dead,
                "oldest_ready_s": int(max(0, now - oldest)) if oldest else 0,
                "retries_1m": self.retries_1m(now), "scheduled": scheduled,
                "failed": failed, "free_kb": int(free_kb),
                "dropped": tot["dropped"] if by_type else sum(tot["dropped"].values()),
                "expired": tot["expired"] if by_type else sum(tot["expired"].values()),
                "rejected": tot["rejected"] if by_type else
                sum(tot["rejected"].values()),
                "removed": tot["removed"] if by_type else
                sum(tot["removed"].values()),
                "refused": tot["refused"] if by_type else
                sum(tot["refused"].values()),
                "paused": self.store.paused(),
                "held": [{"dest": h["dest"], "until": h.get("until")}
                         for h in self.store.breaker.records()],
                "destinations": self.dest_states(now)}
        out["dropped_by"] = self.store.budget.dropped_by(tot)
        out.update(self.store.budget.capacity(now, types))
        if self.store.ram is not None:
            self.store.ram.count_into(out, now)
        return out

    def totals(self):
        """{"dropped"|"expired"|"rejected"|"removed"|"refused": {TYPE: N}}
        (refused: what intake refused at arrival, myq(1) INTAKE)."""
        out = {"dropped": {}, "expired": {}, "rejected": {}, "removed": {},
               "refused": {}, "dropped_budget": {}, "dropped_overflow": {}}

        data = _read_small(self.store.d("locks", "totals.json"), 1 << 20)
        try:
            tot = json.loads(data.decode("utf-8")) if data else {}
        except ValueError:
            tot = {}
        if isinstance(tot, dict):
            for k in out:
                v = tot.get(k)
                if isinstance(v, dict):
                    out[k] = dict((t, n) for t, n in v.items()
                                  if n.__class__ is int and n >= 0)
        return out

    def status_line(self, now=None):
        now = _now() if now is None else now
        s = self.stats(now, types=False)
        return iso(now, frac=False) + " queue=" + _plain(s["queue"], _FIELD) + "".join(
            " %s=%d" % (k, s[k]) for k in (
                "ready", "processing", "done", "dead", "oldest_ready_s",
                "retries_1m", "scheduled", "failed", "free_kb", "dropped",
                "expired", "rejected", "removed", "refused")) + " paused=%s held=%s" % (
            _few(s["paused"]), _few([_plain(h["dest"], _FIELD) for h in s["held"]])) + \
            " capacity_s=%s" % (s["outage_capacity_s"] if s["outage_capacity_s"]
                                is not None else "-") + (
            " ram=%d ram_bound_s=%d" % (s["ram"], s["ram_bound_s"])
            if "ram" in s else "")

    def retries_1m(self, now=None):
        now = _now() if now is None else now
        data = _read_small(self.store.d("locks", "retries"), 65536, tail=True)
        if data is None:
            return 0
        n = 0
        for line in data.split(b"\n")[::-1]:
            try:
                t = float(line)
            except ValueError:
                continue
            if now - 60 < t <= now + 1:
                n += 1
            elif t <= now - 60:
                break
        return n

    def dest_states(self, now=None):
        """Each destination of the types whose policy gives `url`, in order,
        and its state (myq(1) failover): {TYPE: [{"url", "dest", "state":
        "ok" or "held", "until"}]}; the first "ok" one gets the new starts.
        A type whose policy gives `topic`: the brokers of a living worker's
        --mqtt (its record, locks/workers/), when one has them."""
        holds = dict((h["dest"], h) for h in self.store.breaker.records())
        now = _now() if now is None else now
        out, brokers = {}, None
        for t, keys in sorted(self.store.policy().items()):
            urls = keys.get("url") if t != "*" else None
            if not urls and keys.get("topic") and t != "*":
                if brokers is None:
                    brokers = next((" ".join(w["mqtt"]) for w in
                                    self.store.upkeep._live_workers()
                                    if isinstance(w.get("mqtt"), list) and
                                    all(isinstance(b, str) for b in w["mqtt"])
                                    ), "")
                urls = brokers
            if not urls:
                continue
            out[t] = []
            for u in urls.split():
                d = u if u[:4] == "mqtt" else (url_origin(u) or t)
                h = holds.get(d)
                out[t].append({"url": u, "dest": d, "state":
                               "held" if h else "ok",
                               "until": h.get("until") if h else None})
        return out

    def _waiting_files(self, subs, now):
        """(ready, scheduled, the earliest ready one's time) of the job
        files in the directories `subs`, each due at its mtime."""
        ready = scheduled = 0
        oldest = None
        for e in (e for sub in subs for e in _scandir(self.store.d(sub))):
            if not e.name.endswith(".json"):
                continue
            try:
                m = e.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
            if m <= now:
                ready += 1
                oldest = m if oldest is None or m < oldest else oldest
            else:
                scheduled += 1
        return ready, scheduled, oldest

    def _failed_files(self):
        return sum(1 for n in _listdir(self.store.d("failed")) if not n.endswith(".reason"))

    def counts(self, now):
        """(ready, scheduled, the earliest ready one's time, processing,
        done, dead, failed), from the directories."""
        ready, scheduled, oldest = self._waiting_files(self.store.waiting_dirs(), now)
        processing = sum(1 for n in _listdir(self.store.d("processing"))
                         if _split_claim(n))
        return (ready, scheduled, oldest, processing,
                _count(self.store.d("done"), ".json"), _count(self.store.d("dlq"), ".json"),
                self._failed_files())


# The spool's budget (myq-spool(5) BUDGET) ####################################
#
# What a spool keeps is measured as the allocated blocks of every file and
# directory in it, as du(1) counts them (the SQLite store's database, log
# and index among them; the guard's reserve, locks/room, too: the worker
# sets it aside only where the figure has room for it).  A walk costs a stat a
# file, too much for every enqueue, so the figure the budget is held to is
# kept in locks/used as three numbers: the bytes MEASURED by the last walk,
# the bytes ADDED by producers since, and the walk's time.  A producer,
# under that file's lock, adds its jobs' cost (bytes rounded up to the
# filesystem's block, and a directory entry's share; a row and the log's
# pages on the SQLite store: never less than what the job takes) and
# never passes the budget by that figure; producers take the lock in
# turn, so together they cannot pass it either.  Whatever frees space
# (retention, deliveries, deletes) only makes the figure high, which is
# safe: nothing is shed or refused on a figure older than BUDGET_FRESH
# seconds without a walk first (on the SQLite store, whose cost of a row
# is a generous guess, on any figure with producers' additions in it:
# its walk is a few files and a checkpoint).  The worker walks every
# BUDGET_EVERY seconds and sheds what came in past the producers' lock (a shell
# producer's file, a producer who may not write locks/used, its own
# writes, the SQLite log): the spool is over its budget by at most what
# arrives between two walks that way, and by no job at all through
# `enqueue`, the API and intake (with no worker, a producer walks when
# the figure is older than BUDGET_STALE seconds; _SPARE blocks are kept
# for the records' next versions).  An enqueue with a budget costs one
# open, flock, pread and pwrite of a 64-byte record (no fsync: a power
# cut loses at most the figure's last additions, and the worker's next
# walk measures anew); without one, nothing (but the arrivals' line in
# locks/rates, which a producer appends at most once a second).

BUDGET_FRESH = 2.0      # seconds a walk is trusted for a shed or a refusal
BUDGET_EVERY = 10.0     # seconds between a worker's walks
BUDGET_STALE = 60.0     # seconds after which a producer walks itself
RATE_WINDOW = 600.0     # seconds of arrivals and deliveries in the rates
DRAIN_GAP = 30.0        # a job waited this long, nothing delivered: an outage
UPLINK_WINDOW = 10.0    # --uplink-rate holds over any window this long
DRAIN_MEASURE = 3       # seconds of deliveries before a drain's rate is said
_ENTRY = 128            # a new job's directory entry and locks/rates line
_SPARE = 2              # blocks kept for the records' next versions
_USED_LEN = 64          # locks/used: "MEASURED ADDED TIME", padded


def _records_made(dfd, ids):
    """init: locks/used (the owner's alone, 0600: it is flock'd, and a
    producer who could open it could lock it) and locks/rates (producers
    of the spool's group append to it; nothing locks it), each given to
    the owner when new."""
    for name, mode in (("used", 0o600), ("rates", 0o660)):
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW
                         | O_CLOEXEC, mode, dir_fd=dfd)
        except FileExistsError:
            continue
        try:
            if ids:
                os.fchown(fd, ids[0], ids[1])
            os.fchmod(fd, mode)
            if name == "used":      # (its block there before any walk)
                Budget._used_write(fd, 0, 0, 0)
        finally:
            os.close(fd)


class Budget(object):
    """The budget (myq(1) budget): the used-bytes figure, the producers'
    charge, shedding; and the figures of capacity: arrivals and deliveries
    in locks/rates, what waits by type.  A store's, as store.budget: what
    a job costs and what sheds first are its own (FileBudget, SqlBudget:
    the methods that raise NotImplementedError here)."""

    def __init__(self, store):
        self.store = _weakref.proxy(store)
        self._rates = store.d("locks", "rates")
        self._blk = None            # the filesystem's block (_block)
        self._arrivals = None       # a producer's, held a second (atexit)
        self._arrived_at = -1e9
        self._cost_of = (None, 0)   # (size, its cost): note_arrival's last
        self._delivered = {}        # a worker's, noted each second
        self._sent = {}             # its bytes on the uplink, the same
        self._upkept = (-1e9, -1e9)     # (last turn, next walk): upkeep_budget
        self._inbox = {}            # what _inbox_waiting saw

    def _abstract(self):
        raise NotImplementedError("Method must be implemented by the store")

    def cost(self, size):
        """The bytes a new job of `size` takes from the budget."""
        self._abstract()

    def freed(self, size):
        """The bytes a removed job of `size` gives back."""
        self._abstract()

    def _shed_measured(self, m, a, t):
        """shed's figure of the spool after a walk."""
        self._abstract()

    def _shed_done(self, need):
        """Done jobs before their time, the earliest finished first."""
        self._abstract()

    def _shed_records(self, need):
        """Idempotency records past the de-duplication window."""
        self._abstract()

    def _lane_waiting(self, now, out):
        """The waiting jobs of the lanes, by type, into `out`."""
        self._abstract()

    # A job's cost is what it takes, give or take a directory entry: the
    # figure is exact enough to shed on (the SQLite store's is not: a row
    # takes part of a page, its log's pages are reused, so it walks
    # before it sheds on what producers added).
    _EXACT = True

    def budget_bytes(self):
        """The spool's budget in bytes, or None."""
        own = self.store.policy().get(SPOOL_POLICY)
        return own.get("budget") if own else None

    def beside(self):
        """The bytes the budget counts beside the spool's own files: what
        its RAM tier holds, each job of which must find room here when it
        moves (0 without a tier)."""
        ram = self.store.ram
        return 0 if ram is None else ram.budget.held()

    def _block(self):
        b = self.store.producer.room[3] or self._blk   # (room_for's)
        if b is None:
            try:
                b = os.statvfs(self.store.path).f_frsize or 4096
            except OSError:
                b = 4096
            self._blk = b
        return b

    def measure(self):
        """The bytes the spool keeps now, by a walk (see above)."""
        total, stack = 0, [self.store.path]
        while stack:
            d = stack.pop()
            for e in _scandir(d):
                p = d + "/" + e.name
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(p)
        try:
            total += os.lstat(self.store.path).st_blocks * 512
        except OSError:
            pass
        return total

    def _used_lock(self):
        """locks/used open and locked, or None (this user may not write it:
        a producer of the spool's group; the worker's walk keeps the
        budget for its jobs).  Made by init and by the worker only."""
        import fcntl
        try:
            fd = _open_reg(self.store.d("locks", "used"), os.O_RDWR)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def _used_read(fd):
        """(measured, added, when) of locks/used, or None."""
        try:
            m, a, t = os.pread(fd, _USED_LEN, 0).split()[:3]
            return int(m), int(a), float(t)
        except (OSError, ValueError):
            return None

    @staticmethod
    def _used_write(fd, m, a, t):
        rec = b"%d %d %.3f\n" % (max(0, m), max(0, a), t)
        try:
            os.pwrite(fd, rec + b" " * (_USED_LEN - len(rec)), 0)
        except OSError:
            pass                # (the next walk measures anew)

    def used_bytes(self, most=30.0):
        """The figure (locks/used), walked again when older than `most`
        seconds (and written back where this user may)."""
        fd = self._used_lock()
        try:
            rec = self._used_read(fd) if fd is not None else None
            now = _now()
            if rec is not None and 0 <= now - rec[2] <= most:
                return rec[0] + rec[1]
            m = self.measure()
            if fd is not None and (rec is None or rec[0] + rec[1] != m):
                # (the same figure is not written again: the status line
                # asks each minute, and on flash each write is a commit)
                self._used_write(fd, m, 0, now)
            return m
        finally:
            if fd is not None:
                os.close(fd)

    def charge(self, items, subs=()):
        """The budget for new jobs, `items`: [(type, bytes)] into the
        directories `subs`: their cost (and a new lane's) added to the
        figure, after shedding what must go (done/ first, then stale
        records, then waiting jobs of drop-oldest types); SpoolFull when
        even that leaves no room."""
        budget = self.budget_bytes()
        if budget is None:
            return
        fd = self._used_lock()
        if fd is None:
            return
        try:
            need = sum(self.cost(n) for t, n in items) + self._block() * sum(
                1 for sub in set(subs) | set(LANES for s in subs if s != "incoming")
                if not os.path.isdir(self.store.d(sub)))
            budget -= _SPARE * self._block() + self.beside()
            rec = self._used_read(fd)
            now = _now()
            age = now - rec[2] if rec is not None else -1
            if not 0 <= age <= BUDGET_STALE or (
                    rec[0] + rec[1] + need > budget and (
                        age > BUDGET_FRESH or rec[1] and not self._EXACT)):
                rec = (self.measure(), 0, now)
            m, a, t = rec
            for _ in range(8):      # (the SQLite store: pages, not rows)
                if m + a + need <= budget:
                    break
                freed = self.shed(m + a + need - budget)
                if not freed:
                    break
                m, a, t = self._shed_measured(m + a - freed, 0, t)
            if m + a + need > budget:
                self._used_write(fd, m, a, t)
                raise SpoolFull(self._at_budget(self.budget_bytes(), m + a,
                                                items))
            self._used_write(fd, m, a + need, t)
        finally:
            os.close(fd)

    def budget_takes(self, size):
        """May the owner write `size` bytes of its own (the reserve) under
        the budget?  Added to the figure when it may; no shed for it."""
        budget = self.budget_bytes()
        fd = self._used_lock() if budget is not None else None
        if fd is None:
            return True
        try:
            rec = self._used_read(fd)
            if rec is None or rec[0] + rec[1] + size > budget - _SPARE * \
                    self._block() - self.beside():
                return False
            self._used_write(fd, rec[0], rec[1] + size, rec[2])
            return True
        finally:
            os.close(fd)

    def _at_budget(self, budget, used, items):
        types = sorted(set(t for t, n in items))
        return ("spool %s is at its budget %s (%s used): nothing more may "
                "be shed (dead jobs, and waiting jobs of types with "
                "overflow=reject, never are); the job of type %s was refused; "
                "try again later, raise it (myq policy --budget SIZE), or "
                "let overflow=drop-oldest types give way"
                % (self.store.path, _format_size(budget), _format_size(used),
                   ",".join(types)))

    def keep_budget(self):
        """The worker's walk (every BUDGET_EVERY seconds): the figure
        measured anew, and what is over the budget shed."""
        budget = self.budget_bytes()
        fd = self._used_lock()
        if fd is None and not _lexists(self.store.d("locks", "used")):
            try:
                _create_empty(self.store.d("locks", "used"))
            except OSError:
                pass
            fd = self._used_lock()
        if fd is None:
            return
        try:
            m = self.measure()
            if budget is not None:
                budget -= _SPARE * self._block() + self.beside()
            for _ in range(8):
                if budget is None or m <= budget:
                    break
                freed = self.shed(m - budget, records=True)
                if not freed:
                    break
                m = self._shed_measured(m - freed, 0, 0)[0]
            self._used_write(fd, m, 0, _now())
        finally:
            os.close(fd)

    def shed(self, need, records=False):
        """Free at least `need` bytes if that can be done, in the budget's
        order; the bytes freed.  `records`: the worker's walk, which also
        removes the idempotency records past their window (a producer
        leaves them: empty files, they free no block, and there may be
        100,000 to look at)."""
        freed = self._shed_done(need)
        if freed < need and (records or not self._EXACT):
            freed += self._shed_records(need - freed)
        if freed < need:
            freed += self._shed_waiting(need - freed)
        return freed

    def _sheddable(self):
        """[(priority, made, name, bytes, lane, type)] of the waiting jobs
        of drop-oldest types, in the order they are shed."""
        now, out = _now(), []
        for t in sorted(set(l[1] for l in self.store.lanes())):
            if self.store.rules(t).get("overflow") == "drop-oldest":
                out.extend((w[0], self.store._made(w, now), w[2], self.freed(w[3]),
                            w[4], t) for w in self.store._waiting_of(t))
        out.sort()
        return out

    def _shed_waiting(self, need):
        """Waiting jobs of drop-oldest types: lowest priority first, then
        the earliest made, across types (logged, counted)."""
        freed, by_type = 0, {}
        dirs = self.store.fs
        for p, made, name, size, sub, t in self._sheddable():
            if freed >= need:
                break
            if not self.store._drop_waiting(sub, name, dirs):
                continue        # claimed meanwhile: it is not waiting
            freed += size
            by_type[t] = by_type.get(t, 0) + 1
            self.store.log("dropped", id=name[:-5], type=t, reason="budget")
        for t, n in sorted(by_type.items()):
            self.store.count(("dropped", "dropped_budget"), t, n)
        return freed

    # Arrivals and deliveries (locks/rates) -----------------------------------
    #
    # One line per event group, appended with one O_APPEND write (no fsync,
    # a statistic): "TIME a TYPE N BYTES" by a producer for the jobs of one
    # enqueue, "TIME d TYPE N BYTES" by a worker for what it delivered since
    # its last group commit and the bytes it sent on its --uplink-rate
    # (locks/uplink: its rate, for the forecast).  Producers of the spool's group may append (the
    # file is 0660); a line that does not parse is skipped.  The worker
    # compacts it (one line per 10 seconds and type, the last RATE_WINDOW
    # seconds kept) once it passes 64 KiB.

    def note_arrivals(self, counts):
        """A producer's arrivals {TYPE: (N, BYTES)}: appended at once, but
        within a second of the last append kept and added to the next (or
        written at exit): a producer that enqueues many opens the file
        once a second, not once a job."""
        mono, held = _mono(), self._arrivals
        if held is None:
            held = self._arrivals = {}
            import atexit
            atexit.register(self.flush_arrivals)   # (the store may be gone:
            # what it needs of it, locks/rates' path, is the budget's own)
        for k, (n, b) in counts.items():
            c = held.get(k, (0, 0))
            held[k] = (c[0] + n, c[1] + b)
        if mono - self._arrived_at >= 1.0:
            self.flush_arrivals()

    def note_arrival(self, type, size, mono):
        """note_arrivals of one job of `size` bytes (`mono`: the producer's
        clock, just read), without a dict a job."""
        held, last = self._arrivals, self._cost_of
        cost = last[1] if last[0] == size else None
        if cost is None:
            cost = self.cost(size)
            self._cost_of = (size, cost)
        if held is None or mono - self._arrived_at >= 1.0:
            return self.note_arrivals({type: (1, cost)})
        c = held.get(type)
        held[type] = (1, cost) if c is None else (c[0] + 1, c[1] + cost)

    def flush_arrivals(self):
        held = self._arrivals
        if held:
            self._arrivals, self._arrived_at = {}, _mono()
            self.note_rates("a", held)

    def note_rates(self, kind, counts, now=None):
        """Append {TYPE: (N, BYTES)} of `kind` ("a" or "d") to locks/rates."""
        if not counts:
            return
        t = int(_now() if now is None else now)
        data = b"".join(b"%d %s %s %d %d\n" % (t, kind.encode(), k.encode(),
                                               n, b)
                        for k, (n, b) in counts.items())
        try:
            fd = _open_reg(self._rates, os.O_WRONLY | os.O_APPEND)
        except OSError:
            return              # (none yet, or not this user's to write)
        try:
            os.write(fd, data)
        except OSError:
            pass
        finally:
            os.close(fd)

    def delivered(self, type):
        """A job of `type` done (counted for locks/rates)."""
        d = self._delivered
        d[type] = d.get(type, 0) + 1

    def sent(self, type, n):
        """n bytes of `type` booked on the worker's --uplink-rate (its
        runs' threads: a statistic, a race may lose an addition)."""
        s = self._sent
        s[type] = s.get(type, 0) + n

    def note_delivered(self):
        """The deliveries counted since the last call, and the bytes sent
        on the uplink, into locks/rates."""
        d, s = self._delivered, self._sent
        if d or s:
            self._delivered, self._sent = {}, {}
            self.note_rates("d", dict((t, (d.get(t, 0), s.get(t, 0)))
                                      for t in set(d) | set(s)))

    def note_uplink(self, rate):
        """A worker's start: its --uplink-rate (bytes a second) in
        locks/uplink for the forecast (capacity), or none."""
        path = self.store.d("locks", "uplink")
        try:
            if rate:
                _replace(path, b"%d\n" % int(rate), mode=0o644)
            elif _lexists(path):
                os.unlink(path)
        except OSError:
            pass

    def uplink_rate(self):
        """The last worker's --uplink-rate (locks/uplink), or None."""
        try:
            rate = int(_read_small(self.store.d("locks", "uplink"), 64) or b"")
        except (OSError, ValueError):
            return None
        return rate if rate > 0 else None

    def upkeep_budget(self, now):
        """A worker's turn (`now`: its monotonic clock): the deliveries
        into locks/rates each second; each BUDGET_EVERY seconds (or 100
        times what the last took) the walk (keep_budget, with a budget)
        and the rates compacted."""
        t = self._upkept
        if now - t[0] < 1.0:
            return
        self.note_delivered()
        if now >= t[1]:
            # (a walk costs a stat a file: at most 1 % of the time)
            try:
                if self.budget_bytes() is not None:
                    self.keep_budget()
                self.compact_rates()
            except (OSError, MyqError) as e:
                self.store.log("error", during="budget", error=str(e))
            t = (now, max(now + BUDGET_EVERY, 101 * _mono() - 100 * now))
        self._upkept = (now, t[1])

    def _rate_lines(self, now, since):
        """(time, kind, type, n, bytes) of the lines in locks/rates after
        `since`."""
        data = _read_small(self.store.d("locks", "rates"), 4 << 20, tail=True)
        for line in (data or b"").split(b"\n"):
            f = line.split()
            if len(f) != 5 or f[1] not in (b"a", b"d"):
                continue
            try:
                t, n, b = int(f[0]), int(f[3]), int(f[4])
                k = f[2].decode("ascii")
            except (ValueError, UnicodeError):
                continue
            if since < t <= now + 1 and n >= 0 and b >= 0 and _is_name(k):
                yield t, f[1], k, n, b

    def rates(self, now=None):
        """{TYPE: [arrived, their bytes, delivered, the time deliveries
        (re)started, delivered since, the last delivery's time, an arrival
        not delivered since, bytes sent on the uplink, delivered in the
        second they restarted, bytes sent in the last UPLINK_WINDOW]} over
        RATE_WINDOW: they restart after a job waited DRAIN_GAP seconds with
        nothing delivered (an outage)."""
        now = _now() if now is None else now
        self.flush_arrivals()
        out = {}
        for t, kind, k, n, b in self._rate_lines(now, now - RATE_WINDOW):
            r = out.setdefault(k, [0, 0, 0, None, 0, None, None, 0, 0, 0])
            if kind == b"a":
                r[0] += n
                r[1] += b
                r[6] = t if r[6] is None else r[6]
                continue
            r[7] += b
            r[9] += b if t > now - UPLINK_WINDOW else 0
            if n:
                r[2] += n
                if r[3] is None or r[6] is not None and t - r[6] > DRAIN_GAP:
                    r[3], r[4], r[8] = t, 0, 0
                r[4] += n
                r[8] += n if t == r[3] else 0
                r[5] = t if r[5] is None or t > r[5] else r[5]
                r[6] = None
        return out

    def compact_rates(self, now=None):
        """locks/rates past 64 KiB: one line per 10 s, kind and type.  Not
        again within a minute unless it doubled since: what thousands of
        types' arrivals leave past 64 KiB was compacted again at each
        turn, for nothing (issue 36, an idle worker)."""
        path = self.store.d("locks", "rates")
        now = _now() if now is None else now
        try:
            size, kept = _lstat(path).st_size, self.__dict__.get("_rates_kept")
            if size < 65536 or kept is not None and size < 2 * kept[0] \
                    and 0 <= now - kept[1] < 60:
                return
        except OSError:
            if not _lexists(path):
                try:
                    _create_empty(path, 0o660)
                except OSError:
                    pass
            return
        sums = {}
        for t, kind, k, n, b in self._rate_lines(now, now - RATE_WINDOW - 60):
            s = sums.setdefault((t - t % 10, kind, k), [0, 0])
            s[0] += n
            s[1] += b
        data = b"".join(b"%d %s %s %d %d\n" % (t, kind, k.encode(), n, b)
                        for (t, kind, k), (n, b) in sorted(sums.items()))
        try:
            _replace(path, data, mode=0o660)
            self._rates_kept = (len(data), now)
        except OSError:
            pass

    # Capacity (myq-spool(5) CAPACITY) -----------------------------------------

    def _waiting_types(self, now):
        """{TYPE: [jobs, bytes, the earliest created_at]} of what waits."""
        out = {}
        self._lane_waiting(now, out)
        self._inbox_waiting(now, out)
        return out

    @staticmethod
    def _add_waiting(out, t, size, made):
        w = out.setdefault(t, [0, 0, None])
        w[0] += 1
        w[1] += size
        if made is not None and (w[2] is None or made < w[2]):
            w[2] = made

    def _inbox_waiting(self, now, out):
        """The files at the top of incoming/, each read once (its type is
        inside; kept by name, inode and size while it stays)."""
        seen, keep = self._inbox, {}
        for e in _scandir(self.store.d("incoming")):
            if not e.name.endswith(".json"):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            key = (e.name, st.st_ino, st.st_size)
            got = seen.get(key)
            if got is None:
                try:
                    job = parse(self.store.read_file(self.store.d("incoming", e.name))[0])[0]
                    made = job.get("created_at")
                    got = (job["type"], made if made.__class__ in _NUM
                           else st.st_mtime)
                except (OSError, MyqError, ValueError, TypeError, KeyError,
                        AttributeError):
                    continue
            keep[key] = got
            self._add_waiting(out, got[0], st.st_size, got[1])
        self._inbox = keep

    def capacity(self, now=None, types=True):
        """The spool's budget_bytes, used_bytes, outage_capacity_s, and with
        `types` each type's waiting, oldest_s, arrival_per_s,
        delivered_per_s and est_drain_s (myq-spool(5) CAPACITY)."""
        now = _now() if now is None else now
        rates = self.rates(now)
        budget = self.budget_bytes()
        # (walked: the figure set right; the RAM tier's jobs counted)
        used = self.used_bytes(0) + self.beside()
        room = max(0, budget - used) if budget is not None else self.store.producer.free()[1]
        per_s = sum(r[1] for r in rates.values()) / RATE_WINDOW
        out = {"budget_bytes": budget, "used_bytes": used,
               "outage_capacity_s": int(room / per_s) if per_s > 0 else None}
        if not types:
            return out
        waiting, per = self._waiting_types(now), {}
        cap = self.uplink_rate()
        room = cap and max(0, cap * UPLINK_WINDOW - sum(r[9] for r in rates.values()))
        for t in sorted(set(waiting) | set(rates)):
            jobs, size, first = waiting.get(t, (0, 0, None))
            r = rates.get(t, (0, 0, 0, None, 0, None, None, 0, 0, 0))
            a, d = r[0], r[2]
            per[t] = {"waiting": {"jobs": jobs, "bytes": size},
                      "oldest_s": int(max(0, now - first)) if first else 0,
                      "arrival_per_s": round(a / RATE_WINDOW, 4),
                      "delivered_per_s": round(d / RATE_WINDOW, 4),
                      "est_drain_s": self._drain_s(now, jobs, r, cap, room)}
        out["types"] = per
        return out

    @staticmethod
    def _drain_s(now, jobs, r, cap, room):
        """est_drain_s of `jobs` from a type's rates `r`: at the rate since
        deliveries (re)started within the window (after an outage, not its
        zeros averaged in), up to the last line while they go on (a line a
        second), else now; the jobs of the first second's line not counted
        in it (they went in the time before it: a probe's one, a burst);
        None while they went on less than DRAIN_MEASURE seconds, or are one
        line younger than DRAIN_GAP (a probe, then the first batches: no
        sustained rate yet).
        With the worker's --uplink-rate `cap` (bytes/s): not faster than
        their bytes on the uplink (as those delivered in the window took)
        can go beyond the `room` its window has left.  Tenths below 10 s."""
        d, since, ds, last, wire, first = r[2], r[3], r[4], r[5], r[7], r[8]
        if not d:
            return None
        going = now - last <= 2
        end = min(since + RATE_WINDOW, last if going else now)
        if going and last - since < DRAIN_MEASURE or \
                ds == first and now - since <= DRAIN_GAP:
            return None
        if ds > first:
            s = jobs * (end - since) / float(ds - first)
        else:
            s = jobs * (end - since + 1) / float(ds)
        if cap and wire:
            s = max(s, (jobs * wire / float(d) - room) / cap)
        return round(s, 1) if s < 10 else int(round(s))

    def capacity_problem(self, warn):
        """check --warn-capacity: why the outage capacity is short, or None."""
        cap = self.capacity(types=False)
        s = cap["outage_capacity_s"]
        if s is None or s >= warn:
            return None
        return ("outage capacity is %s (below --warn-capacity %s): at the "
                "arrivals of the last 10 minutes, %s can take that much more "
                "with nothing delivered; raise the budget (myq policy --budget), "
                "free space, or let types give way (overflow=drop-oldest, ttl)"
                % (_format_duration(s), _format_duration(warn),
                   "the budget" if cap["budget_bytes"] is not None
                   else "the free space above --min-free"))

    def dropped_by(self, tot=None):
        """{TYPE: {REASON: N}}: budget, overflow (a type's bound), ttl."""
        tot = self.store.reader.totals() if tot is None else tot
        out = {}
        for key, reason in (("dropped_budget", "budget"),
                            ("dropped_overflow", "overflow"), ("expired", "ttl")):
            for t, n in tot.get(key, {}).items():
                if n:
                    out.setdefault(t, {})[reason] = n
        return out


class FileBudget(Budget):
    """The file store's budget: a job costs its file's blocks and an
    entry; done files and locks/ok records shed first."""

    def cost(self, size):
        """What a new job of `size` bytes adds: its blocks, its entry."""
        return self.freed(size) + _ENTRY

    def freed(self, size):
        """What removing a waiting job of `size` bytes gives back."""
        b = self._block()
        return -(-size // b) * b

    def _shed_measured(self, m, a, t):
        """(measured, added, when) after a shed: `m` is the figure with the
        bytes of the files removed taken off (the SQLite store measures
        its pages again)."""
        return m, a, t

    def _shed_done(self, need):
        """Retention of done/ before its time, oldest first."""
        old = []
        for e in _scandir(self.store.d("done")):
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            old.append((st.st_ctime, e.name, st.st_blocks * 512))
        old.sort()
        freed = n = 0
        for t, name, size in old:
            if freed >= need:
                break
            if self.store.upkeep.remove("done", self.store.d("done", name)):
                freed, n = freed + size, n + 1
        if n:
            self.store.log("pruned", reason="budget", what="done", n=n)
        return freed

    def _shed_records(self, need):
        """Idempotency records past their window (prune's, sooner)."""
        now, n = _now(), 0
        for t, name in list(self.store.upkeep.aged("locks/ok", "mtime")):
            if now - t > self.store.opt["dedupe_window"]:
                n += self.store.upkeep.remove("locks/ok", self.store.d("locks", "ok", name))
        if n:
            self.store.log("pruned", reason="budget", what="ok", n=n)
        return 0                # (empty files: an entry each, no block)

    def _lane_waiting(self, now, out):
        for t in sorted(set(l[1] for l in self.store.lanes())):
            for w in self.store._waiting_of(t):
                self._add_waiting(out, t, w[3], self.store._made(w, now))


# The store of files ##########################################################
#
# The layout init makes, what every store of a spool directory shares
# (_DirStore), the store of files, open_store and Spool.


class _Layout(object):
    """Making a spool's layout (myq init, run as root at every boot): every
    directory, incoming/lanes/ (files: made here, so that no producer's
    can stand there), the wake FIFO, the intake's token, the records, the
    reserve (locks/room), and the database's and the lock files' modes,
    made the owner's alone (no producer may lock them).  Every entry is
    reached through its parent's descriptor, never through a symlink, and
    the owner gets each one through its own descriptor.  Its own object:
    what root does at a boot is read in one place, and a spool in use
    never needs it."""

    def __init__(self, spool):
        self.sp = spool
        self.path = spool.path
        self.d = spool.d

    def make(self, owner, store="files"):
        """The layout, the owner's: every directory, incoming/lanes/ (files:
        made here, so that no producer's can stand there), the wake FIFO,
        the reserve (locks/room), and the database's and the lock files'
        modes, made the owner's alone (no producer may lock them)."""
        ids = _user_ids(owner) if owner else None
        try:
            os.makedirs(self.path, 0o750, exist_ok=True)
            st = os.lstat(self.path)
            if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
                raise ConfigError(
                    "%s is a symlink owned by uid %d; refusing to follow it "
                    "(give the real directory as --spool)" % (self.path, st.st_uid))
            fds = {"": os.open(self.path, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)}
        except OSError as e:
            raise ConfigError("cannot create the spool %s: %s; check the path "
                              "and its permissions" % (self.path, e.strerror))
        try:
            for sub in SUBDIRS + ("locks/ok", "locks/workers"):
                parent, _, name = sub.rpartition("/")
                p = self.d(sub)
                try:
                    _step("mkdir", p, "before")
                    os.mkdir(name, 0o750, dir_fd=fds[parent])
                    _step("mkdir", p, "after")
                except FileExistsError:
                    pass
                fds[sub] = _open_dir(name, fds[parent], p)
            mine = ids[0] if ids else os.fstat(fds[""]).st_uid
            if store == "files":
                fds[LANES] = self._lanes(fds["incoming"], mine)
            dev = os.fstat(fds[""]).st_dev
            for sub, fd in fds.items():
                if os.fstat(fd).st_dev != dev:
                    raise ConfigError(_other_fs(self.d(sub), self.path))
            if hasattr(os, "mkfifo"):
                try:
                    os.mkfifo("wake", 0o660, dir_fd=fds["locks"])
                except FileExistsError:
                    pass
            self._token(fds[""], ids)
            _records_made(fds["locks"], ids)
            if ids:
                _give_layout(fds, ids)
                for fd in fds.values():
                    os.fchown(fd, ids[0], ids[1])
                if ":" in owner:
                    # USER:GROUP: the group is the producers' (myq-spool(5)
                    # OWNERSHIP): tmp/ and incoming/ g+ws,+t, at every start
                    for sub in ("tmp", "incoming"):
                        os.fchmod(fds[sub], stat.S_IMODE(os.fstat(
                            fds[sub]).st_mode) | 0o3070)
                try:
                    fd = os.open("wake", os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW
                                 | O_CLOEXEC, dir_fd=fds["locks"])
                except OSError as e:
                    if e.errno != errno.ENOENT:
                        raise ConfigError("%s is not a FIFO; remove it and run "
                                          "myq init" % self.d("locks", "wake"))
                else:
                    try:
                        if stat.S_ISFIFO(os.fstat(fd).st_mode):
                            os.fchown(fd, ids[0], ids[1])
                    finally:
                        os.close(fd)
            self._files(fds, mine, ids)
        except OSError as e:
            raise ConfigError("cannot create the spool %s: %s; check the path "
                              "and its permissions (--owner needs root)"
                              % (self.path, e.strerror))
        finally:
            for fd in fds.values():
                os.close(fd)

    def _token(self, dirfd, ids):
        """SPOOL/intake.token, the HTTP intake's bearer token (myq(1)
        INTAKE): made once, random, 0640, so that the owner and the
        spool's group (its producers) read it and no other account does;
        one that is there is kept (given to `ids` only when it is root's
        own, one link, reached without following a link)."""
        p = self.d(INTAKE_TOKEN)
        try:
            fd = os.open(INTAKE_TOKEN, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | O_NOFOLLOW | O_CLOEXEC, 0o600, dir_fd=dirfd)
        except FileExistsError:
            try:
                fd = os.open(INTAKE_TOKEN, os.O_RDONLY | os.O_NONBLOCK
                             | O_NOFOLLOW | O_CLOEXEC, dir_fd=dirfd)
            except OSError:
                raise ConfigError("%s is not a plain file; remove it and run "
                                  "myq init (it makes a new token)" % p)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    raise ConfigError("%s is not a plain file of one link; "
                                      "remove it and run myq init" % p)
                if ids and st.st_uid == os.geteuid() != ids[0]:
                    os.fchown(fd, ids[0], ids[1])
            finally:
                os.close(fd)
            return
        try:
            os.write(fd, os.urandom(24).hex().encode("ascii") + b"\n")
            if ids:
                os.fchown(fd, ids[0], ids[1])
            os.fchmod(fd, 0o640)
        finally:
            os.close(fd)

    def _lanes(self, inc, mine):
        """incoming/lanes/ made (0750) in incoming/ (descriptor `inc`), or
        kept when it is a directory of `mine` or root's; anything else (a
        producer's directory, link or file: review) is moved aside within
        incoming/ (lanes.refused-N, which check names), never adopted."""
        try:
            st = os.stat("lanes", dir_fd=inc, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not (stat.S_ISDIR(st.st_mode)
                                   and st.st_uid in (mine, 0)):
            os.rename("lanes", "lanes.refused-" + _rand_hex(4),
                      src_dir_fd=inc, dst_dir_fd=inc)
            st = None
        if st is None:
            try:
                os.mkdir("lanes", 0o750, dir_fd=inc)
            except FileExistsError:
                pass
        fd = _open_dir("lanes", inc, self.d(LANES))
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & 0o022:        # (made when it took incoming/'s mode)
            os.fchmod(fd, mode & ~0o022)
        return fd

    def _files(self, fds, mine, ids):
        """The reserve (locks/room: a worker starts on a full disk whether
        or not one ran before, myq(1) guards) made when there is room; the
        lock files and the database (queue.db, -wal, -shm) that exist made
        the owner's alone (0600): a producer who can open a file can lock
        it, and one read lock on queue.db-shm stopped every writer
        (review).  A file of another owner, or a link, is left as it is."""
        lk = fds["locks"]
        if not _exists("room", lk) and not self.sp.free_problem():
            try:
                fd = os.open("room", os.O_WRONLY | os.O_CREAT | os.O_EXCL
                             | O_NOFOLLOW | O_CLOEXEC, 0o600, dir_fd=lk)
            except FileExistsError:
                fd = None
            if fd is not None:
                try:
                    if ids:
                        os.fchown(fd, ids[0], ids[1])
                    os.write(fd, os.urandom(self.sp.ROOM))
                    os.fsync(fd)
                except OSError:
                    os.unlink("room", dir_fd=lk)    # (no room: a reserve
                finally:                             # is for when there is)
                    os.close(fd)
        for sub, name in _PRIVATE:
            dfd = fds.get(sub)
            if dfd is None:
                try:
                    dfd = fds[sub] = _open_dir(sub.rpartition("/")[2],
                                               fds["locks"], self.d(sub))
                except OSError:
                    continue
            _own_mode(name, dfd, mine, 0o600)


def _over_bound(rules, n, b, size):
    """The bound of a type's `rules` that one more job of `size` bytes
    passes, with n jobs of b bytes waiting ("max_queued=N" or
    "max_bytes=SIZE"), or None."""
    mq, mb = rules.get("max_queued"), rules.get("max_bytes")
    if mq is not None and n + 1 > mq:
        return "max_queued=%d" % mq
    if mb is not None and b + size > mb:
        return "max_bytes=%s" % _format_size(mb)
    return None


class SpoolPolicy(object):
    """A spool's policy (myq(1) policy; a store's `policies`): policy.json
    read again when it changed (looked at once a second at most, or at a
    worker's poll ticks: pol_polled), each type's rules, where a job of a
    type waits (home: incoming/ or its lane), the types held for a missing
    handler (lane_types), and the policy's changes (set_policy).  `store`:
    its spool (the file's path, the door, the wake-up)."""

    def __init__(self, store):
        self.store = store
        self._pol, self._pol_key, self._pol_next = {}, None, 0.0
        self._rules, self._homes = {}, {}     # per type, for this policy
        self.lane_types = frozenset()   # held for a missing handler: laned
        self.pol_polled = False
        self.policy_error = None

    def policy(self, now=None):
        """{TYPE or "*": {KEY: VALUE}}: the last good policy, re-read when
        its file changed (looked at once a second at most; `now`: the
        caller's _mono(), just read).  A file that does not parse is
        ignored: policy_error says why."""
        now = _mono() if now is None else now
        if now < self._pol_next:
            return self._pol
        self._pol_next = now + 1.0
        path = self.store.d(POLICY_FILE)
        try:
            st = os.lstat(path)
            key = (st.st_mtime_ns, st.st_ino, st.st_size)
        except OSError:
            key = None
        if key != self._pol_key:
            self._pol_key = key
            self._rules, self._homes = {}, {}
            if key is None:
                self._pol, self.policy_error = {}, None
            else:
                try:
                    data = self.store.read_file(path, 1 << 20)[0]
                    self._pol = Policy.check(json.loads(data.decode("utf-8")))
                    self.policy_error = None
                except OSError as e:
                    self.policy_error = (
                        "%s cannot be read by uid %d (%s): its rules (pauses, "
                        "bounds, limits) are not applied; %s" % (
                            path, os.geteuid(), e.strerror or e,
                            "give the spool to its owner: " + self.store.chown_fix()
                            if e.errno in (errno.EACCES, errno.EPERM) else
                            "fix the file, or remove it and set the policy "
                            "again with myq policy"))
                except (ValueError, MyqError) as e:
                    self.policy_error = (
                        "%s does not parse (%s); workers keep the last good "
                        "policy: fix the file, or remove it and set the policy "
                        "again with myq policy" % (path, e))
        return self._pol

    def require_policy(self):
        """policy(), or ConfigError when its file is there but this user
        cannot read it: a worker never runs without the types' rules."""
        pol = self.policy()
        if self.policy_error and not os.access(self.store.d(POLICY_FILE), os.R_OK):
            raise ConfigError(self.policy_error)
        return pol

    def rules(self, type):
        """The policy of one type: its own keys over the default's.  (A
        worker re-reads the policy at its poll ticks: pol_polled.)"""
        pol = self._pol if self.pol_polled else self.policy()
        r = self._rules.get(type)
        if r is None:
            own, default = pol.get(type), pol.get("*")
            r = dict(default or ())
            r.update(own or ())
            if len(self._rules) > 4096:
                self._rules.clear()
            self._rules[type] = r
        return r

    def set_policy(self, name, changes):
        """Apply {KEY: VALUE, or None to remove it} to the policy of `name`
        (a type, or "*"): under locks/policy.lock, written beside
        policy.json and renamed over it, so concurrent calls lose nothing.
        Returns the whole new policy."""
        self.store.require()
        own = Policy.SPOOL_KEYS if name == SPOOL_POLICY else None
        if name not in ("*", SPOOL_POLICY):
            _check_name(name, "type")
        changes = dict((k, Policy.value(k, v, own) if v is not None or
                        k not in (own or Policy.KEYS) else None)
                       for k, v in changes.items())
        try:
            fd = _lock(self.store.d("locks", "policy.lock"))
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise ConfigError("%s is not a regular file; remove it"
                                  % self.store.d("locks", "policy.lock"))
            raise ConfigError("cannot lock %s: %s%s" % (
                self.store.d("locks", "policy.lock"), e.strerror or e,
                "; give the spool to its owner: " + self.store.chown_fix()
                if e.errno in (errno.EACCES, errno.EPERM) else ""))
        try:
            path = self.store.d(POLICY_FILE)
            try:
                data = self.store.read_file(path, 1 << 20)[0]
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
                data = None
            pol = {}
            if data is not None:
                try:
                    pol = Policy.check(json.loads(data.decode("utf-8")))
                except (ValueError, MyqError) as e:
                    raise ConfigError(
                        "%s does not parse (%s); nothing was changed: fix it "
                        "by hand, or remove it and set the policy again"
                        % (path, e))
            own = dict(pol.get(name, {}))
            for k, v in changes.items():
                if v is None:
                    own.pop(k, None)
                else:
                    own[k] = v
            Policy.combined(own)
            if own:
                pol[name] = own
            else:
                pol.pop(name, None)
            _replace(path, (json.dumps(pol, indent=1, sort_keys=True) + "\n")
                     .encode("utf-8"), sync=True)
        finally:
            os.close(fd)
            self.store.fs.release()
        self._pol_next = 0.0
        self.store.poke()
        return pol

    def paused(self):
        """Type names paused now ("*": the default, so every new type)."""
        return sorted(t for t, keys in self.policy().items()
                      if keys.get("paused"))

    def is_paused(self, type):
        return bool(self.rules(type).get("paused"))

    def home(self, job, rules=None):
        """Where a waiting job lives: "incoming", or its lane (a priority
        other than 0, or rules of its type that need its jobs apart).
        `rules`: the type's, when the caller has them."""
        t, p = job["type"], job.get("priority")
        if rules is None:
            rules = self.rules(t)
        home = self._homes.get((t, p))
        if home is None:
            q = rules.get("priority", 0) if p is None else p
            if q == 0 and not any(k in rules for k in _LANE_KEYS) \
                    and t not in self.lane_types \
                    and rules.get("overflow") != "drop-oldest":
                home = "incoming"
            else:
                home = "%s/%s@%d" % (LANES, t, q)
            self._homes[(t, p)] = home
        return home

    def set_lane_types(self, types):
        """The types held for a missing handler (by any worker): their
        jobs wait in their lane, where the workers that lack the handler
        do not look until their probe and those that have it take them."""
        types = frozenset(types)
        if types != self.lane_types:
            self.lane_types, self._homes = types, {}

    def expiry(self, job, rules=None):
        """When a job expires (myq(1) policy), or None: its own expires_at, else
        (its retry, or its creation) + its type's ttl.  Times from a clock
        that was never set (before 2020) expire nothing: a device without
        a real-time clock boots in 1970 and jumps at its first NTP sync.
        `rules`: the type's, when the caller has them."""
        if job.get("expires_at") is not None:
            return job_expiry(job, None)
        return job_expiry(job, (self.rules(job["type"]) if rules is None
                                else rules).get("ttl"))


class _DirStore(Store):
    """What every store of a spool directory shares (the file store's and
    the SQLite store's): the layout, name, policy and lanes, the drop
    box's and failed/'s files, the budget's records, the statistics.
    Its parts, each with its own state: `policies` (SpoolPolicy),
    `producer` (Producer), `reader` (READER), `upkeep` (UPKEEP),
    `breaker`, `claims`, `budget`, `backlog`."""

    ROOM = 65536        # bytes of the reserve, locks/room (init, keep_room)
    ram = None          # its RAM tier (RamStore), when it has one (_with_ram)

    def __init__(self, path=None, log=None, **options):
        self.path = os.path.abspath(path or os.environ.get("MYQ_SPOOL")
                                    or DEFAULT_SPOOL)
        self._name = None       # (name: read at its first use)
        self.opt = dict(DEFAULTS)
        for k, v in options.items():
            if k not in DEFAULTS:
                raise TypeError("unknown spool option %r" % k)
            if v is not None:
                self.opt[k] = v
        self.log = log or _noop_log
        self._pre = self.path if self.path.endswith("/") else self.path + "/"
        self._incoming = os.path.join(self.path, "incoming", "")
        self._processing = os.path.join(self.path, "processing", "")
        self._done = os.path.join(self.path, "done", "")
        self._tmp = os.path.join(self.path, "tmp", "")
        self._ready = False
        self.intake = False     # _claim moved a producer's file to its lane
        self.lane_problems = {}     # lane -> why the door refused it
        # Its parts: the producer's side, the reader, the upkeep, the
        # holds' records, the claims, the budget (export and import: the
        # backlog, made at its first use); and its handles on the methods
        # a worker or a producer asks at every turn, bound once.  (At most
        # 30 attributes in all: past that, CPython 3.11 no longer shares
        # the keys of the instance's dict, and every self.spool.X of the
        # worker's loop costs more: +0.7 % instructions a drained job.)
        self.policies = pol = SpoolPolicy(self)
        self.policy, self.rules, self.home = pol.policy, pol.rules, pol.home
        self.expiry = pol.expiry
        self.producer = p = Producer(self)
        self.poke, self.low_on_space = p.poke, p.low_on_space
        self.reader = self.READER(self)
        self.load = self.reader.load
        self.upkeep = self.UPKEEP(self)
        self.breaker = Breaker(self)
        self.claims = self.CLAIMS(self)
        self.budget = self.BUDGET(self)

        _Door.of(self.path)

    def enqueue(self, type, payload=None, id=None, delay=0, max_attempts=None,
                timeout=None, sync=True, priority=None, ttl=None):
        """Add one job; returns its id.  Durable when it returns (sync),
        unless its type is durable=outage and the RAM tier takes it."""
        self.require()
        if self.ram is not None:
            jid = self.ram.take(type, payload, id, delay, max_attempts,
                                timeout, priority, ttl)
            if jid is not None:
                return jid
        job = new_job(type, payload, id, delay, max_attempts, timeout, _now(),
                      priority, ttl)
        todo = self.producer.prepared(job, id is not None, delay or 0)
        if todo[4] != "incoming":       # (a lane: make_room, the lane made)
            return self._enqueue([todo], sync)[0]
        return self._enqueue_one(todo, sync)

    def enqueue_many(self, specs, sync=True):
        """Add many jobs, durable when it returns (sync): on ext4 in one
        journal commit (Producer.place).  All are validated before any is
        written; jobs placed before an error stay queued."""
        self.require()
        if self.ram is not None:
            return self.ram.take_many(specs, sync)
        return self._enqueue_many(specs, sync)

    def _enqueue_many(self, specs, sync):
        now = _now()
        todo = []
        for spec in specs:
            spec = dict(spec)
            explicit = spec.get("id") is not None
            job = new_job(spec.pop("type", None), now=now, **spec)
            todo.append(self.producer.prepared(job, explicit, spec.get("delay") or 0))
        return self._enqueue(todo, sync)

    @property
    def fs(self):
        """Every step on the spool's files goes through its door (the
        filesystem steps above), this thread's (asked four times a drained
        job; _Door.of makes it): its descriptors are closed at the end of
        each public call unless a worker of this thread keeps them."""
        door = _HERE.doors.get(self.path)
        return door if door is not None else _Door.of(self.path)

    def complete(self, c):
        """A worker's success (claims.complete), counted for locks/rates."""
        ok = self.claims.complete(c)
        if ok and (self.ram is None or not c.path.startswith(self.ram._pre)):
            self.budget.delivered(c.job["type"])    # (not RAM's: no write)
        return ok

    def complete_many(self, cs):
        """complete() of each of a batch's claims at once (claims.complete_many),
        or None: one at a time."""
        if not self.claims.bulk_claims:
            return None
        oks = self.claims.complete_many(cs)
        for c, ok in zip(cs, oks or ()):
            if ok and (self.ram is None or not c.path.startswith(self.ram._pre)):
                self.budget.delivered(c.job["type"])
        return oks

    def upkeep_budget(self, now):
        return self.budget.upkeep_budget(now)

    def close_tiers(self):
        """What the RAM tier keeps open, closed (a tmpfs to unmount)."""
        if self.ram is not None:
            self.ram.stop()

    def d(self, *parts):
        """A path in the spool: os.path.join(path, *parts), built without
        it for the relative parts every caller passes (it runs per job)."""
        for p in parts:
            if p[:1] == "/":
                return os.path.join(self.path, *parts)
        if parts and parts[0][:4] == "ram:" and self.ram is not None:
            return self.ram.d(*parts)           # (a lane of the RAM tier)
        return self._pre + "/".join(parts) if parts else self.path

    # Its parts', as the contract names them ---------------------------------

    @property
    def policy_error(self):
        """Why the policy file is not applied, or None (policies')."""
        return self.policies.policy_error

    @property
    def lane_types(self):
        return self.policies.lane_types

    def require_policy(self):
        return self.policies.require_policy()

    def set_policy(self, name, changes):
        return self.policies.set_policy(name, changes)

    def paused(self):
        return self.policies.paused()

    def is_paused(self, type):
        return self.policies.is_paused(type)

    def set_lane_types(self, types):
        self.policies.set_lane_types(types)

    @property
    def backlog(self):
        """Export and import (BACKLOG), made at its first use."""
        b = self.__dict__.get("_backlog")
        if b is None:
            b = self._backlog = self.BACKLOG(self)
        return b

    def free_problem(self):
        return self.producer.free_problem()

    def read_file(self, path, limit=None):
        return self.reader.read_file(path, limit)

    def locate(self, jid):
        return self.reader.locate(jid)

    def show(self, jid):
        return self.reader.show(jid)

    def list(self, state=None):
        return self.reader.list(state)

    def stats(self, now=None, by_type=False, types=True):
        return self.reader.stats(now, by_type, types)

    def dest_states(self, now=None):
        return self.reader.dest_states(now)

    def export(self, states=(), type=None, skip=None):
        """myq export's jobs: the store's (backlog.export), then its RAM
        tier's waiting and running ones."""
        jobs = self.backlog.export(states, type, skip)
        return jobs if self.ram is None else self.ram.exported(
            jobs, states, type, skip)

    def reap(self, me=None, max_attempts=5, dry_run=False):
        """Take back the claims of workers that are gone (Claims.reap)."""
        return self.claims.reap(me, max_attempts, dry_run)

    def retry(self, ids=(), all=False, now=False):
        return self.upkeep.retry(ids, all, now)

    def delete(self, ids, force=False):
        return self.upkeep.delete(ids, force)

    def delete_where(self, state, type=None, older_than=None, force=False,
                     now=None):
        return self.upkeep.delete_where(state, type, older_than, force, now)

    def prune(self, now=None, full=True):
        return self.upkeep.prune(now, full)

    def make_space(self, n=256):
        return self.upkeep.make_space(n)

    def keep_room(self):
        return self.upkeep.keep_room()

    def check(self, operator=True):
        return self.upkeep.check(operator)

    def chown_fix(self):
        """The command that gives the whole spool to its owner."""
        try:
            import pwd
            who = pwd.getpwuid(os.stat(self.path).st_uid).pw_name
        except (ImportError, KeyError, OSError):
            who = "USER"
        return "chown -R %s %s (or: myq --spool %s init --owner %s)" % (
            who, self.path, self.path, who)



    # Layout ------------------------------------------------------------------

    def init(self, owner=None, store=None):
        """Create the spool and its layout (idempotent).  Every entry is
        reached through its parent's descriptor, never through a symlink,
        and `owner` gets each one through its own descriptor: the owner of
        an existing spool cannot make init (run as root at every boot) chown
        or create anything outside it.  `store`: "files" (default) or
        "sqlite" (myq-spool(5) SQLITE STORE), for a new spool; an existing
        one keeps its own."""
        store = store or self.store
        if store != self.store:
            if store != "files" and store not in _STORES:
                raise UsageError("unknown store %r; one of: files %s"
                                 % (store, " ".join(sorted(_STORES))))
            if os.path.isdir(self.d("incoming")) or store == "files":
                raise ConfigError(
                    "spool %s keeps its jobs in %s; init cannot change its "
                    "store: make a new spool with myq --spool NEW init --store "
                    "%s, then move the jobs: myq --spool %s export | myq "
                    "--spool NEW import" % (self.path, self.store, store, self.path))
            _STORES[store].usable()     # (nothing made where it cannot be)
            _Layout(self).make(owner, store)
            return _STORES[store].create(self, owner)
        _Layout(self).make(owner, store)
        return self

    @property
    def name(self):
        """The queue's name: SPOOL/name (init --name, or kept by an
        import), else the directory's base name."""
        if self._name is None:
            data = _read_small(self.d(NAME_FILE), 256)
            name = data.decode("utf-8", "replace").strip() if data else ""
            self._name = name if _is_name(name) else (
                os.path.basename(self.path.rstrip("/")) or "myq")
        return self._name

    def named(self):
        """Whether the spool records a name of its own (SPOOL/name)."""
        return _lexists(self.d(NAME_FILE))

    def set_name(self, name):
        """Record the queue's name (init --name): what the status line,
        stats and metrics say, whatever the directory is called."""
        if not isinstance(name, str) or not _is_name(name):
            raise UsageError("bad queue name %s: 1-128 characters of A-Z a-z "
                             "0-9 . _ -, not starting with '.'"
                             % json.dumps(name)[:140])
        if name == self.name and self.named():
            return
        _replace(self.d(NAME_FILE), (name + "\n").encode("utf-8"), sync=True,
                 mode=0o644)
        self._name = name

    def require(self):
        """Raise ConfigError unless the spool exists and is initialised."""
        if self._ready:
            return self
        for sub in SUBDIRS:
            if not os.path.isdir(self.d(sub)):
                self._unusable(sub)
                if not os.path.isdir(self.path):
                    raise ConfigError("spool %s does not exist; create it with: "
                                      "myq --spool %s init" % (self.path, self.path))
                raise ConfigError("spool %s is not initialised (no %s/); run: "
                                  "myq --spool %s init" % (self.path, sub, self.path))
        self._ready = True      # checked once per store object
        return self

    def _unusable(self, sub):
        """Raise ConfigError when spool/SUB is there but this user may not
        reach it (EACCES) or a part of the path is not a directory: not the
        'not initialised' of a spool that is missing."""
        p = self.d(sub)
        try:
            st = os.stat(p)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM):
                where = self.path
                try:
                    os.stat(self.path)
                except OSError:
                    where = os.path.dirname(self.path)  # above the spool
                raise ConfigError(
                    "permission denied: uid %d may not enter %s; run myq as "
                    "the spool's owner%s, or give this user access"
                    % (os.geteuid(), where, self._owner_hint()))
            if e.errno == errno.ENOTDIR:
                raise ConfigError("spool %s: a part of the path is not a "
                                  "directory; give the spool directory as "
                                  "--spool" % self.path)
            return
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError("spool %s: %s is not a directory; move it away "
                              "and run: myq --spool %s init"
                              % (self.path, p, self.path))

    def _check_readable(self):
        """stats and list read every state directory: say so when this user
        may not, rather than count nothing."""
        for sub in ("incoming", "processing", "done", "dlq", "failed"):
            if not os.access(self.d(sub), os.R_OK | os.X_OK):
                raise ConfigError(
                    "permission denied: uid %d may not read %s; run myq as "
                    "the spool's owner%s or a member of its group"
                    % (os.geteuid(), self.d(sub), self._owner_hint()))

    def _owner_hint(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return ""
        try:
            import pwd
            return " (%s)" % pwd.getpwuid(st.st_uid).pw_name
        except (ImportError, KeyError):
            return " (uid %d)" % st.st_uid

    def check_filesystem(self):
        dev = os.stat(self.path).st_dev
        for sub in SUBDIRS + ("locks/ok",):
            if os.stat(self.d(sub)).st_dev != dev:
                raise ConfigError(_other_fs(self.d(sub), self.path))

    # Policy and lanes (myq(1) policy) ----------------------------------------

    def waiting_dirs(self):
        """incoming/ and its lanes: every directory of waiting jobs."""
        return ["incoming"] + [l[2] for l in self.lanes()]

    def waits_at(self, job, jid):
        """The path in the spool of a waiting job: HOME/ID.json."""
        return "%s/%s.json" % (self.home(job), jid)

    def _lanes_dir(self, make=False):
        """incoming/lanes/'s descriptor (`make`: made when missing).  What
        a producer made there or put in its place (a directory of its
        own, a link: review) is never used: the owner moves it aside
        within incoming/ (lanes.refused-N, named by check) and makes its
        own; anyone else sees no lanes (OSError)."""
        try:
            return self.fs.mkdir(LANES) if make else self.fs(LANES)
        except _Refused as e:
            if not self.fs.owns():
                raise
            inc = self.fs("incoming")
            aside = "lanes.refused-" + _rand_hex(4)
            os.rename("lanes", aside, src_dir_fd=inc, dst_dir_fd=inc)
            self.lane_problems.pop(LANES, None)
            self.log("error", during="lanes", lane=LANES, error="%s; moved "
                     "aside to incoming/%s" % (e, aside))
        return self.fs.mkdir(LANES)

    def make_room(self, type, size, dirs=None, exclude=None):
        """The type's bounds (myq(1) policy) for one new arrival of `size` bytes:
        None when it fits (drop-oldest: after the oldest waiting jobs were
        removed), else why it does not."""
        rules = self.rules(type)
        if rules.get("max_queued") is None and rules.get("max_bytes") is None:
            return None
        waiting = [w for w in self._waiting_of(type) if w[2] != exclude]
        n, b = len(waiting), sum(w[3] for w in waiting)
        bound = _over_bound(rules, n, b, size)
        if bound is None:
            return None
        if rules.get("overflow") != "drop-oldest" or _over_bound(rules, 0, 0, size):
            return ("type %s is at its bound %s (overflow=reject): %d jobs "
                    "(%d bytes) waiting; the job was refused; try again later, "
                    "or raise the bound with myq policy" % (type, bound, n, b))
        now = _now()        # lowest priority, then the earliest made, then id
        waiting.sort(key=lambda w: (w[0], self._made(w, now), w[2]))
        for p, m, name, sz, sub in waiting:
            if not _over_bound(rules, n, b, size):
                break
            if self._drop_waiting(sub, name, dirs or self.fs):  # (else claimed)
                n, b = n - 1, b - sz
                self.log("dropped", id=name[:-5], type=type, reason="overflow",
                       why=bound)
                self.count(("dropped", "dropped_overflow"), type)
        return None

    def count(self, what, type, n=1):
        """Add to a total since init (dropped, expired, rejected, removed;
        myq-spool(5) STATISTICS): locks/totals.json, replaced under locks/totals.lock."""
        try:
            fd = _lock(self.d("locks", "totals.lock"))
        except OSError:
            return
        try:
            tot = self.reader.totals()
            for w in what if isinstance(what, tuple) else (what,):
                d = tot.setdefault(w, {})
                k = type if type in d or len(d) < 1000 else "-"
                d[k] = d.get(k, 0) + n      # (bounded: the rest under "-")
            _replace(self.d("locks", "totals.json"),
                     json.dumps(tot, sort_keys=True).encode("utf-8"))
        except (OSError, MyqError):

            pass            # a statistic, never worth a job
        finally:
            os.close(fd)

    def status_line(self, now=None):
        return self.reader.status_line(now)

    def _note_retry(self, now=None):
        try:
            _append(self.d("locks", "retries"),
                    b"%d\n" % int(_now() if now is None else now))
        except OSError:
            pass        # a statistic, never worth failing a job for


class FileUpkeep(Upkeep):
    """Upkeep of the store of files: retry's moves of job files, retention
    of done/, dlq/, failed/ by their files' times, make_space's oldest."""

    def _retry(self, ids, missing, me, now=False):
        n = 0
        for jid, state, path in self._located(ids, missing):
            if now and state in ("ready", "scheduled"):
                if not self._make_ready(jid, path, me):
                    missing.append(jid)
                    continue
            elif state == "dead":
                if self.store.claims.queued(jid):
                    raise DuplicateJob("job %s is already queued; delete one "
                                       "of them first" % jid)
                job, _, _ = self.store.load(path, jid)
                revive(job, _now(), self.store.rules(job["type"]).get("ttl"))
                if not me.registered:
                    me.register()
                # Own it first (dlq/ -> processing/ID+TOKEN.fin), like every
                # finish: a crash leaves it where a reaper requeues it.
                owned = self.store.claims.own(path, jid, me)
                if owned is None:
                    missing.append(jid)
                    continue
                fin, token = owned
                self.store.claims.move_on(Claim(jid=jid, path=fin, token=token, job=job),
                             job, "incoming", me, fin=fin)
            elif state == "failed":
                name = os.path.basename(path)
                if not name.endswith(".json"):
                    name += ".json"
                why = self._unreadable_by_worker(path)
                if why:
                    raise ConfigError("cannot retry %s: %s" % (jid, why))
                _rename(path, self.store.d("incoming", name))
                _quiet_unlink(path + ".reason")
            else:
                missing.append(jid)
                continue
            n += 1
        if n:
            for sub in self.store.waiting_dirs():
                _fsync_dir(self.store.d(sub))
            self.store.poke()
        return n

    def _prune_jobs(self, now, full, out):
        """prune's part of the jobs' states (the counts into `out`); what
        went for a bound in count, by directory."""
        bound = {}
        for sub, key, age, keep, most, always in self._RETENTION:
            if always or full:
                out[key] += self._expire(sub, age, self.store.opt[keep],
                                         self.store.opt[most] if most else None, now,
                                         bound)
        return bound

    def make_space(self, n=256):
        """Below a guard (myq(1) guards): retention frees done/ first, its n
        oldest now (a producer-chosen id keeps its de-duplication in
        locks/ok/: an inode for an inode, the blocks freed).  Short of
        inodes, the n oldest idempotency records go first, and done files
        go without one: records are never what keeps a backlog from
        draining (a job sent again after that may run twice: at least
        once holds).  Returns how many went."""
        import heapq
        problem = self.store.free_problem()
        inodes = bool(problem) and "inodes" in problem
        gone = 0
        for sub in (("locks/ok", "done") if inodes else ("done",)):
            old = heapq.nsmallest(n, self.aged(sub, "ctime"))
            for _, name in old:
                try:
                    if sub == "done" and not inodes:
                        self.store.producer.outlive(self.store.d(sub, name))
                    _unlink(self.store.d(sub, name))
                    gone += 1
                except OSError:
                    pass
            if sub == "locks/ok" and old:
                self.store.count("removed", "ok", len(old))
        if not gone and self._free_room():
            what = "its reserve (locks/room)"
            gone = 1
        else:
            what = "the oldest"
        if gone:
            self.store.log("pruned", why="below a guard: " + (problem or "low"),
                     n=gone, freed=what)
        return gone


class FileStore(_DirStore):
    """The store of files: a file per job, a state per directory, every
    move one rename(2) (the protocol of the module's docstring); its
    claims are FileClaims'."""

    store = "files"
    READER = Reader
    UPKEEP = FileUpkeep
    CLAIMS = FileClaims
    BUDGET = FileBudget
    BACKLOG = FileBacklog

    def _enqueue(self, todo, sync, refused=None, done=None):
        return self.producer.place(todo, sync, refused, done)

    def _move_in(self, todo, refused=None, done=None):
        return self.producer.place(todo, True, refused, done, whole=True)

    def _enqueue_one(self, todo, sync):
        return self.producer.enqueue_one(todo, sync)

    def find_id(self, jid, now=None, dirs=None):
        return self.producer.find_id(jid, now, dirs)

    def ok_fresh(self, jid, now=None, dirs=None):
        return self.producer.ok_fresh(jid, now, dirs)

    def close(self):
        """What this object keeps open of the spool, closed (a worker's run
        ends with it); the spool of files keeps nothing between calls."""
        self.budget.note_delivered()
        self.fs.release()
        self.close_tiers()

    def lanes(self):
        """[(priority, type, sub)] of the lanes, highest priority first.
        Only directories the door accepts (the owner's alone): what else
        stands there is never used; lane_problems says what and why."""
        out = []
        try:
            names = os.listdir(self._lanes_dir())
        except OSError as e:
            if e.errno != errno.ENOENT:     # (none yet: no lanes)
                self.lane_problems[LANES] = str(e)
            return out
        for name in names:
            m = _lane_of(name)
            if m:
                sub = LANES + "/" + name
                try:
                    self.fs(sub)
                except OSError as e:
                    if sub not in self.lane_problems:
                        self.log("error", during="lanes", lane=sub, error=str(e))
                    self.lane_problems[sub] = str(e)
                    continue
                self.lane_problems.pop(sub, None)
                out.append((int(m[1]), m[0], sub))
        out.sort(key=lambda l: (-l[0], l[1]))
        return out

    def _make_lane(self, sub, dirs=None):
        """Create the lane `sub` (and incoming/lanes/): the owner's alone
        (0750, given to the owner when root makes it), through the door:
        producers drop into incoming/ only, so nothing of theirs can stand
        among the lanes."""
        if sub not in self.fs.fds:
            self._lanes_dir(make=True)
            self.fs.mkdir(sub)

    def _waiting_of(self, type):
        """[(priority, mtime, name, size, sub)] of the jobs of `type`
        waiting in its lanes."""
        out = []
        for p, t, sub in self.lanes():
            if t != type:
                continue
            for e in _scandir(self.d(sub)):
                if e.name.endswith(".json"):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    out.append((p, st.st_mtime, e.name, st.st_size, sub))
        return out

    def _made(self, w, now):
        """When the waiting job `w` (_waiting_of's) was made: its file's
        mtime, unless that is a time to come (a retry's or a delay's
        schedule): then the created_at it holds, less a tick of the
        kernel's clock (a file's time is that coarse clock's, up to 10 ms
        behind the created_at of a job made before it: on a tmpfs, where
        enqueues come that fast, the job made first looked the later)."""
        m = w[1]
        if m <= now:
            return m
        try:
            t = parse(self.read_file(self.d(w[4], w[2]))[0])[0]["created_at"]
        except (OSError, MyqError, ValueError, TypeError, KeyError):
            return m
        return t - 0.01 if t.__class__ in _NUM and t == t else m

    def _drop_waiting(self, sub, name, dirs):
        """Remove the waiting job NAME of `sub` (a bound's drop-oldest):
        False when it was claimed meanwhile."""
        try:
            os.unlink(name, dir_fd=dirs(sub))
        except OSError:
            return False
        return True


_STORES["files"] = FileStore
_ON_OPEN = []       # what extends a store at its opening (a RAM tier's)
_ON_INIT = []       # what myq init does besides, f(store, args) (its --ram)


def open_store(path=None, log=None, **options):
    """The store of the spool at `path` (MYQ_SPOOL, else /var/spool/myq):
    the class _STORES names for its SPOOL/store ("files" where there is
    none); `options`: the guard and retention settings."""
    name = _read_small(os.path.join(os.path.abspath(
        path or os.environ.get("MYQ_SPOOL") or DEFAULT_SPOOL), "store"), 64)
    name = name.decode("ascii", "replace").strip() if name else "files"
    if name not in _STORES:
        raise ConfigError("spool %s records the store %r, which this "
                          "myq does not know (one of: %s)"
                          % (path, name, " ".join(sorted(_STORES))))
    store = _STORES[name](path, log, **options)
    for extend in _ON_OPEN:
        store = extend(store)
    return store


def enqueue(spool, type, payload=None, id=None, delay=0, max_attempts=None,
            timeout=None, priority=None, ttl=None):
    """Add a job to the spool durably; returns its id (myq(1) PYTHON API)."""
    sp = _SPOOLS.get(spool)
    if sp is None or not sp._ready:
        sp = _SPOOLS[spool] = open_store(spool)
    try:
        return sp.enqueue(type, payload, id=id, delay=delay,
                          max_attempts=max_attempts, timeout=timeout,
                          priority=priority, ttl=ttl)
    except ConfigError:
        _SPOOLS.pop(spool, None)
        raise


class Spool(object):
    """One spool, as myq(1) PYTHON API has it: each call what the command
    of its name does, handed to the spool's store (`store`: a Store, of
    the class SPOOL/store names), which has the rest."""

    def __init__(self, path=None, log=None, **options):
        self.store = open_store(path, log, **options)
        self.path = self.store.path

    def init(self, owner=None, store=None):
        """Make the spool (myq init [--store]); returns the Spool."""
        self.store = self.store.init(owner, store)
        return self

    def enqueue(self, type, payload=None, id=None, delay=0, max_attempts=None,
                timeout=None, sync=True, priority=None, ttl=None):
        """myq enqueue: add one job, durable when it returns (sync);
        returns its id."""
        return self.store.enqueue(type, payload, id, delay, max_attempts,
                                  timeout, sync, priority, ttl)

    def enqueue_many(self, specs, sync=True):
        """Add the jobs of `specs` (dicts), durable together; their ids."""
        return self.store.enqueue_many(specs, sync)

    def show(self, id):
        """myq show ID: the job as a dict, with its state."""
        return self.store.show(id)

    def list(self, state=None):
        """myq list [STATE]: the jobs as dicts."""
        return self.store.list(state)

    def stats(self):
        """myq stats: the counters, as a dict."""
        return self.store.stats()

    def status_line(self):
        """The one line of the status: what myq stats prints first."""
        return self.store.status_line()

    def check(self):
        """myq check: what is wrong, as lines (none: all is well)."""
        return self.store.check()

    def retry(self, ids):
        """myq retry ID...: dead jobs back to the queue."""
        return self.store.retry(ids)

    def delete(self, ids, force=False):
        """myq delete ID...: jobs removed."""
        return self.store.delete(ids, force)

    def reap(self):
        """myq reap: the claims of workers that are gone, taken back."""
        return self.store.reap()

    def prune(self):
        """myq prune: retention applied."""
        return self.store.prune()

    def close(self):
        """What the spool keeps open, closed."""
        self.store.close()


# Logging #####################################################################

def open_log_file(path, ids=None):
    """Open (create) a log file for appending, safely as root in a
    directory another user may write to: never through a symlink, never a
    FIFO or a device, never a file with another name (a hard link);
    created 0640 and, with `ids` (uid, gid), handed to that user through
    its descriptor.  Returns the descriptor.  The checks apply where they
    matter: to root, in a directory that someone else may write to (a
    /dev/null or a /dev/stderr given by root stays usable)."""
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | O_CLOEXEC
             | getattr(os, "O_NOCTTY", 0))
    strict = os.geteuid() == 0
    if strict:
        try:
            st = os.stat(os.path.dirname(os.path.abspath(path)))
            strict = st.st_uid != 0 or bool(st.st_mode & 0o022)
        except OSError:
            pass
    try:
        fd = os.open(path, flags | (O_NOFOLLOW if strict else 0), 0o640)
    except OSError as e:
        raise ConfigError("cannot open log file %s: %s%s" % (
            path, e.strerror, " (a symlink is not followed)"
            if e.errno == errno.ELOOP else ""))
    try:
        st = os.fstat(fd)
        if strict and (not stat.S_ISREG(st.st_mode) or st.st_nlink != 1):
            raise ConfigError("log file %s is not a plain file (%s); remove it"
                              % (path, _file_kind(st.st_mode) or "a hard link"))
        if ids is not None and stat.S_ISREG(st.st_mode) \
                and (st.st_uid, st.st_gid) != tuple(ids):
            # handed over: a file just created (empty), or the user's own;
            # never an existing file of root's (MYQ_LOG=/var/log/messages)
            if st.st_uid != ids[0] and (st.st_uid != 0 or st.st_size):
                raise ConfigError("log file %s belongs to uid %d%s; not handed "
                                  "to the service user: give another path, or "
                                  "chown it to the service user" % (
                                      path, st.st_uid,
                                      " and is not empty" if st.st_uid == 0 else ""))
            os.fchown(fd, ids[0], ids[1])
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


_DEV_LOG = "/dev/log"        # syslog(3)'s socket


class Log(object):
    """`TIMESTAMP event=NAME key=value …` lines to stderr, a file (reopened
    on SIGHUP, for logrotate) or syslog.  No `logging`: python3-light lacks it."""

    def __init__(self, path=None, syslog=False, facility="daemon", tag="myq",
                 stream=None, owner=None):
        self.path, self.use_syslog = path, syslog
        self.dest = "syslog" if syslog else path    # (a worker's record says)
        self.stream = stream
        self.owner = owner          # (uid, gid) a new log file is given to
        self._file = None
        self._syslog = None
        self.problem = None         # why the lines go nowhere (syslog)
        if syslog:
            import syslog as _syslog
            fac = getattr(_syslog, "LOG_" + str(facility).upper(), None)
            if fac is None:
                raise UsageError("unknown syslog facility %r (daemon, user, "
                                 "local0 … local7)" % facility)
            _syslog.openlog(tag, _syslog.LOG_PID, fac)
            self._syslog = _syslog
            self.problem = _syslog_problem(_DEV_LOG)
            if self.problem:
                out = stream or sys.stderr
                out.write("myq: warning: %s\n" % self.problem)
                out.flush()
        elif path:
            self.reopen()

    def reopen(self):
        if self.path:
            f = os.fdopen(open_log_file(self.path, self.owner), "a", buffering=1,
                          encoding="utf-8", errors="replace")
            old, self._file = self._file, f
            if old:
                old.close()

    def fileno(self):
        """The log file's descriptor (for a child's stdout and stderr), or
        None (syslog, stderr: the child inherits ours)."""
        return self._file.fileno() if self._file is not None else None

    def write(self, line, warning=False):
        if self._syslog:
            self._syslog.syslog(self._syslog.LOG_WARNING if warning
                                else self._syslog.LOG_INFO, line)
            return
        out = self._file
        try:
            if out is not None:     # line-buffered: the write flushes it
                out.write(line + "\n")
                return
            out = self.stream or sys.stderr
            out.write(line + "\n")
            out.flush()
        except (OSError, ValueError):
            pass

    def __call__(self, event, **kv):
        warn = event in _WARN_EVENTS
        line = iso() + " event=" + event
        for k, v in kv.items():     # _kv(v), its usual cases inline
            if v.__class__ is str and _bare(v):
                line += " " + k + "=" + v
            elif v.__class__ is int:
                line += " " + k + "=" + v.__repr__()
            else:
                line += " " + k + "=" + _kv(v)
        self.write(line, warn)

    def done(self, jid, type, attempt, ms):
        """self("done", id=jid, type=type, attempt=attempt, ms=ms) of a
        claimed job, whose id and type are names (never quoted) and attempt
        and ms ints: the line of every job, formatted at once (its general
        loop over the fields was 5% of a drained job's instructions), to
        a file by one write(2) (its wrapper flushes every line anyway)."""
        line = "%s event=done id=%s type=%s attempt=%d ms=%d" % (
            iso(), jid, type, attempt, ms)
        if self._file is None or self._syslog:
            self.write(line)
            return
        try:
            os.write(self._file.fileno(), (line + "\n").encode("utf-8",
                                                                "replace"))
        except (OSError, ValueError):
            pass


_WARN_EVENTS = frozenset(("error", "dead", "timeout", "quarantined", "disk_low",
                          "lost", "retry", "warning"))


# Handlers ####################################################################

def load_module(path):
    """Load a --module FILE.py; its functions become handlers."""
    import importlib.util
    name = "myq_handlers_" + re.sub(r"\W", "_",
                                    os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or not os.path.isfile(path):
        raise ConfigError("--module %s: no such Python file" % path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise ConfigError("--module %s failed to load: %s: %s"
                          % (path, type(e).__name__, e))
    return mod


def _module_types(mod):
    """The job types of a --module file (myq(1) HANDLERS): exactly its HANDLERS dict
    when it has one, else the functions the file itself defines -- never
    what it imports (`from subprocess import run` must not make a type
    `run`), never a name starting with '_'."""
    table = getattr(mod, "HANDLERS", None)
    if isinstance(table, dict):
        items = table.items()
    else:
        items = [(k, v) for k, v in vars(mod).items()
                 if isinstance(v, _FUNCTION)
                 and getattr(v, "__module__", None) == mod.__name__]
    return dict((k, v) for k, v in items
                if isinstance(k, str) and not k.startswith("_") and callable(v))


_FUNCTION = type(_module_types)


class Handler(object):
    """How the jobs of a type run, as _Resolver.resolve() found it: what it
    is (`kind`, the word of the log and of the policy's `handler`), its
    time limit, its destination (the circuit breaker's, myq(1) holds), which
    jobs may share one batch, and how it runs.  This base is a call in
    this process; the worker asks its handler, never its kind."""
    __slots__ = ("target",)
    kind = None
    spawned = False     # a process the worker feeds and reaps (exec)
    remote = False      # a built-in sender: its time-out is its destination's

    def __init__(self, target=None):
        self.target = target

    def time_limit(self, job, default):
        """Seconds a run of `job` may take: its own timeout, else the
        worker's --timeout."""
        return job.get("timeout") or default

    def dest(self, job, runner, run=None):
        """The circuit breaker's destination of `job`: its type.  (`run`:
        the run it starts, whose probe a failover may take.)"""
        return job["type"]

    def batch_key(self, job, runner):
        """Jobs with the same key may share a batch; None: any of the type."""
        return None

    def start(self, runner, run):
        """A function in this thread (concurrency 1) or a thread of its own."""
        if runner.concurrency == 1 and runner._main:
            runner._run_inline(run)
        else:
            runner._run_thread(run)

    def call(self, runner, run, job):
        self.target(job)

    def call_batch(self, runner, run, jobs):
        """A batch's outcome: ("done",), or ("each", [None or the
        exception, one a job]); a failure raises, as call() does."""
        self.target(jobs)
        return ("done",)

    def resolve(self, type):
        """(this handler, None) for a job of `type`, or (None, why not):
        a built-in type's, once it knows what it needs."""
        return self, None

    def close(self):
        """What it keeps open closed (the end of Worker.run)."""


class ExecHandler(Handler):
    """An executable of --handlers: a process of its own, the payload on
    its stdin (Running a job: _spawn, _collect)."""
    __slots__ = ()
    kind = "exec"
    spawned = True

    def start(self, runner, run):
        runner._spawn(run, self.target)


class PyHandler(Handler):
    """A function of --module or of Worker(handlers=...)."""
    __slots__ = ()
    kind = "py"


def _dests_of(urls, type):
    """The breaker's destinations of a type's `url` list, in order."""
    return [url_origin(u) or type for u in urls.split()]


def _url_dests(pol):
    """The destinations that a policy's `url` keys name, as a set."""
    return set(d for t, keys in pol.items() if keys.get("url")
               for d in _dests_of(keys["url"], t))


def _enveloped(job, rules, now):
    """An mqtt job whose message goes in its envelope (myq(1) policy
    `envelope`): {"id", "type", "created_at", "message"}, and
    "backlog": true for a job of the backlog (policy `order`), so that a
    consumer drops what a crash made the worker publish twice and tells
    old readings from live ones.  A payload that is not an object is
    left to fail as it would."""
    p = job.get("payload")
    if not isinstance(p, dict):
        return job
    env = {"id": job.get("id"), "type": job.get("type"),
           "created_at": job.get("created_at"), "message": p.get("message")}
    if backlog_job(job, rules, now):
        env["backlog"] = True
    return dict(job, payload=dict(p, message=env))


class Uplink(object):
    """The worker's uplink budget (--uplink-rate): the bytes of request
    bodies and MQTT payloads sent by all its runs, to every destination,
    stay within rate x 10 s over any 10 s; a send larger than that goes
    alone, once nothing else was sent in the window.  Thread-safe; wait()
    sleeps the calling run (its time limit is moved on by the wait)."""

    def __init__(self, rate, window=None):
        import threading
        self.rate = float(rate)
        self.window = float(window or UPLINK_WINDOW)
        self.budget = self.rate * self.window
        self._cond = threading.Condition(threading.Lock())
        self._sent = []         # [(monotonic time, bytes)], oldest first
        self._next = 0.0        # the next send not before (monotonic): paced
        self._turns, self._seq = [], 0      # the runs that wait, in order
        self._later = set()     # of them, a backlog's (they wait behind live)
        self.waited = 0.0       # seconds runs waited, in all (tests, bench)
        self.on_sent = None     # f(run, bytes) at each booking (the forecast)

    def _delay(self, n, now):
        """0 when n bytes may go now (then booked), else how long until.
        Sends are paced at the rate (the next after n bytes not before n /
        rate), not sent in a burst each time the window empties: a run
        waits one send's time, not the window's (live data behind a
        backlog, myq(1) policy `order`)."""
        sent = self._sent
        while sent and sent[0][0] <= now - self.window:
            sent.pop(0)
        used = sum(b for _, b in sent)
        if not sent or (used + n <= self.budget and now >= self._next):
            sent.append((now, n))
            self._next = now + n / self.rate
            return 0.0
        if used + n <= self.budget:
            return max(0.001, self._next - now)
        for t, b in sent:       # the first moment enough has left the window
            used -= b
            if used + n <= self.budget or used <= 0:
                return max(0.001, t + self.window - now)
        return max(0.001, sent[-1][0] + self.window - now)

    def wait(self, n, run=None, later=False):
        """Wait until n bytes may go, book them; the seconds waited.  The
        runs wait their turns in order (a larger send is not passed for
        ever by smaller ones that fit in what it leaves), `later` ones (a
        backlog's, myq(1) policy `order`) behind every other: live data
        waits for no backlog send queued before it, only for its bytes.
        The run's time limit moves on by each wait before it is waited
        (the worker's clock of the run must not end it meanwhile): pacing
        is not the job's time.  A run stopped meanwhile (released at the
        end of a shutdown's grace, timed out) sends nothing: RetryLater."""
        cond, start = self._cond, _mono()
        with cond:
            self._seq += 1
            me = self._seq
            turns = self._turns
            if later:
                self._later.add(me)
                turns.append(me)
            else:
                turns.insert(next((i for i, t in enumerate(turns)
                                   if t in self._later), len(turns)), me)
            try:
                while True:
                    d = 0.5 if self._turns[0] != me else \
                        self._delay(n, _mono())
                    if not d:
                        break
                    if run is not None and (run.timed_out or run.released):
                        raise RetryLater(None, "stopped before its turn on "
                                         "the uplink (--uplink-rate): not sent")
                    d, t0 = min(d, 0.5), _mono()
                    if run is not None and run.deadline is not None:
                        run.deadline += d
                    cond.wait(d)
                    if run is not None and run.deadline is not None:
                        run.deadline -= max(0.0, t0 + d - _mono())
            finally:
                self._turns.remove(me)
                self._later.discard(me)
                cond.notify_all()
            if run is not None and self.on_sent is not None:
                self.on_sent(run, n)
            waited = _mono() - start
            if waited > 0.001:
                self.waited += waited
        return waited


# A run's pieces ##############################################################

class _Run(object):
    """One job in flight in this worker, run by its Handler.  What a run
    of one inline call leaves as it was is the class's (made once a job:
    each attribute set was a store a job)."""
    proc = started = deadline = kill_at = None
    stdin = stdin_fd = err_fd = thread = None
    result = conn = None
    slot = probe = dest = None
    batch = None                # the claims of a batch
    dest_fail = split = unsent = False
    retry_after = None          # a destination failure's own delay
    failovers = ()              # ((dest, its failure),) passed over
    err = b""                   # a process's stderr's tail (_spawn's own)
    timed_out = released = False

    def __init__(self, claim, handler):
        self.claim, self.handler = claim, handler


class Backoff(object):
    """Every wait a worker gives a job before it goes again, in one place:
    a retry's (--backoff-base doubling per attempt, to --backoff-max), a
    held destination's probes (doubling per failure of its streak, to
    --probe-max), a held type's, and how long parked jobs wait; each
    jittered by --jitter where it is a backoff."""
    __slots__ = ("base", "most", "probe_max", "jitter")

    def __init__(self, base, most, probe_max, jitter):
        self.base, self.most = float(base), float(most)
        self.probe_max, self.jitter = float(probe_max), float(jitter)

    def _jittered(self, d):
        return max(0.0, d * (1 + self.jitter * (2 * _uniform() - 1)))

    def retry(self, attempt, asked=None):
        """The wait after a job's `attempt`-th run failed: what the handler
        `asked` (RetryLater, a server's Retry-After) capped at
        --backoff-max, else the backoff of that attempt."""
        if asked is not None:
            return min(asked, self.most)
        return self._jittered(min(self.base * 2 ** min(attempt - 1, 60),
                                  self.most))

    def at_least(self, asked, attempt):
        """A server's Retry-After is a lower bound, not leave to hammer it
        ("Retry-After: 0" a thousand times): the backoff holds too."""
        return max(asked or 0.0, self.retry(attempt))

    def probe(self, n):
        """A held destination's n-th wait: --backoff-base doubling to
        --probe-max (and never past --backoff-max), jittered: a link that
        comes back is used within --probe-max, whatever a job's backoff."""
        return self._jittered(min(self.base * 2 ** min(n - 1, 60),
                                  self.probe_max, self.most))

    def dest(self, asked, streak):
        """A failing destination's wait: grows with its streak, not with
        the attempts its jobs spent, to --probe-max; a server's Retry-After
        (or a handler's RetryLater) sets it, capped at --backoff-max."""
        return min(asked, self.most) if asked else self.probe(streak)

    def held_type(self, last):
        """A type held for its missing handler: its wait doubles from
        --backoff-base (at least 1 s), to --backoff-max and 5 minutes."""
        return min(max(last * 2 if last else self.base, 1.0), self.most, 300.0)

    def parked(self):
        """How long a held destination's jobs wait past the hold's next
        probe: the probes take them in turn and the release makes them
        ready; this is only for a release that never comes."""
        return min(max(10 * self.most, 60.0), 3600.0)


class _Resolver(object):
    """The handlers of a worker, by type (myq(1) HANDLERS): --handlers'
    executables, the functions of --module and of Worker(handlers=...)
    (`handlers`, the worker's dict), and the built-in types of
    _BUILTIN_TYPES (`kinds`), each one object holding its connections
    (`http`: HttpHandler and its HttpPool; `mqtt`: MqttHandler and its
    brokers), sharing one uplink (--uplink-rate)."""

    def __init__(self, spool, options, handlers, module):
        o = options
        self.spool, self.handlers, self.module = spool, handlers, module
        self.handlers_dir = o.handlers_dir
        self._py = {}               # type -> its PyHandler (resolve)
        self._last = (None,)        # (rules, type, function, PyHandler)
        self.uplink = Uplink(o.uplink_rate) if o.uplink_rate else None
        if self.uplink is not None:     # its bytes by type: the forecast
            self.uplink.on_sent = self._sent
        self.kinds = dict((name, make(o, self.uplink)) for name, (_, make, _)
                          in sorted(_BUILTIN_TYPES.items()))
        self._keys = [(key, name) for name, (key, _, _)
                      in sorted(_BUILTIN_TYPES.items())]
        self.http, self.mqtt = self.kinds.get("http"), self.kinds.get("mqtt")

    def _sent(self, run, n):
        """A run's n bytes booked on the uplink, by its type (locks/rates)."""
        job = getattr(getattr(run, "claim", None), "job", None)
        t = job.get("type") if isinstance(job, dict) else None
        if isinstance(t, str) and _is_name(t):
            self.spool.budget.sent(t, n)

    def close(self):
        """The kept connections closed (the end of Worker.run)."""
        for h in self.kinds.values():
            h.close()

    def resolve(self, type, rules=None):
        """(handler, None): its Handler, or (None, why not).  `rules`: the
        type's, when the caller has them."""
        rules = self.spool.rules(type) if rules is None else rules
        last = self._last           # (the last job's, again: no lookups)
        if last[0] is rules and last[1] == type and \
                last[2] is self.handlers.get(type):
            return last[3], None
        builtin = rules.get("handler")
        if builtin is None:
            for key, name in self._keys:
                if rules.get(key):
                    builtin = name
                    break
        h = self.kinds.get(builtin) if builtin is not None else None
        if h is not None:
            return h.resolve(type)
        if self.handlers_dir:
            path = os.path.join(self.handlers_dir, type)
            if os.path.isfile(path):
                if os.access(path, os.X_OK):
                    return ExecHandler(path), None
                return None, ("handler %s is not executable (chmod +x %s)"
                              % (path, path))
        fn = self.handlers.get(type)
        if callable(fn) and not type.startswith("_"):
            h = self._py.get(type)
            if h is None or h.target is not fn:     # (one a type, not a job)
                h = self._py[type] = PyHandler(fn)
            if not self.handlers_dir:   # (else an executable may come)
                self._last = (rules, type, fn, h)
            return h, None
        h = self.kinds.get(type)
        if h is not None:
            return h.resolve(type)
        return None, ("no handler for type %s (looked in %s, %s, the built-ins)"
                      % (type, "--handlers " + self.handlers_dir
                         if self.handlers_dir else "no --handlers",
                         "--module" if self.module else "no --module"))



def _abort(run):
    """Cut the http request of a run from the worker's thread: its blocked
    read returns at once and the run ends."""
    conn = run.conn
    sock = getattr(conn, "sock", None)
    if sock is not None:
        import socket
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass


def _cannot_run(path, e):
    """Why an executable handler did not start, in words that name the
    culprit: "No such file or directory" for a file that exists means its
    #! interpreter is missing."""
    why = getattr(e, "strerror", None) or str(e)
    errno_ = getattr(e, "errno", None)
    if errno_ in (errno.ENOENT, errno.ENOEXEC, errno.EACCES) and os.path.isfile(path):
        head = _read_small(path, 256) or b""
        line = head.split(b"\n", 1)[0].decode("utf-8", "replace").strip()
        if errno_ == errno.ENOEXEC or not line.startswith("#!"):
            return ("cannot run %s: not a program (no #! line; start a script "
                    "with e.g. #!/bin/sh)" % path)
        if errno_ == errno.ENOENT:
            return ("cannot run %s: its interpreter is missing (%s); install "
                    "it or fix the #! line" % (path, line))
    return "cannot run %s: %s" % (path, why)


def _tb_tail(e, lines=6):
    """The last lines of an exception's traceback (where it was raised)."""
    try:
        import traceback
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    except Exception:       # a broken __str__, no traceback module
        return None
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def _exc_text(e):
    msg = str(e)
    return "%s: %s" % (type(e).__name__, msg) if msg else type(e).__name__


def _drain(fd):
    """Read what a pipe holds; True when there was something."""
    got = False
    try:
        while os.read(fd, 4096):
            got = True
    except OSError:
        pass
    return got


# The scheduler ###############################################################
#
# Which job a worker starts next: the lanes (incoming/ and its typed and
# prioritised lanes), each with a bounded scan cache refilled by passes over
# its directory; the gates (pause, a held destination, concurrency slots,
# rates, batch_wait); a held destination's probes.  An object the worker
# holds (Worker.sched), with the state it keeps.

class LiveFirst(object):
    """The choice of a lane whose type has order=live-first (myq(1) policy
    `order`), kept apart from the scan and the gates: among the due
    entries of the lane's scan cache, (mtime, name, scheduled), the live
    ones (made within `live` of now) start first, oldest first; the
    backlog (made before) in created_at order, then id, and while live
    jobs wait it takes `backlog_share` percent of the starts (a credit
    that grows by the share at each choice of a live one, spent by a
    backlog job: 50 alternates, 0 starts the backlog only when no live
    job waits).  Live jobs never wait for the backlog's turn when none of
    it is due, nor the backlog for live jobs that are gone.

    The store's scan fills the lane's cache with its n oldest due backlog
    jobs, its n earliest due live ones and its n soonest not due
    (Claims.scan: `live_cut`, `created_of`; `created`, by name, where the
    store keeps created_at: SQLite); files estimate a job's created_at by
    its id, where myq made it (ids sort by creation), else by its mtime
    (available_at): _by_age.  `head` moves its choice to
    the cache's end, where the scheduler takes a lane's next job (_head,
    _next_claim); asked again before that one is taken, it gives it
    again (no share spent); `more` (a batch filling up): only of the kind
    of the last choice, so that a batch is all live or all backlog."""
    __slots__ = ("seen", "n", "live", "back", "credit", "created", "last",
                 "until", "live_s", "look")

    def __init__(self):
        self.seen, self.n, self.until, self.look = None, -1, 0.0, 0.0
        self.live, self.back = [], []
        self.credit, self.created, self.last = 0.0, {}, None
        self.live_s = LIVE_DEFAULT

    def live_cut(self, now):
        """Jobs made before it are the backlog."""
        return now - self.live_s

    @staticmethod
    def sooner(L, head, best):
        """Does lane L's `head` start before `best` (lane, head): the
        earlier, then the id (_Scheduler._next_claim); but between two
        lanes of one live-first type (a RAM tier's and the spool's) whose
        choices are of one kind (both live, both backlog), the older."""
        B, h = best
        if L.order is None or B.order is None or L.type != B.type:
            return head[:2] < h[:2]
        mine, theirs = L.order.last, B.order.last
        if mine is None or theirs is None or mine[1] is not head or \
                theirs[1] is not h or mine[0] != theirs[0]:
            return head[:2] < h[:2]
        return (L.order.created_of(head[1], head[0]), head[1]) < \
            (B.order.created_of(h[1], h[0]), h[1])

    def looked(self, took):
        """A scan read the lane again for its arrivals (a dirty lane) in
        `took` seconds: the next such read not before 20 times that has
        passed (at most 1 s: an arrival waits no longer to be seen), so
        that a deep lane's reads take at most 5 % of the worker's time."""
        self.look = _mono() + min(1.0, 20.0 * took)

    def created_of(self, name, m):
        t = self.created.get(name)
        if t is None:
            stem = name[:-5]
            t = int(stem[:13]) / 1000.0 if _is_generated_id(stem) else m
        return t

    def _split(self, cache, now):
        """The due entries of `cache` as the two lines, each in reverse
        (the next at its end); until when that holds."""
        cut = self.live_cut(now)
        live, back, until = [], [], float("inf")
        for e in cache:
            if not e[1]:
                continue
            if e[0] > now:
                until = min(until, e[0])        # it comes due then
                continue
            t = self.created_of(e[1], e[0])
            if t >= cut:
                live.append(e)
                until = min(until, t + self.live_s)     # it ages then
            else:
                back.append((t, e[1], e))
        live.sort(reverse=True)
        back.sort(reverse=True)
        self.live, self.back, self.until = live, [b[2] for b in back], until
        self.seen, self.n = cache, len(cache)

    def head(self, L, now, rules, more=False, no_wait=False):
        """Lane L's next job under live-first, moved to L.cache's end (the
        scheduler's head), or None when none of the kind `more` wants is
        due (L.next_due: when live jobs' batch_wait ends, if that is why).
        The cache's last entry is due and named when asked."""
        self.live_s = rules.get("live", LIVE_DEFAULT)
        share = rules.get("backlog_share", BACKLOG_SHARE_DEFAULT) / 100.0
        cache = L.cache
        if not more and self.last is not None and cache is self.seen and \
                len(cache) == self.n + 1 and cache[-1] is self.last[1]:
            return cache[-1]        # the choice not taken yet: the same
        if cache is not self.seen or len(cache) != self.n or now >= self.until:
            self._split(cache, now)
        n, wait = rules.get("batch"), rules.get("batch_wait")
        while True:
            if not more and self.live and n and wait and not no_wait and \
                    len(self.live) < n and self.live[-1][0] + wait > now:
                # a live batch waits its batch_wait (myq(1) batches) as it
                # would without a backlog: the backlog's batches go meanwhile
                if not self.back:
                    L.next_due = self.live[-1][0] + wait
                    return None
                kind = "back"
            elif more:
                kind = self.last[0] if self.last else "live"
            elif not self.live:
                kind = "back"
            elif not self.back or share <= 0:
                kind = "live"
            else:
                self.credit = min(self.credit + share, 1.0 + share)
                kind = "live"
                if self.credit >= 1.0:
                    self.credit -= 1.0
                    kind = "back"
            e = self._take(cache, kind)
            if e is not False:
                return e

    def _take(self, cache, kind):
        """The next of line `kind` moved to the cache's end; None when the
        line is empty, False when its next was taken meanwhile."""
        line = self.live if kind == "live" else self.back
        if not line:
            return None
        e = line.pop()
        try:
            i = cache.index(e)
        except ValueError:
            return False                # taken meanwhile
        if i != len(cache) - 1:
            cache.append(cache.pop(i))
        self.n = len(cache) - 1         # (once the scheduler takes it)
        self.last = (kind, e)
        return e


class _HoldTimes(dict):
    """A worker's held destinations, DEST -> until (wall clock): a dict
    that also knows which of them its loop may have a probe of due
    (_Scheduling._next_claim): those that are not its own types held for
    a missing handler (probed through their lanes and parked jobs).  It
    keeps a time no later than the soonest of theirs (every until set
    lowers it), and only once that is due looks through that list, made
    again when a destination came or went: an idle poll with 8,000 types
    held compares one number, not a pass over them (issue 36)."""
    __slots__ = ("_gen", "_key", "_others", "_soonest")

    def __init__(self, *args):
        dict.__init__(self, *args)
        self._gen, self._key, self._others = 0, None, ()
        self._soonest = -float("inf")

    def __setitem__(self, dest, until):
        if dest not in self:
            self._gen += 1
        if until < self._soonest:
            self._soonest = until
        dict.__setitem__(self, dest, until)

    def __delitem__(self, dest):
        self._gen += 1
        dict.__delitem__(self, dest)

    def pop(self, dest, *default):
        if dest in self:
            self._gen += 1
        return dict.pop(self, dest, *default)

    def clear(self):
        self._gen += 1
        dict.clear(self)

    def update(self, *args, **kv):
        self._gen += 1
        self._soonest = -float("inf")
        dict.update(self, *args, **kv)

    def setdefault(self, *args):
        self._gen += 1
        self._soonest = -float("inf")
        return dict.setdefault(self, *args)

    def popitem(self):
        self._gen += 1
        return dict.popitem(self)

    def due(self, now, own):
        """The destinations whose probe is due at `now`, in order, but
        those in `own` (the types this worker holds itself)."""
        if now < self._soonest:
            return ()
        key = (self._gen, len(own))
        if key != self._key:
            self._key = key
            self._others = [d for d in self if d not in own]
        out, soonest = [], float("inf")
        for d in self._others:
            until = dict.get(self, d)
            if until is None or d in own:
                continue
            if until <= now:
                out.append(d)
            soonest = min(soonest, until)   # (a due one not probed: again)
        self._soonest = soonest
        return out


class _Lane(object):
    """A directory of waiting jobs as one worker sees it: incoming/ itself,
    or incoming/lanes/TYPE@PRIORITY, with its scan cache (`order`: its
    LiveFirst, when its type's order is live-first)."""
    __slots__ = ("sub", "type", "prio", "cache", "cache_full", "dirty", "sweep",
                 "soonest", "next_due", "blocked", "slot", "probe", "rated",
                 "dest", "key", "path", "order", "quiet")

    def __init__(self, sub, type=None, prio=0, path=None):
        self.sub, self.type, self.prio, self.path = sub, type, prio, path
        self.cache, self.cache_full, self.dirty = [], False, True
        self.sweep = self.soonest = self.next_due = None
        self.blocked = 0.0          # wall time before which it is not tried
        self.slot = self.probe = self.dest = self.key = self.order = None
        self.quiet = None
        self.rated = False

    def end_sweep(self):
        if self.sweep is not None:
            self.sweep.close()
            self.sweep = None


class _Ahead(object):
    """Claims made ahead: where the store claims many in one statement
    (Claims.bulk_claims), the due jobs of a lane without gates after the
    one the scheduler asks for are claimed with it, AHEAD in all, each
    kept here until the scheduler asks for it in turn (its cache still
    lists it), or given back untouched (release): one statement for
    AHEAD drained jobs, not one each.  A kill takes them back as any
    claim.  The scheduler's (its `ahead`)."""

    AHEAD = 16

    def __init__(self):
        self.held = {}      # name -> (its Claim, when claimed: monotonic)
        self.off = False    # (--once: one job, no more)

    def claim(self, claims, name, me, max_attempts, scheduled, L):
        """claims.claim() of NAME in lane L, with the due jobs after it in
        L's cache where the store claims many at once: a Claim, or None."""
        held = self.held
        got = held.pop(name, None)
        if got is not None:
            return got[0]
        names, sched, now = [name], [scheduled], _now()
        for m, n, s in () if self.off else reversed(L.cache):
            if len(names) >= self.AHEAD or not n or m > now:
                break
            if n not in held:
                names.append(n)
                sched.append(s)
        if len(names) == 1:
            return claims.claim(name, me, max_attempts, scheduled, L.sub)
        try:
            got = claims.claim_many(names, me, max_attempts, sched, L.sub)
        except OSError as e:
            # (what it admitted before the error: kept, given back later)
            self._keep(names, getattr(e, "claims", None) or ())
            raise
        self._keep(names[1:], got[1:])
        return got[0]

    def _keep(self, names, cs):
        t = _mono()
        for n, c in zip(names, cs):
            if c is not None:
                self.held[n] = (c, t)

    def release(self, claims, age=0.0):
        """The claims not asked for in `age` seconds given back untouched
        (put_back: due as they were, no attempt spent); one that fails on
        I/O stays, for the next call (the error raised).  True if any
        went back (or the error came): the lanes are to be read again."""
        cut = _mono() - age
        back = False
        for n, (c, t) in list(self.held.items()):
            if t <= cut:
                back = True
                claims.put_back(c, c.mtime)
                del self.held[n]
        return back


class _Scheduler(object):
    """The worker's choice of its next job: its lanes and their scan
    caches, the gates of a start, the probes of held destinations.  What
    it reads of the others it is given: `holds` (what is held, until
    when), `runs` (the worker's runs: a type's concurrency) and `tick`
    (the worker's heartbeat, kept on time inside long passes)."""

    def __init__(self, spool, log, options, delays, holds, runs, tick):
        self.spool, self.log, self.delays = spool, log, delays
        self.holds, self.runs, self._tick = holds, runs, tick
        self.poll, self.scan_cache = options.poll, options.scan_cache
        self.max_attempts = options.max_attempts
        self.me = None              # the worker's Identity (start)
        self._top = _Lane("incoming", path=spool.d("incoming"))
        self._lanes, self._lanes_key = [self._top], None
        self._lanes_look = 0.0      # no lanes yet: when to look again
        self._taken = (None, None, None)    # the last claim's slot, probe, lane
        self._no_wait = False       # --once, --drain: no batch_wait
        self.next_due = None        # when a job comes due (wall clock)
        self._dir_key = None        # incoming/'s change key, last seen
        self.ahead = _Ahead()       # (off for --once: Worker._loop)
        self._own_since = None      # incoming/ changed by this worker alone since
        self._poked = False         # a poke _wait drained, for _sync_lanes
        self._pol_said = None       # the policy's problem last logged
        self._clock_offset = _now() - _mono()
        self._wake_fds, self._wake_poll = [], None  # locks/wake (start)
        self._noted = {}            # the last stop's note: sub -> (key, soonest)

    def start(self, me, select):
        """At the start of Worker.run(): its identity, the wake-up FIFO
        opened (with a poll object: a look without an exception), the last
        stop's note of the lanes taken (_use_note)."""
        self.me = me
        self._noted = self._take_note()
        self._wake_fds = self._open_wake()
        self._wake_poll = None
        if self._wake_fds and hasattr(select, "poll"):
            self._wake_poll = select.poll()
            for fd in self._wake_fds[0::2]:     # (a RAM tier's FIFO too)
                self._wake_poll.register(fd, select.POLLIN)

    def close(self):
        """At the end of run(): the FIFO closed, the passes ended, the
        lanes' slots given back; a later run starts afresh."""
        for fd in self._wake_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_fds, self._wake_poll = [], None
        self._write_note()
        self._end_sweep()
        for L in self._lanes:
            L.cache, L.dirty = [], True
            if L.slot is not None:
                os.close(L.slot)
                L.slot = None

    def _check_incoming(self):
        """On each poll tick: rescan only when incoming/ changed (a shell
        producer's mv does not poke the FIFO) or the wall clock jumped; the
        policy, when its file changed."""
        # The door's descriptors looked at again: one replaced is opened
        # (and checked) again; their stats, taken now, serve this tick.
        self.spool.fs.recheck()
        looked = self.spool.fs.looked
        self.spool.policy()
        if self.spool.policy_error != self._pol_said:
            self._pol_said = self.spool.policy_error      # (said once)
            if self._pol_said:
                self.log("warning", problem=self._pol_said)
        key, racy = self.spool.claims.change_key(looked.get("incoming"))
        own = self._own_since
        if own is not None:         # (only this worker's changes: _dirty_home)
            racy = _mono() - own > 5.0
        if key != self._dir_key or racy:
            self._dir_key, self._own_since = key, None  # (a pass sees all)
            self.dirty = True
        for L in self._lanes:
            if L is not self._top:
                # (a lane's jobs came without a poke: _hush; a stat each)
                k, racy = self.spool.claims.lane_key(L)
                if k != L.key or racy:
                    L.key, L.dirty = k, True
        offset = _now() - _mono()
        if abs(offset - self._clock_offset) > 2.0:
            self.log("clock_jump", seconds=offset - self._clock_offset)
            self._clock_offset = offset
            self.dirty = True
            self.next_due = None

    def _rescan(self, L=None):
        """Refill lane L's scan cache (default: incoming/ itself) with its N
        earliest jobs: the store's scan (Claims.scan), or the last stop's
        note of it.  A pass starts with the lane's key read (not racy): what
        changes during it changes the key (_check_incoming), what did not
        needs no pass at the next look (_current)."""
        L = L or self._top
        if L.sweep is None:
            k, racy = self._lane_key(L)
            k = None if racy else k
            if L is self._top:
                self._dir_key, self._own_since = k, None
            else:
                L.key = k
            if self._noted and self._use_note(L, k):
                return
        self.spool.claims.scan(L, self.scan_cache, self._tick)

    def _lane_key(self, L):
        claims = self.spool.claims
        return claims.change_key() if L is self._top else claims.lane_key(L)

    def _current(self, L):
        """Does lane L's cache hold what waits there (no change since its
        last pass: its key the same, not racy), so that a fresh look
        (--once, --drain) need not read it again?"""
        if L.dirty or L.sweep is not None or L.order is not None or \
                L is self._top and self._own_since is not None:
            return False
        k, racy = self._lane_key(L)
        return not racy and k is not None and \
            k == (self._dir_key if L is self._top else L.key)

    # The note of a stop (locks/scanned): a deep lane's pass (100,000 jobs
    # not due: 1.3 G instructions on files, a stat each) is not made again
    # at the next start when nothing changed in between (Claims.lasting_key).

    def _take_note(self):
        """The last stop's note, removed (a worker killed leaves none)."""
        if not self.spool.claims.lasting_key:
            return {}
        path = self.spool.d("locks", SCAN_NOTE)
        raw = _read_small(path, 65536)
        if raw is None:
            return {}
        _quiet_unlink(path)
        try:
            note = json.loads(raw.decode("utf-8"))
            if _now() < note["at"]:
                return {}           # the clock went back since: a pass
            return dict((sub, (tuple(k), float(t)))
                        for sub, (k, t) in note["lanes"].items())
        except (ValueError, KeyError, TypeError, AttributeError):
            return {}

    def _use_note(self, L, key):
        """Lane L's cache from the note, when its key is still the one
        noted: a marker at its soonest job, as a pass would end."""
        k, t = self._noted.pop(L.sub, (None, None))
        if key is None or k != key or t <= _now():
            return False
        L.cache, L.cache_full, L.dirty, L.next_due = [(t, "", False)], False, \
            False, None
        return True

    def _write_note(self):
        """At a stop: the soonest job of each lane whose cache holds what
        waits there, none of it due (a deep lane's: its pass ended with a
        marker); nothing when no lane is such."""
        if not self.spool.claims.lasting_key or not self.me:
            return
        now, lanes = _now(), {}
        for L in self._lanes:
            if L.cache and L.cache[-1][0] > now and self._current(L):
                key = self._dir_key if L is self._top else L.key
                lanes[L.sub] = [list(key), L.cache[-1][0]]
        if lanes:
            try:
                _replace(self.spool.d("locks", SCAN_NOTE), json.dumps(
                    {"at": now, "lanes": lanes}).encode("utf-8"))
            except (OSError, ValueError):
                pass            # (no note: the next start makes a pass)

    # The top lane (incoming/ itself) under the names the scan had before
    # there were lanes.
    @property
    def dirty(self):
        return self._top.dirty

    @dirty.setter
    def dirty(self, value):
        if value:
            self._lanes_look = 0.0      # a producer's lane may be new
        for L in self._lanes:
            L.dirty = L.dirty or value

    @property
    def _sweep(self):
        return self._top.sweep

    @_sweep.setter
    def _sweep(self, value):
        self._top.sweep = value

    def _end_sweep(self):
        for L in self._lanes:
            L.end_sweep()
            if L.quiet is not None:         # (the worker stops)
                self._hush(L, None)

    def _woken(self):
        """A poke (a producer's enqueue, a worker's retry or release, this
        worker's own): incoming/ is read again when its key changed, the
        lanes when theirs did (_sync_lanes, told of the poke)."""
        self._poked = True
        self._lanes_look = 0.0
        self._look_top()

    def _look_top(self):
        """incoming/ read again at its next look when its key changed."""
        key, racy = self.spool.claims.change_key()
        if key != self._dir_key or racy and self._own_since is None:
            self._dir_key, self._own_since = key, None
            self._top.dirty = True

    def _dirty_home(self, job, until=None, pre=None):
        """A job put back waiting (until: its time, when later than now;
        `pre`: incoming/'s key before the move, which tells another's
        change since the last look from this one's):
        its lane's cache is stale, no other's; not even its own when the
        lane's last pass ended with a marker (a deep directory of jobs not
        due: 8,000 parked) no later than `until`: the pass that marker
        starts sees it (review: each job parked again made a pass over all
        of incoming/, 3-6 % of a core).  A live-first lane's is: it goes by
        its age, maybe before the jobs its cache holds (a retry's)."""
        sub = self.spool.home(job)
        for L in self._lanes:
            if L.sub == sub:
                if not L.dirty and until is not None and L.sweep is None \
                        and L.order is None \
                        and L.cache and self._seen_later(L, until) \
                        and (L is not self._top or pre == self._dir_key):
                    if L is self._top:
                        # (this change of incoming/ is known: not another's;
                        # one made in the same jiffy, which leaves the key
                        # as it is, is seen within 5 s, _check_incoming)
                        self._dir_key = self.spool.claims.change_key()[0]
                        self._own_since = self._own_since or _mono()
                    return
                L.dirty = True
                return
        self._lanes_look = 0.0          # a lane new since: learnt there

    @staticmethod
    def _seen_later(L, until):
        """Will lane L's next pass come by `until` anyway?  Its last pass
        ended with a marker no later (a deep directory), or its cache
        holds the N earliest of more, all no later (the pass that follows
        them sees it)."""
        marks = [e[0] for e in L.cache if not e[1]]
        if marks:
            return min(marks) <= until
        return L.cache_full and L.cache[0][0] <= until

    def _sync_lanes(self, fresh=False, fifo_seen=False):
        """Learn the lanes (incoming/lanes/ changed: one stat), and, when a
        producer poked the wake FIFO since (read here at each claim: while
        jobs run back to back the loop's select comes only now and then),
        which changed: a stat each."""
        # (the FIFO asked once a claim, not after a select: `fifo_seen`)
        fifo = self._wake_poll
        was, self._poked = self._poked, False       # (drained by _wait: _woken)
        waiting = was or not fifo_seen and fifo is not None and bool(fifo.poll(0))
        # What a producer's poke can have changed: the lanes that got jobs,
        # where the store can say (Claims.arrived); else incoming/ by its
        # key (_woken, when _wait drained the poke) and the lanes below by
        # theirs (below).
        arrived = self.spool.claims.arrived() if waiting else None
        if arrived is not None:
            for L in self._lanes:
                if L.sub in arrived:
                    L.dirty = True
            self._lanes_look = 0.0
        if self._lanes_key is None:
            # No lanes yet: look for incoming/lanes/ when a poke waits in
            # the FIFO (the job may have made the first lane), after a
            # change of incoming/ (the dirty setter), at a fresh look (the
            # scan may have moved producers' files to new lanes), else
            # every 50 ms: not at each claim, where the path lookup was 5%
            # of a drained job.
            now = _mono()
            if now < self._lanes_look and not fresh and not waiting:
                return
            self._lanes_look = now + 0.05
            if not self.spool.claims.maybe_lanes():
                return  # no lanes, as before
        key = self.spool.claims.lanes_key(waiting)
        if key is None and key == self._lanes_key:
            return                      # no lanes: nothing to learn
        wake = self._wake_fds
        if not wake:
            poked = True
        elif fifo is not None and not waiting:
            poked = False
        else:
            poked = any([_drain(fd) for fd in wake[0::2]]) or waiting
        for L in self._lanes if poked and arrived is None else ():
            if L is not self._top:
                # (a time that recent proves nothing: see change_key)
                k, racy = self.spool.claims.lane_key(L)
                if k != L.key or racy:
                    L.key, L.dirty = k, True
        if key == self._lanes_key:
            return
        self._lanes_key = key
        have = dict((L.sub, L) for L in self._lanes)
        lanes = [self._top]
        for p, t, sub in self.spool.claims.worker_lanes():
            lanes.append(have.pop(sub, None) or _Lane(sub, t, p,
                                                      self.spool.d(sub)))
        have.pop(self._top.sub, None)
        for L in have.values():
            L.end_sweep()
        lanes.sort(key=lambda L: -L.prio)       # stable: incoming/ first of 0
        self._lanes = lanes

    def _head(self, L, force=False, more=False):
        """Lane L's next job that is due now, (mtime, name, scheduled), or
        None (L.next_due: when one will be).  A lane of a live-first type
        chooses through its LiveFirst (`more`: a batch filling up)."""
        forced = restarted = False
        if L.type is not None:
            rules = self.spool.rules(L.type)
            live = rules.get("order") == "live-first"
            if live != (L.order is not None):
                L.order, L.dirty = LiveFirst() if live else None, True
                L.end_sweep()           # (a live-first lane has no pass)
        if force and self._current(L):
            force = False       # (nothing changed since its pass: not again)
        while True:
            self._tick()            # (the worker's heartbeat, on time)
            if not L.cache:
                if not (L.dirty or L.cache_full or (force and not forced)):
                    return None
                forced = True
                self._rescan(L)
                if not L.cache:
                    if L.sweep is None:
                        return None
                    continue            # an open pass goes on
            m, name, scheduled = L.cache[-1]
            if m > _now():
                if L.dirty or (force and not forced):
                    forced = True
                    self._rescan(L)
                    continue
                L.next_due = m
                return None
            if not name:                # a pass's marker: time for the next
                L.cache.pop()
                L.dirty = True
                if restarted:           # nothing claimable: not again now,
                    L.next_due = _now() + min(self.poll, 0.25)  # soon
                    return None
                restarted = True
                continue
            if L.order is not None:
                if L.dirty and not forced and _mono() >= L.order.look:
                    forced = True       # live jobs come at the end: read
                    took = _mono()      # what came since (the earliest
                    self._rescan(L)     # alone do not need it), in at
                    L.order.looked(_mono() - took)  # most 5 % of the time
                    continue
                return L.order.head(L, _now(), rules, more, self._no_wait)
            return L.cache[-1]

    def _next_claim(self, force=False):
        """The next job to start: among the lanes whose type may start one
        now, the highest priority, then the earliest, then the id."""
        budget = 256        # files that could not be claimed, before a break
        inf = float("inf")
        fresh = False       # force: a fresh look at every lane, once, when
        while True:         # the caches gave nothing
            self._sync_lanes(fresh)
            # the time for the holds and the gates of typed lanes (none:
            # not read)
            now = _now() if self.holds.until or len(self._lanes) > 1 else None
            best, due = None, inf
            for dest in self.holds.until.due(now, self.holds.missing) \
                    if self.holds.until else ():
                c = self._probe_claim(dest)
                if c is not None:
                    return c
            if self.spool.intake:
                # Producers' files are being moved to their lanes: go on
                # with incoming/ first, so that their bounds see them all
                # before any of them starts (myq(1) policy: "at the next scan").
                head = self._head(self._top, fresh)
                if head is not None:
                    best = (self._top, head)
                self.spool.intake = False
            for L in self._lanes if best is None else ():
                if best is not None and L.prio < best[0].prio:
                    break
                if L.type is not None:
                    wait = self._gate(L, now)
                    if wait is not None:
                        due = min(due, wait)
                        continue
                head = self._head(L, fresh)
                if head is None:
                    if L.next_due is not None:
                        due = min(due, L.next_due)
                    continue
                if L.type is not None:
                    wait = self._batch_wait(L, now)
                    if wait is not None:
                        due = min(due, wait)
                        self._hush(L, wait)
                        continue

                if best is None or LiveFirst.sooner(L, head, best):
                    best = (L, head)
            if best is None and force and not fresh:
                fresh = True
                continue
            if best is None:
                self.next_due = None if due == inf else due
                return None
            L, (m, name, scheduled) = best
            if L.type is not None:
                wait = self._reserve(L, L.sub + "/" + name)
                if wait is not None:
                    continue            # another worker was faster
            L.cache.pop()
            c = self._lane_claim(L, name, scheduled)
            if c is not None:
                return c
            self._unreserve(L)
            budget -= 1
            if budget <= 0 and not force:
                # A flood of bad files: the loop's housekeeping (reaping,
                # the status line, commits) goes first, then on at once.
                self.next_due = _now()
                return None

    def _lane_claim(self, L, name, scheduled, anytime=False):
        """Claim NAME of lane L, what _reserve took for it handed to the
        run (_start), or None (L keeps it: the caller gives it back)."""
        claims = self.spool.claims
        # (a claim from incoming/ changes it, where the store's claims say
        # so: known, unless another's change came first (_dirty_home); not
        # asked while the next job is due too: a stale key costs one pass)
        pre = L is self._top and claims.claim_changes_key and not (
            L.cache and L.cache[-1][1] and L.cache[-1][0] <= _now()) \
            and claims.change_key()[0]
        try:        # (a lane without gates: its next jobs claimed ahead)
            c = claims.claim(name, self.me, self.max_attempts, scheduled, L.sub,
                             anytime=anytime) if anytime or L.type or L.order \
                or not claims.bulk_claims else self.ahead.claim(
                    claims, name, self.me, self.max_attempts, scheduled, L)
        except BaseException:
            self._unreserve(L)
            raise
        if pre and pre == self._dir_key:
            self._dir_key = claims.change_key()[0]
            self._own_since = self._own_since or _mono()
        if c is not None:
            self._taken = (L.slot, L.probe, L)
            L.slot = L.probe = None
            L.rated = False
            if L.quiet is not None:
                self._hush(L, None)
        return c

    def _hush(self, L, until):
        """Lane L's batch waits out its batch_wait until `until` (wall
        clock): producers need not poke for it meanwhile (locks/quiet/LANE,
        its mtime that time on the monotonic clock: Producer.hushed), as
        this worker looks at the lane then; None: poke again (its batch
        starts, the worker stops).  Either way the lane is scanned at its
        next claim: what came without a poke is found there."""
        if until == L.quiet:
            return
        L.quiet, L.dirty = until, True
        try:
            path = self.spool.claims.quiet_mark(L, until is not None)
            if until is None:
                _quiet_unlink(path)
                return
            if not _lexists(path):
                os.close(_open(path, os.O_WRONLY | os.O_CREAT))
            _utime(path, _mono() + max(0.0, until - _now()))
        except OSError:
            L.quiet = None                  # (pokes come: only wasted)

    def _ready_now(self):
        """For --drain: is any job ready now (after a fresh scan)?  Jobs of
        a paused type or a held destination are not, unless a probe is
        due."""
        self._sync_lanes(True)
        now = _now()
        for L in self._lanes:
            if L.type is not None and (self.spool.rules(L.type).get("paused") or
                                       self.holds.until.get(L.dest or L.type, 0) > now):
                continue        # (a rate or a slot only makes ready jobs wait)
            if L.cache and L.cache[-1][0] <= now and L.cache[-1][1]:
                return True
            if L.cache and L.cache[-1][0] > now and self._current(L):
                continue        # its pass, or the note, still holds: none due
            self._rescan(L)
            while not L.cache and L.sweep is not None:
                self._rescan(L)
            if L.cache and L.cache[-1][0] <= _now():
                return True
        return False

    def _gate(self, L, now):
        """None when a job of lane L may start now, else the wall time when
        it may (inf: not by time: a pause, all slots busy here)."""
        rules = self.spool.rules(L.type)
        if rules.get("paused"):
            return float("inf")
        until = self.holds.until.get(L.dest or L.type)
        if until is not None and until > now:
            return until
        n = rules.get("concurrency")
        if n is not None and sum(1 for r in self.runs
                                 if r.claim.job["type"] == L.type) >= n:
            return float("inf")
        if L.blocked > now:
            return L.blocked
        return None

    def _batch_wait(self, L, now):
        """None when lane L's batch may start now, else the wall time when
        it may: up to batch_wait after its first ready job, unless a whole
        batch is ready (myq(1) batches: for every claim, so asked after the scan
        that found the jobs; --drain and --once do not wait)."""
        if self._no_wait:
            return None
        rules = self.spool.rules(L.type)
        wait, n = rules.get("batch_wait"), rules.get("batch")
        if not wait or not n:
            return None
        ready = [e[0] for e in L.cache if e[1] and e[0] <= now]
        if not ready or len(ready) >= n:
            return None
        first = min(ready) + wait
        return first if first > now else None

    def _reserve(self, L, job=None):
        """Take what a start of lane L's type needs: the probe of a held
        destination (`job`: the one it will be, Breaker.take_probe), a
        concurrency slot (locks/slots/TYPE.K, flock'd: a kill -9 frees
        it), a place in the rate's window.  None when taken, else the lane
        waits (L.blocked) and it returns the time."""
        sp = self.spool
        rules = sp.rules(L.type)
        now = _now()
        dest = L.dest or L.type
        if dest in self.holds.until:
            until = sp.breaker.take_probe(dest, self.delays.probe, job)
            if until is None:
                L.blocked = now + min(self.poll, 1.0)
                return L.blocked
            if until:
                self.holds.until[dest] = until
                L.probe = dest
            else:
                self.holds.until.pop(dest, None)     # released meanwhile
        n = rules.get("concurrency")
        if n is not None and L.slot is None:
            L.slot = self._slot(L.type, n)
            if L.slot is None:
                L.probe = None
                L.blocked = now + min(self.poll, 0.25)
                return L.blocked
        rate = rules.get("rate")
        if rate:
            wait = self._rate_take(L.type, rate)
            if wait:
                L.probe = None
                L.blocked = now + wait
                return L.blocked
            L.rated = True
        return None

    def _unreserve(self, L):
        """The lane gave no job: give back its slot and its place in the
        rate's window."""
        L.probe = None
        if L.slot is not None:
            os.close(L.slot)
            L.slot = None
        if L.rated:
            L.rated = False
            self._rate_take(L.type, self.spool.rules(L.type).get("rate"),
                            give_back=True)

    def _slot(self, type, n):
        """One of the type's n slots, or None: a locked descriptor."""
        d = self.spool.d("locks", "slots")
        try:
            self.spool.fs.mkdir("locks/slots")
        except OSError:
            return None
        for k in range(n):
            try:
                fd = _lock("%s/%s.%d" % (d, type, k), block=False)
            except OSError:
                continue
            if fd is not None:
                return fd
        return None

    def _rate_take(self, type, rate, give_back=False):
        """Take a start in the type's window (locks/rate/TYPE: this boot's
        monotonic start times, under flock): 0 when taken, else how long
        until one is free.  With give_back, return the last one taken."""
        n, per = rate_of(rate)
        d = self.spool.d("locks", "rate")
        try:
            self.spool.fs.mkdir("locks/rate")
            fd = _lock(d + "/" + type)
        except OSError:
            return 0            # no window to keep: never hold a job for it
        try:
            lines = os.pread(fd, 1 << 20, 0).decode("utf-8", "replace").split("\n")
            now = _mono()
            times = []
            if lines[0] == boot_id():
                for t in lines[1:]:
                    try:
                        t = float(t)
                    except ValueError:
                        continue
                    if now - per < t <= now:
                        times.append(t)
            if give_back:
                if times:
                    times.pop()
                wait = 0
            elif len(times) >= n:
                wait = max(0.001, times[-n] + per - now)
            else:
                times.append(now)
                wait = 0
            data = "\n".join([boot_id()] + ["%.6f" % t for t in times[-n:]])
            os.ftruncate(fd, 0)
            os.pwrite(fd, data.encode("utf-8"), 0)
            return wait
        except OSError:
            return 0
        finally:
            os.close(fd)

    def _probe_claim(self, dest):
        """A held destination's probe is due: claim the next of the jobs it
        put back (locks/held/DEST.jobs), in turn, so that each probe is
        another job.  None when none is there (a lane's head is then the
        probe, see _reserve)."""
        sp = self.spool
        names = sp.breaker.jobs(dest)
        if not names:
            return None
        # the one after the last probe's job (which a job that came due by
        # itself may have been, see _start)
        last = (sp.breaker.record(dest) or {}).get("last")
        # (a last probe not among them was a lane's head: the recorded jobs
        # had their turn, the lane's next head is the probe)
        k = names.index(last) + 1 if last in names else len(names) if last else 0
        wrapped = k == len(names)
        names = names[k:] + names[:k]
        sub = names[0].rpartition("/")[0]
        L = next((L for L in self._lanes if L.sub == sub), None)
        if L is not None and L.type is not None:
            # A start of its type like any other: paused, its slots and its
            # rate hold for a probe too, taken the lane's own way
            # (_reserve); and once the recorded jobs had their turn, the
            # lane's head is the next probe (what the hold kept from
            # starting is never recorded: the same job was probed forever).
            L.dest = dest
            head = self._head(L) if wrapped else None
            if self._gate(L, _now()) is not None or head is not None and \
                    sub + "/" + head[1] not in names:
                return None
            if self._reserve(L, names[0]) is not None or L.probe != dest:
                self._unreserve(L)
                return None
            for rel in names:
                if rel.startswith(sub + "/") and sp.claims.waits(rel):
                    c = self._lane_claim(L, rel.rpartition("/")[2], True,
                                         anytime=True)
                    if c is not None:
                        return c
            self._unreserve(L)
            return None
        until = sp.breaker.take_probe(dest, self.delays.probe, names[0])
        if not until:
            if until == 0.0:
                self.holds.until.pop(dest, None)     # released meanwhile
                self.dirty = True
            return None
        self.holds.until[dest] = until
        for rel in names:
            sub, _, name = rel.rpartition("/")
            if not sp.claims.waits(rel):
                continue
            c = sp.claims.claim(name, self.me, self.max_attempts, True, sub,
                                anytime=True)
            if c is not None:
                # (its lane: where the rest of a batch it went in waits)
                self._taken = (None, dest, _Lane(sub))
                return c
        return None

    def _failover_lanes(self):
        """The holds changed: each lane of a type with destinations to fail
        over to is gated by where its next start would go (the first not
        held, else the one due first), not by where its last one went."""
        now = _now()
        for L in self._lanes:
            dests = L.type is not None and L.dest is not None and \
                self.holds._dests_of_type(L.type)
            if dests:
                L.dest = next((d for d in dests if self.holds.until.get(d, 0) <= now),
                              min(dests, key=lambda d: self.holds.until.get(d, 0)))

    def _open_wake(self):
        """[read end, write end] of each FIFO the store's producers poke
        (Claims.wake_paths: the spool's, a RAM tier's)."""
        fds = []
        for path in self.spool.claims.wake_paths():
            fds += self._open_fifo(path)
        return fds

    @staticmethod
    def _open_fifo(path):
        try:
            r = os.open(path, os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)
        except OSError:
            return []
        st = os.fstat(r)
        if not stat.S_ISFIFO(st.st_mode):
            os.close(r)
            return []
        # Our own write end keeps the FIFO from reporting EOF forever after
        # the first producer closed it.
        try:
            w = os.open(path, os.O_WRONLY | os.O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)
        except OSError:
            os.close(r)
            return []
        if os.fstat(w).st_ino != st.st_ino:     # swapped meanwhile
            os.close(r)
            os.close(w)
            return []
        return [r, w]


# Running a job ###############################################################
#
# A claimed job (or batch) started through its handler: an exec handler as a
# process fed on stdin, a Python function inline or in a thread, http and
# mqtt through their clients; its outcome collected.  An object the worker
# holds (Worker.runner).

class _Runner(object):
    """Starting handlers and collecting what they did.  It takes the
    scheduler's last claim (its slot, probe and lane; a batch's further
    jobs from its lane), finds the handler (`resolver`), asks the holds
    where a job goes, and hands every outcome to `finish`.  `runs` is the
    worker's list of what runs (processes and threads)."""

    def __init__(self, spool, log, options, delays, resolver, sched, holds,
                 finish, runs):
        self.spool, self.log, self.delays = spool, log, delays
        self.resolver, self.sched, self.holds = resolver, sched, holds
        self.finish, self.runs = finish, runs
        self.concurrency, self.timeout = options.concurrency, options.timeout
        self.lease, self.poll = options.lease, options.poll
        self.max_attempts, self.pass_env = options.max_attempts, options.pass_env
        self.me = None              # the worker's Identity (start)
        self._signal = self._pipe = None    # (start)
        self._main = False          # in the main thread: inline runs (start)
        self._inline = None         # the run called in this thread now
        self._timer = 0.0           # the SIGALRM tick armed now (0: none)
        self._null = None           # /dev/null, for exec handlers' stdout

    def start(self, me, signal, pipe, main):
        """At the start of Worker.run(): its identity, its signal module,
        the wake-up pipe a thread's end writes to, and whether this is
        the main thread (where SIGALRM times an inline run)."""
        self.me, self._signal, self._pipe, self._main = me, signal, pipe, main

    def stop_all(self):
        """The end of Worker.run(): what still runs killed (a thread is
        left to the process's exit), its descriptors closed, its jobs
        given back."""
        for run in list(self.runs):
            self._kill(run, 9)
            if run.proc is not None:
                for c in run.batch or [run.claim]:
                    self.spool.claims.end_handler(c.token)
            for fd in (run.stdin_fd, run.err_fd):
                if fd is not None:
                    os.close(fd)
            run.stdin_fd = run.err_fd = None
            self.finish._release(run)

    def close(self):
        if self._null is not None:
            os.close(self._null)
            self._null = None

    def _job_for_handler(self, c):
        job = dict(c.job)
        job["attempts"] = c.attempt
        if job.get("max_attempts") is None:
            job["max_attempts"] = c.max_attempts
        return job

    def _start(self, c):
        (slot, probe, lane), self.sched._taken = self.sched._taken, (None, None, None)
        rules = self.spool.rules(c.job["type"])
        handler, why = self.resolver.resolve(c.job["type"], rules)
        run = _Run(c, handler)
        run.slot, run.probe = slot, probe      # (_launch times the run)
        if handler is None:
            self.finish._hold(run, why)
            return
        if c.job["type"] in self.holds.missing:
            self.holds._unhold(c.job["type"])
        run.dest = handler.dest(c.job, self, run)
        if lane is not None and lane.type is not None and run.dest != lane.type:
            lane.dest = run.dest    # where this lane's jobs go, for its gate
        until = self.holds.until.get(run.dest)
        if until is not None and run.probe != run.dest \
                and self.spool.breaker.record(run.dest) is None:
            self.holds.until.pop(run.dest, None)     # released by another worker
            self.sched.dirty = True
            until = None
        if until is not None and run.probe != run.dest:
            new = None if until > _now() else self.spool.breaker.take_probe(
                run.dest, self.delays.probe, self.spool.waits_at(c.job, c.jid))
            if new is None:
                self.finish._park(run, max(until, _now() + self.poll), "destination %s "
                           "is held" % run.dest, lane=lane)
                return
            if new:
                self.holds.until[run.dest] = new
                run.probe = run.dest
            else:
                self.holds.until.pop(run.dest, None)
        if run.probe:
            self.log("probe", dest=run.dest, id=c.jid)
        n = rules.get("batch")
        if n and (run.probe or (lane is not None and lane.type == c.job["type"])):
            # A job of a batched type always goes in a batch's form, and
            # every batch is recorded, one job alone too: what went out
            # under one Idempotency-Key goes again under it (a probe sent
            # alone, then batched with others after a kill, was stored
            # twice by a receiver that de-duplicates).
            if run.probe:
                # A probe is ONE job, whatever the batch (SPEC 9): what a
                # failed batch's jobs share waits in their files, untouched.
                run.batch = [c]
            elif c.job.get("batch_of") and lane is not None:
                run.batch = self._claim_batch(lane.sub, c)
            elif c.job.get("batch_of"):
                run.batch = [c]
            else:
                run.batch = [c] + self._claim_more(
                    lane, c, n - 1, rules.get("batch_bytes"), handler)
            if not run.probe:
                self.spool.claims.batches.note(run.batch)
        self._launch(run)

    def _claim_batch(self, sub, first):
        """A batch that a dead worker had in flight, formed again (myq(1) batches):
        the same ids in the same order, so the same Idempotency-Key, of
        those that still wait in lane `sub`."""
        sp = self.spool
        ids = sp.claims.batches.ids(first.job["batch_of"])
        out = {first.jid: first}
        for jid in ids:
            if jid in out or not sp.claims.waits(sub + "/" + jid + ".json"):
                continue
            c = sp.claims.claim(jid + ".json", self.me, self.max_attempts, False, sub)
            if c is not None and c.job.get("batch_of") == first.job["batch_of"]:
                out[jid] = c
            elif c is not None:
                self.finish._release_one(c)
        order = dict((jid, i) for i, jid in enumerate(ids))
        return sorted(out.values(), key=lambda c: order.get(c.jid, -1))

    def _launch(self, run):
        """Run the handler, timed by its limit: it starts as it does
        (Handler.start: a process, a call here or in a thread)."""
        run.started = _mono()
        run.deadline = run.started + run.handler.time_limit(run.claim.job,
                                                            self.timeout)
        run.handler.start(self, run)

    def _claim_more(self, L, first, n, limit, handler):
        """A batch (myq(1) batches): up to n more ready jobs of lane L, within
        `limit` bytes, of the first's batch key (http: the same request);
        claimed together where the store can (Claims.bulk_claims: one
        statement), else one at a time."""
        out = []
        # (sizes only under a limit: a job's size is a stat or a query)
        size = len(dumps(first.job)) if limit else 0
        key = handler.batch_key(first.job, self)
        sp = self.spool
        bulk = sp.claims.bulk_claims
        stop = False
        while len(out) < n and not stop:
            heads, stop = self._batch_heads(L, n - len(out), limit, size, bulk)
            if not heads:
                break
            try:
                cs = sp.claims.claim_many([h[1] for h, _ in heads], self.me,
                                          self.max_attempts,
                                          [h[2] for h, _ in heads], L.sub) \
                    if bulk else [sp.claims.claim(heads[0][0][1], self.me,
                                                  self.max_attempts,
                                                  heads[0][0][2], L.sub)]
            except OSError as e:
                if not bulk:
                    raise
                self.finish._io_error("claim", e)
                if getattr(e, "give_back", None):
                    self.finish._give_back(e.give_back)
                cs, stop = getattr(e, "claims", None) or [], True
            back = False
            for (_, sz), c in zip(heads, cs):
                if c is None:
                    continue
                if back or (key is not None and handler.batch_key(
                        c.job, self) != key) or c.job.get("batch_of"):
                    job = dict(c.job)       # not for this request: back, as
                    if not back:            # it was, for the next batch
                        job["available_at"] = _now()
                    self.finish._move(c, job, "incoming", None, {})
                    back = stop = True      # (and those claimed after it)
                    continue
                size += sz
                out.append(c)
        return out

    def _batch_heads(self, L, n, limit, size, bulk):
        """The next jobs in lane L's line for a batch (one, or up to n with
        `bulk`), taken off its cache, within `limit` bytes past `size`:
        ([(head, its size)], whether the limit ended them)."""
        heads, names, sp = [], set(), self.spool
        while len(heads) < n and (bulk or not heads):
            if heads and not L.cache:
                break           # (no new pass while some wait to be claimed)
            head = self.sched._head(L, more=True)
            if head is None:
                break
            if head[1] in names:
                L.cache.pop()
                continue
            try:
                sz = sp.claims.size(L.sub, head[1]) if limit else 0
            except OSError:
                L.cache.pop()
                continue
            if limit and size + sz > limit:
                return heads, True
            L.cache.pop()
            size += sz
            heads.append((head, sz))
            names.add(head[1])
        return heads, False

    def _env(self, c):
        env = {}
        for k, v in os.environ.items():
            if k in ("PATH", "HOME", "LANG", "TZ") or k.startswith("LC_") \
                    or k in self.pass_env:
                env[k] = v
        env.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        env.update(MYQ_JOB_ID=c.jid, MYQ_JOB_TYPE=c.job["type"],
                   MYQ_ATTEMPT=str(c.attempt), MYQ_MAX_ATTEMPTS=str(c.max_attempts),
                   MYQ_SPOOL=self.spool.path,
                   # marks every process of this run, even one that left
                   # the handler's session: see kill_run()
                   MYQ_CLAIM=c.token)
        return env

    def _spawn(self, run, path):
        """Start an exec handler in its own session: the payload on a pipe
        to its stdin, its stderr on a pipe (for last_error), stdout to
        /dev/null.  The pipes are made here, not by Popen: it would wrap
        each in a file object (three syscalls apiece) used for nothing."""
        c = run.claim
        fds = []
        try:
            import subprocess           # here: it can fail with EMFILE too
            if self._null is None:
                self._null = os.open(os.devnull, os.O_WRONLY | O_CLOEXEC)
            fds.extend(os.pipe())       # close-on-exec; Popen dup2s them
            fds.extend(os.pipe())
            in_r, in_w, err_r, err_w = fds
            env = self._env(c)
            if run.batch:
                env["MYQ_BATCH"] = str(len(run.batch))
            proc = subprocess.Popen(
                [path], stdin=in_r, stdout=self._null, stderr=err_w,
                env=env, close_fds=True, start_new_session=True)
        except (OSError, ValueError, ImportError) as e:   # EMFILE: retry
            for fd in fds:
                os.close(fd)
            if getattr(e, "errno", None) in (errno.ENOENT, errno.ENOEXEC,
                                             errno.EACCES):
                self.finish._hold(run, _cannot_run(path, e))   # a deployment matter
            else:
                self.finish._finish(run, "retry", _cannot_run(path, e))
            return
        run.proc = proc
        # First of all: the handler's pid, for a reaper should we die now.
        start = proc_start(proc.pid)
        for one in run.batch or [c]:
            self.spool.claims.note_handler(one, proc.pid, start)
        os.close(in_r)
        os.close(err_w)
        run.stdin_fd, run.err_fd = in_w, err_r
        run.err = bytearray()
        os.set_blocking(in_w, False)
        os.set_blocking(err_r, False)
        if run.batch:       # one JSON object a line (myq(1) batches)
            run.stdin = memoryview(b"".join(json.dumps(
                {"id": one.jid, "type": one.job["type"], "payload":
                 one.job["payload"], "attempt": one.attempt}).encode("utf-8")
                + b"\n" for one in run.batch))
        else:
            run.stdin = memoryview(json.dumps(c.job["payload"]).encode("utf-8")
                                   + b"\n")
        self.runs.append(run)
        self._feed(run)

    def _feed(self, run):
        try:
            while run.stdin:
                n = os.write(run.stdin_fd, run.stdin)
                run.stdin = run.stdin[n:]
        except BlockingIOError:
            return
        except OSError:         # EPIPE: the handler did not read it all
            pass
        os.close(run.stdin_fd)
        run.stdin_fd = None

    def _read_err(self, run, final=False):
        try:
            while True:
                b = os.read(run.err_fd, 65536)
                if not b:
                    break
                run.err += b
                del run.err[:-STDERR_TAIL]
        except (BlockingIOError, InterruptedError):
            if not final:
                return
        except OSError:
            pass
        os.close(run.err_fd)
        run.err_fd = None

    def _kill(self, run, sig):
        """Signal everything the run's handler started (kill_run)."""
        if run.proc is not None:
            kill_run(run.proc.pid, sig, run.claim.token)

    def _collect(self):
        """Finish the runs that ended; enforce time limits."""
        now = _mono()
        for run in list(self.runs):
            if run.handler.spawned:
                rc = run.proc.poll()
                if rc is None:
                    if run.kill_at is not None and now >= run.kill_at:
                        self._kill(run, 9)
                        run.kill_at = now + 1.0
                    elif run.kill_at is None and now >= run.deadline:
                        run.timed_out = True
                        self._kill(run, 15)
                        run.kill_at = now + 2.0
                        self.log("timeout", id=run.claim.jid, pid=run.proc.pid)
                    continue
                if run.timed_out or run.released:
                    self._kill(run, 9)          # no descendant survives
                for c in run.batch or [run.claim]:
                    self.spool.claims.end_handler(c.token)
                if run.stdin_fd is not None:
                    os.close(run.stdin_fd)
                    run.stdin_fd = None
                if run.err_fd is not None:
                    self._read_err(run, final=True)
                self.runs.remove(run)
                self._exec_outcome(run, rc)
            else:
                if run.result is not None:
                    self.runs.remove(run)
                    if run.released:
                        self.finish._release(run)
                    elif run.timed_out and run.result[0] != "done":
                        # a built-in handler's time-out is its destination's
                        run.dest_fail = run.handler.remote
                        self.finish._finish(run, "retry", "timed out after %gs (%s)" % (
                            run.deadline - run.started, run.result[1]),
                            None, run.result[3] if len(run.result) > 3 else None)
                    else:
                        self.finish._finish(run, *run.result)
                elif run.released:
                    # A thread cannot be killed: the process exits next.
                    self.runs.remove(run)
                    _abort(run)
                    self.finish._release(run)
                elif now >= run.deadline and not run.timed_out:
                    # The job stays this run's until the thread returns (it
                    # is never in flight twice); an http request is cut now.
                    run.timed_out = True
                    self.log("timeout", id=run.claim.jid)
                    _abort(run)

    def _exec_outcome(self, run, rc):
        if run.released:
            self.finish._release(run)
            return
        tail = bytes(run.err).decode("utf-8", "replace").strip()
        if run.timed_out:
            why = "timed out after %gs (process group killed)" % (
                run.deadline - run.started)
            self.finish._finish(run, "retry", why + (": " + tail if tail else ""))
        elif rc == 0:
            self.finish._finish(run, "done")
        else:
            why = ("killed by signal %d" % -rc) if rc < 0 else ("exit %d" % rc)
            if tail:
                why += ": " + tail
            run.dest_fail = rc in (EX_TEMPFAIL, EX_OSERR)
            if run.dest_fail or not 64 <= rc <= 78:
                self.finish._finish(run, "retry", why)
            else:
                self.finish._finish(run, "dead", why)

    def _call(self, run):
        """Run an in-process handler; returns (outcome[, error, delay,
        traceback]).  A batch's function gets the list of its jobs; the
        built-in handlers send it their way (mqtt: one outcome a job)."""
        try:
            if run.batch:
                return run.handler.call_batch(self, run, [
                    self._job_for_handler(c) for c in run.batch])
            run.handler.call(self, run, self._job_for_handler(run.claim))
            return ("done",)
        except PermanentError as e:
            run.unsent = isinstance(e, _Unsent)
            return ("dead", _exc_text(e), None, _tb_tail(e))
        except RetryLater as e:
            run.dest_fail = True    # the destination's failure (myq(1) holds)
            run.retry_after = getattr(e, "retry_after", e.seconds)
            return ("retry", _exc_text(e), e.seconds)
        except Exception as e:
            return ("retry", _exc_text(e), None, _tb_tail(e))

    def _run_inline(self, run):
        """concurrency 1 in the main thread: call the handler right here;
        SIGALRM ticks heartbeat it and enforce the time limit (raising
        _Timeout into the handler) and the shutdown grace."""
        signal = self._signal
        tick = min(0.5, self.lease / 3, max(0.01, run.deadline - run.started))
        self._inline = run
        result = None
        try:
            if tick != self._timer:     # armed once for a run of jobs
                signal.setitimer(signal.ITIMER_REAL, tick, tick)
                self._timer = tick
            result = self._call(run)
            self._inline = None
        except _Timeout:
            # a built-in handler's time-out is its destination's (_collect)
            run.dest_fail = getattr(run.handler, "remote", False)
            result = ("retry", "timed out after %gs (interrupted)"
                      % (run.deadline - run.started))
        except _Shutdown:
            run.released = True
        finally:
            self._inline = None
        if run.released:
            self.finish._release(run)
        else:
            if run.timed_out:
                self.log("timeout", id=run.claim.jid)
            self.finish._finish(run, *result)

    def _run_thread(self, run):
        import threading

        def main():
            run.result = self._call(run)
            try:
                os.write(self._pipe[1], b"t")
            except OSError:
                pass

        run.thread = threading.Thread(target=main, name="myq-" + run.claim.jid)
        run.thread.daemon = True
        self.runs.append(run)
        run.thread.start()

    def _start_split(self):
        """Start the first half of a split batch waiting (_finish) when a
        slot of the worker and of its type is free; False when none may."""
        part, handler = self.finish._splits[0]
        t = part[0].job["type"]
        n = self.spool.rules(t).get("concurrency")
        slot = None
        if n is not None:
            if sum(1 for r in self.runs if r.claim.job["type"] == t) >= n:
                return False
            slot = self.sched._slot(t, n)
            if slot is None:
                return False
        del self.finish._splits[0]
        new = _Run(part[0], handler)
        new.batch, new.split, new.slot = part, True, slot
        new.dest = handler.dest(part[0].job, self)  # (its failure: _dest_failed)
        self._launch(new)
        return True


# Holds, the worker's side ####################################################
#
# The records are the spool's (Breaker); this is what a worker does with
# them: a missing handler holds its type for this worker, a failing
# destination is held for all, probes take the held jobs in turn, and a
# release makes them ready.  An object the worker holds (Worker.holds).

class _Holds(object):
    """What is held for this worker: `until`, every held destination (a
    type held for its missing handler is its own) -> the wall time of its
    next probe, this worker's and the spool's records; `missing`, the
    types held here for want of a handler -> (why, delay, until,
    recorded).  It asks `resolver` which handlers there are, and tells
    `sched` (the Worker sets it: the scheduler reads these holds) when a
    release makes held jobs ready."""

    LANED = 64      # held types that get a lane of their own (_hold)

    def __init__(self, spool, log, delays, resolver):
        self.spool, self.log, self.delays = spool, log, delays
        self.resolver = resolver
        self.sched = None           # (Worker.__init__, once both are made)
        self.until = _HoldTimes()   # held destination -> until (wall clock)
        self.missing = {}           # held type -> (why, delay, until, recorded)
        self.missing_changed = False
        self._holds_from = None     # the spool.breaker.records() `until` came from
        self._lack = {}             # type -> no handler here (_lacks)
        self._handlers_seen, self._handlers_next = None, 0.0
        self._streaky = set()       # destinations with failures in a row
        self._safe_names = {}       # destination -> its name as a file
        self._pol_seen = None       # the policy _check_holds last saw
        self._holds_sig = None      # what _load_holds last made `until` of

    def _write_hold(self, dest, why, until, **extra):
        rec = {"dest": dest, "why": why, "since": round(_now(), 3),
               "until": round(until, 3), "probes": 0, "boot": boot_id()}
        rec.update(extra)
        try:
            self.spool.breaker.write(rec)
        except OSError as e:    # the local hold stands; say why it is not on disk
            self.log("error", during="breaker", dest=dest,
                     error=e.strerror or str(e))

    def _unhold(self, t):
        """The handler of a held type is there: release the hold; the jobs
        it put back are ready now."""
        self.missing.pop(t, None)
        self.until.pop(t, None)
        self._lack.pop(t, None)
        self.missing_changed = True
        self.spool.breaker.release(t)
        self.sched.dirty = True
        self.sched.next_due = None
        self.log("release", dest=t)

    def _load_holds(self, locks=None):
        """The holds of every worker of the spool (locks/held/); a hold
        from another boot has its probe due at once.  A missing handler's
        hold holds only the workers that lack the handler (myq(1) holds): this
        one's own (`missing`), and another's when this one lacks it too.
        (`locks`: locks/'s stat, just taken: Breaker.records.)"""
        held = self.spool.breaker.records(locks)
        if held is self._holds_from and not self.missing_changed:
            return                  # (the same records: nothing to learn)
        now, boot = _now(), boot_id()
        sig = self._holds_sig_of(held, boot)
        if sig == self._holds_sig and not self.missing_changed:
            # (records that changed only where this worker's own holds
            # win: a held type's probe; not a pass over all of them)
            self._holds_from = held
            self._streaky = self.spool.breaker.streaky()
            return
        self._holds_from, self.missing_changed = held, False
        self._holds_sig = sig
        holds = {}
        for h in held:
            dest = h["dest"]
            if h.get("missing") and dest not in self.missing \
                    and not self._lacks(dest):
                continue
            holds[dest] = h["until"] if h.get("boot") == boot \
                else min(h["until"], now)
        for t, v in self.missing.items():
            holds[t] = v[2]
        self.until = _HoldTimes(holds)
        self.spool.set_lane_types(sorted(set(
            [h["dest"] for h in held if h.get("missing")]
            + [t for t, v in self.missing.items() if v[3]]))[:self.LANED])
        self._streaky = self.spool.breaker.streaky()

    def _holds_sig_of(self, records, boot):
        """What _load_holds makes of the records besides this worker's own
        holds (whose times are its own): equal, the same holds."""
        own = self.missing
        return [(h["dest"], h.get("missing")) if h["dest"] in own else
                (h["dest"], h.get("missing"), h["until"], h.get("boot") == boot,
                 bool(h.get("missing")) and self._lacks(h["dest"]))
                for h in records]

    def _lacks(self, type):
        """Has this worker no handler for `type`?  (Asked again when the
        handlers changed: _check_holds.)"""
        lack = self._lack.get(type)
        if lack is None:
            if len(self._lack) > 4096:
                self._lack.clear()
            lack = self._lack[type] = self.resolver.resolve(type)[0] is None
        return lack

    def _handlers_key(self):
        if not self.resolver.handlers_dir:
            return None
        try:
            st = os.stat(self.resolver.handlers_dir)
            return (st.st_mtime_ns, st.st_ino)
        except OSError:
            return None

    def _check_holds(self, looked=None):
        """At each poll tick: the holds on disk (other workers' too), and
        has the handler of a held type appeared?  (Looked for when the
        handlers directory changed, or once a minute: many held types cost
        a poll no more than one.  `looked`: the tick's stats, _Door.recheck.)"""
        before = self.until
        self._load_holds((looked or {}).get("locks"))
        if before is not self.until and set(before) - set(self.until):
            self.sched.dirty = True       # released by another worker
        pol = self.spool.policy()
        if pol is not self._pol_seen:
            # a type's `url` changed: a held destination no type names
            # any more ends, its jobs ready to go where their type goes now
            if self._pol_seen is not None:
                for d in _url_dests(self._pol_seen) - _url_dests(pol):
                    if d in self.until:
                        self._unname(d)
            self._pol_seen = pol
            self.sched._failover_lanes()
        elif before is not self.until:
            self.sched._failover_lanes()
        key, now = self._handlers_key(), _mono()
        if self.missing and (key != self._handlers_seen or now >= self._handlers_next):
            self._handlers_seen, self._handlers_next = key, now + 60.0
            self._lack.clear()
            for t in list(self.missing):
                if self.resolver.resolve(t)[0] is not None:
                    self._unhold(t)

    def _pick_dest(self, dests, job, run=None):
        """Where a start of `job` goes: the first of `dests` not held; a
        held one whose probe is due takes this start as its probe (run.
        probe), so that a destination that is back gets new starts again;
        all held: the one due first (the start then waits for it).  A
        probe of one that is no longer the type's (`myq policy` changed
        its `url`) is no probe (_stale_probe)."""
        now = _now()
        if run is not None and run.probe and run.probe not in dests:
            self._stale_probe(run.probe)
            run.probe = None
        if run is not None and run.probe in dests:
            # a lane's probe: unless one before it is free now (released
            # meanwhile), then that one, and no probe
            free = [d for d in dests[:dests.index(run.probe)]
                    if d not in self.until]
            if not free:
                return run.probe
            run.probe = None
            return free[0]
        for d in dests:
            until = self.until.get(d)
            if until is None:
                return d
            if until > now or run is None or run.probe:
                continue
            new = self.spool.breaker.take_probe(
                d, self.delays.probe, self.spool.waits_at(job, run.claim.jid))
            if new == 0.0:
                self.until.pop(d, None)        # released meanwhile
                self.sched.dirty = True
                return d
            if new:
                self.until[d] = new
                run.probe = d
                return d
        return min(dests, key=lambda d: self.until.get(d, 0))

    def _stale_probe(self, dest):
        """A probe of held `dest` took a job whose type no longer goes
        there: unless a type's `url` or --mqtt still names it, the hold
        ends (its jobs go where their type goes now, at once), rather
        than be probed with jobs that never go there, held for ever."""
        if dest not in _url_dests(self.spool.policy()):
            self._unname(dest)

    def _unname(self, dest):
        """Held `dest` is no type's `url` any more (myq(1) failover): the
        hold ends, unless it is not an http server (an --mqtt broker).
        (Jobs that name it in their own payload find out again: `breaker`
        failures.)"""
        if not dest.startswith(("http://", "https://")):
            return      # (a broker: another worker's --mqtt may name it)
        self.spool.breaker.release(dest)
        self.until.pop(dest, None)
        self.sched.dirty = True
        self.log("release", dest=dest, why="no type goes there")

    def _dests_of_type(self, type):
        """A type's destinations in order when it has more than one: its
        policy's `url`, or --mqtt's brokers for an mqtt type; else None."""
        rules = self.spool.rules(type)
        if rules.get("url"):
            return _dests_of(rules["url"], type)
        mqtt = self.resolver.mqtt       # (None: no mqtt type registered)
        if mqtt is not None and len(mqtt.clients) > 1 \
                and self.resolver.resolve(type, rules)[0] is mqtt:
            return [c.dest for c in mqtt.clients]
        return None

    def _safe(self, dest):
        safe = self._safe_names.get(dest)
        if safe is None:
            if len(self._safe_names) > 1000:
                self._safe_names.clear()
            safe = self._safe_names[dest] = _safe_dest(dest)
        return safe

    def _take_holds(self):
        """At the start: the missing-handler holds on disk.  This worker's
        own where it lacks the handler too; released where it has it,
        unless the worker that wrote it lives (and lacks it)."""
        sp = self.spool
        for h in sp.breaker.records():
            if not h.get("missing"):
                continue
            if self._lacks(h["dest"]):
                self.missing[h["dest"]] = (h.get("why"), self.delays.base,
                                         h["until"], True)
            elif not (_is_num(h.get("pid")) and proc_start(
                    int(h["pid"]), living=True) == h.get("start")):
                sp.breaker.release(h["dest"])
                self.log("release", dest=h["dest"])
        self._load_holds()

    def _dest_failed(self, run, delay, error):
        """The circuit breaker (myq(1) holds) after a destination failure (of a
        batch: one failure): (does it count an attempt, the delay before
        the job may run again)."""
        sp, c = self.spool, run.claim
        started, distinct, total = sp.breaker.streak(run.dest, c.jid)
        self._streaky.add(self._safe(run.dest))
        delay = self.delays.dest(run.retry_after, total)
        until = self.until.get(run.dest)
        if until is not None:
            rec = sp.breaker.record(run.dest)      # (released by another worker?)
            if rec is None:
                self.until.pop(run.dest, None)
                until = None
            else:
                until = rec["until"]
        if until is not None:
            # held: it waits with the others; the probes take them in turn
            return False, max(0.0, until - _now()) + self.delays.parked()
        n = sp.rules(c.job["type"]).get("breaker", 3)
        if n and distinct >= n:
            d = delay
            until = _now() + d
            self.until[run.dest] = until
            self._write_hold(run.dest, "%d jobs failed in a row: %s" % (
                distinct, _clip(error or "failed", 200)), until)
            self.log("hold", dest=run.dest, until=iso(until), failures=distinct)
            return started and not run.probe, d
        return started and not run.probe, delay


# The worker ##################################################################

class WorkerOptions(object):
    """What a worker is told, checked and in its types once: the options of
    `myq worker` (myq(1) PYTHON API: the keywords of Worker()), the command line's
    from its flags and MYQ_* variables (_worker_from), the Python API's
    from Worker(spool, **keywords).  A Worker copies them to attributes
    of the same names (self.lease, ...: no lookup through here on the hot
    paths); `module` is the --module file's path, `parent` the
    supervisor's pid (stop when it is gone), `textfile` the directory of
    --textfile."""

    KEYS = (("handlers_dir", None), ("module", None), ("concurrency", 1),
            ("lease", 60.0), ("timeout", 300.0), ("max_attempts", 5),
            ("backoff_base", 5.0), ("backoff_max", 3600.0), ("jitter", 0.1),
            ("poll", 1.0), ("probe_max", 30.0), ("stats_interval", 60.0),
            ("grace", 5.0), ("pass_env", ()), ("http_headers", None),
            ("http_ca", None), ("scan_cache", 2048), ("reap_interval", None),
            ("prune_interval", 60.0), ("parent", None), ("textfile", None),
            ("mqtt", None), ("mqtt_password_file", None),
            ("mqtt_client_id", None), ("mqtt_ca", None), ("mqtt_cert", None),
            ("mqtt_key", None), ("uplink_rate", None))
    __slots__ = tuple(k for k, _ in KEYS)

    def __init__(self, **keywords):
        for k, default in self.KEYS:
            setattr(self, k, keywords.pop(k, default))
        if keywords:
            raise TypeError("unknown worker option(s): %s"
                            % ", ".join(sorted(keywords)))
        if self.concurrency < 1:
            raise UsageError("--concurrency must be at least 1")
        self.concurrency = int(self.concurrency)
        self.lease, self.timeout = float(self.lease), float(self.timeout)
        self.max_attempts = int(self.max_attempts)
        self.backoff_base = float(self.backoff_base)
        self.backoff_max = float(self.backoff_max)
        self.probe_max = float(self.probe_max)
        self.jitter, self.poll = float(self.jitter), max(0.01, float(self.poll))
        self.stats_interval = float(self.stats_interval)
        self.grace = float(self.grace)
        self.pass_env = list(self.pass_env or ())
        self.http_headers = dict(self.http_headers or {})
        self.scan_cache = max(1, int(self.scan_cache))
        self.reap_interval = self.reap_interval or max(
            0.5, min(self.lease / 2, 10.0))


class _Finishing(object):
    """A claim's end, as its run's outcome says: done/ (group-committed),
    a retry, a dead letter, a release; a job of a held type or destination
    put back, no attempt counted; a failed batch split in halves
    (`_splits`, which the runner starts); a step that failed on I/O tried
    again after a pause (`_stuck`).  It books a destination's failure
    with `holds` and tells `sched` which lane a job went back to.  An
    object the worker holds (Worker.finish)."""

    def __init__(self, spool, log, delays, sched, holds):
        self.spool, self.log, self.delays = spool, log, delays
        self.sched, self.holds = sched, holds
        self.me = None              # the worker's Identity (Worker.run)
        self._splits = []   # halves of failed batches, to start: (claims, handler)
        self._stuck = []            # finishes that failed on I/O: callables
        self._pending = 0           # done/ renames not yet committed
        self._pending_since = 0.0
        self._io_pause_until = 0.0
        self._io_backoff = 0.5

    def _finish(self, run, outcome, error=None, delay=None, tb=None):
        """The run's outcome: "done", "retry" (or "dead" once the attempts
        are spent) or "dead", with the error, a delay (RetryLater) and a
        Python handler's traceback.  A batch's outcome is every job's; a
        batch that fails for good is split in halves, run at once
        (myq(1) batches); "each" carries one outcome per job (mqtt)."""
        self._free(run)
        if outcome == "done" and run.batch is None and not run.failovers \
                and not self.holds.until and not self.holds._streaky:
            # (the usual success: one job, no hold to release)
            self._finish_one(run, run.claim, outcome, error, delay, tb, True)
            return
        if run.failovers:
            self._failed_over(run)      # (myq(1) policy `url`)
        if outcome == "each":
            # (one outcome a job, mqtt's: nothing of the batch is kept, so
            # what goes again is batched afresh, not one at a time)
            self.spool.claims.batches.end(run.batch[0].batch)
            for c, res in zip(run.batch, error):
                c.batch = None
                one = _Run(c, run.handler)
                one.started, one.dest, one.probe = run.started, run.dest, run.probe
                if res is None:
                    self._finish(one, "done")
                else:
                    one.dest_fail = isinstance(res, RetryLater)
                    one.retry_after = getattr(res, "retry_after", None)
                    one.unsent = isinstance(res, _Unsent)
                    self._finish(one, "dead" if isinstance(res, PermanentError)
                                 else "retry", _exc_text(res),
                                 getattr(res, "seconds", None))
            return
        counts = True
        if outcome == "retry" and run.dest_fail:
            counts, delay = self.holds._dest_failed(run, delay, error)
        elif run.unsent:
            pass    # the job's own request never left: no answer came
        elif (outcome == "done" or outcome == "dead") and run.dest and (
                run.dest in self.holds.until or self.holds._streaky and
                self.holds._safe(run.dest) in self.holds._streaky):
            # an answer that is not the destination's failure (myq(1) holds)
            self.holds._streaky.discard(self.holds._safe(run.dest))
            if self.spool.breaker.dest_ok(run.dest) or run.dest in self.holds.until:
                self.holds.until.pop(run.dest, None)
                self.sched.dirty = True
                self.log("release", dest=run.dest, id=run.claim.jid)
        claims = run.batch or [run.claim]
        if len(claims) > 1 and (outcome == "dead" or (
                outcome == "retry" and not run.dest_fail and
                any(c.attempt >= c.max_attempts for c in claims))):
            half = len(claims) // 2
            self.log("split", type=run.claim.job["type"], jobs=len(claims),
                     error=_clip(error or "failed", 200))
            # Each half is first in line, as its own group, and starts as a
            # slot frees (_start_split): a split never runs more at once
            # than --concurrency and the type's concurrency allow.
            self.spool.claims.batches.end(claims[0].batch)
            for c in claims:            # (its halves are groups of their own)
                c.batch = None
                c.job.pop("batch_of", None)
            self._splits[:0] = [(part, run.handler)
                                for part in (claims[:half], claims[half:])]
            return
        if len(claims) > 1 and outcome == "retry" and delay is None:
            # one wait for the batch, not a jittered one a job: it comes
            # due as one, and goes again as that batch (myq(1) batches)
            delay = self.delays.retry(max(c.attempt for c in claims))
        oks = self._complete_many(claims) if outcome == "done" and \
            len(claims) > 1 else None
        for c in claims:
            self._finish_one(run, c, outcome, error, delay, tb, counts,
                             oks and oks.get(c.token))
        if run.batch:
            if outcome == "retry" and (counts or claims[0].batch ==
                                       claims[0].job.get("batch_of")):
                self.spool.claims.batches.keep(claims[0].batch)
            else:
                self.spool.claims.batches.end(claims[0].batch)

    def _finish_one(self, run, c, outcome, error, delay, tb, counts, ok=None):
        ms = int((_mono() - run.started) * 1000)
        kv = {"id": c.jid, "type": c.job["type"], "attempt": c.attempt, "ms": ms}
        if run.batch:
            kv["batch"] = len(run.batch)
        if outcome == "done":
            self._complete(c, kv, ok)
            return
        job = dict(c.job)
        job["attempts"] = c.attempt if counts else c.attempt - 1
        note_failure(job, c.attempt, error, tb)
        error = job["last_error"]
        if c.batch and outcome == "retry":
            job["batch_of"] = c.batch       # it goes again as that batch
        else:
            job.pop("batch_of", None)
        if not counts:
            # The destination's failure inside a streak: no attempt spent.
            self._wait_again(run, c, delay, error, kv)
            return
        if outcome == "retry" and c.attempt >= c.max_attempts:
            outcome = "dead"
        if outcome == "dead":
            job["failed_at"] = _now()
            kv["error"] = error
            self._move(c, job, "dlq", "dead", kv)
            return
        d = self.delays.retry(c.attempt, delay)
        now = _now()
        job["available_at"] = now + d
        kv["retry_in"] = round(d, 3)
        kv["error"] = error
        until = None
        if run.dest_fail:       # the release makes it ready at once
            self.spool.breaker.note_job(run.dest, self.spool.waits_at(job, c.jid))
            job["available_at"], until = now, now + d   # see Spool._move_on
        self._move(c, job, "incoming", "retry", kv, until)

    def _release(self, run):
        """Shutdown: back to incoming/, ready now, the attempt not counted."""
        self._free(run)
        for c in run.batch or [run.claim]:
            self._release_one(c)
        if run.batch:
            self.spool.claims.batches.keep(run.batch[0].batch)

    def _release_splits(self):
        """Stopping: the halves not started go back, ready now."""
        splits, self._splits = self._splits, []
        for part, _ in splits:
            for c in part:
                self._release_one(c)

    def _release_one(self, c):
        job = dict(c.job)
        job["available_at"] = _now()
        if c.batch:
            job["batch_of"] = c.batch       # it goes again as that batch
        self._move(c, job, "incoming", "released", {"id": c.jid, "type": job["type"]})

    def _complete_many(self, claims):
        """A batch's successes at once, where the store can (one
        transaction): {token: done or not}, or None: one at a time (also
        when it failed: each is tried on its own, and says so)."""
        try:
            oks = self.spool.complete_many(claims)  # (counted: locks/rates)
        except OSError:
            return None
        return oks and dict(zip([c.token for c in claims], oks))

    def _complete(self, c, kv, ok=None):
        """Success: done/ (fsync'd by the next group commit), or what
        _complete_many said of it (`ok`).  An I/O error leaves it to
        _retry_stuck."""
        try:
            if ok is None:
                ok = self.spool.complete(c)     # (counted: locks/rates)
        except OSError as e:
            self._io_error("finish", e, id=c.jid)
            self._stuck.append(lambda: self._complete(c, kv))
            return
        if ok:
            if not self._pending:
                self._pending_since = _mono()
            self._pending += 1
            if self.log.__class__ is Log and len(kv) == 4 \
                    and kv["attempt"].__class__ is int:
                self.log.done(kv["id"], kv["type"], kv["attempt"], kv["ms"])
            else:
                self.log("done", **kv)  # (_logged's way when ok)
            return
        self._logged(ok, c, "done", kv)

    def _move(self, c, job, dest, event, kv, until=None):
        """A retry or a release (dest incoming) or a dead letter (dlq)."""
        pre = until and self.spool.claims.change_key()[0]   # (_dirty_home)
        try:
            ok = self.spool.claims.move_on(c, job, dest, self.me, until=until)
        except OSError as e:
            self._io_error("finish", e, id=c.jid)
            self._stuck.append(lambda: self._move(c, job, dest, event, kv,
                                                  until))
            return
        if ok and dest == "incoming":
            self.sched._dirty_home(job, until, pre)
            if event == "retry":
                self.spool._note_retry()
        self._logged(ok, c, event, kv)

    def _logged(self, ok, c, event, kv):
        if ok:
            if event:
                self.log(event, **kv)
            return
        try:
            self.spool.locate(c.jid)
            why = ("the claim was taken back (this worker was considered "
                   "dead or hung)")
        except MyqError:
            why = "the job was deleted meanwhile (myq delete --force)"
        self.log("lost", id=c.jid, why=why)

    def _retry_stuck(self, final=False):
        """Finishes that failed on I/O, tried again after the pause."""
        if not final and _mono() < self._io_pause_until:
            return
        stuck, self._stuck = self._stuck, []
        for again in stuck:
            again()

    def _io_error(self, during, e, **kv):
        self.log("error", during=during, error=e.strerror or str(e), **kv)
        self._io_pause_until = _mono() + self._io_backoff
        self._io_backoff = min(30.0, self._io_backoff * 2)

    def _commit(self, final=False):
        """Group commit: one fsync of done/ for many jobs (a done file is
        also the job's idempotency record; a lost rename runs it again, as
        at-least-once allows)."""
        if not self._pending and not self.spool.claims.owed:
            return
        try:
            self.spool.claims.commit()
            self._pending = 0
            self._io_backoff = 0.5
        except OSError as e:
            self._io_error("commit", e)

    def _give_back(self, back):
        """A claim whose admission failed on I/O: ready again at a try
        after the pause (_retry_stuck), until one succeeds."""
        def again():
            try:
                back()
            except OSError as e:
                self._io_error("claim", e)
                self._stuck.append(again)
        self._stuck.append(again)

    def _hold(self, run, why):
        """A missing or unstartable handler: its type is held at once (a
        deployment not finished); the job waits, no attempt counted."""
        c = run.claim
        t = run.dest = c.job["type"]
        old = self.holds.missing.get(t)
        delay = self.delays.held_type(old[1] if old else None)
        until = _now() + delay
        recorded = old[3] if old else len(self.holds.missing) < 1024
        self.holds.missing[t] = (why, delay, until, recorded)
        self.holds.until[t] = until
        # (held again: what _load_holds makes of the holds is the same; a
        # pass over all of them at each probe was an idle worker's work)
        self.holds.missing_changed = self.holds.missing_changed or old is None
        if old is None:
            self.log("hold", dest=t, why=why, until=iso(until))
        # The record (for stats, check and a restart) is written once a
        # hold, not at each job put back, and for the first 1,024 held
        # types only: a flood of unknown types neither writes the flash
        # full nor makes every poll read thousands of records.  Other
        # workers are not held by it unless they lack the handler too; one
        # that has it releases it (_load_holds), and this worker's next
        # probe, a job it found still without a handler, writes it again:
        # the jobs it put back are never left to wait out their time.
        if recorded and (old is None or self.spool.breaker.record(t) is None):
            self.holds._write_hold(t, why, until, missing=True, pid=self.me.pid,
                             start=self.me.start)
        # Back into its type's lane, ready: this worker does not look there
        # until its probe; a worker that has the handler takes it now.  (A
        # lane is a directory and a descriptor: for the first LANED types
        # held; the others wait their time in incoming/, see _park.)
        lanes = self.spool.lane_types
        if t not in lanes and len(lanes) >= self.holds.LANED:
            self._park(run, until, why, noted=recorded)
            return
        self.spool.set_lane_types(lanes | {t})
        c = run.claim
        if old is not None and c.trailers is not None \
                and c.job.get("last_error") == "held: " + why:
            self._held_again(run)
            return
        job = dict(c.job)
        job["available_at"] = _now()
        job["last_error"] = "held: " + why
        self._free(run)
        self._move(c, job, "incoming", None, {})

    def _held_again(self, run):
        """A probe of a held type found its handler still missing: its job
        waits again in its lane as it was, not written again (SPEC 9: a
        hold writes nothing per waiting job; a new version, fsync'd, at
        each probe of 64 lanes, 5 s, 10 s, ... apart, was most of an idle
        worker's work); only its lane is read again (_dirty_home)."""
        c = run.claim
        self._free(run)
        try:
            ok = self.spool.claims.put_back(c, _now())
        except OSError as e:
            self._io_error("finish", e, id=c.jid)
            self._stuck.append(lambda: self._put_back(c, None, None, {}))
            return
        if ok:
            self.sched._dirty_home(c.job)
        self._logged(ok, c, None, {})

    def _park(self, run, until, why, noted=True, lane=None):
        """Put a job of a held destination back, no attempt counted, until
        the hold's next probe; the release makes it ready at once.  (Not
        `noted`: a held type past the cap of records waits its own time.)
        Of a type's own lane (`lane`, whose gate the hold now closes: its
        dest is known), it goes back unchanged, in its place."""
        c = run.claim
        self._free(run)
        if lane is not None and lane.type == c.job["type"] and \
                (lane.dest or lane.type) == run.dest and \
                self.spool.home(c.job) == lane.sub:
            self._put_back(c, c.mtime, None, {})
            return
        if not noted:
            job = dict(c.job)
            job["available_at"] = _now()        # see Spool._move_on
            job["last_error"] = "held: " + why
            self._move(c, job, "incoming", None, {}, until + self.delays.parked())
            return
        self.spool.breaker.note_job(run.dest or c.job["type"],
                                    self.spool.waits_at(c.job, c.jid))
        self._put_back(c, until + self.delays.parked(), None, {})

    def _wait_again(self, run, c, delay, error, kv):
        """A destination's failure inside a streak (no attempt spent): the
        job waits again as it was, its file or row not written (SPEC 9: a
        hold writes nothing per waiting job).  Held, in its type's lane,
        whose gate the hold keeps shut: ready at once, behind the others,
        so that the next probe is another job and the release touches
        nothing.  Else due after `delay`, or at the release, which the next
        probe may make (it waits longer only for a release that never
        comes)."""
        d = delay if delay is not None else self.delays.retry(max(1, c.attempt))
        now = _now()
        until = self.holds.until.get(run.dest)
        shown = min(d, max(0.0, until - now)) if until else d
        kv.update(retry_in=round(shown, 3), error=error, counted=False)
        if until is not None and self.spool.home(c.job) != "incoming":
            self._put_back(c, now, "retry", kv)
            return
        self.spool.breaker.note_job(run.dest, self.spool.waits_at(c.job, c.jid))
        self._put_back(c, now + d, "retry", kv)

    def _put_back(self, c, mtime, event, kv):
        """A claim of a held (or failing) destination waits again as it
        was, due at `mtime`: its file or row is not written again (SPEC 9:
        a hold writes nothing per waiting job; myq-spool(5) STATES)."""
        if c.trailers is None:      # a lease line follows it: a new version
            self._move(c, dict(c.job), "incoming", event, kv, mtime or _now())
            return
        try:
            ok = self.spool.claims.put_back(c, mtime if mtime is not None
                                            else _now())
        except OSError as e:
            self._io_error("finish", e, id=c.jid)
            self._stuck.append(lambda: self._put_back(c, mtime, event, kv))
            return
        if ok:
            self.sched.dirty = True
        self._logged(ok, c, event, kv)

    def _free(self, run):
        if run.slot is not None:
            os.close(run.slot)
            run.slot = None

    def _failed_over(self, run):
        """The destinations a run passed over after their failure: each
        one the breaker's failure (its streak, its hold), the job's
        attempts untouched; its type's lanes go where the run went."""
        for dest, e in run.failovers:
            one = _Run(run.claim, run.handler)
            one.dest, one.dest_fail = dest, True
            one.probe = run.probe if run.probe == dest else None
            one.retry_after = getattr(e, "retry_after", e.seconds)
            self.holds._dest_failed(one, None, _exc_text(e))
            self.log("failover", id=run.claim.jid, dest=dest, to=run.dest,
                     error=_clip(_exc_text(e), 200))
        run.failovers = []
        for L in self.sched._lanes:
            if L.type == run.claim.job["type"]:
                L.dest = run.dest


class Worker(object):
    """Claims ready jobs and runs them through their handlers: the loop,
    its signals and timers, the heartbeat.  It holds its parts, each with
    its own state: `resolver` (the handlers by type, the http pool, the
    brokers), `holds` (what is held), `sched` (which job next), `finish`
    (a claim's end) and `runner` (a handler started, its outcome)."""

    def __init__(self, spool, handlers=None, handlers_dir=None, module=None,
                 options=None, log=None, **keywords):
        """`options`: a WorkerOptions; else they are made of the keywords
        that are WorkerOptions' (myq(1) PYTHON API), the others are the Spool's."""
        mine = dict((k, keywords.pop(k)) for k, _ in WorkerOptions.KEYS
                    if k in keywords)
        if options is None:
            options = WorkerOptions(handlers_dir=handlers_dir, module=module,
                                    **mine)
        elif mine or handlers_dir or module:
            raise TypeError("Worker(): give options=WorkerOptions(...) or "
                            "its keywords, not both")
        self.options = o = options
        for k, _ in WorkerOptions.KEYS:
            setattr(self, k, getattr(o, k))
        self.log = log = log or Log()
        if isinstance(spool, Spool):
            self.spool = sp = spool.store
        elif isinstance(spool, Store):
            self.spool = sp = spool
        else:
            self.spool = sp = open_store(spool, **keywords)
        sp.log = log
        self.handlers = dict(handlers or {})
        self.module = load_module(o.module) if o.module else None
        if self.module is not None:
            for k, v in _module_types(self.module).items():
                self.handlers.setdefault(k, v)
        self.delays = Backoff(o.backoff_base, o.backoff_max, o.probe_max,
                              o.jitter)
        self.runs = []              # what runs now: processes, threads
        # The parts, each given what it works with (holds and scheduler
        # each need the other: the scheduler reads the holds, a release
        # makes its lanes ready).
        self.resolver = _Resolver(sp, o, self.handlers, self.module)
        self.holds = _Holds(sp, log, self.delays, self.resolver)
        self.sched = _Scheduler(sp, log, o, self.delays, self.holds,
                                self.runs, self._tick)
        self.holds.sched = self.sched
        self.finish = _Finishing(sp, log, self.delays, self.sched, self.holds)
        self.runner = _Runner(sp, log, o, self.delays, self.resolver,
                              self.sched, self.holds, self.finish, self.runs)
        self.stopping = self.hard_stop = False
        self.stop_deadline = None
        self.me = None
        self._low_logged = False
        self._next_guard = 0.0      # the disk guard's next look (_guard)
        self._rest = False          # at rest: no claim to look for (_at_rest)
        self._next_beat = float("inf")     # set when run() starts
        self._beat_seq = -1         # the claims made at the last beat (me.seq)
        # set when run() starts: its modules, pipe, thread, supervisor
        self._select = self._signal = self._pipe = self._parent = None
        self._main = False
        # the loop's timers (_loop sets them, on the monotonic clock)
        self._next_stats = self._next_reap = self._next_poll = float("inf")
        self._next_prune = self._next_full_prune = float("inf")
        self._next_settle = None    # the store's next own turn (settle)
        self._started = 0           # jobs started by this run()

    @property
    def http_pool(self):
        """The kept http connections (HttpHandler's)."""
        return self.resolver.http.pool

    def mqtt_batch(self, jobs, run=None, client=None, share=None):
        """MqttHandler.batch: `mqtt` jobs published through the worker's
        broker, one outcome per job."""
        return self.resolver.mqtt.batch(jobs, run, client, share)

    # The loop ----------------------------------------------------------------

    def run(self, once=False, drain=False):
        """Work until stopped (or, with once/drain, until that is done)."""
        import select
        import signal
        import threading
        self._select, self._signal = select, signal
        sp = self.spool
        sp.require()
        try:
            sp.check_filesystem()
        except OSError as e:
            # (a full disk: the SQLite store's log index is made at the
            # first open after the last close; the reserve is for that)
            if not _space_error(e) or not sp.make_space():
                raise
            sp.check_filesystem()
        sp.policies._pol_next = 0.0
        sp.require_policy()         # (never the types' rules dropped unsaid)
        sp.claims.start()
        sp.policies.pol_polled = True   # re-read at each poll tick, not per job
        self.me = Identity(sp, self.lease, log=getattr(self.log, "dest", None))
        mqtt = self.resolver.mqtt       # its brokers: a topic's destinations
        self.me.mqtt = mqtt and [c.dest for c in mqtt.clients if c is not None]
        self._pipe = os.pipe()
        for fd in self._pipe:
            os.set_blocking(fd, False)
        self._main = threading.current_thread() is threading.main_thread()
        saved = self._install_signals() if self._main else None
        try:
            try:
                self.me.register()
            except OSError as e:
                # A worker starts on a full disk (myq(1) guards): room for its
                # record from done/ (or old idempotency records) first.
                if not _space_error(e) or not sp.make_space():
                    raise
                self.me.register()
            sp.keep_room()
        except BaseException:
            if saved:
                self._restore_signals(saved)
            raise
        me = self.me
        for t in sp.eager_types():
            # (before it listens: a first job's handler, an http type's
            # modules imported, took a slow device's worker from its store's
            # turns for seconds, a RAM tier's bound with them)
            self.resolver.resolve(t)
        self.sched.start(me, select)
        self.runner.start(me, signal, self._pipe, self._main)
        self.finish.me = me
        # Started by `myq supervise` (--parent-pid): stop when it is gone,
        # also when that happened before we got here.
        self._parent = self.parent
        self.log("start", worker=self.me.wid, pid=self.me.pid, spool=sp.path,
                 concurrency=self.concurrency, version=__version__,
                 supervisor=self._parent)
        sp.budget.note_uplink(self.options.uplink_rate)     # (the forecast)
        sp.fs.kept += 1             # its descriptors stay (rechecked at polls)
        self.holds._take_holds()
        try:
            self._reap()
            self._loop(once, drain)
        finally:
            self._shut_down(saved)
        return 0

    def _shut_down(self, saved):
        """The end of run(): what still runs killed and given back, what
        is pending committed, every descriptor closed, the record gone."""
        sp = self.spool
        self.runner.stop_all()
        self._let_go()
        self.finish._release_splits()
        self.finish._retry_stuck(final=True)
        self.finish._commit(final=True)
        self._settle(final=True)
        self.resolver.close()
        if saved:
            self._restore_signals(saved)
        for fd in self._pipe:
            try:
                os.close(fd)
            except OSError:
                pass
        self.sched.close()
        self.runner.close()
        self.me.unregister()
        sp.policies.pol_polled = False
        sp.fs.kept -= 1
        sp.fs.release()
        sp.close()
        self.log("stop", worker=self.me.wid)

    def _install_signals(self):
        signal = self._signal
        saved = {}
        for sig, fn in ((signal.SIGTERM, self._on_stop), (signal.SIGINT, self._on_stop),
                        (signal.SIGHUP, self._on_hup), (signal.SIGCHLD, self._on_nothing),
                        (signal.SIGALRM, self._on_alarm)):
            saved[sig] = signal.signal(sig, fn)
        saved["wakeup"] = signal.set_wakeup_fd(self._pipe[1])
        # A supervisor's child starts with SIGHUP blocked (_child_run): one
        # sent before this handler was here is delivered to it now.
        saved["mask"] = signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGHUP,))
        return saved

    def _restore_signals(self, saved):
        signal = self._signal
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.set_wakeup_fd(saved.pop("wakeup"))
        if signal.SIGHUP in saved.pop("mask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGHUP,))
        for sig, fn in saved.items():
            signal.signal(sig, fn)

    def _on_stop(self, signum, frame):
        if self.stopping:
            self.hard_stop = True
            if self.runner._inline is not None:
                self.runner._inline = None
                raise _Shutdown()
            return
        self.stopping = True
        self.stop_deadline = _mono() + self.grace
        self.log("stopping", signal=signum, grace=self.grace,
                 running=len(self.runs) + (self.runner._inline is not None))

    def _on_hup(self, signum, frame):
        try:
            self.log.reopen()
        except MyqError as e:
            self.log("error", error=str(e))

    def _on_nothing(self, signum, frame):
        pass

    def _on_alarm(self, signum, frame):
        run = self.runner._inline
        if run is None:
            return
        now = _mono()
        if now >= self._next_beat:
            self._heartbeat()
        if self._next_settle is not None and now >= self._next_settle:
            # the store's turn goes on while a run takes its time (a RAM
            # tier's bound: jobs behind a stalled request move all the
            # same); a second not to come in again, if cut short
            self._next_settle = now + 1.0
            self._settle()
        if now >= run.deadline:
            self.runner._inline = None
            run.timed_out = True
            raise _Timeout()
        if self.stopping and now >= self.stop_deadline:
            self.runner._inline = None
            raise _Shutdown()

    def _loop(self, once, drain):
        """fill, housekeep, wait: until stopped, or --once/--drain done."""
        now = _mono()
        self._next_beat = now + self.lease / 3
        self._next_stats = now + self.stats_interval if self.stats_interval > 0 \
            else float("inf")
        self._next_reap = now + self.reap_interval
        self._next_prune = self._next_full_prune = now + min(self.prune_interval,
                                                             5.0)
        self._next_poll = now + self.poll
        self._settle()
        self._started, self._rest = 0, False
        self.sched._no_wait = once or drain       # --once, --drain: no batch_wait
        self.sched.ahead.off = once
        while True:
            busy = False
            if self.stopping:
                self._let_go()
                if self.finish._splits:
                    self.finish._release_splits()
                if not self.runs:
                    break
                self._enforce_grace()
            elif not self._rest:
                busy = self._fill(once, drain)
            if not self.runs and not self.finish._stuck and not self.finish._splits and (
                    once or self.stopping or (drain and not self.sched._ready_now())):
                break
            self._housekeep()
            self._wait(busy)

    def _enforce_grace(self):
        """Stopping: past the grace (or at a second signal), the runs are
        killed and their jobs released (_collect puts them back)."""
        if self.hard_stop or _mono() >= self.stop_deadline:
            for run in self.runs:
                if not run.released:
                    run.released = True
                    self.runner._kill(run, 9)

    def _fill(self, once, drain):
        """Claim and start jobs while a slot is free.  True when the loop
        must come straight back after its housekeeping (more to claim)."""
        now = _mono()
        finish = self.finish
        if (once and self._started) or now < finish._io_pause_until:
            return False
        while finish._splits and len(self.runs) < self.concurrency \
                and not self.stopping and self.runner._start_split():
            pass                    # (halves of a split batch go first)
        # (the parts' methods bound once: this loop runs once a job)
        next_claim, start = self.sched._next_claim, self.runner._start
        while len(self.runs) < self.concurrency and not self.stopping \
                and now >= finish._io_pause_until:
            # Below a guard the worker goes on: delivering the backlog is
            # how a store-and-forward spool gets its room back (myq(1) guards).
            # Producers are refused, retention frees done/ first
            # (_housekeep), and a step that cannot be made waits (_stuck).
            if now >= self._next_guard:     # (its figure is a second's)
                self._guard(now, 1.0)
            try:
                c = next_claim(force=(once or drain) and not self.runs)
            except OSError as e:
                finish._io_error("claim", e)
                if getattr(e, "give_back", None):   # (_SqlClaims.claim)
                    finish._give_back(e.give_back)
                return False
            if c is None:
                self._let_go()      # (claims ahead it did not ask for)
                self._rest = not (once or drain) and self._at_rest()
                return False
            self._started += 1
            start(c)
            if once:
                return False
            pending = finish._pending
            due = min(self._next_beat, self._next_reap, self._next_stats,
                      finish._pending_since + 1.0 if pending else self._next_stats,
                      self._next_settle or self._next_stats)
            now = _mono()       # (the job ran meanwhile: read again)
            if pending >= 64 or now >= due:
                return True         # housekeeping first, then go on
        return False

    def _guard(self, now, every):
        """The disk-free guard (its figure a second's: low_on_space), asked
        again in `every` seconds: below it, said once (disk_low) and done/
        freed at once (_housekeep)."""
        self._next_guard = now + every
        low = self.spool.low_on_space(now)
        if low and not self._low_logged:
            self.log("disk_low", problem=low)
            self._next_prune = 0.0          # free done/ at once
        self._low_logged = bool(low)

    def _at_rest(self):
        """Can only a change that a wake-up or a poll tick sees give the
        next claim (_fill then skipped: an idle worker's tick does its
        looks alone)?  Nothing runs, is claimed ahead, pending, stuck or
        split; no job comes due, no hold waits for its probe, no store's
        turn; every lane empty, clean and without a pass or a wait."""
        f, sched = self.finish, self.sched
        return not (
            self.runs or f._splits or f._pending or f._stuck or sched._poked
            or sched.ahead.held or sched.next_due is not None or self.stopping
            or self.holds.until or self._next_settle is not None or any(
                L.dirty or L.cache or L.cache_full or L.sweep is not None
                or L.quiet is not None or L.order is not None
                for L in sched._lanes))

    def _rest_tick(self, now):
        """A poll tick at rest, after the scheduler's and the holds' looks:
        the lanes looked at as a claim would (_sync_lanes; the wake FIFO
        not asked again: the select just did), the disk guard every 5 s;
        still at rest unless something changed."""
        self.sched._sync_lanes(fifo_seen=True)
        if now >= self._next_guard:
            self._guard(now, 5.0)
        return self._at_rest()

    def _housekeep(self):
        """Heartbeat, reap, status line, prune, stuck finishes, group
        commit: each on its own timer, all on the monotonic clock."""
        now = _mono()
        self._let_go(1.0)
        if now >= self._next_beat:
            self._heartbeat()
        if now >= self._next_reap:
            self._reap()
            self._next_reap = now + self.reap_interval
        if now >= self._next_stats and self.stats_interval > 0:
            try:
                line = self.spool.status_line()
                if hasattr(self.log, "write"):
                    self.log.write(line)
                else:           # a plain function given as log=
                    self.log("status", line=line)
            except OSError:
                pass
            _write_textfile(self)
            self._next_stats = now + self.stats_interval
        if now >= self._next_prune and self.prune_interval:
            full = now >= self._next_full_prune
            try:
                self.spool.prune(full=full)
                if self.spool.low_on_space(now):
                    self.spool.make_space()
                else:
                    self.spool.keep_room()
            except (OSError, MyqError) as e:
                self.log("error", during="prune", error=str(e))
            self._next_prune = now + (self.prune_interval if not
                                      self._low_logged else
                                      min(self.prune_interval, 5.0))
            if full:
                self._next_full_prune = now + 15 * self.prune_interval

        self.spool.upkeep_budget(now)       # (its own timers)
        if self._next_settle is not None and now >= self._next_settle:
            self._settle()
        if self.finish._stuck:
            self.finish._retry_stuck()
        if not self.runs or self.finish._pending >= 64 or (
                self.finish._pending and now - self.finish._pending_since > 1.0
        ) or self.spool.claims.owed:
            self.finish._commit()

    def _let_go(self, age=0.0):
        """The claims made ahead and not asked for in `age` seconds given
        back (_Ahead.release): the lanes are read again if any went."""
        if self.sched.ahead.held:
            try:
                back = self.sched.ahead.release(self.spool.claims, age)
            except (OSError, MyqError) as e:
                self.log("error", during="release", error=str(e))
                back = True
            if back:
                self.sched.dirty = True

    def _settle(self, final=False):
        """The store's own turn (Store.settle: a RAM tier's moves)."""
        try:
            self._next_settle = self.spool.claims.settle(final)
        except (OSError, MyqError) as e:
            self.log("error", during="settle", error=str(e))
            self._next_settle = _mono() + 1.0

    def _wait(self, busy):
        """Sleep in select() until the next timer, a wake-up (a producer's
        poke, a signal, a thread's end) or a handler's pipe; then feed the
        handlers' stdin, read their stderr and collect the runs that ended."""
        now = _mono()
        deadlines = [self._next_beat, self._next_reap, self._next_poll,
                     self._next_stats]
        if self._next_settle is not None:
            deadlines.append(self._next_settle)
        if self.finish._stuck or self.finish._io_pause_until > now:
            deadlines.append(max(self.finish._io_pause_until, now + 0.5))
        if self.stopping:
            deadlines.append(self.stop_deadline)
        if self.sched.next_due is not None and len(self.runs) < self.concurrency:
            # (all slots busy: a due claim waits for a run's end, which
            # wakes this select; a due time past would make it spin)
            deadlines.append(now + max(0.0, self.sched.next_due - _now()))
        for run in self.runs:
            if run.handler.spawned or not run.timed_out:
                deadlines.append(run.kill_at or run.deadline)
        if self.finish._pending:
            deadlines.append(self.finish._pending_since + 1.0)
        if self.runs and not self._main:
            deadlines.append(now + 0.02)
        wait = 0.0 if busy else max(0.0, min(deadlines) - now)
        if self.runner._timer and wait > 0:
            self._signal.setitimer(self._signal.ITIMER_REAL, 0)
            self.runner._timer = 0.0
        rl = [self._pipe[0]] + self.sched._wake_fds[0::2]
        wl = []
        for run in self.runs:
            if run.err_fd is not None:
                rl.append(run.err_fd)
            if run.stdin_fd is not None:
                wl.append(run.stdin_fd)
        try:
            r, w, _ = self._select.select(rl, wl, [], wait)
        except InterruptedError:
            r, w = [], []
        # (at rest still only when nothing woke it, a signal, a poke, a
        # run's pipe, and its poll tick found nothing new)
        rest, self._rest = self._rest and not (r or w), False
        if self._pipe[0] in r:
            _drain(self._pipe[0])
        woken = [fd for fd in self.sched._wake_fds[0::2] if fd in r]
        if woken:
            for fd in woken:
                _drain(fd)
            self.sched._woken()
        now = _mono()
        if now >= self._next_poll:
            self._next_poll = now + self.poll
            self.sched._check_incoming()
            self.holds._check_holds(self.spool.fs.looked)
            if self._parent and os.getppid() != self._parent \
                    and not self.stopping:
                # the supervisor is gone (kill -9): stop as on SIGTERM
                self.log("supervisor_gone", pid=self._parent)
                self._on_stop(0, None)
            if rest:
                self._rest = self._rest_tick(now)
        for run in list(self.runs):
            if run.stdin_fd is not None and run.stdin_fd in w:
                self.runner._feed(run)
            if run.err_fd is not None and run.err_fd in r:
                self.runner._read_err(run)
        self.runner._collect()

    def _tick(self):
        """Inside long loops (a flood of bad files): the heartbeat keeps its
        schedule, so that no reaper takes this live worker's jobs."""
        if _mono() >= self._next_beat:
            self._heartbeat()

    def _heartbeat(self):
        """The worker's beat and its claims' leases extended; no beat
        while it holds no claim and made none since the last (its beat
        vouches for its claims alone: an idle worker writes nothing; its
        next claim beats first, Identity.token)."""
        self._next_beat = _mono() + self.lease / 3
        until = _now() + self.lease
        self._let_go(1.0)       # (a long run's: not kept for its time)
        try:
            claims = [c for part, _ in self.finish._splits for c in part]
            for run in self.runs + ([self.runner._inline] if self.runner._inline else []):
                claims.extend(run.batch or [run.claim])
            fin = self.finish
            if claims or fin._stuck or fin._pending or self.spool.claims.owed \
                    or self.me.seq != self._beat_seq:
                self._beat_seq = self.me.seq
                self.me.beat()
            self.spool.claims.extend(claims, until)
        except OSError as e:
            self.log("error", during="heartbeat", error=e.strerror)

    def _reap(self):
        try:
            self.spool.reap(self.me, self.max_attempts)
        except (OSError, MyqError) as e:
            self.log("error", during="reap", error=str(e))


# Supervision #################################################################


def _clean_env(pass_env=(), user=None):
    """What a process myq starts gets of our environment (myq(1) HANDLERS): PATH,
    HOME, LANG, LC_*, TZ and the names given with --pass-env; for another
    user, its own HOME, USER and LOGNAME."""
    env = dict((k, v) for k, v in os.environ.items()
               if k in ("PATH", "HOME", "LANG", "TZ") or k.startswith("LC_")
               or k in pass_env)
    env.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    if user is not None:
        env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
    return env


class _NotStarted(MyqError):
    """What the supervisor of `supervise --daemon` said instead of ready."""

    def __init__(self, message, code=1):
        MyqError.__init__(self, message)
        self.code = code


def _error_report(e):
    """(exit status, one line) of an exception, as main() would say it."""
    if isinstance(e, MyqError):
        return e.code, str(e)
    if isinstance(e, OSError):
        return EX_TEMPFAIL, "%s%s" % (e.strerror or e, " (%s)" % e.filename
                                      if getattr(e, "filename", None) else "")
    return 1, "%s: %s" % (e.__class__.__name__, e)


def _open_fds():
    try:
        return [int(n) for n in os.listdir("/proc/self/fd")]
    except (OSError, ValueError):
        return range(3, 1024)


def fork_daemon(keep=()):
    """`supervise --daemon`: fork, as os.fork() does: (pid, fd) in the
    caller, the child's pid and the pipe on which the child says whether
    it started; (0, that pipe's write end) in the child.  The child leads
    a session of its own (its pid is its process group, the one that
    `supervise --stop` waits for), reads and writes /dev/null on 0, 1 and
    2, and holds no other descriptor of the caller's but `keep`: a shell
    leaks its saved ones (BusyBox ash), and one that is the init script's
    $(...) pipe would hold the script up as long as the daemon runs."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(w)
        return pid, r
    os.close(r)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    keep = set(keep) | {w}
    for fd in _open_fds():
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    return 0, w


def await_daemon(pid, fd, log_name, timeout=30.0):
    """The caller's half of `supervise --daemon`: 0 once the child said it
    is ready (the pidfile written, the first worker started); else raise
    what it said instead, with its exit status."""
    import select
    data = b""
    end = _mono() + timeout
    try:
        while not data.endswith(b"\n"):
            if not select.select([fd], [], [], max(0.0, end - _mono()))[0]:
                raise _NotStarted("the supervisor (pid %d) did not say it started "
                                  "within %ds; see %s" % (pid, timeout, log_name))
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    code, _, message = data.decode("utf-8", "replace").strip().partition(" ")
    if code == "0":
        return 0
    if code.isascii() and code.isdigit() and message:
        raise _NotStarted(message, int(code))
    _, status = os.waitpid(pid, 0)      # it died without a word
    raise _NotStarted("the supervisor exited at once; see %s" % log_name,
                      os.WEXITSTATUS(status) if os.WIFEXITED(status)
                      and os.WEXITSTATUS(status) else 1)


class Supervisor(object):
    """`myq supervise`: keeps N worker processes running (for the init
    script and procd).  It owns process management, so that the init
    script stays thin:

    - it leads its own session; writes the pidfile (when asked) and
      removes it at exit;
    - as root with --user, it creates the log's directory and opens the
      log file safely (open_log_file), writes the pidfile, then becomes
      that user for good; it reads and writes nothing in the spool itself;
      the workers get a clean environment, and in it (not on their command
      line, which any user can read) the options that may be credentials
      (_SECRET_OPTIONS);
    - a worker that dies is restarted with a backoff (1 s doubling to 30 s,
      reset after 60 s up); workers stop by themselves when the supervisor
      is gone (they watch their parent);
    - with `intake` (the options of `myq intake`), it keeps one intake
      process running beside the workers, started, restarted and stopped
      as they are (the same _spawn);
    - with `ready` (the pipe of fork_daemon), it says there "0" once the
      pidfile is written and its first worker started, or the exit status
      and the error that stopped it;
    - SIGTERM/SIGINT: TERM to the workers, KILL after --stop-timeout (a
      second signal: at once), then `myq reap` as the spool's owner, which
      takes back the claims of killed workers and ends their handlers; then
      it exits 0.  SIGHUP reopens the log and is passed on."""

    def __init__(self, spool, workers, worker_argv, log, user=None, ids=None,
                 pidfile=None, stop_timeout=10.0, env=None, python=None,
                 ready=None, intake=None, entry=None, keep=()):
        self.spool, self.n, self.log = spool, workers, log
        self.keep = tuple(keep)     # descriptors the intake gets (its port)
        self.ready = ready
        self.user, self.ids = user, ids     # a pwd entry and (uid, gid), or None
        self.pidfile, self.stop_timeout = pidfile, stop_timeout
        # the words of each child's command (after the program)
        self.argv = ["--spool", spool.path, "worker", "--parent-pid",
                     str(os.getpid())] + list(worker_argv)
        self.reap_argv = ["--spool", spool.path, "reap"]
        self.intake_argv = None if intake is None else [
            "--spool", spool.path, "intake", "--parent-pid", str(os.getpid())] \
            + list(intake)
        self.env = dict(env or {})
        self.python = python
        # _child_entry: a child forked from this process runs what
        # entry(words) returns; with none (or another interpreter), every
        # child is a new one (exec)
        self.entry = None if python else entry
        self.area = _IMAGE["area"]() if self.entry else None
        self.stop = 0
        self.hup = False

    def _spawn(self, words, out=None, quiet=False):
        """Start a child (a worker, the intake, the final reap) that runs
        `myq WORDS`.  Forked from this process, where it can be retitled
        (_retitle: the command line an exec'd child would have, as much of
        it as fits in ours, and its clean environment over ours), so that
        it shares our pages: no second interpreter that loads and compiles
        myq again.  Else (no /proc, our command line too short for the
        child's first words, its environment longer than ours, another
        interpreter) exec'd, as a new Python; a child whose retitle fails
        execs too."""
        title = None
        if self.area is not None:
            title = _IMAGE["title"](self.area, [sys.executable or "python3",
                                                _IMAGE["prog"]()] + words,
                                    2 + words.index("--spool") + 3)
        env = None if title is None else _IMAGE["env_block"](self.area, self.env)
        if env is None:
            return self._exec(words, out, quiet)
        run = self.entry(words)
        if run is None:
            return self._exec(words, out, quiet)
        import gc
        import signal
        gc.collect()            # our garbage (the parser) goes first; then
        # what is there now stays out of every collection, in the children
        # too: their collector never writes to (so never copies) our pages
        gc.freeze()
        sys.stdout.flush()
        sys.stderr.flush()
        sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
        try:
            pid = os.fork()
            if pid == 0:
                _child_run(self, run, words, (title, env), out, quiet, signal, sigs)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
        return _Child(pid)

    def _exec(self, words, out, quiet):
        import subprocess
        return subprocess.Popen(
            _IMAGE["start"](self.python) + words, close_fds=True, env=self.env,
            cwd="/", stdin=subprocess.DEVNULL, stderr=out,
            stdout=subprocess.DEVNULL if quiet else out,
            pass_fds=self.keep if words[2:3] == ["intake"] else ())

    def _write_pidfile(self):
        fd = os.open(self.pidfile, os.O_WRONLY | os.O_CREAT | O_NOFOLLOW
                     | os.O_NONBLOCK | O_CLOEXEC, 0o644)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError("pidfile %s is not a plain file" % self.pidfile)
            # a hard link to another file (/etc/shadow, put in a directory
            # another user may write to) or another user's file: never
            # truncated, never written
            if st.st_nlink != 1:
                raise ConfigError("pidfile %s has %d hard links (another file's "
                                  "name?); remove it" % (self.pidfile, st.st_nlink))
            if st.st_uid != os.geteuid():
                raise ConfigError("pidfile %s belongs to uid %d; remove it"
                                  % (self.pidfile, st.st_uid))
            # held while this supervisor lives: a second start (two init
            # scripts at once) ran a second supervisor, which stop then
            # left running (review)
            import fcntl
            # the lock is on a read-only descriptor of its own, the one kept
            # while the supervisor lives: as the user, dumpable again
            # (_dumpable), it holds no descriptor that writes a file of root's
            lock = os.open(self.pidfile, os.O_RDONLY | O_NOFOLLOW | os.O_NONBLOCK
                           | O_CLOEXEC)
            try:
                same = os.fstat(lock)
                if (same.st_dev, same.st_ino) != (st.st_dev, st.st_ino):
                    raise ConfigError("pidfile %s was replaced while it was "
                                      "opened; try again" % self.pidfile)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    raise ConfigError(
                        "another myq supervise runs with pidfile %s (pid %s); "
                        "stop it first" % (self.pidfile, (
                            _read_small(self.pidfile, 64) or b"?")
                            .decode("ascii", "replace").strip()))
            except BaseException:
                os.close(lock)
                raise
            os.ftruncate(fd, 0)
            os.write(fd, b"%d\n" % os.getpid())
            self._pid_fd = lock
        finally:
            if fd is not None:
                os.close(fd)

    def _tell(self, code=0, message=""):
        """--daemon: tell the caller that we are ready (0), or why not;
        once (a caller that is gone is not an error)."""
        fd, self.ready = self.ready, None
        if fd is None:
            return
        try:
            os.write(fd, ("%d %s\n" % (code, message.replace("\n", " ")))
                     .encode("utf-8", "replace"))
        except OSError:
            pass
        finally:
            os.close(fd)

    def _remove_pidfile(self):
        data = _read_small(self.pidfile, 64)
        if data and data.strip() == str(os.getpid()).encode():
            _quiet_unlink(self.pidfile)

    def run(self):
        import select
        import signal
        try:
            os.setsid()         # its own session: stop can find what is left
        except OSError:
            pass                # a session leader already (start-stop-daemon)
        pipe = os.pipe()
        for fd in pipe:
            os.set_blocking(fd, False)

        def on_stop(signum, frame):
            self.stop += 1

        def on_hup(signum, frame):
            self.hup = True

        for sig, fn in ((signal.SIGTERM, on_stop), (signal.SIGINT, on_stop),
                        (signal.SIGHUP, on_hup),
                        (signal.SIGCHLD, lambda s, f: None)):
            signal.signal(sig, fn)
        signal.set_wakeup_fd(pipe[1])
        try:
            if self.pidfile:
                self._write_pidfile()
            try:
                if self.ids is not None:
                    # Root's part is done (the pidfile, the log file): from
                    # here on the supervisor, its workers and the final reap
                    # run as the user.  The pidfile stays root's: the init
                    # script removes it.
                    become(self.ids[0], self.ids[1])
                    _readable_library(self.ids[0])
                    _IMAGE["dumpable"]()         # (its children forked, not exec'd)
                    self.pidfile = None
                self._loop(select, signal, pipe[0])
            finally:
                if self.pidfile:
                    self._remove_pidfile()
        except BaseException as e:
            self._tell(*_error_report(e))
            raise
        finally:
            self._tell(1, "the supervisor stopped before its first worker started")
        return 0

    def _loop(self, select, signal, wake):
        log = self.log
        slots = [{"proc": None, "since": 0.0, "backoff": 1.0, "at": 0.0,
                  "argv": self.argv, "slot": i} for i in range(self.n)]
        if self.intake_argv:
            slots.append({"proc": None, "since": 0.0, "backoff": 1.0, "at": 0.0,
                          "argv": self.intake_argv, "slot": "intake"})
        log("supervise", workers=self.n, pid=os.getpid(), spool=self.spool.path,
            user=self.user.pw_name if self.user else None,
            intake=1 if self.intake_argv else None)
        sent = 0
        kill_at = None
        while True:
            now = _mono()
            if self.hup:
                self.hup = False
                try:
                    log.reopen()
                except MyqError as e:
                    log("error", during="reopen log", error=str(e))
                for s in slots:
                    if s["proc"] is not None:
                        s["proc"].send_signal(signal.SIGHUP)
            for s in slots:
                p = s["proc"]
                if p is not None and p.poll() is not None:
                    up = now - s["since"]
                    if up >= 60:
                        s["backoff"] = 1.0
                    s["at"] = now + s["backoff"]
                    log("worker_exit", slot=s["slot"], pid=p.pid,
                        status=p.returncode,
                        uptime=round(up, 1),
                        restart_in=None if self.stop else s["backoff"])
                    s["backoff"] = min(30.0, s["backoff"] * 2)
                    s["proc"] = None
            alive = [s["proc"] for s in slots if s["proc"] is not None]
            if self.stop:
                if not alive:
                    break
                if self.stop > sent:
                    if sent == 0:
                        kill_at = now + self.stop_timeout
                    sig = signal.SIGTERM if self.stop == 1 else signal.SIGKILL
                    for p in alive:
                        p.send_signal(sig)
                    sent = self.stop
                elif kill_at is not None and now >= kill_at:
                    for p in alive:
                        p.send_signal(signal.SIGKILL)
                    kill_at = None
            else:
                error = self._start_workers(slots, now)
                if error and self.ready is not None:    # --daemon: not started
                    self.stop = 1
                    self._tell(1, "cannot start a worker: %s" % error)
                self._tell()        # the first round: --daemon's word, once
            waits = [s["at"] - now for s in slots if s["proc"] is None]
            if self.stop:
                wait = max(0.05, kill_at - now) if kill_at is not None else 1.0
            else:
                wait = max(0.05, min(waits)) if waits else 5.0
            try:
                select.select([wake], [], [], wait)
            except InterruptedError:
                pass
            _drain(wake)
        self._reap_after_stop()
        log("supervise_stop", pid=os.getpid())

    def _start_workers(self, slots, now):
        """Start the workers that are due; the last error, or None."""
        error = None
        for s in slots:
            if s["proc"] is None and now >= s["at"]:
                try:
                    s["proc"] = self._spawn(s["argv"], self.log.fileno())
                    s["since"] = now
                    self.log("worker_start", slot=s["slot"], pid=s["proc"].pid)
                except (OSError, ValueError) as e:
                    error = getattr(e, "strerror", None) or str(e)
                    self.log("error", during="start worker", error=error)
                    s["at"] = now + s["backoff"]
                    s["backoff"] = min(30.0, s["backoff"] * 2)
        return error

    def _reap_after_stop(self):
        """Workers that were killed leave claims and maybe handlers: `myq
        reap`, as the spool's owner, takes the claims back and ends the
        handlers they recorded (kill_run)."""
        try:
            p = self._spawn(self.reap_argv, self.log.fileno(), quiet=True)
        except (OSError, ValueError) as e:
            self.log("error", during="reap", error=getattr(e, "strerror", None)
                     or str(e))
            return
        end = _mono() + max(5.0, self.stop_timeout)
        while p.poll() is None:
            if _mono() >= end:
                p.kill()
                while p.poll() is None:
                    time.sleep(0.01)
                self.log("error", during="reap", error="timed out")
                return
            time.sleep(0.02)


class _Child(object):
    """A child the supervisor forked: what it uses of subprocess.Popen
    (pid, returncode, poll, send_signal, kill)."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 255 << 8     # reaped elsewhere
            if pid:
                self.returncode = -os.WTERMSIG(status) \
                    if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:         # (never a pid reused meanwhile)
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(9)


def _child_run(sup, run, words, image, out, quiet, signal, sigs):
    """The child of Supervisor._spawn, until its end (os._exit: never back
    into the supervisor's frames, its finally clauses, its objects'
    descriptors).  It gets what an exec'd child gets: 0 on /dev/null, 1
    and 2 on `out` (the log; 1 on /dev/null when `quiet`), no other
    descriptor of ours, the default signals (SIGHUP blocked until the
    worker's or intake's own handler unblocks it: a logrotate in that
    window is neither a death nor lost), no wakeup fd, /
    as its directory, the supervisor's clean environment (and shown as
    its own: _retitle), its title; then run() (main() with the words the supervisor parsed) in this
    process; else an exec of the same words."""
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig, fn in ((signal.SIGTERM, signal.SIG_DFL),
                        (signal.SIGINT, signal.default_int_handler),
                        (signal.SIGHUP, signal.SIG_DFL),   # (blocked: kept)
                        (signal.SIGCHLD, signal.SIG_DFL)):
            signal.signal(sig, fn)
        null = os.open(os.devnull, os.O_RDWR)
        for fd, to in ((0, null), (1, null if quiet else out), (2, out)):
            if to is not None and to != fd:
                os.dup2(to, fd)
        keep = sup.keep if words[2:3] == ["intake"] else ()
        for fd in _open_fds():
            if fd > 2 and fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        os.chdir("/")
        os.environ.clear()
        os.environ.update(sup.env)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [
            s for s in sigs if s != signal.SIGHUP])
        if not _IMAGE["retitle"](sup.area, image[0], image[1]):
            argv = _IMAGE["start"](sup.python) + words
            os.execve(argv[0], argv, sup.env)
        sys.argv[:] = [_IMAGE["prog"]()] + words
        del _COMPILED_AT_START[:]       # the heap is the supervisor's, shared
        status = run()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (e.code is not None)
    except BaseException as e:
        try:
            import traceback
            traceback.print_exc()
        except BaseException:       # (no traceback module to be had: its
            try:                    # words at least)
                os.write(2, ("myq: %s: %s\n" % (type(e).__name__, e)).encode(
                    "utf-8", "replace"))
            except BaseException:
                pass
        status = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status if isinstance(status, int) else 1)


# Options and parsers #########################################################

# (flag, kind, default, help); the kind is a Kind (Small helpers: the same
# parser as a policy file's value of that kind), str, "append" (repeatable)
# or None (a switch; its MYQ_* variable is a BOOL).
GUARD_OPTIONS = [
    ("--min-free", SIZE, DEFAULTS["min_free"], "refuse new work below this free space on the spool's filesystem"),
    ("--min-free-inodes", NATURAL, DEFAULTS["min_free_inodes"], "refuse new work below these free inodes"),
    ("--max-job-bytes", SIZE, DEFAULTS["max_job_bytes"], "largest job file"),
    ("--dedupe-window", SECONDS, DEFAULTS["dedupe_window"], "how long a finished id stays refused"),
    ("--keep-done", SECONDS, DEFAULTS["keep_done"], "how long done/ keeps finished jobs"),
    ("--keep-done-max", NATURAL, DEFAULTS["keep_done_max"], "at most this many jobs in done/"),
    ("--keep-dead", SECONDS, DEFAULTS["keep_dead"], "how long dlq/ keeps dead jobs"),
    ("--keep-dead-max", NATURAL, DEFAULTS["keep_dead_max"], "at most this many jobs in dlq/"),
    ("--keep-failed", SECONDS, DEFAULTS["keep_failed"], "how long failed/ keeps quarantined files"),
    ("--keep-ok-max", NATURAL, DEFAULTS["keep_ok_max"], "at most this many idempotency records in locks/ok/"),
]
# (their defaults are WorkerOptions', written once)
_WORKER_DEFAULTS = dict(WorkerOptions.KEYS)
WORKER_OPTIONS = [
    ("--handlers", str, None, "directory of executable handlers, one per type"),
    ("--module", str, None, "Python file of handler functions"),
    ("--concurrency", COUNT, _WORKER_DEFAULTS["concurrency"], "handlers run at once by this worker"),
    ("--lease", SECONDS, _WORKER_DEFAULTS["lease"], "claim lease, renewed by heartbeats"),
    ("--timeout", SECONDS, _WORKER_DEFAULTS["timeout"], "handler time limit, unless the job has a timeout"),
    ("--max-attempts", COUNT, _WORKER_DEFAULTS["max_attempts"], "runs a job gets when it does not say"),
    ("--backoff-base", SECONDS, _WORKER_DEFAULTS["backoff_base"], "delay of the first retry, doubling after each failure"),
    ("--backoff-max", SECONDS, _WORKER_DEFAULTS["backoff_max"], "longest retry delay"),
    ("--probe-max", SECONDS, _WORKER_DEFAULTS["probe_max"], "longest wait between two probes of a held destination (a link that is back is used within it)"),
    ("--jitter", FRACTION, _WORKER_DEFAULTS["jitter"], "random spread of retry delays, a fraction"),
    ("--poll", SECONDS, _WORKER_DEFAULTS["poll"], "how often to look for files dropped without a wake-up"),
    ("--stats-interval", SECONDS, _WORKER_DEFAULTS["stats_interval"], "time between status lines in the log, 0 for none"),
    ("--grace", SECONDS, _WORKER_DEFAULTS["grace"], "time running handlers get after SIGTERM"),
    ("--scan-cache", COUNT, _WORKER_DEFAULTS["scan_cache"], "ready jobs remembered per directory scan"),
    ("--once", None, False, "run at most one job, then exit"),
    ("--drain", None, False, "run until nothing is ready or running, then exit"),
    ("--pass-env", "append", [], "pass this variable to exec handlers"),
    ("--log", str, None, "append log lines to FILE (reopened on SIGHUP), not stderr"),
    ("--syslog", None, False, "log to syslog, not stderr"),
    ("--syslog-facility", str, "daemon", "syslog facility"),
    ("--syslog-tag", str, "myq", "syslog tag"),
    ("--http-header", "append", [], "'Name: value' added to every http job"),
    ("--http-headers-file", str, None, "file of 'Name: value' lines for http jobs"),
    ("--http-ca", str, None, "PEM file of CA certificates that https trusts besides the system's"),
    ("--textfile", str, None, "write DIR/myq_QUEUE.prom (Prometheus) every --stats-interval"),
    ("--uplink-rate", UPLINK, None, "at most SIZE/s (e.g. 16K/s) of http bodies and mqtt payloads over any 10 s, to all destinations"),
    ("--mqtt", str, None, "the broker of mqtt jobs: mqtt://[USER@]HOST[:PORT] or mqtts://..."),
    ("--mqtt-password-file", str, None, "file holding the password of the --mqtt user"),
    ("--mqtt-client-id", str, None, "MQTT client id (default: unique per worker process)"),
    ("--mqtt-ca", str, None, "CA certificate(s) to trust for an mqtts broker, besides the system's"),
    ("--mqtt-cert", str, None, "client certificate for an mqtts broker that wants one"),
    ("--mqtt-key", str, None, "private key of --mqtt-cert, when not in that file"),
]

# The commands that take the guard options, and those each one's --help
# shows (None: all); the others are accepted and ignored, as they always were.
_RETENTION_FLAGS = ("--dedupe-window", "--keep-done", "--keep-done-max",
                    "--keep-dead", "--keep-dead-max", "--keep-failed",
                    "--keep-ok-max")
_GUARDS_SHOWN = {
    "init": ("--min-free", "--min-free-inodes"),
    "enqueue": ("--min-free", "--min-free-inodes", "--max-job-bytes",
                "--dedupe-window"),
    "prune": _RETENTION_FLAGS,
    "check": ("--min-free", "--min-free-inodes") + _RETENTION_FLAGS,
    "worker": None,
    "supervise": None,
    "intake": ("--min-free", "--min-free-inodes", "--max-job-bytes",
               "--dedupe-window"),
    "import": ("--min-free", "--min-free-inodes", "--max-job-bytes",
               "--dedupe-window"),
}


_METAVARS = {"handlers": "DIR", "module": "FILE.py", "log": "FILE", "textfile": "DIR",
             "http_ca": "FILE",
             "pass_env": "NAME", "mqtt": "URL", "mqtt_password_file": "FILE",
             "mqtt_client_id": "ID", "mqtt_ca": "FILE", "mqtt_cert": "FILE",
             "mqtt_key": "FILE", "listen": "unix:PATH|[ADDR]:PORT",
             "subscribe": "FILTER=TYPE"}


def _option_help(flag, typ, default, help):
    """A table option's help: what it does, its default, its variable."""
    var = "MYQ_" + flag[2:].replace("-", "_").upper()
    if isinstance(typ, Kind):
        return "%s (default %s; %s)" % (help, typ.show(default), var)
    if typ is None:
        return "%s (%s=1)" % (help, var)
    if typ == "append":
        return "%s; repeatable (%s)" % (help, var)
    if default is None:
        return "%s (%s)" % (help, var)
    return "%s (default %s; %s)" % (help, default, var)


def _arg_error(message):
    import argparse
    return argparse.ArgumentTypeError(message)


def _arg(kind):
    """An argparse type of a Kind: its error names the value."""
    def value(text):
        try:
            return kind(text)
        except ValueError as e:
            raise _arg_error("%r: %s" % (text, e))
    value.__name__ = kind.metavar
    return value


def _metavar(typ, dest):
    return typ.metavar if isinstance(typ, Kind) else \
        _METAVARS.get(dest) or dest.split("_")[-1].upper()


# What argparse.SUPPRESS is (its value, without importing argparse): a
# help left out of --help.
_SUPPRESS = "==SUPPRESS=="


class _Spec(object):
    """A command's arguments as its builders declare them to argparse
    (add_argument, the same calls), recorded instead of built: what
    _quick_args parses the usual command lines by, without argparse.
    What it does not know (another action, a positional after an
    optional one) makes it `plain` no more: argparse then parses."""

    def __init__(self):
        self.flags = {}         # --flag: (dest, action, type, const, choices)
        self.places = []        # positionals: (dest, nargs, type, default,
        self.defaults = {}      # choices); dest: its default, as argparse's
        self.plain = True

    def add_argument(self, *flags, **kw):
        action, typ = kw.get("action", "store"), kw.get("type")
        default, choices = kw.get("default"), kw.get("choices")
        if action not in ("store", "store_true", "store_const", "append") \
                or kw.get("required") or kw.get("nargs") not in (None, "?", "*"):
            self.plain = False
        if flags[0][:1] != "-":
            nargs = kw.get("nargs")
            if self.places and (self.places[-1][1] == "*" or
                                nargs is None and self.places[-1][1] == "?"):
                self.plain = False      # (argparse's regex would backtrack)
            self.places.append((flags[0], nargs, typ, default, choices))
            self.defaults[flags[0]] = default
            return
        if kw.get("nargs") is not None or not all(f[:2] == "--" for f in flags):
            self.plain = False
        dest = kw.get("dest") or flags[0][2:].replace("-", "_")
        for f in flags:
            self.flags[f] = (dest, action, typ, kw.get("const"), choices)
        self.defaults[dest] = False if action == "store_true" else default

    def option(self, flag, typ):
        """A table's option (_add_options): a flag (typ None), repeatable
        ("append") or text, each default None, as argparse's."""
        action = "store_const" if typ is None else \
            "append" if typ == "append" else "store"
        dest = flag[2:].replace("-", "_")
        self.flags[flag] = (dest, action, None, True, None)
        self.defaults[dest] = None

    def parse(self, words):
        """argparse's answer for `words` (after the command word) as a
        dict, where the form is one of the usual ones: each option spelt
        out in full, as --name VALUE or --name=VALUE (a VALUE not starting
        with '-', unless it is "-" or after '='), the positionals in one
        run, every value one its type and choices take.  Else None (an
        abbreviation, --help, --, an error: argparse says what it says)."""
        if not self.plain:
            return None
        got, seen, run, over = dict(self.defaults), set(), [], False
        i, n = 0, len(words)
        while i < n:
            a = words[i]
            i += 1
            if a[:1] != "-" or a == "-":
                if over:
                    return None         # a second run of positionals
                run.append(a)
                continue
            over = bool(run)            # (a run of positionals ends here)
            name, eq, value = a.partition("=")
            flag = self.flags.get(name)
            if flag is None:
                return None
            dest, action, typ, const, choices = flag
            if action in ("store_true", "store_const"):
                if eq:
                    return None
                got[dest] = True if action == "store_true" else const
            else:
                if not eq:
                    if i == n or words[i][:1] == "-" and words[i] != "-":
                        return None
                    value = words[i]
                    i += 1
                value = _Spec._value(typ, choices, value)
                if value is _Spec:
                    return None
                got[dest] = list(got[dest] or ()) + [value] \
                    if action == "append" else value
            seen.add(dest)
        for dest, _, typ, _, _ in self.flags.values():
            # (argparse gives a text default, not given, to its type)
            if typ is not None and dest not in seen and \
                    got[dest].__class__ is str:
                got[dest] = _Spec._value(typ, None, got[dest])
                if got[dest] is _Spec:
                    return None
        return self._place(got, run)

    def _place(self, got, run):
        """The positionals of `run` given to their places, as argparse
        matches them (left to right: none is optional before a required
        one, `plain`)."""
        for dest, nargs, typ, default, choices in self.places:
            if nargs is None:
                if not run:
                    return None
                v = _Spec._value(typ, choices, run.pop(0))
            elif nargs == "?":
                v = run.pop(0) if run else default
                if v.__class__ is str:
                    v = _Spec._value(typ, choices, v)
            else:
                if not run and choices is not None:
                    return None     # (argparse's answer varies by version)
                v = [_Spec._value(typ, choices, w) for w in run] if run else (
                    default if default is not None else [])
                if run and any(w is _Spec for w in v):
                    return None
                run = []
            if v is _Spec:
                return None
            got[dest] = v
        return None if run else got

    @staticmethod
    def _value(typ, choices, text):
        """What argparse makes of `text` (_Spec itself: an error)."""
        try:
            v = typ(text) if typ is not None else text
        except Exception:
            return _Spec
        return _Spec if choices is not None and v not in choices else v


def _add_options(p, table, shown=None):
    """The options of a table (WORKER_OPTIONS, GUARD_OPTIONS); those not
    in `shown` are accepted but left out of --help."""
    if p.__class__ is _Spec:            # (no help to write)
        for flag, typ, _, _ in table:
            p.option(flag, typ)
        return
    for flag, typ, default, help in table:
        dest = flag[2:].replace("-", "_")
        if shown is not None and flag not in shown:
            help = _SUPPRESS            # accepted, but not its concern
        else:
            help = _option_help(flag, typ, default, help)
        if typ is None:
            p.add_argument(flag, dest=dest, action="store_const", const=True,
                           default=None, help=help)
        elif typ == "append":
            p.add_argument(flag, dest=dest, action="append", default=None,
                           metavar=_METAVARS.get(dest) or
                           dest.upper().rsplit("_", 1)[-1], help=help)
        else:
            p.add_argument(flag, dest=dest, default=None, help=help,
                           metavar=_metavar(typ, dest))


# One parser builder per command: its own arguments, after the worker and
# guard options that _add_command gives it.

def _budget_arg(text):
    """--budget SIZE, or "" (none)."""
    return _arg(Policy.SPOOL_KEYS["budget"])(text) if text != "" else ""


def _args_init(p):
    p.add_argument("--owner", help="chown the layout to USER[:GROUP] (a "
                   "GROUP: the producers', tmp/ and incoming/ g+ws,+t)")
    p.add_argument("--name", help="the queue's name (default: the "
                   "directory's), for the status line and metrics")
    p.add_argument("--budget", type=_budget_arg, metavar="SIZE",
                   help="cap everything the spool keeps on its filesystem "
                   "(myq(1) budget; default none, an empty value removes it)")
    p.add_argument("--store", choices=("files", "sqlite"), default=None,
                   help="where a new spool keeps its jobs: a file each "
                   "(default) or one SQLite database, queue.db")


def _args_enqueue(p):
    p.add_argument("type", help="the job's type: selects its handler")
    p.add_argument("payload", nargs="?", default="null",
                   help="JSON text, or - for standard input (default null)")
    p.add_argument("--id", help="the job's id (default: generated, in "
                   "creation order); exit 73 when that id is queued, running, "
                   "dead or done within the --dedupe-window")
    p.add_argument("--delay", type=_arg(DURATION), default=0, metavar="S",
                   help="run it no sooner than this from now (default 0)")
    p.add_argument("--max-attempts", type=int, metavar="N",
                   help="runs the job gets (default: the worker's "
                   "--max-attempts)")
    p.add_argument("--timeout", type=_arg(DURATION), metavar="S",
                   help="the handler's time limit for this job (default: "
                   "the worker's --timeout)")
    p.add_argument("--priority", type=_arg(PRIORITY), metavar="P",
                   help="-9 to 9, higher first (default: the type's policy, "
                   "else 0)")
    p.add_argument("--ttl", type=_arg(POSITIVE_SECONDS), metavar="S",
                   help="never start it later than this from now: it goes to "
                   "dlq/ as expired (default: the type's policy ttl)")


def _args_worker(p):
    p.add_argument("--parent-pid", type=int, help=_SUPPRESS)


def _args_supervise(p):
    p.add_argument("--workers", default=None, metavar="N",
                   help="worker processes to keep running (default 1; MYQ_WORKERS)")
    p.add_argument("--user", help="run the workers as USER[:GROUP] (root only); "
                   "the log file is created for that user")
    p.add_argument("--pidfile", help="write the supervisor's pid to FILE")
    p.add_argument("--stop-timeout", metavar="S", help="time the workers get "
                   "after SIGTERM before SIGKILL (default 10s)")
    p.add_argument("--dry-run", action="store_true", help="check the options "
                   "and the spool, start nothing (exit 0 when all is well)")
    p.add_argument("--daemon", action="store_true", help="run in the "
                   "background: exit 0 once the pidfile is written and the "
                   "first worker started, else with the error that stopped it "
                   "(the init script's start)")
    p.add_argument("--stop", action="store_true", help="stop the supervisor of "
                   "--pidfile: SIGTERM, wait for its workers (SIGKILL after "
                   "--stop-timeout + 5 s), then reap (the init script's stop)")


def _args_stats(p):
    p.add_argument("--json", action="store_true",
                   help="one JSON object instead of the status line")
    p.add_argument("--prometheus", action="store_true",
                   help="the Prometheus text format (node_exporter's "
                   "textfile collector) instead of the status line")


def _args_list(p):
    p.add_argument("state", nargs="?", choices=STATES + ("held",),
                   help="only jobs in this state: %s (held: waiting for a "
                   "held destination)" % ", ".join(STATES + ("held",)))
    p.add_argument("--type", help="only jobs of this type")
    p.add_argument("--limit", type=_arg(COUNT), metavar="N",
                   help="at most N jobs (default: all)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per line instead of text")


def _args_show(p):
    p.add_argument("id", help="a job id, or the name of a file in failed/")


def _args_retry(p):
    p.add_argument("ids", nargs="*", metavar="ID",
                   help="dead job ids, or names of repaired files in failed/")
    p.add_argument("--all", action="store_true",
                   help="every job in dlq/")
    p.add_argument("--now", action="store_true",
                   help="also make these scheduled jobs ready now")
    p.add_argument("--json", action="store_true", help='print {"retried": N}')


def _args_delete(p):
    p.add_argument("ids", nargs="*", metavar="ID",
                   help="job ids, or names of files in failed/")
    p.add_argument("--state", choices=STATES,
                   help="in bulk: every job in this state (%s)" % ", ".join(STATES))
    p.add_argument("--type", help="with --state: only jobs of this type")
    p.add_argument("--older-than", type=_arg(DURATION), metavar="S",
                   help="with --state: only jobs older than this (waiting "
                   "and running: since created, done and dead: since the "
                   "finish, failed: since quarantined)")
    p.add_argument("--force", action="store_true",
                   help="delete running jobs too (their handlers are killed)")
    p.add_argument("--json", action="store_true",
                   help='print {"deleted": N} instead of deleted=N')


def _args_reap(p):
    p.add_argument("--json", action="store_true", help='print {"requeued": N}')


def _args_prune(p):
    p.add_argument("--json", action="store_true",
                   help="print the counts of what was removed as one JSON object")


def _args_check(p):
    p.add_argument("--json", action="store_true",
                   help='one JSON object: {"ok", "spool", "problems"}')
    p.add_argument("--warn-capacity", type=_arg(DURATION), default=3600.0,
                   metavar="DURATION", help="report an outage capacity "
                   "(stats outage_capacity_s) below it (default 1h)")


def _args_policy(p):
    p.add_argument("type", nargs="?", help="a job type")
    p.add_argument("pairs", nargs="*", metavar="KEY=VALUE",
                   help="keys: " + " ".join(sorted(Policy.KEYS)))
    p.add_argument("--default", action="store_true",
                   help="the default rules, for every type without its own "
                   "value (shown as *)")
    p.add_argument("--budget", type=_budget_arg, metavar="SIZE",
                   help="the spool's budget: everything it keeps on its "
                   "filesystem (shown as %s budget=; an empty value removes "
                   "it)" % SPOOL_POLICY)
    p.add_argument("--json", action="store_true",
                   help="the policy as one JSON object")


def _args_pause(p):
    p.add_argument("types", nargs="*", metavar="TYPE", help="job types")
    p.add_argument("--all", action="store_true",
                   help="every type, new ones too (the default rules)")


def _args_resume(p):
    p.add_argument("types", nargs="*", metavar="TYPE", help="job types")
    p.add_argument("--all", action="store_true", help="every paused type")
    p.add_argument("--dest", action="append", default=[], metavar="DEST",
                   help="release this held destination now (as myq stats "
                   "--json shows it under held)")


def _args_export(p):
    p.add_argument("states", nargs="*", metavar="STATE",
                   help="only jobs in these states: %s (default: all but "
                   "failed, which holds files, not jobs)" % ", ".join(STATES))
    p.add_argument("--type", help="only jobs of this type")


def _args_import(p):
    p.add_argument("file", nargs="?", default="-", metavar="FILE",
                   help="JSON lines, as export writes them (default -: "
                   "standard input)")
    p.add_argument("--no-policy", action="store_true", help="leave this "
                   "spool's policy as it is (default: the export's applies)")


def _args_version(p):
    pass


# What the extensions add to the command line (each registers itself):
# the option tables a command's parser takes besides its own (name ->
# [tables]), and the children a supervisor keeps beside its workers (name
# -> (argv(args, spool, o, guards, env): the child's options, checked, or
# None when none is asked for; hold(argv): what it takes as root before
# root is dropped, an object with fileno() and close(), or None)).
_COMMAND_OPTIONS = {}
_CHILDREN = {}


def _declare(p, name, build):
    """Command `name`'s arguments declared to `p` (argparse's parser, or a
    _Spec): the hidden --spool after the command word, the worker options
    (worker, supervise), the guard options, then its own (`build`, its
    builder in _COMMAND_TABLE)."""
    p.add_argument("--spool", dest="spool_sub", help=_SUPPRESS)
    if name in ("worker", "supervise"):
        _add_options(p, WORKER_OPTIONS)
    for table in _COMMAND_OPTIONS.get(name, ()):
        _add_options(p, table)      # (an extension's: intake's)
    if name in _GUARDS_SHOWN:
        _add_options(p, GUARD_OPTIONS, _GUARDS_SHOWN[name])
    build(p)
    return p


# Command line ################################################################
#
# The parser made of _COMMAND_TABLE, the start of a command (its options
# resolved, a worker or supervisor made of them), the commands, each a
# _cmd_ function in _COMMAND_TABLE, and main.


def _parser(only=None):
    """The command line's parser; with `only`, that command's alone
    (building all of them costs a `myq enqueue` 15-30 ms of its ~70)."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def add_argument(self, *flags, **kw):
            if kw.get("help") == _SUPPRESS:     # (argparse asks `is`)
                kw["help"] = argparse.SUPPRESS
            return argparse.ArgumentParser.add_argument(self, *flags, **kw)

        def error(self, message):
            raise UsageError("%s (see: myq %s--help)" % (
                message, self.prog.partition(" ")[2] + " " if " " in self.prog else ""))

    top = Parser(prog="myq", description="A job queue worker for small Linux "
                 "devices: one spool directory, one file per job.")
    top.add_argument("--spool", help="the spool directory (default $MYQ_SPOOL "
                     "or %s)" % DEFAULT_SPOOL)
    top.add_argument("--version", action="version", version="myq " + __version__)
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (_, build, help) in _COMMAND_TABLE.items():
        if only is None or name == only:
            _declare(sub.add_parser(name, help=help, description=help), name,
                     build)
    return top


class _Args(object):
    """What parse_args returns, made by _quick_args."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


_SPECS = {}     # command -> its _Spec, recorded once a process


def _quick_args(argv):
    """parse_args(argv) for the usual forms of a command line, without
    argparse (importing it and building a command's parser cost a `myq
    enqueue` more than the rest of its run, and a worker's start 55 M
    instructions of its 150): [--spool DIR] COMMAND [ARGUMENT]..., as its
    _Spec parses them.  Anything else (--help, --version, an abbreviation,
    a value its option refuses) returns None: argparse parses that, with
    its own errors."""
    spool, i, n = None, 0, len(argv)
    while i < n and argv[i][:1] == "-":
        name, eq, value = argv[i].partition("=")
        if name != "--spool":
            return None
        if not eq:
            if i + 1 == n or argv[i + 1][:1] == "-" and argv[i + 1] != "-":
                return None
            i += 1
            value = argv[i]
        spool = value
        i += 1
    if i == n or argv[i] not in _COMMAND_TABLE:
        return None
    name = argv[i]
    spec = _SPECS.get(name)
    if spec is None:
        spec = _SPECS[name] = _declare(_Spec(), name, _COMMAND_TABLE[name][1])
    got = spec.parse(argv[i + 1:])
    if got is None:
        return None
    got.update(spool=spool, command=name)
    return _Args(**got)


def _resolve(args, table, env):
    """Option values: the flag, else MYQ_<OPTION>, else the default."""
    out = {}
    for flag, typ, default, _ in table:
        dest = flag[2:].replace("-", "_")
        value = getattr(args, dest, None)
        name = "MYQ_" + dest.upper()
        if value is None and env.get(name, "") != "":
            raw = env[name]
            if typ == "append":
                # one header a line ('Authorization: Bearer x' is one);
                # names split on blanks
                value = raw.splitlines() if dest == "http_header" else raw.split()
            elif typ is None:
                try:
                    value = BOOL(raw)
                except ValueError as e:
                    raise UsageError("%s=%s: %s" % (name, raw, e))
            else:
                value = raw
            source = "%s=%s" % (name, raw)
        else:
            source = "%s %s" % (flag, value)
        if value is None:
            value = default
        elif typ not in (None, "append", str):     # a Kind
            try:
                value = typ(value)
            except (ValueError, TypeError) as e:
                raise UsageError("bad value %s: %s" % (source, e))
        out[dest] = value
    return out


def _header_lines(lines, source):
    headers = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip() or " " in name.strip():
            # the line number and the name, never the line: its value is
            # a credential (and stderr may be a log file)
            raise UsageError("bad http header in %s, line %d%s: use 'Name: value'"
                             % (source, n, " (name %r)" % name.strip()[:64]
                                if sep and name.strip() else " (no ':')"))
        headers[name.strip()] = value.strip()
    return headers


def _make_log(o):
    return Log(path=o.get("log"), syslog=o.get("syslog"),
               facility=o.get("syslog_facility"), tag=o.get("syslog_tag"))


# Worker options whose values may be credentials (a header's token, the
# user of a broker): supervise gives them to its workers in their
# environment, which only their user and root can read, never on their
# command line, which every user can (ps, /proc/PID/cmdline).
_SECRET_OPTIONS = ("http_header", "mqtt")


def _secret_env(o):
    """The MYQ_* variables that give a worker the _SECRET_OPTIONS of `o`."""
    env = {}
    for dest in _SECRET_OPTIONS:
        v = o.get(dest)
        if v:
            env["MYQ_" + dest.upper()] = "\n".join(v) if isinstance(v, list) else v
    return env


def _option_argv(o, table, skip=()):
    """The command line that gives a worker the options `o` (resolved
    from flags and MYQ_* variables): what supervise starts its workers
    with, but the options named in `skip`."""
    argv = []
    for flag, typ, default, _ in table:
        dest = flag[2:].replace("-", "_")
        if dest in skip:
            continue
        v = o.get(dest)
        if typ is None:
            if v:
                argv.append(flag)
        elif typ == "append":
            for x in v or ():
                argv += [flag, x]
        elif v is not None and v != default:
            argv += [flag, repr(v) if isinstance(v, float) else str(v)]
    return argv


def _check_worker_options(o):
    """Everything _worker_from() refuses, without starting a worker (nor
    loading a --module: supervise may run as root)."""
    _http_headers(o)
    _check_http_ca(o.get("http_ca"))
    if o["handlers"] and not os.path.isdir(o["handlers"]):
        raise ConfigError("--handlers %s is not a directory" % o["handlers"])
    if o["module"] and not os.path.isfile(o["module"]):
        raise ConfigError("--module %s: no such Python file" % o["module"])
    if o.get("textfile") and not os.path.isdir(o["textfile"]):
        raise ConfigError("--textfile %s is not a directory" % o["textfile"])
    _mqtt_options(o)


def _mqtt_options(o):
    """Worker(...) keyword arguments of the --mqtt options, checked (a bad
    URL: UsageError, an unreadable file: ConfigError)."""
    kw = dict((k, o.get(k)) for k in ("mqtt", "mqtt_password_file",
                                       "mqtt_client_id", "mqtt_ca",
                                       "mqtt_cert", "mqtt_key"))
    if not kw["mqtt"]:
        extra = sorted("--" + k.replace("_", "-") for k, v in kw.items() if v)
        if extra:
            raise UsageError("%s without --mqtt (give the broker: --mqtt "
                             "mqtt://HOST)" % ", ".join(extra))
        return kw
    for name in sorted(_BUILTIN_TYPES):
        check = _BUILTIN_TYPES[name][2]
        if check is not None:
            check(kw)
    return kw


def _http_headers(o):
    headers = {}
    if o["http_headers_file"]:
        try:
            with open(o["http_headers_file"], encoding="utf-8") as f:
                headers.update(_header_lines(f, o["http_headers_file"]))
        except OSError as e:
            raise ConfigError("cannot read --http-headers-file %s: %s"
                              % (o["http_headers_file"], e.strerror))
    headers.update(_header_lines(o["http_header"], "--http-header"))
    return headers


def _check_http_ca(path):
    """--http-ca: a file that the ssl module (where there is one) loads."""
    if not path:
        return
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise ConfigError("cannot read --http-ca %s: %s" % (path, e.strerror))
    try:
        import ssl
    except ImportError:
        return          # https jobs say what is missing
    try:
        ssl.create_default_context().load_verify_locations(cafile=path)
    except (ssl.SSLError, ValueError) as e:
        raise ConfigError("--http-ca %s is not a PEM file of CA certificates "
                          "(%s)" % (path, e))


def _worker_from(spool, o, parent=None):
    headers = _http_headers(o)
    _check_http_ca(o.get("http_ca"))
    if o["handlers"] and not os.path.isdir(o["handlers"]):
        raise ConfigError("--handlers %s is not a directory" % o["handlers"])
    kw = dict((k, o[k]) for k in (
        "concurrency", "lease", "timeout", "max_attempts", "backoff_base",
        "backoff_max", "probe_max", "jitter", "poll", "stats_interval",
        "grace", "pass_env", "scan_cache", "uplink_rate"))
    kw.update(_mqtt_options(o))
    options = WorkerOptions(
        handlers_dir=o["handlers"], module=o["module"], http_headers=headers,
        http_ca=o.get("http_ca"), textfile=o.get("textfile"), parent=parent,
        **kw)
    return Worker(spool, options=options, log=_make_log(o))


def _supervise(args, spool, guards, env):
    o = _resolve(args, WORKER_OPTIONS, env)
    n = args.workers or env.get("MYQ_WORKERS") or "1"
    try:
        n = COUNT(n)
    except ValueError:
        raise UsageError("bad --workers %r: a number >= 1" % n)
    try:
        stop_timeout = SECONDS(args.stop_timeout or "10")
    except ValueError as e:
        raise UsageError("bad value --stop-timeout %s: %s" % (args.stop_timeout, e))
    if args.stop:
        return stop_supervisor(spool, args.pidfile, stop_timeout)
    user = ids = None
    if args.user:
        import pwd
        ids = _user_ids(args.user)
        if ids[0] != os.geteuid():
            if os.geteuid() != 0:
                raise ConfigError("only root can run the workers as %s" % args.user)
            user = pwd.getpwuid(ids[0])
        else:
            ids = None
    spool.require()
    _check_worker_options(o)
    child = _CHILDREN.get("intake")     # (the intake's extension: its argv)
    intake = child[0](args, spool, o, guards, env) if child else None
    if o["mqtt_client_id"] and n > 1 and not intake:
        raise UsageError("--mqtt-client-id with --workers %d: each worker needs "
                         "its own client id (the broker drops a connection when "
                         "another takes its id); leave it out for unique ids" % n)
    if args.dry_run:
        port = child[1](intake) if child else None    # (taken: said)
        if port is not None:
            port.close()
        return 0
    # before the log is open and the caller's stderr replaced: the image
    # started again does both (and a daemon forks from it)
    _IMAGE["give_back_heap"](reexec=True)
    # the intake's port, taken as root now (a port another program took is
    # said at start, not in a restart loop of the intake) and held
    port = child[1](intake) if child else None
    if port is not None:
        intake = intake + ["--listen-fd", str(port.fileno())]
    if o.get("log"):
        _make_log_dir(o["log"], ids)
    log = Log(path=o.get("log"), syslog=o.get("syslog"),
              facility=o.get("syslog_facility"), tag=o.get("syslog_tag"),
              owner=ids)
    ready = None
    if args.daemon:
        pid, ready = fork_daemon(keep=[log.fileno()] + (
            [port.fileno()] if port is not None else []))
        if pid:
            return await_daemon(pid, ready, o.get("log") or "syslog")
    if log.fileno() is not None:        # a traceback lands in the log too
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    if not o["handlers"] and not o["module"]:
        log("warning", problem="no --handlers and no --module: only http%s jobs "
            "have a handler; give MYQ_ARGS=\"--handlers DIR\""
            % (" and mqtt" if o["mqtt"] else ""))
    # with subscriptions, --mqtt-client-id is the intake's (its session)
    wargv = _option_argv(o, WORKER_OPTIONS, skip=_SECRET_OPTIONS + (
        ("mqtt_client_id",) if intake and o.get("mqtt_client_id") else ())) \
        + _option_argv(guards, GUARD_OPTIONS)
    wenv = _clean_env(o["pass_env"], user)
    wenv.update(_secret_env(o))
    return Supervisor(spool, n, wargv, log, user=user, ids=ids,
                      pidfile=args.pidfile, stop_timeout=stop_timeout,
                      env=wenv, ready=ready, intake=intake, entry=_child_entry,
                      keep=[port.fileno()] if port is not None else ()).run()


def _make_log_dir(path, ids):
    """Create the log file's directory when it is missing; for the service
    user (`ids`), handed over through its own descriptor."""
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(d):
        return
    try:
        os.makedirs(d, 0o750)
        if ids is not None:
            fd = _open_dir(d)
            try:
                os.fchown(fd, ids[0], ids[1])
            finally:
                os.close(fd)
    except OSError as e:
        raise ConfigError("cannot create the log directory %s: %s" % (d, e.strerror))


def _proc_uids(pid):
    """The real, effective, saved and filesystem uids of a process (the
    Uid: line of /proc/PID/status), or () when it is gone."""
    for line in (_read_small("/proc/%d/status" % pid, 1 << 14) or b"").splitlines():
        if line.startswith(b"Uid:"):
            try:
                return tuple(int(u) for u in line.split()[1:])
            except ValueError:
                return ()
    return ()


def _is_supervisor(pid, uids):
    """Does `pid` run "myq … --spool DIR supervise" (any DIR, any path) as
    one of `uids` (every one of its uids)?  A command line is anyone's to
    choose; the user a process runs as is not."""
    argv = (_read_small("/proc/%d/cmdline" % pid, 1 << 16) or b"").split(b"\0")
    return b"supervise" in argv and b"--spool" in argv and b"--stop" not in argv \
        and _ours(pid, uids)


def _ours(pid, uids):
    got = _proc_uids(pid)
    return bool(got) and set(got) <= set(uids)


def stop_supervisor(spool, pidfile, timeout=10.0):
    """`myq supervise --stop` (the init script's stop): SIGTERM the
    supervisor named by the pidfile (it stops its workers, SIGKILLs them
    after its own --stop-timeout and reaps), wait for its process group
    (workers left by a supervisor that died stop by themselves when they
    see it gone), SIGKILL what is still there after `timeout` + 5 s, then
    `myq reap` as the spool's owner: claims of killed workers go back and
    their handlers are ended.  A pidfile whose pid now belongs to another
    program: nothing is signalled.  What is signalled or waited for runs
    as root, the caller or the spool's owner (the service user): a
    process of another user is none of the supervisor's, whatever its
    command line.  Exit 0, or 1 when something survived."""
    if not pidfile:
        raise UsageError("supervise --stop needs --pidfile FILE")
    data = _read_small(pidfile, 64)
    pid = int(data.split()[0]) if data and data.split() and data.split()[0].isdigit() \
        else 0
    uids = {0, os.geteuid()}
    try:
        uids.add(os.stat(spool.path).st_uid)
    except OSError:
        pass
    if pid > 1:
        alive = _is_supervisor(pid, uids)
        if alive:
            try:
                os.kill(pid, 15)
            except OSError:
                pass
        elif pid in _proc_table():      # alive, not a zombie
            return 0            # the pid was handed to another program
        # Its process group; of a supervisor that died, only the workers it
        # started (--parent-pid PID): a group of that number may be another
        # program's now, whose leader left (review: an unrelated root
        # daemon was SIGKILLed by a stop on a stale pidfile).
        mark = b"\0--parent-pid\0%d\0" % pid
        end = _mono() + timeout + 5.0
        killed_at = None
        while True:
            group = [p for p, (_, pgrp, _) in _proc_table().items()
                     if pgrp == pid and _ours(p, uids) and (alive or mark in (
                         _read_small("/proc/%d/cmdline" % p, 1 << 16) or b""))]
            if not group:
                break
            if killed_at is None and _mono() >= end:
                for p in group:
                    try:
                        os.kill(p, 9)
                    except OSError:
                        pass
                killed_at = _mono()
            elif killed_at is not None and _mono() - killed_at > 5.0:
                return 1
            time.sleep(0.1)
    import subprocess
    try:
        subprocess.run(_IMAGE["start"]() + ["--spool", spool.path, "reap"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=max(30.0, timeout))
    except (OSError, subprocess.SubprocessError):
        pass
    return 0


def _drop_root(path, command):
    """Root acting in a spool that belongs to another user does it as that
    user: then nothing the owner puts in the spool (a symlink to
    /etc/shadow, a FIFO) can make root read, write, chown or signal
    anything the owner could not.  `init` (which chowns through
    descriptors) and `supervise` (which switches its workers) excepted."""
    if command in ("init", "supervise", "version", "install") or os.geteuid() != 0:
        return
    try:
        st = os.stat(path)
    except OSError:
        return                  # no spool: the command says so
    if st.st_uid != 0:
        become(st.st_uid, st.st_gid)
        if command in ("worker", "intake"):
            _readable_library(st.st_uid)


def _command_index(argv):
    """Where the command word is: after the global options (--spool DIR)."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--spool":
            i += 2
        elif a.startswith("-"):
            i += 1
        else:
            return i
    return len(argv)


def _print(line):
    """One line on stdout; names that are not UTF-8 go out as their bytes."""
    data = (line + "\n").encode("utf-8", "surrogateescape")
    out = getattr(sys.stdout, "buffer", None)
    if out is None:
        sys.stdout.write(data.decode("utf-8", "replace"))
        return
    sys.stdout.flush()
    out.write(data)
    out.flush()


def _cmd_version(a):
    _print("myq " + __version__)


def _cmd_init(a):
    sp = a.spool.init(owner=a.args.owner, store=a.args.store)
    for extend in _ON_INIT:
        extend(sp, a.args)
    if a.args.name is not None:
        sp.set_name(a.args.name)
    if a.args.budget is not None:
        sp.set_policy(SPOOL_POLICY, {"budget": a.args.budget or None})
    low = a.spool.free_problem()
    if low:                 # the spool is there; workers will wait
        sys.stderr.write("myq: warning: %s\n" % low)


def _cmd_enqueue(a):
    args = a.args
    text = sys.stdin.read() if args.payload == "-" else args.payload
    try:
        payload = _decode(text.strip())
    except RecursionError:
        raise InvalidJob("payload nested too deep")
    except ValueError as e:
        raise InvalidJob("payload is not JSON (%s); quote a string as "
                         "'\"text\"'" % e)
    _print(a.spool.enqueue(args.type, payload, id=args.id, delay=args.delay,
                           max_attempts=args.max_attempts, timeout=args.timeout,
                           priority=args.priority, ttl=args.ttl))


def _cmd_policy(a):
    args, sp = a.args, a.spool
    sp.require()
    pairs = list(args.pairs)
    name = args.type
    if args.default:
        if name is not None:
            pairs.insert(0, name)
        name = "*"
    elif name is not None and "=" in name:
        raise UsageError("give the TYPE before KEY=VALUE (or --default for "
                         "every type)")
    if pairs:
        changes = {}
        for pair in pairs:
            k, eq, v = pair.partition("=")
            if not eq:
                raise UsageError("%r is not KEY=VALUE (an empty VALUE removes "
                                 "the key)" % pair)
            if k not in Policy.KEYS:
                Policy.value(k, v)          # the error that names the keys
            changes[k] = v if v != "" else None
        sp.set_policy(name, changes)
    if args.budget is not None:
        sp.set_policy(SPOOL_POLICY, {"budget": args.budget or None})
    sp.policies._pol_next = 0.0
    pol = sp.policy()
    if sp.policy_error and not pairs:
        sys.stderr.write("myq: %s\n" % sp.policy_error)
    if name is not None:
        pol = {name: pol.get(name, {})} if name in pol or pairs else {}
    if args.json:
        _print(json.dumps(pol, sort_keys=True))
        return
    for t in sorted(pol, key=lambda t: (t != "*", t)):
        _print(" ".join([t] + ["%s=%s" % (k, Policy.show(k, v))
                               for k, v in sorted(pol[t].items())]))


def _cmd_pause(a):
    args, sp = a.args, a.spool
    if not args.types and not args.all:
        raise UsageError("give the types to pause, or --all")
    for t in (["*"] if args.all else []) + args.types:
        sp.set_policy(t, {"paused": True})


def _cmd_resume(a):
    args, sp = a.args, a.spool
    if not (args.types or args.all or args.dest):
        raise UsageError("give the types to resume, --all, or --dest DEST")
    sp.require()
    if args.all:
        for t in list(sp.policy()):
            if "paused" in sp.policy()[t]:
                sp.set_policy(t, {"paused": None})
    for t in args.types:
        sp.set_policy(t, {"paused": None})
        if sp.rules(t).get("paused"):       # the default pauses every type
            sp.set_policy(t, {"paused": False})
    missing = []
    for dest in args.dest:
        if sp.breaker.record(dest) is None:
            missing.append(dest)
            continue
        sp.breaker.release(dest)
    if missing:
        raise NoSuchJob("no held destination %s (see: myq --spool %s stats "
                        "--json, under held)" % (", ".join(missing), sp.path))


def _cmd_worker(a):
    o = _resolve(a.args, WORKER_OPTIONS, a.env)
    a.spool.require()
    if o["textfile"] and not os.path.isdir(o["textfile"]):
        raise ConfigError("--textfile %s is not a directory" % o["textfile"])
    w = _worker_from(a.spool, o, a.args.parent_pid)
    _IMAGE["give_back_heap"](reexec=not (o["once"] or o["drain"]))
    return w.run(once=o["once"], drain=o["drain"])


def _cmd_supervise(a):
    return _supervise(a.args, a.spool, a.guards, a.env)


def _cmd_stats(a):
    if a.args.json and a.args.prometheus:
        raise UsageError("give --json or --prometheus, not both")
    a.spool.require()
    a.spool._check_readable()
    if a.args.json:
        _print(json.dumps(a.spool.stats(), sort_keys=False))
    elif a.args.prometheus:
        _print(prometheus_text(a.spool.stats(by_type=True)).rstrip("\n"))
    else:
        _print(a.spool.status_line())


def _cmd_list(a):
    a.spool.require()
    a.spool._check_readable()
    n = 0
    for job in a.spool.list(a.args.state):
        if a.args.type is not None and job.get("type") != a.args.type:
            continue
        if a.args.limit is not None and n >= a.args.limit:
            break
        n += 1
        if a.args.json:
            _print(json.dumps(job))
            continue
        line = "%s %s %s attempts=%s" % (
            _kv(job["id"]), job["state"], job.get("type") or "-",
            job.get("attempts") if job.get("attempts") is not None else "-")
        held = job.get("held")
        if held:
            line += " held_until=%s dest=%s" % (
                iso(held.get("until") or 0, False), _kv(_plain(held["dest"])))
        elif job.get("available_at"):
            line += " available_at=" + iso(job["available_at"], False)
        if job.get("last_error"):

            line += " last_error=" + _kv(job["last_error"])
        _print(line)


_TIMES = ("created_at", "updated_at", "available_at", "failed_at", "expires_at")


def _cmd_show(a):
    a.spool.require()
    job = a.spool.show(a.args.id)
    # the stored epoch seconds, and beside them the same in ISO 8601 UTC
    # (as `list` prints them)
    iso_times = dict((k, iso(job[k])) for k in _TIMES if _is_num(job.get(k)))
    if iso_times:
        job["iso"] = iso_times
    _print(json.dumps(job, ensure_ascii=False, indent=1))


def _cmd_retry(a):
    if not a.args.ids and not a.args.all:
        raise UsageError("retry needs job ids or --all")
    n = a.spool.retry(a.args.ids, all=a.args.all, now=a.args.now)
    _print(json.dumps({"retried": n}) if a.args.json else "retried=%d" % n)


def _cmd_delete(a):
    args = a.args
    if args.state is None:
        if args.type is not None or args.older_than is not None:
            raise UsageError("--type and --older-than go with --state STATE")
        if not args.ids:
            raise UsageError("delete needs job ids, or --state STATE")
        n = a.spool.delete(args.ids, force=args.force)
    elif args.ids:
        raise UsageError("give job ids or --state STATE, not both")
    else:
        if args.older_than is not None and not args.older_than >= 0:
            raise UsageError("--older-than must be a duration >= 0")
        n = a.spool.delete_where(args.state, type=args.type,
                                 older_than=args.older_than, force=args.force)
    _print(json.dumps({"deleted": n}) if args.json else "deleted=%d" % n)


def _cmd_reap(a):
    n = a.spool.reap()
    _print(json.dumps({"requeued": n}) if a.args.json else "requeued=%d" % n)


def _cmd_prune(a):
    out = a.spool.prune()
    _print(json.dumps(out) if a.args.json else
           " ".join("%s=%d" % kv for kv in out.items()))


def _cmd_check(a):
    problems = a.spool.check()
    try:
        short = a.spool.budget.capacity_problem(a.args.warn_capacity)
    except (OSError, MyqError):
        short = None
    problems += [short] if short else []
    if a.args.json:
        _print(json.dumps({"ok": not problems, "spool": a.spool.path,
                           "problems": problems}))
        return 1 if problems else 0
    for p in problems:
        _print(_plain(p))
    if problems:
        return 1

    _print("ok spool=%s" % a.spool.path)


def _cmd_export(a):
    skipped = []

    def skip(path, why):
        skipped.append(path)
        sys.stderr.write("myq: skipped %s: %s\n" % (
            _plain(path), _plain(why)))
    out = getattr(sys.stdout, "buffer", None)
    sys.stdout.flush()
    line = a.spool.backlog.spool_line(a.args.type)
    chunk = [dumps(line)] if line else []
    if a.spool.policy_error:
        sys.stderr.write("myq: warning: %s; the export carries no policy\n"
                         % a.spool.policy_error)
    for job in a.spool.export(a.args.states, a.args.type, skip):
        chunk.append(dumps(job))
        if len(chunk) >= 256:
            _write_out(out, chunk)
    _write_out(out, chunk)
    if skipped:
        sys.stderr.write("myq: %d file(s) skipped: not jobs (a worker "
                         "quarantines them; see: myq list failed)\n"
                         % len(skipped))
        return EX_DATAERR


def _write_out(out, chunk):
    data = b"".join(chunk)
    del chunk[:]
    if out is None:
        sys.stdout.write(data.decode("utf-8", "replace"))
        sys.stdout.flush()
    else:
        out.write(data)
        out.flush()


def _cmd_import(a):
    name = a.args.file
    try:
        f = sys.stdin.buffer if name == "-" else open(name, "rb")
    except OSError as e:
        raise NoSuchJob("cannot read %s: %s" % (name, e.strerror))

    def refuse(n, why):
        sys.stderr.write("myq: line %d: %s; not imported\n" % (n, _plain(why)))
    try:
        counts = a.spool.backlog.import_jobs(_bounded_lines(
            f, a.spool.opt["max_job_bytes"] + 65536), refuse,
            policy=not a.args.no_policy)
    except SpoolFull as e:
        c = getattr(e, "counts", None)
        if c is None:
            raise
        sys.stderr.write("myq: %s; not imported from line %d on (free space, "
                         "then run the same import again: what was imported "
                         "is refused as duplicate)\n" % (e, e.line))
        _import_counts(c)
        return EX_TEMPFAIL
    finally:
        if f is not sys.stdin.buffer:
            f.close()
    _import_counts(counts)
    return EX_TEMPFAIL if counts["refused"] else EX_DATAERR if counts["bad"] \
        else EX_CANTCREAT if counts["duplicate"] else 0


def _bounded_lines(f, limit):
    """The lines of binary file `f`, none held longer than `limit` bytes:
    a longer one is read past (in pieces) and given as the InvalidJob
    that import counts bad (a 64 MB line was a MemoryError)."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        size = len(line)
        while not line.endswith(b"\n"):
            line = f.readline(1 << 16)
            if not line:
                break
            size += len(line)
        yield InvalidJob("a line of %d bytes, longer than a job may be "
                         "(--max-job-bytes + 64 KiB: %d); skipped" % (size, limit))


def _import_counts(c):
    sys.stderr.write("myq: imported %d, duplicate %d, bad %d%s\n" % (
        c["imported"], c["duplicate"], c["bad"],
        ", refused %d" % c["refused"] if c["refused"] else ""))
    if c.get("policy"):
        sys.stderr.write("myq: policy applied: %s\n" % " ".join(c["policy"]))
    if c.get("queue"):
        sys.stderr.write("myq: queue name kept: %s\n" % c["queue"])


# The commands: name -> (its function, its parser builder, its help), in
# the order --help lists them.
_COMMAND_TABLE = {
    "init": (_cmd_init, _args_init,
             "create the spool and its layout (idempotent)"),
    "enqueue": (_cmd_enqueue, _args_enqueue, "add a job; prints its id"),
    "worker": (_cmd_worker, _args_worker, "run jobs"),
    "supervise": (_cmd_supervise, _args_supervise,
                  "run and restart N workers (for the init script)"),
    "stats": (_cmd_stats, _args_stats, "print the status line"),
    "list": (_cmd_list, _args_list, "list jobs"),
    "show": (_cmd_show, _args_show, "print one job as JSON"),
    "retry": (_cmd_retry, _args_retry,
              "bring dead (or repaired failed) jobs back"),
    "delete": (_cmd_delete, _args_delete, "remove jobs"),
    "reap": (_cmd_reap, _args_reap,
             "requeue claims of dead workers and expired leases"),
    "prune": (_cmd_prune, _args_prune, "apply retention now"),
    "check": (_cmd_check, _args_check,
              "health: layout, permissions, free space, stale claims, and "
              "what needs an operator (exit 1, one line per problem)"),
    "policy": (_cmd_policy, _args_policy,
               "show or set the per-type rules (TYPE KEY=VALUE ...; an empty "
               "VALUE removes the key)"),
    "pause": (_cmd_pause, _args_pause,
              "no new job of these types starts (running ones finish)"),
    "resume": (_cmd_resume, _args_resume,
               "undo pause; or release a held destination now"),
    "export": (_cmd_export, _args_export,
               "write jobs as JSON lines, each with its state"),
    "import": (_cmd_import, _args_import,
               "add the jobs of export's lines, keeping their states; "
               "ids the spool has are refused"),
    "version": (_cmd_version, _args_version, "print the version"),
}
# (and the extensions' commands, each registered by its section: intake,
# install)


class _Call(object):
    """What a command function gets: the parsed args, the spool, the
    resolved guard options and the environment."""

    def __init__(self, args, spool, guards, env):
        self.args, self.spool, self.guards, self.env = args, spool, guards, env


def _child_entry(words):
    """The supervisor's children (Supervisor._spawn): `words` parsed now,
    in the supervisor, and a function that runs them, in the child: its
    parser is not built again in every child (~1.4 MiB of pages each
    child would copy).  None when they do not parse."""
    args = _quick_args(words)
    if args is None:
        i = _command_index(words)
        try:
            args = _parser(words[i] if i < len(words) else None).parse_args(words)
        except SystemExit:
            return None
    return lambda: main(words, args)


def main(argv=None, parsed=None):
    """The command line; returns the exit status (never calls sys.exit).
    `parsed`: argv already parsed (_child_entry)."""
    if argv is None:
        # This process's own command line: myq is the program.  What the
        # import made (~1,000 functions, their classes and dicts) lives
        # until the exit; frozen (out of every collection), the collector
        # stops walking it at each full collection, and at the exit's 3-4
        # (8.6 M instructions of a 62.7 M `myq enqueue`, issue 42).  Not
        # for a caller's main(argv): its garbage is not ours to keep.
        gc.freeze()
    own = argv is None
    argv = sys.argv[1:] if own else list(argv)
    env = os.environ
    try:
        args = parsed if parsed is not None else _quick_args(argv)
        if args is None:
            i = _command_index(argv)
            only = argv[i] if i < len(argv) and argv[i] in _COMMAND_TABLE else None
            try:
                args = _parser(only).parse_args(argv)
            except SystemExit as e:         # --help, --version
                return e.code if isinstance(e.code, int) else 0
        path = getattr(args, "spool_sub", None) or args.spool \
            or env.get("MYQ_SPOOL") or DEFAULT_SPOOL
        guards = {}
        if args.command in _GUARDS_SHOWN:
            guards = _resolve(args, GUARD_OPTIONS, env)
        _drop_root(path, args.command)
        spool = open_store(path, **guards)
        fn = _COMMAND_TABLE[args.command][0]
        try:
            return fn(_Call(args, spool, guards, env)) or 0
        finally:
            # what the command opened (the SQLite store's connection: a
            # cycle that only a full collection would close) is closed
            # now: a caller's main(argv) goes on after it, and the
            # launcher's exit (end) leaves nothing to a finalizer
            spool.close()
    except MyqError as e:
        msg = str(e).replace("\n", " ")
        sys.stderr.write("myq: %s\n" % msg)
        return e.code
    except BrokenPipeError:
        # `myq list | head -1`: the reader has what it wanted.  Python
        # would complain again when it flushes stdout at exit.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        except OSError:
            pass
        return 0
    except OSError as e:
        where = (" (%s)" % e.filename) if getattr(e, "filename", None) else ""
        sys.stderr.write("myq: %s%s; nothing was changed by the failing step, "
                         "try again\n" % (e.strerror or e, where))
        return EX_TEMPFAIL
    except KeyboardInterrupt:
        return 130


# =============================================================================
# PART II: THE EXTENSIONS
#
# Each uses Part I and registers itself in its tables; remove one (and
# its registration) and the core still runs.
# =============================================================================

# The SQLite store: its database ##############################################
#
# A spool made by `myq init --store sqlite` keeps its jobs in one database
# file, SPOOL/queue.db (WAL), the rest as for files: locks/ (workers,
# holds, rates, the wake FIFO), tmp/ and incoming/ as the drop box of shell
# producers, failed/ for what is not a job.  The same Spool and Claims
# interface, so that the worker, policy, the breaker, the handlers and the
# command line do not know which store holds their jobs (myq-spool(5)
# SQLITE STORE has the schema).  sqlite3 is imported only here, for such a
# spool: OpenWrt ships it apart (python3-sqlite3).

DB_NAME = "queue.db"
CLEAN_MARK = "db-clean"     # in locks/: the last worker stopped cleanly
SMALL_LOG = 4           # pages the log is checkpointed at below a guard
DB_BUSY = 5.0           # seconds a busy database is waited for (then exit 75;
                        # MYQ_DB_BUSY)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs(
    id TEXT PRIMARY KEY,
    queue TEXT NOT NULL,
    type TEXT,
    payload TEXT,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER,
    available_at REAL NOT NULL,
    leased_until REAL,
    worker_id TEXT,
    last_error TEXT,
    created_at REAL,
    updated_at REAL,
    priority INTEGER,
    lane TEXT NOT NULL DEFAULT 'incoming',
    token TEXT,
    lease TEXT,
    finished_at REAL,
    size INTEGER,
    extra TEXT);
CREATE INDEX IF NOT EXISTS idx_jobs_ready ON jobs(queue, lane, available_at, id)
    WHERE status='ready';
CREATE INDEX IF NOT EXISTS idx_jobs_claimed ON jobs(token)
    WHERE status='processing';
CREATE TABLE IF NOT EXISTS ok(id TEXT PRIMARY KEY, at REAL NOT NULL);
"""

# The job's fields that have a column of their own; the rest (timeout,
# expires_at, failures, failed_at, batch_of, ...) are kept in `extra`.
_JOB_COLS = ("id", "type", "payload", "attempts", "max_attempts",
             "available_at", "last_error", "created_at", "updated_at",
             "priority")
_SELECT_COLS = _JOB_COLS + ("extra", "status", "lane", "lease", "finished_at",
                            "token")
_SELECT = "SELECT %s FROM jobs" % ", ".join(_SELECT_COLS)
# A new job of the usual shape (new_job's keys, no options: SqlStore.enqueue):
# (id, queue, type, payload, its time, size), the time bound once for its
# three columns (a value bound costs more than a column that repeats one)
_INSERT_NEW = ("INSERT INTO jobs(id, queue, type, payload, status, attempts, "
               "available_at, created_at, updated_at, lane, size) "
               "VALUES(?1, ?2, ?3, ?4, 'ready', 0, ?5, ?5, ?5, 'incoming', ?6)")
_NEW_SIZE = len(_NEW_FORMAT) - 2 * _NEW_FORMAT.count("%s")
# A claim: the row still ready in its lane, the claimer's token and lease
_CLAIM = ("UPDATE jobs SET status='processing', worker_id=?, token=?, "
          "lease=?||(attempts+1)||?, leased_until=? WHERE id=? AND "
          "status='ready' AND lane=? AND available_at<=?")
# A success: the row still the claimer's
_SUCCESS = ("UPDATE jobs SET status='done', attempts=?, finished_at=?, "
            "updated_at=?, token=NULL, worker_id=NULL, leased_until=NULL WHERE "
            "id=? AND status='processing' AND token=?")
# (what _job_of_row reads, no more: the lease the claim just wrote, its
# token and its status are known; each column returned is a Python object)
_CLAIM_RETURNING = _CLAIM + " RETURNING " + ", ".join(_JOB_COLS + ("extra",))
# Several claims in one statement (a batch's: _SqlClaims.claim_many): each
# row's token, lease head and due bound from a table of VALUES (id, tok,
# pre, due), joined by id (UPDATE ... FROM: SQLite 3.33; RETURNING: 3.35)
_CLAIM_MANY = ("UPDATE jobs SET status='processing', worker_id=?, token=v.tok, "
               "lease=v.pre||(jobs.attempts+1)||?, leased_until=? FROM (SELECT "
               "column1 AS id, column2 AS tok, column3 AS pre, column4 AS due "
               "FROM (VALUES %s)) AS v WHERE jobs.id=v.id AND jobs.status="
               "'ready' AND jobs.lane=? AND jobs.available_at<=v.due RETURNING "
               + ", ".join(_JOB_COLS + ("extra", "token")))


def _sqlite3():
    """The sqlite3 module, or ConfigError (exit 78) naming the package."""
    try:
        import sqlite3
    except ImportError:
        raise ConfigError(
            "this spool keeps its jobs in SQLite (queue.db) and this Python "
            "has no sqlite3 module; install it (OpenWrt: opkg install "
            "python3-sqlite3), or move the jobs to a spool of files on a "
            "machine that has it (myq export | myq import)")
    return sqlite3


class _DbError(OSError, SpoolBusy):
    """The database said no (busy, full, read-only, damaged): an OSError
    to the worker (it backs off and tries again, as for any I/O error), a
    MyqError with its exit status to a command."""
    code = EX_TEMPFAIL

    def __str__(self):
        return self.strerror or OSError.__str__(self)


class _DbFull(_DbError, SpoolFull):
    pass


class _DbDamaged(_DbError):
    code = EX_CONFIG


class _DbDenied(ConfigError):
    """queue.db (or its -wal, -shm) out of this user's reach: another
    owner's (myq-spool(5) OWNERSHIP), said with the chown that fixes it."""


def _db_error(sp, e):
    """The _DbError for sqlite3's exception `e` on spool `sp`."""
    msg = str(e)
    low = msg.lower()
    db = sp.d(DB_NAME)
    if "full" in low or ("i/o" in low and _fs_full(db)):
        # (a full disk fails the log index's first page as an I/O error)
        return _DbFull(errno.ENOSPC, "%s: %s; the disk is full: free some "
                       "space (myq prune)" % (db, msg))
    if "locked" in low or "busy" in low:
        return _DbError(errno.EBUSY, "%s is busy (another process held its "
                        "write lock for %gs): %s; try again" % (db, parse_seconds(
                            os.environ.get("MYQ_DB_BUSY") or DB_BUSY), msg))
    if "malformed" in low or "not a database" in low or "corrupt" in low \
            or "no such table" in low:      # (emptied: no schema)
        sp.damaged = msg
        return _DbDamaged(errno.EIO, "%s is damaged (%s): no job is claimed "
                          "from it; save what can be read with myq --spool %s "
                          "export > jobs.jsonl, then make a new spool and "
                          "import them" % (db, msg, sp.path))
    if "readonly" in low or "read-only" in low or _read_only_fs(db):
        return _DbError(errno.EROFS, "%s is read-only (%s): nothing can be "
                        "written to it; check the filesystem (mounted "
                        "read-only?) and the file's owner" % (db, msg))
    return _DbError(errno.EIO, "%s: %s" % (db, msg))


def _cloexec_files(prefix):
    """Close-on-exec for this process's descriptors of the files whose
    path starts with `prefix` (SQLite opens its database, log and index
    without it): a handler started by exec inherits none of them."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for n in names:
        try:
            if os.readlink("/proc/self/fd/" + n).startswith(prefix):
                os.set_inheritable(int(n), False)
        except (OSError, ValueError):
            pass


def _fs_full(path):
    """No block left for this user on the filesystem of `path`."""
    try:
        return os.statvfs(path).f_bavail == 0
    except OSError:
        return False


def _read_only_fs(path):
    try:
        return bool(os.statvfs(path).f_flag & getattr(os, "ST_RDONLY", 1))
    except OSError:
        return False


def _wal_bytes(pages):
    """The bytes of a log of `pages` 1 KiB pages (its header, a frame's)."""
    return 32 + pages * (1024 + 24) if pages else 0


def _row_values(sp, job, status, lane, now, **more):
    """The columns of a job's row (a dict), its other fields in `extra`."""
    extra = dict((k, v) for k, v in job.items()
                 if k not in _JOB_COLS and k not in ("lease", "state"))
    v = dict((k, job.get(k)) for k in _JOB_COLS)
    v["payload"] = _encode_value(job.get("payload"))
    v.update(queue=sp.name, status=status, lane=lane,
             extra=_encode_value(extra) if extra else None)
    if v["updated_at"] is None:
        v["updated_at"] = now
    v.update(more)
    if v.get("size") is None:
        v["size"] = len(dumps(job))     # (what its file would hold)
    return v


def _row_of(values):
    """A row of _SELECT made of _row_values' dict."""
    return tuple(values.get(k) for k in _SELECT_COLS)


_USUAL = ((str, int, float, str, float, float),
          (str, int, float, type(None), float, float))


def _job_of_row(row):
    """The job (a dict, normalised) of a row of _SELECT; a row is checked
    when written (queue.db is the owner's alone), so one of the usual
    shape (myq's types, no `extra`) is taken as it is."""
    if row[10] is None and row[4] is None and row[9] is None and (
            row[1].__class__, row[3].__class__, row[5].__class__,
            row[6].__class__, row[7].__class__, row[8].__class__) in _USUAL:
        try:
            payload = _decode(row[2]) if row[2] is not None else None
        except (ValueError, RecursionError) as e:
            raise InvalidJob("its row holds bad JSON: %s" % e)
        return {"id": row[0], "type": row[1], "payload": payload,
                "attempts": row[3], "available_at": row[5], "last_error":
                row[6], "created_at": row[7], "updated_at": row[8]}
    try:
        job = _decode(row[10]) if row[10] else {}
        payload = _decode(row[2]) if row[2] is not None else None
    except (ValueError, RecursionError) as e:
        raise InvalidJob("its row holds bad JSON: %s" % e)
    if not isinstance(job, dict):
        raise InvalidJob("its row's extra is not a JSON object")
    for k, v in zip(_JOB_COLS, row):
        if v is not None or k in ("payload", "last_error"):
            job[k] = v
    job["payload"] = payload
    return normalize(job)


class _SqlDb(object):
    """A SQLite store's database: this process's connection to queue.db
    and its statements, one at a time (`mutex`), each a transaction of its
    own (write) or several in one (tx), durable at their commit or at the
    log's next fsync (`sync`); the log's limits (the budget's cap, a small
    log below a guard).  `store`: its spool (paths, require, the owner's
    hints, what a damaged database marks)."""

    def __init__(self, store):
        self.store = store
        self.conn = self.conn_pid = self.sync = None
        self.commits = self.fresh = 0     # commits, those that added ready rows
        self.mutex = _thread.allocate_lock()     # one statement at a time
        self.cap_set = 0        # the log's limit set on this connection
        self.small = False      # the log kept small (below a guard)
        self.ret = None         # UPDATE ... RETURNING known (SQLite 3.35)
        self._g = None          # the last look at others' commits (look)
        self._ins = None        # the usual enqueue's cursor (insert_new)

    def connection(self):
        """This process's connection (a forked child makes its own; its
        parent's is kept, never closed: see _FORKED_DBS)."""
        db = self.conn
        if db is not None and self.conn_pid == _PID[0]:
            return db
        if db is not None:
            _FORKED_DBS.append(db)
            self.conn = None
        sqlite3 = _sqlite3()
        self.store.require()
        path = self.store.d(DB_NAME)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError("%s is not a regular file (%s); move it away "
                                  "and restore the database" % (
                                      path, _file_kind(st.st_mode)))
            if not os.access(path, os.R_OK) and os.geteuid() == \
                    os.stat(self.store.path).st_uid:
                # the spool's owner, the database another's (an owner
                # changed: MYQ_USER): the chown that gives it back
                raise _DbDenied(
                    "%s cannot be used by uid %d (permission denied); give "
                    "the spool to its owner: %s" % (
                        path, os.geteuid(), self.store.chown_fix()))
            if not os.access(path, os.R_OK):
                raise ConfigError(
                    "permission denied: %s is the spool's owner's alone (a "
                    "producer could lock it); producers enqueue (myq enqueue, "
                    "or a file in incoming/), the rest is the owner's: run "
                    "myq as the owner%s or root" % (path, self.store._owner_hint()))
            busy = parse_seconds(os.environ.get("MYQ_DB_BUSY") or DB_BUSY)
            try:
                db = self._connect(sqlite3, path, busy, False)
            except sqlite3.Error:
                if not _read_only_fs(path):
                    raise
                db = self._connect(sqlite3, path, busy, True)
        except OSError as e:
            raise _DbError(e.errno, "%s: %s" % (path, e.strerror))
        except sqlite3.Error as e:
            for p in (path, path + "-wal", path + "-shm"):
                if _lexists(p) and not os.access(p, os.R_OK | os.W_OK):
                    raise _DbDenied(
                        "%s cannot be used by uid %d (permission denied); give "
                        "the spool to its owner: %s" % (
                            p, os.geteuid(), self.store.chown_fix()))
            raise _db_error(self.store, e)
        self.conn, self.conn_pid, self.sync = db, _PID[0], True
        return db

    def _connect(self, sqlite3, path, busy, read_only):
        """A connection to queue.db; `read_only` (its filesystem is mounted
        so): immutable, which reads what queue.db holds without the log and
        index WAL needs to write, and so only when the log holds nothing
        (it would be missed)."""
        if read_only:
            if os.path.exists(path + "-wal") and os.path.getsize(path + "-wal"):
                raise _DbError(errno.EROFS, "%s is on a read-only filesystem and "
                               "its log (-wal) holds commits not yet in it; mount "
                               "it read-write, or copy the spool elsewhere, to "
                               "read them" % path)
            db = sqlite3.connect("file:%s?immutable=1" % path, uri=True,
                                 timeout=busy, isolation_level=None,
                                 check_same_thread=False)
        else:
            db = sqlite3.connect(path, timeout=busy, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA synchronous=FULL")
        db.execute("SELECT 1 FROM jobs LIMIT 0").fetchall()    # (-wal, -shm)
        _cloexec_files(path)
        if not read_only:
            self.cap_set = 0     # (a new connection)
            self.log_limits(db)
        return db

    def tx(self, fn, sync=True, fresh=False):
        """fn(db) in one write transaction (BEGIN IMMEDIATE ... COMMIT),
        durable at its commit with `sync` (synchronous=FULL), else at the
        next fsync of the log (claims.commit, or a durable commit).
        `fresh`: it may add waiting rows (a lane the scheduler must learn)."""
        sqlite3 = _sqlite3()
        with self.mutex:
            db = self.connection()
            try:
                self._synced(db, sync)
                db.execute("BEGIN IMMEDIATE")
                try:
                    out = fn(db)
                    if _hook is not None:       # (the crash points' seam)
                        _hook("commit", self.store.d(DB_NAME), "before")
                    db.execute("COMMIT")
                    self._after_commit(fresh)
                    if _hook is not None:
                        _hook("commit", self.store.d(DB_NAME), "after")
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
                return out
            except sqlite3.Error as e:
                raise _db_error(self.store, e)

    def _synced(self, db, sync):
        """The next commit durable at once (FULL) or at the next fsync of
        the log (NORMAL): a connection's setting, changed only when it must."""
        if self.sync != sync:
            db.execute("PRAGMA synchronous=%s" % ("FULL" if sync else "NORMAL"))
            self.sync = sync

    def _after_commit(self, fresh):
        self.commits += 1
        if fresh:
            self.fresh += 1
        if self.commits == 1:      # (the log, made by a write)
            _cloexec_files(self.store.d(DB_NAME))

    def write(self, sql, args=(), sync=True, fresh=False, rows=False):
        """One statement in its own transaction (autocommit: a write
        statement takes the write lock at its start): the rows it changed,
        or with `rows`, what it returned."""
        if _hook is not None:           # (the crash points see its commit)
            return self.tx(lambda db: db.execute(sql, args).fetchall() if rows
                           else db.execute(sql, args).rowcount, sync, fresh)
        with self.mutex:
            # (every enqueue, claim and success: the usual case spelt out)
            db = self.conn
            if db is None or self.conn_pid != _PID[0]:
                db = self.connection()
            try:
                if self.sync != sync:
                    self._synced(db, sync)
                cur = db.execute(sql, args)
                out = cur.fetchall() if rows else cur.rowcount
            except _sqlite3().Error as e:       # (looked up on an error alone)
                raise _db_error(self.store, e)
            self._after_commit(fresh)
            return out

    def insert_new(self, args, sync):
        """write() of the usual enqueue's INSERT (_INSERT_NEW's `args`), by
        a cursor kept for it (one made a statement: 2,500 instructions of
        a job's 95,000)."""
        if _hook is not None:
            return self.write(_INSERT_NEW, args, sync, fresh=True)
        mutex = self.mutex
        mutex.acquire()         # (not `with`: its two bound methods a job)
        try:
            db = self.conn
            if db is None or self.conn_pid != _PID[0]:
                db = self.connection()
            cur = self._ins
            if cur is None or cur.connection is not db:
                cur = self._ins = db.cursor()
            try:
                if self.sync != sync:
                    self._synced(db, sync)
                cur.execute(_INSERT_NEW, args)
            except _sqlite3().Error as e:       # (looked up on an error alone)
                raise _db_error(self.store, e)
            self.commits += 1                   # (_after_commit's)
            self.fresh += 1
            if self.commits == 1:
                _cloexec_files(self.store.d(DB_NAME))
        finally:
            mutex.release()

    def all(self, sql, args=()):
        sqlite3 = _sqlite3()
        with self.mutex:
            try:
                return self.connection().execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise _db_error(self.store, e)

    def one(self, sql, args=()):
        rows = self.all(sql, args)
        return rows[0] if rows else None

    def returning(self):
        """Does this SQLite know UPDATE ... RETURNING (3.35), and may a claim
        be one statement (no crash point wants to see its commit)?"""
        r = self.ret
        if r is None:
            r = self.ret = _sqlite3().sqlite_version_info >= (3, 35, 0)
        return r and _hook is None

    def version(self):
        """Changes when anything commits: another connection (PRAGMA
        data_version, which its own commits leave alone) or this one."""
        return self.one("PRAGMA data_version")[0], self.fresh

    def look(self, poked=False):
        """What other processes committed since the last look, at most every
        50 ms here (or at once after a producer's poke), as (when to look
        again, PRAGMA data_version, max(rowid), the generation of every
        lane, {lane: generation of its own}, when a change next makes a new
        generation of every lane).  Rows added alone (the rowids past the
        last look's: a producer's) move on the lanes they went to; anything
        else (a commit that added no row, a rowid used again) all of them,
        and so does any change 10 s after the last time it did: another
        process's commit that both added rows and changed others unpoked
        (a worker's own put back) is seen within that."""
        now, g = _mono(), self._g
        if g is not None and now < g[0] and not poked:
            return g
        v = self.one("PRAGMA data_version")[0]
        if g is not None and v == g[1]:
            g = self._g = (now + 0.05,) + g[1:]
            return g
        top = self.one("SELECT max(rowid) FROM jobs")[0] or 0
        if g is None or top <= g[2] or now >= g[5]:
            g = (now + 0.05, v, top, g[3] + 1 if g else 0, {}, now + 10.0)
        else:
            per = dict(g[4])
            for (lane,) in self.all("SELECT DISTINCT lane FROM jobs WHERE "
                                    "rowid>?", (g[2],)):
                per[lane] = per.get(lane, 0) + 1
            g = (now + 0.05, v, top, g[3], per, g[5])
        self._g = g
        return g

    def log_limits(self, db):
        """With a budget, the log is checkpointed at a 32nd of it (16 to
        1,000 pages; SQLite's 1,000 without one) and cut back to that
        after: what the workers' commits write there stays within what
        measure() counts for it.  (Below a guard, small_log's SMALL_LOG.)"""
        cap = self.wal_cap()
        if cap == self.cap_set:
            return
        try:
            small = self.small
            db.execute("PRAGMA wal_autocheckpoint=%d" % (
                SMALL_LOG if small else cap or 1000))
            db.execute("PRAGMA journal_size_limit=%d" % (
                _wal_bytes(cap) if cap else -1)).fetchall()
            self.cap_set = cap
        except _sqlite3().Error:
            pass                # (the next walk tries again)

    def wal_cap(self):
        b = self.store.budget.budget_bytes()
        return None if b is None else max(16, min(1000, b // 32768))

    def small_log(self, small):
        """Below a guard (make_space) the log is checkpointed at SMALL_LOG
        pages, not SQLite's 1,000 (a MiB it would need free), and at once:
        its next commits go to its own first blocks, not to new ones the
        full disk no longer has; back to 1,000 (or the budget's cap) once
        the reserve is set aside again (keep_room).  (What the reserve
        gives a full disk, 64 KiB, is half the log's index (-shm, 32 KiB);
        the rest holds the log and the rows the backlog's jobs leave done:
        at 16 pages, a log of a claim's and a finish's frames, three
        indexes' pages each, took most of it.)"""
        if not small and not self.small:
            return
        with self.mutex:
            try:
                db = self.connection()
                db.execute("PRAGMA wal_autocheckpoint=%d" % (
                    SMALL_LOG if small else self.wal_cap() or 1000))
                if small:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                self.small = small
            except (_sqlite3().Error, MyqError):
                pass            # (best effort: the next call tries again)

    def vacuum(self):
        """Free pages back to the filesystem (auto_vacuum=INCREMENTAL), and
        the log's pages into the database (a checkpoint).  A checkpoint
        that finds another running (a producer's commit past the log's
        cap starts one) returns busy at once, not after the busy wait: it
        is tried again, for up to a tenth of DB_BUSY.  Without that, four
        producers at the budget kept the log growing past it, and the
        walk shed every row and still refused."""
        with self.mutex:
            db = self.connection()
            try:
                # (sqlite3_exec, which steps it to its end: execute() and
                # fetchall() step it once, and free one page)
                db.executescript("PRAGMA incremental_vacuum;")
                until = time.monotonic() + DB_BUSY / 10
                while db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall(
                        )[0][0] and time.monotonic() < until:
                    time.sleep(0.005)
            except _sqlite3().Error as e:
                raise _db_error(self.store, e)

    def close(self):
        """The connection closed (this process's: a forked child's parent
        keeps its own)."""
        with self.mutex:
            db, self.conn = self.conn, None
            if db is not None and self.conn_pid == _PID[0]:
                try:
                    db.close()
                except _sqlite3().Error:
                    pass


# The SQLite store: its drop box and claims ##################################
#
# How jobs come into queue.db and go out of it: the drop box's files taken
# in (_SqlDropBox), and the claims, one row or many in one statement, and
# their finishes (_SqlClaims), over the database above.


class _SqlDropBox(object):
    """A SQLite store's drop box taken in: the job files shell producers
    drop into incoming/ (a mv; myq enqueue by a producer who may not write
    queue.db, _SqlProducer.drop_box; a file a retry brought back from
    failed/), each checked as a worker checks a file it claims, INSERTed
    under its type's bound, then removed; what is not a job quarantined.
    A part of the store's claims (their `dropbox`), whose scan of
    incoming/ takes them in first.  `spool`: its SqlStore."""

    def __init__(self, spool):
        self.spool = _weakref.proxy(spool)  # (no cycle, as Claims)

    def quarantine(self, path, name, reason):
        """A file that is not a job to failed/ (Claims.quarantine)."""
        self.spool.claims.quarantine(path, name, reason)

    def take_in(self, tick=None):
        """Move each job file of incoming/ (a shell producer's mv, a file a
        retry brought back from failed/) into the database, then remove it:
        a crash between the two leaves the file, whose id the database then
        has (refused, removed).  What is not a job is quarantined."""
        import heapq
        sp = self.spool
        got = []
        # the earliest first (by mtime, then name, as the scan of files
        # goes): a type's bound keeps the first arrivals; at most 1,024 a
        # pass (memory stays small; the rest at the next)
        seen = []
        for e in _scandir(sp.d("incoming")):
            if e.name.endswith(".json"):
                try:
                    seen.append((e.stat(follow_symlinks=False).st_mtime, e.name, e))
                except OSError:
                    pass
        failed = None
        for _, _, e in heapq.nsmallest(1024, seen, key=lambda x: x[:2]):
            if tick is not None:
                tick()
            try:
                job = self._dropped(e)
            except OSError as err:  # a quarantine that failed: said below
                failed = err
                continue
            if job is not None:
                got.append((e.name,) + job)
            if len(got) >= 256:
                self._took(got)
                got = []
        if got:
            self._took(got)
        if failed is not None:
            # as a claim of files says it (the worker logs it and pauses
            # its claims, backing off), once the other files are in
            raise failed

    def _dropped(self, e):
        """The job of the drop box's entry `e`, or None (quarantined,
        empty and young, gone)."""
        sp = self.spool
        name, path = e.name, sp.d("incoming", e.name)
        limit = sp.opt["max_job_bytes"]
        try:
            data, st = sp.read_file(path, limit + SLACK)
            if not data.strip(b"\0 \t\r\n"):
                self._empty(path, name, st)
                return None
            obj, trailers = parse(data)
            if len(data) > limit and not (isinstance(obj, dict) and _rewritten(obj)):
                raise InvalidJob("too large: %d bytes (--max-job-bytes is %d)"
                                 % (len(data), limit))
            if trailers:
                raise InvalidJob("worker records after the job: a producer's "
                                 "file holds the job object alone")
            if not NAME_RE.match(name[:-5]):
                raise InvalidJob("bad file name: a job file is ID.json, ID being "
                                 "1-128 characters of A-Z a-z 0-9 . _ -")
            job = _untrusted(normalize(obj, name[:-5], st.st_mtime),
                             st.st_uid, sp.fs.uid)
            own = own_destination(job, sp.rules(job["type"]))
            if own:     # (myq(1) policy `url`)
                raise InvalidJob(own)
        except (OSError, InvalidJob) as e2:
            if getattr(e2, "errno", None) == errno.ENOENT:
                return None
            try:
                self.quarantine(path, name, str(e2) if isinstance(
                    e2, InvalidJob) else "unreadable: %s" % (e2.strerror or e2))
            except OSError as e3:
                if e3.errno != errno.ENOENT or _lexists(path):
                    raise           # (not: the file gone, another worker's)
            return None
        if st.st_mtime > st.st_ctime:       # a schedule set on purpose,
            job["available_at"] = st.st_mtime   # by this clock: the JSON's
            job["updated_at"] = st.st_ctime     # times may be of another
        return job, len(data)

    def _empty(self, path, name, st):
        """An empty file in the drop box (Claims._unwritten): put back for a
        minute (its mtime, on purpose), then removed, never quarantined;
        at once when made before this boot (no producer writes it now)."""
        if st.st_mtime <= st.st_ctime and not _before_boot(path, st):
            until = _now() + 60
            _utime(path, until)
            self.spool.log("deferred", file=name, until=iso(until),
                           why="empty: not written yet")
        elif st.st_mtime <= _now():
            _quiet_unlink(path)
            self.spool.log("removed", file=name, why="empty: nothing was "
                           "written in it (an enqueue that a crash or power "
                           "cut ended before it returned, or a producer "
                           "that wrote nothing)")
            self.spool.count("removed", "empty")

    def _took(self, got):
        """The drop box's jobs `got` [(name, job)] into the database, durably,
        then their files removed."""
        sp = self.spool
        now = _now()
        rows = []
        for name, job, size in got:
            rules = sp.rules(job["type"])
            if job.get("priority") is None and rules.get("priority"):
                job["priority"] = rules["priority"]
            lane = sp.home(job, rules)
            full = None
            if lane != "incoming" and sp.rows.bounded(job["type"]):
                # (its type's bound counts what waits: those before it first)
                self._settled(rows)
                rows = []
                full = sp.make_room(job["type"], size)
            if full:
                job["last_error"] = "rejected: " + full
                job["failed_at"] = now
                rows.append((name, _row_values(sp, job, "dead", lane, now,
                                               finished_at=now, size=size), full))
            else:
                rows.append((name, _row_values(sp, job, "ready", lane, now,
                                               size=size), None))
        self._settled(rows)

    def _settled(self, rows):
        """The rows [(file name, values, why rejected)] in, their files
        removed (or quarantined: an id the spool has, not done)."""
        if not rows:
            return
        sp = self.spool
        gone = []
        have = sp.rows.insert([r[1] for r in rows], sync=True)
        for (name, v, full), dup in zip(rows, have):
            path = sp.d("incoming", name)
            if dup is not None:
                if dup[1] == "done":
                    _quiet_unlink(path)
                    sp.log("skipped", id=v["id"], why="already done (its row)")
                elif self._taken_in(v):
                    gone.append(path)       # (its removal was lost: a cut)
                    if dup[1] not in ("ready", "processing"):   # (it won't run)
                        sp.log("skipped", id=v["id"], why="the same job is %s "
                               "already (its row): myq retry %s runs it again"
                               % (dup[1], v["id"]))
                        sp.count("removed", v["type"])
                else:
                    try:
                        self.quarantine(path, name, "duplicate: job %s is in the "
                                        "spool already (%s)" % (v["id"], dup[1]))
                    except OSError:
                        pass
                continue
            gone.append(path)
            if full:
                sp.log("rejected", id=v["id"], type=v["type"], why=full)
                sp.count("rejected", v["type"])
        for path in gone:
            _quiet_unlink(path)
        if gone:
            sp.intake = True
            # the removals made durable: a power cut must not bring back a
            # file whose job is a row (it would be taken for a duplicate)
            _fsync_dir(sp.d("incoming"))

    def _taken_in(self, v):
        """Is the row of v's id this file's job, taken in before (a crash
        or a cut between the commit and the file's removal; or the same
        job sent again while it waits: one job either way)?"""
        row = self.spool._one("SELECT type, payload FROM jobs WHERE id=?",
                              (v["id"],))
        return row is not None and row == (v["type"], v["payload"])


class _SqlClaims(Claims):
    """The claim protocol over queue.db: a claim is one short transaction
    (BEGIN IMMEDIATE; the row, still ready in its lane; UPDATE to
    processing with the claimer's token and lease; COMMIT), every finish
    an UPDATE of the row that still holds the claimer's token (a claim
    taken back is the new owner's: its finish changes nothing).  Its part:
    `dropbox` (_SqlDropBox: the files of incoming/ taken in)."""

    def __init__(self, spool):
        Claims.__init__(self, spool)
        self.dropbox = _SqlDropBox(spool)

    # The scheduler's view -----------------------------------------------------

    def change_key(self, st=None):
        inc, racy = Claims.change_key(self, st)
        self._clock()
        return (inc, self._lane_gen("incoming", True)), racy

    def _ahead(self, rows):
        """Rows at a lane's head written by a clock ahead of this one (a
        producer's, or this worker's before its clock went back): each
        waits the delay it was given from now, not until its date (as a
        file whose ctime lies in the future, Claims._entries).  True when
        one was moved."""
        now = _now()
        moved = False
        for t, jid, upd in rows:
            if t > now and upd is not None and upd > now + 5:
                self.spool._write(
                    "UPDATE jobs SET available_at=?, updated_at=? WHERE id=? AND "
                    "status='ready' AND updated_at=?",
                    (now + max(0.0, t - upd), now, jid, upd), fresh=True)
                moved = True
        return moved

    def _clock(self):
        """The clock went back (a row written "later" than now): each job
        waiting for a time keeps the delay it had left, not the old date
        (as a file whose ctime lies in the future, Claims._entries)."""
        offset = _now() - _mono()
        last = getattr(self, "_offset", None)
        self._offset = offset
        if last is not None and offset < last - 2.0:
            now = _now()
            n = self.spool._write(
                "UPDATE jobs SET available_at=?+max(0, available_at-updated_at), "
                "updated_at=? WHERE status='ready' AND updated_at>? AND "
                "available_at>?", (now, now, now + 5, now), fresh=True)
            if n:
                self.spool.log("rescheduled", n=n, why="the clock went back")

    def arrived(self):
        """The lanes that got rows since the last call (rowids past the
        last one seen: one step down the table's b-tree, then only the new
        rows), and incoming/ when the drop box changed.  A rowid used
        again (the newest row deleted, then one inserted) is not seen
        here: the poll tick's change_key finds it."""
        sp = self.spool
        top = sp._one("SELECT max(rowid) FROM jobs")[0] or 0
        seen, self._rowid = self.__dict__.get("_rowid"), top
        if seen is None:
            return None
        subs = set(r[0] for r in sp._all(
            "SELECT DISTINCT lane FROM jobs WHERE rowid>?", (seen,))) \
            if top > seen else set()
        key, racy = Claims.change_key(self)
        if key != self.__dict__.get("_drop_key") or racy:
            self._drop_key = key
            subs.add("incoming")
        return subs

    def _lane_gen(self, sub, poked=False):
        """What changes when lane `sub`'s waiting rows may have: another
        process's commits there (_look), this one's that added ready rows."""
        g = self.spool.db.look(poked)
        return g[3], g[4].get(sub, 0), self.spool.db.fresh

    def lanes_key(self, poked=False):
        """What changes when the lanes may have: as _look says, or a lane
        got rows that had none from another process since (a new name among
        those rows added), or this process's commits added ready rows."""
        g = self.spool.db.look(poked)
        return g[3], frozenset(g[4]), self.spool.db.fresh

    def maybe_lanes(self):
        return True

    def lane_key(self, L):
        return self._lane_gen(L.sub), False

    def waits(self, rel):
        sub, _, name = rel.rpartition("/")
        return self.spool._one("SELECT 1 FROM jobs WHERE id=? AND status='ready' "
                               "AND lane=?", (name[:-5], sub)) is not None

    def size(self, sub, name):
        row = self.spool._one("SELECT size FROM jobs WHERE id=? AND "
                              "status='ready' AND lane=?", (name[:-5], sub))
        if row is None:
            raise OSError(errno.ENOENT, "gone")
        return row[0] or 0

    def due(self, rel, now):
        sub, _, name = rel.rpartition("/")
        self.spool._write("UPDATE jobs SET available_at=? WHERE id=? AND "
                          "status='ready' AND lane=? AND available_at>?",
                          (now, name[:-5], sub, now), fresh=True)

    def extend(self, claims, until):
        tokens = [c.token for c in claims]
        for i in range(0, len(tokens), 500):
            part = tokens[i:i + 500]
            self.spool._write(
                "UPDATE jobs SET leased_until=? WHERE status='processing' AND "
                "token IN (%s)" % ",".join("?" * len(part)), [until] + part,
                sync=False)

    def commit(self):
        """Finishes commit without waiting for the disk (synchronous=NORMAL
        in WAL): one fsync of the log here makes them all durable."""
        try:
            fd = os.open(self.spool.d(DB_NAME + "-wal"), os.O_RDONLY | O_CLOEXEC)
        except OSError:
            return                  # no log: checkpointed, on the disk
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def scan(self, L, n, tick):
        """Lane L's cache: its N earliest waiting jobs (after the drop box's
        files are taken in, for incoming/ itself)."""
        sp = self.spool
        failed = None
        if L.sub == "incoming":
            try:
                self.dropbox.take_in(tick)
            except OSError as e:    # (raised below, once the lane is read)
                failed = e
        sql = ("SELECT available_at, id, updated_at FROM jobs WHERE queue=? AND "
               "status='ready' AND lane=? ORDER BY available_at, id LIMIT ?")
        rows = sp._all(sql, (sp.name, L.sub, n))
        if self._ahead(rows):
            rows = sp._all(sql, (sp.name, L.sub, n))
        best = [(t, jid + ".json", True) for t, jid, _ in rows]
        full = len(best) >= n
        order = getattr(L, "order", None)
        if order is not None:
            best, more = self._live_first(L, order, n, best)
            full = full or more
        best.reverse()
        L.cache = best
        L.cache_full = full
        L.dirty = False
        L.next_due = None
        L.sweep = None
        if failed is not None:
            raise failed

    def _live_first(self, L, order, n, best):
        """A live-first lane's cache (Scheduling: LiveFirst): its n earliest
        (`best`), its n earliest ready live jobs, the n first ready of its
        backlog by created_at and its n soonest not yet due (a retry of
        the backlog's goes by its age when it comes due, not after the
        cache's), each job's created_at told to `order`; and whether one
        of them was full."""
        sp = self.spool
        now = _now()
        cut = order.live_cut(now)
        sql = ("SELECT available_at, id, created_at FROM jobs WHERE queue=? "
               "AND status='ready' AND lane=? AND available_at")
        live = sp._all(sql + "<=? AND created_at>=? ORDER BY available_at, id "
                       "LIMIT ?", (sp.name, L.sub, now, cut, n))
        back = sp._all(sql + "<=? AND (created_at<? OR created_at IS NULL) "
                       "ORDER BY created_at, id LIMIT ?",
                       (sp.name, L.sub, now, cut, n))
        later = sp._all(sql + ">? ORDER BY available_at, id LIMIT ?",
                        (sp.name, L.sub, now, n))
        rows = live + back + later
        order.created = dict((jid + ".json", c) for _, jid, c in rows
                             if c is not None)
        got = set(best).union((t, jid + ".json", True) for t, jid, _ in rows)
        return sorted(got), max(len(live), len(back), len(later)) >= n

    # Claim and finish -------------------------------------------------------------

    def claim(self, name, me, default_max_attempts=5, scheduled=False,
              sub="incoming", anytime=False):
        """Take job NAME (ID.json) waiting in lane `sub` for `me`: a Claim,
        or None (another worker was faster, it went elsewhere, or it is
        not due: Claims.claim)."""
        if not name.endswith(".json"):
            return None
        jid = name[:-5]
        sp = self.spool
        token = me.token()
        now = _now()
        until = now + me.lease
        # the lease as a file's claim appends it, its attempt the row's next
        pre, post = me.lease_parts(token, until)
        # (the row's own time, not the scan's: another worker's retry
        # may have put it back with its backoff since)
        args = (me.wid, token, pre, post, until, jid, sub,
                now + 0.5 if scheduled and not anytime else MAX_TIME)
        if sp.db.returning():
            rows = sp._write(_CLAIM_RETURNING, args, sync=False, rows=True)
            row = rows[0] if rows else None
        else:
            row = sp._tx(lambda db: db.execute(_SELECT + " WHERE id=?", (
                jid,)).fetchone() if db.execute(_CLAIM, args).rowcount else None,
                sync=False)
        if row is None:
            return None
        return _sql_claimed(self, row, jid, token, me, default_max_attempts,
                            sub, scheduled, now)

    bulk_claims = True

    def claim_many(self, names, me, default_max_attempts=5, scheduled=(),
                   sub="incoming"):
        """The jobs `names` of lane `sub` claimed in one statement: as claim()
        each, in their order (_sql_claim_many)."""
        return _sql_claim_many(self, names, me, default_max_attempts,
                               scheduled, sub)

    def _done_already(self, jid, now, generated):
        """(The claimed row is not done: only an `ok` record can say so.)"""
        if generated:
            return False
        row = self.spool._one("SELECT at FROM ok WHERE id=?", (jid,))
        return row is not None and row[0] + self.spool.opt["dedupe_window"] > now

    def complete(self, c):
        """Success: the row is done (the id's idempotency record while it
        stays); committed at once, without waiting for the disk (see
        commit()): a kill after it does not run the job again."""
        now = _now()
        n = self.spool._write(_SUCCESS, (
            c.attempt or c.job["attempts"] + 1, now, now, c.jid, c.token),
            sync=False)
        return n == 1

    def complete_many(self, cs):
        """complete() of each claim in one transaction (a batch's)."""
        now = _now()
        return self.spool._tx(lambda db: [db.execute(_SUCCESS, (
            c.attempt or c.job["attempts"] + 1, now, now, c.jid,
            c.token)).rowcount == 1 for c in cs], sync=False)

    def move_on(self, c, job, dest, me, fin=None, until=None):
        """The job's next version: waiting again (dest incoming: its lane;
        available at its available_at, or `until`) or dead (dlq); durable
        when it returns.  False when the claim is no longer ours."""
        sp = self.spool
        now = _now()
        job = dict(job)
        job["updated_at"] = now
        if dest.startswith("incoming"):
            lane, status = sp.home(job), "ready"
            more = dict(finished_at=None)
            if until is not None:
                job["available_at"] = until
        else:
            lane, status, more = "incoming", "dead", dict(finished_at=now)
        v = _row_values(sp, job, status, lane, now, token=None, worker_id=None,
                        lease=None, leased_until=None, **more)
        keys = [k for k in v if k != "id"]
        n = sp._write("UPDATE jobs SET %s WHERE id=? AND status='processing' AND "
                      "token=?" % ", ".join(k + "=?" for k in keys),
                      [v[k] for k in keys] + [c.jid, c.token],
                      fresh=status == "ready")
        if n != 1:
            return False
        if status == "ready":
            sp.poke()
        return True

    def put_back(self, c, mtime):
        """The row waits again as it was, due at `mtime` (Claims.put_back):
        only the claim's own columns change."""
        return self.spool._write(
            "UPDATE jobs SET status='ready', lane=?, available_at=?, "
            "token=NULL, worker_id=NULL, lease=NULL, leased_until=NULL WHERE "
            "id=? AND status='processing' AND token=?",
            (self.spool.home(c.job), mtime, c.jid, c.token), sync=False,
            fresh=True) == 1

    def close(self, c):
        pass

    def queued(self, jid):
        return self.spool._one("SELECT 1 FROM jobs WHERE id=? AND status='ready'",
                               (jid,)) is not None

    # Recovery -----------------------------------------------------------------

    def _until_of(self, path):
        row = self.spool._one("SELECT leased_until FROM jobs WHERE id=?",
                              (path[3:],))
        return row[0] or 0.0 if row else 0.0

    def reap(self, me=None, max_attempts=5, dry_run=False):
        """Take back the claims whose owner is gone (Claims.reap)."""
        sp = self.spool
        sp.require()
        mine = me is None and not dry_run
        if mine:
            me = Identity(sp, kind="r")
            me.register()
        try:
            cache, now, mono = {}, _now(), _mono()
            batches = {} if dry_run else self._dead_batches(
                sorted(_listdir(sp.d("processing"))), me, cache, now, mono)
            n = 0
            for jid, wid, token in sp._all(
                    "SELECT id, worker_id, token FROM jobs WHERE status="
                    "'processing'"):
                if me is not None and wid == me.wid:
                    continue
                why = self._owner_gone(wid or "-", "db:" + jid, cache, now, mono,
                                       kill=not dry_run)
                if why is None:
                    continue
                if dry_run or self._taken_back(jid, token, me, why, max_attempts,
                                               batches.get(jid)):
                    n += 1
            return n
        finally:
            if mine:
                me.unregister()

    def _taken_back(self, jid, token, me, why, max_attempts, batch):
        sp = self.spool
        row = sp._one(_SELECT + " WHERE id=? AND status='processing' AND "
                      "token IS ?", (jid, token))
        if row is None:
            return False
        self.kill_handler(token, 9)
        self.end_handler(token)
        c = Claim(jid=jid, path="", token=token)
        try:
            c.job = job = _job_of_row(row)
        except InvalidJob as e:
            sp._write("UPDATE jobs SET status='failed', last_error=? WHERE id=? "
                      "AND token IS ?", ("taken back from a dead worker but "
                                         "unreadable: %s" % e, jid, token))
            return True
        try:
            attempt = json.loads(row[13] or "{}")["lease"]["attempt"]
        except (ValueError, KeyError, TypeError):
            attempt = None
        if not isinstance(attempt, int):
            attempt = job["attempts"] + 1
        job["attempts"] = attempt
        note_failure(job, attempt, "%s during attempt %d" % (why, attempt))
        dest = "incoming"
        if attempt >= (job.get("max_attempts") or max_attempts):
            dest = "dlq"
            job["failed_at"] = _now()
        job["available_at"] = _now()
        if batch and dest == "incoming":
            job["batch_of"] = batch
        if not self.move_on(c, job, dest, me):
            return False                # another reaper was faster
        sp.log("requeued" if dest == "incoming" else "dead", id=jid, why=why)
        return True


def _sql_claimed(claims, row, jid, token, me, default_max_attempts, sub,
                 scheduled, now):
    """The Claim of the row just claimed for `claims` (_CLAIM_RETURNING's
    columns first), or None: unreadable, or it went elsewhere (_admit).
    An I/O error gives it back untouched (or leaves that to the worker:
    the error's give_back)."""
    sp = claims.spool
    try:
        try:
            job = _job_of_row(row)
        except InvalidJob as e:
            sp._write("UPDATE jobs SET status='failed', last_error=?, "
                      "token=NULL WHERE id=? AND token=?",
                      ("unreadable: %s" % e, jid, token))
            sp.log("quarantined", id=jid, reason=str(e))
            return None
        c = Claim(jid, "", job, token, None, [],
                  job.get("max_attempts") or default_max_attempts, None,
                  job["available_at"])      # (by position, as a file's)
        if not claims._admit(c, job, me, None, sub, len(row[2] or ""),
                             scheduled, now):
            return None
    except OSError as e:
        # Its next write failed (busy, full): the claim goes back
        # untouched, now, or at the worker's next try (Worker._fill);
        # else it stayed this live worker's until it stopped.
        _sql_give_back(sp, e, [token])
        raise
    c.attempt = job["attempts"] + 1
    return c


def _sql_give_back(sp, e, tokens):
    """The claims of `tokens` ready again untouched, now, or else at the
    worker's next try (the error e's give_back, after any it had)."""
    prev = getattr(e, "give_back", None)

    def back():
        if prev is not None:
            prev()
        for i in range(0, len(tokens), 500):
            part = tokens[i:i + 500]
            sp._write("UPDATE jobs SET status='ready', token=NULL, "
                      "worker_id=NULL, lease=NULL, leased_until=NULL WHERE "
                      "status='processing' AND token IN (%s)" % ",".join(
                          "?" * len(part)), part, sync=False, fresh=True)
    try:
        back()
        e.give_back = None
    except OSError:
        e.give_back = back


def _claim_each(claims, names, me, default_max_attempts, scheduled, sub):
    """claim_many as claims.claim() of each name: [Claim or None]; an
    OSError's `claims`: those claimed before it (the caller's)."""
    out = []
    for name, sched in zip(names, scheduled):
        try:
            out.append(claims.claim(name, me, default_max_attempts, sched, sub))
        except OSError as e:
            e.claims = out + [None] * (len(names) - len(out))
            raise
    return out


def _sql_claim_many(claims, names, me, default_max_attempts, scheduled, sub):
    """_SqlClaims.claim_many: the rows claimed in one statement
    (_CLAIM_MANY, 200 a statement), each then admitted as claim() does;
    [Claim or None] in the order of `names` (a name again: None).  An
    OSError's `claims`: those admitted before it, the caller's (the rest
    given back)."""
    sp = claims.spool
    sp.db.returning()       # (a crash point sees its commit: _SqlDb.write)
    if not sp.db.ret:
        return _claim_each(claims, names, me, default_max_attempts, scheduled,
                           sub)
    now = _now()
    until = now + me.lease
    want, args, post = {}, [], None
    for name, sched in zip(names, scheduled):
        if not name.endswith(".json") or name[:-5] in want:
            continue
        token = me.token()
        pre, post = me.lease_parts(token, until)
        want[name[:-5]] = (token, sched)
        args += [name[:-5], token, pre, now + 0.5 if sched else MAX_TIME]
    got = {}
    for i in range(0, len(args), 800):
        part = args[i:i + 800]
        for row in sp._write(_CLAIM_MANY % ",".join(
                ["(?,?,?,?)"] * (len(part) // 4)),
                [me.wid, post, until] + part + [sub], sync=False, rows=True):
            got[row[0]] = row
    out = {}
    order = [jid for jid in want if jid in got]
    for k, jid in enumerate(order):
        token, sched = want[jid]
        try:
            out[jid] = _sql_claimed(claims, got[jid], jid, token, me,
                                    default_max_attempts, sub, sched, now)
        except OSError as e:
            # (this one given back, or left to the worker: so are those
            # not admitted yet)
            _sql_give_back(sp, e, [want[j][0] for j in order[k + 1:]])
            e.claims = [out.pop(n[:-5], None) for n in names]
            raise
    return [out.pop(n[:-5], None) for n in names]


# The SQLite store ############################################################
#
# The SQLite store's upkeep and reader, its budget and backlog, and the
# store itself, registered in _STORES.


class _SqlUpkeep(Upkeep):
    """The operator's moves and retention over queue.db (a part of
    SqlStore): retry, delete, prune, make_space, check, export."""

    def retry(self, ids=(), all=False, now=False):
        if all:
            self.store.require()
            ids = list(_ids(ids)) + [r[0] for r in self.store._all(
                "SELECT id FROM jobs WHERE status='dead' ORDER BY id")]
            all = False
        return Upkeep.retry(self, ids, all, now)

    def _retry(self, ids, missing, me, now=False):
        n = 0
        for jid, state, path in self._located(ids, missing):
            if not path.startswith("db:"):
                if state != "failed":
                    missing.append(jid)
                    continue
                name = os.path.basename(path)
                name = name if name.endswith(".json") else name + ".json"
                why = self._unreadable_by_worker(path)
                if why:
                    raise ConfigError("cannot retry %s: %s" % (jid, why))
                _rename(path, self.store.d("incoming", name))     # the drop box
                _quiet_unlink(path + ".reason")
            elif not self._retry_row(jid, state, now):
                missing.append(jid)
                continue
            n += 1
        if n:
            _fsync_dir(self.store.d("incoming"))
            self.store.poke()
        return n

    def _retry_row(self, jid, state, now):
        """retry (--now) of the row of `jid`: False when it is not there."""
        t = _now()
        if now and state in ("ready", "scheduled"):
            self.store._write("UPDATE jobs SET available_at=? WHERE id=? AND "
                        "status='ready' AND available_at>?", (t, jid, t),
                        fresh=True)
            self.store.log("retry_now", id=jid)
            return True
        if state != "dead":
            return False
        row = self.store._one(_SELECT + " WHERE id=? AND status='dead'", (jid,))
        if row is None:
            return False
        job = _job_of_row(row)
        revive(job, t, self.store.rules(job["type"]).get("ttl"))
        v = _row_values(self.store, job, "ready", self.store.home(job), t,
                       finished_at=None)
        keys = [k for k in v if k != "id"]
        return self.store._write("UPDATE jobs SET %s WHERE id=? AND status='dead'"
                           % ", ".join(k + "=?" for k in keys),
                           [v[k] for k in keys] + [jid], fresh=True) == 1

    def _delete_one(self, jid, state, path, force, status=None):
        """(`status`: a bulk delete's, which a row changed since it was
        selected no longer matches: it is left alone.)"""
        if not path.startswith("db:"):
            return Upkeep._delete_one(self, jid, state, path, force)
        row = self.store._one("SELECT status, token, finished_at FROM jobs WHERE id=?",
                        (jid,))
        if row is None or status is not None and row[0] != status:
            return 0
        if row[0] == "processing" and not force:
            raise SpoolBusy("job %s is running; wait for it, or delete it with "
                            "--force (its handler is killed)" % jid)

        def gone(db):
            n = db.execute("DELETE FROM jobs WHERE id=? AND status=? AND token "
                           "IS ?", (jid, row[0], row[1])).rowcount
            if n and row[0] == "done":
                self._outlive_row(db, jid, row[2], _now())
            return n
        n = self.store._tx(gone)
        if n and row[0] == "processing":
            self.store.claims.kill_handler(row[1], 15)
        return n if n or row[0] != "processing" else None

    def _outlive_row(self, db, jid, t, now):
        """A done row goes: its id's de-duplication kept in `ok` while its
        window lasts (not for an id myq generated)."""
        if t and t + self.store.opt["dedupe_window"] > now and NAME_RE.match(jid) \
                and not GENERATED_ID_RE.match(jid):
            db.execute("INSERT OR REPLACE INTO ok(id, at) VALUES(?, ?)", (jid, t))

    def delete_where(self, state, type=None, older_than=None, force=False,
                     now=None):
        now = self._bulk_delete(state, force, now)
        n = 0
        if state in ("failed", "ready", "scheduled"):     # (files: failed/,
            n = Upkeep.delete_where(self, state, type,    # the drop box)
                                    older_than, force, now)
        if type is not None and not NAME_RE.match(type):
            return n            # (no row's; not even sqlite's to encode)
        status = {"ready": "ready", "scheduled": "ready"}.get(state, state)
        if state in ("ready", "scheduled"):
            born = "created_at"
        else:
            born = "coalesce(finished_at, updated_at)"
        sql = "SELECT id FROM jobs WHERE status=?"
        args = [status]
        if state == "ready":
            sql += " AND available_at<=?"
            args.append(now)
        elif state == "scheduled":
            sql += " AND available_at>?"
            args.append(now)
        if type is not None:
            sql += " AND type=?"
            args.append(type)
        if older_than is not None:
            sql += " AND %s<=?" % born
            args.append(now - older_than)
        for (jid,) in self.store._all(sql, args):
            n += self._delete_one(jid, state, "db:" + jid, force, status) or 0
        return n

    def _prune_jobs(self, now, full, out):
        bound = {}
        out["tmp"] += self._expire("tmp", "oldest", self.store.opt["keep_tmp"], None, now)
        out["done"] += self._expire_rows("done", "keep_done", "keep_done_max", now)
        if full:
            out["dead"] += self._expire_rows("dead", "keep_dead", "keep_dead_max", now)
            out["failed"] += self._expire("failed", "ctime", self.store.opt["keep_failed"],
                                          None, now)
            out["failed"] += self._expire_rows("failed", "keep_failed", None, now)
            window, most = self.store.opt["dedupe_window"], self.store.opt["keep_ok_max"]

            def ok(db):
                n = db.execute("DELETE FROM ok WHERE at<=?", (now - window,)).rowcount
                m = db.execute("DELETE FROM ok WHERE id IN (SELECT id FROM ok "
                               "ORDER BY at DESC LIMIT -1 OFFSET ?)", (most,)).rowcount
                return n, m
            n, m = self.store._tx(ok, sync=False)
            out["ok"] += n + m
            if m:
                bound["locks/ok"] = m
        return bound

    def _expire_rows(self, status, keep, most, now):
        """Rows of `status` finished longer than the option `keep` ago, then
        the oldest beyond the option `most`: deleted (a done one's id kept
        in `ok` for its window).  How many went."""
        keep = self.store.opt[keep]
        most = self.store.opt[most] if most else None

        def expire(db):
            ids = db.execute("SELECT id, finished_at FROM jobs WHERE status=? AND "
                             "coalesce(finished_at, updated_at)<=?",
                             (status, now - keep)).fetchall()
            if most is not None:
                ids += db.execute(
                    "SELECT id, finished_at FROM jobs WHERE status=? AND "
                    "coalesce(finished_at, updated_at)>? ORDER BY "
                    "coalesce(finished_at, updated_at) DESC LIMIT -1 OFFSET ?",
                    (status, now - keep, most)).fetchall()
            for jid, t in ids:
                if status == "done":
                    self._outlive_row(db, jid, t, now)
                db.execute("DELETE FROM jobs WHERE id=? AND status=?", (jid, status))
            return len(ids)
        return self.store._tx(expire, sync=False)

    def _holders(self):
        owners, tokens = Upkeep._holders(self)
        for wid, token in self.store._all("SELECT worker_id, token FROM jobs WHERE "
                                    "status='processing'"):
            owners.add(wid)
            tokens.add(token)
        return owners, tokens

    def make_space(self, n=256):
        """Below a guard: the n oldest done rows go (ids kept in `ok`), and
        the pages they held go back to the filesystem (incremental vacuum);
        then the reserve, as for files."""
        problem = self.store.free_problem()
        now = _now()
        self.store.db.small_log(True)

        def free(db):
            ids = db.execute("SELECT id, finished_at FROM jobs WHERE "
                             "status='done' ORDER BY finished_at LIMIT ?",
                             (n,)).fetchall()
            for jid, t in ids:
                self._outlive_row(db, jid, t, now)
                db.execute("DELETE FROM jobs WHERE id=? AND status='done'", (jid,))
            return len(ids)
        try:
            gone = self.store._tx(free, sync=False)
            self.store.db.vacuum()
        except _DbError:
            gone = 0
        what = "the oldest"
        if not gone and self._free_room():
            what, gone = "its reserve (locks/room)", 1
        if gone:
            self.store.log("pruned", why="below a guard: " + (problem or "low"),
                     n=gone, freed=what)
        return gone

    def keep_room(self):
        kept = Upkeep.keep_room(self)
        if kept and self.store.db.small:
            self.store.db.small_log(False)
        return kept

    def check(self, operator=True):
        """Upkeep.check, the database first: damaged, it says so (with the
        filesystem's problems; what needs its rows cannot be asked)."""
        bad = None
        if _lexists(self.store.d(DB_NAME)):
            try:
                bad = self.store.damaged or self.store._quick_check()
                bad = bad and (
                    "%s is damaged: %s; no job is claimed from it; save what "
                    "can be read: myq --spool %s export > jobs.jsonl, then "
                    "import them into a new spool" % (self.store.d(DB_NAME), bad,
                                                      self.store.path))
            except (_DbDamaged, _DbDenied) as e:
                bad = str(e)
            except MyqError:
                pass            # (busy, out of reach: Upkeep.check says)
        if not bad:
            return Upkeep.check(self, operator)
        problems = [bad]
        try:
            _DirStore.check_filesystem(self.store)
        except ConfigError as e:
            problems.append(str(e))
        self.store.policy()
        problems += [p for p in [self.store.policy_error] + self._unreadable_problems()
                     if p and self.store.d(DB_NAME) + " " not in p]
        return problems + [p for p in (self.store.free_problem(),) if p]


class _SqlReader(Reader):
    """What the commands read of a SQLite store: its rows, then the drop
    box's and failed/'s files as Reader reads them."""

    def locate(self, jid):
        if NAME_RE.match(_check_ref(jid)):
            row = self.store._one("SELECT status, available_at FROM jobs WHERE id=?",
                            (jid,))
            if row is not None:
                state = {"ready": "scheduled" if row[1] > _now() else "ready",
                         "dead": "dead"}.get(row[0], row[0])
                return state, "db:" + jid
        return Reader.locate(self, jid)          # the drop box, failed/

    def _describe(self, state, path, holding=None):
        if not path.startswith("db:"):
            return Reader._describe(self, state, path, holding)
        jid = path[3:]
        row = self.store._one(_SELECT + " WHERE id=?", (jid,))
        if row is None:
            raise OSError(errno.ENOENT, "no longer in the spool")
        status = row[11]
        if status == "failed":
            return {"id": jid, "state": "failed", "type": row[1],
                    "attempts": row[3], "available_at": None,
                    "file": self.store.d(DB_NAME), "last_error": row[6],
                    "content": row[2]}
        job = _job_of_row(row)
        if status == "processing":
            job["attempts"] = _row_attempt(row, job)
            try:
                job["lease"] = json.loads(row[13])["lease"]
            except (ValueError, KeyError, TypeError):
                pass
            state = "processing"
        elif status == "ready":
            state = "scheduled" if job["available_at"] > _now() else "ready"
            h = (holding.get(row[12] + "/" + jid + ".json") or holding.get(
                ("type", job["type"]))) if holding else None
            if h is not None and (state == "scheduled" or h.get("missing")):
                state = "held"
                job["held"] = {"dest": h["dest"], "until": h.get("until"),
                               "why": h.get("why")}
        else:
            state = status
        if state == "done":
            job["last_error"] = None
        job["state"] = state
        return job

    def _rows(self, state):
        """Jobs by state, then time, then id (the drop box's files among
        the ready ones, failed/'s after the rows)."""
        if state in (None, "ready", "scheduled", "held"):
            for row in Reader._rows(self, state):     # the drop box's files
                if row["state"] != "failed" and (state != "failed"):
                    yield row
        holding = self._holding() if state in (None, "scheduled", "held") \
            else None
        for status in ("ready", "processing", "done", "dead", "failed"):
            if state not in (None, "held") and status != {
                    "ready": "ready", "scheduled": "ready"}.get(state, state):
                continue
            if state == "held" and status != "ready":
                continue
            ids = [r[0] for r in self.store._all(
                "SELECT id FROM jobs WHERE status=? ORDER BY coalesce("
                "finished_at, available_at), id", (status,))]
            for jid in ids:
                try:
                    row = self._describe(status, "db:" + jid, holding)
                except OSError:
                    continue            # it moved while we looked
                except InvalidJob as e:
                    row = {"id": jid, "type": None, "state": status,
                           "attempts": None, "available_at": None,
                           "last_error": "unreadable: %s" % e}
                if state and row["state"] != state:
                    continue
                yield row
        if state in (None, "failed"):
            for row in Reader._rows(self, "failed"):
                yield row

    def counts(self, now):
        # the drop box's files first, each due at its mtime
        ready, scheduled, oldest = self._waiting_files(("incoming",), now)
        processing = done = dead = failed = 0
        for status, due, n, first in self.store._all(
                "SELECT status, available_at<=?, count(*), min(available_at) "
                "FROM jobs GROUP BY 1, 2", (now,)):
            if status == "ready" and due:
                ready += n
                oldest = first if oldest is None or first < oldest else oldest
            elif status == "ready":
                scheduled += n
            elif status == "processing":
                processing += n
            elif status == "done":
                done += n
            elif status == "dead":
                dead += n
            elif status == "failed":
                failed += n
        return (ready, scheduled, oldest, processing, done, dead,
                failed + self._failed_files())

    # Export -----------------------------------------------------------------------


def _make_db(sqlite3, path):
    """The database at `path` (its file made already): schema, WAL."""
    if stat.S_ISLNK(os.lstat(path).st_mode):
        raise OSError(errno.ELOOP, "a symlink")
    db = sqlite3.connect(path, timeout=DB_BUSY, isolation_level=None)
    try:
        # 1 KiB pages: a commit appends the pages it changed to the
        # log, whole; a job's row and index entries fit in a few
        # (bench/README.md: a third of the bytes of 4 KiB pages)
        db.execute("PRAGMA page_size=1024")
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("PRAGMA journal_mode=WAL").fetchall()
        db.executescript(_SCHEMA)
    finally:
        db.close()


def _as_user(ids, fn):
    """fn() in a child that became the user `ids` (uid, gid): what it
    opens by path it opens with that user's rights alone.  Its error
    comes back as an OSError (its words)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            become(ids[0], ids[1])
            fn()
        except BaseException as e:
            code = 1
            try:
                os.write(w, str(e).encode("utf-8", "replace")[:2000])
            except BaseException:
                pass
        os._exit(code)
    os.close(w)
    try:
        words = b""
        while True:
            b = os.read(r, 4096)
            if not b:
                break
            words += b
    finally:
        os.close(r)
    status = os.waitpid(pid, 0)[1]
    if status:
        raise OSError(errno.EPERM, words.decode("utf-8", "replace")
                      or "exit status %d" % status)


def _salvage_state(row, job, states):
    """The export state of a salvaged row, or None (not asked for)."""
    status = row[11]
    if status == "processing":
        job["attempts"] = _row_attempt(row, job)
    elif status == "ready":
        status = "scheduled" if job["available_at"] > _now() else "ready"
    return status if status in states else None


def _row_attempt(row, job):
    """The attempt a claimed row's lease runs (as a reaper counts it)."""
    try:
        a = json.loads(row[13] or "{}")["lease"]["attempt"]
    except (ValueError, KeyError, TypeError):
        a = None
    return a if isinstance(a, int) else job["attempts"] + 1


class SqlBudget(Budget):
    """The budget of the SQLite store (myq-spool(5) BUDGET): what a row
    costs and frees in pages, the walk that checkpoints and vacuums
    first (the log's checkpoint kept within what is counted for it:
    _SqlDb.log_limits), and the shedding of done and `ok` rows."""

    _EXACT = False

    def cost(self, size):
        """A new row, never less: the 1 KiB pages its commit writes (its
        row's, with overflow pages of about 1,000 bytes each, and three of
        the table's and its indexes'), once in the log (each with its
        frame's header) and once in the database, where they may be new."""
        pages = -(-(size + 100) // 1000) + 3
        return pages * (2 * 1024 + 24) + _ENTRY

    def freed(self, size):
        """A row deleted: its own pages (the next walk says how many)."""
        return -(-(size + 100) // 1000) * 1024

    def measure(self):
        """_DirStore.measure, the log counted at least at its cap (what the
        workers' commits may write there before the next checkpoint);
        with a budget, the log first checkpointed and truncated and the
        database's free pages given back (incremental vacuum), so that
        what a shed deleted is freed (a walk is rare: at most every
        BUDGET_FRESH seconds at the budget)."""
        wal_path = self.store.d(DB_NAME + "-wal")
        try:
            wal = os.lstat(wal_path).st_blocks * 512
        except OSError:
            wal = 0
        db = self.store.db
        cap = db.wal_cap()
        try:
            if cap is not None:
                with db.mutex:
                    db.log_limits(db.connection())
                if wal:
                    db.vacuum()
                    wal = _lstat(wal_path).st_blocks * 512
        except (MyqError, OSError):
            pass                # (busy: measured as it is)
        return Budget.measure(self) + max(0, _wal_bytes(cap or 0) - wal)

    def _shed_measured(self, m, a, t):
        return self.measure(), 0, _now()

    def _shed_done(self, need):
        """Done rows before their time, the earliest finished first."""
        def free(db):
            rows = db.execute("SELECT id, finished_at, coalesce(size, 0) FROM "
                              "jobs WHERE status='done' ORDER BY finished_at, "
                              "id").fetchall()
            got = n = 0
            for jid, t, size in rows:
                if got >= need:
                    break
                self.store.upkeep._outlive_row(db, jid, t, _now())
                db.execute("DELETE FROM jobs WHERE id=? AND status='done'", (jid,))
                got, n = got + size, n + 1
            return got, n
        try:
            got, n = self.store._tx(free, sync=False)
        except _DbError:
            return 0
        if n:
            self.store.log("pruned", reason="budget", what="done", n=n)
        return got

    def _shed_records(self, need):
        """`ok` rows past the de-duplication window."""
        try:
            n = self.store._write("DELETE FROM ok WHERE at<=?", (
                _now() - self.store.opt["dedupe_window"],), sync=False)
        except _DbError:
            return 0
        if n:
            self.store.log("pruned", reason="budget", what="ok", n=n)
        return 0

    def _lane_waiting(self, now, out):
        for t, created, size in self.store._all(
                "SELECT type, created_at, coalesce(size, 0) FROM jobs WHERE "
                "queue=? AND status='ready'", (self.store.name,)):
            self._add_waiting(out, t, size, created)


class SqlBacklog(Backlog):
    """The SQLite store's export: the drop box's files, the rows, what a
    damaged database still gives (its salvage), failed/'s files."""

    def export(self, states=(), type=None, skip=None):
        self.store.require()
        states, skip = self._export_args(states, skip)
        if states & {"ready", "scheduled"}:
            for e in _scandir(self.store.d("incoming")):      # the drop box
                row = self._exported("incoming", e.name, skip)
                if row is not None and row["state"] in states and (
                        type is None or row["type"] == type):
                    state = row.pop("state")
                    row = _job_of_row(_row_of(_row_values(
                        self.store, row, "ready", "incoming", _now())))
                    row["state"] = state        # (as a row's: its keys' order)
                    yield row
        seen = set()        # (what a damaged database's salvage skips)
        try:
            for status in ("ready", "processing", "done", "dead"):
                if status in states or (status == "ready" and
                                        "scheduled" in states):
                    for job in self._exported_rows(status, states, type, skip):
                        seen.add(job["id"])
                        yield job
        except _DbDamaged as e:
            skip(self.store.d(DB_NAME), str(e))
            for job in self._salvaged(states, type, skip, seen):
                yield job
        if "failed" in states and type is None:
            for row in self._exported_failed():
                yield row
            for jid, reason, text in self.store._all(
                    "SELECT id, last_error, payload FROM jobs WHERE "
                    "status='failed'"):
                yield {"state": "failed", "file": jid, "reason": reason,
                       "bytes": text}

    def _salvaged(self, states, type, skip, seen):
        """Every row of a damaged database that can still be read, one at a
        time by its rowid (a query over the whole table stops at the first
        bad page), but those of ids in `seen` (written already): what
        export writes when the database is damaged."""
        try:
            top = self.store._one("SELECT max(rowid) FROM jobs")[0] or 0
        except MyqError:
            top = None
        if top is None:                 # (guessed from the file's size)
            top = os.stat(self.store.d(DB_NAME)).st_size // 64
        for rowid in range(1, top + 1):
            try:
                row = self.store._one(_SELECT + " WHERE rowid=?", (rowid,))
                if row is None or row[0] in seen:
                    continue
                job = _job_of_row(row)
            except (MyqError, InvalidJob) as e:
                skip("%s: row %d" % (self.store.d(DB_NAME), rowid), str(e))
                continue
            seen.add(row[0])
            state = _salvage_state(row, job, states)
            if state is not None and (type is None or job["type"] == type):
                job["state"] = state
                yield job

    def _exported_rows(self, status, states, type, skip):
        if type is not None and not NAME_RE.match(type):
            return              # (no row's; not even sqlite's to encode)
        sql, args = "SELECT id FROM jobs WHERE status=?", [status]
        if type is not None:
            sql += " AND type=?"
            args.append(type)
        ids = [r[0] for r in self.store._all(sql, args)]
        for i in range(0, len(ids), 256):
            part = ids[i:i + 256]
            for row in self.store._all(_SELECT + " WHERE id IN (%s) AND status=?" % (
                    ",".join("?" * len(part))), part + [status]):
                try:
                    job = _job_of_row(row)
                except InvalidJob as e:
                    skip(self.store.d(DB_NAME) + ":" + row[0], str(e))
                    continue
                if status == "processing":
                    job["attempts"] = _row_attempt(row, job)
                    state = status
                elif status == "ready":
                    state = "scheduled" if job["available_at"] > _now() else "ready"
                else:
                    state = {"dead": "dead"}.get(status, status)
                if state in states:
                    job["state"] = state
                    yield job


class _SqlProducer(object):
    """A SQLite store's producer (its `rows`): a job is a row INSERTed,
    the usual one as one prepared statement, many in one transaction,
    under the same guard and budget as files; a producer who may not write
    queue.db (the spool's group) drops files into incoming/ instead (the
    drop box: the store's file Producer, `files`), which a worker takes
    in.  `store`: its SqlStore (its database, policy, lanes, budget)."""

    def __init__(self, store):
        self.store, self.files = store, store.producer
        self._writer = None     # may this user write queue.db (drop_box)
        self._usual = None      # (SpoolPolicy._homes, {type: usual(type)})

    def drop_box(self):
        """True when this user cannot write queue.db (a producer of the
        spool's group): its jobs go into incoming/ as files, and a worker
        takes them in.  (Asked once.)"""
        w = self._writer
        if w is None:
            w = self._writer = os.access(self.store.d(DB_NAME), os.R_OK | os.W_OK)
        return not w

    def enqueue(self, type, payload=None, id=None, delay=0, max_attempts=None,
                timeout=None, sync=True, priority=None, ttl=None):
        """_DirStore.enqueue.  The usual call (a generated id, no options, a type
        whose jobs wait in incoming/ unbounded, no budget) is one INSERT of
        a prepared statement: no job file's bytes, no dict of columns
        (bench/README.md: its Python costs less than the INSERT); what the
        type's rules say of it is asked once per type and policy (usual),
        and each step of insert_one spelt out for one job, asked only where
        it can say something: the disk guard's figure (room_for's, within
        its second and its room: no statvfs), the budget where there is
        one, a poke where a worker may listen (_UNHEARD, as poke has it),
        the arrival added to those held (Budget.note_arrival), the door
        released where a step opened it.  Anything else, and any error,
        goes the general way, which words it."""
        mono = _mono()
        known, pols = self._usual, self.store.policies
        ok = known[1].get(type) if known is not None and known[0] is \
            pols._homes and mono < pols._pol_next and type.__class__ is str \
            else None
        if id is not None or delay or max_attempts is not None \
                or timeout is not None or priority is not None \
                or ttl is not None or not (ok or ok is None and self.usual(type, mono)):
            return _DirStore.enqueue(self.store, type, payload, id, delay,
                                     max_attempts, timeout, sync, priority, ttl)
        store = self.store
        now = _now()
        try:
            if now.__class__ is not float or not -MAX_TIME < now < MAX_TIME - 1e10:
                raise ValueError
            pj = "null" if payload is None else "".join(_ENCODE_ONCE(payload, 0)) \
                if _ENCODE_ONCE else _encode_value(payload)
            # new_job's depth check, where the text could be that deep (the
            # job object is level 1: each level a bracket at least, and a
            # bracket that closes it)
            if len(pj) > 2 * MAX_DEPTH - 4 and \
                    pj.count("[") + pj.count("{") > MAX_DEPTH - 2:
                _check_depth(payload, 2)
            jid = _new_id(now)
            # len(_dumps_new(job)): what its file would hold (test_sqlite)
            size = _NEW_SIZE + len(jid) + len(type) + 3 * _time_repr_len(now) \
                + len(pj if pj.isascii() else pj.encode("utf-8"))
            if size > store.opt["max_job_bytes"]:
                raise ValueError            # (its refusal is worded there)
        except (ValueError, TypeError, RecursionError, UnicodeError):
            return _DirStore.enqueue(store, type, payload, None, 0, None, None, sync)
        files = self.files
        t, room, left, block = files.room
        if mono - t < 1.0 and size + block <= room and left > 0:
            files.room = (t, room - size - block, left - 1, block)
        else:
            problem = files.room_for((size,))
            if problem:
                raise SpoolFull("spool %s refuses the job: %s" % (store.path, problem))
        try:
            if ok != 1 and self._usual[1].get(type) == 2:
                store.budget.charge(((type, size),))
            store.db.insert_new((jid, store.name, type, pj, now, size), sync)
            t = _UNHEARD.get(store.path)
            if t is None or mono >= t:
                store.poke(often=True)
            store.budget.note_arrival(type, size, mono)
        finally:
            door = _HERE.doors.get(store.path)
            if door is not None and door.fds:
                door.release()
        return jid

    def usual(self, type, mono=None):
        """May a job of `type` be the usual enqueue (SqlStore.enqueue)?  A
        name, the spool ready, this user a writer of queue.db, the type's
        rules none that set where or how its jobs wait or go (its home
        incoming/), no budget: asked once per type while the policy and
        the types held for a missing handler stay (SpoolPolicy._homes, made
        anew when either changes; the policy file looked at once a second,
        as rules() does; `mono`: the caller's _mono()).  False, or 1; 2
        where the spool has a budget."""
        pols = self.store.policies
        if mono is None or mono >= pols._pol_next:
            pols.policy(mono)
        known = self._usual
        if known is None or known[0] is not pols._homes:
            known = self._usual = (pols._homes, {})
        ok = known[1].get(type) if type.__class__ is str else False
        if ok is None:
            rules = self.store.rules(type)
            ok = _is_name(type) and not (
                self.store.require() and self.drop_box()) \
                and not (rules.get("priority") or "url" in rules
                         or "topic" in rules) \
                and self.store.home({"type": type}, rules) == "incoming" \
                and (1 if self.store.budget.budget_bytes() is None else 2)
            if len(known[1]) < 4096:
                known[1][type] = ok
        return ok

    def insert_one(self, sql, args, size, sync, type):
        """One new row waiting in incoming/ (`size`: its file's bytes),
        under the disk guard and the budget, in its own commit; a worker
        woken."""
        problem = self.files.room_for((size,))
        if problem:
            raise SpoolFull("spool %s refuses the job: %s" % (self.store.path, problem))
        try:
            self.store.budget.charge(((type, size),))
            self.store._write(sql, args, sync, fresh=True)
            self.store.poke(often=True)
            self.store.budget.note_arrival(type, size, _mono())
        finally:
            self.store.fs.release()

    def enqueue_one(self, todo, sync):
        """One job of a generated id into incoming/'s lane: one INSERT, in
        its own transaction (no batch's lists, no duplicate to look for)."""
        job, data, explicit, delay, sub = todo
        if explicit or sub != "incoming" or self.drop_box():
            return self.place([todo], sync)[0]
        v = _row_values(self.store, job, "ready", "incoming", _now(), size=len(data))
        self.insert_one("INSERT INTO jobs(%s) VALUES(%s)" % (
            ",".join(v), ",".join("?" * len(v))), tuple(v.values()), len(data),
            sync, job["type"])
        return job["id"]

    def place(self, todo, sync, refused=None, done=None):
        """Place the jobs of `todo` (Producer.prepared's) in one transaction, durable
        at its commit (sync); their ids.  A duplicate id raises
        DuplicateJob and places nothing, unless `refused` (import) takes
        it."""
        self.store.require()
        if self.drop_box():
            return self.files.place(todo, sync, refused, done)
        problem = self.files.room_for([len(t[1]) for t in todo])
        if problem:
            raise SpoolFull("spool %s refuses the job: %s" % (self.store.path, problem))
        self.store.budget.charge([(t[0]["type"], len(t[1])) for t in todo])
        done = [] if done is None else done
        now = _now()
        rows = []

        def dup(v, where):
            e = DuplicateJob("job id %s already exists (%s); pick another id "
                             "or delete the old job" % (v["id"], where))
            if refused is None:
                raise e
            refused.append((v["id"], e))
        for job, data, explicit, delay, sub in todo:
            if explicit and _lexists(self.store.d("incoming", job["id"] + ".json")):
                dup(job, "a producer's file in incoming/, not taken in yet")
                continue
            if sub in ("done", "dlq"):
                rows.append(_row_values(self.store, job, "done" if sub == "done" else
                                        "dead", "incoming", now, finished_at=now,
                                        size=len(data)))
            elif not sub.startswith(LANES) or not self.bounded(job["type"]):
                rows.append(_row_values(self.store, job, "ready", sub, now,
                                        size=len(data)))
            else:
                # A type's bound counts what waits: each of its jobs is
                # counted and placed on its own, after those before it.
                self._rows_placed(self.insert(rows, sync, dup), rows, done)
                rows = []
                full = self.store.make_room(job["type"], len(data))
                if full and refused is not None:
                    refused.append((job["id"], SpoolFull(full)))
                    continue
                if full:
                    raise SpoolFull(full)
                rows.append(_row_values(self.store, job, "ready", sub, now,
                                        size=len(data)))
        try:
            self._rows_placed(self.insert(rows, sync, dup), rows, done)
            if done:
                self.store.poke(often=True, subs=set(d[1] for d in done))
                self.files.arrived(todo, done)
        finally:
            self.store.fs.release()
        return [jid for jid, _ in done]

    def bounded(self, type):
        rules = self.store.rules(type)
        return "max_queued" in rules or "max_bytes" in rules

    @staticmethod
    def _rows_placed(have, rows, done):
        for v, d in zip(rows, have):
            if d is None:
                done.append((v["id"], v["lane"] if v["status"] == "ready" else
                             "done" if v["status"] == "done" else "dlq"))

    def insert(self, rows, sync, dup=None):
        """INSERT the rows (dicts of columns) in one transaction; for each,
        None or (id, where it is already) when its id is taken: a done row
        past the de-duplication window is replaced, an `ok` record within
        it refuses.  dup(row, where) is told of each refusal inside the
        transaction (raising rolls back them all)."""
        if not rows:
            return []
        sqlite3 = _sqlite3()
        window = self.store.opt["dedupe_window"]
        now = _now()
        where = {"ready": "queued", "processing": "processing", "dead": "dead",
                 "failed": "failed",
                 "done": "done within the de-duplication window"}

        def put(db):
            out = []
            for v in rows:
                keys = list(v)
                sql = "INSERT INTO jobs(%s) VALUES(%s)" % (
                    ",".join(keys), ",".join("?" * len(keys)))
                ok = None if GENERATED_ID_RE.match(v["id"]) else db.execute(
                    "SELECT at FROM ok WHERE id=?", (v["id"],)).fetchone()
                if ok is not None and ok[0] + window > now:
                    out.append((v["id"], "done"))
                else:
                    try:
                        db.execute(sql, [v[k] for k in keys])
                        out.append(None)
                        continue
                    except sqlite3.IntegrityError:
                        old = db.execute("SELECT status, finished_at FROM jobs "
                                         "WHERE id=?", (v["id"],)).fetchone()
                    if old and old[0] == "done" and (old[1] or 0) + window <= now:
                        db.execute("DELETE FROM jobs WHERE id=?", (v["id"],))
                        db.execute(sql, [v[k] for k in keys])
                        out.append(None)
                        continue
                    out.append((v["id"], old[0] if old else "queued"))
                if dup is not None:
                    dup(v, where.get(out[-1][1], out[-1][1]))
            return out
        return self.store._tx(put, sync, fresh=True)

    def find_id(self, jid, now=None, dirs=None):
        if _exists(jid + ".json", (dirs or self.store.fs)("incoming")):
            return "queued"                 # in the drop box
        if self.drop_box():
            return None                     # (the worker's take-in decides)
        row = self.store._one("SELECT status FROM jobs WHERE id=?", (jid,))
        if row is not None and row[0] != "done":
            return {"ready": "queued"}.get(row[0], row[0])
        if self.ok_fresh(jid, now):
            return "done within the de-duplication window"
        return None

    def ok_fresh(self, jid, now=None, dirs=None):
        now = _now() if now is None else now
        window = self.store.opt["dedupe_window"]
        row = self.store._one("SELECT finished_at FROM jobs WHERE id=? AND "
                        "status='done'", (jid,))
        if row is None and not _is_generated_id(jid):
            row = self.store._one("SELECT at FROM ok WHERE id=?", (jid,))
        return row is not None and dedupe_fresh(row[0] or 0, window, now)


class SqlStore(_DirStore):
    """A spool of the SQLite store (myq-spool(5) SQLITE STORE): the jobs in
    queue.db, the rest as for files.  Its own parts besides _DirStore's:
    `db` (_SqlDb: the connection and its statements) and `rows`
    (_SqlProducer: its jobs INSERTed)."""

    store = "sqlite"
    READER = _SqlReader
    UPKEEP = _SqlUpkeep
    CLAIMS = _SqlClaims
    BUDGET = SqlBudget
    BACKLOG = SqlBacklog

    def __init__(self, path=None, log=None, **options):
        _DirStore.__init__(self, path, log, **options)
        self.damaged = None
        # Its database, and the store's handles on its statements (bound
        # once: a claim's statement is one lookup)
        self.db = db = _SqlDb(self)
        self._db, self._tx, self._write = db.connection, db.tx, db.write
        self._all, self._one = db.all, db.one
        self.rows = _SqlProducer(self)      # its jobs INSERTed
        self.enqueue = self.rows.enqueue    # (enqueue's, one call less a job)

    @staticmethod
    def usable():
        """ConfigError (exit 78, naming the package) without sqlite3."""
        _sqlite3()

    @classmethod
    def create(cls, spool, owner=None):
        """queue.db made in the initialised spool `spool` (its schema, WAL,
        free pages given back), then the store recorded in SPOOL/store.
        The file is made (or checked) through the door, the owner's alone
        (0600: its log and index get its mode, and no producer may open,
        so lock, any of them); root makes the database as the owner (review:
        root's init went through the owner's link at queue.db)."""
        sqlite3 = _sqlite3()
        path = spool.d(DB_NAME)
        ids = _user_ids(owner) if owner else None
        try:
            if ids is None and os.geteuid() == 0:
                st = os.fstat(spool.fs(""))     # (root, for another's spool)
                ids = (st.st_uid, st.st_gid) if st.st_uid else None
            cls._db_file(spool, ids)
            if ids and os.geteuid() == 0 and ids[0] != 0:
                _as_user(ids, lambda: _make_db(sqlite3, path))
            else:
                _make_db(sqlite3, path)
            _replace(spool.d("store"), b"sqlite\n", sync=True, mode=0o644)
            _fsync_dir(spool.path)
        except (sqlite3.Error, OSError) as e:
            raise ConfigError("cannot make %s: %s; check the spool's filesystem "
                              "and permissions" % (path, e))
        finally:
            spool.fs.release()
        return cls(spool.path, spool.log, **dict(
            (k, v) for k, v in spool.opt.items() if DEFAULTS.get(k) != v))

    @staticmethod
    def _db_file(spool, ids):
        """queue.db (and a -wal, -shm there) checked, or queue.db made, in
        the spool's directory, never through a link: a regular file of the
        spool's owner with one name, 0600; anything else is refused."""
        dfd = spool.fs("")
        uid = ids[0] if ids else os.fstat(dfd).st_uid
        for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm"):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW
                             | O_CLOEXEC, dir_fd=dfd)
            except FileNotFoundError:
                if name != DB_NAME:
                    continue
                fd = os.open(name, os.O_RDONLY | os.O_CREAT | os.O_EXCL
                             | O_NOFOLLOW | O_CLOEXEC, 0o600, dir_fd=dfd)
                if ids:
                    os.fchown(fd, ids[0], ids[1])
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    raise
                fd = None
            try:
                st = os.fstat(fd) if fd is not None else None
                if st is None or not stat.S_ISREG(st.st_mode) \
                        or st.st_uid != uid or st.st_nlink != 1:
                    raise ConfigError(
                        "%s is not a regular file of the spool's owner (uid %d) "
                        "with one name; move it away and run myq init again"
                        % (spool.d(name), uid))
                if st.st_mode & 0o077:
                    os.fchmod(fd, 0o600)
            finally:
                if fd is not None:
                    os.close(fd)

    def check_filesystem(self):
        """The spool's filesystem as for files, and the database whole
        (PRAGMA quick_check, at a worker's start after a stop that was not
        clean: no mark_clean's mark): a damaged one claims nothing
        (ConfigError, exit 78), and says how to save its jobs.  A pass over
        every page costs ~3,000 instructions a row (308 M at 100,000 rows,
        ~1 s on a 500 MHz router) at every start; after a clean stop
        nothing happened to the file since its last check but what SQLite
        wrote itself, so it is skipped there (issue 42)."""
        _DirStore.check_filesystem(self)
        if _lexists(self.d("locks", CLEAN_MARK)):
            # The first open all the same (cheap: no row read): on a full
            # disk it is what fails (its index, -shm), here, where the
            # worker gives back its reserve (make_space) before its first
            # write (mark_clean, its record, the log).
            self._db()
            return
        bad = self._quick_check()
        if bad:
            raise _db_error(self, _sqlite3().DatabaseError(
                "database disk image is malformed: " + bad))

    def _ready_index(self):
        """A database made before idx_jobs_ready had the id (_SCHEMA) gets
        it, once: a scan's ORDER BY available_at, id is then the index's
        order, not a sort of the rows that share an available_at (an
        enqueue_many's: 5,000 sorted at each refill, 40 ms at 100,000)."""
        row = self._one("SELECT sql FROM sqlite_master WHERE "
                        "name='idx_jobs_ready'")
        if row is not None and "available_at, id)" in (row[0] or ""):
            return

        def swap(db):
            db.execute("DROP INDEX IF EXISTS idx_jobs_ready")
            db.execute("CREATE INDEX idx_jobs_ready ON jobs(queue, lane, "
                       "available_at, id) WHERE status='ready'")
        self._tx(swap)

    def mark_clean(self, clean):
        """locks/db-clean, the mark of a clean stop: removed (durably,
        before the worker writes anything) at a worker's start, written
        at its clean stop when no other worker's record is left (a worker
        killed leaves its record until it is reaped) and nothing found the
        database damaged.  Without it (a power cut, a kill -9, a crash, a
        spool never worked) the next worker's start runs quick_check."""
        path = self.d("locks", CLEAN_MARK)
        if not clean:
            try:        # (a database made before idx_jobs_claimed: _SCHEMA)
                if self._one("SELECT 1 FROM sqlite_master WHERE "
                             "name='idx_jobs_claimed'") is None:
                    self._write("CREATE INDEX IF NOT EXISTS idx_jobs_claimed "
                                "ON jobs(token) WHERE status='processing'")
                self._ready_index()
            except MyqError as e:
                if _space_error(e):     # (the worker's start gives room)
                    raise
                # (out of reach: found again at use)
            if _lexists(path):
                os.unlink(path)
                _fsync_dir(self.d("locks"))
            return
        try:
            if self.damaged or os.listdir(self.d("locks", "workers")):
                return
            _replace(path, b"clean\n", sync=True)
        except OSError:
            pass                    # (no mark: the next start checks)

    def require(self):
        if not self._ready:
            _DirStore.require(self)
            if not _lexists(self.d(DB_NAME)):
                self._ready = False
                raise ConfigError(
                    "spool %s keeps its jobs in SQLite and %s is missing; "
                    "restore it, or make the spool again (myq --spool %s init "
                    "--store sqlite after moving the old one away)"
                    % (self.path, self.d(DB_NAME), self.path))
        return self

    def set_name(self, name):
        """_DirStore.set_name, for a spool that holds no job yet: its rows carry
        the queue's name (the queue column)."""
        if name != self.name and _is_name(name) and self._one("SELECT count(*) FROM jobs")[0]:
            raise ConfigError(
                "spool %s holds jobs of the queue %s; its name cannot change: "
                "make a new spool (myq --spool NEW init --store sqlite --name "
                "%s) and move the jobs (myq --spool %s export | myq --spool NEW "
                "import)" % (self.path, self.name, name, self.path))
        _DirStore.set_name(self, name)

    def _quick_check(self):
        """None, or what PRAGMA quick_check says is wrong."""
        rows = self._all("PRAGMA quick_check")
        out = [r[0] for r in rows if r and r[0] != "ok"]
        return "; ".join(out[:3]) if out else None

    # The connection -----------------------------------------------------------------

    def close(self):
        self.budget.note_delivered()
        self.fs.release()
        self.close_tiers()
        self.db.close()

    # Its rows' producer's, as the contract names them ---------------------

    def enqueue(self, type, payload=None, id=None, delay=0, max_attempts=None,
                timeout=None, sync=True, priority=None, ttl=None):
        return self.rows.enqueue(type, payload, id, delay, max_attempts,
                                 timeout, sync, priority, ttl)

    def _enqueue(self, todo, sync, refused=None, done=None):
        return self.rows.place(todo, sync, refused, done)

    def _enqueue_one(self, todo, sync):
        return self.rows.enqueue_one(todo, sync)

    def find_id(self, jid, now=None, dirs=None):
        return self.rows.find_id(jid, now, dirs)

    def ok_fresh(self, jid, now=None, dirs=None):
        return self.rows.ok_fresh(jid, now, dirs)

    # Lanes -------------------------------------------------------------------------------

    def lanes(self):
        """The lanes that hold ready rows: one index lookup each (a skip
        scan of idx_jobs_ready), not a pass over the ready rows."""
        out = []
        sub = "incoming"
        while True:
            row = self._one("SELECT lane FROM jobs WHERE queue=? AND status="
                            "'ready' AND lane>? ORDER BY lane LIMIT 1",
                            (self.name, sub))
            if row is None:
                break
            sub = row[0]
            m = _lane_of(sub[len(LANES) + 1:]) if sub.startswith(LANES + "/") \
                else None
            if m:
                out.append((int(m[1]), m[0], sub))
        out.sort(key=lambda l: (-l[0], l[1]))
        return out

    def _make_lane(self, sub, dirs=None):
        pass                        # a lane is a column's value

    def _waiting_of(self, type):
        out = []
        for jid, t, size, sub in self._all(
                "SELECT id, created_at, size, lane FROM jobs WHERE queue=? "
                "AND status='ready' AND type=? AND lane!='incoming'",
                (self.name, type)):
            m = _lane_of(sub[len(LANES) + 1:])
            out.append((int(m[1]) if m else 0, t, jid + ".json", size, sub))
        return out

    def _made(self, w, now):
        return w[1]         # (created_at: _waiting_of)

    def _drop_waiting(self, sub, name, dirs):
        return self._write("DELETE FROM jobs WHERE id=? AND status='ready' AND "
                           "lane=?", (name[:-5], sub)) == 1


_STORES["sqlite"] = SqlStore


# The RAM tier ################################################################
#
# myq(1) RAM FIRST: a type of `durable=outage` stays in RAM until it must
# wait.  `myq init --ram DIR` gives the spool a second file store in DIR, a
# directory on a RAM filesystem (SPOOL/ram names it): the same layout, the
# same claims, no fsync.  The spool's store holds it as `store.ram`, and its
# claims as the RAM side of `store.claims` (_TieredClaims): a worker's lanes
# are the spool's and the RAM tier's ("ram:" before the lane's name), and it
# does not know which holds a job.  A job leaves RAM for the spool, id,
# attempts, priority and created_at kept, durable together with many and
# named there only then (_Mover.move, Store._move_in): when a run of it fails or its destination is held (the
# claims' move_on and put_back), when it waited its type's `spill_after`,
# past `ram_max`, and when its worker stops (RamStore.spill, each turn of a
# worker: Store.settle).  A power cut loses what RAM held: jobs made within
# the last `spill_after` (never more than `ram_max`); a killed worker
# nothing (the files outlive it, and the next worker takes its claims back).

RAM_FILESYSTEMS = ("tmpfs", "ramfs")
RAM_FILE = "ram"                # SPOOL/ram: the RAM tier's directory
SPILL_AFTER, RAM_MAX_JOBS, RAM_MAX_BYTES = 10.0, 1000, 1 << 20


def fs_type(path):
    """The type of the filesystem that holds `path` ("tmpfs", "ext4", ...):
    the deepest mount point above it in /proc/self/mountinfo; None when
    that cannot be read."""
    real = os.path.realpath(path)
    best, kind = None, None
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if "-" not in parts[6:] or len(parts) < 9:
            continue
        mp = parts[4]
        while "\\0" in mp:        # (\040: a space, as mountinfo escapes it)
            i = mp.index("\\0")
            mp = mp[:i] + chr(int(mp[i + 1:i + 4], 8)) + mp[i + 4:]
        under = real == mp or real.startswith(mp.rstrip("/") + "/")
        if under and (best is None or len(mp) >= len(best)):
            best, kind = mp, parts[parts.index("-", 6) + 1]
    return kind


def ram_rules(rules):
    """(spill_after, jobs, bytes) of a type's rules (myq(1) RAM FIRST)."""
    most = rules.get("ram_max")
    jobs = most if most.__class__ is int else RAM_MAX_JOBS
    size = parse_size(most) if isinstance(most, str) else RAM_MAX_BYTES
    return rules.get("spill_after", SPILL_AFTER), jobs, size


class RamClaims(FileClaims):
    """The RAM tier's claims: FileClaims in its directory, but what would
    wait again (a retry, a put-back) or go to the dead letters moves to
    the spool instead (_Mover.move, at the next commit: one durable
    commit for all)."""

    def __init__(self, spool):
        FileClaims.__init__(self, spool)
        self.moving = []            # (claim, job, dest) to move at commit

    def claim(self, name, me, default_max_attempts=5, scheduled=False,
              sub="incoming", anytime=False):
        return FileClaims.claim(self, name, me, default_max_attempts,
                                scheduled, _unram(sub), anytime)

    def move_on(self, c, job, dest, me, fin=None, until=None):
        job = dict(job)
        if until is not None:
            job["available_at"] = max(job["available_at"], until)
        self.close(c)
        self.moving.append((c, job, dest))
        return True

    def put_back(self, c, mtime):
        job = dict(c.job)
        job["available_at"] = mtime
        self.close(c)
        self.moving.append((c, job, "incoming"))
        return True

    @property
    def owed(self):
        return bool(self.moving)

    def complete(self, c):
        """Done here; a copy the spool got (RamStore._copy_running) goes."""
        ok = FileClaims.complete(self, c)
        mark = self.spool.d("copied", c.jid)
        if _lexists(mark):
            try:
                self.spool.spool.delete([c.jid])
            except (NoSuchJob, SpoolBusy):
                pass                # (run again, or running: at least once)
            _quiet_unlink(mark)
        return ok

    def commit(self):
        """The moves of the claims finished since, in one durable commit
        (nothing of RAM's own is made durable: it cannot be)."""
        moving, self.moving = self.moving, []
        if moving:
            self.spool.mover.move([(c.path, j, d) for c, j, d in moving])

    def lane_key(self, L):
        return FileClaims.lane_key(self, L)


class _RamBudget(FileBudget):
    """The RAM tier's budget.  Its jobs cost the flash nothing, but each
    must find room in the spool when it moves: the spool's budget counts
    what the tier holds (Budget.beside), and the tier takes a job only
    within what the spool's budget leaves it (budget_bytes), its figure
    kept in its own locks/used, on the tmpfs.  A job it refuses goes to
    the spool, whose budget sheds or refuses it.  Its arrivals and
    deliveries are the spool's (_DirStore.complete)."""

    def held(self):
        """The bytes the tier's jobs would take in the spool, by its figure
        (walked again when older than BUDGET_FRESH)."""
        return self.used_bytes(BUDGET_FRESH)

    def measure(self):
        """What the jobs the tier holds would cost the spool (its budget's
        cost of each file), waiting or running: not its done/ (never
        moved; kept_done_max bounds it), records or tmp/."""
        total, stack = 0, [self.store.path]
        cost = self.store.spool.budget.cost
        while stack:
            d = stack.pop()
            for e in _scandir(d):
                if d == self.store.path and e.name in ("done", "locks", "tmp"):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    stack.append(d + "/" + e.name)
                elif stat.S_ISREG(st.st_mode):
                    total += cost(st.st_size)
        return total

    def cost(self, size):
        return self.store.spool.budget.cost(size)

    def freed(self, size):
        return self.store.spool.budget.freed(size)

    def _shed_done(self, need):
        return 0            # (the tier's done/ is not counted)

    def _shed_records(self, need):
        return 0

    def budget_bytes(self):
        """What the spool's budget leaves the tier, or None (no budget)."""
        spool = self.store.spool.budget
        budget = spool.budget_bytes()
        return None if budget is None else budget - spool.used_bytes()

    def note_arrivals(self, counts):
        pass

    def note_arrival(self, type, size, mono):
        pass

    def flush_arrivals(self):
        pass

    def delivered(self, type):
        pass

    def sent(self, type, n):
        pass

    def note_delivered(self):
        pass

    def upkeep_budget(self, now):
        pass


def _unram(sub):
    return sub[4:] if sub[:4] == "ram:" else sub


class RamStore(FileStore):
    """The RAM tier of a spool (`spool`: the spool's store): a file store
    in a directory of a RAM filesystem, whose policy, breaker, workers'
    records and wake-up are the spool's.  Nothing in it is fsync'd: a
    power cut takes it whatever is done."""

    store = "ram"
    CLAIMS = RamClaims
    BUDGET = _RamBudget
    # (the spool's log: a worker sets it after the store is made)
    log = property(lambda self: self.spool.log, lambda self, value: None)

    def __init__(self, path, spool, log=None, **options):
        self.spool = spool
        FileStore.__init__(self, path, log, **options)
        self.breaker = spool.breaker
        # the spool's policy (SpoolPolicy), its handles too
        self.policies, self.policy, self.rules = spool.policies, \
            spool.policy, spool.rules
        self.home, self.expiry = spool.home, spool.expiry
        self.mover = _Mover(self)

    def d(self, *parts):
        """A path in the tier; "ram:LANE" is the tier's LANE.  The workers'
        records and the holds are the spool's (locks/workers/WID.json,
        locks/held/); a handler's run record (locks/workers/TOKEN.run) and
        its lanes' quiet marks (locks/quiet/) the tier's own."""
        if parts:
            p = parts[0]
            if p[:4] == "ram:":
                parts = (p[4:],) + parts[1:]
            elif p == "locks" and len(parts) > 1 and (
                    parts[1] == "held" or parts[1] == "workers"
                    and parts[-1].endswith(".json")):
                return self.spool.d(*parts)
        return FileStore.d(self, *parts)

    def beat_path(self, wid):
        """Worker wid's heartbeat here, locks/workers/WID.beat (the record
        beside it is the spool's: d())."""
        return self.d("locks", "workers", wid + ".beat")

    def usable(self):
        """Whether producers may put jobs here: the layout is made (a
        worker makes it at its start: after a boot the directory is empty)
        and a worker listens (with none, a job waits in the spool)."""
        if not os.path.isdir(self._incoming):
            return False
        fd = self.producer._open_wake(None)
        if fd is None:
            return False
        os.close(fd)
        return True

    def problems(self):
        """check's lines about the tier: where it is not on a RAM
        filesystem (after a boot where /tmp is not a tmpfs: the workers
        keep every job in the spool then)."""
        if fs_type(self.path) not in RAM_FILESYSTEMS:
            return [_not_ram(self.path) + "; the workers keep every job in "
                    "the spool meanwhile (myq init --ram DIR, or --ram '' "
                    "for none)"]
        return []

    def make(self, owner=None):
        """The tier's layout (at init, and at each worker's start)."""
        if fs_type(self.path) not in RAM_FILESYSTEMS:
            raise ConfigError(_not_ram(self.path))
        _Layout(self).make(owner, "files")

    def count_into(self, out, now):
        """The spool's stats `out` with this tier's: its waiting and running
        jobs counted with the spool's, `ram` (how many it holds: what a
        power cut would take now at most) and `ram_bound_s` (the loss
        bound: the longest spill_after of a durable=outage type)."""
        ready, scheduled, oldest, processing = self.reader.counts(now)[:4]
        out["ready"] += ready
        out["scheduled"] += scheduled
        out["processing"] += processing
        if oldest and ready:
            out["oldest_ready_s"] = max(out["oldest_ready_s"],
                                        int(max(0, now - oldest)))
        out["ram"] = ready + scheduled + processing
        out["ram_bound_s"] = -int(-self.bound() // 1)

    def bound(self):
        """The longest spill_after of the durable=outage types (0: none)."""
        return max([after for _, after in self._outage()] or [0.0])

    def outage_types(self):
        """The types the policy names durable=outage ("*" aside)."""
        return [t for t, _ in self._outage() if t != "*"]

    def _outage(self):
        """(type or "*", its spill_after) of the policy's durable=outage."""
        pol = self.policy()
        for t in pol:
            if t == SPOOL_POLICY:
                continue
            rules = pol[t] if t == "*" else self.rules(t)
            if rules.get("durable") == "outage":
                yield t, ram_rules(rules)[0]

    # What the spool asks of its tier -----------------------------------

    def take(self, type, payload, id, delay, max_attempts, timeout,
             priority, ttl):
        """A new job of the spool's, here when its type is durable=outage,
        a worker listens and its id is not the spool's already: its id;
        None when the spool must take it (RAM full or gone too)."""
        if not self.takes(type, id):
            return None
        try:
            return self.enqueue(type, payload, id, delay, max_attempts,
                                timeout, False, priority, ttl)
        except (SpoolFull, SpoolBusy, ConfigError):
            return None

    def takes(self, type, jid=None):
        try:
            rules = self.rules(type)
        except (MyqError, TypeError):
            return False            # (said where the job is refused)
        return rules.get("durable") == "outage" and self.usable() and \
            not (jid is not None and self.spool.find_id(jid))

    def take_many(self, specs, sync):
        """The spool's enqueue_many: the jobs of durable=outage types here,
        the rest (and those RAM refuses) the spool's; their ids in the
        order of `specs`."""
        specs = list(specs)
        ids = [None] * len(specs)
        mine = [i for i, s in enumerate(specs)
                if isinstance(s, dict) and self.takes(s.get("type"), s.get("id"))]
        if mine:
            try:
                for i, jid in zip(mine, self.enqueue_many(
                        [specs[i] for i in mine], False)):
                    ids[i] = jid
            except (SpoolFull, SpoolBusy, ConfigError):
                pass                # (the spool takes them)
        rest = [i for i in range(len(specs)) if ids[i] is None]
        if rest:
            for i, jid in zip(rest, self.spool._enqueue_many(
                    [specs[i] for i in rest], sync)):
                ids[i] = jid
        return ids

    def exported(self, jobs, states, type, skip):
        """The spool's export `jobs`, then this tier's waiting and running
        ones."""
        return _chain(jobs, (j for j in self.backlog.export(
            states, type, skip) if j["state"] not in ("done", "dead")))

    def worker_lanes(self):
        """Its lanes as a worker of the spool sees them ("ram:" first)."""
        return [(0, None, "ram:incoming")] + [
            (p, t, "ram:" + sub) for p, t, sub in self.lanes()]

    def start(self):
        """At a worker's start: the layout made again (ConfigError where
        the directory is not on a RAM filesystem), its descriptors kept."""
        self.make()
        self.fs.kept += 1

    def stop(self):
        """What it keeps open, closed (a tmpfs to unmount)."""
        self.fs.kept = 0
        self.fs.release()

    def spill(self, final=False):
        return self.mover.spill(final)

class _Mover(object):
    """A RAM tier's moves to its spool (`tier`: the RamStore): what must
    not wait in RAM, in one durable commit for many jobs; the copies of
    jobs running at their bound.  Its state: when it looks again."""

    def __init__(self, tier):
        self.tier = _weakref.proxy(tier)
        self.spool = tier.spool
        self._next_spill = 0.0              # (monotonic) when to look again

    def move(self, items):
        """Move jobs to the spool: `items` (path in this tier, job, dest
        "incoming" or "dlq"), in one durable commit; then their files here
        go.  A job the spool refuses (its bound, a full disk) stays here
        and is said; one it has already (an earlier move cut short) goes."""
        todo, paths = [], {}
        for path, job, dest in items:
            job = dict(job)
            job.pop("lease", None)
            job.pop("state", None)
            job["updated_at"] = _now()
            data = dumps(job)
            sub = self.spool.home(job) if dest == "incoming" else dest
            delay = max(0.0, job["available_at"] - _now())
            todo.append((job, data, True, delay, sub))
            paths[job["id"]] = path
        refused, placed = [], []
        try:
            self.spool._move_in(todo, refused, placed)
        except (SpoolFull, SpoolBusy, ConfigError, OSError) as e:
            self.tier.log("error", during="ram", error="%s; %d jobs stay in RAM"
                     % (e, len(todo) - len(placed)))
        gone = set(jid for jid, _ in placed)
        for jid, e in refused:
            if isinstance(e, DuplicateJob):
                gone.add(jid)
            else:
                self.tier.log("error", during="ram", job=jid, error=str(e))
        for jid in gone:
            _quiet_unlink(paths[jid])
            _quiet_unlink(self.tier.d("copied", jid))
        if placed:
            self.tier.log("moved", jobs=len(placed), to="spool")
        for jid, path in paths.items():
            if jid not in gone and path.startswith(self.tier._pre + "spill/"):
                self._unspill(path)
        return len(gone)

    def spill(self, final=False):
        """A worker's turn: move to the spool the waiting jobs that must
        not wait here any longer (their spill_after, a type's ram_max, a
        held destination, a type not durable=outage, `final`: all), and
        what an earlier spill left in spill/; copy there the running ones
        past their bound.  Returns when to look again (monotonic)."""
        now, mono = _now(), _mono()
        if not final and mono < self._next_spill:
            return self._next_spill
        take, soonest = [], now + 1.0
        for sub in self.tier.waiting_dirs():
            soonest = min(soonest, self._due(sub, now, final, take))
        if not take:
            take = [("spill", name) for name in _listdir(self.tier.d("spill"))]
        if take:
            self._spill(take)
        soonest = min(soonest, self._copy_running(now))
        self._next_spill = mono + max(0.0, soonest - now)
        return self._next_spill

    def _due(self, sub, now, final, take):
        """The jobs of lane `sub` to move now, appended to `take` as (sub,
        name), oldest first; the wall time when the next comes due."""
        t = _lane_of(sub.rpartition("/")[2])[0] if sub != "incoming" else None
        files = []
        for e in _scandir(self.tier.d(sub)):
            if e.name.endswith(".json"):
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                files.append((_made(e.name[:-5], st.st_ctime), e.name,
                              st.st_size))
        files.sort()
        total = sum(f[2] for f in files)
        soonest = now + 1.0
        gather = False
        for n, (made, name, nbytes) in enumerate(files):
            # (incoming/ itself: a shell producer's, of any type)
            kind = t or self._type_of(sub, name)
            rules = self.tier.rules(kind) if kind else {"durable": "outage"}
            after, most, size = ram_rules(rules)
            due = made + after - 2 * _lead(after)
            # When a lane's oldest is due, all of the lane moves with it (the
            # bound whole): jobs that wait behind a due one wait for a held,
            # failing or stalled destination (its own url's too, which the
            # policy does not name): one commit for what came within
            # spill_after, not one each (with the link down, that made as
            # many commits as durable=always)
            gather = gather or due <= now
            if final or rules.get("durable") != "outage" or gather or \
                    len(files) - n > most or total > size or due <= now:
                take.append((sub, name))
                total -= nbytes
            else:
                soonest = min(soonest, due)
        return soonest

    def _type_of(self, sub, name):
        try:
            return self.tier.load(self.tier.d(sub, name), name[:-5])[0]["type"]
        except (OSError, InvalidJob):
            return None             # (its claim quarantines it)

    def _copy_running(self, now):
        """The jobs running from here past their bound: a copy of each in
        the spool, due when its run's lease ends (a power cut then takes
        none of them; a success removes the copy: RamClaims.complete).
        Returns the wall time when the next comes due."""
        soonest = now + 1.0
        todo = []
        for name in _listdir(self.tier.d("processing")):
            parts = _split_claim(name)
            if not parts or parts[2] != "json" or \
                    _lexists(self.tier.d("copied", parts[0])):
                continue
            path = self.tier.d("processing", name)
            try:
                job, _, st = self.tier.load(path, parts[0])
            except (OSError, InvalidJob):
                continue
            after = ram_rules(self.tier.rules(job["type"]))[0]
            due = min(_made(parts[0], st.st_ctime), job["created_at"]) + \
                after - 2 * _lead(after)
            if due > now:
                soonest = min(soonest, due)
                continue
            job.pop("lease", None)
            job["available_at"] = max(now, st.st_mtime)
            todo.append((job, dumps(job), True, job["available_at"] - now,
                         self.spool.home(job)))
        if todo:
            refused, placed = [], []
            try:
                self.spool._move_in(todo, refused, placed)
            except (SpoolFull, SpoolBusy, ConfigError, OSError) as e:
                self.tier.log("error", during="ram", error="%s; running jobs not "
                         "copied to the spool" % e)
            self.tier.fs.mkdir("copied")
            for jid, _ in placed:
                _create(self.tier.d("copied", jid), b"", sync=False)
            if placed:
                self.tier.log("copied", jobs=len(placed), to="spool")
        return soonest

    def _spill(self, take):
        """Move the files `take` ((sub, name)) to the spool: each renamed
        into spill/ first (a claim of another worker then finds it gone),
        read, moved in one commit."""
        self.tier.fs.mkdir("spill")
        items = []
        for sub, name in take:
            path = self.tier.d("spill", name)
            if sub != "spill" and not _take(self.tier.d(sub, name), path):
                continue
            try:
                job, trailers, st = self.tier.load(path, name[:-5])
            except (OSError, InvalidJob) as e:
                if not isinstance(e, OSError):
                    self.tier.claims.quarantine(path, name, str(e))
                continue
            items.append((path, job, "incoming"))
        if items:
            self.move(items)

    def _unspill(self, path):
        """A job the spool refused goes back to wait here."""
        try:
            job = self.tier.load(path)[0]
            _rename(path, self.tier.d(self.tier.home(job), os.path.basename(path)))
        except (OSError, InvalidJob):
            pass



def _made(jid, ctime):
    """When a job in RAM was made: its generated id's time, or its file's
    ctime (when it came to RAM), whichever is earlier."""
    if jid[13:14] == "-" and jid[:13].isdigit():
        return min(ctime, int(jid[:13]) / 1000.0)
    return ctime


def _lead(after):
    """How early a RAM job moves before its spill_after (its bound whole
    despite the worker's turns)."""
    return min(1.0, after / 4.0)


def _not_ram(path):
    return ("%s is on %s, not a RAM filesystem (%s): the RAM tier must not "
            "write to flash; give a directory under a tmpfs such as /tmp or "
            "/var/run" % (path, fs_type(path) or "an unknown filesystem",
                          " or ".join(RAM_FILESYSTEMS)))


class _TieredClaims(object):
    """The claims of a spool with a RAM tier: each call handed to the
    spool's claims or the tier's, by the lane ("ram:" first) or the claim
    (its path), what is not one or the other the spool's."""

    def __init__(self, own, ram):
        self.own, self.ram = own, ram
        self._ram_pre = ram.spool._pre
        self._own_owed = False      # the spool's own finishes to commit
        self.claim_changes_key = own.claim_changes_key
        self.batches = _TieredBatches(own.batches, ram.batches, self._ram_pre)

    @property
    def owed(self):
        return bool(self.ram.moving)

    def __getattr__(self, name):
        return getattr(self.own, name)

    def _of(self, c):
        return self.ram if c.path.startswith(self._ram_pre) else self.own

    def claim(self, name, me, default_max_attempts=5, scheduled=False,
              sub="incoming", anytime=False):
        return (self.ram if sub[:4] == "ram:" else self.own).claim(
            name, me, default_max_attempts, scheduled, sub, anytime)

    def _side(self, c):
        """_of(c), noting a finish of the spool's own to commit."""
        if c.path.startswith(self._ram_pre):
            return self.ram
        self._own_owed = True
        return self.own

    def claim_many(self, names, me, default_max_attempts=5, scheduled=(),
                   sub="incoming"):
        side = self.ram if sub[:4] == "ram:" else self.own
        if side.bulk_claims:
            return side.claim_many(names, me, default_max_attempts, scheduled,
                                   sub)
        return _claim_each(side, names, me, default_max_attempts, scheduled, sub)

    def complete(self, c):
        return self._side(c).complete(c)

    def complete_many(self, cs):
        side = self._of(cs[0])
        if not side.bulk_claims or any(self._of(c) is not side for c in cs):
            return None                 # (one at a time)
        return self._side(cs[0]).complete_many(cs)     # (the spool's: owed)

    def move_on(self, c, job, dest, me, fin=None, until=None):
        return self._side(c).move_on(c, job, dest, me, fin, until)

    def put_back(self, c, mtime):
        return self._side(c).put_back(c, mtime)

    def close(self, c):
        return self._of(c).close(c)

    def note_handler(self, c, pid, start):
        return self._of(c).note_handler(c, pid, start)

    def end_handler(self, token):
        self.own.end_handler(token)
        self.ram.end_handler(token)

    def extend(self, claims, until):
        for side in (self.own, self.ram):
            mine = [c for c in claims if self._of(c) is side]
            if mine:
                side.extend(mine, until)

    def commit(self):
        # (the spool's group commit when it finished jobs of its own: a
        # RAM job's success costs the flash no fsync of done/ or the log,
        # which UBIFS pays with a page even where nothing changed)
        if self._own_owed:
            self.own.commit()
            self._own_owed = False
        self.ram.commit()

    def reap(self, me=None, max_attempts=5, dry_run=False):
        return self.own.reap(me, max_attempts, dry_run) + \
            self.ram.reap(me, max_attempts, dry_run)

    def scan(self, L, n, tick):
        return (self.ram if L.sub[:4] == "ram:" else self.own).scan(L, n, tick)

    def lane_key(self, L):
        return (self.ram if L.sub[:4] == "ram:" else self.own).lane_key(L)

    def lanes_key(self, poked=False):
        return (self.own.lanes_key(poked), self.ram.lanes_key(poked))

    def maybe_lanes(self):
        return True                 # (the tier's incoming/ is one)

    def worker_lanes(self):
        lanes = self.own.worker_lanes() + self.ram.spool.worker_lanes()
        lanes.sort(key=lambda l: -l[0])
        return lanes

    def wake_paths(self):
        # (a poke writes the FIFO's times: the tier's own is on the tmpfs)
        return self.own.wake_paths() + self.ram.wake_paths()

    def start(self):
        try:
            self.ram.spool.start()
        except ConfigError as e:
            # (/tmp not a tmpfs on this boot: the spool takes every job)
            store = self.own.spool
            store.log("error", during="ram", error="%s; the RAM tier is not "
                      "used" % e)
            store.claims, store.ram = self.own, None
            del store.beat_path, store.eager_types      # (_with_ram's)

    def settle(self, final=False):
        return self.ram.spool.spill(final)

    def quiet_mark(self, L, make=False):
        # (a RAM lane's in the tier: on flash each is a journal commit)
        return (self.ram if L.sub[:4] == "ram:" else self.own).quiet_mark(
            L, make)

    def arrived(self):
        self.own.arrived()          # (its count goes on)
        return None                 # (the tier's lanes: by their keys)

    def waits(self, rel):
        return (self.ram if rel[:4] == "ram:" else self.own).waits(rel)

    def size(self, sub, name):
        return (self.ram if sub[:4] == "ram:" else self.own).size(sub, name)

    def due(self, rel, now):
        return (self.ram if rel[:4] == "ram:" else self.own).due(rel, now)

    def queued(self, jid):
        return self.own.queued(jid) or self.ram.queued(jid)


class _TieredBatches(object):
    """The batches' records of a spool with a RAM tier: a batch of RAM
    jobs is recorded in RAM (_Batches)."""

    def __init__(self, own, ram, ram_pre):
        self.own, self.ram, self._ram_pre = own, ram, ram_pre

    def note(self, claims):
        side = self.ram if claims[0].path.startswith(self._ram_pre) else self.own
        return side.note(claims)

    def ids(self, name):
        return self.own.ids(name) or self.ram.ids(name)

    @property
    def whole(self):
        return dict(self.ram.whole, **self.own.whole)

    def keep(self, name):
        self.own.keep(name)
        self.ram.keep(name)

    def end(self, name):
        self.own.end(name)
        self.ram.end(name)


def _with_ram(store):
    """The store, given its RAM tier when SPOOL/ram names one."""
    data = _read_small(store.d(RAM_FILE), 4096)
    path = data.decode("utf-8", "replace").strip() if data else ""
    if path:
        store.ram = RamStore(path, store, store.log, **dict(
            (k, v) for k, v in store.opt.items() if k != "keep_done_max"))
        store.ram.opt["keep_done_max"] = 100
        store.claims = _TieredClaims(store.claims, store.ram.claims)
        # the worker's beat in the tier; its types' handlers resolved
        # before it listens (Store.beat_path, Store.eager_types)
        store.beat_path = store.ram.beat_path
        store.eager_types = store.ram.outage_types
    return store


_ON_OPEN.append(_with_ram)
# myq init --ram DIR
_COMMAND_OPTIONS.setdefault("init", []).append([
    ("--ram", str, None, "a RAM tier in DIR, on a tmpfs (/tmp, /var/run), "
     "for the types of durable=outage (myq(1) RAM FIRST; an empty value "
     "removes it)")])
_METAVARS["ram"] = "DIR"


def _init_ram(store, args):
    """myq init's --ram (or MYQ_RAM: the init script's settings)."""
    ram = args.ram if args.ram is not None else os.environ.get("MYQ_RAM")
    if ram is not None:
        init_ram(store, ram, args.owner)


_ON_INIT.append(_init_ram)


def init_ram(store, path, owner=None):
    """myq init --ram DIR: the spool's RAM tier in DIR, which must be on a
    RAM filesystem (ConfigError); "": none."""
    if not path:
        _quiet_unlink(store.d(RAM_FILE))
        return
    path = os.path.abspath(path)
    if "\n" in path:
        raise UsageError("--ram takes a directory's path (no newline)")
    RamStore(path, store, store.log).make(owner)
    _replace(store.d(RAM_FILE), (path + "\n").encode("utf-8"), sync=True,
             mode=0o644)


# HTTP forwarding #############################################################
#
# The http type (myq(1) the http type): requests and answers, a
# destination's origin, --uplink-rate (Uplink), the kept connections
# (HttpPool), batches and Kafka's body.


def _retry_after(value, now=None):
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():     # ('²' is a digit too)
        return float(value)
    try:
        from email.utils import parsedate_to_datetime
        dt = parsedate_to_datetime(value)
        return max(0.0, dt.timestamp() - (_now() if now is None else now))
    except (ImportError, TypeError, ValueError, IndexError, OverflowError):
        return None


_REDIRECTS = (301, 302, 303, 307, 308)
_CREDENTIALS = ("authorization", "cookie", "proxy-authorization")


def http_request(job, headers=None, body=True):
    """(method, url, body bytes or None, headers) of an `http` job
    (myq(1) the http type); PermanentError when the payload cannot make a request.  The
    configured `headers` win over the job's own; `User-Agent` is
    myq/VERSION unless one of them sets it.  `body` False: no body (None)
    and no Content-Type of its own (a batch's key: http_group_key)."""
    p = job.get("payload")
    if not isinstance(p, dict) or not isinstance(p.get("url"), str):
        raise PermanentError("http: the payload must be an object with a url")
    url = p["url"]
    if url.partition(":")[0].lower() not in ("http", "https"):
        raise PermanentError("http: unsupported URL scheme in %r" % url[:200])
    method = str(p.get("method") or "POST").upper()
    extra = p.get("headers") or {}
    if not isinstance(extra, dict):
        raise PermanentError("http: headers must be an object")
    hdrs = dict((str(k), str(v)) for k, v in extra.items())
    data = None
    if body and p.get("body") is not None:
        body = p["body"]
        if isinstance(body, str):
            data = body.encode("utf-8")
            ctype = "text/plain; charset=utf-8"
        else:
            data = json.dumps(body, separators=(",", ":")).encode("utf-8")
            ctype = "application/json"
        if not any(k.lower() == "content-type" for k in hdrs):
            hdrs["Content-Type"] = ctype
    hdrs["Idempotency-Key"] = job["id"]
    for k, v in (headers or {}).items():
        for old in [h for h in hdrs if h.lower() == k.lower()]:
            del hdrs[old]
        hdrs[k] = v
    if not any(k.lower() == "user-agent" for k in hdrs):
        hdrs["User-Agent"] = "myq/" + __version__
    return method, url, data, hdrs


def http_verdict(status, header, head, method, backoff_max=3600.0):
    """What an answer means (myq(1) the http type): None when the job is done, else the
    exception to raise.  `header(name)` gives a response header or None;
    `head` is the start of the body.  Pure: no I/O."""
    text = head[:200].decode("utf-8", "replace").strip()
    msg = "http %d: %s" % (status, text)
    if status in _REDIRECTS and header("Location"):
        msg = "http %d: redirect to %s (not followed for %s)" % (
            status, header("Location")[:200], method)
    if 200 <= status < 300:
        return None
    if status in (408, 425, 429) or 500 <= status <= 599:
        ra = _retry_after(header("Retry-After"))
        return DestinationDown(None if ra is None else min(ra, backoff_max), msg)
    return PermanentError(msg)


def _origin(parts):
    """(scheme, host, port) of a urlsplit() result, port explicit.
    ValueError for a port that is not a number."""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, (parts.hostname or "").lower(), port


def http_dest(url):
    """The circuit breaker's destination of an http URL (myq(1) holds): its
    origin as _origin() gives it to HttpPool, "scheme://host:port"; None
    when the URL has none (not http or https, no host, a bad port)."""
    if not isinstance(url, str):
        return None
    try:
        from urllib.parse import urlsplit
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return None
        scheme, host, port = _origin(parts)
    except (ImportError, ValueError):
        return None
    return "%s://%s:%d" % (scheme, "[%s]" % host if ":" in host else host,
                           port)


# Forwarding over slow links (myq(1) the http type): kept connections, gzip, batches.

HTTP_IDLE = 30.0        # a kept connection idle this long is closed
                        # (cellular NATs drop idle flows); tests lower it

# Errors that a kept connection the server closed meanwhile gives before
# any byte of the answer: such a request goes once more on a fresh one.
_STALE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)



def _tls_connection():
    """http.client.HTTPSConnection that resumes the TLS session it is
    given (SSLContext.wrap_socket(session=...)): a reconnect to the same
    server skips the certificate exchange, which on a metered link is most
    of a handshake's bytes."""
    if not _tls_class:
        import http.client

        class TLSConnection(http.client.HTTPSConnection):
            tls_session = None

            def connect(self):
                http.client.HTTPConnection.connect(self)
                self.sock = self._context.wrap_socket(
                    self.sock, server_hostname=self.host,
                    session=self.tls_session)
        _tls_class.append(TLSConnection)
    return _tls_class[0]




class HttpPool(object):
    """A worker's kept http connections (myq(1) the http type).

    Each connection is taken by one request at a time (never two requests
    on one connection at once) and given back when its answer was read to
    the end; at most `size` connections wait per origin (scheme, host,
    port): one per concurrent slot of the worker.  A connection that timed
    out, failed, or whose answer said `Connection: close` is closed, never
    given back.  One waiting longer than `idle` seconds is closed by a
    thread that lives only while connections wait.  `size` 0: no
    keep-alive (a fresh connection per request, closed after it).  One
    SSLContext for the pool (`ca` adds a CA file to the system's), and the
    last TLS session of each origin is offered to its next connection."""

    def __init__(self, size=1, ca=None, idle=None, uplink=None):
        import threading
        # --uplink-rate: the worker's Uplink, or its rate
        self.uplink = uplink if isinstance(uplink, Uplink) else \
            Uplink(uplink) if uplink else None
        self.size = max(0, int(size))
        self.ca = ca
        self.idle = HTTP_IDLE if idle is None else float(idle)
        self._cond = threading.Condition(threading.Lock())
        self._thread = threading.Thread
        self._free = {}         # origin -> [(connection, since)], oldest first
        self._sessions = {}     # origin -> the last ssl.SSLSession
        self._reaper = None
        self._ctx = None
        self.connections = 0    # made, for tests and the bench

    def _context(self):
        if self._ctx is None:
            try:
                import ssl
            except ImportError:
                raise PermanentError("http: https needs Python's ssl module "
                                     "(OpenWrt: opkg install python3-openssl)")
            ctx = ssl.create_default_context()
            if self.ca:
                try:
                    ctx.load_verify_locations(cafile=self.ca)
                except (OSError, ValueError, ssl.SSLError) as e:
                    raise DestinationDown(None, "http: --http-ca %s: cannot "
                                          "load it (%s); give a PEM file of CA "
                                          "certificates" % (self.ca, e))
            self._ctx = ctx
        return self._ctx

    def take(self, origin, timeout, fresh=False):
        """(connection, reused): a waiting connection of `origin` that is
        still open, else (or with `fresh`) a new one, not yet connected."""
        scheme, host, port = origin
        with self._cond:
            free = self._free.get(origin) or []
            if fresh:
                # The server closed one: the others of its origin, too.
                for conn, _ in free:
                    conn.close()
                del free[:]
            while free:
                conn, since = free.pop()
                if _mono() - since < self.idle and _still_open(conn.sock):
                    conn.timeout = timeout
                    return conn, True
                conn.close()
        if scheme == "https":
            ctx = self._context()       # first: says when ssl is missing
            conn = _tls_connection()(host, port, timeout=timeout, context=ctx)
            conn.tls_session = self._sessions.get(origin)
        else:
            import http.client
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        with self._cond:
            self.connections += 1
        return conn, False

    def give(self, origin, conn):
        """Back after a complete answer: kept, or closed if it cannot be."""
        sock = conn.sock
        if sock is None or self.size == 0:
            conn.close()
            return
        session = getattr(sock, "session", None)
        with self._cond:
            if session is not None:
                self._sessions[origin] = session
            free = self._free.setdefault(origin, [])
            if len(free) >= self.size:
                conn.close()
                return
            free.append((conn, _mono()))
            if self._reaper is None:
                self._reaper = self._thread(target=self._reap,
                                            name="myq-http-idle")
                self._reaper.daemon = True
                self._reaper.start()

    def _reap(self):
        """Close connections idle for `idle` seconds; return when none waits."""
        with self._cond:
            try:
                while True:
                    now, soonest = _mono(), None
                    for origin, free in list(self._free.items()):
                        while free and now - free[0][1] >= self.idle:
                            free.pop(0)[0].close()
                        if free:
                            due = free[0][1] + self.idle
                            soonest = due if soonest is None else min(soonest, due)
                        else:
                            del self._free[origin]
                    if soonest is None:
                        return
                    self._cond.wait(max(0.01, soonest - now))
            finally:
                self._reaper = None

    def close(self):
        """Close every waiting connection (the worker stops); the pool can
        still be used after."""
        with self._cond:
            for free in self._free.values():
                for conn, _ in free:
                    conn.close()
            self._free.clear()
            self._cond.notify_all()

    def waiting(self):
        """How many connections wait now (tests)."""
        with self._cond:
            return sum(len(f) for f in self._free.values())

    def exchange(self, parts, method, target, data, hdrs, deadline, run=None):
        """Send one request to the origin of `parts` and read its whole
        answer before `deadline` (monotonic): (status, getheader, start of
        the body).  Network errors and time-outs raise DestinationDown; a
        reused connection that fails before any byte of the answer is
        tried once more on a fresh one.  With `run`, the connection in use
        is run.conn, which the worker cuts when the job's time is up."""
        import http.client
        try:
            origin = _origin(parts)
        except ValueError as e:          # a bad port
            raise PermanentError("http: bad URL %s: %s" % (
                parts.geturl()[:200], e))
        why = _unsendable(method, target, hdrs)
        if why:
            raise _Unsent("http: the job's request cannot be sent (%s); "
                          "nothing was sent to %s" % (why, origin[1]))
        fresh = False
        while True:
            left = deadline - _mono()
            try:
                conn, reused = self.take(origin, max(0.05, left), fresh)
            except ValueError as e:
                raise PermanentError("http: bad URL %s: %s" % (
                    parts.geturl()[:200], e))
            if run is not None:
                run.conn = conn
            keep = answered = False
            try:
                if left <= 0:
                    raise _timed_out()
                if conn.sock is not None:
                    conn.sock.settimeout(left)
                conn.request(method, target, body=data, headers=hdrs)
                sock = conn.sock
                _settimeout(sock, deadline)
                resp = conn.getresponse()
                answered = True
                head = b""
                while True:
                    _settimeout(sock, deadline)
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    head = head or chunk
                if resp.length:     # the server closed before the announced end
                    raise http.client.IncompleteRead(head, resp.length)
                resp.read()         # (read1 leaves a complete answer open)
                keep = not resp.will_close
                return resp.status, resp.getheader, head
            except (http.client.HTTPException, OSError, ValueError) as e:
                if reused and not answered and not fresh and _stale(e) \
                        and not (run is not None and (run.timed_out or run.released)):
                    fresh = True
                    continue
                raise DestinationDown(None, "http: %s %s: %s" % (
                    method, parts.geturl()[:200],
                    getattr(e, "strerror", None) or e or type(e).__name__))
            finally:
                if run is not None:
                    run.conn = None
                if keep:
                    self.give(origin, conn)
                else:
                    conn.close()


_BAD_IN_HEADER = _Pattern(r"[\x00-\x08\x0a-\x1f\x7f]")


def _unsendable(method, target, hdrs):
    """Why http.client would refuse to send this request, or None: checked
    before any connection, so that it is the job's fault, not the
    server's."""
    try:
        method.encode("ascii")
        target.encode("ascii")
    except (UnicodeError, AttributeError):
        return "the method or the path is not ASCII (percent-encode it)"
    if _BAD_IN_HEADER.search(method + target) or " " in target:
        return "a control character or a space in the method or the path"
    for k, v in hdrs.items():
        k, v = str(k), str(v)
        if not k or not k.isascii() or _BAD_IN_HEADER.search(k) or ":" in k \
                or " " in k:
            return "a bad header name %r" % _clip(k, 60)
        try:
            v.encode("latin-1")
        except UnicodeError:
            return "the value of header %s is not Latin-1" % _clip(k, 60)
        if _BAD_IN_HEADER.search(v):
            return "a control character in the value of header %s" % _clip(k, 60)
    return None


def _still_open(sock):

    """False when a waiting connection's socket is readable: the server
    closed it (or sent what no request asked for)."""
    if sock is None:
        return False
    import select
    try:
        if hasattr(select, "poll"):     # no FD_SETSIZE limit
            p = select.poll()
            p.register(sock, select.POLLIN)
            return not p.poll(0)
        return not select.select([sock], [], [], 0)[0]
    except (OSError, ValueError):
        return False


def _settimeout(sock, deadline):
    left = deadline - _mono()
    if left <= 0:
        raise _timed_out()
    if sock is not None:
        sock.settimeout(left)


def _timed_out():
    import socket
    return socket.timeout("timed out")


def _stale(e):
    # (http.client's RemoteDisconnected, "closed without a response", is
    # a ConnectionResetError.)
    ssl = sys.modules.get("ssl")
    return isinstance(e, _STALE) or (ssl is not None and isinstance(
        e, (ssl.SSLEOFError, ssl.SSLZeroReturnError)))


def _gzip(data):
    """`data` gzip-compressed (RFC 1952; zlib writes the header, mtime 0,
    so the same body gives the same bytes)."""
    import zlib
    z = zlib.compressobj(6, zlib.DEFLATED, 31)
    return z.compress(data) + z.flush()


def _http_modules():
    try:
        from urllib.parse import urljoin, urlsplit
        import http.client
    except ImportError:
        raise PermanentError("http: Python's http.client is not installed "
                             "(OpenWrt: opkg install python3-urllib)")
    return urljoin, urlsplit


def _http_send(method, url, data, hdrs, headers, t, backoff_max, run, pool,
               gzip):
    """Send a request made by http_request() or http_batch() and judge the
    answer: None when done, else raise (myq(1) the http type).  `t` bounds the whole
    request (connect, send, answer, redirects).  GET and HEAD follow up to
    5 redirects, to http and https only; a redirect to another origin
    drops the configured headers and credentials."""
    urljoin, urlsplit = _http_modules()
    if pool is None:
        pool = HttpPool(0)
    if gzip and data is not None and \
            not any(k.lower() == "content-encoding" for k in hdrs):
        data = _gzip(data)
        hdrs = dict(hdrs, **{"Content-Encoding": "gzip"})
    if pool.uplink is not None:     # --uplink-rate: the bytes that go
        pool.uplink.wait(len(data or b""), run, later="X-Myq-Backlog" in hdrs)
    deadline = _mono() + t
    if run is not None:
        deadline = min(deadline, run.deadline)
    configured = set(k.lower() for k in (headers or {}))
    for _ in range(6):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PermanentError("http: cannot send to %r (only http and https "
                                 "URLs with a host)" % url[:200])
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        status, header, head = pool.exchange(parts, method, target, data,
                                             hdrs, deadline, run)
        location = header("Location")
        if status in _REDIRECTS and location and method in ("GET", "HEAD"):
            new = urljoin(url, location)
            if urlsplit(new).scheme not in ("http", "https"):
                raise PermanentError("http %d: redirect to %s not followed (only "
                                     "http and https)" % (status, new[:200]))
            try:
                same = _origin(urlsplit(new)) == _origin(parts)
            except ValueError:
                same = False
            if not same:
                hdrs = dict((k, v) for k, v in hdrs.items()
                            if k.lower() not in configured
                            and k.lower() not in _CREDENTIALS)
                configured = set()
            url = new
            continue
        err = http_verdict(status, header, head, method, backoff_max)
        if err is not None:
            raise err
        return
    raise PermanentError("http: more than 5 redirects, last to %s" % url[:200])


def _job_timeout(job, timeout):
    p = job["payload"]
    if _is_num(p.get("timeout")) and p["timeout"] > 0:
        return float(p["timeout"])
    return job.get("timeout") or timeout or 30.0


def http_handler(job, headers=None, backoff_max=3600.0, timeout=None, run=None,
                 pool=None, gzip=False):
    """The built-in `http` type.  http.client and ssl are imported here
    only: python3-light has neither.  With `pool` (an HttpPool), the
    connection is kept for the next request; with `run` (the worker's),
    the connection is put where the worker can close it when the job's
    time is up, so a job is never in flight twice.  `gzip`: send the body
    gzip-compressed."""
    method, url, data, hdrs = http_request(job, headers)
    _http_modules()
    return _http_send(method, url, data, hdrs, headers,
                      _job_timeout(job, timeout), backoff_max, run, pool, gzip)


def http_group_key(job, headers=None):
    """Which http jobs may share a request (myq(1) the http type, batches): the same key
    means the same method, url and headers (names in any case; the
    Idempotency-Key and a Content-Type that the job did not set itself do
    not count).  A job whose payload cannot make a request gets a key of
    its own, so that it is sent, and fails, alone.  (Its body is not
    encoded: a batch computes this twice a job, a third of its CPU.)"""
    try:
        req = http_request(job, headers, False)
    except PermanentError:
        return ("!", job.get("id"))
    return _group_key(job, headers, req)


def _group_key(job, headers, req):
    """http_group_key of `job` from its http_request(job, headers, False)."""
    method, url, _, hdrs = req
    own = set(k.lower() for k in (job["payload"].get("headers") or {}))
    own.update(k.lower() for k in (headers or {}))
    return (method, url, tuple(sorted(
        (k.lower(), v) for k, v in hdrs.items()
        if k.lower() != "idempotency-key"
        and (k.lower() != "content-type" or "content-type" in own))))


def _ids_key(ids):
    """The Idempotency-Key of a batch: the same ids in the same order give
    the same key.  128 bits of SHA-256 (hashlib's built-in SHA-256 is in
    python3-light; only OpenSSL's _hashlib is not), else of four zlib
    checksums (never used where SHA-256 exists, so a device's keys stay
    the same)."""
    data = ",".join(ids).encode("utf-8")
    try:
        from hashlib import sha256
        return "b-" + sha256(data).hexdigest()[:32]
    except ImportError:
        import zlib
        rev = data[::-1]
        return "bz-%08x%08x%08x%08x" % (
            zlib.crc32(data), zlib.adler32(data), zlib.crc32(rev),
            zlib.adler32(rev) ^ zlib.crc32(data, 0x5bd1e995))


KAFKA_JSON = "application/vnd.kafka.json.v2+json"


def http_batch(jobs, headers=None, backoff_max=3600.0, timeout=None, run=None,
               pool=None, gzip=False, fmt=None, alone=False, key_ids=None):
    """Jobs of one http_group_key() as ONE request (myq(1) the http type): the body is
    a JSON array of their bodies in job order (null for a job without
    one), `X-Myq-Ids` lists their ids in array order, the Idempotency-Key
    is derived from the ids (the same ids give the same key).  One outcome
    for all: returns or raises as http_handler() does.  The time limit is
    the largest `timeout` of their payloads, else `timeout`.  `fmt`
    "kafka": the body is Kafka REST v2's {"records": [{"key": ID, "value":
    BODY}, ...]} (myq(1) policy `format`); `alone`: one job of a type
    without `batch`, its Idempotency-Key its id; `key_ids`: the ids whose key
    it is (a batch's first, when what is left of it goes again)."""
    jobs = list(jobs)
    if not jobs:
        return
    method, url, _, hdrs = http_request(jobs[0], headers)
    key = http_group_key(jobs[0], headers)
    for job in jobs[1:]:
        # (a bad payload fails the batch: PermanentError)
        if _group_key(job, headers, http_request(job, headers, False)) != key:
            raise ValueError("http_batch: job %s differs in method, url or "
                             "headers from job %s; group jobs by "
                             "http_group_key()" % (job["id"], jobs[0]["id"]))
    _http_modules()
    ids = [str(j["id"]) for j in jobs]
    bodies = [j["payload"].get("body") for j in jobs]
    if fmt == "kafka":
        bodies = {"records": [{"key": i, "value": b}
                              for i, b in zip(ids, bodies)]}
    data = json.dumps(bodies, separators=(",", ":")).encode("utf-8")
    configured = set(k.lower() for k in (headers or {}))
    own = set(k.lower() for k in (jobs[0]["payload"].get("headers") or {}))
    if "content-type" not in own | configured:
        for k in [k for k in hdrs if k.lower() == "content-type"]:
            del hdrs[k]
        hdrs["Content-Type"] = KAFKA_JSON if fmt == "kafka" \
            else "application/json"
    if "idempotency-key" not in configured:
        hdrs["Idempotency-Key"] = ids[0] if alone else _ids_key(key_ids or ids)
    hdrs["X-Myq-Ids"] = ",".join(ids)
    t = max(_job_timeout(j, timeout) for j in jobs)
    return _http_send(method, url, data, hdrs, headers, t, backoff_max, run,
                      pool, gzip)


class HttpHandler(Handler):
    """The built-in `http` type (myq(1) the http type): its destination is the
    URL's origin, scheme://host:port (the one HttpPool keeps connections
    to); jobs share a request when http_group_key() says so.  The run's
    time limit is the job's; a payload's own `timeout` bounds the request
    within it (http_handler).  It holds its connections (`pool`, an
    HttpPool), the headers of --header and --backoff-max (a Retry-After's
    cap).  Its methods' `runner` is the worker's _Runner."""
    __slots__ = ("pool", "headers", "backoff_max")
    kind = "http"
    remote = True

    def __init__(self, pool, headers, backoff_max):
        Handler.__init__(self)
        self.pool, self.headers, self.backoff_max = pool, headers, backoff_max

    def dest(self, job, runner, run=None):
        urls = runner.spool.rules(job["type"]).get("url")
        if urls:            # the type's own, in order (myq(1) failover)
            return runner.holds._pick_dest(_dests_of(urls, job["type"]), job,
                                           run)
        p = job.get("payload")
        return http_dest(p.get("url") if isinstance(p, dict) else None) \
            or job["type"]

    def batch_key(self, job, runner):
        if runner.spool.rules(job["type"]).get("url"):
            return ("url",)     # (all go to the type's destination)
        return http_group_key(job, self.headers)

    def call(self, runner, run, job):
        self.call_batch(runner, run, [job], False)

    def call_batch(self, runner, run, jobs, batched=True):
        """A batch of http jobs as one request (myq(1) the http type); under
        the type's `url`, to its first destination that answers."""
        rules = runner.spool.rules(jobs[0]["type"])
        t = self.time_limit(jobs[0], runner.timeout)
        try:
            if rules.get("url"):
                self._failover(runner, run, jobs, rules, batched, t)
            else:
                self._send(runner, run, jobs, rules, batched, t)
        except RetryLater as e:
            e.retry_after = e.seconds
            e.seconds = runner.delays.at_least(e.seconds, jobs[0]["attempts"])
            raise
        return ("done",)

    def _send(self, runner, run, jobs, rules, batched, t):
        gzip, fmt = bool(rules.get("gzip")), rules.get("format")
        headers, now = self.headers, _now()
        if rules.get("order") == "live-first" and all(
                backlog_job(j, rules, now) for j in jobs):
            # the backlog marked for the receiver (myq(1) policy `order`)
            headers = dict(headers or (), **{"X-Myq-Backlog": "1"})
        if batched or fmt == "kafka":
            # what is left of a batch goes under its first key (_Batches)
            whole = run is not None and run.batch and \
                runner.spool.claims.batches.whole.get(run.batch[0].batch)
            http_batch(jobs, headers, self.backoff_max, t, run,
                       self.pool, gzip=gzip, fmt=fmt, alone=not batched,
                       key_ids=whole or None)
        else:
            http_handler(jobs[0], headers, self.backoff_max, t,
                         run, self.pool, gzip=gzip)

    def _failover(self, runner, run, jobs, rules, batched, t):
        """Send to the type's destination picked at the start (run.dest),
        then on to the next ones not held, in order, after a destination
        failure: the same ids and Idempotency-Key everywhere, no attempt
        counted; each failure is the breaker's (run.failovers, booked by
        the worker at the finish).  Each destination has its share of
        the run's time, so that a hung one leaves time for the next."""
        for job in jobs:
            why = own_destination(job, rules)
            if why:
                raise PermanentError(why)
        urls = rules["url"].split()
        dests = _dests_of(rules["url"], jobs[0]["type"])
        first = dests.index(run.dest) if run.dest in dests else 0
        todo = list(range(first, len(urls)))
        base = run.deadline
        end = _mono() + t if base is None else min(_mono() + t, base)
        failed = None
        while todo:
            i = todo.pop(0)
            if i != first and runner.holds.until.get(dests[i], 0) > _now():
                # held, the last too: none of a held destination's jobs
                # start but its probe; when every one after the failure is
                # held, the run ends with that failure, where it was
                if todo:
                    continue
                raise failed
            if base is not None:    # (moved on by the uplink's waits)
                end, base = end + run.deadline - base, run.deadline
            share = max(0.05, (end - _mono()) / (1 + len(todo)))
            sent = [dict(j, payload={"url": urls[i], "body": j["payload"],
                                     "timeout": share}) for j in jobs]
            if i != first:
                run.failovers = run.failovers + ((run.dest, failed),)
            run.dest = dests[i]
            try:
                return self._send(runner, run, sent, rules, batched, share)
            except DestinationDown as e:
                if base is not None:
                    end, base = end + run.deadline - base, run.deadline
                if not todo or end - _mono() < 0.1 or run.timed_out \
                        or run.released:
                    raise
                failed = e

    def resolve(self, type):
        """The http handler, or why not: without Python's http.client the
        type is held (myq(1) batches), not dead: install it and the jobs run."""
        try:
            import http.client  # noqa: F401
            import urllib.parse  # noqa: F401
        except ImportError:
            return None, ("the http handler needs Python's http.client and "
                          "urllib (OpenWrt: opkg install python3-urllib)")
        return self, None

    def close(self):
        self.pool.close()


def _http_type(o, uplink):
    """A worker's http type: its kept connections, one per destination
    and slot (myq(1) the http type), on the worker's uplink."""
    return HttpHandler(HttpPool(o.concurrency, o.http_ca, None, uplink),
                       o.http_headers, o.backoff_max)


_BUILTIN_TYPES["http"] = ("url", _http_type, None)


# MQTT ########################################################################
#
# MQTT 3.1.1 on the standard library: socket (and ssl for mqtts), imported
# when a connection is made, never at load.  One connection per worker,
# clean session, re-made from scratch after any error; QoS 1 is done on the
# broker's PUBACK, QoS 0 once written.  A thread sends PINGREQ when the
# connection idles past keepalive/2 (the broker drops it at 1.5 x keepalive).

MQTT_PORTS = {"mqtt": 1883, "mqtts": 8883}
_MQTT_URL = _Pattern(r"(?i)(mqtts?)://(?:([^@/]*)@)?(\[[0-9A-Fa-f:.]+\]|[^\[\]@/:]+)"
                     r"(?::(\d{1,5}))?/?\Z")
_MQTT_MAX = 268435455          # the largest remaining length MQTT can say
_MQTT_WINDOW = 65535           # packet ids: at most this many in flight
_CONNACK = {
    1: ("the broker does not speak MQTT 3.1.1 (CONNACK 1, unacceptable "
        "protocol version)", "use a broker that supports MQTT 3.1.1", True),
    2: ("the client id was rejected (CONNACK 2)", "give --mqtt-client-id at "
        "most 23 letters and digits, unique per worker", True),
    3: ("the MQTT service is unavailable (CONNACK 3)", None, False),
    4: ("bad user name or password (CONNACK 4)", "check the user in --mqtt "
        "(mqtt://USER@HOST) and the password in --mqtt-password-file", True),
    5: ("not authorised (CONNACK 5)", "the broker does not let this client "
        "connect: check the user in --mqtt, --mqtt-password-file and the "
        "broker's access rules", True),
}


class _MqttBroken(Exception):
    """The connection is unusable: closed, timed out, or the broker broke
    the protocol."""


def _mqtt_url(url):
    """(scheme, user or None, host, port) of a broker URL."""
    m = _MQTT_URL.match(url or "")
    if not m:
        # echoed without the password of its user part (USER:PASSWORD@)
        head, at, tail = (url or "").rpartition("@")
        scheme, sep, userinfo = head.rpartition("://")
        if at and ":" in userinfo:
            url = "%s%s%s:***@%s" % (scheme, sep, userinfo.partition(":")[0], tail)
        raise UsageError("--mqtt %r is not an MQTT broker URL: give "
                         "mqtt://[USER@]HOST[:PORT] or mqtts://[USER@]HOST[:PORT]"
                         % (url,))
    scheme, user, host, port = m.groups()
    if user is not None and ":" in user:
        raise UsageError("--mqtt %s: a password in the URL shows in ps and "
                         "the logs; put it in --mqtt-password-file"
                         % url.replace(user, user.partition(":")[0] + ":***", 1))
    if user == "":
        raise UsageError("--mqtt %s: empty user name before '@' (give "
                         "mqtt://USER@HOST, or no '@')" % url)
    scheme = scheme.lower()
    port = int(port) if port else MQTT_PORTS[scheme]
    if not 0 < port < 65536:
        raise UsageError("--mqtt %s: port %d is not in 1-65535" % (url, port))
    return scheme, user, host.lower(), port


def mqtt_dest(url):
    """The broker of a --mqtt URL as the circuit breaker names it (myq(1) holds):
    scheme://host:port, lower case, the port explicit, no user."""
    scheme, _, host, port = _mqtt_url(url)
    return "%s://%s:%d" % (scheme, host, port)


def _mqtt_len(n):
    """MQTT's remaining length: 7 bits a byte, the high bit says more."""
    out = bytearray()
    while True:
        n, b = n >> 7, n & 127
        out.append(b | 128 if n else b)
        if not n:
            return bytes(out)


def _mqtt_str(b):
    return len(b).to_bytes(2, "big") + b


def _mqtt_parse(buf, limit=65536):
    """(first byte, body, length used) of the packet at the start of buf,
    or None while it is incomplete.  A publisher only ever gets small
    packets back (CONNACK, PUBACK, PINGRESP): anything larger than `limit`
    (64K; a subscriber's: its largest message) is not MQTT."""
    n = shift = 0
    for i in range(1, min(len(buf), 5)):
        b = buf[i]
        n |= (b & 127) << shift
        shift += 7
        if not b & 128:
            if n > limit:
                raise _MqttBroken("the broker sent a %d-byte packet (protocol "
                                  "error)" % n)
            end = i + 1 + n
            if len(buf) < end:
                return None
            return buf[0], bytes(buf[i + 1:end]), end
    if len(buf) >= 5:
        raise _MqttBroken("the broker sent a bad packet length (protocol error)")
    return None


def _mqtt_message(job):
    """(topic, message, qos, retain) of an `mqtt` job, topic and message as
    bytes; PermanentError when the payload cannot be published."""
    p = job.get("payload")
    if not isinstance(p, dict):
        raise PermanentError('mqtt: the payload must be an object: {"topic": '
                             '"a/b", "message": ..., "qos": 0|1, "retain": false}')
    topic = p.get("topic")
    if not isinstance(topic, str) or not topic:
        raise PermanentError("mqtt: the payload has no topic (a non-empty string)")
    if "+" in topic or "#" in topic:
        raise PermanentError("mqtt: topic %r has a wildcard (+ or #); publish "
                             "to a topic without them" % topic[:200])
    if "\0" in topic:
        raise PermanentError("mqtt: topic %r contains a NUL character"
                             % topic[:200])
    qos = p.get("qos", 1)
    if qos is None:
        qos = 1
    if isinstance(qos, bool) or not isinstance(qos, int) or qos not in (0, 1):
        raise PermanentError("mqtt: qos %s is not supported: give 0 or 1"
                             % json.dumps(qos)[:50])
    retain = p.get("retain", False)
    if retain is None:
        retain = False
    if not isinstance(retain, bool):
        raise PermanentError("mqtt: retain must be true or false, not %s"
                             % json.dumps(retain)[:50])
    msg = p.get("message")
    try:
        t = topic.encode("utf-8")
        if "message" not in p:
            data = b""
        elif isinstance(msg, str):
            data = msg.encode("utf-8")
        else:
            data = json.dumps(msg, separators=(",", ":")).encode("utf-8")
    except UnicodeError:        # a lone surrogate ("\ud800") in the JSON
        raise PermanentError("mqtt: the topic or message is not valid UTF-8 text")
    if len(t) > 65535:
        raise PermanentError("mqtt: the topic is %d bytes long (at most 65535)"
                             % len(t))
    if len(t) + 4 + len(data) > _MQTT_MAX:
        raise PermanentError("mqtt: the message is %d bytes, larger than MQTT "
                             "allows (256 MB)" % len(data))
    return t, data, qos, retain


def _mqtt_client_id():
    """Unique per worker process, and at most 23 characters (all an MQTT
    3.1.1 broker must accept): myq-HOST-PID-RANDOM, the host cut to fit."""
    host = re.sub(r"[^A-Za-z0-9]", "", os.uname()[1])
    tail = "-%d-%s" % (os.getpid(), _rand_hex(2))
    return ("myq-" + host)[:max(3, 23 - len(tail))] + tail


def _os_text(e):
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def _mqtt_password(path):
    """The password in --mqtt-password-file (its trailing newline dropped)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read(65536).rstrip(b"\r\n")
    except OSError as e:
        raise ConfigError("cannot read --mqtt-password-file %s: %s (the worker "
                          "must be able to read it)" % (path, _os_text(e)))


class MqttClient(object):
    """One MQTT 3.1.1 connection to a broker, made at first use and made
    again from scratch after any error (nothing half-sent is reused).
    Thread-safe: every exchange holds `lock`.  `close()` when done: it
    sends DISCONNECT and ends the keep-alive thread."""

    def __init__(self, url, password=None, client_id=None, ca=None, cert=None,
                 key=None, keepalive=60, timeout=10.0):
        import threading
        self.scheme, self.user, self.host, self.port = _mqtt_url(url)
        self.dest = "%s://%s:%d" % (self.scheme, self.host, self.port)
        if password is not None and self.user is None:
            raise UsageError("--mqtt-password-file needs a user in --mqtt "
                             "(mqtt://USER@%s)" % self.host)
        if (ca or cert or key) and self.scheme != "mqtts":
            raise UsageError("--mqtt-ca, --mqtt-cert and --mqtt-key are for "
                             "mqtts:// brokers; --mqtt is %s" % self.dest)
        if key and not cert:
            raise UsageError("--mqtt-key needs --mqtt-cert (the client "
                             "certificate it belongs to)")
        for flag, path in (("--mqtt-ca", ca), ("--mqtt-cert", cert),
                           ("--mqtt-key", key)):
            if path:
                try:
                    open(path, "rb").close()
                except OSError as e:
                    raise ConfigError("cannot read %s %s: %s" % (
                        flag, path, _os_text(e)))
        if self.scheme == "mqtts":
            try:
                import ssl  # noqa: F401
            except ImportError:
                raise ConfigError("--mqtt %s needs Python's ssl module (OpenWrt: "
                                  "opkg install python3-openssl)" % self.dest)
        self.client_id = client_id or _mqtt_client_id()
        if len(self.client_id.encode("utf-8", "replace")) > 65535:
            raise UsageError("--mqtt-client-id is too long (at most 23 "
                             "characters is safe)")
        if not 0 <= int(keepalive) <= 65535:
            raise UsageError("MQTT keepalive %r is not in 0-65535 s" % keepalive)
        self.password = password
        self.ca, self.cert, self.key = ca, cert, key
        self.keepalive, self.timeout = int(keepalive), float(timeout)
        self.lock = threading.RLock()
        self.sock = None            # _abort() shuts it down to cut a run
        self.connects = 0           # connections made, for tests and benches
        self._threading = threading
        self._buf = bytearray()
        self._next_id = 0
        self._last_sent = 0.0
        self._answered = False
        self._quickack = None
        self._ctx = self._session = None
        self._pinger = None
        self._closed = False
        self.clean = True           # clean session (a subscriber's is not)
        self.max_packet = 65536     # the largest packet taken from the broker

    # Packets ---------------------------------------------------------------

    def _left(self, deadline, what):
        t = deadline - _mono()
        if t <= 0:
            raise _MqttBroken("no %s from the broker in time" % what)
        return t

    def _send(self, data, deadline):
        self.sock.settimeout(self._left(deadline, "room to write"))
        self.sock.sendall(data)
        self._last_sent = _mono()

    def _read(self, deadline, what, quick=False):
        """The next packet: (first byte, body).  `quick`: more answers are
        due, so acknowledge at once what comes (TCP_QUICKACK): a broker
        without TCP_NODELAY (mosquitto's default) holds its next PUBACKs
        until the first is acknowledged, and a delayed ACK costs 40 ms."""
        buf = self._buf
        while True:
            got = _mqtt_parse(buf, self.max_packet)
            if got is not None:
                del buf[:got[2]]
                return got[0], got[1]
            self.sock.settimeout(self._left(deadline, what))
            if quick and self._quickack:
                try:
                    self.sock.setsockopt(6, self._quickack, 1)   # IPPROTO_TCP
                except OSError:
                    self._quickack = None
            try:
                data = self.sock.recv(65536)
            except OSError as e:
                if type(e).__name__ in ("timeout", "TimeoutError"):
                    raise _MqttBroken("no %s from the broker in time" % what)
                raise
            if not data:
                raise _MqttBroken("the broker closed the connection")
            buf += data

    # The connection ----------------------------------------------------------

    def _connect(self, deadline):
        import socket
        host = self.host.strip("[]")
        try:
            # an ASCII name as bytes: a str goes through the idna codec,
            # which needs unicodedata (not in python3-light)
            host = host.encode("ascii")
        except UnicodeError:
            pass
        try:
            sock = socket.create_connection(
                (host, self.port), timeout=self._left(deadline, "connection"))
        except _MqttBroken:
            raise
        except OSError as e:
            raise DestinationDown(None, "mqtt: cannot connect to %s: %s"
                                  % (self.dest, _os_text(e)))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._quickack = getattr(socket, "TCP_QUICKACK", None)   # Linux
            if self.scheme == "mqtts":
                sock = self._tls(sock, deadline)
            self.sock, self._buf = sock, bytearray()
            self._send(self._connect_packet(), deadline)
            kind, body = self._read(deadline, "CONNACK")
            if kind != 0x20 or len(body) != 2:
                raise _MqttBroken("the broker answered CONNECT with packet "
                                  "type %d, not CONNACK" % (kind >> 4))
            if body[1]:
                raise self._refused(body[1])
            if self.scheme == "mqtts":
                self._session = getattr(sock, "session", None) or self._session
        except BaseException:
            self.sock = None
            sock.close()
            raise
        self.connects += 1
        self._closed = False
        if self.keepalive and (self._pinger is None or not self._pinger.is_alive()):
            self._pinger = self._threading.Thread(target=self._keep_alive,
                                                  name="myq-mqtt-ping")
            self._pinger.daemon = True
            self._pinger.start()

    def _connect_packet(self):
        flags = 0x02 if self.clean else 0               # clean session
        payload = _mqtt_str(self.client_id.encode("utf-8"))
        if self.user is not None:
            flags |= 0x80
            payload += _mqtt_str(self.user.encode("utf-8"))
            if self.password is not None:
                flags |= 0x40
                payload += _mqtt_str(self.password)
        head = _mqtt_str(b"MQTT") + bytes((4, flags)) + \
            self.keepalive.to_bytes(2, "big")
        return b"\x10" + _mqtt_len(len(head) + len(payload)) + head + payload

    def _refused(self, code):
        what, todo, config = _CONNACK.get(code, (
            "refused with CONNACK code %d" % code, None, False))
        msg = "mqtt: %s refused the connection: %s" % (self.dest, what)
        if config:
            msg = "mqtt: configuration error: %s refused the connection: %s; %s" % (
                self.dest, what, todo)
        e = DestinationDown(None, msg)
        e.config = config
        return e

    def _tls(self, sock, deadline):
        try:
            import ssl
        except ImportError:
            raise DestinationDown(None, "mqtt: %s needs Python's ssl module "
                                  "(OpenWrt: opkg install python3-openssl)"
                                  % self.dest)
        if self._ctx is None:
            try:
                ctx = ssl.create_default_context()
                if self.ca:
                    ctx.load_verify_locations(cafile=self.ca)
                if self.cert:
                    ctx.load_cert_chain(self.cert, self.key)
            except (OSError, ValueError) as e:
                raise DestinationDown(None, "mqtt: configuration error: cannot "
                                      "load --mqtt-ca/--mqtt-cert/--mqtt-key: %s"
                                      % _os_text(e))
            self._ctx = ctx
        sock.settimeout(self._left(deadline, "TLS handshake"))
        try:
            return self._ctx.wrap_socket(sock, server_hostname=self.host.strip("[]"),
                                         session=self._session)
        except ssl.CertificateError as e:
            raise DestinationDown(None, "mqtt: configuration error: %s: the "
                                  "broker's certificate is not trusted (%s); give "
                                  "its CA with --mqtt-ca" % (self.dest, _os_text(e)))

    def _stale(self):
        """Did the broker close this idle connection (or send what nobody
        asked for)?  Then it is not used again."""
        import select
        sock = self.sock
        try:
            pending = sock.pending() if hasattr(sock, "pending") else 0
            if not pending and not select.select([sock], [], [], 0)[0]:
                return False
            sock.settimeout(0)
            sock.recv(4096)             # EOF, or data that nobody asked for
            return True
        except OSError as e:
            # no data after all: a TLS record that was no application data
            return not (isinstance(e, BlockingIOError)
                        or type(e).__name__ == "SSLWantReadError")

    def _drop(self):
        """Forget the connection (after an error: nothing of it is reused)."""
        sock, self.sock = self.sock, None
        self._buf = bytearray()
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _keep_alive(self):
        """The keep-alive thread: PINGREQ when idle past keepalive/2, so
        that the broker (which drops a client silent for 1.5 x keepalive)
        and NATs keep the connection."""
        every = max(0.05, self.keepalive / 4.0)
        while not self._closed:
            time.sleep(every)
            if self.sock is None or _mono() - self._last_sent < self.keepalive / 2.0:
                continue
            if self.lock.acquire(False):        # busy: that is traffic enough
                try:
                    if self.sock is not None and not self._closed:
                        self.ping()
                finally:
                    self.lock.release()

    def ping(self):
        """PINGREQ, wait for PINGRESP; False (and the connection dropped)
        when it does not come."""
        with self.lock:
            if self.sock is None:
                return False
            deadline = _mono() + min(self.timeout, max(2.0, float(self.keepalive)))
            try:
                self._send(b"\xc0\x00", deadline)
                kind, _ = self._read(deadline, "PINGRESP")
                if kind != 0xD0:
                    raise _MqttBroken("unexpected packet type %d" % (kind >> 4))
                return True
            except (OSError, ValueError, _MqttBroken):
                self._drop()
                return False
            except BaseException:
                self._drop()
                raise

    def close(self):
        """DISCONNECT and close; a later publish connects again."""
        self._closed = True
        if not self.lock.acquire(True, 1.0):
            # another thread is mid-exchange (a run being abandoned): cut it
            sock = self.sock
            if sock is not None:
                import socket
                try:
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass
            return
        try:
            if self.sock is not None:
                try:
                    self._send(b"\xe0\x00", _mono() + 1.0)
                except (OSError, _MqttBroken):
                    pass
                self._drop()
        finally:
            self.lock.release()

    # Publishing --------------------------------------------------------------

    def publish_many(self, msgs, timeout):
        """Publish (topic bytes, message bytes, qos, retain) tuples, all of
        them in flight at once, within `timeout` seconds: one outcome per
        message, in order: None (done) or a DestinationDown."""
        out = [None] * len(msgs)
        done = set()
        deadline = _mono() + timeout
        left = list(range(len(msgs)))
        retried = False
        err = None
        with self.lock:
            while left:
                reused = self.sock is not None
                self._answered = False
                try:
                    if reused and self._stale():
                        self._drop()
                        reused = False
                    if self.sock is None:
                        self._connect(deadline)
                    self._exchange(msgs, left[:_MQTT_WINDOW], deadline, done)
                except DestinationDown as e:        # cannot connect, refused
                    self._drop()
                    err = e
                except (OSError, ValueError, _MqttBroken) as e:
                    self._drop()
                    err = DestinationDown(None, "mqtt: %s: %s" % (
                        self.dest, _os_text(e)))
                    # A connection that had been idle may have died unseen:
                    # once more on a fresh one, as for any http job (myq(1) the http type).
                    if reused and not self._answered and not retried \
                            and _mono() < deadline:
                        retried, err = True, None
                except BaseException:
                    self._drop()
                    raise
                left = [i for i in left if i not in done]
                if err is not None:
                    break
        for i in left:
            e = DestinationDown(err.seconds, str(err))
            e.config = getattr(err, "config", False)
            e.dest = self.dest
            out[i] = e
        return out

    def _exchange(self, msgs, window, deadline, done):
        """Send the window's PUBLISH packets (64K at a time), then read
        PUBACKs until each QoS 1 one has its own."""
        waiting = {}
        chunk, size, written = [], 0, []
        last = window[-1]
        for i in window:
            topic, data, qos, retain = msgs[i]
            head = _mqtt_str(topic)
            if qos:
                self._next_id = self._next_id % 65535 + 1
                waiting[self._next_id] = i
                head += self._next_id.to_bytes(2, "big")
            else:
                written.append(i)
            chunk.append(bytes((0x30 | qos << 1 | retain,)) +
                         _mqtt_len(len(head) + len(data)) + head)
            chunk.append(data)
            size += len(head) + len(data)
            if size >= 65536 or i == last:
                self._send(b"".join(chunk), deadline)
                done.update(written)                # QoS 0: done once written
                chunk, size, written = [], 0, []
        while waiting:
            kind, body = self._read(deadline, "PUBACK", len(waiting) > 1)
            self._answered = True
            if kind == 0x40 and len(body) == 2:
                i = waiting.pop(int.from_bytes(body, "big"), None)
                if i is not None:
                    done.add(i)
            elif kind != 0xD0:                      # a late PINGRESP is fine
                raise _MqttBroken("the broker sent packet type %d, not PUBACK "
                                  "(protocol error)" % (kind >> 4))


def _mqtt_client(url, password_file=None, client_id=None, ca=None, cert=None,
                 key=None, **kw):
    """The MqttClient of the --mqtt options: everything checked before the
    password file is read."""
    client = MqttClient(url, b"" if password_file else None, client_id, ca,
                        cert, key, **kw)
    client.password = _mqtt_password(password_file)
    return client


def _mqtt_clients(urls, *args, **kw):
    """One MqttClient per broker of --mqtt: "URL URL2" gives brokers in
    order, the second taking the jobs while the first is held (myq(1)
    failover)."""
    return [_mqtt_client(u, *args, **kw) for u in str(urls).split()]


def mqtt_publish(client, jobs, timeout):
    """Publish `mqtt` jobs (myq(1) the mqtt type) through `client`, all in flight at
    once: one outcome per job, in order: None when done (QoS 1: its PUBACK
    came; QoS 0: written), a PermanentError for a payload that cannot be
    published, a DestinationDown for the rest when the connection, the
    CONNACK, a PUBACK or the time failed (the client connects afresh at
    its next use)."""
    out = [None] * len(jobs)
    msgs, where = [], []
    for i, job in enumerate(jobs):
        try:
            msgs.append(_mqtt_message(job))
            where.append(i)
        except PermanentError as e:
            out[i] = e
    if msgs:
        for i, e in zip(where, client.publish_many(msgs, timeout)):
            out[i] = e
    return out


def _mqtt_bytes(jobs):
    """The bytes of the messages of `jobs` that can be published (what
    --uplink-rate counts of them)."""
    n = 0
    for job in jobs:
        try:
            n += len(_mqtt_message(job)[1])
        except PermanentError:
            pass
    return n


class MqttHandler(Handler):
    """The built-in `mqtt` type (myq(1) the mqtt type): its destination is the broker
    of --mqtt; a batch is published all in flight, one outcome a job.  It
    holds the clients of --mqtt's brokers (`clients`, connected at the
    first job; one connection each, shared by the worker's threads), the
    uplink they share with http (--uplink-rate) and the worker's
    --timeout."""
    __slots__ = ("clients", "uplink", "timeout")
    kind = "mqtt"
    remote = True

    def __init__(self, clients, uplink, timeout):
        Handler.__init__(self)
        self.clients, self.uplink, self.timeout = clients, uplink, timeout

    @property
    def client(self):
        """The broker of --mqtt (the first, when it gives more: failover)."""
        return (self.clients or [None])[0]

    def dest(self, job, runner, run=None):
        clients = self.clients
        if len(clients) > 1:    # brokers in order (myq(1) failover)
            return runner.holds._pick_dest([c.dest for c in clients], job, run)
        client = self.client
        return client.dest if client is not None else "mqtt"

    def call(self, runner, run, job):
        err = self.call_batch(runner, run, [job])[1][0]
        if err is not None:
            raise err

    def call_batch(self, runner, run, jobs):
        rules = runner.spool.rules(jobs[0]["type"])
        topic = rules.get("topic")
        out, sent, where = [None] * len(jobs), [], []
        now = _now()
        for i, job in enumerate(jobs):
            why = topic and own_destination(job, rules)
            if why:
                out[i] = PermanentError(why)
                continue
            if topic:       # the type's (myq(1) policy `topic`): the payload
                job = dict(job, payload={"topic": topic,    # is the message
                                         "message": job["payload"]})
            if rules.get("envelope"):
                job = _enveloped(job, rules, now)
            sent.append(job)
            where.append(i)
        # a backlog's payloads wait behind live ones for the uplink, as an
        # http request marked X-Myq-Backlog does (myq(1) policy `order`)
        later = bool(jobs) and all(backlog_job(j, rules, now) for j in jobs)
        self._failover(runner, run, self.clients or [None], sent, where, out,
                       later)
        return ("each", out)

    def _failover(self, runner, run, clients, sent, where, out, later=False):
        """Publish through the broker picked at the start (run.dest), then
        the jobs that its failure left (DestinationDown) through the next
        brokers not held, in order, as HttpHandler._failover does."""
        dests = [c.dest if c is not None else None for c in clients]
        first = dests.index(run.dest) if run.dest in dests else 0
        todo = list(range(first, len(clients)))
        failed = None
        while sent and todo:
            i = todo.pop(0)
            if i != first and runner.holds.until.get(dests[i], 0) > _now():
                continue        # held, the last too (HttpHandler._failover)
            share = None
            if todo and run.deadline is not None:
                share = max(0.05, (run.deadline - _mono()) / (1 + len(todo)))
            if failed is not None:
                run.failovers = run.failovers + ((run.dest, failed),)
            if len(clients) > 1:
                run.dest = dests[i]
            res = self.batch(sent, run, clients[i], share, later)
            for k, e in zip(where, res):
                out[k] = e
            left = [k for k, e in enumerate(res)
                    if isinstance(e, DestinationDown)]
            if not left or not todo or run.timed_out or run.released:
                return
            failed = res[left[0]]
            sent, where = [sent[k] for k in left], [where[k] for k in left]

    def batch(self, jobs, run=None, client=None, share=None, later=False):
        """Publish `mqtt` jobs through the first broker's connection (`client`:
        to that broker), all in flight at once: one outcome per job, in
        order (None: done, else the exception: PermanentError,
        DestinationDown).  With `run`, the connection is cut when the run's
        time is up (_abort); `share`: at most that many seconds of it;
        `later`: a backlog's (Uplink.wait)."""
        client = client or self.client
        up = self.uplink
        if up is not None:
            # --uplink-rate: the payloads' turn is waited for before the
            # connection's (other runs and the keep-alive ping are not
            # kept from it by a wait that is only this run's)
            up.wait(_mqtt_bytes(jobs), run, later)
        limit = min(self.time_limit(j, self.timeout) for j in jobs)
        if share is not None:
            limit = min(limit, share)
        if run is not None:
            # a little before the worker's own limit, so that a time-out is
            # ours: a destination failure (myq(1) holds), not the job's
            limit = max(0.05, min(limit, run.deadline - _mono() - 0.1))
        start = _mono()
        # one exchange at a time on the connection (other threads' runs,
        # the keep-alive ping): waiting for a turn counts in the limit
        if not client.lock.acquire(True, limit):
            out = [DestinationDown(None, "mqtt: %s: no turn on the connection "
                                   "within %gs (the broker is slow to answer)"
                                   % (client.dest, limit)) for _ in jobs]
            for e in out:
                e.dest = client.dest
            return out
        try:
            if run is not None:
                run.conn = client
            return mqtt_publish(client, jobs, max(0.05, limit - (
                _mono() - start)))
        finally:
            if run is not None:
                run.conn = None
            client.lock.release()

    def resolve(self, type):
        if self.client is not None:
            return self, None
        return None, ("no --mqtt broker configured for type %s (give the "
                      "worker --mqtt mqtt://HOST)" % type)

    def close(self):
        for client in self.clients:
            client.close()


def _mqtt_type(o, uplink):
    """A worker's mqtt type: --mqtt's options checked now, the broker
    connected at the first mqtt job (one connection per worker, shared by
    its threads)."""
    return MqttHandler([] if not o.mqtt else _mqtt_clients(
        o.mqtt, o.mqtt_password_file, o.mqtt_client_id, o.mqtt_ca,
        o.mqtt_cert, o.mqtt_key, timeout=min(o.timeout, 30.0)),
        uplink, o.timeout)


def _mqtt_check(kw):
    """--mqtt's options (`kw`: the Worker's keywords) checked: a bad URL
    is a UsageError, an unreadable file a ConfigError."""
    _mqtt_clients(*(kw[k] for k in ("mqtt", "mqtt_password_file",
                                     "mqtt_client_id", "mqtt_ca", "mqtt_cert",
                                     "mqtt_key")))


_BUILTIN_TYPES["mqtt"] = ("topic", _mqtt_type, _mqtt_check)


# Intake: HTTP ################################################################
#
# Jobs that arrive over the network: a local HTTP endpoint and MQTT
# subscriptions, each answered only once its jobs are durable (the spool's
# own enqueue_many, which fsyncs before it returns).  `myq intake` runs
# both in one process, as the spool's user.  The HTTP endpoint is one
# thread's poll(2) loop over non-blocking sockets: a slow client costs a
# buffer and one of _HTTP_CONNS slots for at most --listen-timeout, never a
# wait of anyone else's (a thread per connection would let a slowloris
# hold threads, and each thread's stack).  The subscriptions are a thread
# of their own, whose connect and reconnects may block.
#
# Every job taken in gets its id before it is written (the producer's, or
# one made here as _new_id makes them), so that a request that fails half
# way is taken back whole, and one sent again after a crash finds the jobs
# it already placed: the same id with the same type and payload is the
# same job (answered as before, never queued twice); another payload under
# a known id is a conflict.

_HTTP_CONNS = 64                # connections at once; the oldest goes first
_HTTP_HEAD_MAX = 8192           # bytes of request line and headers
_HTTP_BUFFERED = 4 << 20        # request bytes held at once, all connections
_HTTP_REASONS = {
    100: "Continue", 200: "OK", 202: "Accepted", 400: "Bad Request",
    401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout", 409: "Conflict", 411: "Length Required",
    413: "Payload Too Large", 429: "Too Many Requests",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    503: "Service Unavailable", 505: "HTTP Version Not Supported"}
_NDJSON = ("application/x-ndjson", "application/ndjson", "application/jsonl",
           "application/x-jsonlines", "application/jsonlines")
_INTAKE_BATCH = 256             # jobs in one enqueue_many (one commit)
_INTAKE_LINES = 10000           # jobs in one HTTP request
_INTAKE_IDS = _thread.allocate_lock()     # the HTTP and MQTT threads' _new_id
# the words of check's problems that stop the intake taking jobs (/health 503)
_HEALTH_BLOCKING = (" is damaged", " is missing", "is not writable",
                    "permission denied", "budget", " free on the spool")


class _Refusal(Exception):
    """A request answered with an error `status` (and Retry-After)."""

    def __init__(self, status, message, retry_after=None):
        Exception.__init__(self, message)
        self.status, self.retry_after = status, retry_after


def _same_job(spool, jid, type, payload):
    """Is job `jid`, already in the spool, this one (same type, same
    payload)?  False also when it cannot be read (only its idempotency
    record is left)."""
    try:
        job = spool.show(jid)
    except (MyqError, OSError):
        return False
    return job.get("type") == type and job.get("payload") == payload


def _intake_id(now=None):
    with _INTAKE_IDS:
        return _new_id(_now() if now is None else now)


def _refused(spool, e, items, count=True):
    """The _Refusal of a MyqError that enqueue raised for `items`
    (`count`: count them refused)."""
    if isinstance(e, SpoolFull):
        for t in sorted(set(it[1] for it in items)) if count else ():
            spool.count("refused", t, sum(1 for it in items if it[1] == t))
        bound = "at its bound" in str(e)
        return _Refusal(429 if bound else 503, str(e), 5 if bound else 30)
    if isinstance(e, InvalidJob):
        return _Refusal(413 if "--max-job-bytes" in str(e) else 400, str(e))
    if isinstance(e, SpoolBusy):
        return _Refusal(503, str(e), 1)
    return _Refusal(500, str(e))


def _withdraw_new(spool, ids):
    """Take back what a failed enqueue_many placed of `ids` (still
    waiting): nothing of a refused request is kept (myq(1) INTAKE)."""
    for jid in ids:
        try:
            if spool.locate(jid)[0] in ("ready", "scheduled"):
                spool.delete([jid])
        except (MyqError, OSError):
            pass        # claimed meanwhile, or never placed


def _sync_placed(spool, ids):
    """Make the waiting jobs `ids` durable: each one's file and its
    directory fsync'd (what a killed intake placed, perhaps before its own
    fsync); a row of the SQLite store was durable at its commit.  Only
    what this request names: never a sync(2) of every filesystem."""
    dirs = set()
    for jid in ids:
        try:
            path = spool.locate(jid)[1]
        except MyqError:
            continue
        if path.startswith("db:"):
            continue
        try:
            fd = _open_reg(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue            # claimed meanwhile: a worker has it
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.add(os.path.dirname(path))
    for d in sorted(dirs):
        _fsync_dir(d)


def take_in(spool, items, count=True, known=None):
    """Enqueue `items`, [(id, type, payload)], durably, all or none: the
    ids, in order; a job already there under its id with the same type
    and payload counts as taken (an answer lost to a crash, sent again;
    its id added to the list `known`).  Raises DuplicateJob when an id is
    taken by another job, _Refusal when the spool refuses (a bound, a
    guard: counted `refused` unless not `count`)."""
    for _ in range(3):
        new, waiting, same = [], [], []
        for jid, type, payload in items:
            where = spool.find_id(jid)
            if where is None:
                new.append((jid, type, payload))
                continue
            if not _same_job(spool, jid, type, payload):
                raise DuplicateJob("job id %s is taken by another job (%s); "
                                   "give this one another id" % (jid, where))
            same.append(jid)
            if where == "queued":
                waiting.append(jid)
        try:
            if new:
                spool.enqueue_many([{"type": t, "payload": p, "id": j}
                                    for j, t, p in new])
            if waiting:
                # placed by an intake killed before its answer, perhaps
                # before its fsync: durable before this answer says so
                _sync_placed(spool, waiting)
            if known is not None:
                known.extend(same)
            return [it[0] for it in items]
        except DuplicateJob:
            continue        # another producer, meanwhile: look again
        except MyqError as e:
            # (what it placed is ours: an id placed by another meanwhile
            # would have been a DuplicateJob; the HTTP loop takes one
            # request at a time)
            _withdraw_new(spool, [it[0] for it in new])
            raise _refused(spool, e, new, count)
    raise _Refusal(503, "spool %s: the ids of this request keep changing "
                   "hands; try again" % spool.path, 1)


def _json_value(text, what):
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise _Refusal(400, "%s is nested too deep" % what)
    except ValueError as e:
        raise _Refusal(400, "%s is not JSON (%s)" % (what, e))


def _own_id(value, what):
    """The id a payload names for itself (its `id` field), or None."""
    if not isinstance(value, dict) or value.get("id") is None:
        return None
    jid = value["id"]
    if not isinstance(jid, str) or not NAME_RE.match(jid):
        raise _Refusal(400, "%s: id %s is not a job id (1-128 of A-Z a-z 0-9 "
                       ". _ -, not starting with .)" % (what, json.dumps(jid)[:140]))
    return jid


def http_jobs(type, body, ndjson, key=None, now=None):
    """[(id, type, payload)] of a POST /jobs/TYPE body: one JSON payload,
    or (`ndjson`) one a line.  The id: the Idempotency-Key `key` (one job;
    KEY.N for line N of many), else the payload's own `id` field, else a
    new one.  Raises _Refusal (400)."""
    if not isinstance(type, str) or not NAME_RE.match(type):
        raise _Refusal(400, "job type %r is not a type name (1-128 of A-Z a-z "
                       "0-9 . _ -); POST to /jobs/TYPE" % (type,)[:140])
    if key is not None and not NAME_RE.match(key):
        raise _Refusal(400, "Idempotency-Key %r is not a job id (1-128 of A-Z "
                       "a-z 0-9 . _ -)" % key[:140])
    try:
        text = body.decode("utf-8")
    except UnicodeError:
        raise _Refusal(400, "the body is not UTF-8 text")
    if ndjson:
        lines = [(n, line) for n, line in enumerate(text.split("\n"), 1)
                 if line.strip()]
        if len(lines) > _INTAKE_LINES:
            raise _Refusal(413, "%d jobs in one request: send at most %d a "
                           "request" % (len(lines), _INTAKE_LINES))
        values = [(_json_value(line, "line %d" % n), "line %d" % n)
                  for n, line in lines]
    else:
        values = [(_json_value(text, "the body"), "the body")]
    if not values:
        raise _Refusal(400, "the body holds no job (one JSON payload a line)")
    out, seen = [], set()
    now = _now() if now is None else now
    for n, (value, what) in enumerate(values, 1):
        jid = _own_id(value, what)
        if key is not None:
            jid = key if len(values) == 1 else "%s.%d" % (key, n)
            if len(jid) > 128:
                raise _Refusal(400, "Idempotency-Key is too long for %d jobs "
                               "(KEY.N must fit 128 characters)" % len(values))
        jid = jid or _intake_id(now)
        if jid in seen:
            raise _Refusal(400, "%s repeats id %s of an earlier line" % (what, jid))
        seen.add(jid)
        out.append((jid, type, value))
    return out


def listen_address(text):
    """(host, port, loopback?) of --listen [ADDR]:PORT (ADDR default
    127.0.0.1; [::1]:PORT for IPv6)."""
    m = re.match(r"(?:(\[[0-9A-Fa-f:.]+\]|[0-9.]+|localhost|\*)?:)?(\d{1,5})\Z",
                 text or "")
    port = int(m.group(2)) if m else -1
    if not m or not 0 <= port < 65536:          # (0: any free port, logged)
        raise UsageError("--listen %r is not [ADDR]:PORT (e.g. 127.0.0.1:8440, "
                         "[::1]:8440, 0.0.0.0:8440) nor unix:PATH; ADDR is an "
                         "IP address" % (text,))
    host = (m.group(1) or "127.0.0.1").strip("[]")
    host = {"localhost": "127.0.0.1", "*": "0.0.0.0"}.get(host, host)
    loop = host == "::1" or host.startswith("127.")
    return host, port, loop


def _unix_path(listen):
    """PATH of --listen unix:PATH (absolute, fits a socket's address)."""
    path = listen[5:]
    if not path.startswith("/") or len(path.encode("utf-8", "replace")) > 107 \
            or "\0" in path:
        raise UsageError("--listen %r: unix:PATH needs an absolute PATH of at "
                         "most 107 bytes (e.g. unix:/run/myq/intake.sock)"
                         % (listen,))
    return path


def _tcp_socket(listen):
    """A TCP socket listening on --listen [ADDR]:PORT.  A port taken by
    another program is said loudly (ConfigError): whoever listens there
    gets the producers' posts and their token."""
    import socket
    host, port, _ = listen_address(listen)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                "cannot listen on %s: another program already listens on port "
                "%d (find it: ss -ltnp 'sport = :%d'); it, not myq, would get "
                "the producers' posts and their token: stop it, or give "
                "another --listen (unix:PATH is safe from this)"
                % (listen, port, port))
        raise ConfigError("cannot listen on %s: %s (a port below 1024 needs "
                          "root)" % (listen, _os_text(e)))
    return sock


def _held_socket(fd):
    """The listening TCP socket that supervise took for this intake
    (--listen-fd): the port stays taken while the intake restarts."""
    import socket
    try:
        sock = socket.socket(fileno=fd)
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise OSError(errno.EINVAL, "not a listening socket")
    except OSError as e:
        raise ConfigError("--listen-fd %d: %s (it is supervise's to give)"
                          % (fd, _os_text(e)))
    return sock


def _hold_port(argv):
    """supervise's part (as root, before it drops root): the TCP port of
    the intake's --listen in `argv`, taken now and kept while supervise
    runs, so that no other program takes it while the intake (re)starts,
    and a port below 1024 works; None for unix:PATH or no --listen."""
    if not argv or "--listen" not in argv:
        return None
    listen = argv[argv.index("--listen") + 1]
    if listen.startswith("unix:"):
        return None
    sock = _tcp_socket(listen)
    sock.set_inheritable(True)
    return sock


def _unix_socket(path, gid):
    """A Unix socket listening at `path`, mode 0660, group `gid` (the
    spool's: its producers).  A stale socket there is replaced; a live
    one (another intake), or anything but a socket, is refused."""
    import socket
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ConfigError("cannot use --listen unix:%s: %s" % (path, _os_text(e)))
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError("--listen unix:%s: there is a file there that is "
                              "not a socket; move it away" % path)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(2)
            probe.connect(path)
            live = True
        except OSError as e:
            live = e.errno not in (errno.ECONNREFUSED, errno.ENOENT)
        finally:
            probe.close()
        if live:
            raise ConfigError("--listen unix:%s: another program listens on "
                              "it (another myq intake?); stop it first" % path)
        _quiet_unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)           # (0600 until its group is set)
    try:
        sock.bind(path)
        sock.listen(64)
        fd = os.open(path, getattr(os, "O_PATH", os.O_RDONLY) | O_NOFOLLOW
                     | O_CLOEXEC)
        try:                # the inode bound, never a name put in its place
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                raise OSError(errno.EEXIST, "replaced while being made")
            at = "/proc/self/fd/%d" % fd
            if not os.path.exists(at):
                at = path
            os.chown(at, -1, gid)
            os.chmod(at, 0o660)
        finally:
            os.close(fd)
    except OSError as e:
        sock.close()
        raise ConfigError("cannot listen on unix:%s: %s (its directory must "
                          "be the spool user's, and that user in the spool's "
                          "group)" % (path, _os_text(e)))
    finally:
        os.umask(old)
    return sock


def _read_token(path):
    """The bearer token in --listen-token-file (one line)."""
    try:
        with open(path, "rb") as f:
            token = f.read(4097).strip()
    except OSError as e:
        raise ConfigError("cannot read --listen-token-file %s: %s (the intake "
                          "runs as the spool's user, which must read it; "
                          "myq init makes SPOOL/%s)"
                          % (path, _os_text(e), INTAKE_TOKEN))
    if not token or len(token) > 4096 or b"\n" in token or b" " in token:
        raise ConfigError("--listen-token-file %s must hold one token: 1-4096 "
                          "characters, no blanks" % path)
    return token


def _equal_secret(a, b):
    """Compare without telling by the time taken where they differ."""
    try:
        from _operator import _compare_digest
        return _compare_digest(a, b)
    except ImportError:
        n = len(a) ^ len(b)
        for x, y in zip(a, b if len(a) == len(b) else a):
            n |= x ^ y
        return n == 0


class _HttpConn(object):
    """One client connection: what it sent, what is still to go out."""
    __slots__ = ("sock", "buf", "out", "deadline", "head", "need", "close",
                 "started", "continued")

    def __init__(self, sock, deadline):
        self.sock, self.deadline = sock, deadline
        self.started = _mono()
        self.buf, self.out = bytearray(), bytearray()
        self.head = None            # (method, path, headers) once read
        self.need = 0               # body bytes the head announced
        self.close = self.continued = False


class HttpIntake(object):
    """The local HTTP endpoint (myq(1) INTAKE): POST /jobs/TYPE, GET /health,
    GET /metrics, on non-blocking sockets served by `serve()` (one poll).
    `token`: the bearer token every request must carry (bytes), or None."""

    def __init__(self, spool, listen, token=None, max_bytes=1 << 20,
                 timeout=10.0, log=None, fd=None):
        import socket
        import select
        self.spool, self.token, self.log = spool, token, log or _noop_log
        self.max_bytes, self.timeout = max_bytes, float(timeout)
        # request bytes held at once, across connections (_HTTP_CONNS of
        # max_bytes each would be 64 M)
        self.buffer_max = max(_HTTP_BUFFERED, 2 * (max_bytes + _HTTP_HEAD_MAX))
        self.unix = None
        if listen.startswith("unix:"):
            self.unix = _unix_path(listen)
            sock = _unix_socket(self.unix, os.stat(spool.path).st_gid)
            self.address, self._ino = listen, os.lstat(self.unix).st_ino
        else:
            if not listen_address(listen)[2] and token is None:
                raise UsageError("--listen %s is not a loopback address: it "
                                 "needs a token (--listen-token-file, default "
                                 "SPOOL/%s), never --listen-open"
                                 % (listen, INTAKE_TOKEN))
            sock = _tcp_socket(listen) if fd is None else _held_socket(fd)
            self.address = "%s:%d" % sock.getsockname()[:2]
        sock.setblocking(False)
        self.sock = sock
        self._socket, self._select = socket, select
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self.conns = {}             # fd -> _HttpConn
        self.served = self.cut = 0  # requests answered; connections cut
        self._cache = {}            # path -> (until, answer): /health, /metrics

    def close(self):
        for fd in list(self.conns):
            self._drop(fd)
        self.sock.close()
        try:                # our socket's name, unless another took it
            if self.unix and os.lstat(self.unix).st_ino == self._ino:
                os.unlink(self.unix)
        except OSError:
            pass

    def serve(self, wait=1.0):
        """One round: wait up to `wait` seconds for sockets, then serve
        what is there (never blocking on any client)."""
        now = _mono()
        soonest = min([c.deadline for c in self.conns.values()] or [now + wait])
        try:
            ready = self.poller.poll(max(0, min(wait, soonest - now)) * 1000)
        except InterruptedError:
            ready = []
        for fd, ev in ready:
            if fd == self.sock.fileno():
                self._accept()
                continue
            c = self.conns.get(fd)
            if c is None:
                continue
            try:
                if ev & self._select.POLLOUT and c.out:
                    self._flush(fd, c)
                    if fd in self.conns and not c.out:
                        self._advance(fd, c)
                if ev & (self._select.POLLIN | self._select.POLLHUP
                         | self._select.POLLERR) and fd in self.conns:
                    self._receive(fd, c)
            except OSError:
                self._drop(fd)
            except Exception as e:      # (a client's bytes met a bug: it
                self.log("error", during="intake", error="%s: %s" % (
                    type(e).__name__, e))
                self._drop(fd)          # goes, the endpoint serves on)
        now = _mono()
        for fd, c in list(self.conns.items()):
            if now >= c.deadline:
                self._expire(fd, c)

    def _accept(self):
        for _ in range(16):
            try:
                s, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:        # EMFILE and the like: later
                self.log("error", during="accept", error=_os_text(e))
                return
            if len(self.conns) >= _HTTP_CONNS:
                # the connection that has taken longest goes (a slowloris
                # opening many holds each for --listen-timeout at most)
                old = min(self.conns, key=lambda fd: self.conns[fd].started)
                self.cut += 1
                self._drop(old)
            s.setblocking(False)
            self.conns[s.fileno()] = _HttpConn(s, _mono() + self.timeout)
            self.poller.register(s.fileno(), self._select.POLLIN)

    def _drop(self, fd):
        c = self.conns.pop(fd, None)
        if c is not None:
            try:
                self.poller.unregister(fd)
            except (KeyError, ValueError):
                pass
            c.sock.close()

    def _expire(self, fd, c):
        """A request that took too long: 408 (best effort), closed."""
        if c.buf or c.head is not None:
            self.cut += 1
            try:
                c.sock.send(self._answer(408, {"error": "the request took "
                                               "longer than %gs" % self.timeout},
                                         close=True))
            except OSError:
                pass
        self._drop(fd)

    def _receive(self, fd, c):
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self._drop(fd)
            return
        c.buf += data
        if len(c.buf) > self.max_bytes + _HTTP_HEAD_MAX:
            self._drop(fd)          # more than a request, unasked
            return
        if sum(len(x.buf) for x in self.conns.values()) > self.buffer_max:
            # the bytes held for all clients at once are bounded: the
            # connection that holds most goes (503, try again)
            big = max(self.conns, key=lambda f: len(self.conns[f].buf))
            self.cut += 1
            try:
                self.conns[big].sock.send(self._answer(503, {
                    "error": "the intake holds too many bodies at once; try "
                    "again"}, close=True, retry_after=1))
            except OSError:
                pass
            self._drop(big)
            if big == fd:
                return
        if c.out:               # pipelined before our answer went: later
            return
        self._advance(fd, c)

    def _advance(self, fd, c):
        """Serve the requests that c.buf holds whole."""
        while fd in self.conns and not c.out and c.buf:
            if c.head is None:
                if not self._read_head(fd, c):
                    return
            if len(c.buf) < c.need:
                return
            body = bytes(c.buf[:c.need])
            del c.buf[:c.need]
            method, path, headers = c.head
            c.head, c.need, c.continued = None, 0, False
            try:
                answer = self._request(method, path, headers, body)
            except Exception as e:      # (a bug: said, and the loop goes on)
                self.log("error", during="intake request", error="%s: %s" % (
                    type(e).__name__, e))
                answer = (500, {"error": "myq failed on this request: %s"
                                % type(e).__name__}, {})
            self._reply(fd, c, *answer)

    def _read_head(self, fd, c):
        """Parse the head in c.buf; False while it is incomplete (or the
        connection was answered and closed)."""
        end = c.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(c.buf) > _HTTP_HEAD_MAX:
                self._reply(fd, c, 431, {"error": "the request head is larger "
                                         "than %d bytes" % _HTTP_HEAD_MAX},
                            close=True)
            return False
        if end > _HTTP_HEAD_MAX:
            self._reply(fd, c, 431, {"error": "the request head is larger than "
                                     "%d bytes" % _HTTP_HEAD_MAX}, close=True)
            return False
        head = bytes(c.buf[:end]).decode("latin-1")
        del c.buf[:end + 4]
        try:
            method, path, headers, close = self._parse_head(head)
        except _Refusal as e:
            self._reply(fd, c, e.status, {"error": str(e)}, close=True)
            return False
        c.close = close
        refusal = self._refuse_early(method, path, headers)
        if refusal is not None:
            self._reply(fd, c, refusal.status, {"error": str(refusal)},
                        close=True, retry_after=refusal.retry_after)
            return False
        c.head, c.need = (method, path, headers), int(headers.get(
            "content-length", "0"))
        if c.need and len(c.buf) < c.need and \
                headers.get("expect", "").lower() == "100-continue":
            try:
                c.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")   # (curl waits 1 s)
            except (BlockingIOError, InterruptedError):
                pass
        return True

    def _parse_head(self, head):
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            if len(parts) == 3 and parts[2].startswith("HTTP/"):
                raise _Refusal(505, "only HTTP/1.x is spoken here")
            raise _Refusal(400, "not an HTTP/1.x request line")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            name = name.strip().lower()
            if not sep or not name or " " in name:
                raise _Refusal(400, "a header line is not 'Name: value'")
            value = value.strip()
            if name in headers and name in ("content-length", "authorization",
                                            "idempotency-key", "content-type"):
                if headers[name] != value:
                    raise _Refusal(400, "header %s given twice" % name)
            headers[name] = value
        conn = headers.get("connection", "").lower()
        close = conn == "close" or (parts[2] == "HTTP/1.0" and conn != "keep-alive")
        return parts[0], parts[1], headers, close

    def _refuse_early(self, method, path, headers):
        """What is refused on the head alone, before any body is read:
        the token, chunked bodies, bad or too large lengths."""
        if self.token is not None:
            auth = headers.get("authorization", "")
            scheme, _, given = auth.partition(" ")
            if scheme.lower() != "bearer" or not _equal_secret(
                    given.strip().encode("latin-1"), self.token):
                return _Refusal(401, "this endpoint needs 'Authorization: "
                                "Bearer TOKEN' (the token of "
                                "--listen-token-file)")
        if "transfer-encoding" in headers:
            return _Refusal(411, "send the body with a Content-Length, not "
                            "chunked")
        length = headers.get("content-length", "0")
        if not (length.isascii() and length.isdigit()) or len(length) > 18:
            return _Refusal(400, "Content-Length %r is not a byte count" % length[:40])
        if int(length) > self.max_bytes:
            return _Refusal(413, "the body is %s bytes, more than "
                            "--listen-max-bytes (%d)" % (length, self.max_bytes))
        if method == "POST" and "content-length" not in headers:
            return _Refusal(411, "a POST needs a Content-Length")
        return None

    def _request(self, method, path, headers, body):
        """(status, answer object or text, {"retry_after": S}) of one
        whole request."""
        path = path.split("?", 1)[0]
        if path.startswith("/jobs/"):
            if method != "POST":
                return 405, {"error": "POST a job to /jobs/TYPE"}, {"allow": "POST"}
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            known = []
            try:
                items = http_jobs(path[6:], body, ctype in _NDJSON,
                                  headers.get("idempotency-key"))
                ids = take_in(self.spool, items, known=known)
            except _Refusal as e:
                return e.status, {"error": str(e)}, {"retry_after": e.retry_after}
            except DuplicateJob as e:
                self.log("duplicate", via="http", type=path[6:],
                         kept="refused (409)", error=str(e))
                return 409, {"error": str(e)}, {}
            for jid in known:
                self.log("duplicate", via="http", id=jid, type=path[6:],
                         kept="the same job, already taken")
            self.log("intake", via="http", type=path[6:], jobs=len(ids))
            return 202, {"ids": ids}, {}
        if path in ("/health", "/metrics"):
            if method != "GET":
                return 405, {"error": "GET %s" % path}, {"allow": "GET"}
            return self._report(path)
        return 404, {"error": "no %s here: POST /jobs/TYPE, GET /health, GET "
                     "/metrics" % path[:200]}, {}

    def _report(self, path):
        """/health (check --json; 503 only when the intake cannot take jobs:
        a guard, the budget, a damaged or unwritable store; what only needs
        an operator, dead jobs say, answers 200) or /metrics (the
        Prometheus text of stats), each worked out at most once a second."""
        until, answer = self._cache.get(path, (0, None))
        if _mono() < until:
            return answer
        try:
            if path == "/health":
                problems = self.spool.check()
                blocking = self.spool.free_problem() or any(
                    any(w in p for w in _HEALTH_BLOCKING) for p in problems)
                answer = (503 if blocking else 200, {
                    "ok": not problems, "spool": self.spool.path,
                    "problems": problems}, {})
            else:
                answer = (200, prometheus_text(self.spool.stats(by_type=True)),
                          {"type": "text/plain; version=0.0.4; charset=utf-8"})
        except (MyqError, OSError) as e:
            answer = (503, {"ok": False, "spool": self.spool.path,
                            "problems": [str(e)]}, {})
        self._cache[path] = (_mono() + 1.0, answer)
        return answer

    def _answer(self, status, obj, close=False, retry_after=None, extra=None):
        extra = extra or {}
        if isinstance(obj, str):
            body = obj.encode("utf-8")
        else:
            body = (json.dumps(obj, sort_keys=True) + "\n").encode("utf-8")
        head = ["HTTP/1.1 %d %s" % (status, _HTTP_REASONS.get(status, "")),
                "Content-Type: %s" % extra.get("type", "application/json"),
                "Content-Length: %d" % len(body), "Cache-Control: no-store"]
        if retry_after:
            head.append("Retry-After: %d" % retry_after)
        if status == 401:
            head.append('WWW-Authenticate: Bearer realm="myq"')
        if extra.get("allow"):
            head.append("Allow: " + extra["allow"])
        head.append("Connection: close" if close else "Connection: keep-alive")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body

    def _reply(self, fd, c, status, obj, extra=None, close=False,
               retry_after=None):
        extra = extra or {}
        close = close or c.close or status in (408, 411, 413, 431)
        c.out += self._answer(status, obj, close, retry_after or
                              extra.get("retry_after"), extra)
        c.close = close
        self.served += 1
        if close:
            c.buf = bytearray()
        self._flush(fd, c)

    def _flush(self, fd, c):
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            n = 0
        del c.out[:n]
        if c.out:
            self.poller.modify(fd, self._select.POLLOUT)
            return
        if c.close:
            self._drop(fd)
            return
        self.poller.modify(fd, self._select.POLLIN)
        c.deadline = _mono() + self.timeout     # the next request's time
        c.started = _mono()


# Intake: MQTT ################################################################
#
# The subscriptions of `myq intake --mqtt` (MqttIntake), and run_intake,
# which runs both kinds of intake in one process.


def parse_subscriptions(specs):
    """[(filter, type)] of --subscribe 'FILTER=TYPE' (the last '=' splits:
    a filter may hold one)."""
    out = []
    for spec in specs or ():
        flt, eq, type = spec.rpartition("=")
        if not eq or not flt:
            raise UsageError("--subscribe %r is not FILTER=TYPE (e.g. "
                             "'sensors/+/reading=reading')" % spec)
        if not NAME_RE.match(type):
            raise UsageError("--subscribe %r: %r is not a job type (1-128 of "
                             "A-Z a-z 0-9 . _ -)" % (spec, type))
        levels = flt.split("/")
        if any(("#" in x and (x != "#" or i != len(levels) - 1)) or
               ("+" in x and x != "+") for i, x in enumerate(levels)) \
                or "\0" in flt or len(flt.encode("utf-8", "replace")) > 65535:
            raise UsageError("--subscribe %r: %r is not an MQTT topic filter "
                             "(+ stands for a whole level, # for the last ones)"
                             % (spec, flt))
        out.append((flt, type))
    return out


def topic_matches(flt, topic):
    """Does MQTT topic filter `flt` match `topic` (+ one level, # the rest;
    no wildcard first matches a topic starting with $)?"""
    f, t = flt.split("/"), topic.split("/")
    if topic.startswith("$") and f[0] in ("+", "#"):
        return False
    for i, x in enumerate(f):
        if x == "#":
            return True
        if i >= len(t) or (x != "+" and x != t[i]):
            return False
    return len(f) == len(t)


def intake_client_id(spool_path):
    """The default --mqtt-client-id of intake: stable across restarts (its
    session is the broker's queue of what it has not acknowledged), from
    the host and the spool, at most 23 characters."""
    import binascii
    host = os.uname()[1]
    tail = "-%08x" % (binascii.crc32(("%s\0%s" % (host, os.path.abspath(
        spool_path))).encode("utf-8", "replace")) & 0xffffffff)
    return ("myqi-" + re.sub(r"[^A-Za-z0-9]", "", host))[:23 - len(tail)] + tail


def mqtt_job(topic, data, type, now=None):
    """(id, type, payload) of a received message: payload {"topic",
    "message": JSON, else the text; a message that is not UTF-8:
    "message_base64"}; the id is the message's own `id` when it is an
    object with a valid one."""
    jid = None
    try:
        text = data.decode("utf-8")
    except UnicodeError:
        import binascii
        return _intake_id(now), type, {
            "topic": topic,
            "message_base64": binascii.b2a_base64(data).decode().strip()}
    try:
        msg = _DECODER.decode(text)
        if isinstance(msg, dict) and isinstance(msg.get("id"), str) \
                and NAME_RE.match(msg["id"]):
            jid = msg["id"]
    except (ValueError, RecursionError):
        msg = text
    return jid or _intake_id(now), type, {
        "topic": topic, "message": msg}


def session_subs(subs, client_id):
    """[(client id, [(filter, type)])]: one MQTT session a type, so that a
    type held at its bound (its PUBACKs withheld, the broker's window of
    unacknowledged messages full) holds no other type's messages; one
    type keeps `client_id` itself, several get CLIENT_ID.TYPE (a CRC of the
    type when long)."""
    import binascii
    types = []
    for _, t in subs:
        if t not in types:
            types.append(t)
    out = []
    for t in types:
        cid = client_id
        if len(types) > 1:
            cid = "%s.%s" % (client_id, t if len(t) <= 40 else "%08x" % (
                binascii.crc32(t.encode("utf-8")) & 0xffffffff))
        out.append((cid, [x for x in subs if x[1] == t]))
    return out


def _packet_head(buf):
    """(first byte, body length, head length) of the MQTT packet at the
    start of `buf`, or None while its head is incomplete."""
    n = shift = 0
    for i in range(1, min(len(buf), 5)):
        b = buf[i]
        n |= (b & 127) << shift
        shift += 7
        if not b & 128:
            return buf[0], n, i + 1
    if len(buf) >= 5:
        raise _MqttBroken("the broker sent a bad packet length (protocol error)")
    return None


class MqttIntake(MqttClient):
    """MQTT subscriptions of one type taken in as jobs (myq(1) INTAKE): a
    persistent session (clean session off, a stable client id), QoS 1,
    each PUBACK sent once its job is durable, in the order the messages
    came; withheld while a bound or a guard refuses (the message waits in
    memory, the broker keeps it until the PUBACK: a crash loses nothing,
    the broker sends it again).  `subs`: this session's filters; `every`:
    all of them (the first filter that matches a topic decides its type,
    across sessions).  `run(stopping)` connects, subscribes and takes in
    until `stopping()`, reconnecting with a backoff after any error."""

    def __init__(self, spool, subs, url, password=None, client_id=None,
                 ca=None, cert=None, key=None, keepalive=60, timeout=10.0,
                 log=None, every=None):
        MqttClient.__init__(self, url, password, client_id or
                            intake_client_id(spool.path), ca, cert, key,
                            keepalive, timeout)
        self.clean = False
        self.spool, self.subs, self.log = spool, subs, log or _noop_log
        self.every = every or subs
        # a message is at most a job: its topic and envelope fit in 64K more
        self.max_packet = spool.opt["max_job_bytes"] + 65536
        # (packet id or None, (id, type, payload) or None: refused at
        # arrival, acknowledged in its turn, size)
        self.pending = []
        self._pending_bytes = 0
        self.taken = self.acked = self.refused = 0
        self._retry_at = 0.0
        self._refusals = 0
        self._counted = None        # the id last counted refused
        self._skip = 0              # bytes of an oversized message still to come
        self._big = None            # its (packet id, topic, size)

    def _keep_alive(self):
        """(The session loop pings; no thread of MqttClient's.)"""

    def run(self, stopping):
        backoff = 1.0
        while not stopping():
            try:
                with self.lock:
                    self._connect(_mono() + self.timeout)
                self.log("intake_connected", broker=self.dest,
                         client_id=self.client_id)
                backoff = 1.0
                self._serve(stopping)
                self._send(b"\xe0\x00", _mono() + 1.0)       # DISCONNECT
            except Exception as e:      # (a hostile broker: never a crash)
                self.log("error", during="intake from %s" % self.dest,
                         error=str(e) if isinstance(e, (DestinationDown,
                                                        _MqttBroken))
                         else _os_text(e) if isinstance(e, OSError)
                         else "%s: %s" % (type(e).__name__, e),
                         retry_in=round(backoff, 1))
            finally:
                self._drop()
                # unacknowledged: the broker sends them again
                self.pending, self._pending_bytes = [], 0
                self._skip, self._big = 0, None
            end = _mono() + backoff * (0.75 + 0.5 * _uniform())
            while not stopping() and _mono() < end:
                time.sleep(min(0.1, max(0.0, end - _mono())))
            backoff = min(60.0, backoff * 2)

    def _subscribe_packet(self):
        body = b"\x00\x01"
        for flt, _ in self.subs:
            body += _mqtt_str(flt.encode("utf-8")) + b"\x01"
        return b"\x82" + _mqtt_len(len(body)) + body

    def _serve(self, stopping):
        """One connection's life: SUBSCRIBE, then messages in, PUBACKs
        out, PINGREQ when idle; returns when `stopping()`, raises when the
        connection fails or the broker breaks the protocol."""
        import select
        sock = self.sock
        self._send(self._subscribe_packet(), _mono() + self.timeout)
        ping_sent = None
        self._parse_buffered()          # what came with the CONNACK
        while not stopping():
            now = _mono()
            if self.pending and now >= self._retry_at:
                self._take_pending()
            if ping_sent is not None and now - ping_sent > self.timeout:
                raise _MqttBroken("no PINGRESP from the broker in time")
            if ping_sent is None and self.keepalive and \
                    now - self._last_sent >= self.keepalive / 2.0:
                self._send(b"\xc0\x00", now + self.timeout)
                ping_sent = now
            # full: read no more (TCP holds the broker back) until room
            full = len(self.pending) >= 1000 or self._pending_bytes > 4 << 20
            wait = 0.5 if not self.pending else max(
                0.0, min(0.5, self._retry_at - now))
            if not full and not (hasattr(sock, "pending") and sock.pending()):
                if not select.select([sock], [], [], wait)[0]:
                    continue
            elif full:
                time.sleep(wait)
                continue
            sock.settimeout(0)
            try:
                data = sock.recv(65536)
            except OSError as e:
                if isinstance(e, BlockingIOError) or \
                        type(e).__name__ == "SSLWantReadError":
                    continue
                raise
            if not data:
                raise _MqttBroken("the broker closed the connection")
            self._buf += data
            if self._parse_buffered():
                ping_sent = None

    def _parse_buffered(self):
        """Handle the whole packets in the buffer; True if one was a
        PINGRESP.  A PUBLISH larger than a job can be is read past, never
        buffered (_oversized)."""
        pong = False
        while True:
            if self._skip:
                n = min(self._skip, len(self._buf))
                del self._buf[:n]
                self._skip -= n
                if self._skip:
                    return pong
                self._refuse_big()
            head = _packet_head(self._buf)
            if head is None:
                return pong
            if head[1] > self.max_packet:
                if not self._oversized(*head):
                    return pong
                continue
            got = _mqtt_parse(self._buf, self.max_packet)
            if got is None:
                return pong
            del self._buf[:got[2]]
            pong = self._packet(got[0], got[1]) or pong

    def _oversized(self, kind, size, at):
        """A packet of `size` bytes, over max_packet: a PUBLISH whose head
        (topic, packet id) is in the buffer is taken off it, and the rest
        of its bytes are read past (_skip); True then, False while its head
        is incomplete.  Any other packet that large breaks the protocol."""
        if kind >> 4 != 3:
            raise _MqttBroken("the broker sent a %d-byte packet of type %d "
                              "(protocol error)" % (size, kind >> 4))
        qos = (kind >> 1) & 3
        if len(self._buf) < at + 2:
            return False
        end = at + 2 + int.from_bytes(self._buf[at:at + 2], "big") + (
            2 if qos else 0)
        if len(self._buf) < end:
            return False
        topic = bytes(self._buf[at + 2:end - (2 if qos else 0)]).decode(
            "utf-8", "replace")
        pid = int.from_bytes(self._buf[end - 2:end], "big") if qos else None
        del self._buf[:end]
        self._skip, self._big = size - (end - at), (pid or None, topic, size)
        if not self._skip:
            self._refuse_big()
        return True

    def _refuse_big(self):
        """An oversized message, read past: refused (counted, logged) and
        acknowledged in its turn: it can never be a job, and a message not
        acknowledged would come again at every connect."""
        pid, topic, size = self._big
        self._big = None
        type = next((ty for flt, ty in self.every if topic_matches(flt, topic)),
                    None)
        if type is None or any(ty == type for _, ty in self.subs):
            self._said_big(topic, size, type)
        self.pending.append((pid, None, 0))
        if len(self.pending) == 1:
            self._ack(self.pending[:1])

    def _said_big(self, topic, size, type):
        """An oversized message of this session's: counted and logged."""
        self.refused += 1
        if type is not None:
            self.spool.count("refused", type)
        self.log("intake_refused", via="mqtt", broker=self.dest,
                 topic=topic[:200], bytes=size, type=type,
                 why="larger than a job may be (--max-job-bytes %d)"
                 % self.spool.opt["max_job_bytes"])

    def _packet(self, kind, body):
        """Handle one packet from the broker; True for a PINGRESP."""
        t = kind >> 4
        if t == 3:
            self._publish_in(kind, body)
        elif t == 9:                                        # SUBACK
            if len(body) != 2 + len(self.subs):
                raise _MqttBroken("the broker's SUBACK has %d return codes for "
                                  "%d filters (protocol error)"
                                  % (max(0, len(body) - 2), len(self.subs)))
            for (flt, type), code in zip(self.subs, bytearray(body[2:])):
                if code == 0x80:
                    self.log("error", during="subscribe", broker=self.dest,
                             filter=flt, error="the broker refused the "
                             "subscription; check its access rules (ACL)")
        elif t == 13:                                       # PINGRESP
            return True
        else:
            raise _MqttBroken("the broker sent packet type %d, which a "
                              "subscriber never gets (protocol error)" % t)
        return False

    def _publish_in(self, kind, body):
        qos = (kind >> 1) & 3
        if qos == 3 or len(body) < 2:
            raise _MqttBroken("the broker sent a malformed PUBLISH (protocol "
                              "error)")
        n = int.from_bytes(body[:2], "big")
        end = 2 + n + (2 if qos else 0)
        if len(body) < end:
            raise _MqttBroken("the broker sent a PUBLISH shorter than its topic "
                              "(protocol error)")
        try:
            topic = body[2:2 + n].decode("utf-8")
        except UnicodeError:
            raise _MqttBroken("the broker sent a topic that is not UTF-8 "
                              "(protocol error)")
        pid = int.from_bytes(body[2 + n:end], "big") if qos else None
        if qos == 2:
            # we subscribe at QoS 1: a broker must not send more
            raise _MqttBroken("the broker sent a QoS 2 message on a QoS 1 "
                              "subscription (protocol error)")
        if pid == 0:
            raise _MqttBroken("the broker sent packet id 0 (protocol error)")
        type = next((ty for flt, ty in self.every if topic_matches(flt, topic)),
                    None)
        mine = any(ty == type for _, ty in self.subs)
        if not mine:
            if type is None:
                # a subscription this session kept from an earlier --subscribe
                self.log("intake_unmatched", broker=self.dest, topic=topic[:200])
            # (else: an earlier filter of another type's session decides)
            self.pending.append((pid, None, 0))
            if len(self.pending) == 1:
                self._ack(self.pending[:1])
            return
        self.pending.append((pid, mqtt_job(topic, body[end:], type), len(body)))
        self._pending_bytes += len(body)

    def _take_pending(self):
        """Enqueue what waits, in order, and acknowledge it: a batch at a
        time (one commit); when the spool refuses, one at a time up to the
        first refused, which waits (its PUBACK withheld) and is tried again
        after a backoff (0.5 s doubling to 5 s)."""
        while self.pending:
            if self.pending[0][1] is None:      # refused at arrival: its turn
                self._ack(self.pending[:1])
                continue
            n = next((k for k, it in enumerate(self.pending[:_INTAKE_BATCH])
                      if it[1] is None), min(_INTAKE_BATCH, len(self.pending)))
            try:
                self._take(self.pending[:n])
                self._refusals = 0
                continue
            except _Refusal as e:
                refusal = e
            if n > 1:
                # (one at a time: what is refused, and why, is the first's
                # alone; a bad message behind good ones drops itself only)
                refusal = None
                for _ in range(n):
                    try:
                        self._take(self.pending[:1])
                    except _Refusal as e:
                        refusal = e
                        break
                if refusal is None:
                    continue
            if refusal.status in (400, 413):        # can never be a job
                self.refused += 1
                self.spool.count("refused", self.pending[0][1][1])
                self.log("intake_refused", via="mqtt", broker=self.dest,
                         topic=self.pending[0][1][2]["topic"][:200],
                         bytes=self.pending[0][2], type=self.pending[0][1][1],
                         why="message dropped: %s" % refusal)
                self._ack(self.pending[:1])
                continue
            self._refusals += 1
            head = self.pending[0][1]
            if self._counted != head[0]:        # once a message, not a retry
                self._counted = head[0]
                self.spool.count("refused", head[1])
            delay = min(5.0, 0.5 * 2 ** min(self._refusals - 1, 4))
            self._retry_at = _mono() + delay
            if self._refusals == 1:
                self.log("intake_held", broker=self.dest, type=head[1],
                         waiting=len(self.pending), why=str(refusal),
                         retry_in=delay)
            return

    def _take(self, batch):
        known = []
        try:
            take_in(self.spool, [it[1] for it in batch], count=False,
                    known=known)
        except DuplicateJob as e:
            if len(batch) > 1:
                for it in batch:
                    self._take([it])
                return
            self._keep_duplicate(batch[0][1], str(e))
        for jid in known:
            self.log("duplicate", via="mqtt", id=jid, type=batch[0][1][1],
                     kept="the same job, already taken")
        self.taken += len(batch)
        self._ack(batch)

    def _keep_duplicate(self, item, why):
        """A message under an id that another job holds: its job goes to
        failed/ with the reason (myq(1) INTAKE), durably, before its
        PUBACK; never dropped, never run under a new id."""
        jid, type, payload = item
        data = json.dumps({"id": jid, "type": type, "payload": payload},
                          sort_keys=True).encode("utf-8") + b"\n"
        tmp = self.spool.d("tmp", "%s.%d.%s.dup" % (jid, os.getpid(),
                                                    _rand_hex(4)))
        _create(tmp, data)
        # (a name of its own: the job that holds the id keeps `show ID`)
        self.spool.claims.quarantine(tmp, "%s.dup-%s.json" % (
            jid, _rand_hex(3)), "duplicate: %s; the "
                                     "message kept here (give it another id "
                                     "and myq retry it, or delete it)" % why)
        _fsync_dir(self.spool.d("failed"))
        self.log("duplicate", via="mqtt", id=jid, type=type,
                 topic=payload.get("topic", "")[:200], kept="failed/")

    def _ack(self, batch):
        """PUBACK, in order, for what is now durable (or dropped)."""
        acks = b"".join(b"\x40\x02" + it[0].to_bytes(2, "big")
                        for it in batch if it[0] is not None)
        del self.pending[:len(batch)]
        self._pending_bytes -= sum(it[2] for it in batch)
        if acks:
            self._send(acks, _mono() + self.timeout)
            self.acked += len(acks) // 4


def run_intake(spool, log, listen=None, token=None, subs=(), mqtt=None,
               max_bytes=1 << 20, timeout=10.0, parent=None, listen_fd=None):
    """`myq intake`: the HTTP endpoint in this thread, the subscriptions
    (`mqtt`: MqttIntake's keyword arguments) in others, a session a type
    (session_subs), each with a Spool of its own, until SIGTERM/SIGINT (or
    the supervisor `parent` is gone); SIGHUP reopens the log.  Returns 0."""
    import signal
    import threading
    stop = []
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    signal.signal(signal.SIGINT, lambda s, f: stop.append(s))
    signal.signal(signal.SIGHUP, lambda s, f: stop.append("hup"))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGHUP,))  # (_child_run)
    http = HttpIntake(spool, listen, token, max_bytes, timeout, log,
                      listen_fd) if listen else None
    sessions, threads = [], []
    for cid, some in session_subs(subs, (mqtt or {}).get("client_id")):
        mq = MqttIntake(open_store(spool.path, log=log, **spool.opt), some,
                        log=log, every=subs, **dict(mqtt, client_id=cid))
        thread = threading.Thread(target=mq.run, name="myq-intake-mqtt",
                                  args=(lambda: any(s != "hup" for s in stop),))
        thread.daemon = True
        sessions.append(mq)
        threads.append(thread)
    log("intake_start", pid=os.getpid(), spool=spool.path,
        listen=http.address if http else None,
        subscribe=",".join(f for f, _ in subs) or None,
        broker=sessions[0].dest if sessions else None,
        sessions=len(sessions) or None)
    for thread in threads:
        thread.start()
    try:
        while not any(s != "hup" for s in stop):
            if "hup" in stop:
                stop.remove("hup")
                try:
                    log.reopen()
                except MyqError as e:
                    log("error", during="reopen log", error=str(e))
            if http is not None:
                http.serve(0.5)
            else:
                time.sleep(0.2)
            if parent and os.getppid() != parent:
                log("supervisor_gone", pid=parent)
                break
            if not stop and not all(t.is_alive() for t in threads):
                raise ConfigError("the MQTT intake stopped; see the log")
    finally:
        stop.append("stop")
        for thread, mq in zip(threads, sessions):
            thread.join(mq.timeout + 1)
            mq.close()
        if http is not None:
            http.close()
        log("intake_stop", pid=os.getpid(),
            served=http.served if http else None,
            taken=sum(mq.taken for mq in sessions) if sessions else None,
            refused=sum(mq.refused for mq in sessions) if sessions else None)
    return 0


# `myq intake` (myq(1) INTAKE); supervise takes them too, and starts an intake
# process beside its workers when --listen or --subscribe is given.
INTAKE_OPTIONS = [
    ("--listen", str, None, "take jobs over HTTP on unix:PATH (a socket, 0660, the spool's group) or [ADDR]:PORT (ADDR default 127.0.0.1): POST /jobs/TYPE"),
    ("--listen-token-file", str, None, "file of the bearer token every HTTP request must carry (default on a port: SPOOL/%s, made by init)" % INTAKE_TOKEN),
    ("--listen-open", None, False, "a loopback port without a token: every local account may post"),
    ("--listen-max-bytes", SIZE, 1 << 20, "largest HTTP request body"),
    ("--listen-timeout", SECONDS, 10.0, "time a client gets to send a whole request"),
    ("--subscribe", "append", [], "'FILTER=TYPE': MQTT messages on FILTER (from --mqtt) become jobs of TYPE"),
]
# the worker options that intake takes as well
_INTAKE_SHARED = ("--log", "--syslog", "--syslog-facility", "--syslog-tag",
                  "--mqtt", "--mqtt-password-file", "--mqtt-client-id",
                  "--mqtt-ca", "--mqtt-cert", "--mqtt-key")


def _args_intake(p):
    p.add_argument("--parent-pid", type=int, help=_SUPPRESS)
    # the port supervise took as root, before it dropped root (_hold_port)
    p.add_argument("--listen-fd", type=int, help=_SUPPRESS)


def _intake_argv(args, spool, o, guards, env):
    """The options of the intake process that supervise keeps running
    (myq(1) INTAKE), checked; None without --listen and --subscribe.  It gets
    the worker's log and --mqtt options (the URL in its environment, as
    the workers do) and the guards."""
    io = _resolve(args, INTAKE_OPTIONS, env)
    if not io["listen"] and not io["subscribe"]:
        if io["listen_token_file"] or io["listen_open"]:
            raise UsageError("--listen-token-file and --listen-open need "
                             "--listen")
        return None
    _intake_options(dict(o, **io), spool.path)
    shared = [t for t in WORKER_OPTIONS if t[0] in _INTAKE_SHARED]
    return _option_argv(io, INTAKE_OPTIONS) + _option_argv(
        o, shared, skip=_SECRET_OPTIONS) + _option_argv(guards, GUARD_OPTIONS)


def _intake_options(o, spool_path):
    """run_intake()'s keyword arguments of the intake options `o` (with
    the shared --mqtt ones), checked: UsageError, ConfigError."""
    if not o["listen"] and not o["subscribe"]:
        raise UsageError("intake needs --listen unix:PATH or [ADDR]:PORT, or "
                         "--subscribe "
                         "FILTER=TYPE (with --mqtt URL)")
    if (o["listen_token_file"] or o["listen_open"]) and not o["listen"]:
        raise UsageError("--listen-token-file and --listen-open need --listen")
    token = None
    if o["listen"] and o["listen"].startswith("unix:"):
        _unix_path(o["listen"])
        if o["listen_open"]:
            raise UsageError("--listen-open is for a port: on unix:PATH the "
                             "socket's mode and group decide who posts")
        if o["listen_token_file"]:
            token = _read_token(o["listen_token_file"])
    elif o["listen"]:
        loop = listen_address(o["listen"])[2]
        if o["listen_open"] and o["listen_token_file"]:
            raise UsageError("--listen-open and --listen-token-file: give one")
        if o["listen_open"] and not loop:
            raise UsageError("--listen-open on %s, not a loopback address: "
                             "every host that reaches it could post; leave "
                             "it out (the token of SPOOL/%s is then needed)"
                             % (o["listen"], INTAKE_TOKEN))
        if not o["listen_open"]:
            token = _read_token(o["listen_token_file"] or os.path.join(
                spool_path, INTAKE_TOKEN))
    subs = parse_subscriptions(o["subscribe"])
    mqtt = None
    if subs:
        if not o.get("mqtt"):
            raise UsageError("--subscribe needs --mqtt URL (the broker to "
                             "subscribe at)")
        mqtt = dict(url=(o["mqtt"].split() or [""])[0],  # (the first broker)
                    client_id=o.get("mqtt_client_id") or
                    intake_client_id(spool_path), ca=o.get("mqtt_ca"),
                    cert=o.get("mqtt_cert"), key=o.get("mqtt_key"))
        MqttClient(password=b"" if o.get("mqtt_password_file") else None,
                   **mqtt)          # (every check of the options)
        mqtt["password"] = _mqtt_password(o.get("mqtt_password_file"))
    return dict(listen=o["listen"], token=token, subs=subs, mqtt=mqtt,
                max_bytes=o["listen_max_bytes"], timeout=o["listen_timeout"])


def _cmd_intake(a):
    o = _resolve(a.args, [t for t in WORKER_OPTIONS if t[0] in _INTAKE_SHARED]
                 + INTAKE_OPTIONS, a.env)
    a.spool.require()
    kw = _intake_options(o, a.spool.path)
    _IMAGE["give_back_heap"](reexec=True)        # (it runs until stopped, as a worker)
    log = _make_log(o)
    a.spool.log = log
    return run_intake(a.spool, log, parent=a.args.parent_pid,
                      listen_fd=a.args.listen_fd, **kw)


_COMMAND_TABLE["intake"] = (
    _cmd_intake, _args_intake,
    "take jobs in over HTTP (--listen) and MQTT (--subscribe), each answered "
    "once durable")
# intake's options: its own and the worker's it shares; supervise takes its
# own too, to keep an intake running (_CHILDREN)
_COMMAND_OPTIONS["intake"] = [
    [t for t in WORKER_OPTIONS if t[0] in _INTAKE_SHARED], INTAKE_OPTIONS]
_COMMAND_OPTIONS.setdefault("supervise", []).append(INTAKE_OPTIONS)
_CHILDREN["intake"] = (_intake_argv, _hold_port)


# Install #####################################################################
#
# `python3 myq.py install`: the one file lays itself out as build/dist.py's
# `make install` does -- PREFIX/lib/myq/myq.py (this file, unchanged), its
# bytecode beside it, the launcher PREFIX/bin/myq that imports it, the init
# script and its settings -- so that "copy one file, run one command" ends
# in the layout whose `myq enqueue` starts from bytecode (a script is
# compiled at every start: 7x the instructions).  The one file has no
# init.d/ beside it: the init scripts travel inside it (_INIT_FILES), their
# settings files are made from _INIT_SETTINGS.

# The init scripts' settings: the one source of init.d/myq.default (SysV:
# /etc/default/myq), init.d/myq.config (OpenWrt: /etc/config/myq) and the
# settings list of myq(1)'s INIT SCRIPTS.  `make docs` writes those three
# from here (build/dist.py --docs), `myq install` writes a settings file
# from here, and tests/test_docs.py fails while one differs.  A row:
# (UCI option; SysV: MYQ_ and upper case, the script's default, an example
# or "", what it is).  In the text, `name` is another setting's name,
# [sysv: ...] and [procd: ...] are said for that init system alone.
_INIT_SETTINGS = [
    ("spool", "/var/spool/myq", "",
     "The spool directory (one spool = one queue), made at every start by "
     "\"myq init --owner\" `user`. On flash it survives a power cut; on a "
     "tmpfs (/tmp, and /var on OpenWrt and many devices) the queue is lost "
     "at reboot: put it on flash to keep it."),
    ("store", "", "",
     "Where a new spool keeps its jobs: files (one a job; empty means "
     "files) or sqlite (one database, SPOOL/queue.db; needs Python's "
     "sqlite3, python3-sqlite3 on OpenWrt). An existing spool keeps its "
     "own (man myq-spool: SQLITE STORE)."),
    ("python", "python3", "", "The interpreter, a name in PATH or a path."),
    ("bin", "/usr/bin/myq", "", "The myq program."),
    ("user", "root", "",
     "The user the workers run as, USER or USER:GROUP (GROUP: the spool's, "
     "the producers'); \"myq init --owner\" gives it the spool. "
     "[procd: procd starts \"myq supervise\" as root; it becomes this user "
     "itself.]"),
    ("args", "", "--handlers /etc/myq/handlers --concurrency 2 --grace 5",
     "Worker options, split on blanks (no quoting). This is the only way to "
     "give myq options: no MYQ_* variable (not even an exported one, such "
     "as MYQ_CONCURRENCY) reaches the workers."),
    ("workers", "1", "",
     "Worker processes kept running by \"myq supervise\". One worker with "
     "--concurrency N (in `args`) is the cheap way to run N exec or http "
     "jobs at once; more workers suit Python (--module) handlers."),
    ("listen", "", "",
     "Intake (man myq: INTAKE): jobs taken in over HTTP and MQTT by one "
     "more process beside the workers, each acknowledged once it is on the "
     "disk. HTTP: POST /jobs/TYPE on [ADDR]:PORT, e.g. 127.0.0.1:8440, with "
     "the token of SPOOL/intake.token (init makes it; --listen-open in "
     "`args`: none), or on unix:PATH (0660, the spool's group may post)."),
    ("listen_token_file", "", "",
     "The intake's token file instead of SPOOL/intake.token."),
    ("subscribe", "", "",
     "MQTT: FILTER=TYPE subscriptions, split on blanks, at the broker of "
     "--mqtt URL in `args`, e.g. \"sensors/+/temp=reading alarms/#=alarm\"."),
    ("pidfile", "/var/run/myq.pid", "",
     "[sysv: The pid of the supervising process (keep it on a tmpfs: no "
     "stale pidfile survives a reboot).]"),
    ("log", "syslog", "",
     "\"syslog\" (facility daemon, tag myq; read it with logread on "
     "BusyBox), or an absolute file path, created by \"myq supervise\" for "
     "`user` and reopened by \"/etc/init.d/myq reload\" (after logrotate "
     "has moved it aside). With a `user` other than root, give the log a "
     "directory of its own (created for the user when missing), e.g. "
     "/var/log/myq/myq.log, so that the user can create the new file."),
    ("stop_timeout", "10", "",
     "Seconds the workers get after SIGTERM before SIGKILL. Keep it above "
     "the worker's --grace, or running jobs are killed rather than put "
     "back. [procd: procd waits 10 s longer before it kills \"myq "
     "supervise\" itself.]"),
]

_INIT_SETTINGS_HEAD = {
    "sysv": "Settings for /etc/init.d/myq, installed as /etc/default/myq (read "
            "by sh). Every line is optional; the commented value is the "
            "default. Restart the service after a change: /etc/init.d/myq "
            "restart",
    "procd": "Settings of the myq service on OpenWrt (/etc/init.d/myq, run by "
             "procd), installed as /etc/config/myq. Every option is optional; "
             "the commented value is the default. Change them with uci, or "
             "here, then: uci set myq.main.workers='2'; uci commit myq; "
             "/etc/init.d/myq reload. reload restarts the workers when a "
             "setting changed (and reopens the log file in any case). The "
             "same settings as /etc/default/myq of the SysV script, lower "
             "case, without MYQ_ (no pidfile: procd keeps the pid).",
}


def _init_setting_text(text, system, name):
    """A setting's text for one init system ("sysv", "procd"): the other's
    [system: ...] parts left out, each `setting` as name(setting)."""
    out, rest = [], text
    while "[" in rest and "]" in rest:
        head, _, tail = rest.partition("[")
        inner, _, rest = tail.partition("]")
        which, colon, said = inner.partition(": ")
        if colon and which in _INIT_SETTINGS_HEAD:
            out.append(head + (said if which == system else ""))
        else:
            out.append(head + "[" + inner + "]")
    parts = " ".join(("".join(out) + rest).split()).split("`")
    return "".join(name(p) if i % 2 else p for i, p in enumerate(parts))


def _wrap(text, width, prefix):
    """text's words in lines of at most width columns (a longer word alone),
    each line starting with prefix."""
    lines = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(prefix + word)
    return lines


def _init_settings_file(system):
    """The settings file of init system `system` ("sysv": init.d/myq.default,
    "procd": init.d/myq.config) that _INIT_SETTINGS makes."""
    sysv = system == "sysv"
    out = _wrap(_INIT_SETTINGS_HEAD[system], 76, "# ")
    out += [] if sysv else ["", "config myq 'main'"]
    pre = "# " if sysv else "\t# "
    for key, default, example, text in _INIT_SETTINGS:
        text = _init_setting_text(text, system, lambda n: (
            "MYQ_" + n.upper()) if sysv else n)
        if not text:
            continue                    # (the other system's setting)
        out += [""] + _wrap(text, 76 if sysv else 72, pre)
        for v in ([example] if example else []) + [default]:
            out.append(("#MYQ_%s=%s" % (key.upper(), '"%s"' % v if " " in v
                                        else v)) if sysv
                       else "\t#option %s '%s'" % (key, v))
    return "\n".join(out) + "\n"


def _init_settings_roff():
    """myq(1)'s list of the settings (its INIT SCRIPTS; the SysV names)."""
    def roff(s):
        return s.replace("\\", "\\e").replace("-", "\\-")
    out = []
    for key, default, example, text in _INIT_SETTINGS:
        text = roff(_init_setting_text(text, "sysv", lambda n: (
            "\x01MYQ_" + n.upper() + "\x02")))
        if example:
            text += " For example \x01%s\x02." % roff(example)
        out += [".TP", "\\fBMYQ_%s\\fR (%s)" % (roff(key.upper()), (
            "\\fI%s\\fR" if default.startswith("/") else "\\fB%s\\fR" if default
            else "empty%s") % roff(default))]
        out += [("\\&" + l) if l[:1] in ".'" else l for l in _wrap(
            text.replace("\x01", "\\fB").replace("\x02", "\\fR"), 72, "")]
    return "\n".join(out) + "\n"


# The init scripts of init.d/, as they are there: `make embed` writes this
# block (build/dist.py --embed), tests/test_dist.py fails when they differ.
# _INIT_FILES begin
_INIT_FILES = {
    "myq": (
        "#!/bin/sh\n"
        "### BEGIN INIT INFO\n"
        "# Provides:          myq\n"
        "# Required-Start:    $local_fs $remote_fs $syslog\n"
        "# Required-Stop:     $local_fs $remote_fs $syslog\n"
        "# Should-Start:      $network $time\n"
        "# Should-Stop:       $network\n"
        "# Default-Start:     2 3 4 5\n"
        "# Default-Stop:      0 1 6\n"
        "# Short-Description: myq job queue workers\n"
        "# Description:       Keeps MYQ_WORKERS myq worker processes running on one\n"
        "#                    spool directory, under one \"myq supervise\" process.\n"
        "### END INIT INFO\n"
        "# init.d/myq start|stop|restart|force-reload|reload|status: a SysV init\n"
        "# script for BusyBox ash (Buildroot, OpenWrt, Alpine) and Debian.\n"
        "# Settings come from /etc/default/myq, or from the file named by MYQ_DEFAULTS;\n"
        "# a missing file means the defaults below. See init.d/myq.default.\n"
        "#\n"
        "# \"myq supervise --daemon\" does the work: it forks into a session of its\n"
        "# own, writes the pidfile, opens the log safely, becomes MYQ_USER, starts\n"
        "# the workers, and only then returns (or says why not); on SIGTERM it stops\n"
        "# them (SIGKILL after MYQ_STOP_TIMEOUT) and takes back what they held. This\n"
        "# script signals it by its pidfile and never touches a file the service\n"
        "# user could have replaced. \"boot\" and \"shutdown\" (OpenWrt) mean start, stop.\n"
        "\n"
        "fail() {\n"
        "\tprintf 'myq: %s\\n' \"$2\" >&2\n"
        "\texit \"$1\"\n"
        "}\n"
        "\n"
        "DEFAULTS=${MYQ_DEFAULTS:-/etc/default/myq}\n"
        "case $DEFAULTS in */*) ;; *) DEFAULTS=./$DEFAULTS ;; esac # \".\" would search PATH\n"
        "if [ -e \"$DEFAULTS\" ]; then\n"
        "\t[ -r \"$DEFAULTS\" ] || fail 6 \"cannot read $DEFAULTS\"\n"
        "\t# shellcheck source=/dev/null\n"
        "\t. \"$DEFAULTS\"\n"
        "fi\n"
        "\n"
        "SPOOL=${MYQ_SPOOL:-/var/spool/myq}\n"
        "PYTHON=${MYQ_PYTHON:-python3}\n"
        "BIN=${MYQ_BIN:-/usr/bin/myq}\n"
        "RUNAS=${MYQ_USER:-root} # USER or USER:GROUP (the spool's group, for producers)\n"
        "USERNAME=${RUNAS%%:*}\n"
        "ARGS=${MYQ_ARGS:-}\n"
        "WORKERS=${MYQ_WORKERS:-1}\n"
        "PIDFILE=${MYQ_PIDFILE:-/var/run/myq.pid}\n"
        "LOG=${MYQ_LOG:-syslog}\n"
        "STOP_TIMEOUT=${MYQ_STOP_TIMEOUT:-10}\n"
        "LISTEN=${MYQ_LISTEN:-}       # intake over HTTP: [ADDR]:PORT\n"
        "LISTEN_TOKEN_FILE=${MYQ_LISTEN_TOKEN_FILE:-}\n"
        "SUBSCRIBE=${MYQ_SUBSCRIBE:-} # intake over MQTT: FILTER=TYPE ..., split on blanks\n"
        "STORE=${MYQ_STORE:-}         # a new spool's store: files (default) or sqlite\n"
        "\n"
        "check_settings() {\n"
        "\tfor _v in \"MYQ_SPOOL=$SPOOL\" \"MYQ_BIN=$BIN\" \"MYQ_PIDFILE=$PIDFILE\"; do\n"
        "\t\tcase ${_v#*=} in /*) ;; *) fail 6 \"${_v%%=*} must be an absolute path, not '${_v#*=}'\" ;; esac\n"
        "\tdone\n"
        "\tcase $LOG in syslog | /*) ;; *) fail 6 \"MYQ_LOG must be 'syslog' or an absolute path, not '$LOG'\" ;; esac\n"
        "\tcase $WORKERS in '' | *[!0-9]* | 0*) fail 6 \"MYQ_WORKERS must be a number >= 1, not '$WORKERS'\" ;; esac\n"
        "\tcase $STOP_TIMEOUT in '' | *[!0-9]*) fail 6 \"MYQ_STOP_TIMEOUT must be whole seconds, not '$STOP_TIMEOUT'\" ;; esac\n"
        "\tSTOP_TIMEOUT=${STOP_TIMEOUT#\"${STOP_TIMEOUT%%[!0]*}\"}\n"
        "\tSTOP_TIMEOUT=${STOP_TIMEOUT:-0}\n"
        "}\n"
        "\n"
        "# myq ARGS: the one place that runs myq, with a clean environment: no MYQ_*\n"
        "# variable of the caller's (myq would read it as an option) and nothing else\n"
        "# of root's but PATH, LANG, TZ and PYTHONPATH.\n"
        "myq() {\n"
        "\tenv -i PATH=\"${PATH:-/usr/sbin:/usr/bin:/sbin:/bin}\" ${LANG:+LANG=\"$LANG\"} \\\n"
        "\t\t${TZ:+TZ=\"$TZ\"} ${PYTHONPATH:+PYTHONPATH=\"$PYTHONPATH\"} \"$PY\" \"$BIN\" --spool \"$SPOOL\" \"$@\"\n"
        "}\n"
        "\n"
        "# is_supervisor PID: PID runs \"myq --spool DIR supervise\" as root or\n"
        "# MYQ_USER (every uid of it: a command line is anyone's to choose, a uid\n"
        "# is not). Any DIR, any program path: after an edit of the settings, stop\n"
        "# must still find the supervisor that the old ones started.\n"
        "is_supervisor() {\n"
        "\t_cmd=$(tr '\\0' ' ' 2>/dev/null <\"/proc/$1/cmdline\") || return 1\n"
        "\tcase \" $_cmd\" in\n"
        "\t*\" --stop \"*) return 1 ;;\n"
        "\t*\" --spool \"*\" supervise \"*) ;;\n"
        "\t*) return 1 ;;\n"
        "\tesac\n"
        "\t_uid=$(id -u \"$USERNAME\" 2>/dev/null) || _uid=0\n"
        "\t_me=$(id -u)\n"
        "\twhile read -r _k _r _e _s _f; do\n"
        "\t\t[ \"$_k\" = Uid: ] || continue\n"
        "\t\tfor _u in \"$_r\" \"$_e\" \"$_s\" \"$_f\"; do\n"
        "\t\t\t[ \"$_u\" = 0 ] || [ \"$_u\" = \"$_uid\" ] || [ \"$_u\" = \"$_me\" ] || return 1\n"
        "\t\tdone\n"
        "\t\treturn 0\n"
        "\tdone 2>/dev/null <\"/proc/$1/status\"\n"
        "\treturn 1\n"
        "}\n"
        "\n"
        "# check: 0 running (PID set), 1 a pidfile but no supervisor, 3 no pidfile.\n"
        "check() {\n"
        "\tPID=\n"
        "\t[ -e \"$PIDFILE\" ] || return 3\n"
        "\tPID=$(cat \"$PIDFILE\" 2>/dev/null)\n"
        "\tPID=${PID%%[!0-9]*}\n"
        "\tcase $PID in '' | 0* | 1) PID= ;; esac\n"
        "\t[ -n \"$PID\" ] && is_supervisor \"$PID\"\n"
        "}\n"
        "\n"
        "# resolve: set PY (the interpreter's path); else set WHY, return 5 or 4\n"
        "resolve() {\n"
        "\tWHY=\"MYQ_PYTHON: no '$PYTHON' in PATH\"\n"
        "\tPY=$(command -v \"$PYTHON\") || return 5\n"
        "\tWHY=\"only root can run myq as MYQ_USER=$RUNAS\"\n"
        "\t[ \"$(id -u)\" = 0 ] || [ \"$USERNAME\" = \"$(id -un)\" ] || [ \"$USERNAME\" = \"$(id -u)\" ] || return 4\n"
        "}\n"
        "\n"
        "# stop_supervisor: \"myq supervise --stop\" SIGTERMs the supervisor of the\n"
        "# pidfile (it stops its workers and takes back their jobs), waits for its\n"
        "# process group (SIGKILL after MYQ_STOP_TIMEOUT + 5 s), then reaps: claims\n"
        "# of killed workers go back, their handlers are ended.\n"
        "stop_supervisor() {\n"
        "\tresolve || return 0\n"
        "\tmyq supervise --stop --pidfile \"$PIDFILE\" --stop-timeout \"$STOP_TIMEOUT\"\n"
        "}\n"
        "\n"
        "# failed CODE MESSAGE: end a start that did not happen\n"
        "failed() { echo \"FAIL\"; printf 'myq: %s\\n' \"$2\" >&2; return \"$1\"; }\n"
        "\n"
        "start() {\n"
        "\tprintf 'Starting myq: '\n"
        "\tcheck\n"
        "\tcase $? in\n"
        "\t0) echo \"already running (pid $PID)\"; return 0 ;;\n"
        "\t1) stop_supervisor; rm -f \"$PIDFILE\" ;; # what a dead supervisor left\n"
        "\tesac\n"
        "\tresolve || { failed $? \"$WHY\"; return; }\n"
        "\t[ -r \"$BIN\" ] || { failed 5 \"MYQ_BIN: cannot read $BIN\"; return; }\n"
        "\tid \"$USERNAME\" >/dev/null 2>&1 || { failed 6 \"MYQ_USER: no user '$USERNAME'\"; return; }\n"
        "\tcd / || return 1\n"
        "\tmkdir -p \"${PIDFILE%/*}/\"\n"
        "\tset -f\n"
        "\t# shellcheck disable=SC2086 # MYQ_ARGS is a list of options, split on blanks\n"
        "\tset -- supervise --workers \"$WORKERS\" --daemon --pidfile \"$PIDFILE\" \\\n"
        "\t\t--stop-timeout \"$STOP_TIMEOUT\" $ARGS\n"
        "\t# the intake process, beside the workers (its --mqtt broker: in MYQ_ARGS)\n"
        "\t[ -z \"$LISTEN\" ] || set -- \"$@\" --listen \"$LISTEN\"\n"
        "\t[ -z \"$LISTEN_TOKEN_FILE\" ] || set -- \"$@\" --listen-token-file \"$LISTEN_TOKEN_FILE\"\n"
        "\tfor _s in $SUBSCRIBE; do set -- \"$@\" --subscribe \"$_s\"; done\n"
        "\tset +f\n"
        "\t[ \"$(id -u)\" != 0 ] || [ \"$USERNAME\" = root ] || [ \"$USERNAME\" = 0 ] || set -- \"$@\" --user \"$RUNAS\"\n"
        "\tif [ \"$LOG\" = syslog ]; then set -- \"$@\" --syslog; else set -- \"$@\" --log \"$LOG\"; fi\n"
        "\t# the spool (idempotent, the workers' user's), then the supervisor: it returns\n"
        "\t# once its pidfile is written and its first worker started, or says why not\n"
        "\t_why=$(myq init --owner \"$RUNAS\" ${STORE:+--store \"$STORE\"} 2>&1 >/dev/null && myq \"$@\" 2>&1 >/dev/null) ||\n"
        "\t\t{ failed 1 \"${_why#myq: }\"; return; }\n"
        "\techo \"OK\"\n"
        "\t# what it warned of (logs that go nowhere: no syslogd) goes to the terminal\n"
        "\t[ -z \"$_why\" ] || printf '%s\\n' \"$_why\" >&2\n"
        "}\n"
        "\n"
        "stop() {\n"
        "\tprintf 'Stopping myq: '\n"
        "\tcheck\n"
        "\t[ $? != 3 ] || { echo \"not running\"; return 0; }\n"
        "\tstop_supervisor || { echo \"FAIL\"; return 1; }\n"
        "\trm -f \"$PIDFILE\"\n"
        "\techo \"OK\"\n"
        "}\n"
        "\n"
        "status() {\n"
        "\tcheck\n"
        "\tcase $? in\n"
        "\t0)\n"
        "\t\techo \"myq is running (pid $PID)\"\n"
        "\t\t# without --handlers or --module only http jobs can run (the log says so too)\n"
        "\t\tcase \" $ARGS \" in\n"
        "\t\t*\" --handlers \"* | *\" --handlers=\"* | *\" --module \"* | *\" --module=\"*) ;;\n"
        "\t\t*) printf 'myq: warning: MYQ_ARGS has no --handlers or --module: only http jobs can run\\n' >&2 ;;\n"
        "\t\tesac\n"
        "\t\treturn 0\n"
        "\t\t;;\n"
        "\t1) echo \"myq is not running, but $PIDFILE exists\"; return 1 ;;\n"
        "\tesac\n"
        "\techo \"myq is not running\"\n"
        "\treturn 3\n"
        "}\n"
        "\n"
        "reload() {\n"
        "\tprintf 'Reloading myq: '\n"
        "\tcheck || { echo \"not running\"; return 7; }\n"
        "\t# the supervisor passes SIGHUP on: every process reopens the log file\n"
        "\tkill -s HUP \"$PID\" || { echo \"FAIL\"; return 1; }\n"
        "\techo \"OK\"\n"
        "}\n"
        "\n"
        "case $1 in\n"
        "start | boot) check_settings && start ;;\n"
        "stop | shutdown) check_settings && stop ;;\n"
        "restart | force-reload) check_settings && stop && start ;;\n"
        "reload) check_settings && reload ;;\n"
        "status) status ;;\n"
        "*) echo \"Usage: $0 {start|stop|restart|force-reload|reload|status}\" >&2; exit 2 ;;\n"
        "esac\n"
    ),
    "myq.procd": (
        "#!/bin/sh /etc/rc.common\n"
        "# OpenWrt (procd) init script for myq, installed as /etc/init.d/myq by the\n"
        "# .ipk package. Settings: UCI, /etc/config/myq (see init.d/myq.config):\n"
        "#   uci set myq.main.workers=2; uci commit myq; /etc/init.d/myq reload\n"
        "#   /etc/init.d/myq enable; /etc/init.d/myq start\n"
        "#\n"
        "# procd keeps \"myq supervise\" running as root; supervise does the rest: it\n"
        "# opens the log file safely, becomes the service user, keeps the workers\n"
        "# running, and on SIGTERM stops them (SIGKILL after stop_timeout) and takes\n"
        "# back what they held. This script never touches the log file nor its\n"
        "# directory: the service user could have put a symlink there.\n"
        "#\n"
        "# reload: SIGHUP (the log file is reopened, e.g. after logrotate), then the\n"
        "# settings again: an instance whose command line changed is restarted by\n"
        "# procd (no reload_signal: with one, procd would only send that signal to a\n"
        "# changed instance, and new settings would never take effect). A commit of\n"
        "# /etc/config/myq runs reload (service_triggers).\n"
        "# stop: after procd has stopped the instance, service_stopped waits for the\n"
        "# supervisor and its workers to be gone and runs \"myq reap\": the jobs and\n"
        "# handlers of workers that were killed are taken back.\n"
        "# shellcheck shell=sh disable=SC2034 # START, STOP, USE_PROCD: for rc.common\n"
        "\n"
        "START=95\n"
        "STOP=10\n"
        "USE_PROCD=1\n"
        "\n"
        "# myq_settings: the settings from UCI (config myq 'main'); false, with a\n"
        "# message, when one is wrong. Never exported: myq would read a MYQ_* one.\n"
        "myq_settings() {\n"
        "\tspool='' python='' bin='' user='' args='' workers='' log='' stop_timeout=''\n"
        "\tlisten='' listen_token_file='' subscribe='' store=''\n"
        "\tconfig_load myq\n"
        "\tconfig_get spool main spool /var/spool/myq\n"
        "\tconfig_get python main python python3\n"
        "\tconfig_get bin main bin /usr/bin/myq\n"
        "\tconfig_get user main user root\n"
        "\tconfig_get args main args ''\n"
        "\tconfig_get workers main workers 1\n"
        "\tconfig_get log main log syslog\n"
        "\tconfig_get stop_timeout main stop_timeout 10\n"
        "\tconfig_get listen main listen ''\n"
        "\tconfig_get listen_token_file main listen_token_file ''\n"
        "\tconfig_get subscribe main subscribe ''\n"
        "\tconfig_get store main store ''\n"
        "\tfor _v in \"spool=$spool\" \"bin=$bin\"; do\n"
        "\t\tcase ${_v#*=} in\n"
        "\t\t/*) ;;\n"
        "\t\t*) myq_fail \"${_v%%=*} must be an absolute path, not '${_v#*=}'\" || return ;;\n"
        "\t\tesac\n"
        "\tdone\n"
        "\twhile [ \"$spool\" != / ] && [ \"${spool%/}\" != \"$spool\" ]; do\n"
        "\t\tspool=${spool%/} # as myq names it in the workers' command lines\n"
        "\tdone\n"
        "\tcase $log in\n"
        "\tsyslog | /*) ;;\n"
        "\t*) myq_fail \"log must be 'syslog' or an absolute path, not '$log'\" || return ;;\n"
        "\tesac\n"
        "\tcase $workers in\n"
        "\t'' | *[!0-9]* | 0*) myq_fail \"workers must be a number >= 1, not '$workers'\" || return ;;\n"
        "\tesac\n"
        "\tcase $stop_timeout in\n"
        "\t'' | *[!0-9]*) myq_fail \"stop_timeout must be whole seconds, not '$stop_timeout'\" || return ;;\n"
        "\tesac\n"
        "\tstop_timeout=${stop_timeout#\"${stop_timeout%%[!0]*}\"}\n"
        "\tstop_timeout=${stop_timeout:-0}\n"
        "\t# procd's SIGKILL comes after supervise has had stop_timeout for its\n"
        "\t# workers and time for its \"myq reap\" (a Python start on a slow CPU)\n"
        "\tterm_timeout=$((stop_timeout + 10))\n"
        "\tpy=$(command -v \"$python\") || myq_fail \"python: no '$python' in PATH\"\n"
        "}\n"
        "\n"
        "myq_fail() {\n"
        "\tprintf 'myq: %s\\n' \"$1\" >&2\n"
        "\treturn 1\n"
        "}\n"
        "\n"
        "# myq ARGS: run myq with no variable of the caller's but PATH (myq reads\n"
        "# MYQ_* variables as options)\n"
        "myq() {\n"
        "\tenv -i PATH=\"${PATH:-/usr/sbin:/usr/bin:/sbin:/bin}\" \"$py\" \"$bin\" --spool \"$spool\" \"$@\"\n"
        "}\n"
        "\n"
        "# myq_argv FUNCTION: FUNCTION with the arguments of \"myq --spool SPOOL\"\n"
        "# that start the supervisor\n"
        "myq_argv() {\n"
        "\t_fn=$1\n"
        "\tset -f\n"
        "\t# shellcheck disable=SC2086 # args is a list of options, split on blanks\n"
        "\tset -- supervise --workers \"$workers\" --stop-timeout \"$stop_timeout\" $args\n"
        "\t# the intake process, beside the workers (its --mqtt broker: in args)\n"
        "\t[ -z \"$listen\" ] || set -- \"$@\" --listen \"$listen\"\n"
        "\t[ -z \"$listen_token_file\" ] || set -- \"$@\" --listen-token-file \"$listen_token_file\"\n"
        "\tfor _s in $subscribe; do set -- \"$@\" --subscribe \"$_s\"; done\n"
        "\tset +f\n"
        "\tif [ \"$user\" != root ] && [ \"$user\" != 0 ]; then\n"
        "\t\tset -- \"$@\" --user \"$user\" # supervise becomes the user itself\n"
        "\tfi\n"
        "\tif [ \"$log\" = syslog ]; then\n"
        "\t\tset -- \"$@\" --syslog\n"
        "\telse\n"
        "\t\tset -- \"$@\" --log \"$log\" # created and opened by supervise\n"
        "\tfi\n"
        "\t\"$_fn\" \"$@\"\n"
        "}\n"
        "\n"
        "myq_dry_run() {\n"
        "\tmyq \"$@\" --dry-run\n"
        "}\n"
        "\n"
        "# myq_prepare: the settings, the spool; false, with a message, when the\n"
        "# service cannot start (a typo in args, a spool that is not one: said\n"
        "# here, not in a loop of respawns)\n"
        "myq_prepare() {\n"
        "\tmyq_settings || return 1\n"
        "\t[ -r \"$bin\" ] || myq_fail \"bin: cannot read $bin\" || return 1\n"
        "\tid \"$user\" >/dev/null 2>&1 || myq_fail \"user: no user '$user'\" || return 1\n"
        "\t# the spool (idempotent), owned by the user the workers run as\n"
        "\t_why=$(myq init --owner \"$user\" ${store:+--store \"$store\"} 2>&1 >/dev/null) || myq_fail \"$_why\" || return 1\n"
        "\t_why=$(myq_argv myq_dry_run 2>&1 >/dev/null) || myq_fail \"$_why\" || return 1\n"
        "}\n"
        "\n"
        "myq_instance() {\n"
        "\tprocd_open_instance\n"
        "\tprocd_set_param command \"$py\" \"$bin\" --spool \"$spool\" \"$@\"\n"
        "\tprocd_set_param respawn 3600 5 0\n"
        "\tprocd_set_param term_timeout \"$term_timeout\"\n"
        "\tprocd_set_param stdout 1 # early errors and tracebacks go to logd\n"
        "\tprocd_set_param stderr 1\n"
        "\tprocd_close_instance\n"
        "}\n"
        "\n"
        "start_service() {\n"
        "\t[ -n \"$myq_prepared\" ] || myq_prepare || return 1\n"
        "\tmyq_argv myq_instance\n"
        "}\n"
        "\n"
        "service_triggers() {\n"
        "\tprocd_add_reload_trigger \"myq\"\n"
        "}\n"
        "\n"
        "reload_service() {\n"
        "\t# wrong settings: said, and the service runs on as it is\n"
        "\tmyq_prepare || return 1\n"
        "\tmyq_prepared=1\n"
        "\t# the running supervisor reopens the log and passes SIGHUP on ...\n"
        "\tprocd_send_signal myq '*' HUP >/dev/null 2>&1\n"
        "\t# ... and runs on, unless the settings changed: then procd restarts it\n"
        "\tstart\n"
        "}\n"
        "\n"
        "# myq_procs: the pids of this spool's \"myq supervise\", workers and intake: the\n"
        "# processes with those words in their command line that run as root or\n"
        "# as the service user (uid $_uid). A command line is anyone's to choose:\n"
        "# another user's process with these words is not waited for, nor killed.\n"
        "myq_procs() {\n"
        "\tfor _d in /proc/[0-9]*; do\n"
        "\t\t_cmd=$(tr '\\0' ' ' 2>/dev/null <\"$_d/cmdline\") || continue\n"
        "\t\tcase \" $_cmd\" in\n"
        "\t\t*\" --spool $spool supervise \"* | *\" --spool $spool worker \"* | *\" --spool $spool intake \"*)\n"
        "\t\t\tmyq_ours \"$_d\" && echo \"${_d#/proc/}\"\n"
        "\t\t\t;;\n"
        "\t\tesac\n"
        "\tdone\n"
        "}\n"
        "\n"
        "# myq_ours /proc/PID: every uid of the process (real, effective, saved,\n"
        "# filesystem) is root's or the service user's\n"
        "myq_ours() {\n"
        "\twhile read -r _k _r _e _s _f; do\n"
        "\t\t[ \"$_k\" = Uid: ] || continue\n"
        "\t\tfor _u in \"$_r\" \"$_e\" \"$_s\" \"$_f\"; do\n"
        "\t\t\t[ \"$_u\" = 0 ] || [ \"$_u\" = \"$_uid\" ] || return 1\n"
        "\t\tdone\n"
        "\t\treturn 0\n"
        "\tdone 2>/dev/null <\"$1/status\"\n"
        "\treturn 1\n"
        "}\n"
        "\n"
        "myq_now() {\n"
        "\tread -r _up _ </proc/uptime\n"
        "\techo \"${_up%.*}\"\n"
        "}\n"
        "\n"
        "# after procd_kill, which only asks procd to stop the instance\n"
        "service_stopped() {\n"
        "\tmyq_settings 2>/dev/null || return 0\n"
        "\t_uid=$(id -u \"$user\" 2>/dev/null) || _uid=0\n"
        "\t# procd sends SIGKILL after term_timeout; workers then see their\n"
        "\t# supervisor gone and stop by themselves\n"
        "\t_end=$(($(myq_now) + term_timeout + 10))\n"
        "\twhile [ -n \"$(myq_procs)\" ]; do\n"
        "\t\tif [ \"$(myq_now)\" -ge \"$_end\" ]; then\n"
        "\t\t\tfor _p in $(myq_procs); do kill -s KILL \"$_p\" 2>/dev/null; done\n"
        "\t\t\tsleep 1\n"
        "\t\t\tbreak\n"
        "\t\tfi\n"
        "\t\tsleep 0.2 2>/dev/null || sleep 1\n"
        "\tdone\n"
        "\t# claims of workers that were killed, and their handlers: \"myq reap\"\n"
        "\t# (as the spool's owner) takes them back and ends the handlers\n"
        "\t[ ! -d \"$spool\" ] || myq reap >/dev/null 2>&1\n"
        "\treturn 0\n"
        "}\n"
    ),
}
# _INIT_FILES end

_LIB = "lib/myq"        # under PREFIX: myq.py and its __pycache__/

# build/dist.py's LAUNCHER, word for word (tests/test_dist.py checks).
# %(lib)s is PREFIX/lib/myq as a Python literal.
_LAUNCHER = """#!/usr/bin/env python3
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

# What each init system gets: (its script, the line naming myq's program
# in it, that line's form for PREFIX/bin/myq, its settings file, its
# shipped settings).
_INIT_SYSTEMS = {
    "sysv": ("myq", "BIN=${MYQ_BIN:-/usr/bin/myq}", "BIN=${MYQ_BIN:-%s}",
             "/etc/default/myq", "myq.default"),
    "procd": ("myq.procd", "config_get bin main bin /usr/bin/myq",
              "config_get bin main bin %s", "/etc/config/myq", "myq.config"),
}


def _site_dir(prefix):
    """Where this Python, were it installed under PREFIX, imports modules
    from with no sys.path edit: the first of its site directories under
    PREFIX/lib/ (Debian's /usr/lib/python3/dist-packages, a venv's or
    OpenWrt's lib/python3.X/site-packages), else PREFIX/lib/python3.X/
    site-packages (a cross build's target).  build/dist.py's site_dir,
    word for word but for the name."""
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


class _InstallError(MyqError):
    """A file of the layout that could not be written."""
    code = EX_CANTCREAT


def _install_file(path, data, mode, said):
    """Write aside, then rename into place (a running myq never reads a
    half-written file); say so in `said`."""
    d = os.path.dirname(path)
    try:
        os.makedirs(d, 0o755, exist_ok=True)
        tmp = "%s.%d.tmp" % (path, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_NOFOLLOW
                     | O_CLOEXEC, mode)
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)         # (not the umask's)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as e:
        raise _InstallError("cannot write %s: %s" % (
            e.filename or path, e.strerror or e))
    said.append(path)


def _compile_installed(module, said):
    """module's bytecode where its import looks (__pycache__/myq.TAG.pyc),
    as build/dist.py compiles it; other versions' .pyc removed.  Hash-based
    (PEP 552) and unchecked: valid whatever myq.py's mtime becomes (an
    image's tools may reset it), and trusted without a look at the source,
    which only an install replaces, and with it (checked, every start read
    and hashed all 880 KB of myq.py: 2.5 M instructions, 1 in 23 of a
    `myq enqueue`).  Without py_compile (python3-light may lack it) the
    first import writes it: imported here, in a child."""
    tag = sys.implementation.cache_tag
    if not tag:
        return                          # this Python caches no bytecode
    cache = os.path.join(os.path.dirname(module), "__pycache__")
    pyc = os.path.join(cache, "myq.%s.pyc" % tag)
    for f in (os.listdir(cache) if os.path.isdir(cache) else ()):
        if f.startswith("myq.") and f.endswith(".pyc") and f != os.path.basename(pyc):
            os.unlink(os.path.join(cache, f))
    try:
        import py_compile
        py_compile.compile(module, cfile=pyc, doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    except ImportError:
        import subprocess
        subprocess.call([sys.executable, "-c", "import sys; sys.path.insert(0, "
                         "%r); import myq" % os.path.dirname(module)])
    except (OSError, SyntaxError) as e:
        raise _InstallError("cannot compile %s: %s" % (module, e))
    if os.path.exists(pyc):
        said.append(pyc)


def install(prefix="/usr", destdir="", init=None):
    """Lay out myq under DESTDIR (the target's root; '' is /): PREFIX/lib/
    myq/myq.py (this file's bytes) and its bytecode, PREFIX/bin/myq (the
    launcher), myq.pth naming PREFIX/lib/myq in this Python's site
    directory under PREFIX (so that `import myq` works), /etc/init.d/myq (`init`: sysv, or procd for OpenWrt; by
    default procd where DESTDIR has /etc/rc.common) naming PREFIX/bin/myq,
    and its settings file only where there is none yet (an operator's
    settings are kept).  Again over an installed copy: the same files.
    Returns what it did, a line each."""
    if not prefix.startswith("/") or "\n" in prefix or "\0" in prefix:
        raise UsageError("--prefix must be an absolute path, not %r" % prefix)
    prefix = prefix.rstrip("/") or "/"
    top = destdir or "/"

    def at(path):
        return os.path.join(top, path.lstrip("/"))
    if destdir and not os.path.isdir(destdir):
        raise UsageError("--destdir %s is not a directory" % destdir)
    if init is None:
        init = "procd" if os.path.exists(at("/etc/rc.common")) else "sysv"
    script, line, form, conf, example = _INIT_SYSTEMS[init]
    with open(os.path.abspath(__file__), "rb") as f:
        me = f.read()
    binpath = os.path.join(prefix, "bin", "myq")
    lib = os.path.join(prefix, _LIB)
    module = at(os.path.join(lib, "myq.py"))
    said = []
    # the module and its bytecode first, then what starts it
    _install_file(module, me, 0o644, said)
    _compile_installed(module, said)
    _install_file(at(binpath), (_LAUNCHER % {"lib": lib}).encode("utf-8"), 0o755, said)
    # `import myq` in this python3, with no sys.path edit (SPEC 7)
    _install_file(at(os.path.join(_site_dir(prefix), "myq.pth")),
                  (lib + "\n").encode("utf-8"), 0o644, said)
    text = _INIT_FILES[script]
    _install_file(at("/etc/init.d/myq"), text.replace(
        line, form % binpath).encode("utf-8"), 0o755, said)
    if os.path.exists(at(conf)):
        said.append("%s kept (the shipped example is init.d/%s)" % (at(conf), example))
    else:
        _install_file(at(conf), _init_settings_file(init).encode("utf-8"),
                      0o644, said)
    return said


def _args_install(p):
    p.add_argument("--prefix", default="/usr", help="myq.py goes to "
                   "PREFIX/lib/myq, the launcher to PREFIX/bin/myq (default /usr)")
    p.add_argument("--destdir", default="", metavar="DIR", help="the target's "
                   "root, for an image being built (default /)")
    p.add_argument("--init", choices=sorted(_INIT_SYSTEMS), help="the init "
                   "script: sysv (/etc/default/myq) or procd (OpenWrt, "
                   "/etc/config/myq); default procd where DIR/etc/rc.common is")


def _cmd_install(a):
    for line in install(a.args.prefix, a.args.destdir, a.args.init):
        _print(line)


_COMMAND_TABLE["install"] = (
    _cmd_install, _args_install,
    "lay out this file as an installed myq: the module and its bytecode, the "
    "launcher, the init script and its settings")


# The process image ###########################################################



def _worker_start(python=None, cached=False):
    """argv that starts this very file as a worker process (`cached`: for
    _run_from_cache, whose .pyc is fresh, written before the exec)."""
    me = os.path.abspath(__file__)
    if not me.endswith(".py"):          # /usr/bin/myq is myq.py itself
        return [python or sys.executable, me]
    # Loaded as a module, by its path, so that the workers use its cached
    # .pyc (a script is compiled at every start, and the compiler's memory
    # stays in the worker's heap); its directory takes the place of the
    # current one on sys.path, as for a script.  The .pyc only where
    # _trusted_cache says so, checked by the new process itself (its own
    # user, at its start): else myq.py is compiled from its source, as a
    # script would be, and the heap given back as after a script's compile.
    return [python or sys.executable, "-c", "import sys\n"
            "if sys.path[:1] == ['']:\n    del sys.path[0]\n"
            "sys.path.insert(0, %r)\n"
            "import importlib.util as u\n"
            "%s"
            "s = u.spec_from_file_location('myq', %r)\n"
            "m = sys.modules['myq'] = u.module_from_spec(s)\n"
            "%s"
            "if not s.cached or _trusted_cache(s.origin, s.cached):\n"
            "    s.loader.exec_module(m)\n"
            "else:\n"
            "    m.__cached__ = None\n"
            "    with open(s.origin, 'rb') as f:\n"
            "        exec(compile(f.read(), s.origin, 'exec'), m.__dict__)\n"
            "    m._COMPILED_AT_START.append(True)\n"
            "m._retitle_self()\n"
            "sys.exit(m.main())\n" % (os.path.dirname(me), _TRUSTED_CACHE, me,
                                       "m._FROM_CACHE = 1\n" if cached else "")]


def _compiled_here():
    """Did this process compile myq.py?  Run as a script; or imported with
    no current .pyc (none, older than the source, or written since this
    process started)."""
    if _COMPILED_AT_START:
        return True
    if globals().get("_FROM_CACHE"):
        return False            # _run_from_cache wrote it, then exec'd
    pyc = globals().get("__cached__")
    if not pyc:
        return False            # runpy, exec: not ours to guess
    try:
        made = os.stat(pyc).st_mtime
    except OSError:
        return True
    try:
        if made < os.stat(__file__).st_mtime:
            return True
        up = time.clock_gettime(time.CLOCK_BOOTTIME)
        ticks = proc_start(os.getpid())
        return ticks is not None and \
            made >= time.time() - up + ticks / float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, OSError, ValueError):
        return False


# Byte code is code: a .pyc is used only where no one but us (or root) can
# have put it or can put it: the source's directory, __pycache__/ and the
# .pyc each ours or root's, no symlink, none writable by group or others (a
# copy in /tmp, sticky and world-writable, must not run what another user
# left in /tmp/__pycache__/).  What is not there yet is made by us.  Source
# text, run here and at the start of every worker (_worker_start), before
# myq is imported there: one check for both ways in.
_TRUSTED_CACHE = """def _trusted_cache(me, pyc):
    import os
    for p in (os.path.dirname(me), os.path.dirname(pyc), pyc):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        except OSError:
            return False
        if st.st_mode & 0o170000 == 0o120000 or st.st_mode & 0o022 \\
                or st.st_uid not in (0, os.geteuid()):
            return False
    return True
"""


def _trusted_cache(me, pyc):
    """_TRUSTED_CACHE's check, its text compiled when it is needed (at
    every import it cost 0.6 M instructions, 1 % of a `myq enqueue`)."""
    space = {}
    exec(_TRUSTED_CACHE, space)
    return space["_trusted_cache"](me, pyc)


def _run_from_cache():
    """A long-running command of myq.py run as a script: start it again in
    this process (execv: the same pid, descriptors and words of the command
    line) with myq.py imported, by its path, from the byte code Python
    caches beside it (__pycache__/), written here first when missing.  The
    new image never compiles myq.py, so it keeps none of the ~4 MiB that
    the compile leaves fragmented in pymalloc (3.10+): its RSS is the
    installed layout's.  Nothing happens where that cache cannot be (byte
    code writing off and no fresh .pyc, a read-only directory, no
    py_compile), where another user could write it (its directory, or
    __pycache__/, or the .pyc is not ours or root's alone), or where the
    file is not NAME.py (an installed /usr/bin/myq that is myq.py itself:
    Python caches no byte code for it)."""
    me = os.path.abspath(__file__)
    if not _COMPILED_AT_START or not me.endswith(".py") or not sys.executable:
        return
    try:
        import importlib.util
        pyc = importlib.util.cache_from_source(me)
    except (ImportError, NotImplementedError, ValueError):
        return
    if not _trusted_cache(me, pyc):
        return
    try:
        fresh = os.stat(pyc).st_mtime >= os.stat(me).st_mtime
    except OSError:
        fresh = False
    try:
        if not fresh:
            if sys.flags.dont_write_bytecode:
                return
            import py_compile
            try:
                os.mkdir(os.path.dirname(pyc), 0o755)   # not the umask's 775
            except FileExistsError:
                pass
            py_compile.compile(me, cfile=pyc, doraise=True)
        import subprocess
        flags = subprocess._args_from_interpreter_flags()
    except Exception:   # no py_compile, a read-only directory, ...
        return
    argv = _worker_start(cached=True)
    argv = argv[:1] + flags + (_code_from_pipe(argv[2], flags) or argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv + sys.argv[1:])


def _code_from_pipe(code, flags):
    """[PATH] for _run_from_cache's new image: it reads its -c `code` as a
    script from a pipe (PATH: /dev/fd/N), so that its command line is as
    long as what _retitle_self then writes over it (python3 PROG WORDS),
    none of it left over (the kilobyte of -c text stayed as NULs after the
    words, in ps and /proc/PID/cmdline, its own and its forked workers').
    PATH is padded with slashes to PROG's length less the `flags`'.  None
    (the -c text, then) where no pipe can be made."""
    try:
        fd, w = os.pipe()
    except OSError:
        return None
    try:
        text = ("import os, sys\nos.close(%d)\nif not (sys.flags.isolated"
                " or getattr(sys.flags, 'safe_path', 0)):\n    del sys.path[0]"
                "\nsys.argv[0] = '-c'\n%s" % (fd, code)).encode("utf-8")
        if os.write(w, text) != len(text):      # (a pipe holds 4 KiB at least)
            raise OSError("short write")
        os.set_inheritable(fd, True)
    except (OSError, ValueError):
        os.close(fd)
        return None
    finally:
        os.close(w)
    path = "/dev/fd/" if os.path.isdir("/dev/fd") else "/proc/self/fd/"
    room = len(_title_prog()) - sum(len(f) + 1 for f in flags)
    return [path + "/" * max(0, room - len(path) - len(str(fd))) + str(fd)]


def _give_back_heap(reexec=False):
    """A long-running command (worker, supervise) in a process that
    compiled myq.py: with `reexec` (a worker that runs until stopped, a
    supervisor) first _run_from_cache, which does not return where it
    works; else give the C heap's free pages back to the system.  The
    compiler's memory, once freed, stays in glibc's heap, pinned by what
    was allocated after it (~13 MiB of RSS on Python 3.9+), until
    malloc_trim(0).  Without ctypes (python3-light) or without malloc_trim
    (musl) this does nothing, and the C library's free() alone decides.
    What stays either way is pymalloc's arenas that the compile left
    fragmented (~1 MiB on 3.7-3.9, ~3-4 MiB on 3.10+)."""
    if not _compiled_here():
        return
    if reexec:
        _run_from_cache()
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except Exception:
        pass


def _arg_area():
    """(start, end, env_start, env_end): where this process's command line
    and its first environment are in its own memory, the fields arg_start
    to env_end of /proc/self/stat (Linux 3.5+), which /proc/PID/cmdline and
    /proc/PID/environ read; None where they cannot be read or this process
    cannot write its memory (/proc/self/mem)."""
    data = _read_small("/proc/self/stat", 4096) or b""
    fields = data.rpartition(b")")[2].split()
    try:
        area = tuple(int(f) for f in fields[45:49])
        os.close(os.open("/proc/self/mem", os.O_WRONLY | O_CLOEXEC))
    except (ValueError, OSError):
        return None
    return area if len(area) == 4 and 0 < area[0] < area[1] <= area[2] \
        <= area[3] else None


def _env_block(area, env):
    """The environment `env` as /proc/PID/environ will read it, padded to
    the length of the environment in `area`; None when it does not fit."""
    out = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0"
                   for k, v in env.items())
    room = area[3] - area[2]
    return out.ljust(room, b"\0") if len(out) <= room else None


def _title(area, words, need):
    """The command line `words` as /proc/PID/cmdline will read it, padded
    to the length of `area` (the parent's _arg_area()): all of it, or the
    first `need` words and as many more as fit, then "..."; None when
    the `need` words do not fit."""
    room = area[1] - area[0]
    parts = [os.fsencode(w) + b"\0" for w in words]
    out = b"".join(parts)
    if len(out) > room:
        out = b"".join(parts[:need])
        if len(out) + 4 > room:
            return None
        for part in parts[need:]:
            if len(out) + len(part) + 4 > room:
                break
            out += part
        out += b"...\0"
    return out.ljust(room, b"\0")


def _retitle(area, title, env):
    """Write `title` (of _title) over this process's command line, as ps
    and /proc/PID/cmdline show it: a child forked by the supervisor says
    it is a worker, not a second supervisor (the init scripts find the
    supervisor by its command line); and `env` (of _env_block) over the
    environment it started with, which /proc/PID/environ shows: the
    child's own (clean) one, not the supervisor's.  Only once the C
    library's environ points elsewhere (os.environ set anew: putenv and
    unsetenv copy).  True when both were written."""
    try:
        fd = os.open("/proc/self/mem", os.O_WRONLY | O_CLOEXEC)
        try:
            return os.pwrite(fd, title, area[0]) == len(title) and \
                os.pwrite(fd, env, area[2]) == len(env)
        finally:
            os.close(fd)
    except (OSError, OverflowError):
        return False


def _retitle_self():
    """A worker or intake started as a new interpreter (_worker_start's -c
    text, ~1 KiB of code) shows the command line a forked one shows:
    python3 PROG WORDS..., written over that text (the environment left
    as it is)."""
    area = _arg_area()
    words = sys.argv[1:]
    if area is None or sys.argv[:1] != ["-c"]:
        return
    title = _title(area, [sys.executable or "python3", _title_prog()] + words,
                   len(words) + 2)
    if title is not None:
        _retitle(area, title, b"")


def _dumpable():
    """After root became the service user, the kernel makes this process
    undumpable: its /proc/self/mem is root's, so a child forked from it
    cannot _retitle and would exec a new interpreter (a kilobyte of -c
    text in ps, none of the supervisor's pages shared).  Dumpable again
    (prctl PR_SET_DUMPABLE) where ctypes is (not python3-light): this
    process holds nothing of root's that the user's workers are not
    given (the log's descriptor, the secrets in their environment)."""
    try:
        import _ctypes          # (ctypes itself would cost 0.8 MB, this 0.3)
        prctl = _ctypes.dlsym(_ctypes.dlopen(None), "prctl")
        return _ctypes.call_function(prctl, (4, 1, 0, 0, 0)) == 0
    except Exception:           # PR_SET_DUMPABLE ^
        return False


def _title_prog():
    """The program a child's title names: the file Python ran (myq.py,
    the installed launcher), else this module's file."""
    prog = sys.argv[0] if sys.argv else ""
    if not prog or prog == "-c" or not os.path.isfile(prog):
        prog = __file__
    return os.path.abspath(prog)


def end(status):
    """The installed launcher's exit: `myq.end(myq.main())`.  What the
    interpreter's exit would do for this process (the atexit functions,
    then standard output and error flushed), then os._exit(status): not
    its teardown, which frees what the import made one object at a time
    (1,600 code objects, their functions and classes: 2.9 M instructions,
    1 in 19 of an installed `myq enqueue`) for a process whose memory the
    kernel takes back whole.  Nothing of myq's is left to a finalizer: the
    command closed its store (main), the log writes line by line, a job's
    bytes go through descriptors.  Where another thread still runs, the
    status is no number, or a flush fails (a closed pipe): sys.exit, the
    interpreter's own exit (its message, its 120)."""
    if status is None:
        status = 0
    threading = sys.modules.get("threading")
    if isinstance(status, int) and not (threading and any(
            t.is_alive() and t is not threading.current_thread()
            for t in threading.enumerate())):
        atexit = sys.modules.get("atexit")     # (none imported: none set)
        if atexit is not None:
            atexit._run_exitfuncs()
        try:
            for f in (sys.stdout, sys.stderr):
                if f is not None:
                    f.flush()
        except Exception:
            pass
        else:
            os._exit(status & 0xff)
    sys.exit(status)


_IMAGE.update(start=_worker_start, area=_arg_area, title=_title,
              env_block=_env_block, retitle=_retitle, dumpable=_dumpable,
              prog=_title_prog, give_back_heap=_give_back_heap)


# Run as a script #############################################################
#
# Python 3.9+ parses a script into an arena (its PEG parser's memo and
# nodes: ~15 MB for myq.py's 300 KB) that it frees only when the script's
# module body returns: with `sys.exit(main())` in the body, a worker run
# from the one-file copy would keep it all its life.  So myq.py run as a
# script leaves its body by raising _BodyDone: Python frees the arena, then
# hands the exception to sys.excepthook, the hook made by _after_body,
# which runs main() in the same process (the same command line, the main
# thread, its signals; nothing is finalizing yet).  SystemExit out of the
# hook is Python's ordinary exit, as out of the body.

class _BodyDone(BaseException):
    """Leaves the module body of myq.py run as a script."""


# And a script is compiled at every start, all of it, before its first
# line runs (Python never caches a script's byte code; a stub at the top
# would run after the compile): one `myq enqueue` from the one-file copy
# peaks at ~60 MB of RAM and ~19x the instructions of the installed
# layout, whose launcher imports myq.py from byte code (12 MB; bench/
# device.py).  No interpreter compiles 600 KB in less, so the copy says,
# once, what makes it cheap: on a terminal (a script's or cron's standard
# error is not read by the one to tell), at the first run of a user that
# makes ~/.cache/myq/install-hint (or $XDG_CACHE_HOME's), whose presence
# keeps it quiet for good; nothing where that file cannot be made, or
# where its directories are not this user's alone (no symlink; sudo that
# kept another user's HOME).
_HINT = ("myq: this copy is compiled at every command (~60 MB of RAM, 10x "
         "the time); `python3 %s install` lays myq out to start from byte "
         "code (README: Install). Said once.\n")


def _hint_once():
    """Say _HINT on standard error if it is a terminal and this user was
    never told (see above); True when it was said."""
    if "install" in sys.argv[1:] or not os.isatty(2):
        return False
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not base.startswith("/"):
        base = os.path.join(os.environ.get("HOME", ""), ".cache")
    if not base.startswith("/"):
        return False
    uid = os.geteuid()
    try:
        if os.stat(os.path.dirname(base)).st_uid != uid:
            return False
        for d in (base, os.path.join(base, "myq")):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid \
                    or st.st_mode & 0o022:
                return False
        os.close(os.open(os.path.join(base, "myq", "install-hint"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW
                         | O_CLOEXEC, 0o600))
    except OSError:
        return False
    sys.stderr.write(_HINT % os.path.abspath(sys.argv[0]))
    sys.stderr.flush()
    return True


def _after_body(prev):
    """The sys.excepthook that runs main() once the body is left; prev is
    the hook it replaces, put back at once."""
    def hook(typ, value, tb):
        sys.excepthook = prev
        if typ is not _BodyDone:
            return prev(typ, value, tb)
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
        _COMPILED_AT_START.append(True)
        try:
            _hint_once()
        except Exception:       # a hint never stops a command
            pass
        try:
            status = main()
        except SystemExit:
            raise
        except BaseException:
            # what Python does with an exception out of the body
            prev(*sys.exc_info())
            status = 1
        sys.exit(status)
    return hook


if __name__ == "__main__":
    # A --module handler file that does `import myq` must get THIS module
    # (the same PermanentError and RetryLater classes), not a second copy.
    sys.modules.setdefault("myq", sys.modules[__name__])
    # The body is the outermost frame when Python itself runs this file
    # (not runpy, exec or -m): the exception goes straight to excepthook.
    if getattr(sys, "_getframe", None) and sys._getframe().f_back is None \
            and not sys.flags.inspect:
        sys.excepthook = _after_body(sys.excepthook)
        raise _BodyDone
    sys.exit(main())
