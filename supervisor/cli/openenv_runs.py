"""`kiln openenv start | train | runs | status | cancel | resume | artifact`: the OpenEnv runs the
daemon owns. The evaluator worker plays them (workers/openenv_runs.py), so a run outlives the
command that started it, survives the evaluator's restart and can be cancelled and resumed;
`train` starts one and follows it to the end, as `kiln train sft` follows its job."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from kiln.protocol.openenv.rollout import RECORDS, RUN_FOLDERS

from .engine import fail, verbosity
from .openenv import ROLLOUT_OPTIONS, _said, openenv_app
from .train import _client, _cmd, _routed

FINISHED = ("completed", "failed", "cancelled")


def _start(url, groups, group_size, seed, max_steps, temperature, max_tokens, model, adapter=None,
           train: dict | None = None, eval_seeds: int | None = None) -> dict:
    from ..bus.client import CommandFailed
    body = {"env": url, "groups": groups, "group_size": group_size, "seed": seed, "max_steps": max_steps,
            "temperature": temperature, "max_tokens": max_tokens, **({"model": model} if model else {})}
    if adapter:
        body.update(adapter=adapter, train={k: v for k, v in (train or {}).items() if v is not None},
                    eval_seeds=eval_seeds)
    with _client() as c:
        try:
            _cmd(c, "openenv.preflight", {"adapter": adapter})
            return [m for m in c.stream("openenv.start", body, timeout=120)][-1].body
        except CommandFailed as e:
            fail(e.message)


def _line(run: dict) -> str:
    mean = "-" if run.get("mean_return") is None else f"{run['mean_return']:.4g}"
    return (f"{run['id']} {run['state']} · {run.get('phase')} · {run.get('done', 0)}/{run.get('total', '?')} episodes"
            f" · mean return {mean} · {run['spec']['env']}")


def _follow(run_id: str) -> dict:
    """Say each change of phase or count until the run ends; the run as it ended."""
    said = None
    with _client() as c:
        while True:
            run = _cmd(c, "openenv.run", {"id": run_id})
            now = (run["state"], run.get("phase"), run.get("done"))
            if now != said and verbosity() >= 0:
                typer.echo(_line(run), err=True)
                said = now
            if run["state"] in FINISHED:
                return run
            time.sleep(0.5)


@openenv_app.command("start")
def start(url: str = typer.Argument(..., help="the environment server"),
          groups: int = ROLLOUT_OPTIONS["groups"], group_size: int = ROLLOUT_OPTIONS["group_size"],
          seed: int = ROLLOUT_OPTIONS["seed"], max_steps: int = ROLLOUT_OPTIONS["max_steps"],
          temperature: float = ROLLOUT_OPTIONS["temperature"], max_tokens: int = ROLLOUT_OPTIONS["max_tokens"],
          model: Optional[str] = ROLLOUT_OPTIONS["model"],
          follow: bool = typer.Option(False, "--follow", help="follow the run until it ends")):
    """Start a rollout the daemon owns (the evaluator plays it): its id at once; `status`,
    `cancel`, `resume` and `artifact` take it. `train` starts one that also trains an adapter."""
    run = _start(url, groups, group_size, seed, max_steps, temperature, max_tokens, model)
    typer.echo(run["id"])
    if follow:
        run = _follow(run["id"])
        raise typer.Exit(0 if run["state"] == "completed" else 1)


@openenv_app.command("train")
def train(url: str = typer.Argument(..., help="the environment server"),
          adapter: str = typer.Option(..., "--adapter", "-a", help="name of the adapter to make"),
          out: Optional[Path] = typer.Option(None, "--out", "-o", help="a new folder to copy the run's records to "
                                             "when it ends (they stay in the daemon's run folder too)"),
          groups: int = ROLLOUT_OPTIONS["groups"], group_size: int = ROLLOUT_OPTIONS["group_size"],
          seed: int = ROLLOUT_OPTIONS["seed"], max_steps: int = ROLLOUT_OPTIONS["max_steps"],
          temperature: float = ROLLOUT_OPTIONS["temperature"], max_tokens: int = ROLLOUT_OPTIONS["max_tokens"],
          model: Optional[str] = ROLLOUT_OPTIONS["model"],
          lr: Optional[float] = typer.Option(None, "--lr", help="peak learning rate (default 2e-4)"),
          rank: Optional[int] = typer.Option(None, "--rank", help="LoRA rank (default 16)"),
          beta: Optional[float] = typer.Option(None, "--beta", help="KL penalty to the base model (default 0.04)"),
          epochs: Optional[int] = typer.Option(None, "--epochs", help="passes over the groups (default 1)"),
          eval_seeds: int = typer.Option(4, "--eval-seeds", min=0, max=10000, help="held-out seeds after the "
                                         "training ones, on which the adapter and the base model are compared "
                                         "(0: no evaluation)"),
          load: bool = typer.Option(False, "--load", help="make the adapter active if it beats the base model on "
                                    "the held-out seeds (sign test p <= 0.05)")):
    """Roll out, then train a LoRA with GRPO on the groups' returns (every action of each candidate
    with its episode's return), then compare the adapter with the base model on held-out seeds;
    --load makes it active only when it is better. A run the daemon owns, followed here: Ctrl-C
    leaves it running (`kiln openenv status ID`). The training settings and the adapter name are
    checked before the environment is touched."""
    if out is not None and out.exists():
        fail(f"{out} exists: the run's records are copied to a new folder")
    run = _start(url, groups, group_size, seed, max_steps, temperature, max_tokens, model, adapter,
                 {"lr": lr, "rank": rank, "beta": beta, "epochs": epochs}, eval_seeds)
    typer.echo(f"{run['id']}: rolling out {groups} × {group_size} episodes, then training {adapter}")
    run = _follow(run["id"])
    if out is not None:
        _copy_out(run, out)
    if run.get("train_state") == "completed":
        typer.echo(f"adapter {adapter} is ready")
    if run["state"] != "completed":
        fail(f"run {run['id']} {run['state']}: {run.get('error') or ''}".rstrip(": "))
    if run.get("summary"):
        typer.echo(f"rollout: {_said(run['summary'])}")
    c = run.get("evaluation_detail")
    if c:
        typer.echo(f"held-out seeds {c['seeds'][0]}..{c['seeds'][-1]}: mean return base {c['base_mean']:.4g}, "
                   f"{adapter} {c['adapter_mean']:.4g} ({c['wins']} seeds better, {c['losses']} worse, {c['ties']} "
                   f"tied; sign test p = {c['p_value']:.3g})")
        if load and c["better"]:
            with _client() as cl:
                _cmd(cl, "adapters.load", {"name": adapter})
            typer.echo(f"adapter {adapter} is active (it beat the base model on the held-out seeds)")
        elif load:
            typer.echo(f"adapter {adapter} was not loaded: it did not beat the base model on the held-out seeds "
                       f"(p = {c['p_value']:.3g}); `kiln adapters load {adapter}` loads it anyway")


def _copy_out(run: dict, out: Path) -> None:
    """The run's folders as `kiln openenv rollout --out` lays them out: the rollout's files at the
    top, eval-base/ and eval-adapter/ beside them, evaluation.json."""
    with _client() as c:
        for folder in RUN_FOLDERS:
            dest = out if folder == "rollout" else out / folder
            for name in RECORDS:
                try:
                    where = c.command("openenv.artifact", {"id": run["id"], "name": name, "folder": folder}, 30)
                except Exception:  # noqa: BLE001 - a folder the run did not reach
                    continue
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(where["path"], dest / name)
        try:
            where = c.command("openenv.artifact", {"id": run["id"], "name": "evaluation.json"}, 30)
            shutil.copyfile(where["path"], out / "evaluation.json")
        except Exception:  # noqa: BLE001 - no evaluation (eval_seeds 0, or the run ended before it)
            pass


@openenv_app.command("runs")
def runs(as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """The OpenEnv runs the daemon owns, oldest first."""
    with _client() as c:
        got = _cmd(c, "openenv.runs")["runs"]
    if as_json:
        typer.echo(json.dumps(got))
        return
    for run in got:
        typer.echo(_line(run))
    if not got:
        typer.echo("no OpenEnv runs (kiln openenv start URL, kiln openenv train URL --adapter NAME)")


@openenv_app.command("status")
def status(run_id: str = typer.Argument(..., help="a run's id (kiln openenv runs)"),
           follow: bool = typer.Option(False, "--follow", help="follow the run until it ends"),
           as_json: bool = typer.Option(False, "--json", help="the run, its summary and evaluation as JSON")):
    """One run: state, phase, episodes, mean return, its training job and held-out evaluation."""
    if follow:
        _follow(run_id)
    with _client() as c:
        run = _cmd(c, "openenv.run", {"id": run_id})
    if as_json:
        typer.echo(json.dumps(run))
        return
    typer.echo(_line(run))
    for key in ("error", "note", "train_job", "train_state"):
        if run.get(key):
            typer.echo(f"{key.replace('_', ' ')}: {run[key]}")
    if run.get("evaluation"):
        e = run["evaluation"]
        typer.echo(f"held-out: base {e['base_mean']:.4g}, adapter {e['adapter_mean']:.4g}, p = {e['p_value']:.3g}"
                   f" ({'better' if e['better'] else 'not better'})")


@openenv_app.command("cancel")
def cancel(run_id: str = typer.Argument(..., help="a run's id")):
    """Stop a run after its current episode (and its training job, if it is training); what
    was recorded is kept and `resume` goes on from it."""
    with _client() as c:
        run = _routed(c, "openenv.cancel", {"id": run_id})
    typer.echo(f"{run['id']}: cancel requested")


@openenv_app.command("resume")
def resume(run_id: str = typer.Argument(..., help="a cancelled or failed run's id"),
           follow: bool = typer.Option(False, "--follow", help="follow the run until it ends")):
    """Go on with a cancelled or failed run from its last whole episode, against the same
    environment (its discovery documents must hash as recorded)."""
    with _client() as c:
        run = _routed(c, "openenv.resume", {"id": run_id})
    typer.echo(f"{run['id']}: queued again from episode {run.get('done', 0) + 1}")
    if follow:
        run = _follow(run_id)
        raise typer.Exit(0 if run["state"] == "completed" else 1)


@openenv_app.command("artifact")
def artifact(run_id: str = typer.Argument(..., help="a run's id"),
             name: str = typer.Argument(..., help="summary.json, transcript.jsonl, dataset.jsonl, discovery.json "
                                                  "or evaluation.json"),
             folder: str = typer.Option("rollout", "--folder", help="rollout, eval-base or eval-adapter"),
             out: Optional[Path] = typer.Option(None, "--out", "-o", help="write it here (default: standard output)")):
    """One of a run's records, as written (`kiln openenv verify` checks a folder of them)."""
    with _client() as c:
        where = _cmd(c, "openenv.artifact", {"id": run_id, "name": name, "folder": folder})
    if out is not None:
        shutil.copyfile(where["path"], out)
        return
    with open(where["path"], "rb") as f:
        shutil.copyfileobj(f, sys.stdout.buffer)
