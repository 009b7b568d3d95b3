"""The inference worker (kind `inference`): one model, one KV cache, ops over the protocol.

Ops: generate (streams one chunk per token), tokenize, detokenize, apply_template, info.
Boot resolves and loads the configured model; a bad path or a corrupt file exits 3 with the
reason, so the supervisor marks the worker fatal instead of restarting it in a loop.
The KV cache keeps the last conversation: a follow-up turn that extends it reuses the shared
prefix (reported as cached_tokens).
"""

from __future__ import annotations

import os
import queue
import time

from kiln.protocol.store.adapter_registry import AdapterNotFound, AdapterRegistry
from kiln.native.chat_template import TemplateError, render_and_tokenize, template_for
from kiln.native.lora import AdapterError

from kiln.native.constrain import GrammarError, check, gbnf_grammar, json_schema_grammar
from kiln.native.fim import InfillError, infill_prompt
from kiln.native.generate import ContextLengthError, Finish, Token, score_prompt
from kiln.native.draft_model import DraftModel, DraftModelError
from kiln.native.encoder import Encoder, is_encoder, load_encoder
from kiln.native.scheduler import DEFAULT_PARALLEL, Scheduler
from kiln.native import kernels
from kiln.native.gguf_file import GGUFError, read_gguf
from kiln.native.models.library import ModelNotFound, PullError, resolve_model
from kiln.native.kv_types import KVTypeError, settings_kv
from kiln.native.model import WEIGHTS, load_model
from kiln.native.sampling import SamplingError, SamplingParams
from kiln.native.tokenizer import TokenizerError, TooManyTokens
from kiln.native.vision.layout import prompt_ids

from kiln.protocol import vocab

from . import chat_plan, pipeline, prefix_setup
from .adapters import LoadedAdapters
from .chat_plan import ChatPlan, PlanError
from .context_fit import answer_room, fit_turns
from .vision_ops import VisionOps
from .embedding_ops import EmbeddingOps
from .runtime import main
from .slots import SlotOps
from .worker import BootError, OpError, Worker, op, state_dir


