"""Bus commands for training jobs and adapters.

Job status and loss history read the job store on disk (the trainer writes it), so they answer
while the trainer is busy or restarting. Submitting and cancelling are the trainer's ops, routed
(`train.submit`, `train.cancel`: supervisor/router.py).
"""

from __future__ import annotations

from kiln.protocol.store.adapter_registry import AdapterNotFound
from kiln.native.gguf_file import GGUFError, read_gguf
from kiln.native.lora import AdapterError, load_adapter
from kiln.protocol.store.job_store import JobStore

from ..core.registry import CommandError, command
from .job_lookup import job_or_404


def _store(sup) -> JobStore:
    return JobStore(sup.paths.home)


def _job(sup, job_id) -> dict:
    return job_or_404(_store(sup), job_id, "training")


@command("train.jobs", off_loop=True)
def train_jobs(sup, args):
    """Every training job, oldest first: state, step/total, epoch, loss, tokens/s, ETA."""
    return {"jobs": _store(sup).list()}


@command("train.job", off_loop=True)
def train_job(sup, args):
    """One job, with its loss history after step `since` (default 0: all of it)."""
    job = _job(sup, args.get("id"))
    job["losses"] = _store(sup).losses(job["id"], int(args.get("since") or 0))
    return job


# -- adapters ------------------------------------------------------------------------------------

def _adapter(sup, name) -> dict:
    try:
        return sup.adapters.get(name)
    except AdapterNotFound as e:
        raise CommandError("adapter_not_found", str(e), status=404) from None
    except ValueError as e:
        raise CommandError("bad_request", str(e)) from None


def _in_use(sup, name: str) -> int:
    return sum(1 for p in list(sup.pending.values()) if p.adapter == name)   # list(): safe off the loop


@command("adapters.list", off_loop=True)
def adapters_list(sup, args):
    """Registered adapters: base model, rank, alpha, targets, size, whether active or in use."""
    return {"active": sup.adapters.active(),
            "adapters": [dict(a, in_use=_in_use(sup, a["name"])) for a in sup.adapters.list()]}


@command("adapters.load", off_loop=True)
def adapters_load(sup, args):
    """Make an adapter the active one: applied to every request that names none. Refused if it
    does not fit the model an inference worker serves."""
    meta = _adapter(sup, args.get("name"))
    try:
        ad = load_adapter(meta["path"])
        for w in sup.workers.values():
            path = (w.status or {}).get("path")
            if w.kind in ("inference", "moe-stream") and path:
                ad.check_fits(read_gguf(path))
    except (AdapterError, GGUFError) as e:
        raise CommandError("adapter_mismatch", f"adapter {meta['name']}: {e}") from None
    sup.adapters.set_active(meta["name"])
    sup.record("adapter_loaded", None, meta["name"])
    return dict(meta, active=True)


@command("adapters.unload")
def adapters_unload(sup, args):
    """No active adapter: requests run on the base model unless they name one."""
    was = sup.adapters.active()
    sup.adapters.set_active(None)
    if was:
        sup.record("adapter_unloaded", None, was)
    return {"active": None, "was": was}


@command("adapters.delete")
def adapters_delete(sup, args):
    """Delete an adapter's files; refused while it is active or a request uses it."""
    meta = _adapter(sup, args.get("name"))
    name = meta["name"]
    if sup.adapters.active() == name:
        raise CommandError("adapter_in_use", f"adapter {name} is the active adapter; "
                                             f"`kiln adapters unload` first", status=409)
    n = _in_use(sup, name)
    if n:
        raise CommandError("adapter_in_use", f"adapter {name} is in use by {n} request(s); try again "
                                             f"when they finish", status=409)
    sup.adapters.delete(name)
    sup.record("adapter_deleted", None, name)
    return {"deleted": name}
