"""One job of a store on disk, or the 404 users read: what they asked for and the ids there are."""

from __future__ import annotations

from kiln.protocol.store.job_store import JobNotFound, JobStore

from ..core.registry import CommandError


def job_or_404(store: JobStore, job_id, what: str, noun: str = "job") -> dict:
    try:
        return store.get(str(job_id))
    except JobNotFound:
        ids = [j["id"] for j in store.list()]
        raise CommandError("job_not_found", f"no {what} {noun} {job_id!r}"
                           + (f" ({noun}s: {', '.join(ids[-10:])})" if ids else f" (no {noun}s yet)"),
                           status=404) from None
