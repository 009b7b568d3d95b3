"""Rollouts of a model in an OpenEnv environment, and the offline check of what they recorded.

`rollout` plays `groups` × `group_size` episodes: every candidate of a group resets with the
group's seed, so a group's candidates face the same start and differ only by the model's
samples. Each turn the model sees the environment's description, the action schema and the
observations so far, and answers one action as JSON constrained to the action schema (`act`
runs it — the daemon's generate op with the schema as its grammar). An episode ends when the
environment says done or after `max_steps`; its return is the sum of its rewards.

A run folder holds discovery.json (the three discovery documents and their hashes),
transcript.jsonl (one episode a line, appended as each ends: an error later loses none of
them), dataset.jsonl (one GRPO group a line: the first turn's prompt, each candidate's first
action and its episode's return — `kiln train grpo`'s format) and summary.json (the settings,
each episode's rewards and return, and the sha256 of every file and of the reward arithmetic).
`verify` re-checks all of it offline and names the field that does not hold.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Callable

from .openenv_env import Environment, EnvError, canonical, sha256_of

FILES = ("discovery.json", "transcript.jsonl", "dataset.jsonl")


class VerifyError(ValueError):
    """A run folder that does not hold what its summary says (the message names the field)."""


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def instructions(discovery: dict) -> str:
    meta = discovery["documents"]["metadata"]
    name, about = str(meta.get("name") or "the environment")[:80], str(meta.get("description") or "")[:500]
    schema = json.dumps(discovery["documents"]["schema"]["action"], sort_keys=True)
    return (f"You act in the environment {name}. {about}\nEach turn you get an observation as JSON. Reply with "
            f"exactly one action: a JSON object matching this schema:\n{schema}")


def episode_return(steps: list[dict]) -> float:
    return float(sum(s["reward"] or 0.0 for s in steps))


def rollout(env: Environment, out: Path, act: Callable[[list, dict, int], str], groups: int, group_size: int,
            seed: int = 0, max_steps: int = 8, settings: dict | None = None,
            progress: Callable[[str], None] = lambda s: None) -> dict:
    """Play the episodes into the new folder `out`; return the summary (also written). An
    EnvError mid-run is recorded in the summary ("error") and raised after it is written."""
    out.mkdir(parents=True, exist_ok=False)
    discovery = env.discover()
    (out / "discovery.json").write_bytes(canonical(discovery) + b"\n")
    schema = discovery["documents"]["schema"]["action"]
    system = instructions(discovery)
    episodes, rows, error = [], [], None
    with open(out / "transcript.jsonl", "wb") as transcript:
        try:
            for g in range(groups):
                group_seed = seed + g
                group = []
                for k in range(group_size):
                    with env.session() as s:
                        first = s.reset(group_seed)
                        messages = [{"role": "system", "content": system},
                                    {"role": "user", "content": json.dumps(first["observation"], sort_keys=True)}]
                        prompt, steps, done = list(messages), [], first["done"]
                        while not done and len(steps) < max_steps:
                            n = len(steps)
                            text = act(messages, schema, _seed(seed, g, k, n))
                            try:
                                action = json.loads(text)
                            except ValueError:      # cut short by max_tokens: the policy's fault, return 0
                                steps.append({"action_text": text, "action": None, "observation": None,
                                              "reward": 0.0, "done": True, "invalid": True})
                                done = True
                                break
                            got = s.step(action, n)
                            steps.append({"action_text": text, "action": action, **got})
                            done = got["done"]
                            messages += [{"role": "assistant", "content": text},
                                         {"role": "user", "content": json.dumps(got["observation"], sort_keys=True)}]
                    ep = {"group": g, "candidate": k, "seed": group_seed, "reset": first["observation"],
                          "steps": steps, "return": episode_return(steps), "end": "invalid_action" if steps and steps[-1].get("invalid") else "done" if done else "max_steps"}
                    transcript.write(canonical(ep) + b"\n")
                    transcript.flush()
                    episodes.append(ep)
                    group.append((prompt, ep))
                    progress(f"group {g + 1}/{groups} candidate {k + 1}/{group_size}: return {ep['return']:g} "
                             f"in {len(steps)} step{'s' if len(steps) != 1 else ''}")
                if all(ep["steps"] for _, ep in group):
                    rows.append({"prompt": group[0][0],
                                 "completions": [{"text": ep["steps"][0]["action_text"], "reward": ep["return"]}
                                                 for _, ep in group]})
        except EnvError as e:
            error = str(e)
    (out / "dataset.jsonl").write_bytes(b"".join(canonical(r) + b"\n" for r in rows))
    rewards = [[ep["group"], ep["candidate"], [s["reward"] for s in ep["steps"]], ep["return"]] for ep in episodes]
    by_group: dict[int, list[float]] = {}
    for ep in episodes:
        by_group.setdefault(ep["group"], []).append(ep["return"])
    summary = {"format": "kiln-openenv-rollout/1", "env": env.url, "groups": groups, "group_size": group_size,
               "seed": seed, "max_steps": max_steps, "settings": settings or {}, "episodes": len(episodes),
               "complete": error is None, "error": error, "rewards": rewards,
               "mean_return": (sum(r[3] for r in rewards) / len(rewards)) if rewards else None,
               "group_returns": {str(g): v for g, v in by_group.items()},
               "sha256": {**{f: _sha(out / f) for f in FILES}, "discovery_documents": discovery["sha256"],
                          "reward_arithmetic": sha256_of(rewards)}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if error:
        raise EnvError(f"{error} (the {len(episodes)} episodes before it are kept in {out})")
    return summary


def _seed(seed: int, g: int, k: int, n: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{g}/{k}/{n}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def verify(folder: Path) -> dict:
    """The summary, once every file's hash, every episode's return and every group's rewards in
    the dataset agree with it; VerifyError naming the first field that does not."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError) as e:
        raise VerifyError(f"{folder}/summary.json: cannot be read ({e})") from None
    for f in FILES:
        try:
            got = _sha(folder / f)
        except OSError:
            raise VerifyError(f"{folder}/{f}: missing") from None
        if got != summary["sha256"].get(f):
            raise VerifyError(f"sha256.{f}: the summary says {str(summary['sha256'].get(f))[:16]}…, the file's is "
                              f"{got[:16]}… (changed since the rollout)")
    discovery = json.loads((folder / "discovery.json").read_text())
    for name, doc in discovery["documents"].items():
        if sha256_of(doc) != summary["sha256"]["discovery_documents"].get(name):
            raise VerifyError(f"sha256.discovery_documents.{name}: the document does not hash to it")
    episodes = [json.loads(ln) for ln in (folder / "transcript.jsonl").read_text().splitlines() if ln.strip()]
    rewards = []
    for i, ep in enumerate(episodes):
        total = episode_return(ep["steps"])
        if not math.isclose(total, ep["return"], rel_tol=0, abs_tol=1e-9):
            raise VerifyError(f"transcript.jsonl line {i + 1}: return {ep['return']} is not the sum of its rewards "
                              f"({total})")
        rewards.append([ep["group"], ep["candidate"], [s["reward"] for s in ep["steps"]], ep["return"]])
    if rewards != summary["rewards"] or sha256_of(rewards) != summary["sha256"]["reward_arithmetic"]:
        raise VerifyError("sha256.reward_arithmetic: the transcript's rewards are not the summary's")
    returns = {(ep["group"], ep["candidate"]): ep["return"] for ep in episodes}
    groups = sorted({ep["group"] for ep in episodes})
    rows = [json.loads(ln) for ln in (folder / "dataset.jsonl").read_text().splitlines() if ln.strip()]
    complete = [g for g in groups if sum(1 for ep in episodes if ep["group"] == g) == summary["group_size"]]
    for line, (row, g) in enumerate(zip(rows, complete), 1):
        for k, c in enumerate(row["completions"]):
            if c["reward"] != returns.get((g, k)):
                raise VerifyError(f"dataset.jsonl line {line} completions[{k}].reward: {c['reward']} is not episode "
                                  f"({g}, {k})'s return {returns.get((g, k))}")
    return summary


