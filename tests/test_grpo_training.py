"""GRPO training in-process on a tiny model (fast tier): the adapter raises the likelihood of
high-reward completions over low-reward ones on held-out prompts of the same kind; a run
stopped midway resumes to a bit-identical adapter; the data file is validated with line
numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import DATA
from kiln.native.chat_template import template_for
from kiln.native.model import load_model
from kiln.native.training.lora_grad import loss_and_grads
from kiln.native.training.sft_data import DataError, load_grpo_file
from kiln.native.training.sft_trainer import GRPORun, TrainSpec

NAMES = ["Ada", "Bob", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kim", "Lu", "Max", "Ned", "Oz", "Pam"]


def group(name: str) -> dict:
    return {"prompt": [{"role": "user", "content": f"Greet {name}."}],
            "completions": [{"text": f"Hello {name}!", "reward": 1.0}, {"text": f"Go away {name}.", "reward": 0.0},
                            {"text": f"Hi {name}!", "reward": 0.8}]}


@pytest.fixture(scope="module")
def tiny():
    m = load_model(DATA / "tiny" / "tiny-llama.gguf")
    return m, template_for(m)


def write(tmp_path, groups, name="groups.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(g) for g in groups) + "\n")
    return p


def margin(run, examples_high, examples_low) -> float:
    """Mean log-likelihood of the high-reward completions minus the low-reward ones."""
    lmap = {n: run.adapter.tensors[n] for n in run.names}

    def ll(ex):
        got = {}

        def keep(lp):
            got["s"] = float(lp.sum())
            return np.zeros_like(lp), 0.0
        loss_and_grads(run.base, lmap, run.adapter.scale, ex.tokens, ex.targets, {}, keep)
        return got["s"]
    return float(np.mean([ll(h) for h in examples_high]) - np.mean([ll(lo) for lo in examples_low]))


def test_grpo_prefers_high_reward_completions_on_held_out_prompts(tiny, tmp_path):
    m, tpl = tiny
    train = load_grpo_file(write(tmp_path, [group(n) for n in NAMES[:12]]), tpl, m.tokenizer, 256)
    held = load_grpo_file(write(tmp_path, [group(n) for n in NAMES[12:]], "held.jsonl"), tpl, m.tokenizer, 256)
    spec = TrainSpec(epochs=3, lr=5e-3, rank=4, alpha=8, seed=1, beta=0.01, checkpoint_interval=1000)
    (tmp_path / "job").mkdir()
    run = GRPORun(m, train, spec, tmp_path / "job")
    high = [g.completions[0] for g in held]
    low = [g.completions[1] for g in held]
    before = margin(run, high, low)
    seen = []
    assert run.run(on_step=seen.append) == "completed"
    after = margin(run, high, low)
    assert after > before + 0.5, (before, after)
    assert all("reward" in p.extra and "kl" in p.extra for p in seen)
    assert seen[-1].extra["kl"] > 0                        # it moved away from the base, and says how far
    history = [json.loads(ln) for ln in (tmp_path / "job" / "losses.jsonl").read_text().splitlines()]
    assert len(history) == run.total_steps and "reward" in history[0]


def test_a_stopped_grpo_run_resumes_to_a_bit_identical_adapter(tiny, tmp_path):
    m, tpl = tiny
    groups = load_grpo_file(write(tmp_path, [group(n) for n in NAMES[:6]]), tpl, m.tokenizer, 256)
    spec = TrainSpec(epochs=2, lr=5e-3, rank=4, alpha=8, seed=3, checkpoint_interval=2, grad_accum=2)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = GRPORun(m, groups, spec, tmp_path / "a")
    assert whole.run() == "completed"
    calls = {"n": 0}

    def stop_later():
        calls["n"] += 1
        return calls["n"] > 9                            # mid-step, after a checkpoint or two
    part = GRPORun(m, groups, spec, tmp_path / "b")
    assert part.run(stop_later) == "stopped"
    resumed = GRPORun(m, groups, spec, tmp_path / "b")
    assert 0 < resumed.step < resumed.total_steps
    assert resumed.run() == "completed"
    for n in whole.names:
        for x, y in zip(whole.adapter.tensors[n], resumed.adapter.tensors[n]):
            assert np.array_equal(x, y), n


def test_bad_groups_are_reported_by_line(tiny, tmp_path):
    m, tpl = tiny
    lines = [group("Ada"), {"prompt": [{"role": "user", "content": "x"}], "completions": [{"text": "a", "reward": 1}]},
             {"prompt": [{"role": "user", "content": "x"}], "completions": [{"text": "a", "reward": "high"},
                                                                           {"text": "b", "reward": 0}]},
             {"completions": []}]
    with pytest.raises(DataError) as e:
        load_grpo_file(write(tmp_path, lines), tpl, m.tokenizer, 256)
    msg = str(e.value)
    assert "line 2: completions: at least two" in msg and "line 3: completions[0]: reward" in msg
    assert "line 4:" in msg and "line 1" not in msg


def test_a_grpo_run_killed_mid_run_resumes_from_its_last_checkpoint_bit_identically(tiny, tmp_path):
    """As kill -9: the run dies between checkpoints (nothing saved at the end); the next run
    resumes from the last interval checkpoint and ends with the same adapter."""
    m, tpl = tiny
    groups = load_grpo_file(write(tmp_path, [group(n) for n in NAMES[:6]]), tpl, m.tokenizer, 256)
    spec = TrainSpec(epochs=2, lr=5e-3, rank=4, alpha=8, seed=4, checkpoint_interval=2)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    whole = GRPORun(m, groups, spec, tmp_path / "a")
    whole.run()

    class Killed(Exception):
        pass
    calls = {"n": 0}

    def die():
        calls["n"] += 1
        if calls["n"] > 16:                  # in step 6 (3 completions a step): after the step-4 checkpoint
            raise Killed()
        return False
    with pytest.raises(Killed):
        GRPORun(m, groups, spec, tmp_path / "b").run(die)
    resumed = GRPORun(m, groups, spec, tmp_path / "b")
    assert resumed.step == 4
    resumed.run()
    for n in whole.names:
        for x, y in zip(whole.adapter.tensors[n], resumed.adapter.tensors[n]):
            assert np.array_equal(x, y), n


def test_progress_counts_epochs_from_one(tiny, tmp_path):
    """Each step says the epoch it belongs to, from 1 to `epochs` (issue 42: they counted from 0)."""
    m, tpl = tiny
    groups = load_grpo_file(write(tmp_path, [group(n) for n in NAMES[:4]]), tpl, m.tokenizer, 256)
    spec = TrainSpec(epochs=2, lr=1e-3, rank=2, alpha=4, seed=1, checkpoint_interval=1000, grad_accum=2)
    (tmp_path / "job").mkdir()
    seen = []
    assert GRPORun(m, groups, spec, tmp_path / "job").run(on_step=seen.append) == "completed"
    assert [p.epoch for p in seen] == [1, 1, 2, 2]
    history = [json.loads(ln)["epoch"] for ln in (tmp_path / "job" / "losses.jsonl").read_text().splitlines()]
    assert history == [1, 1, 2, 2]


def test_an_episode_of_several_steps_learns_every_action_and_nothing_it_saw(tiny, tmp_path):
    """A completion given as `messages` (an agent's actions and the observations between them):
    its targets are the tokens of both actions — exactly those `text` completions of each action
    would learn at their places — never the observation's, never the prompt's own assistant turn."""
    m, tpl = tiny
    prompt = [{"role": "user", "content": "Play."}, {"role": "assistant", "content": "Ready."},
              {"role": "user", "content": "Go."}]
    turns = [{"role": "assistant", "content": "left"}, {"role": "user", "content": "a wall"},
             {"role": "assistant", "content": "right"}]
    line = {"prompt": prompt, "completions": [{"messages": turns, "reward": 1.0}, {"text": "up", "reward": 0.0}]}
    g = load_grpo_file(write(tmp_path, [line]), tpl, m.tokenizer, 256)[0]
    multi, single = g.completions
    def learned(ex):
        return m.tokenizer.decode([ex.tokens[j] for j in ex.targets])
    assert "left" in learned(multi) and "right" in learned(multi)
    assert "wall" not in learned(multi) and "Ready" not in learned(multi) and "Ready" not in learned(single)
    first = load_grpo_file(write(tmp_path, [{"prompt": prompt, "completions": [{"text": "left", "reward": 1},
                                                                              {"text": "up", "reward": 0}]}],
                                 "first.jsonl"), tpl, m.tokenizer, 256)[0].completions[0]
    assert multi.tokens[:len(first.tokens)] == first.tokens
    assert [j for j in multi.targets if j < len(first.tokens)] == first.targets


@pytest.mark.parametrize("completion, said", [
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], "reward": 1},
     "alternate assistant, user"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}], "reward": 1},
     "the last turn is the assistant's"),
    ({"messages": [], "reward": 1}, "messages is empty"),
    ({"text": "a", "messages": [{"role": "assistant", "content": "a"}], "reward": 1}, "give text (the answer) or messages"),
    ({"messages": [{"role": "assistant", "content": "a", "name": "x"}], "reward": 1}, "role and content only"),
])
def test_a_bad_multi_turn_completion_is_named(tiny, tmp_path, completion, said):
    m, tpl = tiny
    line = {"prompt": [{"role": "user", "content": "x"}], "completions": [completion, {"text": "b", "reward": 0}]}
    with pytest.raises(DataError) as e:
        load_grpo_file(write(tmp_path, [line]), tpl, m.tokenizer, 256)
    assert "line 1: completions[0]" in str(e.value) and said in str(e.value), str(e.value)
