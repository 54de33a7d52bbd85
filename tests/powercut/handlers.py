"""Handlers for the power-cut workload (myq worker --module this file).

Types: "ok" succeeds; "flaky" fails (its own retryable failure, not its
destination's: a RetryLater would be the destination's, SPEC 9, and hold
the type) until its third attempt; "bad" is a permanent error (dead
letter).  Every run of a handler
appends "TYPE ID ATTEMPT" to $PC_RUNLOG (when set), so the checker knows
which jobs ran during recovery.
"""
import os

import myq


def _ran(job):
    path = os.environ.get("PC_RUNLOG")
    if path:
        with open(path, "a") as f:
            f.write("%s %s %s\n" % (job["type"], job["id"], job.get("attempts")))


def ok(job):
    _ran(job)


def flaky(job):
    _ran(job)
    if (job.get("attempts") or 0) < 3:
        raise RuntimeError("flaky: fails until its third attempt (on purpose)")


def bad(job):
    _ran(job)
    raise myq.PermanentError("bad job (on purpose)")