def replay(env: Environment, folder: Path, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Play every recorded episode again, live, with its recorded actions (no model): the same
    discovery documents, and every reset observation, step observation, reward and done as
    recorded; VerifyError naming the first that differs. The folder is verified first."""
    summary = verify(folder)
    live = env.discover()
    for name, h in summary["sha256"]["discovery_documents"].items():
        if live["sha256"].get(name) != h:
            raise VerifyError(f"discovery {name}: the server's document is not the one recorded (another "
                              f"environment, or another version of it)")
    episodes = [json.loads(ln) for ln in (folder / "transcript.jsonl").read_text().splitlines() if ln.strip()]
    steps = 0
    for i, ep in enumerate(episodes):
        where = f"transcript.jsonl line {i + 1} (group {ep['group']} candidate {ep['candidate']})"
        with env.session() as s:
            if s.reset(ep["seed"])["observation"] != ep["reset"]:
                raise VerifyError(f"{where}: the reset observation for seed {ep['seed']} differs")
            for n, rec in enumerate(ep["steps"]):
                if rec.get("invalid"):
                    break
                got = s.step(rec["action"], n)
                for field in ("observation", "reward", "done"):
                    if got[field] != rec[field]:
                        raise VerifyError(f"{where} step {n}: {field} {json.dumps(got[field])[:80]} was "
                                          f"{json.dumps(rec[field])[:80]}")
                steps += 1
        progress(f"episode {i + 1}/{len(episodes)} matched")
    return {"episodes": len(episodes), "steps": steps}


def compare_returns(base: dict, tuned: dict) -> dict:
    """Per-seed mean returns of two rollouts over the same seeds (summaries), and the exact sign
    test over the seeds where they differ: the gate an adapter passes before it is loaded."""
    from kiln.native.eval_metrics import sign_test
    seeds = sorted(set(base["group_returns"]) & set(tuned["group_returns"]), key=int)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    rows = [(int(g) + base["seed"], mean(base["group_returns"][g]), mean(tuned["group_returns"][g])) for g in seeds]
    wins, losses = sum(1 for _, b, t in rows if t > b), sum(1 for _, b, t in rows if t < b)
    return {"seeds": [r[0] for r in rows], "base_mean": mean([r[1] for r in rows]) if rows else None,
            "adapter_mean": mean([r[2] for r in rows]) if rows else None, "wins": wins, "losses": losses,
            "ties": len(rows) - wins - losses, "p_value": sign_test(wins, losses),
            "per_seed": [{"seed": s, "base": b, "adapter": t} for s, b, t in rows]}
