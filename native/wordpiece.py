"""WordPiece as llama.cpp tokenizes it (llama-vocab.cpp, llm_tokenizer_wpm_session): BERT-family
embedders and rerankers (`tokenizer.ggml.model == "bert"`).

The vocabulary is in llama.cpp's phantom-space form: a piece that starts a word carries "▁"
("▁the"), a continuation does not ("ing" — BERT's "##ing"), so each word is looked up with "▁"
in front. Text is split into words at whitespace and around every punctuation mark, ASCII symbol
and CJK ideograph; control characters vanish; with `lowercase` (and `strip_accents`, on with it
unless the file says otherwise) letters are lowered and combining marks dropped after each
character is replaced by the first of its canonical decomposition, as llama.cpp's NFD does. A
word is then the longest vocabulary pieces from left to right; a word with any part no piece
covers becomes one [UNK].
"""

from __future__ import annotations

import unicodedata

import numpy as np

PHANTOM = "▁"


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


# unicode.cpp's whitespace set (\s as llama.cpp's flags define it)
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                         0x2028, 0x2029, 0x202F, 0x205F, 0x3000])


def _first_of_nfd(ch: str) -> str:
    """llama.cpp's unicode_cpts_normalize_nfd maps a code point to one code point: the first of
    its canonical decomposition."""
    d = unicodedata.decomposition(ch)
    if not d or d.startswith("<"):
        return ch
    return _first_of_nfd(chr(int(d.split()[0], 16)))


class WordPiece:
    def __init__(self, tokens: list[str], unk: int, lowercase: bool, strip_accents: bool):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.unk = unk
        self.lowercase, self.strip_accents = lowercase, strip_accents
        # the longest piece in UTF-8 bytes bounds the match (llama.cpp's max_token_len)
        self.longest = max((len(t) for t in tokens), default=1)

    def words(self, text: str) -> list[str]:
        out, word = [], []
        for ch in text:
            if self.strip_accents:
                ch = _first_of_nfd(ch)
            cp = ord(ch)
            if cp in _WHITESPACE:
                if word:
                    out.append("".join(word))
                    word = []
                continue
            cat = unicodedata.category(ch)
            if cp == 0 or cp == 0xFFFD or cat[0] == "C":
                continue
            if self.strip_accents and cat[0] == "M":
                continue
            if self.lowercase:
                low = ch.lower()
                ch = low if len(low) == 1 else ch          # llama.cpp lowers one code point to one
            if cat[0] == "P" or (cp < 0x7F and cat[0] == "S") or _is_cjk(cp):
                if word:
                    out.append("".join(word))
                    word = []
                out.append(ch)
            else:
                word.append(ch)
        if word:
            out.append("".join(word))
        return out

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self.words(text):
            w = PHANTOM + word
            start, pieces = 0, []
            while start < len(w):
                for end in range(min(len(w), start + self.longest), start, -1):
                    tid = self.ids.get(w[start:end])
                    if tid is not None:
                        pieces.append(tid)
                        start = end
                        break
                else:
                    pieces = None                      # a part no piece covers: the word is [UNK]
                    break
            ids.extend(pieces if pieces else [self.unk])
        return ids


def build_wordpiece(tok, gguf) -> WordPiece:
    """A GGUF's WordPiece vocabulary (`tokenizer.ggml.model` "bert") checked and built, with
    llama.cpp's defaults for what the file leaves out (BERT's ids: UNK 100, CLS 101, SEP 102).
    `tok`: the GGUFTokenizer being built (its tokens); sets its `sep`."""
    from .vocabulary import bad
    meta, n = gguf.metadata, len(tok.tokens)
    unk, sep, bos = (meta.get(f"tokenizer.ggml.{k}_token_id", d)
                     for k, d in (("unknown", 100), ("seperator", 102), ("bos", 101)))
    for key, tid in (("unknown", unk), ("seperator", sep), ("bos", bos)):
        if isinstance(tid, bool) or not isinstance(tid, (int, np.integer)) or not 0 <= tid < n:
            raise bad(gguf, f"tokenizer.ggml.{key}_token_id", f"{tid!r} is not a token id (the vocabulary "
                                                               f"has {n} tokens)")
    tok.sep = int(sep)
    lower = bool(meta.get("tokenizer.ggml.normalizer.lowercase", False))
    return WordPiece(tok.tokens, int(unk), lower, bool(meta.get("tokenizer.ggml.normalizer.strip_accents", lower)))
