"""Bus commands for the OpenEnv runs the daemon owns: the list, one run and where its artifacts
are read the job store on disk (the evaluator writes it), so they answer while it is busy or
restarting. Starting, resuming and cancelling are the evaluator's ops, routed (`openenv.start`,
`openenv.resume`, `openenv.cancel`: supervisor/core/routing.py)."""

from __future__ import annotations

import json

from kiln.protocol.openenv.rollout import RECORDS as ARTIFACTS  # what a client may read of a run folder
from kiln.protocol.openenv.rollout import RUN_FOLDERS as FOLDERS
from kiln.protocol.store.job_store import JobStore

from ..core.registry import CommandError, command
from .job_lookup import job_or_404


def _store(sup) -> JobStore:
    return JobStore(sup.paths.home, "openenv")


def _run(sup, run_id) -> dict:
    return job_or_404(_store(sup), run_id, "OpenEnv", "run")


@command("openenv.preflight", off_loop=True)
def openenv_preflight(sup, body: dict):
    """What `kiln openenv train` checks before the environment is touched, for a run the daemon
    will own: the workers it needs are configured."""
    kinds = {w.kind for w in list(sup.workers.values())}
    if "evaluator" not in kinds:
        raise CommandError("no_worker", "no evaluator worker is configured ([workers.eval] kind = \"evaluator\"): "
                                        "the evaluator plays the daemon's OpenEnv runs", status=503)
    if body.get("adapter") and "trainer" not in kinds:
        raise CommandError("no_worker", "no trainer worker is configured ([workers.trainer] kind = \"trainer\"): "
                                        "the run could not train its adapter", status=503)
    return {"ok": True}


@command("openenv.runs", off_loop=True)
def openenv_runs(sup, args):
    """Every OpenEnv run, oldest first: state, phase, episodes done/total, mean return."""
    return {"runs": _store(sup).list()}


@command("openenv.run", off_loop=True)
def openenv_run(sup, args):
    """One run, with its rollout's summary and its held-out evaluation when they are written."""
    run = _run(sup, args.get("id"))
    store = _store(sup)
    for key, path in (("summary", store.path(run["id"], "rollout") / "summary.json"),
                      ("evaluation_detail", store.path(run["id"], "evaluation.json"))):
        try:
            run[key] = json.loads(path.read_text())
        except (OSError, ValueError):
            run[key] = None
    return run


@command("openenv.artifact", off_loop=True)
def openenv_artifact(sup, args):
    """Where one of a run's files is: `name` one of ARTIFACTS (or evaluation.json), `folder` one
    of FOLDERS (default rollout). A name outside those is refused: no path comes from a client."""
    run = _run(sup, args.get("id"))
    name, folder = str(args.get("name") or ""), str(args.get("folder") or "rollout")
    if name == "evaluation.json":
        path = _store(sup).path(run["id"], name)
    elif name in ARTIFACTS and folder in FOLDERS:
        path = _store(sup).path(run["id"], folder) / name
    else:
        raise CommandError("not_found", f"no artifact {folder}/{name!r}: a run has {', '.join(ARTIFACTS)} in each of "
                                        f"{', '.join(FOLDERS)}, and evaluation.json", status=404)
    if not path.is_file():
        raise CommandError("not_found", f"run {run['id']} has no {path.relative_to(_store(sup).path(run['id'], ''))} "
                                        f"yet (state {run['state']}, phase {run.get('phase')})", status=404)
    return {"path": str(path), "bytes": path.stat().st_size}
