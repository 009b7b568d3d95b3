"""llama-server's sampling knobs, as its clients send them (the llama.cpp web UI, llama.vscode's
chat, llama.vim): validation into the sampling parameters Kiln runs.

Those clients send the whole parameter set with every request — `samplers: "edkypmxt"`,
`dry_multiplier: 0`, `xtc_probability: 0`, `dynatemp_range: 0`, `timings_per_token: false` —
mostly at the values that turn a feature off. The rule: a field set to its "off" value asks
for what Kiln does anyway and is accepted; a field that would turn on a sampler Kiln does not
have (DRY, XTC, dynamic temperature, Mirostat, top-nσ) is a 400 naming it, never ignored.
"""

from __future__ import annotations

from typing import Any

from .openai_validate import bad

# llama.cpp's sampler names (and the short ones it also takes) -> Kiln's; None: a sampler Kiln
# does not have, a no-op in a chain while its own field leaves it off
SAMPLER_NAMES: dict[str, str | None] = {
    "penalties": "penalties", "top_k": "top_k", "typ_p": "typ_p", "typical_p": "typ_p", "top_p": "top_p",
    "min_p": "min_p", "temperature": "temperature", "temp": "temperature", "infill": "infill",
    "dry": None, "xtc": None, "top_n_sigma": None}
# Kiln's fixed chain (native/sampling.py), which is llama.cpp's default order
KILN_ORDER = ["penalties", "top_k", "typ_p", "top_p", "min_p", "temperature"]
# the one-letter form ("edkypmxt", llama.cpp's default order)
SAMPLER_CHARS = {"e": "penalties", "d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma",
                 "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill"}
# the field each of Kiln's samplers reads: given with a chain that does not name it, it would do nothing
READS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical_p": "typ_p",
         "repeat_penalty": "penalties", "presence_penalty": "penalties", "frequency_penalty": "penalties",
         "repeat_last_n": "penalties"}
# a feature Kiln does not have -> its switch's "off" values, and the fields that only tune it
_OFF: dict[str, tuple[tuple, tuple[str, ...]]] = {
    "dry_multiplier": ((0, 0.0), ("dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers")),
    "xtc_probability": ((0, 0.0), ("xtc_threshold",)),
    "dynatemp_range": ((0, 0.0), ("dynatemp_exponent",)),
    "mirostat": ((0,), ("mirostat_tau", "mirostat_eta")),
    "top_n_sigma": ((-1, -1.0, 0, 0.0), ()),
    "timings_per_token": ((False,), ()),
    "n_probs": ((0,), ()),
}
FIELDS = {"samplers", "repeat_last_n", "cache_prompt"} | set(_OFF) | {f for _, tune in _OFF.values() for f in tune}


def llama_params(body: dict, sampling: bool = True) -> dict[str, Any]:
    """The sampling parameters llama-server's fields in `body` ask for (`samplers`,
    `repeat_last_n`), after refusing the ones that would ask for what Kiln does not do.
    `sampling`: False when nothing will be sampled (n_predict 0): the chain then reads nothing."""
    out: dict[str, Any] = {}
    # with its switch off, a field that only tunes the feature tunes nothing: accepted
    for switch, (off, _tuners) in _OFF.items():
        if switch in body and body[switch] not in off:
            raise bad(switch, f"{switch} = {body[switch]!r} asks for what Kiln does not do "
                              f"({_WHAT[switch]}); leave it out or set it to {off[0]!r}")
    if "cache_prompt" in body and not isinstance(body["cache_prompt"], bool):
        raise bad("cache_prompt", "cache_prompt must be a boolean", "invalid_type")
    if body.get("repeat_last_n") is not None:
        n = body["repeat_last_n"]
        if isinstance(n, bool) or not isinstance(n, int) or n < -1:
            raise bad("repeat_last_n", "repeat_last_n must be -1 (the whole context), 0 (off) or a number of tokens")
        out["repeat_last_n"] = n
    if body.get("samplers") is not None:
        chain = body["samplers"]
        if isinstance(chain, str):
            unknown = [c for c in chain if c not in SAMPLER_CHARS]
            if unknown:
                raise bad("samplers", f"sampler letter {unknown[0]!r} is not one of {''.join(SAMPLER_CHARS)}")
            chain = [SAMPLER_CHARS[c] for c in chain]
        if not isinstance(chain, list) or not all(isinstance(x, str) for x in chain):
            raise bad("samplers", "samplers must be a list of sampler names (or llama.cpp's letters)", "invalid_type")
        for x in chain:
            if x not in SAMPLER_NAMES:
                raise bad("samplers", f"sampler {x!r} is not supported (supported: {', '.join(SAMPLER_NAMES)})")
        out["samplers"] = [SAMPLER_NAMES[x] for x in chain if SAMPLER_NAMES[x] is not None]
        if sampling:
            for field, sampler in READS.items():
                if field in body and sampler not in out["samplers"]:
                    raise bad(field, f"{field} has no effect: samplers does not name {sampler!r}")
    if out.get("samplers") == KILN_ORDER:
        del out["samplers"]                      # Kiln's own chain, in the same order (and faster)
    return out


_WHAT = {"dry_multiplier": "no DRY sampler", "xtc_probability": "no XTC sampler",
         "dynatemp_range": "no dynamic temperature", "mirostat": "no Mirostat",
         "top_n_sigma": "no top-nσ sampler", "timings_per_token": "no timings in each chunk",
         "n_probs": "on this route per-token probabilities are asked for with logprobs; n_probs is /completion's"}
