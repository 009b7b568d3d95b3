"""On-policy distillation: the student answers, a teacher scores every sampled token.

For a completion sampled from the student, with the student's log-probabilities l_t of its own
tokens and the teacher's τ_t of the same tokens, the per-token reverse KL sample is
d_t = l_t - τ_t; its expectation over the student's samples is KL(student || teacher). The
policy gradient of that expectation (each token's term a constant, as on-policy distillation
does it — no credit carried to earlier tokens) is sum_t d_t ∇l_t. lora_grad's backward computes
the gradient of sum_t w_t (-l_t), so the weights are w_t = -d_t / N, N the step's sampled tokens,
and the loss reported is the step's mean d_t: the reverse KL per token.

A teacher is a model from the library, loaded beside the student (`LocalTeacher`), or an
OpenAI-compatible server (`URLTeacher`: /v1/completions with echo and logprobs, the way
evaluation harnesses score text). Either must share the student's vocabulary: the ids are
scored as they are, so another tokenizer would score other text.
"""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import numpy as np

from ..generate import PREFILL_CHUNK
from ..sampling import log_softmax
from ..vocabulary import vocabulary_difference

KEY_ENV = "KILN_TEACHER_API_KEY"       # a URL teacher's bearer key, read by the trainer; never stored


class TeacherError(ValueError):
    """The teacher cannot score for this student (what failed and what to do)."""


def objective(teacher_lp: np.ndarray, scale: float, stats: dict | None = None):
    """The `weight` function for lora_grad.loss_and_grads over one sample's tokens; `scale` is
    1 / the step's sampled tokens."""
    teacher_lp = np.asarray(teacher_lp, np.float64)

    def weigh(logp: np.ndarray):
        d = logp - teacher_lp
        if stats is not None:
            stats["tokens"] = stats.get("tokens", 0) + len(d)
            stats["teacher_lp"] = stats.get("teacher_lp", 0.0) + float(teacher_lp.sum())
        return -d * scale, float(d.sum() * scale)
    return weigh


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


class LocalTeacher:
    """A model of the library, scored with the engine (llama.cpp's arithmetic)."""

    def __init__(self, model, student):
        differ = vocabulary_difference(model, student)
        if differ:
            raise TeacherError(f"teacher {model.path.name} cannot teach {student.path.name}: their vocabularies "
                               f"differ ({differ}); choose a teacher of the student's family (the same tokenizer)")
        self.model, self.name = model, model.path.name

    def logprobs(self, tokens: list[int], start: int) -> np.ndarray:
        return _logprobs(self.model, tokens, start)


def _logprobs(m, tokens: list[int], start: int, adapter=None) -> np.ndarray:
    """log p(tokens[j] | tokens[:j]) for j in start..len(tokens)-1 under model m, in chunks."""
    cache = m.new_cache(len(tokens) + 1)
    out = []
    for lo in range(0, len(tokens) - 1, PREFILL_CHUNK):
        part = tokens[lo:min(lo + PREFILL_CHUNK, len(tokens) - 1)]
        want = lo + len(part) >= start                  # does this chunk predict a scored token?
        logits = m.forward(part, cache, all_logits=want, adapter=adapter)
        if want:
            for i, row in enumerate(np.atleast_2d(logits)):
                j = lo + i + 1                          # the token this row predicts
                if j >= start:
                    out.append(float(log_softmax(row)[tokens[j]]))
    return np.asarray(out, np.float64)


