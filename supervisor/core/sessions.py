"""Saved chat sessions: `kiln chat --session NAME` keeps its conversation (messages, model,
adapter, sampling) in $KILN_HOME/sessions/NAME.json, rewritten atomically after every turn —
a crash leaves the previous turn's file, never half of one."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class SessionError(Exception):
    pass


class Sessions:
    def __init__(self, home: Path):
        self.dir = Path(home) / "sessions"

    def path(self, name: str) -> Path:
        if not _NAME.fullmatch(name or ""):
            raise SessionError(f"session name {name!r}: use 1-64 letters, digits, '.', '_' or '-'")
        return self.dir / f"{name}.json"

    def load(self, name: str) -> dict | None:
        p = self.path(name)
        if not p.exists():
            return None
        try:
            doc = json.loads(p.read_text())
        except (ValueError, OSError) as e:
            raise SessionError(f"session {name} ({p}) cannot be read: {e}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("messages"), list):
            raise SessionError(f"session {name} ({p}) is not a Kiln session")
        return doc

    def save(self, name: str, doc: dict) -> Path:
        p = self.path(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        doc = {**doc, "name": name, "updated": now, "created": doc.get("created") or now}
        # a temporary file of this save's own: the daemon's HTTP threads may save one session at
        # once (the chat page saving twice), and a shared name made the later replace fail (a 500)
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}")
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        return p

    def list(self) -> list[dict]:
        out = []
        for p in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            try:
                doc = json.loads(p.read_text())
            except (ValueError, OSError):
                out.append({"name": p.stem, "error": "unreadable"})
                continue
            msgs = doc.get("messages") or []
            out.append({"name": p.stem, "title": doc.get("title"), "model": doc.get("model"), "adapter": doc.get("adapter"),
                        "messages": len(msgs), "turns": sum(1 for m in msgs if m.get("role") == "user"),
                        "updated": doc.get("updated"), "created": doc.get("created")})
        return out

    def search(self, text: str) -> list[dict]:
        """The sessions whose name, title, model or any message holds `text` (any case)."""
        want = text.lower()
        out = []
        for entry in self.list():
            try:
                doc = self.load(entry["name"]) or {}
            except SessionError:
                continue
            hay = [entry["name"], str(doc.get("title") or ""), str(doc.get("model") or "")]
            hay += [text_of(m.get("content")) for m in doc.get("messages", []) if isinstance(m, dict)]
            if any(want in h.lower() for h in hay):
                out.append(entry)
        return out

    def rename(self, name: str, to: str) -> Path:
        src, dst = self.path(name), self.path(to)
        if not src.exists():
            raise SessionError(f"no session named {name!r}")
        if dst.exists():
            raise SessionError(f"a session named {to!r} exists already; choose another name")
        doc = self.load(name)
        out = self.save(to, {**doc, "created": doc.get("created")})
        src.unlink()
        return out

    def remove(self, name: str) -> None:
        p = self.path(name)
        if not p.exists():
            raise SessionError(f"no session named {name!r} (`kiln sessions list` shows them)")
        p.unlink()

    def export_line(self, name: str) -> str:
        """The conversation as one `kiln train sft` line: {"messages": [...]}."""
        doc = self.load(name)
        if doc is None:
            raise SessionError(f"no session named {name!r} (`kiln sessions list` shows them)")
        msgs = [{"role": m["role"], "content": text_of(m["content"])} for m in doc["messages"]
                if m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), (str, list))]
        return json.dumps({"messages": msgs}, ensure_ascii=False)


def text_of(content) -> str:
    """A message's text: its content, or the text parts of one with images (the chat page's)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""
