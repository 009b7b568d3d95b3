"""Encoder models against llama.cpp (tests/tools/make_tiny_bert.py made the references with
llama-cpp-python's `embed`): BERT's WordPiece tokens, its embeddings under every pooling, the
reranker's scores, a chat model's mean and last-token pooling; inputs batched into one forward
give what each gives alone; a hostile encoder file is refused naming what is wrong."""

import json
import shutil

import numpy as np
import pytest

from conftest import DATA
from gguf_copy import copy_gguf
from kiln.native.encoder import load_encoder
from kiln.native.generate import embed
from kiln.native.gguf_file import GGUFError
from kiln.native.model import load_model
from kiln.native.models.inspect import capabilities, inspect_model
from kiln.native.models.plan import plan
from kiln.native.gguf_file import read_gguf
from kiln.native.rerank import CausalRanker

TINY = DATA / "tiny"
REF = json.loads((TINY / "tiny-bert.json").read_text())
NPZ = np.load(TINY / "tiny-bert.npz")
RANKS = json.loads((TINY / "tiny-bert-rerank.json").read_text())


def cosine(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def embedder():
    return load_encoder(TINY / "tiny-bert.gguf")


@pytest.fixture(scope="module")
def nomic():
    return load_encoder(TINY / "tiny-nomic-bert.gguf")


@pytest.fixture(scope="module")
def jina():
    return load_encoder(TINY / "tiny-jina-bert-v2.gguf")


@pytest.fixture(scope="module")
def modern():
    return load_encoder(TINY / "tiny-modern-bert.gguf")


@pytest.fixture(scope="module")
def reranker():
    return load_encoder(TINY / "tiny-bert-rerank.gguf")


def test_wordpiece_tokens_are_llama_cpps(embedder):
    tok = embedder.tokenizer
    for case in REF["tokenize"]:
        assert tok.encode(case["text"], special=False) == case["ids"], case["text"]
        assert tok.encode(case["text"], special=True) == case["ids_special"], case["text"]
        assert tok.encode(case["text"], special=False, add_bos=False) == case["ids_bare"], case["text"]
    unk = tok.id_of("[UNK]")
    assert unk in REF["tokenize"][8]["ids"]                     # a glyph no piece covers: its word is [UNK]


@pytest.mark.parametrize("family", ["bert", "nomic-bert", "jina-bert-v2", "modern-bert"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "last", "none"])
def test_embeddings_meet_llama_cpp_under_every_pooling(embedder, nomic, jina, modern, family, pooling):
    """BERT (learned positions, GELU), nomic-bert (rotary positions, fused q|k|v, SwiGLU),
    jina-bert-v2 (ALiBi, q/k LayerNorms, GELU-gated with the gate fused into up) and modern-bert
    (pre-norm without biases, local layers with their own rope base and a symmetric window)."""
    model, prefix = {"bert": (embedder, ""), "nomic-bert": (nomic, "nomic_"), "jina-bert-v2": (jina, "jina_"),
                     "modern-bert": (modern, "modern_")}[family]
    inputs = [case["ids"] for case in REF["tokenize"]]
    for i, got in enumerate(model.pooled(inputs, pooling)):
        want = NPZ[f"{prefix}{pooling}_{i}"]
        assert got.shape == want.shape
        rows = zip(got, want) if pooling == "none" else [(got, want)]
        assert min(cosine(g, w) for g, w in rows) >= 0.9999, (pooling, i)
        assert np.abs(got - want).max() < 5e-3


def test_inputs_in_one_forward_give_what_each_gives_alone(embedder):
    inputs = [case["ids"] for case in REF["tokenize"]]
    together = embedder.pooled(inputs)
    for ids, v in zip(inputs, together):
        assert np.array_equal(embedder.pooled([ids])[0], v)


def test_rerank_scores_and_order_are_llama_cpps(reranker):
    tok = reranker.tokenizer
    for pair in RANKS["pairs"]:
        query = tok.encode(pair["query"], special=False, add_bos=False)
        prompts = [reranker.rank_prompt(query, tok.encode(d, special=False, add_bos=False)) for d in pair["documents"]]
        assert prompts == pair["ids"]                     # llama-server's [CLS] query [SEP] document
        scores = [float(s[0]) for s in reranker.pooled(prompts)]
        assert np.abs(np.array(scores) - pair["scores"]).max() <= 1e-4, (scores, pair["scores"])
        assert np.argsort(scores).tolist() == np.argsort(pair["scores"]).tolist()


def test_a_modern_bert_reranker_scores_as_llama_cpp():
    """gte-reranker-modernbert's head: the mean of the states, a dense layer, GELU, a head norm, one
    score. The mean is summed in an order not ggml's (≤ 2.4e-7 apart, docs/retrieval.md), which
    GELU's fp16 table can round apart: 6 of 7 scores are llama.cpp's bits, all within 1e-3."""
    ref = json.loads((TINY / "tiny-modern-bert-rerank.json").read_text())
    m = load_encoder(TINY / "tiny-modern-bert-rerank.gguf")
    assert (m.config.pooling, m.config.pooling_cls) == ("rank", "mean")
    tok, exact, total = m.tokenizer, 0, 0
    for pair in ref["pairs"]:
        query = tok.encode(pair["query"], special=False, add_bos=False)
        prompts = [m.rank_prompt(query, tok.encode(d, special=False, add_bos=False)) for d in pair["documents"]]
        scores = [float(s[0]) for s in m.pooled(prompts)]
        assert np.abs(np.array(scores) - pair["scores"]).max() <= 1e-3, (scores, pair["scores"])
        assert np.argsort(scores).tolist() == np.argsort(pair["scores"]).tolist()
        exact += sum(a == b for a, b in zip(scores, pair["scores"]))
        total += len(scores)
    assert exact >= total - 1, (exact, total)


def test_an_xlm_roberta_reranker_tokenizes_and_scores_as_llama_cpp():
    """bge-reranker-v2-m3's kind (tests/tools/make_tiny_xlmr.py): a SentencePiece unigram vocabulary
    with its NFKC charsmap — fullwidth letters, ligatures, Cyrillic, CJK, runs of spaces, empty
    text — and <s> q </s></s> d </s> pairs, scored as llama.cpp scores them."""
    ref = json.loads((TINY / "tiny-xlmr-rerank.json").read_text())
    m = load_encoder(TINY / "tiny-xlmr-rerank.gguf")
    tok = m.tokenizer
    for case in ref["tokenize"]:
        assert tok.encode(case["text"], special=False) == case["ids"], case["text"]
        assert tok.encode(case["text"], special=True) == case["ids_special"], case["text"]
        assert tok.encode(case["text"], special=False, add_bos=False) == case["ids_bare"], case["text"]
    for pair in ref["pairs"]:
        query = tok.encode(pair["query"], special=False, add_bos=False)
        prompts = [m.rank_prompt(query, tok.encode(d, special=False, add_bos=False)) for d in pair["documents"]]
        assert prompts == pair["ids"]
        assert [float(s[0]) for s in m.pooled(prompts)] == pair["scores"]


def test_a_corrupt_charsmap_is_refused_naming_it(tmp_path):
    """The charsmap's size header patched in place to claim more bytes than the array holds."""
    data = bytearray((TINY / "tiny-xlmr-rerank.gguf").read_bytes())
    key = b"tokenizer.ggml.precompiled_charsmap"
    at = data.index(key) + len(key) + 4 + 4 + 8            # value type, element type, count
    data[at:at + 4] = (0x7FFFFFFF).to_bytes(4, "little")
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(GGUFError, match="precompiled_charsmap.*does not fit"):
        load_encoder(tmp_path / "bad.gguf")


def test_a_causal_reranker_scores_as_llama_cpp():
    """Qwen3-Reranker's layout (tests/tools/make_tiny_qwen3_rerank.py): its rerank template
    tokenized as llama-server does, P(yes) from the answers' head — llama.cpp's bits."""
    ref = json.loads((TINY / "tiny-qwen3-rerank.json").read_text())
    m = load_model(TINY / "tiny-qwen3-rerank.gguf")
    ranker = CausalRanker(m)
    assert m.config.pooling == "rank" and capabilities(read_gguf(TINY / "tiny-qwen3-rerank.gguf"))[-1] == "rerank"
    for pair in ref["pairs"]:
        prompts = [ranker.prompt(pair["query"], d) for d in pair["documents"]]
        assert prompts == pair["ids"]
        scores = [ranker.score(p) for p in prompts]
        assert np.abs(np.array(scores) - [s[0] for s in pair["scores"]]).max() <= 1e-6, (scores, pair["scores"])
        assert np.argsort(scores).tolist() == np.argsort([s[0] for s in pair["scores"]]).tolist()
    with pytest.raises(GGUFError, match="cls.output.weight"):
        CausalRanker(load_model(TINY / "tiny-qwen3.gguf"))


def test_a_chat_model_pools_by_mean_or_last_token_as_llama_cpp():
    m = load_model(TINY / "tiny-qwen3.gguf")
    for pooling in ("mean", "last"):
        for i in range(4):
            ids = [int(t) for t in NPZ[f"qwen3_ids_{i}"]]
            got = embed(m, ids, normalize=False, pooling=pooling)
            assert cosine(got, NPZ[f"qwen3_{pooling}_{i}"]) >= 0.99999


def test_capabilities_plan_and_inspect_say_what_an_encoder_is():
    assert capabilities(read_gguf(TINY / "tiny-bert.gguf")) == ["embedding"]
    assert capabilities(read_gguf(TINY / "tiny-nomic-bert.gguf")) == ["embedding"]
    assert capabilities(read_gguf(TINY / "tiny-jina-bert-v2.gguf")) == ["embedding"]
    assert capabilities(read_gguf(TINY / "tiny-modern-bert.gguf")) == ["embedding"]
    assert capabilities(read_gguf(TINY / "tiny-bert-rerank.gguf")) == ["rerank"]
    assert capabilities(read_gguf(TINY / "tiny-llama.gguf"))[:2] == ["completion", "tools"]
    info = inspect_model(TINY / "tiny-bert-rerank.gguf")
    assert (info["architecture"], info["pooling"], info["memory"]["kv_cache_bytes"]) == ("bert", "rank", 0)
    p = plan(TINY / "tiny-bert.gguf", available=2**30)
    assert p["verdict"] == "fits" and p["kv_cache_bytes"] == 0 and p["context"] == 128


@pytest.mark.parametrize("drop, meta, words", [
    (("blk.1.ffn_up.weight",), None, "blk.1.ffn_up.weight"),
    ((), {"bert.attention.head_count": 3}, "must divide embedding_length"),
    ((), {"bert.block_count": 9}, "the file holds layers 0..2"),
    ((), {"bert.pooling_type": 9}, "bert.pooling_type = 9"),
    (("cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias"), None, "needs a classification head"),
])
def test_a_hostile_encoder_is_refused_naming_what_is_wrong(tmp_path, drop, meta, words):
    out = tmp_path / "bad.gguf"
    copy_gguf(TINY / "tiny-bert-rerank.gguf", out, drop=drop, meta=meta)
    with pytest.raises(GGUFError, match=words.replace(".", r"\.")):
        load_encoder(out)


def test_an_encoder_refuses_inputs_it_cannot_hold(embedder, tmp_path):
    with pytest.raises(ValueError, match="1..128 token ids"):
        embedder.pooled([[2] * 129])
    with pytest.raises(ValueError, match="no classification head"):
        embedder.pooled([[2, 3]], "rank")
    shutil.copy(TINY / "tiny-bert.gguf", tmp_path / "copy.gguf")
    assert load_encoder(tmp_path / "copy.gguf").config.pooling == "mean"


def test_private_weights_give_the_mapped_embeddings_bit_for_bit(embedder):
    private = load_encoder(TINY / "tiny-bert.gguf", weights="private")
    assert private.gguf.private is not None and embedder.gguf.private is None
    ids = [embedder.tokenizer.encode(t, special=False) for t in ("hello world", "a longer sentence here")]
    for a, b in zip(embedder.pooled(ids), private.pooled(ids)):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    with pytest.raises(ValueError, match="weights = 'shared': must be mapped or private"):
        load_encoder(TINY / "tiny-bert.gguf", weights="shared")
