"""One LoRA SFT job from start (or checkpoint) to adapter, with exact resume.

The order of everything random is fixed by the seed: one numpy Generator draws the LoRA init,
then one permutation of the examples per epoch. A checkpoint holds the LoRA factors, AdamW's
moments and step, the Generator's state, the current epoch's order and the position in it —
always as of an optimizer-step boundary — so a resumed job repeats exactly the arithmetic of
an uninterrupted one and ends with a bit-identical adapter (same machine, same thread count).

Checkpoints are written every `checkpoint_interval` steps and when the job is asked to stop;
stopping mid-step drops the partial gradient and redoes that step after the resume.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..lora import TARGETS, Adapter, LoraConfig, init_adapter, save_adapter
from .lora_grad import FrozenBase, loss_and_grads
from .optim import SCHEDULES, AdamW, learning_rate
from .sft_data import Example


@dataclass
class TrainSpec:
    epochs: int = 1
    lr: float = 2e-4
    rank: int = 16
    alpha: float = 32.0
    targets: tuple = TARGETS
    max_seq_len: int = 512
    checkpoint_interval: int = 50
    seed: int = 0
    grad_accum: int = 1
    warmup: int = 0
    schedule: str = "cosine"
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    beta: float = 0.04             # GRPO: weight of the KL penalty to the base model
    clip: float = 0.2              # GRPO: policy-ratio clip range

    LIMITS = {"epochs": (1, 10000), "lr": (1e-9, 1.0), "rank": (1, 1024), "alpha": (1e-6, 1e6),
              "max_seq_len": (8, 1 << 20), "checkpoint_interval": (1, 1 << 30), "seed": (0, 2**63 - 1),
              "grad_accum": (1, 4096), "warmup": (0, 1 << 30), "weight_decay": (0.0, 10.0),
              "beta": (0.0, 100.0), "clip": (0.0, 10.0)}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainSpec":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown training option(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")
        spec = cls(**{k: (tuple(v) if k in ("targets", "betas") else v) for k, v in d.items() if v is not None})
        for k, (lo, hi) in cls.LIMITS.items():
            v = getattr(spec, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"training option {k} = {v!r} must be a number in [{lo}, {hi}]")
        if spec.schedule not in SCHEDULES:
            raise ValueError(f"schedule {spec.schedule!r} is not one of {', '.join(SCHEDULES)}")
        LoraConfig(spec.rank, spec.alpha, spec.targets)          # validates targets
        return spec

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass
class Progress:
    step: int
    total_steps: int
    epoch: int                    # the epoch the step belongs to, from 1
    loss: float
    lr: float
    tokens: int
    tokens_per_s: float
    eta_s: float
    extra: dict = field(default_factory=dict)    # method-specific figures (GRPO: reward, KL)


@dataclass
class SFTRun:
    """Train `examples` on `model`; `job_dir` holds the checkpoint and the loss history."""
    model: object
    examples: list[Example]
    spec: TrainSpec
    job_dir: Path
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        s = self.spec
        self.base = FrozenBase(self.model, np.float32)
        self.rng = np.random.default_rng(s.seed)
        self.adapter: Adapter = init_adapter(self.model, LoraConfig(s.rank, s.alpha, s.targets), self.rng)
        self.names = list(self.adapter.tensors)
        self.params = [t for n in self.names for t in self.adapter.tensors[n]]
        self.opt = AdamW(self.params, s.lr, s.betas, 1e-8, s.weight_decay)
        self.steps_per_epoch = math.ceil(len(self.examples) / s.grad_accum)
        self.total_steps = s.epochs * self.steps_per_epoch
        self.step, self.epoch, self.pos = 0, 0, 0
        self.order = self.rng.permutation(len(self.examples))
        self.ckpt = Path(self.job_dir) / "checkpoint.npz"
        self.history = Path(self.job_dir) / "losses.jsonl"
        if self.ckpt.exists():
            self._load_checkpoint()
        else:
            self.history.unlink(missing_ok=True)

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        arrays = {f"p{i}": p for i, p in enumerate(self.params)} | self.opt.state()
        state = {"step": self.step, "epoch": self.epoch, "pos": self.pos, "order": self.order.tolist(),
                 "rng": self.rng.bit_generator.state, "names": self.names, "spec": self.spec.as_dict()}
        arrays["state"] = np.frombuffer(json.dumps(state).encode(), np.uint8)
        tmp = self.ckpt.with_name(f".checkpoint.{os.getpid()}.tmp.npz")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.ckpt)

    def _load_checkpoint(self) -> None:
        with np.load(self.ckpt) as z:
            state = json.loads(z["state"].tobytes())
            if state["names"] != self.names or state["spec"] != self.spec.as_dict():
                raise ValueError(f"{self.ckpt} was written for another configuration of this job")
            for i, p in enumerate(self.params):
                p[...] = z[f"p{i}"]
            self.opt.load_state(z)
        self.step, self.epoch, self.pos = state["step"], state["epoch"], state["pos"]
        self.order = np.asarray(state["order"])
        self.rng.bit_generator.state = state["rng"]
        # the history may run past the checkpoint: those steps will be done again
        kept = [ln for ln in self._history_lines() if json.loads(ln)["step"] <= self.step]
        self.history.write_text("".join(ln + "\n" for ln in kept))

    def _history_lines(self) -> list[str]:
        try:
            return [ln for ln in self.history.read_text().splitlines() if ln.strip()]
        except OSError:
            return []

    # -- the loop ---------------------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool] = lambda: False,
            on_step: Callable[[Progress], None] = lambda p: None) -> str:
        """Train to the end ("completed") or until should_stop() ("stopped", checkpointed)."""
        s = self.spec
        grads = [np.zeros_like(p) for p in self.params]
        gmap = {n: (grads[2 * i], grads[2 * i + 1]) for i, n in enumerate(self.names)}
        lmap = {n: self.adapter.tensors[n] for n in self.names}
        t_start, steps_done = time.perf_counter(), 0
        while self.step < self.total_steps:
            batch = [self.examples[i] for i in self.order[self.pos:self.pos + s.grad_accum]]
            for g in grads:
                g.fill(0)
            t0 = time.perf_counter()
            done = self._accumulate(batch, lmap, gmap, should_stop)
            if done is None:
                self.save_checkpoint()                  # the state as of the last step boundary
                return "stopped"
            loss, tokens, extra = done
            lr = learning_rate(self.step, self.total_steps, s.lr, s.warmup, s.schedule)
            self.opt.step(grads, lr)
            self.step += 1
            self.pos += len(batch)
            if self.pos >= len(self.examples):
                self.epoch += 1
                self.pos = 0
                if self.epoch < s.epochs:
                    self.order = self.rng.permutation(len(self.examples))
            dt = time.perf_counter() - t0
            steps_done += 1
            rate = (time.perf_counter() - t_start) / steps_done
            # the epoch this step belongs to, counted from 1 (self.epoch counts the finished ones)
            in_epoch = self.epoch if self.pos == 0 else self.epoch + 1
            p = Progress(self.step, self.total_steps, in_epoch, loss, lr, tokens,
                         tokens / dt if dt > 0 else 0.0, rate * (self.total_steps - self.step), extra)
            with open(self.history, "a") as f:
                f.write(json.dumps({"step": p.step, "epoch": p.epoch, "loss": p.loss, "lr": lr,
                                    "tokens": tokens, "tokens_per_s": round(p.tokens_per_s, 2),
                                    "t": round(time.time(), 3), **extra}) + "\n")
            if self.step % s.checkpoint_interval == 0 and self.step < self.total_steps:
                self.save_checkpoint()
            on_step(p)
        return "completed"

    def _accumulate(self, batch, lmap, gmap, should_stop):
        """Add one optimizer step's gradients into gmap; (loss, tokens, extra figures), or None
        when asked to stop (the partial gradient is dropped)."""
        n_targets = sum(len(e.targets) for e in batch)
        loss_sum = 0.0
        for ex in batch:
            if should_stop():
                return None
            loss, _ = loss_and_grads(self.base, lmap, self.adapter.scale, ex.tokens, ex.targets,
                                     gmap, 1.0 / n_targets)
            loss_sum += loss
        return loss_sum / n_targets, sum(len(e.tokens) for e in batch), {}

    def save(self, path: Path, name: str) -> Path:
        self.adapter.meta = dict(self.meta)
        return save_adapter(self.adapter, path, name)


class GRPORun(SFTRun):
    """GRPO from scored groups (native/training/grpo.py): `examples` are Groups; each optimizer
    step takes grad_accum groups. One update per group, so the log-probabilities the ratio
    compares with are the current ones (the clip binds from a second pass on); the reference
    log-probabilities of the base model are computed once per completion."""

    def __post_init__(self):
        super().__post_init__()
        self._ref: dict[tuple[int, int], np.ndarray] = {}

    def _reference(self, gi: int, ci: int, ex) -> np.ndarray:
        key = (gi, ci)
        if key not in self._ref:
            got = {}

            def keep(lp):
                got["lp"] = lp
                return np.zeros_like(lp), 0.0
            loss_and_grads(self.base, {}, self.adapter.scale, ex.tokens, ex.targets, {}, keep)
            self._ref[key] = got["lp"]
        return self._ref[key]

    def _accumulate(self, batch, lmap, gmap, should_stop):
        from .grpo import advantages, objective
        s = self.spec
        n = sum(len(g.completions) for g in batch)
        loss_sum, tokens, rewards, adv_abs = 0.0, 0, [], []
        stats: dict = {}
        for g in batch:
            A = advantages(g.rewards)
            for ci, (ex, a) in enumerate(zip(g.completions, A)):
                if should_stop():
                    return None
                weigh = objective(float(a), self._reference(g.line, ci, ex), None, s.beta, s.clip, stats)

                def scaled(lp, weigh=weigh):
                    w, value = weigh(lp)
                    return w / n, value / n
                loss, _ = loss_and_grads(self.base, lmap, self.adapter.scale, ex.tokens, ex.targets, gmap, scaled)
                loss_sum += loss
                tokens += len(ex.tokens)
            rewards += g.rewards
            adv_abs += [abs(float(x)) for x in A]
        return loss_sum, tokens, {"reward": float(np.mean(rewards)), "kl": stats.get("kl", 0.0) / n,
                                  "advantage_abs": float(np.mean(adv_abs))}
