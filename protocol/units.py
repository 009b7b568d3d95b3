"""Sizes as users write them in settings — "512MiB", "2GB", "25%" of RAM — read by the supervisor
and by workers alike."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|[KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, total_ram: int, what: str = "expert cache") -> int:
    """'512MiB', '2GB', '25%' (of RAM) -> bytes; `what` names the setting in an error."""
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"{what} size {text!r} is not a size: use e.g. 512MiB, 2GiB or 25%")
    value, unit = float(m.group(1)), (m.group(2) or "").lower() or None
    if unit == "%":
        if not 0 < value <= 90:
            raise ValueError(f"{what} {text!r}: a share of RAM must be in (0, 90]%")
        return int(total_ram * value / 100)
    return int(value * _UNITS[unit])
