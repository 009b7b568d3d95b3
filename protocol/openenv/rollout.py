"""Rollouts of a model in an OpenEnv environment, and the offline check of what they recorded.

`rollout` plays `groups` × `group_size` episodes: every candidate of a group resets with the
group's seed, so a group's candidates face the same start and differ only by the model's
samples. Each turn the model sees the environment's description, the action schema and the
observations so far, and answers one action as JSON constrained to the action schema (`act`
runs it — the daemon's generate op with the schema as its grammar). An episode ends when the
environment says done or after `max_steps`; its return is the sum of its rewards.

A run folder holds discovery.json (the three discovery documents and their hashes),
transcript.jsonl (one episode a line, appended as each ends: an error later loses none of
them), dataset.jsonl (one GRPO group a line: the first turn's prompt, each candidate's actions
and its episode's return — `kiln train grpo`'s format) and summary.json (the settings,
each episode's rewards and return, and the sha256 of every file and of the reward arithmetic).
`verify` re-checks all of it offline and names the field that does not hold.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Callable

from .env import Environment, EnvError, canonical, sha256_of

FILES = ("discovery.json", "transcript.jsonl", "dataset.jsonl")
RECORDS = ("summary.json", *FILES)                         # what a rollout folder holds
RUN_FOLDERS = ("rollout", "eval-base", "eval-adapter")    # a daemon-owned run's rollout folders


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
            progress: Callable[[str], None] = lambda s: None, resume: bool = False,
            stop: Callable[[], str | None] = lambda: None) -> dict:
    """Play the episodes into the new folder `out`; return the summary (also written). An
    EnvError mid-run is recorded in the summary ("error") and raised after it is written.

    `resume`: `out` holds an interrupted run of these settings — its whole episodes are kept (a
    line cut by a crash is dropped) and the run goes on from the next one, against the same
    environment (every discovery document must hash as recorded). Episode seeds depend only on
    (seed, group, candidate, step), so a resumed run records what an uninterrupted one would.
    `stop()`: checked before each episode; a reason ends the run there (summary "error")."""
    if resume:
        discovery, episodes = _resume_state(env, out, group_size)
    else:
        out.mkdir(parents=True, exist_ok=False)
        discovery, episodes = env.discover(), []
        (out / "discovery.json").write_bytes(canonical(discovery) + b"\n")
    schema = discovery["documents"]["schema"]["action"]
    system = instructions(discovery)
    error, stopped = None, False
    with open(out / "transcript.jsonl", "ab") as transcript:
        try:
            for i in range(len(episodes), groups * group_size):
                error = stop()
                if error:
                    stopped = True
                    break
                g, k = divmod(i, group_size)
                ep = _episode(env, act, system, schema, seed, g, k, max_steps)
                transcript.write(canonical(ep) + b"\n")
                transcript.flush()
                episodes.append(ep)
                n = len(ep["steps"])
                progress(f"group {g + 1}/{groups} candidate {k + 1}/{group_size}: return {ep['return']:g} "
                         f"in {n} step{'s' if n != 1 else ''}")
        except EnvError as e:
            error = str(e)
    rows = _dataset_rows(episodes, group_size, system)
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
    if error and not stopped:
        raise EnvError(f"{error} (the {len(episodes)} episodes before it are kept in {out})")
    return summary


def _episode(env: Environment, act, system: str, schema: dict, seed: int, g: int, k: int, max_steps: int) -> dict:
    """Candidate k of group g: a reset with the group's seed, then the model's actions until the
    environment says done or max_steps."""
    with env.session() as s:
        first = s.reset(seed + g)
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": json.dumps(first["observation"], sort_keys=True)}]
        steps, done = [], first["done"]
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
    end = "invalid_action" if steps and steps[-1].get("invalid") else "done" if done else "max_steps"
    return {"group": g, "candidate": k, "seed": seed + g, "reset": first["observation"], "steps": steps,
            "return": episode_return(steps), "end": end}


def _dataset_rows(episodes: list[dict], group_size: int, system: str) -> list[dict]:
    """One GRPO group a line for every whole group whose candidates all acted: the first turn's
    prompt and each candidate's episode with its return — its one action as `text`, or, for an
    episode of several steps, every action and the observations between them as `messages`, so
    that each action is learned with the episode's advantage (not the first alone)."""
    rows = []
    for start in range(0, len(episodes) - group_size + 1, group_size):
        group = episodes[start:start + group_size]
        if all(ep["steps"] for ep in group):
            prompt = [{"role": "system", "content": system},
                      {"role": "user", "content": json.dumps(group[0]["reset"], sort_keys=True)}]
            rows.append({"prompt": prompt, "completions": [{**_turns(ep), "reward": ep["return"]} for ep in group]})
    return rows


def _turns(ep: dict) -> dict:
    steps = ep["steps"]
    if len(steps) == 1:
        return {"text": steps[0]["action_text"]}
    turns = [{"role": "assistant", "content": steps[0]["action_text"]}]
    for before, step in zip(steps, steps[1:]):        # the observation the model saw, then its next action
        turns += [{"role": "user", "content": json.dumps(before["observation"], sort_keys=True)},
                  {"role": "assistant", "content": step["action_text"]}]
    return {"messages": turns}


def _resume_state(env: Environment, out: Path, group_size: int) -> tuple[dict, list[dict]]:
    """The live discovery (its documents must hash as recorded) and the whole episodes of an
    interrupted run, in order; the transcript is cut back to them. The live documents, not the
    recorded ones: discovery.json is canonical (keys sorted), and the order of the action
    schema's properties is the order the grammar makes the model write them — a resumed run
    reading the sorted copy acted differently from an uninterrupted one."""
    try:
        recorded = json.loads((out / "discovery.json").read_text())
    except (OSError, ValueError) as e:
        raise EnvError(f"{out}: nothing to resume (discovery.json: {e})") from None
    discovery = env.discover()
    for name, h in recorded["sha256"].items():
        if discovery["sha256"].get(name) != h:
            raise EnvError(f"discovery {name}: the server's document is not the one the run began with (another "
                           f"environment, or another version of it): start a new run")
    episodes, kept = [], 0
    try:
        raw = (out / "transcript.jsonl").read_bytes()
    except OSError:
        raw = b""
    for line in raw.split(b"\n")[:-1]:    # whole lines only: a crash may cut the last one anywhere
        try:
            ep = json.loads(line)
        except ValueError:
            break
        if not isinstance(ep, dict) or (ep.get("group"), ep.get("candidate")) != divmod(len(episodes), group_size):
            break
        episodes.append(ep)
        kept += len(line) + 1
    with open(out / "transcript.jsonl", "ab") as f:
        f.truncate(kept)
    return discovery, episodes


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
    size = summary["group_size"]
    complete = [g for g in groups if len(eps := [ep for ep in episodes if ep["group"] == g]) == size
                and all(ep["steps"] for ep in eps)]
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
