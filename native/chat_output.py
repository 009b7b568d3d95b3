"""A chat answer's streamed text, split into what the client shows: reasoning (between <think>
and </think>, for templates that have them, or gpt-oss's analysis channel), content, and tool
calls (native/tool_calls.py, or gpt-oss's calls to functions). Splitting the text anywhere gives
the same result as feeding it whole."""

from __future__ import annotations

import re
import uuid

from .tool_calls import Call, ToolCallParser

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _hold(buf: str, marker: str) -> int:
    """How many trailing characters of buf could begin `marker`."""
    return max((k for k in range(1, len(marker)) if buf.endswith(marker[:k])), default=0)


class ReasoningSplitter:
    """("reasoning", s) and ("text", s) events. `thinking` starts True when the prompt already
    opened the block (Qwen3.5's generation prompt ends with <think>); otherwise a <think> at the
    very start of the answer opens it. Newlines right after either tag are layout, not text."""

    def __init__(self, thinking: bool = False):
        self.state = "thinking" if thinking else "start"
        self.buf, self.strip = "", thinking

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out = []
        while self.buf:
            if self.strip:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return out
                self.strip = False
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.buf, self.state, self.strip = stripped[len(THINK_OPEN):], "thinking", True
                    continue
                if not stripped or THINK_OPEN.startswith(stripped):
                    return out                 # maybe the start of <think>: wait
                self.state = "content"
            if self.state == "content":
                out.append(("text", self.buf))
                self.buf = ""
                return out
            i = self.buf.find(THINK_CLOSE)
            if i >= 0:
                if i:
                    out.append(("reasoning", self.buf[:i]))
                self.buf, self.state, self.strip = self.buf[i + len(THINK_CLOSE):], "content", True
                continue
            keep = _hold(self.buf, THINK_CLOSE)
            if len(self.buf) > keep:
                out.append(("reasoning", self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return out
        return out

    def finish(self) -> list[tuple[str, str]]:
        out = [("reasoning" if self.state == "thinking" else "text", self.buf)] if self.buf else []
        self.buf = ""
        return out


class HarmonySplitter:
    """gpt-oss's harmony messages — `<|channel|>analysis<|message|>…<|end|><|start|>assistant
    <|channel|>final<|message|>…` (the markers are shown to this splitter; <|return|> and
    <|call|> end generation) — as ("reasoning", s) for the analysis channel, ("text", s) for the
    final answer and for commentary addressed to nobody (a preamble the user sees), and
    ("call", Call) for a message to `functions.NAME`. An answer that starts without a header
    (a constrained one) is plain text."""

    MESSAGE, END = "<|message|>", "<|end|>"
    _TO = re.compile(r"to=functions\.([^\s<]+)")
    _CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")

    def __init__(self):
        self.state, self.buf, self.kind = "header", "", "text"
        self.call: list | None = None           # [name, arguments so far] of a message to a function
        self.n_calls = 0

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while self.buf:
            if self.state == "header":
                if not self.buf.lstrip().startswith("<|") and not "<|".startswith(self.buf.lstrip()):
                    self.state, self.kind = "body", "text"   # no header: plain text to the end
                    continue
                i = self.buf.find(self.MESSAGE)
                if i < 0:
                    return out
                self._open(self.buf[:i])
                self.buf, self.state = self.buf[i + len(self.MESSAGE):], "body"
                continue
            i = self.buf.find(self.END)
            if i >= 0:
                self._emit(out, self.buf[:i])
                self._close(out)
                self.buf, self.state = self.buf[i + len(self.END):], "header"
                continue
            keep = _hold(self.buf, self.END)
            self._emit(out, self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return out
        return out

    def finish(self) -> list[tuple]:
        out: list[tuple] = []
        if self.state == "body":
            self._emit(out, self.buf)
        elif self.buf.strip():
            out.append(("text", self.buf))       # a header that never reached its message
        self.buf = ""
        self._close(out)
        return out

    def _open(self, header: str) -> None:
        channel = self._CHANNEL.search(header)
        to = self._TO.search(header)
        name = channel.group(1) if channel else ""
        if to:
            self.kind, self.call = "call", [to.group(1), ""]
        else:
            self.kind = "reasoning" if name == "analysis" else "text"

    def _emit(self, out: list, s: str) -> None:
        if not s:
            return
        if self.kind == "call":
            self.call[1] += s
        else:
            out.append((self.kind, s))

    def _close(self, out: list) -> None:
        if self.call is not None:
            name, args = self.call
            out.append(("call", Call(self.n_calls, "call_" + uuid.uuid4().hex[:24], name, args.strip() or "{}")))
            self.n_calls += 1
            self.call = None
        self.kind = "text"


class ChatOutput:
    """Reasoning first, then tool calls within the content. `feed`/`finish` return a delta:
    {"text": str, "reasoning": str, "tool_calls": [Call, …]} (empty parts left out)."""

    def __init__(self, tool_format: str | None, tools: list[dict] | None, thinking: bool | None,
                 harmony: bool = False):
        self.reasoning = HarmonySplitter() if harmony else ReasoningSplitter(thinking) if thinking is not None else None
        self.tools = ToolCallParser(tool_format, tools) if tool_format and not harmony else None
        self.harmony_calls: list[Call] = []

    def feed(self, text: str) -> dict:
        return self._delta(self.reasoning.feed(text) if self.reasoning else [("text", text)], False)

    def finish(self, text: str = "") -> dict:
        events = (self.reasoning.feed(text) + self.reasoning.finish()) if self.reasoning else [("text", text)]
        return self._delta(events, True)

    def _delta(self, events, last: bool) -> dict:
        delta: dict = {"text": "", "reasoning": "", "tool_calls": []}
        for kind, s in events:
            if kind == "reasoning":
                delta["reasoning"] += s
            elif kind == "call":
                delta["tool_calls"].append(s)
                self.harmony_calls.append(s)
            elif self.tools:
                self._add(delta, self.tools.feed(s))
            else:
                delta["text"] += s
        if last and self.tools:
            self._add(delta, self.tools.finish())
        return {k: v for k, v in delta.items() if v}

    @staticmethod
    def _add(delta: dict, events) -> None:
        for kind, v in events:
            if kind == "text":
                delta["text"] += v
            else:
                delta["tool_calls"].append(v)

    @property
    def calls(self) -> list[Call]:
        return self.tools.calls if self.tools else self.harmony_calls
