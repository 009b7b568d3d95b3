"""Constrained decoding: a grammar decides which tokens may come next, and the sampler never
sees the others. The engine is llguidance (Rust; a token mask in well under a millisecond at a
49k vocabulary) — a grammar is llguidance's JSON grammar form, built here from a JSON schema
or a Lark grammar, which may embed JSON schemas (`%json {...}`).

The mask is applied to the logits of each step before sampling, for each sequence of a batch on
its own: the output is valid by construction, never by retrying.
"""

from __future__ import annotations

import json

import numpy as np

try:
    import llguidance
except ImportError:  # pragma: no cover - a dependency; the error below says how to get it
    llguidance = None


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot be compiled; the message says why."""


# compact JSON: a small model given free whitespace fills it with newlines
COMPACT = {"whitespace_flexible": False}


def _need() -> None:
    if llguidance is None:
        raise GrammarError("constrained decoding needs the llguidance package: pip install llguidance")


def json_schema_grammar(schema: dict) -> str:
    """The grammar of JSON text matching `schema` (compact separators)."""
    _need()
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def lark_grammar(lark: str) -> str:
    _need()
    return llguidance.LLMatcher.grammar_from_lark(lark)


def gbnf_grammar(gbnf: str) -> str:
    """llama.cpp's GBNF grammar (`root ::= …`), through llguidance's converter to Lark."""
    _need()
    try:
        return lark_grammar(llguidance.grammar_from("gbnf", gbnf))
    except ValueError as e:
        raise GrammarError(str(e)) from None


def json_rule(schema: dict) -> str:
    """A Lark right-hand side matching compact JSON text for `schema`."""
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT}, ensure_ascii=False)


def _lltokenizer(tok):
    """llguidance's view of our tokenizer: every token's bytes (control tokens marked with a
    leading 0xFF, as llguidance expects, so that text never matches them) and a plain-text
    encoder. Built once per tokenizer (~0.2 s at 49k tokens)."""
    cached = getattr(tok, "_llg", None)
    if cached is not None:
        return cached
    _need()

    class _Wrapper(llguidance.TokenizerWrapper):
        def __init__(self):                        # noqa: D401 - llguidance reads these fields
            self.eos_token_id = tok.special.eos if tok.special.eos is not None else min(tok.special.stop_ids)
            self.bos_token_id = tok.special.bos
            self.tokens = [b"\xff" + tok.token_bytes(i) if tok.is_control(i) else tok.token_bytes(i)
                           for i in range(tok.vocab_size)]
            self.special_token_ids = [i for i in range(tok.vocab_size) if tok.is_control(i)]
            self.is_tokenizer_wrapper = True
            self._accepts_bytes = False
            self._gtokenizer = lambda s: tok.encode(s, special=False, add_bos=False)

    stops = sorted(tok.special.stop_ids) or None
    lt = llguidance.LLTokenizer(_Wrapper(), eos_token=stops)
    tok._llg = lt
    return lt


def check(grammar: str, tok) -> None:
    """Raise GrammarError with llguidance's reason when `grammar` does not compile."""
    _need()
    err = llguidance.LLMatcher.validate_grammar(grammar, _lltokenizer(tok))
    if err:
        raise GrammarError(err)


class Constraint:
    """One sequence's grammar state: mask the logits, then accept the chosen token."""

    def __init__(self, grammar: str, tok):
        _need()
        self.vocab = tok.vocab_size
        self.matcher = llguidance.LLMatcher(_lltokenizer(tok), grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self._mask = np.full((self.vocab + 31) // 32, -1, dtype=np.int32)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` with every token the grammar forbids at -inf."""
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[:len(logits)].astype(bool)
        out = np.full_like(logits, -np.inf)
        out[allowed] = logits[allowed]
        return out

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} was refused by the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the answer ends here)."""
        return self.matcher.is_stopped()
