"""Bus commands for evaluation jobs: status and results read the job store on disk (the
evaluator writes it); submitting is the evaluator worker's `eval_submit` op."""

from __future__ import annotations

import json

from kiln.native.job_store import JobNotFound, JobStore

from .commands import CommandError, command


def _store(sup) -> JobStore:
    return JobStore(sup.paths.home, "eval")


@command("eval.evaluator")
def eval_evaluator(sup, args):
    """Which worker evaluates (front ends send it `eval_submit` and `eval_register`)."""
    for w in sup.workers.values():
        if w.kind == "evaluator" and w.spec.get("enabled", True):
            return {"worker": w.name}
    raise CommandError("no_evaluator", "no evaluator worker is configured; add [workers.evaluator] kind = "
                                       "\"evaluator\" to kiln.toml (the default configuration has one)", status=503)


@command("eval.jobs")
def eval_jobs(sup, args):
    """Every evaluation job, oldest first (without per-example results)."""
    return {"jobs": _store(sup).list()}


@command("eval.job")
def eval_job(sup, args):
    """One job with its per-example results."""
    store = _store(sup)
    try:
        job = store.get(str(args.get("id")))
    except JobNotFound:
        raise CommandError("job_not_found", f"no evaluation job {args.get('id')!r}", status=404) from None
    try:
        lines = store.path(job["id"], "results.jsonl").read_text().splitlines()
        job["results"] = [json.loads(ln) for ln in lines if ln.strip()]
    except OSError:
        job["results"] = []
    return job


@command("eval.cancel")
def eval_cancel(sup, args):
    """Cancel a queued or running evaluation."""
    try:
        job = _store(sup).get(str(args.get("id")))
    except JobNotFound:
        raise CommandError("job_not_found", f"no evaluation job {args.get('id')!r}", status=404) from None
    if job["state"] in ("completed", "failed", "cancelled"):
        raise CommandError("job_finished", f"job {job['id']} is already {job['state']}", status=409)
    return _store(sup).request_cancel(job["id"])
