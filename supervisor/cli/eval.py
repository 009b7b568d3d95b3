"""`kiln eval register|run|compare|replay|status`: evaluation suites through the daemon's
evaluator worker (which generates through the inference worker)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from kiln.protocol import vocab

from .debug import eval_app
from .engine import fail, note
from .train import _client, _cmd


def _submit(c, op: str, body: dict) -> dict:
    """A routed evaluator op (eval.register, eval.submit): the router finds the evaluator."""
    from ..bus.client import CommandFailed
    try:
        return [m for m in c.stream(op, body, timeout=600)][-1].body
    except CommandFailed as e:
        fail(e.message)


def _wait(c, job_id: str, watch: bool) -> dict:
    shown = -1
    while True:
        job = _cmd(c, "eval.job", {"id": job_id})
        if watch and job.get("done") != shown:
            shown = job.get("done")
            sys.stderr.write(f"\r{job_id} {job['state']} {shown}/{job.get('total')}   ")
            sys.stderr.flush()
        if job["state"] in vocab.JOB_FINISHED:
            if watch:
                sys.stderr.write("\n")
            return job
        time.sleep(0.3)


def _show_metrics(job: dict) -> None:
    for arm, m in (job.get("metrics") or {}).items():
        lo, hi = m["accuracy_ci95"]
        lat = m["latency_s"]
        typer.echo(f"[{arm}] accuracy {m['accuracy']:.3f} (95% CI {lo:.3f}–{hi:.3f})  n={m['n']}  "
                   + "  ".join(f"{k} {v}" for k, v in m["counts"].items())
                   + f"  mean score {m['mean_score']:.3f}  weighted {m['weighted_score']:.3f}")
        typer.echo(f"    latency p50 {lat['p50']:.3f}s p90 {lat['p90']:.3f}s p99 {lat['p99']:.3f}s  "
                   f"tokens {m['prompt_tokens']} prompt / {m['completion_tokens']} completion")
        for tag, t in m["pass_rate_by_tag"].items():
            typer.echo(f"    tag {tag}: {t['pass']}/{t['n']} ({t['rate']:.2f})")
    for pair, cmp in (job.get("comparison") or {}).items():
        typer.echo(f"{pair}: improved {cmp['improved']}, regressed {cmp['regressed']}, both pass {cmp['both_pass']}, "
                   f"both fail {cmp['both_fail']}; sign test p = {cmp['sign_test_p']:.4g}")


def _finish(job: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(job))
    elif job["state"] == "completed":
        typer.echo(f"{job['id']} completed: suite {job['spec']['suite']} ({job['identities']['suite_sha256'][:12]}), "
                   f"model {job['identities']['model']}")
        _show_metrics(job)
    else:
        typer.echo(f"{job['id']} {job['state']}" + (f": {job['error']}" if job.get("error") else ""))
    if job["state"] != "completed":
        raise typer.Exit(1)


def _suite_body(suite: Optional[str], file: Optional[Path]) -> dict:
    if bool(suite) == bool(file):
        fail("name a suite: --suite NAME (registered) or --file F", 2)
    if file is not None:
        if not file.exists():
            fail(f"{file}: no such file")
        return {"file": str(file.resolve())}
    return {"suite": suite}


@eval_app.command("register")
def register(file: Path = typer.Argument(..., help="suite JSON (or header JSON with examples.jsonl beside it)")):
    """Validate a suite and register it under its name (then: kiln eval run --suite NAME)."""
    with _client() as c:
        r = _submit(c, "eval.register", {"file": str(file.resolve())})
    typer.echo(f"registered suite {r['name']}: {r['examples']} examples, hash {r['hash'][:12]}")


@eval_app.command("run")
def run(suite: Optional[str] = typer.Option(None, "--suite", "-s", help="registered suite name"),
        file: Optional[Path] = typer.Option(None, "--file", "-f", help="suite file"),
        adapter: Optional[str] = typer.Option(None, "--adapter", "-a", help="LoRA adapter (default: none)"),
        seed: Optional[int] = typer.Option(None, "--seed", help="overrides the suite's generation seed"),
        watch: bool = typer.Option(False, "--watch", help="show progress"),
        as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Run a suite on the served model and print its metrics."""
    body = _suite_body(suite, file) | {"adapter": adapter or ""}
    if seed is not None:
        body["seed"] = seed
    with _client() as c:
        job = _submit(c, "eval.submit", body)
        if not as_json:
            note(f"{job['id']} queued ({job['total']} completions)")
        _finish(_wait(c, job["id"], watch and not as_json), as_json)


