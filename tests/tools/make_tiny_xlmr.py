"""tests/data/tiny/tiny-xlmr-rerank.gguf and its llama.cpp reference: bge-reranker-v2-m3's kind of
model — BERT's encoder (the `bert` architecture, as llama.cpp converts XLM-RoBERTa) with a
SentencePiece unigram vocabulary (`tokenizer.ggml.model` "t5", its precompiled NFKC charsmap,
add_space_prefix, remove_extra_whitespaces), <s> … </s></s> … </s> pairs, pooling rank.

The vocabulary is a real SentencePiece model, trained here on a small multilingual corpus with
SentencePiece's default normalization (nmt_nfkc) — `pip install sentencepiece` to run this tool;
Kiln itself does not use the package. The reference: llama.cpp's tokens for every text (with and
without specials) and its rank scores on llama-server's rerank prompt.

    python tests/tools/make_tiny_xlmr.py
"""

import json
import sys
import tempfile
from pathlib import Path

from gguf import GGMLQuantizationType as Q

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_tiny_bert import PAIRS, TEXTS, write_bert  # noqa: E402

TINY = HERE.parent / "data" / "tiny"
CORPUS = TEXTS + [
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le renard brun rapide saute par-dessus le chien paresseux. Où est la gare ?",
    "El zorro marrón rápido salta sobre el perro perezoso. ¿Dónde está?",
    "東京は日本の首都です。北京は中国の首都です。",
    "Ｆｕｌｌｗｉｄｔｈ ｌｅｔｔｅｒｓ and the ﬁ ligature, ① circled, ½ fractions",
    "Москва — столица России. Київ — столиця України.",
    "what is the capital of france paris is the capital of france",
    "kiln fire bakes clay pottery in a hot oven every day",
] * 3
EXTRA_TEXTS = ["Ｆｕｌｌｗｉｄｔｈ ＡＢＣ and ﬁne ligatures ½", "Москва — столица", "東京は日本の首都です。",
               "tabs\tand   runs    of spaces", "", "   ", "zoo xylophone qwerty"]


def train(tmp: Path):
    import sentencepiece as spm
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp / "sp"), vocab_size=320,
                                   model_type="unigram", character_coverage=0.9995, bos_id=1, eos_id=2, unk_id=0,
                                   pad_id=-1, user_defined_symbols=["<mask>"], hard_vocab_limit=False)
    from sentencepiece import sentencepiece_model_pb2 as model
    proto = model.ModelProto()
    proto.ParseFromString((tmp / "sp.model").read_bytes())
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "sp.model"))
    return proto, sp


def write(out: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        proto, sp = train(Path(d))
    tokens, types, scores = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        types.append(2 if sp.IsUnknown(i) else 3 if sp.IsControl(i) else 5 if sp.IsUnused(i)
                     else 6 if sp.IsByte(i) else 4 if proto.pieces[i].type == 4 else 1)
    ns = proto.normalizer_spec

    def vocab(w) -> None:
        w.add_tokenizer_model("t5")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_token_type_count(1)
        w.add_add_space_prefix(ns.add_dummy_prefix)
        w.add_remove_extra_whitespaces(ns.remove_extra_whitespaces)
        w.add_precompiled_charsmap(ns.precompiled_charsmap)
        w.add_bos_token_id(1)           # <s>
        w.add_eos_token_id(2)           # </s>
        w.add_sep_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)

    write_bert(out, tokens, types, rank=True, seed=21, qt=Q.F16, vocab=vocab)


def main() -> None:
    import llama_cpp
    out = TINY / "tiny-xlmr-rerank.gguf"
    write(out)
    llm = llama_cpp.Llama(str(out), n_ctx=128, n_batch=128, n_ubatch=128, embedding=True, pooling_type=4,
                          n_threads=2, verbose=False)
    ref = {"model": out.name, "llama_cpp_python": llama_cpp.__version__, "tokenize": [], "pairs": []}
    for t in TEXTS + EXTRA_TEXTS:
        ref["tokenize"].append({"text": t, "ids": llm.tokenize(t.encode(), add_bos=True, special=False),
                                "ids_special": llm.tokenize(t.encode(), add_bos=True, special=True),
                                "ids_bare": llm.tokenize(t.encode(), add_bos=False, special=False)})
    tok = lambda s: llm.tokenize(s.encode(), add_bos=False, special=False)      # noqa: E731
    for query, docs in PAIRS:
        row = {"query": query, "documents": docs, "ids": [], "scores": []}
        for d in docs:
            ids = [1] + tok(query) + [2] + [2] + tok(d) + [2]      # format_prompt_rerank: BOS q EOS SEP d EOS
            plain = llm.tokenize
            llm.tokenize = lambda text, *a, _ids=ids, **k: list(_ids)      # embed() tokenizes its text
            try:
                row["scores"].append(float(llm.embed(f"{len(row['ids'])}", normalize=False)[0]))
            finally:
                llm.tokenize = plain
            row["ids"].append(ids)
        ref["pairs"].append(row)
    (TINY / "tiny-xlmr-rerank.json").write_text(json.dumps(ref, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
