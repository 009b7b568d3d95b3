"""Tool calls: how a model is told about tools, how it answers with a call, and the grammar that
makes it call when it must.

A model's chat template decides its call format; `detect_format` reads it from the template's
source:

  hermes     `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Qwen2.5/3, Hermes, many more)
  qwen_xml   `<tool_call><function=NAME><parameter=K>V</parameter>…</function></tool_call>` (Qwen3.5,
             Qwen3-Coder)
  llama3     a bare JSON object `{"name": …, "parameters": {…}}`, optionally after <|python_tag|>
  mistral    `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`, or `[TOOL_CALLS]NAME[ARGS]{…}`
  harmony    gpt-oss: the template lists the tools as a TypeScript namespace and the model calls in
             a `commentary to=functions.NAME` message (native/chat_output.py HarmonySplitter)
  generic    a template that knows no tools (SmolLM2…): the tools are described in a system
             message (GENERIC_PROMPT) and the model answers in the hermes form

`ToolCallParser` turns the streamed text into content and calls, holding back only what could
still be the start of a call marker; a call is released whole, when it closes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .constrain import json_rule

FORMATS = ("hermes", "qwen_xml", "llama3", "mistral", "generic")

GENERIC_PROMPT = """You can call functions. These are the functions available, as JSON schemas:
<tools>
{tools}
</tools>
To call a function, answer with one <tool_call></tool_call> block per call, each holding a JSON \
object with the function's name and its arguments:
<tool_call>
{{"name": "<function-name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>"""


def detect_format(source: str | None) -> str:
    s = source or ""
    if "tools" not in s:
        return "generic"
    if "<|channel|>" in s:
        return "harmony"
    if "<function=" in s and "<tool_call>" in s:
        return "qwen_xml"
    if "<tool_call>" in s:
        return "hermes"
    if "[TOOL_CALLS]" in s:
        return "mistral"
    if "<|python_tag|>" in s or "ipython" in s:
        return "llama3"
    return "generic"


# -- prompting ---------------------------------------------------------------------------------

def _arguments_object(args):
    """Templates expect a call's arguments as a mapping; OpenAI clients send a JSON string."""
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return args
        return parsed if isinstance(parsed, dict) else args
    return args


def prepare(messages: list[dict], tools: list[dict] | None, fmt: str) -> tuple[list[dict], dict]:
    """The messages and extra template variables that present `tools` and a conversation with
    calls and results to a template of format `fmt`."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=_arguments_object(
                c["function"].get("arguments")))) for c in m["tool_calls"]]
        out.append(m)
    if fmt != "generic":
        return out, ({"tools": tools} if tools else {})
    # a template without tools: describe them in the system message, write calls and results
    # in the hermes form as ordinary text
    conv = []
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": c["function"]["arguments"]},
                                                           ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            conv.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).lstrip("\n")})
        elif m["role"] == "tool":
            conv.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            conv.append({k: v for k, v in m.items() if k in ("role", "content")})
    if tools:
        prompt = GENERIC_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if conv and conv[0]["role"] in ("system", "developer"):
            conv[0] = {"role": conv[0]["role"], "content": conv[0]["content"] + "\n\n" + prompt}
        else:
            conv.insert(0, {"role": "system", "content": prompt})
    return conv, {}


# -- constraining ------------------------------------------------------------------------------

def _schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


# any text, ending at the first "\n</parameter>\n" (llguidance's & and ~ on a lexeme): the value
# may hold newlines and "<", and cannot run on past its closing tag
_STR_END_RE = r"/(.|\n)*\n<\/parameter>\n/ & ~/(.|\n)*\n<\/parameter>\n(.|\n)+/"
_STR_END = f"STR_END: {_STR_END_RE}"


def _string_bounds(ps: dict) -> list[str]:
    """Regexes for a string parameter's own constraints (minLength, maxLength, pattern — a JSON
    Schema pattern matches anywhere in the value), each one the value must match. `format` is an
    annotation in JSON Schema and is not enforced here, as in the JSON formats."""
    lo, hi, pattern = ps.get("minLength"), ps.get("maxLength"), ps.get("pattern")
    parts = []
    if lo is not None or hi is not None:
        parts.append(f"(.|\\n){{{int(lo or 0)},{'' if hi is None else int(hi)}}}")
    if pattern is not None:             # unanchored unless it says ^ / $
        head = pattern[1:] if pattern.startswith("^") else None
        body = head if head is not None else pattern
        tail = body.endswith("$") and not body.endswith("\\$")
        body = body[:-1] if tail else body
        parts.append(("" if head is not None else "(.|\\n)*") + f"({body})" + ("" if tail else "(.|\\n)*"))
    return parts


def call_grammar(fmt: str, tools: list[dict], parallel: bool, special_ids: dict[str, int]) -> str:
    """A Lark grammar (llguidance) for one call — or one or more when `parallel` — to one of
    `tools`, in the model's own format, arguments valid against each function's schema."""
    names = [t["function"]["name"] for t in tools]
    if fmt == "qwen_xml":
        rules, alts = [], []
        for i, t in enumerate(tools):
            sch = _schema(t)
            props, required = sch.get("properties") or {}, set(sch.get("required") or [])
            parts = []
            for j, (k, ps) in enumerate(props.items()):
                if ps.get("type") == "string" and isinstance(ps.get("enum"), list):
                    value = "(" + " | ".join(_lark_str(str(v)) for v in ps["enum"]) + ")"
                else:
                    value = None if ps.get("type") == "string" else json_rule(ps)
                if value is None:
                    # a string runs to the first "\n</parameter>\n" (lines, "<" and all: code, HTML)
                    tail, bounds = "STR_END", _string_bounds(ps)
                    if bounds:
                        tail = f"S{i}_{j}"
                        rules.append(f"{tail}: {_STR_END_RE}" + "".join(f" & /{b}" + r"\n<\/parameter>\n/"
                                                                        for b in bounds))
                else:
                    tail = f"{value} {_lark_str(chr(10) + '</parameter>' + chr(10))}"
                rules.append(f"p{i}_{j}: {_lark_str(f'<parameter={k}>' + chr(10))} {tail}")
                parts.append(f"p{i}_{j}" + ("" if k in required else "?"))
            rules.append(f"f{i}: {_lark_str(f'<function={names[i]}>' + chr(10))} {' '.join(parts)} "
                         f"{_lark_str('</function>')}")
            alts.append(f"f{i}")
        body = f"call: \"<tool_call>\\n\" ({' | '.join(alts)}) \"\\n</tool_call>\""
        start = "start: call (\"\\n\" call)*" if parallel else "start: call"
        return "\n".join([start, body, *rules, _STR_END])
    obj_key = "parameters" if fmt == "llama3" else "arguments"
    one = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, obj_key: _schema(t)},
                      "required": ["name", obj_key], "additionalProperties": False}
                     for n, t in zip(names, tools)]}
    if fmt == "mistral":
        marker = special_ids.get("[TOOL_CALLS]")
        lead = f"<[{marker}]>" if marker is not None else '"[TOOL_CALLS]"'
        arr = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return f"start: {lead} {json_rule(arr)}"
    if fmt == "llama3":
        return f"start: {json_rule(one)}"
    start = "start: call (\"\\n\" call)*" if parallel else "start: call"
    return f"{start}\ncall: \"<tool_call>\\n\" {json_rule(one)} \"\\n</tool_call>\""


# -- parsing -----------------------------------------------------------------------------------

@dataclass
class Call:
    index: int
    id: str
    name: str
    arguments: str                                # JSON text, as OpenAI sends it

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# a closing tag counts only where the next thing is the next parameter / function or the end: a
# value may hold the literal tag mid-text (code about these very tags), as the grammar lets it
_XML_FN = re.compile(r"<function=([^>\n]+)>(.*?)</function>(?=\s*(?:<function=|\Z))", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>(?=\s*(?:<parameter=|\Z))", re.S)


class ToolCallParser:
    """Content and calls out of a model's streamed text. `feed` and `finish` return a list of
    ("text", str) and ("call", Call) events; splitting the text anywhere gives the same events."""

    def __init__(self, fmt: str, tools: list[dict] | None = None):
        self.fmt = fmt
        self.types = {t["function"]["name"]: (_schema(t).get("properties") or {}) for t in tools or []}
        self.starts = {"mistral": ["[TOOL_CALLS]"], "llama3": ["<|python_tag|>"]}.get(fmt, ["<tool_call>"])
        self.end = "</tool_call>" if fmt in ("hermes", "qwen_xml", "generic") else None
        self.buf, self.marker = "", None       # marker: the start marker of the call being read
        self.end_from = 0                      # where to look for the call's end marker
        self.at_start = True                   # llama3: a bare JSON answer is a call
        self.after_call = False                # whitespace between and after calls is layout
        self.calls: list[Call] = []

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while True:
            if self.marker is None:
                if self.after_call:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        return out
                    self.after_call = False
                if self.fmt == "llama3" and self.at_start:
                    stripped = self.buf.lstrip()
                    if not stripped:
                        return out
                    self.at_start = False
                    if stripped[0] == "{":
                        self.marker, self.buf = "", stripped
                        continue
                found = [(self.buf.find(s), s) for s in self.starts if s in self.buf]
                if found:
                    i, s = min(found)
                    if i:
                        out.append(("text", self.buf[:i]))
                    self.marker, self.buf = s, self.buf[i + len(s):]
                    self.at_start = False
                    continue
                hold = max((k for s in self.starts for k in range(1, len(s)) if self.buf.endswith(s[:k])), default=0)
                if len(self.buf) > hold:
                    out.append(("text", self.buf[:len(self.buf) - hold]))
                    self.buf = self.buf[len(self.buf) - hold:]
                    self.at_start = False
                return out
            if self.end is None:
                return out
            # an end marker closes the call only where the body before it parses: a value may
            # hold the literal marker (code about tool calls); else look for a later one
            i = self.buf.find(self.end, self.end_from)
            if i < 0:
                return out
            if not self._parse(self.buf[:i].strip()):
                self.end_from = i + 1
                continue
            self._close_at(i, out)

    def _close_at(self, i: int, out: list) -> None:
        out += self._close(self.buf[:i], self.marker + self.buf[:i + len(self.end)])
        self.buf, self.marker, self.end_from = self.buf[i + len(self.end):], None, 0
        self.after_call = bool(out) and out[-1][0] == "call"

    def finish(self) -> list[tuple]:
        out = []
        first_end = self.buf.find(self.end) if self.marker is not None and self.end else -1
        if first_end >= 0:
            # no end marker closed a call that parses: the first one ends it (as text, as
            # written), and what follows is read again — it may hold calls of its own
            self._close_at(first_end, out)
            return out + self.feed("") + self.finish()
        if self.marker is not None:
            out = self._close(self.buf, self.marker + self.buf)
        elif self.buf and not (self.after_call and not self.buf.strip()):
            out = [("text", self.buf)]
        self.buf, self.marker = "", None
        return out

    def _close(self, body: str, raw: str) -> list[tuple]:
        """The calls in one call body; a body that does not parse stays text, as written."""
        found = self._parse(body.strip())
        if not found:
            return [("text", raw)]
        events = []
        for name, args in found:
            call = Call(len(self.calls), "call_" + uuid.uuid4().hex[:24], name, args)
            self.calls.append(call)
            events.append(("call", call))
        return events

    def _parse(self, body: str) -> list[tuple[str, str]]:
        if body.startswith("<function="):
            return [(name.strip(), json.dumps(self._xml_args(name.strip(), inner), ensure_ascii=False))
                    for name, inner in _XML_FN.findall(body)]
        if self.fmt == "mistral" and body and body[0] != "[":          # NAME[ARGS]{…}
            name, sep, args = body.partition("[ARGS]")
            try:
                return [(name.strip(), json.dumps(json.loads(args), ensure_ascii=False))] if sep else []
            except ValueError:
                return []
        try:
            obj = json.loads(body)
        except ValueError:
            return []
        items = obj if isinstance(obj, list) else [obj]
        calls = []
        for it in items:
            if not (isinstance(it, dict) and isinstance(it.get("name"), str)):
                return []
            args = it.get("arguments", it.get("parameters", {}))
            calls.append((it["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        return calls

    def _xml_args(self, name: str, inner: str) -> dict:
        props = self.types.get(name, {})
        args = {}
        for k, v in _XML_PARAM.findall(inner):
            k = k.strip()
            if (props.get(k) or {}).get("type") == "string":
                args[k] = v
                continue
            try:
                args[k] = json.loads(v)
            except ValueError:
                args[k] = v
        return args
