"""`kiln openenv …`: reinforcement learning against an OpenEnv environment server — inspect its
discovery documents, roll the running model out in it (groups of episodes from one seed each,
actions constrained to the environment's action schema), verify a rollout offline, replay it live,
compare an adapter with the base model. Training runs are the daemon's: supervisor/cli/openenv_runs.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .engine import fail, verbosity

openenv_app = typer.Typer(help="Reinforcement learning in OpenEnv environments: inspect, rollout, verify, replay, "
                          "eval here; train and start as runs the daemon owns (runs, status, cancel, resume, artifact).",
                          no_args_is_help=True)


def _env(url: str):
    from kiln.protocol.openenv.env import Environment, EnvError
    try:
        return Environment(url)
    except EnvError as e:
        fail(str(e))


@openenv_app.command("inspect")
def inspect(url: str = typer.Argument(..., help="the environment server, e.g. http://127.0.0.1:8000"),
            as_json: bool = typer.Option(False, "--json", help="the documents and their hashes as JSON")):
    """The environment's health, metadata and action/observation/state schemas, each with the
    sha256 of its canonical JSON."""
    from kiln.protocol.openenv.env import EnvError
    try:
        d = _env(url).discover()
    except EnvError as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(d, indent=2, sort_keys=True))
        return
    meta, schema = d["documents"]["metadata"], d["documents"]["schema"]
    typer.echo(f"{meta.get('name', '?')}: {str(meta.get('description') or '')[:200]}")
    typer.echo(f"health: {d['documents']['health'].get('status', '?')}")
    for part in ("action", "observation", "state"):
        props = ", ".join(sorted((schema.get(part) or {}).get("properties", {})))
        typer.echo(f"{part:<12} {props or '-'}")
    for name, h in d["sha256"].items():
        typer.echo(f"sha256 {name:<9}{h}")


def _actor(client, model: Optional[str], temperature: float, max_tokens: int, adapter: Optional[str] = None):
    """act(messages, schema, seed) -> the model's action text, through the daemon ("" as the
    adapter: the base model, whichever adapter is active)."""
    from ..bus.client import CommandFailed
    from kiln.protocol.openenv.env import EnvError

    def act(messages, schema, seed):
        body = {"messages": messages, "grammar": {"json_schema": schema},
                "params": {"temperature": temperature, "max_tokens": max_tokens, "seed": seed},
                **({"model": model} if model else {}), **({"adapter": adapter} if adapter is not None else {})}
        try:
            msgs = list(client.stream("generate", body, timeout=600))
        except CommandFailed as e:
            raise EnvError(f"the model could not act: {e.message}") from None
        except TimeoutError as e:
            raise EnvError(f"the model could not act: {e}") from None
        return "".join(m.body.get("text", "") for m in msgs if isinstance(m.body, dict)).strip()
    return act


def _rollout(url, out, groups, group_size, seed, max_steps, temperature, max_tokens, model, adapter=None):
    from kiln.protocol.openenv.env import EnvError
    from kiln.protocol.openenv.rollout import rollout as run
    from .train import _client
    if out.exists():
        fail(f"{out} exists: a rollout writes a new folder")
    env = _env(url)
    say = (lambda s: typer.echo(s, err=True)) if verbosity() >= 0 else (lambda s: None)
    with _client() as c:
        try:
            return run(env, out, _actor(c, model, temperature, max_tokens, adapter), groups, group_size, seed,
                       max_steps, {"temperature": temperature, "max_tokens": max_tokens, "model": model,
                                   "adapter": adapter}, say)
        except EnvError as e:
            fail(str(e))


ROLLOUT_OPTIONS = dict(
    groups=typer.Option(4, "--groups", min=1, max=10000, help="groups of episodes (one reset seed each)"),
    group_size=typer.Option(4, "--group-size", min=2, max=64, help="episodes per group (GRPO compares them)"),
    seed=typer.Option(0, "--seed", min=0, help="group g resets with seed + g"),
    max_steps=typer.Option(8, "--max-steps", min=1, max=1000, help="steps before an episode is cut"),
    temperature=typer.Option(1.0, "--temperature", min=0.0, max=4.0, help="the model's sampling temperature"),
    max_tokens=typer.Option(256, "--max-tokens", min=1, max=8192, help="longest action, tokens"),
    model=typer.Option(None, "--model", "-m", help="the model that acts (default: the daemon's)"))


@openenv_app.command("rollout")
def rollout(url: str = typer.Argument(..., help="the environment server"),
            out: Path = typer.Option(..., "--out", "-o", help="a new folder for the run"),
            groups: int = ROLLOUT_OPTIONS["groups"], group_size: int = ROLLOUT_OPTIONS["group_size"],
            seed: int = ROLLOUT_OPTIONS["seed"], max_steps: int = ROLLOUT_OPTIONS["max_steps"],
            temperature: float = ROLLOUT_OPTIONS["temperature"], max_tokens: int = ROLLOUT_OPTIONS["max_tokens"],
            model: Optional[str] = ROLLOUT_OPTIONS["model"]):
    """Play groups × group-size episodes with the running model and record them: transcript,
    GRPO dataset and a summary with the hash of every file and of the reward arithmetic."""
    s = _rollout(url, out, groups, group_size, seed, max_steps, temperature, max_tokens, model)
    typer.echo(f"{out}: {_said(s)}")


def _said(s: dict) -> str:
    mean = "-" if s["mean_return"] is None else f"{s['mean_return']:.4g}"
    return f"{s['episodes']} episodes, mean return {mean}"


@openenv_app.command("verify")
def verify(folder: Path = typer.Argument(..., help="a rollout folder")):
    """Re-check a rollout offline: every file's hash, every episode's return, every reward in the
    dataset; names the first field that does not hold."""
    from kiln.protocol.openenv.rollout import VerifyError
    from kiln.protocol.openenv.rollout import verify as check
    try:
        s = check(folder)
    except VerifyError as e:
        fail(f"{folder}: {e}")
    typer.echo(f"{folder}: verified ({_said(s)})" + ("" if s["complete"] else f"; the run ended early: {s['error']}"))


@openenv_app.command("replay")
def replay(folder: Path = typer.Argument(..., help="a rollout folder"),
           url: Optional[str] = typer.Option(None, "--url", help="the environment server (default: the one recorded)")):
    """Re-check a rollout live: play every episode again with its recorded actions and compare the
    discovery documents, every observation, reward and done with what was recorded."""
    from kiln.protocol.openenv.env import EnvError
    from kiln.protocol.openenv.rollout import VerifyError
    from kiln.protocol.openenv.rollout import replay as run
    try:
        recorded = json.loads((folder / "summary.json").read_text())["env"]
    except (OSError, ValueError, KeyError) as e:
        fail(f"{folder}/summary.json: cannot be read ({e})")
    say = (lambda s: typer.echo(s, err=True)) if verbosity() >= 0 else (lambda s: None)
    try:
        r = run(_env(url or recorded), folder, say)
    except (VerifyError, EnvError) as e:
        fail(f"{folder}: {e}")
    typer.echo(f"{folder}: replayed live, {r['episodes']} episodes and {r['steps']} steps as recorded")


def _evaluate(url, out, adapter, seeds, start, episodes, max_steps, temperature, max_tokens, model, as_json=False):
    """The base model and the adapter on the same held-out seeds; per-seed mean returns compared
    with the exact sign test."""
    from kiln.native.eval_metrics import compare_returns
    runs = [_rollout(url, out / name, seeds, episodes, start, max_steps, temperature, max_tokens, model, arm)
            for name, arm in (("eval-base", ""), ("eval-adapter", adapter))]
    c = compare_returns(*runs)
    (out / "evaluation.json").write_text(json.dumps(c, indent=2) + "\n")
    if as_json:
        typer.echo(json.dumps(c))
    else:
        typer.echo(f"held-out seeds {c['seeds'][0]}..{c['seeds'][-1]}: mean return base {c['base_mean']:.4g}, "
                   f"{adapter} {c['adapter_mean']:.4g} ({c['wins']} seeds better, {c['losses']} worse, {c['ties']} "
                   f"tied; sign test p = {c['p_value']:.3g})")
    return c


@openenv_app.command("eval")
def evaluate(url: str = typer.Argument(..., help="the environment server"),
             adapter: str = typer.Option(..., "--adapter", "-a", help="the adapter to compare with the base model"),
             out: Path = typer.Option(..., "--out", "-o", help="a new folder for the two rollouts"),
             seeds: int = typer.Option(8, "--seeds", min=1, max=10000, help="held-out seeds"),
             start: int = typer.Option(1000, "--start", min=0, help="the first held-out seed"),
             episodes: int = typer.Option(2, "--episodes", min=1, max=64, help="episodes per seed and arm"),
             max_steps: int = ROLLOUT_OPTIONS["max_steps"], temperature: float = ROLLOUT_OPTIONS["temperature"],
             max_tokens: int = ROLLOUT_OPTIONS["max_tokens"], model: Optional[str] = ROLLOUT_OPTIONS["model"],
             as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Mean return of the base model and of an adapter on held-out seeds, seed by seed, with the
    exact sign test over the seeds where they differ."""
    out.mkdir(parents=True, exist_ok=False)
    _evaluate(url, out, adapter, seeds, start, episodes, max_steps, temperature, max_tokens, model, as_json)
