"""One on-policy distillation job (native/training/opd.py): sample, score, step, with exact resume.

Each optimizer step takes grad_accum prompts; for each, the student (the base model with the
adapter as it stands) samples `samples` completions through the engine, the teacher scores
their tokens, and the gradient of the reverse KL is accumulated. A sample's seed is derived
from (seed, step, prompt, sample), not drawn from the run's Generator, so a step stopped
midway leaves the checkpointed state untouched and is redone with the same draws: a resumed
job ends with the adapter of an uninterrupted one, as SFT and GRPO do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..generate import generate_text
from ..lora import Adapter
from ..sampling import SamplingParams
from .lora_grad import loss_and_grads
from .opd import objective
from .sft_trainer import SFTRun, TrainSpec


@dataclass
class OPDSpec(TrainSpec):
    samples: int = 4               # completions the student samples per prompt and step
    max_new_tokens: int = 128      # longest sampled completion
    temperature: float = 1.0       # the student's sampling temperature (1: its own distribution)

    LIMITS = {**TrainSpec.LIMITS, "samples": (1, 64), "max_new_tokens": (1, 8192), "temperature": (0.05, 4.0)}
    METHOD_ONLY = ("samples", "max_new_tokens", "temperature")


@dataclass
class OPDRun(SFTRun):
    """`examples` are Prompts (sft_data.Prompt); `teacher` has logprobs(tokens, start)."""
    teacher: object = None

    def _student(self) -> Adapter:
        """The adapter as it stands, copied: the engine keeps derived forms of an adapter, and
        these factors change at every step."""
        a = self.adapter
        return Adapter(a.arch, a.alpha, {n: (x.copy(), y.copy()) for n, (x, y) in a.tensors.items()})

    def sample(self, prompt, k: int, adapter: Adapter) -> list[int]:
        s = self.spec
        seed = int(np.random.SeedSequence([s.seed, self.step, prompt.line, k]).generate_state(1)[0] & 0x7FFFFFFF)
        params = SamplingParams(temperature=s.temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed,
                                max_tokens=s.max_new_tokens)
        return generate_text(self.model, prompt.tokens, params, adapter=adapter)[0]

    def _accumulate(self, batch, lmap, gmap, should_stop):
        s = self.spec
        student = self._student()
        drawn = []
        for prompt in batch:
            for k in range(s.samples):
                if should_stop():
                    return None
                ids = self.sample(prompt, k, student)
                if ids:
                    tokens = prompt.tokens + ids
                    drawn.append((tokens, len(prompt.tokens), self.teacher.logprobs(tokens, len(prompt.tokens))))
        n = sum(len(t) - start for t, start, _ in drawn)
        stats: dict = {}
        loss_sum = 0.0
        for tokens, start, teacher_lp in drawn:
            if should_stop():
                return None
            weigh = objective(teacher_lp, 1.0 / n, stats)
            loss, _ = loss_and_grads(self.base, lmap, self.adapter.scale, tokens, range(start, len(tokens)),
                                     gmap, weigh)
            loss_sum += loss
        return loss_sum, sum(len(t) for t, _, _ in drawn), {
            "kl": loss_sum, "sampled_tokens": n, "teacher_logprob": stats.get("teacher_lp", 0.0) / max(n, 1)}
