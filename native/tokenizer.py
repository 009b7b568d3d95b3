"""Tokenizer built from GGUF metadata into a HF `tokenizers.Tokenizer`.

Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) uses the pre-tokenizer regexes llama.cpp
selects by `tokenizer.ggml.pre`; SentencePiece-style vocabularies (`"llama"`) become a BPE with
merges derived from the piece scores and byte fallback, as HF's LlamaConverter builds them.

Decoding goes through a per-token byte table so that it is lossless: streaming callers feed ids
to `StreamDecoder`, which holds back a partial UTF-8 sequence until the next token completes it.
"""

from __future__ import annotations

import codecs
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .gguf_file import GGUFFile
from .fim import find_fim_tokens
from .vocabulary import SPM_SPLIT_BUDGET, TokenizerError, bad, building, check_vocabulary
from .unigram_vocab import build_unigram
from .wordpiece import build_wordpiece

# llama.cpp token types
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the regex sequence llama.cpp applies (each splits the pieces of the last).
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [_GPT2], "mpt": [_GPT2], "olmo": [_GPT2], "jais": [_GPT2],
    "smollm": [r"\p{N}", _GPT2], "starcoder": [r"\p{N}", _GPT2], "refact": [r"\p{N}", _GPT2],
    "command-r": [r"\p{N}", _GPT2], "codeshell": [r"\p{N}", _GPT2], "exaone": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3], "llama-bpe": [_LLAMA3], "llama-v3": [_LLAMA3], "dbrx": [_LLAMA3],
    "smaug-bpe": [_LLAMA3], "qwen2": [_QWEN2], "stablelm2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
}


# Texts llama.cpp marks end-of-generation and forces to control type (FIM tokens included).
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                        "<|eom_id|>", "<EOT>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                        "<|fim_pad|>", "<|fim_repo|>", "<|repo_name|>", "<|file_sep|>"})

_KEEP_SPACE = frozenset({"<unk>", "<s>", "<|endoftext|>"})   # Phi-3 specials that do not rstrip

# Texts longer than this are tokenized with the GIL released (the library's `encode` holds it for
# the whole call: 2.5 s for 3.5 MB, during which the worker's heartbeat thread cannot run).
GIL_FREE_CHARS = 4096


class TooManyTokens(Exception):
    """Texts were refused before tokenizing: their bytes alone prove more tokens than the budget."""

    def __init__(self, at_least: int, budget: int, n_bytes: int, longest: int):
        super().__init__(f"the prompt has at least {at_least:,} tokens ({n_bytes:,} bytes of text, and no token "
                         f"of this model covers more than {longest} bytes), but the context holds {budget:,}; "
                         f"shorten the prompt")
        self.at_least, self.budget, self.n_bytes, self.longest = at_least, budget, n_bytes, longest


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass
class SpecialTokens:
    bos: int | None
    eos: int | None
    eot: int | None
    add_bos: bool
    add_eos: bool
    stop_ids: frozenset[int]       # tokens that end generation (EOS, EOT, EOM)


