"""A SentencePiece vocabulary in a GGUF, and llama.cpp's token ids for a set of texts, so that
tests/test_tokenizer_spm.py can hold Kiln's SentencePiece path to llama.cpp's (`llm_tokenizer_spm`).

No real Gemma/Llama-2 GGUF is reachable from this machine (registries only), so the vocabulary is
trained here with the `sentencepiece` library on the text its own sdist ships (test/botchan.txt),
with the options Gemma's tokenizer.model has (BPE, byte fallback, split digits, no dummy prefix,
whitespace kept, user-defined turn markers and whitespace runs) — or Llama-2's (dummy prefix) —
and converted as convert_hf_to_gguf.py's `_create_vocab_sentencepiece` does (piece, score, type).

    pip download --no-deps --no-binary :all: sentencepiece   # for test/botchan.txt
    python tests/tools/make_spm_vocab.py botchan.txt tests/data/spm

Needs sentencepiece and llama-cpp-python; session tool, not a test dependency.
"""

import json
import sys
import tempfile
from pathlib import Path

import gguf
import sentencepiece as spm
from llama_cpp import Llama

HERE = Path(__file__).resolve().parents[1]
TEMPLATE = HERE / "data" / "tiny" / "tiny-gemma3.gguf"   # architecture metadata to copy

# What the texts exercise: plain words, leading/trailing/multiple spaces, newlines and tabs, digits
# (split one by one), unseen characters (byte fallback), CJK/emoji, the user-defined turn markers
# in the middle of text, pieces that tie in score, and the empty string.
TEXTS = [
    "Hello world", " Hello world", "Hello  world", "   leading and trailing   ",
    "It was a dark and stormy night.", "I have been a scamp since I was a child.",
    "The year 2025 had 365 days; π ≈ 3.14159.", "line one\nline two\n\n\tindented",
    "naïve café — déjà vu", "日本語のテキスト", "emoji 🙂🚀 and ZWJ 👩‍💻",
    "<start_of_turn>user\nWho are you?<end_of_turn>\n<start_of_turn>model\n",
    "a<start_of_turn>b", "  <end_of_turn>  ", "aaaaaaaaaaaaaaaa", "the the the the",
    "botchan's father said: \"Don't!\"", "x" * 3 + " " * 5 + "y", "", " ", "\n",
    "Mixed CASE and under_scores, URLs like https://example.com/a?b=c#d",
    "<|user|>\nHello there <|end|>\n<|assistant|>\n  Hi<|end|>  ",
]


USER_DEFINED = ["<start_of_turn>", "<end_of_turn>", "▁▁", "▁▁▁▁", "\n\n"]
PHI3_CONTROL = ["<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]
# name, Llama-2-style dummy prefix, general.name (llama.cpp gives "phi-3" models' specials rstrip)
VARIANTS = [("gemma-like", False, "gemma-like test vocabulary"),
            ("llama-like", True, "llama-like test vocabulary"),
            ("phi3-like", True, "Phi-3 like test vocabulary")]


def train(corpus: str, prefix: str, dummy_prefix: bool) -> spm.SentencePieceProcessor:
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=prefix, vocab_size=1200, model_type="bpe",
        byte_fallback=True, split_digits=True, add_dummy_prefix=dummy_prefix,
        remove_extra_whitespaces=False, normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        user_defined_symbols=USER_DEFINED + PHI3_CONTROL,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def write_gguf(sp: spm.SentencePieceProcessor, out: Path, dummy_prefix: bool, name: str) -> None:
    src = gguf.GGUFReader(str(TEMPLATE))
    w = gguf.GGUFWriter(str(out), "gemma3")
    for key, field in src.fields.items():
        if key.startswith(("tokenizer.", "GGUF.", "general.architecture", "general.name")):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            continue
        w.add_key_value(key, field.contents(), vtype)
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i).encode())
        scores.append(sp.get_score(i))
        types.append(gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL
                     if sp.is_control(i) else gguf.TokenType.UNUSED if sp.is_unused(i)
                     else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.NORMAL)
    for piece in USER_DEFINED + PHI3_CONTROL:
        types[sp.piece_to_id(piece)] = gguf.TokenType.USER_DEFINED
    if "phi" in name.lower():
        for piece in PHI3_CONTROL:
            types[sp.piece_to_id(piece)] = gguf.TokenType.CONTROL
    w.add_name(name)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(dummy_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(corpus: str, out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, dummy_prefix, general_name in VARIANTS:
        with tempfile.TemporaryDirectory() as tmp:
            sp = train(corpus, f"{tmp}/{name}", dummy_prefix)
            path = out / f"spm-{name}.gguf"
            write_gguf(sp, path, dummy_prefix, general_name)
        llm = Llama(str(path), vocab_only=True, verbose=False)
        cases = []
        for text in TEXTS:
            for special in (True, False):
                ids = llm.tokenize(text.encode(), add_bos=True, special=special)
                cases.append({"text": text, "special": special, "ids": list(ids)})
        json.dump({"model": path.name, "made_with": "llama-cpp-python (vocab_only)", "cases": cases},
                  open(out / f"spm-{name}.json", "w"), ensure_ascii=False, indent=0)
        print(path, path.stat().st_size, "bytes,", len(cases), "cases")


if __name__ == "__main__":
    main(*sys.argv[1:])
