"""The typed request every dialect's translation produces: one generation, as the router and the
inference worker take it (protocol/ops.py's "generate"). Its defaults are decided here, once — a
dialect that says nothing about max_tokens gets DEFAULT_MAX_TOKENS whichever door it came in."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kiln.protocol.sampling import DEFAULT_MAX_TOKENS

from .openai_validate import bad


@dataclass
class Work:
    # the input: exactly one of these
    messages: list | None = None          # a chat (the model's template renders it)
    text: str | None = None               # a raw prompt (`special`: its special-token text parsed)
    prompt: list | None = None            # token ids
    infill: dict | None = None            # fill-in-the-middle: prefix, suffix, … (native/fim.py)
    special: bool = False
    model: str | None = None              # None: the default model
    params: dict = field(default_factory=dict)      # sampling and max_tokens (openai_validate.sampling_params)
    # chat constraints, checked for shape at the edge and against the template by the worker
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    chat_template_kwargs: dict | None = None
    reasoning_effort: str | None = None
    template_hints: dict | None = None    # template variables applied where the template uses them
    grammar: dict | None = None           # {"gbnf": text} or {"json_schema": schema}
    adapter: str | None = None            # a LoRA adapter by name ("": none, whatever is active)
    adapter_scale: float | None = None    # how strongly it applies (None: 1, as trained)
    keep_alive: Any = None                # how long its model stays loaded after it (None: the default)
    clip_max_tokens: bool = False         # max_tokens as an upper bound: past the context's end, stop
    min_ctx: int | None = None            # the context the client needs (Ollama's num_ctx)
    truncation: str | None = None         # "auto": the oldest turns go until the prompt fits (chat only)
    images: list | None = None            # images' bytes, one per mark in messages/text (supervisor/http/images.py)

    def __post_init__(self):
        self.model = model_of({"model": self.model})
        given = [k for k in ("messages", "text", "prompt", "infill") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a Work has exactly one input, got {given or 'none'}")

    def body(self) -> dict:
        """The generate op's body: what was given, and max_tokens always."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and v is not False and f.name != "params":
                out[f.name] = v
        out["params"] = {"max_tokens": DEFAULT_MAX_TOKENS, **self.params}
        return out


def model_of(body: dict) -> str | None:
    """The model a body names (None, or "": the default one)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string", "invalid_type")
    return model or None


def apply_created(work: Work) -> str | None:
    """A request naming a model made from a Modelfile (native/models/created.py): its defaults go
    under the request's own fields and the request runs on its base file. The created model's
    name, or None when the request names no such model."""
    if not work.model:
        return None
    from kiln.native.models.created import applied, load
    record = load(work.model)
    if record is None:
        return None
    work.messages, work.params, work.adapter = applied(record, work.messages, work.params, work.adapter)
    if work.min_ctx is None and (record.get("parameters") or {}).get("min_ctx"):
        work.min_ctx = record["parameters"]["min_ctx"]
    name, work.model = work.model, record["path"]
    return name