class GGUFTokenizer:
    """Encode/decode for one model, exactly as llama.cpp tokenizes it."""

    def __init__(self, gguf: GGUFFile):
        meta = gguf.metadata
        self.model_type = str(meta.get("tokenizer.ggml.model", ""))
        self.pre = str(meta.get("tokenizer.ggml.pre", "default"))
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError(f"{gguf.path}: no tokenizer.ggml.tokens in the metadata; "
                                 f"this GGUF has no vocabulary")
        check_vocabulary(gguf, tokens)
        self.tokens: list[str] = list(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        self.token_types = [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * len(tokens)
        # llama.cpp makes end-of-generation tokens found by their text control tokens whatever
        # type the file gives them (llama-vocab.cpp: "control-looking token … will be overridden").
        for i, t in enumerate(self.tokens):
            if t in _EOG_TEXTS:
                self.token_types[i] = TOKEN_CONTROL
        self.fim, fim_by_text = find_fim_tokens(meta, self._vocab)
        for i in fim_by_text:
            self.token_types[i] = TOKEN_CONTROL
        # llama.cpp's Phi-3 rule: special tokens swallow the whitespace after them.
        name = str(meta.get("general.name", "")).lower()
        self._rstrip_specials = "phi-3" in name or "phi3" in name
        if self.model_type not in ("gpt2", "llama", "bert", "t5"):
            raise TokenizerError(f"{gguf.path}: tokenizer model {self.model_type!r} is not supported (supported: "
                                 f"'gpt2' byte-level BPE, 'llama' SentencePiece, 'bert' WordPiece, 't5' unigram)")
        self._wpm = self.sep = None
        with building(gguf, self.model_type):
            if self.model_type in ("bert", "t5"):    # our own: WordPiece and unigram (native/wordpiece.py, unigram.py)
                self._wpm = (build_wordpiece if self.model_type == "bert" else build_unigram)(self, gguf)
                self._tok = None
                self._token_bytes = self._spm_token_bytes(gguf)
            elif self.model_type == "gpt2":
                self._tok = self._build_bpe(gguf)
                self._token_bytes = self._bpe_token_bytes()
            else:
                self._tok = self._build_spm(gguf)
                self._token_bytes = self._spm_token_bytes(gguf)
            if self._tok is not None:
                self._add_specials()
        self.max_token_bytes = self._longest_cover()
        self._budget = threading.local()
        # A second instance with special-token parsing off, for untrusted text.
        if self._tok is not None:
            self._tok_plain = Tokenizer.from_str(self._tok.to_str())
            self._tok_plain.encode_special_tokens = True
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        eom = meta.get("tokenizer.ggml.eom_token_id")
        stops = {int(t) for t in (eos, eot, eom) if t is not None} | self.fim.ends
        # gpt-oss's harmony format: <|end|> closes each message (the analysis before the final
        # answer), so only <|return|> (the answer is done) and <|call|> (a tool call) end it
        self.harmony = all(t in self._vocab for t in HARMONY_MARKERS)
        ends = ("<|return|>", "<|call|>") if self.harmony else \
            ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
        if self.harmony:
            stops.discard(self._vocab["<|end|>"])
        # Chat models often end turns with a control token the metadata does not name as EOS.
        for name in ends:
            if name in self._vocab and self.token_types[self._vocab[name]] == TOKEN_CONTROL:
                stops.add(self._vocab[name])
        bos = meta.get("tokenizer.ggml.bos_token_id", 101 if self.model_type == "bert" else None)
        self.special = SpecialTokens(
            bos=int(bos) if bos is not None else None,
            eos=int(eos) if eos is not None else None,
            eot=int(eot) if eot is not None else None,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", self.model_type in ("llama", "bert"))),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", self.model_type == "t5")),
            stop_ids=frozenset(stops),
        )

    # -- construction -------------------------------------------------------------------------

    @property
    def _vocab(self) -> dict[str, int]:
        if not hasattr(self, "_vocab_cache"):
            self._vocab_cache = {t: i for i, t in enumerate(self.tokens)}
        return self._vocab_cache

    def _build_bpe(self, gguf) -> Tokenizer:
        merges = [tuple(m.split(" ", 1)) for m in gguf.metadata.get("tokenizer.ggml.merges", [])]
        tok = Tokenizer(models.BPE(self._vocab, merges, fuse_unk=False, ignore_merges=False))
        regexes = PRE_TOKENIZER_REGEXES.get(self.pre)
        if regexes is None:
            raise bad(gguf, "tokenizer.ggml.pre", f"pre-tokenizer {self.pre!r} is not supported (supported: "
                      f"{', '.join(sorted(PRE_TOKENIZER_REGEXES))})")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        return tok

    def _build_spm(self, gguf) -> Tokenizer:
        meta = gguf.metadata
        scores = meta.get("tokenizer.ggml.scores")
        vocab = self._vocab
        if sum(len(p) ** 2 for p in vocab) > SPM_SPLIT_BUDGET:
            raise bad(gguf, "tokenizer.ggml.tokens", f"pieces of up to {max(map(len, vocab)):,} characters are "
                       f"too long for a SentencePiece vocabulary")
        # llama.cpp's SPM session merges any two adjacent symbols whose text is a token — of any
        # type: a user-defined "▁▁" (score 0) beats every normal piece — highest score first.
        # As a BPE: every split of a piece into two pieces of the vocabulary, ranked by the
        # merged piece's score (higher first).
        ranked = []
        for piece, pid in vocab.items():
            for i in range(1, len(piece)):
                left, right = piece[:i], piece[i:]
                if left in vocab and right in vocab:
                    score = float(scores[pid]) if scores is not None else -pid
                    ranked.append((-score, vocab[left], vocab[right], left, right))
        ranked.sort()
        merges = [(left, right) for _, _, _, left, right in ranked]
        unk = next((t for t, ty in zip(self.tokens, self.token_types) if ty == TOKEN_UNKNOWN), None)
        tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        norm = [normalizers.Replace(" ", "▁")]
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            norm.insert(0, normalizers.Prepend("▁"))
        tok.normalizer = normalizers.Sequence(norm)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
        return tok

    def _add_specials(self) -> None:
        added = []
        for i, (t, ty) in enumerate(zip(self.tokens, self.token_types)):
            rstrip = self._rstrip_specials and t not in _KEEP_SPACE
            if ty == TOKEN_CONTROL:
                added.append(AddedToken(t, special=True, normalized=False, rstrip=rstrip))
            elif ty == TOKEN_USER_DEFINED:
                added.append(AddedToken(t, special=False, normalized=False, rstrip=rstrip))
        if added:
            self._tok.add_tokens(added)

    def _bpe_token_bytes(self) -> list[bytes]:
        dec = _byte_decoder()
        out = []
        for t, ty in zip(self.tokens, self.token_types):
            if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN) or any(c not in dec for c in t):
                out.append(t.encode("utf-8"))
            else:
                out.append(bytes(dec[c] for c in t))
        return out

    def _spm_token_bytes(self, gguf) -> list[bytes]:
        out = []
        for i, (t, ty) in enumerate(zip(self.tokens, self.token_types)):
            if ty == TOKEN_BYTE and t.startswith("<0x") and t.endswith(">"):
                try:
                    out.append(bytes([int(t[3:-1], 16)]))
                except ValueError:
                    raise bad(gguf, "tokenizer.ggml.tokens", f"byte token {i}, {t[:20]!r}, is not <0x00>..<0xFF>") \
                        from None
            else:
                out.append(t.replace("▁", " ").encode("utf-8"))
        return out

    def _longest_cover(self) -> int | None:
        """The most bytes of input text one token can stand for, or None when no such bound holds.
        Sets `_vanishing`: bytes a byte-level BPE drops because its vocabulary lacks them (SmolLM2
        has no token for 0x04): they count for nothing."""
        self._vanishing = b""
        if self._rstrip_specials:         # Phi-3's specials swallow any run of whitespace after them
            return None
        never = {0xC0, 0xC1, *range(0xF5, 0x100)}           # bytes UTF-8 text never holds
        if self.model_type == "gpt2":
            self._vanishing = bytes(b for c, b in sorted(_byte_decoder().items(), key=lambda cb: cb[1])
                                    if c not in self._vocab and b not in never)
        elif any(f"<0x{b:02X}>" not in self._vocab for b in range(256) if b not in never):
            return None                   # unknown characters fuse into one <unk> of any length
        # added tokens match the raw text (SentencePiece's "▁" is 3 bytes there, not a space)
        return max(max(len(b), len(t.encode("utf-8")) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED) else 0)
                   for b, t, ty in zip(self._token_bytes, self.tokens, self.token_types))

    @contextmanager
    def token_budget(self, limit: int):
        """On this thread, within the block, `encode` raises TooManyTokens before tokenizing once
        the texts it was given must hold more than `limit` tokens together: a text of B bytes has
        at least B // max_token_bytes tokens. Huge prompts are refused at the cost of counting bytes."""
        old = getattr(self._budget, "state", None)
        self._budget.state = [limit, 0, 0]          # limit, tokens proven so far, bytes so far
        try:
            yield
        finally:
            self._budget.state = old

    def _spend(self, text: str) -> None:
        state = getattr(self._budget, "state", None)
        if state is None or not self.max_token_bytes:
            return
        data = text.encode("utf-8", "surrogatepass")
        n_bytes = len(data) - sum(data.count(b) for b in self._vanishing)
        state[1] += n_bytes // self.max_token_bytes
        state[2] += n_bytes
        if state[1] > state[0]:
            raise TooManyTokens(state[1], state[0], state[2], self.max_token_bytes)

    # -- use ----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, *, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids for `text`. special=False tokenizes control-token markup as plain text
        (use it for anything a user typed). BOS is added when the model's metadata asks."""
        self._spend(text)
        if self._wpm is not None:
            return self._encode_wpm(text, special, add_bos)
        tok = self._tok if special else self._tok_plain
        if len(text) > GIL_FREE_CHARS:     # the batch call releases the GIL while it works
            ids = tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = tok.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.special.add_bos
        if add_bos and self.special.bos is not None:
            ids = [self.special.bos] + ids
        return ids

    def _encode_wpm(self, text: str, special: bool, add_special: bool | None) -> list[int]:
        """llama.cpp's WPM: [CLS] and [SEP] around the text when specials are added; its UGM: BOS
        and EOS as the vocabulary adds them."""
        ids = []
        for part, tid in (self.split_specials(text) if special else [(text, None)]):
            ids += [tid] if tid is not None else self._wpm.encode(part)
        sp = self.special
        if self.model_type == "t5":
            if add_special is None or add_special:
                ids = [sp.bos] * (sp.add_bos and sp.bos is not None) + ids + [sp.eos] * (sp.add_eos and sp.eos is not None)
            return ids
        if sp.add_bos if add_special is None else add_special:
            ids = [sp.bos, *ids, self.sep]
        return ids

    def split_specials(self, text: str) -> list[tuple[str, int | None]]:
        """Split trusted text (a template's markup) into plain runs and control tokens."""
        if not hasattr(self, "_special_re"):
            import re
            names = sorted((t for i, t in enumerate(self.tokens) if self.token_types[i] == TOKEN_CONTROL and t),
                           key=len, reverse=True)
            self._special_re = re.compile("|".join(map(re.escape, names))) if names else None
        if self._special_re is None:
            return [(text, None)]
        out, pos = [], 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                out.append((text[pos:m.start()], None))
            out.append((m.group(), self._vocab[m.group()]))
            pos = m.end()
        if pos < len(text):
            out.append((text[pos:], None))
        return out

    def id_of(self, piece: str) -> int | None:
        """The id of the token whose text is exactly `piece`, if there is one."""
        return self._vocab.get(piece)

    def rstrips(self, token_id: int) -> bool:
        """Whether this control token swallows the whitespace after it (llama.cpp's Phi-3 rule)."""
        return (self._rstrip_specials and self.token_types[token_id] == TOKEN_CONTROL
                and self.tokens[token_id] not in _KEEP_SPACE)

    def is_control(self, token_id: int) -> bool:
        return self.token_types[token_id] == TOKEN_CONTROL

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]

    def decode(self, ids, *, skip_control: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        parts = [self._token_bytes[i] for i in ids
                 if not (skip_control and self.token_types[i] == TOKEN_CONTROL)]
        return b"".join(parts).decode("utf-8", errors="replace")

    def stream_decoder(self, *, skip_control: bool = True, keep: frozenset[int] = frozenset()) -> "StreamDecoder":
        """`keep`: control tokens to show anyway (markers a caller parses, such as [TOOL_CALLS])."""
        return StreamDecoder(self, skip_control, keep)


class StreamDecoder:
    """Turns a stream of token ids into text pieces without ever splitting a UTF-8 character."""

    def __init__(self, tokenizer: GGUFTokenizer, skip_control: bool, keep: frozenset[int] = frozenset()):
        self._tok = tokenizer
        self._skip = skip_control
        self._keep = keep
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if self._skip and self._tok.is_control(token_id) and token_id not in self._keep:
            return ""
        return self._dec.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
