"""Durations and sizes as users write them in settings and requests: "5m", -1, "2GiB", "25%"."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|[KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, total_ram: int) -> int:
    """'512MiB', '2GB', '25%' (of RAM) -> bytes."""
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"expert cache size {text!r} is not a size: use e.g. 512MiB, 2GiB or 25%")
    value, unit = float(m.group(1)), (m.group(2) or "").lower() or None
    if unit == "%":
        if not 0 < value <= 90:
            raise ValueError(f"expert cache {text!r}: a share of RAM must be in (0, 90]%")
        return int(total_ram * value / 100)
    return int(value * _UNITS[unit])


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
