"""Handlers for the power-cut workload (myq worker --module this file).

Types: "ok" succeeds; "flaky" asks for a retry (RetryLater) until its third
attempt; "bad" is a permanent error (dead letter).  Every run of a handler
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
        raise myq.RetryLater(0.2)


def bad(job):
    _ran(job)
    raise myq.PermanentError("bad job (on purpose)")