@eval_app.command("compare")
def compare(suite: Optional[str] = typer.Option(None, "--suite", "-s", help="registered suite name"),
            file: Optional[Path] = typer.Option(None, "--file", "-f", help="suite file"),
            adapter: list[str] = typer.Option(..., "--adapter", "-a", help="an arm: adapter name, \"\" for the base "
                                                                           "model; give two or more"),
            seed: Optional[int] = typer.Option(None, "--seed", help="overrides the suite's generation seed"),
            watch: bool = typer.Option(False, "--watch", help="show progress"),
            as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Run the same suite, with the same seeds, for each arm; report per-arm metrics, flips
    against the first arm and an exact sign test."""
    if len(adapter) < 2:
        fail("compare needs two or more --adapter arms (\"\" is the base model)", 2)
    body = _suite_body(suite, file) | {"adapters": adapter}
    if seed is not None:
        body["seed"] = seed
    with _client() as c:
        job = _submit(c, "eval.submit", body)
        _finish(_wait(c, job["id"], watch and not as_json), as_json)


@eval_app.command("replay")
def replay(job: str = typer.Argument(..., help="a completed eval job"),
           as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Re-run a job with its recorded suite, model, adapters and generation config. Exit 0 only
    if every completion is byte-identical (matched); mismatch names the examples and the first
    differing byte; error means an identity (model, adapter, suite) changed."""
    with _client() as c:
        j = _submit(c, "eval.submit", {"replay_of": job})
        j = _wait(c, j["id"], False)
    if as_json:
        typer.echo(json.dumps({k: j.get(k) for k in ("id", "state", "error", "verdict", "verdict_detail")}))
    elif j["state"] != "completed":
        typer.echo(f"{j['id']} {j['state']}: {j.get('error')}")
    elif j["verdict"] == "matched":
        typer.echo(f"matched: every completion of {job} is byte-identical ({j['id']})")
    elif j["verdict"] == "mismatch":
        typer.echo(f"mismatch: {len(j['verdict_detail'])} completion(s) differ ({j['id']})")
        for d in j["verdict_detail"][:20]:
            typer.echo(f"  {d['arm'] or 'base'} {d['id']}: first difference at byte {d['first_difference_byte']}")
    else:
        typer.echo(f"error: cannot replay {job} ({j['id']}): " + "; ".join(j["verdict_detail"]))
    if j.get("verdict") != "matched":
        raise typer.Exit(1)


@eval_app.command("status")
def status(job: Optional[str] = typer.Argument(None, help="a job id (default: every job)"),
           as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Evaluation jobs, or one job's metrics."""
    with _client() as c:
        if job:
            j = _cmd(c, "eval.job", {"id": job})
            if as_json:
                typer.echo(json.dumps(j))
                return
            typer.echo(f"{j['id']} {j['spec']['mode']} {j['state']} {j.get('done')}/{j.get('total')}"
                       + (f" verdict {j['verdict']}" if j.get("verdict") else "")
                       + (f": {j['error']}" if j.get("error") else ""))
            _show_metrics(j)
            return
        jobs = _cmd(c, "eval.jobs")["jobs"]
    if as_json:
        typer.echo(json.dumps(jobs))
        return
    if not jobs:
        typer.echo("no evaluation jobs (`kiln eval run --suite NAME` starts one)")
    for j in jobs:
        acc = ", ".join(f"{a} {m['accuracy']:.3f}" for a, m in (j.get("metrics") or {}).items())
        typer.echo(f"{j['id']:<11}{j['spec']['mode']:<9}{j['state']:<11}{str(j.get('done')) + '/' + str(j.get('total')):>9}"
                   f"  {j['spec']['suite']:<20}{acc}" + (f"  {j['verdict']}" if j.get("verdict") else ""))
