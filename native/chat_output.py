"""A chat answer's streamed text, split into what the client shows: reasoning (between <think>
and </think>, for templates that have them), content, and tool calls (native/tool_calls.py).
Splitting the text anywhere gives the same result as feeding it whole."""

from __future__ import annotations

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


class ChatOutput:
    """Reasoning first, then tool calls within the content. `feed`/`finish` return a delta:
    {"text": str, "reasoning": str, "tool_calls": [Call, …]} (empty parts left out)."""

    def __init__(self, tool_format: str | None, tools: list[dict] | None, thinking: bool | None):
        self.reasoning = ReasoningSplitter(thinking) if thinking is not None else None
        self.tools = ToolCallParser(tool_format, tools) if tool_format else None

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
        return self.tools.calls if self.tools else []
