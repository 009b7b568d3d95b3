"""The bounds of every numeric sampling parameter, declared once: the HTTP edge refuses a request
outside them (400 naming the field, supervisor/http/openai_validate.py) and a worker refuses a
generate or score body outside them at the wire boundary (protocol/ops.py), whichever door the
request came in. The engine's own checks (native/sampling.py) are no narrower."""

from __future__ import annotations

NUM = (int, float)

# what leaving max_tokens out means at every door (HTTP, `kiln run`/`chat`, the engine's own
# generate): until the model stops or the context ends — the worker knows the context
DEFAULT_MAX_TOKENS = -1

# name -> (types, low, high)
BOUNDS: dict[str, tuple[tuple, float, float]] = {
    "temperature": (NUM, 0, 2),
    "top_p": (NUM, 0, 1),
    "top_k": ((int,), 0, 1 << 20),
    "min_p": (NUM, 0, 1),
    "typical_p": (NUM, 0, 1),
    "presence_penalty": (NUM, -2, 2),
    "frequency_penalty": (NUM, -2, 2),
    "repeat_penalty": (NUM, 0.01, 10),
    "repeat_last_n": ((int,), -1, 1 << 20),
    "seed": ((int,), -(2**63), 2**64 - 1),
    "max_tokens": ((int,), -1, 1 << 30),        # -1: until the model stops or the context ends
    "n": ((int,), 1, 16),
    "logprobs": ((int,), 0, 20),
    "n_indent": ((int,), 0, 1 << 20),
    "t_max_predict_ms": (NUM, 0, 1e9),
    "n_keep": ((int,), -1, 1 << 30),           # a context shift keeps these first tokens (-1: the prompt)
    "n_discard": ((int,), 0, 1 << 30),         # … and drops this many after them (0: half the rest)
}


def out_of_bounds(params: dict) -> str | None:
    """Why `params` breaks a bound (naming the field), or None."""
    for name, (kinds, low, high) in BOUNDS.items():
        v = params.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, kinds):
            return f"{name} must be a{'n integer' if kinds == (int,) else ' number'}, got {type(v).__name__}"
        if not low <= v <= high:
            return f"{name} = {v} is out of range [{low:g}, {high:g}]"
    return None
