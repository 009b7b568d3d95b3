"""The job-cancel op the trainer and the evaluator share: a cancel arrives through the router as
a request to the worker that owns the job, which records it in its own job store (a running job
stops after its current step or example; a queued one never starts)."""

from __future__ import annotations

from kiln.protocol.store.job_store import FINAL, JobNotFound, JobStore

from .worker import OpError


def cancel_job(store: JobStore, job_id: str, what: str, noun: str = "job") -> dict:
    try:
        job = store.get(str(job_id))
    except JobNotFound:
        ids = [j["id"] for j in store.list()]
        raise OpError("job_not_found", f"no {what} {noun} {job_id!r}"
                      + (f" ({noun}s: {', '.join(ids[-10:])})" if ids else f" (no {noun}s yet)")) from None
    if job["state"] in FINAL:
        raise OpError("job_finished", f"{noun} {job['id']} is already {job['state']}")
    return store.request_cancel(job["id"])
