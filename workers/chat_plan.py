"""What a chat request asks of the model, made concrete for one model: the prompt tokens (tools,
calls and results rendered through its template), the grammar the answer must match (a forced
tool call, a JSON schema), and how the answer's text splits into reasoning, content and calls.

The HTTP layer has already checked the shapes of the fields; what is checked here needs the
model: its template's tool format, the variables the template reads, whether a schema compiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.native.chat_output import ChatOutput
from kiln.native.chat_template import TemplateError, render_and_tokenize
from kiln.native.constrain import GrammarError, check, json_schema_grammar, lark_grammar
from kiln.native.tool_calls import call_grammar, detect_format, prepare

# control tokens a parser must see in the text (the decoder hides control tokens otherwise)
_MARKERS = ("[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<tool_call>", "</tool_call>", "<think>", "</think>")
EFFORTS = ("low", "medium", "high")
# gpt-oss's message markers, shown to the harmony splitter (<|return|> and <|call|> end the answer)
HARMONY_SHOWN = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")


class PlanError(ValueError):
    """The request cannot be served by this model as asked; the message says why."""


@dataclass
class ChatPlan:
    prompt: list[int]
    grammar: str | None = None
    tool_format: str | None = None             # parse calls in this format (None: no tools)
    tools: list[dict] | None = None
    thinking: bool | None = None               # None: the template has no <think> blocks
    show: frozenset = field(default_factory=frozenset)
    harmony: bool = False                      # gpt-oss: channels and calls in harmony messages

    def output(self) -> ChatOutput | None:
        if self.tool_format is None and self.thinking is None and not self.harmony:
            return None
        return ChatOutput(self.tool_format, self.tools, self.thinking, harmony=self.harmony)


def _template_vars(body: dict, source: str) -> dict:
    extra = {}
    kwargs = body.get("chat_template_kwargs") or {}
    for k, v in kwargs.items():
        if k not in source:
            raise PlanError(f"chat_template_kwargs.{k}: this model's chat template does not use {k!r}, "
                            f"so it would have no effect")
        extra[k] = v
    effort = body.get("reasoning_effort")
    if effort is not None:
        if "reasoning_effort" not in source:
            raise PlanError("reasoning_effort: this model's chat template has no reasoning budget; "
                            "leave the field out")
        extra["reasoning_effort"] = effort
    # hints (the Anthropic route's thinking and effort, sent by Claude Code on every request):
    # applied where the template has the switch; a model without it answers as it always does
    for k, v in (body.get("template_hints") or {}).items():
        if k in source and k not in extra:
            extra[k] = v
    return extra


def _response_grammar(fmt: dict | None) -> str | None:
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return json_schema_grammar({"type": "object"})
    schema = fmt["json_schema"].get("schema") or {}
    try:
        return json_schema_grammar(schema)
    except GrammarError as e:
        raise PlanError(f"response_format.json_schema.schema: {e}") from None


def plan(body: dict, model, template, images: list[list[int]] | None = None) -> ChatPlan:
    tok = model.tokenizer
    source = template.source
    tools = body.get("tools") or None
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice == "none":
        tools = None
    harmony = getattr(tok, "harmony", False)
    # a harmony template over a vocabulary without harmony's markers could not call: no tools in it
    native = detect_format(source)
    native = "generic" if native == "harmony" and not harmony else native
    fmt = native if tools else None
    messages, extra = prepare(body["messages"], tools, native)
    extra.update(_template_vars(body, source))

    grammar = _response_grammar(body.get("response_format"))
    where = "response_format.json_schema.schema"
    if tools and choice != "auto" and harmony:
        raise PlanError("tool_choice: a forced tool call is not supported for gpt-oss's harmony format yet; "
                        "use \"auto\" (the model's calls are parsed)")
    if tools and choice != "auto":
        if grammar:
            raise PlanError("tool_choice: a forced tool call and a response_format cannot both constrain "
                            "the answer; use one")
        chosen = tools
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            chosen = [t for t in tools if t["function"]["name"] == name]
            if not chosen:
                raise PlanError(f"tool_choice names the function {name!r}, which is not in tools")
        specials = {m: tok.id_of(m) for m in _MARKERS if tok.id_of(m) is not None}
        # a forced answer is one call unless the client asks for parallel calls outright: a small
        # model, free to go on, repeats calls until max_tokens
        grammar = lark_grammar(call_grammar(fmt, chosen, body.get("parallel_tool_calls") is True
                                            and not isinstance(choice, dict), specials))
        where = "tools"

    thinks = "<think>" in source
    if grammar and thinks and "enable_thinking" in source and "enable_thinking" not in extra:
        extra["enable_thinking"] = False      # a constrained answer starts at once, without reasoning
    try:
        text, ids = render_and_tokenize(template, tok, messages, images=images, **extra)
    except TemplateError as e:
        raise PlanError(str(e)) from None
    opens = text.rstrip().endswith("<think>")
    if grammar and opens:
        raise PlanError("this template opens a reasoning block before the answer, which a constrained "
                        "answer cannot have; set chat_template_kwargs.enable_thinking to false")
    if grammar:
        try:
            check(grammar, tok)
        except GrammarError as e:
            raise PlanError(f"{where}: {e}") from None
    markers = _MARKERS + (HARMONY_SHOWN if harmony else ())
    show = frozenset(i for i in map(tok.id_of, markers) if i is not None and tok.is_control(i))
    return ChatPlan(ids, grammar, fmt, tools, (opens if thinks else None), show, harmony)


def wire_delta(delta: dict) -> dict:
    """A ChatOutput delta as message fields: text, reasoning, tool_calls [{index, id, name,
    arguments}]."""
    out = {"text": delta.get("text", "")}
    if delta.get("reasoning"):
        out["reasoning"] = delta["reasoning"]
    if delta.get("tool_calls"):
        out["tool_calls"] = [{"index": c.index, "id": c.id, "name": c.name, "arguments": c.arguments}
                             for c in delta["tool_calls"]]
    return out


def final(ev, output) -> dict:
    """A generation's end on the wire: why it ended, the tail of its text, its counts — and, for a
    chat, what the tail completes (content, reasoning, tool calls)."""
    out = {"finish_reason": ev.reason, "text": ev.text, "index": ev.index,
           "usage": {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                     "cached_tokens": ev.cached_tokens, "draft_tokens": ev.drafted,
                     "accepted_tokens": ev.accepted},
           "timings": {"prefill_s": ev.prefill_s, "decode_s": ev.decode_s}}
    if ev.stop_string is not None:
        out["stop_string"] = ev.stop_string
    if ev.context_shifts:
        out["context_shifts"] = ev.context_shifts
    if output is not None:
        out.update(wire_delta(output.finish(ev.text)))
        out.setdefault("text", "")
        out["tool_calls_total"] = len(output.calls)
        if output.calls and ev.reason == "stop":
            out["finish_reason"] = "tool_calls"
    return out