class URLTeacher:
    """An OpenAI-compatible server's /v1/completions: the ids sent as the prompt with echo=true,
    logprobs=0, max_tokens=0; its answer is read as untrusted (types, sizes, finite values)."""

    MAX_REPLY = 64 << 20

    def __init__(self, url: str, model: str | None = None, timeout: float = 300.0):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise TeacherError(f"teacher URL {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
        base = url.rstrip("/")
        for tail in ("/v1/completions", "/v1"):
            if base.endswith(tail):
                base = base[: -len(tail)]
                break
        self.endpoint, self.model, self.timeout, self.name = base + "/v1/completions", model, timeout, url

    def _post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(KEY_ENV)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.endpoint, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read(self.MAX_REPLY + 1)
        except urllib.error.HTTPError as e:
            detail = e.read(2000).decode("utf-8", "replace")
            raise TeacherError(f"teacher {self.endpoint} answered HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise TeacherError(f"teacher {self.endpoint} cannot be reached: {getattr(e, 'reason', e)}; "
                               f"is its server running?") from None
        if len(raw) > self.MAX_REPLY:
            raise TeacherError(f"teacher {self.endpoint} answered more than {self.MAX_REPLY >> 20} MiB")
        try:
            return json.loads(raw)
        except ValueError:
            raise TeacherError(f"teacher {self.endpoint} answered something that is not JSON") from None

    def score(self, tokens: list[int]) -> tuple[list, list]:
        """(token_logprobs, token pieces) of the whole sequence as the server echoes it."""
        body = {"prompt": list(map(int, tokens)), "echo": True, "logprobs": 0, "max_tokens": 0, "temperature": 0}
        if self.model:
            body["model"] = self.model
        reply = self._post(body)
        try:
            lp = reply["choices"][0]["logprobs"]
            values, pieces = lp["token_logprobs"], lp["tokens"]
        except (KeyError, IndexError, TypeError):
            raise TeacherError(f"teacher {self.endpoint} did not echo the prompt's log-probabilities "
                               f"(choices[0].logprobs.token_logprobs); it must support echo=true with "
                               f"logprobs, as Kiln, vLLM and OpenAI's legacy completions do") from None
        if not isinstance(values, list) or not isinstance(pieces, list) or len(values) != len(tokens) \
                or len(pieces) != len(tokens):
            raise TeacherError(f"teacher {self.endpoint} scored {len(values) if isinstance(values, list) else '?'} "
                               f"tokens of the {len(tokens)} sent: it must take token ids as the prompt")
        return values, pieces

    def logprobs(self, tokens: list[int], start: int) -> np.ndarray:
        values = self.score(tokens)[0][start:]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= 1e-3
                   for v in values):
            raise TeacherError(f"teacher {self.endpoint} gave a log-probability that is not a finite number ≤ 0")
        return np.asarray(values, np.float64)

    def check_vocabulary(self, tokens: list[int], tokenizer) -> None:
        """The teacher's text of our ids must be ours: otherwise it scores other words."""
        pieces = self.score(tokens)[1]
        theirs = "".join(p if isinstance(p, str) else "" for p in pieces)
        ours = tokenizer.decode(tokens)
        if theirs.strip() != ours.strip():
            raise TeacherError(f"teacher {self.endpoint} reads the student's token ids as other text "
                               f"({theirs[:60]!r}… vs {ours[:60]!r}…): it has another vocabulary; choose a "
                               f"teacher of the student's family (the same tokenizer)")



def exact_reverse_kl(student, teacher, sequences: list[tuple[list[int], int]], adapter=None) -> float:
    """KL(student || teacher) per token, over the whole vocabulary, at every position from
    `start` on of each (tokens, start): a measure with no sampling noise, for held-out prompts
    (both models local; the student's adapter applied)."""
    total, count = 0.0, 0
    for tokens, start in sequences:
        rows = []
        for m, a in ((student, adapter), (teacher, None)):
            cache = m.new_cache(len(tokens) + 1)
            logits = np.atleast_2d(m.forward(tokens[:-1], cache, all_logits=True, adapter=a))[start - 1:]
            rows.append(np.stack([log_softmax(r) for r in logits]).astype(np.float64))
        ls, lt = rows
        total += float((np.exp(ls) * (ls - lt)).sum())
        count += len(ls)
    return total / max(count, 1)


def heldout_kl(student, teacher, prompts, spec, adapter=None) -> dict:
    """The student's reverse KL to the teacher on held-out prompts: `spec.samples` completions
    of each, sampled as training samples them but with seeds of their own (the same before and
    after training); exact over the vocabulary with a local teacher, else the sampled estimate
    (the mean of l_t - τ_t, unbiased)."""
    from ..generate import generate_text
    from ..sampling import SamplingParams
    seqs = []
    for p in prompts:
        for k in range(spec.samples):
            seed = int(np.random.SeedSequence([spec.seed, 1 << 40, p.line, k]).generate_state(1)[0] & 0x7FFFFFFF)
            params = SamplingParams(temperature=spec.temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed,
                                    max_tokens=spec.max_new_tokens)
            ids = generate_text(student, p.tokens, params, adapter=adapter)[0]
            if ids:
                seqs.append((p.tokens + ids, len(p.tokens)))
    n = sum(len(t) - s for t, s in seqs)
    if isinstance(teacher, LocalTeacher):
        return {"kl": round(exact_reverse_kl(student, teacher.model, seqs, adapter), 6), "measure": "exact",
                "tokens": n}
    total = 0.0
    for tokens, start in seqs:
        total += float((_logprobs(student, tokens, start, adapter) - teacher.logprobs(tokens, start)).sum())
    return {"kl": round(total / max(n, 1), 6), "measure": "sampled", "tokens": n}
