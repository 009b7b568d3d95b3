"""The adapter registry: <state>/adapters/<name>.gguf with <name>.json beside it.

The GGUF is what llama.cpp loads; the JSON says where it came from (base model, its hash,
the training job and data, rank/alpha/targets). `active.json` names the adapter applied to
requests that do not name one. The trainer adds adapters, the supervisor lists, activates and
deletes them, the inference worker reads them.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from .job_store import write_json_atomic

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class AdapterNotFound(KeyError):
    def __init__(self, name: str, known: list[str]):
        super().__init__(name)
        self.message = (f"no adapter named {name!r}" +
                        (f" (adapters: {', '.join(known)})" if known else " (no adapters yet: `kiln train sft` makes one)"))

    def __str__(self) -> str:
        return self.message


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or name.endswith(".gguf"):
        raise ValueError(f"adapter name {str(name)[:80]!r} is not valid: use 1-64 letters, digits, '_', '-', '.', "
                         f"starting with a letter or digit")
    return name


class AdapterRegistry:
    def __init__(self, state_dir: str | os.PathLike):
        self.root = Path(state_dir) / "adapters"

    def gguf_path(self, name: str) -> Path:
        return self.root / f"{check_name(name)}.gguf"

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.gguf")) if self.root.is_dir() else []

    def get(self, name: str) -> dict:
        path = self.gguf_path(name)
        if not path.is_file():
            raise AdapterNotFound(name, self.names())
        try:
            meta = json.loads(path.with_suffix(".json").read_text())
        except (OSError, ValueError):
            meta = {}
        st = path.stat()
        return {**meta, "name": name, "path": str(path), "size_bytes": st.st_size, "mtime": st.st_mtime,
                "active": self.active() == name}

    def list(self) -> list[dict]:
        out = []
        for n in self.names():
            try:
                out.append(self.get(n))
            except AdapterNotFound:
                continue
        return out

    def register(self, name: str, meta: dict) -> dict:
        """Record metadata for the GGUF already written at gguf_path(name)."""
        write_json_atomic(self.gguf_path(name).with_suffix(".json"), {**meta, "name": name, "created": time.time()})
        return self.get(name)

    def delete(self, name: str) -> None:
        path = self.gguf_path(name)
        if not path.exists():
            raise AdapterNotFound(name, self.names())
        path.unlink()
        path.with_suffix(".json").unlink(missing_ok=True)
        if self.active() == name:
            self.set_active(None)

    def active(self) -> str | None:
        try:
            return json.loads((self.root / "active.json").read_text()).get("name")
        except (OSError, ValueError):
            return None

    def set_active(self, name: str | None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.root / "active.json", {"name": name})
