"""Durations and sizes as users write them in settings and requests: "5m", -1, "2GiB", "25%"."""

from __future__ import annotations

import re

from kiln.protocol.units import parse_size  # noqa: F401 - sizes are read by workers too

def parse_duration(v) -> float | None:
    """Seconds from Ollama's keep_alive forms: 300, "5m", "1h30m", "10s", "0", -1 / "-1" (forever:
    None). A negative number means forever, as Ollama reads it."""
    if isinstance(v, bool):
        raise ValueError(f"keep_alive {v!r} is not a duration")
    if isinstance(v, (int, float)):
        return None if v < 0 else float(v)
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"keep_alive {v!r} is not a duration (e.g. 300, \"5m\", \"1h\", 0, -1)")
    s = v.strip()
    try:
        f = float(s)
        return None if f < 0 else f
    except ValueError:
        pass
    if s.startswith("-"):
        return None
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?(?:(\d+)ms)?", s)
    if not parts or not any(parts.groups()):
        raise ValueError(f"keep_alive {v!r} is not a duration (e.g. 300, \"5m\", \"1h\", 0, -1)")
    h, m, sec, ms = (float(x) if x else 0.0 for x in parts.groups())
    return h * 3600 + m * 60 + sec + ms / 1000
