"""Bus commands for evaluation jobs: status and results read the job store on disk (the
evaluator writes it); submitting, registering and cancelling
are the evaluator's ops, routed (`eval.submit`, `eval.register`, `eval.cancel`: supervisor/router.py)."""

from __future__ import annotations

import json

from kiln.protocol.store.job_store import JobStore

from ..core.registry import command
from .job_lookup import job_or_404


def _store(sup) -> JobStore:
    return JobStore(sup.paths.home, "eval")


@command("eval.jobs", off_loop=True)
def eval_jobs(sup, args):
    """Every evaluation job, oldest first (without per-example results)."""
    return {"jobs": _store(sup).list()}


@command("eval.job", off_loop=True)
def eval_job(sup, args):
    """One job with its per-example results."""
    store = _store(sup)
    job = job_or_404(store, args.get("id"), "evaluation")
    try:
        lines = store.path(job["id"], "results.jsonl").read_text().splitlines()
        job["results"] = [json.loads(ln) for ln in lines if ln.strip()]
    except OSError:
        job["results"] = []
    return job