class InferenceWorker(EmbeddingOps, SlotOps, VisionOps, Worker):
    kind = "inference"

    def boot(self):
        self.state = vocab.LOADING
        spec = self.settings.get("model") or "default"
        try:
            path = resolve_model(spec, pull=(spec == "default"))
            threads = self.settings.get("threads") or None
            if threads:
                kernels.set_threads(threads)
            weights = self.settings.get("weights", "mapped")
            if weights not in WEIGHTS:
                raise BootError(f"weights = {weights!r} is not valid: mapped (the default: the file's page cache, "
                                f"shared between processes) or private (a copy in huge pages)")
            if is_encoder(read_gguf(path, skip_arrays=True).architecture):
                return self._boot_encoder(path, threads, weights)
            self.model = load_model(path, threads=threads, weights=weights, keep_mapped=self.keep_mapped(path),
                                    **pipeline.stage_kw(path, self.settings))
        except (ModelNotFound, PullError, GGUFError, TokenizerError) as e:
            raise BootError(str(e)) from None
        c = self.model.config
        self.stages = pipeline.attach(self, self.model) if self.settings.get("stage") else None
        self.n_ctx = int(self.settings.get("ctx") or c.n_ctx_train)
        st = self.settings
        try:                           # keys and values of the KV cache (f16 unless told: kv_types.py)
            self.model.use_kv_types(*settings_kv(st))
        except KVTypeError as e:
            raise BootError(f"{self.model.path.name}: {e}") from None
        # llama-server's --context-shift: answers may go past the context's end (a request's
        # context_shift says otherwise for itself)
        self.context_shift = st.get("context_shift", False)
        if not isinstance(self.context_shift, bool):
            raise BootError(f"context_shift = {self.context_shift!r} must be true or false")
        if self.context_shift and not (self.model.new_cache(8).can_shift and self.model.can_shift_over([])):
            raise BootError(f"context_shift: {self.model.path.name} cannot shift its context (its sliding-window "
                            f"or recurrent layers keep no earlier keys, or M-RoPE places its rows); leave "
                            f"context_shift out for this model")
        draft = None
        if st.get("draft_model"):
            try:
                draft = DraftModel(load_model(resolve_model(st["draft_model"]), threads=threads, weights=weights),
                                   self.model)
            except (ModelNotFound, PullError, GGUFError, TokenizerError, DraftModelError) as e:
                raise BootError(f"draft_model {st['draft_model']!r}: {e}") from None
        self.scheduler = Scheduler(self.model, self.n_ctx, int(st.get("parallel") or DEFAULT_PARALLEL),
                                   prefill_ratio=float(st.get("prefill_ratio") or 3.0),
                                   prefill_chunk=int(st.get("prefill_chunk") or 0),
                                   speculative=bool(st.get("speculative", True)),
                                   threads=int(st["threads"]) if st.get("threads") else None,
                                   draft_model=draft, draft_min=int(st.get("draft_min") or 0))
        try:                           # blocks of prompts any sequence computed, in RAM and on disk
            prefix_setup.attach(self.scheduler, self.model, self.n_ctx, st)
        except prefix_setup.PrefixSettingError as e:
            raise BootError(str(e)) from None
        try:
            self.template = template_for(self.model)
        except TemplateError:
            self.template = None
        self._boot_vision()
        self.served = 0
        self.tokens_out = 0
        self.loaded_at = time.time()
        self.adapters = AdapterRegistry(state_dir())
        self.loras = LoadedAdapters(self.adapters, lambda: self.model)

    def _boot_encoder(self, path, threads, weights) -> None:
        """An embedder or reranker (native/encoder.py): no KV cache, no scheduler, no template;
        the ops that generate refuse (`_decoder`)."""
        self.model = load_encoder(path, threads=threads, weights=weights)
        ctx = self.settings.get("ctx")
        self.n_ctx = min(int(ctx), self.model.config.n_ctx_train) if ctx else self.model.config.n_ctx_train
        self.context_shift, self.scheduler, self.template = False, None, None
        self.vision, self.vision_note = None, "an encoder reads text only"
        self.served = self.tokens_out = 0
        self.loaded_at = time.time()
        self.adapters = AdapterRegistry(state_dir())
        self.loras = LoadedAdapters(self.adapters, lambda: self.model)

    def _decoder(self, what: str) -> None:
        """Refuses `what` on an encoder, naming what it can do instead."""
        if isinstance(self.model, Encoder):
            can = "rerank (/v1/rerank)" if self.model.config.pooling == "rank" else "embed (/v1/embeddings, /api/embed)"
            raise OpError("bad_request", f"{self.model.path.stem} is an encoder ({self.model.config.arch}): it "
                                         f"cannot {what}; it can {can}")

    def keep_mapped(self, path) -> set[str]:
        """Tensors left in the mapping with weights = "private" (none here; a moe-stream worker's experts)."""
        return set()

    def status(self) -> dict:
        m = getattr(self, "model", None)
        if m is None:
            return {"model_spec": self.settings.get("model")}
        if self.scheduler is None:
            return {"model": m.path.stem, "path": str(m.path), "n_ctx": self.n_ctx, "encoder": m.config.pooling,
                    "requests": self.served, "load_s": round(m.load_seconds, 3), "kernels": kernels.kernel_info(),
                    "weights": {"mode": "private", **m.gguf.private.stats()} if m.gguf.private is not None
                    else {"mode": "mapped"}}
        return {"model": m.path.stem, "path": str(m.path), "n_ctx": self.n_ctx, "kv_types": list(m.kv_types),
                "context_shift": self.context_shift, **(self.stages.status() if getattr(self, "stages", None) else {}),
                "requests": self.served, "tokens_generated": self.tokens_out,
                "load_s": round(m.load_seconds, 3), "kernels": kernels.kernel_info(), **self.scheduler.load(),
                "weights": {"mode": "private", **m.gguf.private.stats()} if m.gguf.private is not None
                else {"mode": "mapped"},
                "kv_cache_bytes": sum(s.cache.nbytes for s in self.scheduler.seqs),
                "kv_cache_tokens": sum(s.cache.n for s in self.scheduler.seqs), **self.vision_status()}

    # -- helpers ------------------------------------------------------------------------------

    def _prompt(self, body: dict, images=None) -> list[int]:
        tok = self.model.tokenizer
        if "prompt" in body:
            ids = body["prompt"]
            if not ids or not all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids):
                raise OpError("bad_request", f"prompt must be a non-empty list of token ids in [0, {tok.vocab_size})")
            return ids
        if "messages" in body:
            if self.template is None:
                raise OpError("bad_request", f"model {self.model.path.name} has no chat template; "
                                             f"use the completions API with a raw prompt")
            try:
                return render_and_tokenize(self.template, tok, body["messages"], images=images)[1]
            except TemplateError as e:
                raise OpError("bad_request", str(e)) from None
        if "infill" in body:
            return self._infill(body["infill"], (body.get("params") or {}).get("max_tokens"))
        if "text" in body and images:       # llama-server's multimodal_data: a marker where each goes
            try:
                return prompt_ids(tok, body["text"], images)
            except ValueError as e:
                raise OpError("bad_request", str(e)) from None
        if "text" in body:
            ids = tok.encode(body["text"], special=bool(body.get("special", False)))
            if not ids:
                raise OpError("bad_request", "the prompt is empty")
            return ids
        raise OpError("bad_request", "generate needs one of prompt (token ids), text, messages or infill")

    def _bounded(self, fn, *args, what: str = "the prompt", **kwargs):
        """fn(*args) with the texts it tokenizes counted first: a text whose bytes alone prove it
        longer than the context is refused at once instead of being tokenized (3.5 MB: 2.5 s)."""
        try:
            with self.model.tokenizer.token_budget(self.n_ctx):
                return fn(*args, **kwargs)
        except TooManyTokens as e:
            raise OpError("context_length_exceeded", str(e).replace("the prompt", what, 1)) from None

    def _infill(self, f: dict, max_tokens) -> list[int]:
        """A fill-in-the-middle prompt (native/fim.py): prefix, suffix, the start of the middle,
        other files (name, text), and whether to lay it out as llama-server's /infill does."""
        texts = {k: f.get(k, "") for k in ("prefix", "suffix", "middle")}
        extra = f.get("extra", [])
        if not all(isinstance(v, str) for v in texts.values()) or not isinstance(extra, list) or not all(
                isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e) for e in extra):
            raise OpError("bad_request", "infill takes prefix, suffix and middle strings and extra [[name, text], …]")
        try:
            return infill_prompt(self.model.tokenizer, texts["prefix"], texts["suffix"], middle=texts["middle"],
                                 extra=[tuple(e) for e in extra], repo_level=bool(f.get("repo_level")),
                                 n_ctx=self.n_ctx, n_predict=max_tokens if isinstance(max_tokens, int) else 0)
        except InfillError as e:
            raise OpError("bad_request", f"model {self.model.path.name}: {e}") from None

    def _grammar(self, g: dict, plan: ChatPlan) -> str:
        """A grammar the request names outright, llama-server's way: `{"gbnf": text}` (its
        `grammar` field) or `{"json_schema": schema}`."""
        if plan.grammar:
            raise OpError("bad_request", "grammar cannot be combined with response_format or a forced tool call: "
                                         "each constrains the answer; give one")
        kind, value = next(iter(g.items()))
        if len(g) != 1 or (kind, type(value)) not in (("gbnf", str), ("json_schema", dict)):
            raise OpError("bad_request", 'grammar is {"gbnf": text} or {"json_schema": schema}')
        try:
            grammar = gbnf_grammar(value) if kind == "gbnf" else json_schema_grammar(value)
            check(grammar, self.model.tokenizer)
        except GrammarError as e:
            field = "grammar" if kind == "gbnf" else "json_schema"
            raise OpError("bad_request", f"{field}: {e}") from None
        return grammar

    def _adapter(self, body: dict):
        """The LoRA a request names at its scale (workers/adapters.py), or None."""
        try:
            return self.loras.get(body.get("adapter"), body.get("adapter_scale"))
        except (AdapterError, GGUFError) as e:           # (AdapterError is a ValueError: first)
            raise OpError("adapter_mismatch", f"adapter {body.get('adapter')}: {e}") from None
        except (AdapterNotFound, ValueError) as e:       # ValueError: not an adapter's name
            raise OpError("adapter_not_found", str(e)) from None

    def _piece(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id])

    # -- ops ----------------------------------------------------------------------------------

    def _plan(self, body: dict, images=None) -> ChatPlan:
        if "messages" not in body:
            return ChatPlan(self._prompt(body, images))
        if self.template is None:
            raise OpError("bad_request", f"model {self.model.path.name} has no chat template; "
                                         f"use the completions API with a raw prompt")
        try:
            return chat_plan.plan(body, self.model, self.template, images)
        except PlanError as e:
            raise OpError("bad_request", str(e)) from None

    @op("generate", concurrent=True)
    def generate(self, req):
        """Stream one chunk per token; the scheduler batches the decode steps of all requests.
        A chat answer's text is split into content, reasoning and tool calls as it streams. With
        n > 1 the chunks carry the sequence's index and the reply holds one final per sequence."""
        self._decoder("generate text")
        raw = dict(req.body.get("params") or {})
        n = int(raw.pop("n", 1))
        images = self._images(req.body)
        # a repo-level infill keeps what fits of its files: no bound on the text it was given
        dropped = 0
        if req.body.get("truncation") == "auto" and "messages" in req.body:
            plan, dropped = fit_turns(req.body, lambda b: self._bounded(self._plan, b, images), self.n_ctx,
                                      answer_room(raw.get("max_tokens"), self.n_ctx))
        else:
            plan = self._plan(req.body) if "infill" in req.body else self._bounded(self._plan, req.body, images)
        prompt = plan.prompt
        if plan.grammar:
            raw["grammar"] = plan.grammar
        if req.body.get("grammar"):
            raw["grammar"] = self._grammar(req.body["grammar"], plan)
        if self.context_shift:
            raw.setdefault("context_shift", True)
        if raw.get("max_tokens") == -1:        # to the end of the context
            raw["max_tokens"] = max(1, self.n_ctx - len(prompt))
        elif req.body.get("clip_max_tokens") and isinstance(raw.get("max_tokens"), int) and \
                not raw.get("context_shift"):
            raw["max_tokens"] = max(1, min(raw["max_tokens"], self.n_ctx - len(prompt)))
        try:
            params = SamplingParams.from_dict(raw)
        except (SamplingError, TypeError) as e:
            raise OpError("bad_request", str(e)) from None
        adapter = self._adapter(req.body)
        try:
            job = self.scheduler.submit(prompt, params, req.cancelled, adapter, n=n, show=plan.show)
        except ContextLengthError as e:
            raise OpError("context_length_exceeded", str(e)) from None
        except ValueError as e:
            raise OpError("bad_request", str(e)) from None
        self.served += 1
        outputs = [plan.output() for _ in range(n)]
        finals: list[dict | None] = [None] * n
        said_usage = False
        while any(f is None for f in finals):
            try:
                ev = job.events.get(timeout=0.1)
            except queue.Empty:
                continue                   # the scheduler ends a cancelled job within a step
            if isinstance(ev, Token):
                self.tokens_out += 1
                chunk = {"token": ev.id, "text": ev.text}
                if not said_usage:              # the first token says what the prompt took (Anthropic's message_start)
                    said_usage = True
                    chunk.update(prompt_tokens=len(prompt), cached_tokens=job.gen.cached if job.gen else 0)
                if outputs[ev.index] is not None:
                    chunk.update(chat_plan.wire_delta(outputs[ev.index].feed(ev.text)))
                if n > 1:
                    chunk["index"] = ev.index
                if params.logprobs is not None:
                    chunk["logprob"] = ev.logprob
                    chunk["piece"] = self._piece(ev.id)
                    chunk["top_logprobs"] = [[i, lp, self._piece(i)] for i, lp in ev.top_logprobs]
                yield chunk
            elif isinstance(ev, Finish):
                finals[ev.index] = chat_plan.final(ev, outputs[ev.index])
            else:
                raise ev
        if dropped:                        # the answer says what truncation left out
            for f in finals:
                f["truncated_messages"] = dropped
        if n == 1:
            return finals[0]
        usage = {"prompt_tokens": finals[0]["usage"]["prompt_tokens"],
                 "completion_tokens": sum(f["usage"]["completion_tokens"] for f in finals),
                 "cached_tokens": finals[0]["usage"]["cached_tokens"], "draft_tokens": 0, "accepted_tokens": 0}
        shifts = sum(f.get("context_shifts", 0) for f in finals)
        return {"choices": finals, "usage": usage, "timings": finals[0]["timings"],
                **({"truncated_messages": dropped} if dropped else {}), **({"context_shifts": shifts} if shifts else {})}

    @op("score")
    def score(self, req):
        """Log-probabilities of the prompt's own tokens (for echo + logprobs)."""
        self._decoder("score a prompt's tokens")
        prompt = self._bounded(self._prompt, req.body)
        if len(prompt) > self.n_ctx:
            raise OpError("context_length_exceeded", f"the prompt has {len(prompt)} tokens; the context holds {self.n_ctx}")
        top = int(req.body.get("top") or 0)
        adapter = self._adapter(req.body)
        with self.scheduler.model_lock:
            out = score_prompt(self.model, prompt, top, adapter=adapter)
        out["tokens"] = prompt
        out["pieces"] = [self._piece(t) for t in prompt]
        out["top_logprobs"] = [None if t is None else [[i, lp, self._piece(i)] for i, lp in t]
                               for t in out["top_logprobs"]]
        return out

    @op("tokenize")
    def tokenize(self, req):
        b = req.body
        tok = self.model.tokenizer
        ids = tok.encode(b["text"], special=b.get("special", False), add_bos=b.get("add_bos"))
        if b.get("pieces"):
            return {"tokens": ids, "pieces": [tok.token_bytes(i) for i in ids]}
        return {"tokens": ids}

    @op("detokenize")
    def detokenize(self, req):
        ids = req.body["tokens"]
        if not all(isinstance(i, int) and 0 <= i < self.model.tokenizer.vocab_size for i in ids):
            raise OpError("bad_request", f"tokens must be ids in [0, {self.model.tokenizer.vocab_size})")
        return {"text": self.model.tokenizer.decode(ids)}

    @op("apply_template")
    def apply_template(self, req):
        self._decoder("apply a chat template")
        if self.template is None:
            raise OpError("bad_request", f"model {self.model.path.name} has no chat template")
        if any(k in req.body for k in ("tools", "tool_choice", "chat_template_kwargs", "reasoning_effort",
                                       "template_hints")):
            ids = self._plan(req.body, self._images(req.body)).prompt      # exactly the prompt generate would run
            return {"prompt": self.model.tokenizer.decode([t for t in ids if t >= 0]), "tokens": ids}
        try:
            text, ids = render_and_tokenize(self.template, self.model.tokenizer, req.body["messages"],
                                            req.body.get("add_generation_prompt", True), images=self._images(req.body))
        except TemplateError as e:
            raise OpError("bad_request", str(e)) from None
        return {"prompt": text, "tokens": ids}

    @op("info")
    def info(self, req):
        m, tok = self.model, self.model.tokenizer
        sp = tok.special
        return {"model": m.path.stem, "path": str(m.path), "architecture": m.config.arch,
                "n_ctx": self.n_ctx, "n_ctx_train": m.config.n_ctx_train, "vocab_size": tok.vocab_size,
                "bos_token": tok.tokens[sp.bos] if sp.bos is not None else None,
                "eos_token": tok.tokens[sp.eos] if sp.eos is not None else None,
                "chat_template": self.template.source if self.template else None,
                "created": int(os.path.getmtime(m.path)), "slots": len(self.scheduler.seqs) if self.scheduler else 0,
                "fill_in_the_middle": tok.fim.can_infill, "pooling": self._pooling(),
                "vision": getattr(self, "vision", None) is not None}


if __name__ == "__main__":
    main(InferenceWorker)
