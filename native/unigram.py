"""SentencePiece unigram as llama.cpp tokenizes it (llama-vocab.cpp, llm_tokenizer_ugm):
`tokenizer.ggml.model == "t5"` — XLM-RoBERTa's vocabulary (bge-m3, bge-reranker-v2-m3,
multilingual-e5), T5's.

Text is first normalized by the file's `precompiled_charsmap` (SentencePiece's compiled NFKC
rules: an XOR-compressed double array mapping the longest matching prefix of bytes to a
replacement), spaces escaped as "▁", a space put in front (add_space_prefix) and runs of spaces
merged (remove_extra_whitespaces). Then the Viterbi best split by piece scores, one code point at a
time; a code point no piece starts becomes [UNK] at the lowest normal score minus 10, and
consecutive unknowns are one [UNK]. User-defined pieces score 0 and are never split by the
normalizer. Scores are summed in double, as SentencePiece and llama.cpp do.
"""

from __future__ import annotations

import numpy as np

SPACE = "▁".encode()
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 1, 2, 3, 4, 5
UNK_PENALTY = 10.0


def _utf8_len(b: int) -> int:
    """llama.cpp's unicode_len_utf8: the sequence length a lead byte announces (1 for a stray one)."""
    return 1 if b < 0xC0 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4


class CharsMap:
    """The precompiled charsmap: a uint32 blob size, the XCDA entries, then NUL-terminated
    replacement strings. An index outside the array ends a match (llama.cpp throws there)."""

    def __init__(self, blob: bytes):
        if len(blob) < 4:
            raise ValueError("precompiled_charsmap is shorter than its 4-byte size header")
        size = int.from_bytes(blob[:4], "little")
        if size + 4 >= len(blob) or size % 4:
            raise ValueError(f"precompiled_charsmap: its array of {size} bytes does not fit the {len(blob)} given")
        self.xcda = np.frombuffer(blob[4:4 + size], "<u4").astype(np.int64).tolist()
        self.replacements = blob[4 + size:]

    def _node(self, i: int) -> int | None:
        return self.xcda[i] if 0 <= i < len(self.xcda) else None

    @staticmethod
    def _base(node: int) -> int:
        return (node >> 10) << ((node & (1 << 9)) >> 6)

    def longest(self, data: bytes, at: int) -> tuple[bytes, int] | None:
        """(replacement, bytes consumed) of the longest prefix of data[at:] the map rewrites."""
        root = self._node(0)
        if root is None:
            return None
        index, found = self._base(root), None
        for pos in range(at, len(data)):
            c = data[pos]
            if c == 0:
                break
            index ^= c
            node = self._node(index)
            if node is None or node & ((1 << 31) | 0xFF) != c:
                break
            leaf = (node >> 8) & 1
            index ^= self._base(node)
            if leaf:
                value = self._node(index)
                if value is None:
                    break
                found = (pos - at + 1, value & ((1 << 31) - 1))
        if found is None:
            return None
        length, offset = found
        end = self.replacements.find(b"\0", offset)
        if offset >= len(self.replacements) or end < 0:
            raise ValueError("precompiled_charsmap: a replacement string runs past the map's end")
        return self.replacements[offset:end], length


class Unigram:
    def __init__(self, tokens: list[str], types: list[int], scores, unk: int, charsmap: bytes | None,
                 add_space_prefix: bool, remove_extra_whitespaces: bool):
        self.unk = unk
        self.pieces: dict[bytes, int] = {}
        self.user: set[bytes] = set()
        self.scores = [float(s) for s in scores]
        self.user_ids = set()
        normal = [self.scores[i] for i, t in enumerate(types) if t == NORMAL]
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty in (NORMAL, USER_DEFINED, UNUSED):
                self.pieces[t.encode()] = i                 # the trie keeps the last id of a text
            if ty == USER_DEFINED:
                self.user.add(t.encode())
                self.user_ids.add(i)
        self.longest = max((len(p) for p in self.pieces), default=1)
        self.longest_user = max((len(p) for p in self.user), default=0)
        low = np.float32(min(normal, default=np.finfo(np.float32).max))
        self.unk_score = float(low - np.float32(UNK_PENALTY))         # in float, as llama.cpp
        self.charsmap = CharsMap(charsmap) if charsmap else None
        self.prepend, self.merge = add_space_prefix, remove_extra_whitespaces

    def _normalize_prefix(self, data: bytes, at: int) -> tuple[bytes, int]:
        for n in range(min(self.longest_user, len(data) - at), 0, -1):     # a user-defined piece, unchanged
            if data[at:at + n] in self.user:
                return data[at:at + n], n
        if self.charsmap is not None:
            hit = self.charsmap.longest(data, at)
            if hit is not None:
                return hit
        lead = data[at]
        n = _utf8_len(lead)
        seq = data[at:at + n]
        if not 0x80 <= lead < 0xC0 and lead < 0xF8 and len(seq) == n and all(0x80 <= b < 0xC0 for b in seq[1:]):
            return seq, n                                  # a valid sequence, unchanged
        return "\ufffd".encode(), 1                        # else U+FFFD for one byte

    def normalize(self, text: str) -> bytes:
        data, out = text.encode("utf-8", "surrogatepass"), bytearray()
        prepended = in_word = False
        at = 0
        while at < len(data):
            piece, used = self._normalize_prefix(data, at)
            for c in piece:
                if c != 0x20:
                    if not in_word:
                        in_word = True
                        if (self.prepend and not prepended) or self.merge:
                            out += SPACE
                            prepended = True
                    out.append(c)
                else:
                    in_word = False
                    if not self.merge:
                        out += SPACE
            at += used
        return bytes(out)

    def encode(self, text: str) -> list[int]:
        data = self.normalize(text)
        n = len(data)
        if not n:
            return []
        best: list[tuple[int, int, float]] = [(self.unk, 0, -np.inf)] * (n + 1)     # (token, start, score)
        best[0] = (self.unk, 0, 0.0)
        at = 0
        while at < n:
            width = min(_utf8_len(data[at]), n - at)
            here = best[at][2]
            whole = False
            for end in range(at + 1, min(n, at + self.longest) + 1):
                tid = self.pieces.get(data[at:end])
                if tid is None:
                    continue
                whole |= end - at == width
                score = here + (0.0 if tid in self.user_ids else self.scores[tid])
                if score > best[end][2]:
                    best[end] = (tid, at, score)
            if not whole:
                score = here + self.unk_score
                if score > best[at + width][2]:
                    best[at + width] = (self.unk, at, score)
            at += width
        ids, end, prev_unknown = [], n, False
        while True:
            tid, start, _ = best[end]
            unknown = tid == self.unk
            if not (prev_unknown and unknown):
                ids.append(tid)
            if start == 0:
                break
            prev_unknown, end = unknown, start
        return ids[::-1]
