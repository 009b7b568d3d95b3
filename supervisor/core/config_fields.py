"""What a configuration value is checked against — its type, range or choices — and the error that
names the key and what is allowed (config.py's SCHEMA and worker tables are made of these)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Field:
    type: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple | None = None

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(repr, self.choices))
        rng = ""
        if self.low is not None or self.high is not None:
            rng = f" in [{self.low if self.low is not None else '-inf'}, {self.high if self.high is not None else 'inf'}]"
        return f"a{'n' if self.type is int else ''} {self.type.__name__}{rng}"



def coerce(key: str, f: Field, raw: Any, from_text: bool) -> Any:
    value = raw
    if from_text and isinstance(raw, str):
        try:
            if f.type is bool:
                if raw.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError
                value = raw.lower() in ("1", "true", "yes", "on")
            elif f.type in (int, float):
                value = f.type(raw)
        except ValueError:
            raise ConfigError(f"{key} = {raw!r} is not valid: must be {f.describe()}") from None
    if f.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if key.endswith("keep_alive") and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)                 # keep_alive = 300 means seconds, as "300" does
    if not isinstance(value, f.type) or (f.type in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"{key} = {raw!r} is not valid: must be {f.describe()}")
    if f.low is not None and value < f.low or f.high is not None and value > f.high:
        raise ConfigError(f"{key} = {value!r} is out of range: must be {f.describe()}")
    if f.choices and value not in f.choices:
        raise ConfigError(f"{key} = {value!r} is not valid: must be {f.describe()}")
    return value
