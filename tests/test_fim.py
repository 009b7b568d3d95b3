"""Fill-in-the-middle without a daemon: the markers found as llama.cpp finds them (and the ones
that end generation), and the prompt laid out as Ollama's templates and llama-server's /infill
lay it out, tokens exactly."""

import pytest

from conftest import tiny_path
from fim_model import build_fim_model
from kiln.native.fim import InfillError, find_fim_tokens, infill_prompt
from kiln.native.gguf_file import read_gguf
from kiln.native.tokenizer import GGUFTokenizer

PRE, SUF, MID, PAD, REP, SEP = range(269, 275)


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    return GGUFTokenizer(read_gguf(build_fim_model(tiny_path("qwen2"), tmp_path_factory.mktemp("fim") / "c.gguf")))


def test_the_markers_are_found_by_their_text_and_the_separators_end_generation(coder):
    f = coder.fim
    assert (f.pre, f.suf, f.mid, f.pad, f.rep, f.sep) == (PRE, SUF, MID, PAD, REP, SEP) and f.can_infill
    # llama.cpp makes the pad, repo and file separators end-of-generation: a code model writes
    # them when it would go on to another file
    assert {PAD, REP, SEP} <= coder.special.stop_ids and not {PRE, SUF, MID} & coder.special.stop_ids
    assert all(coder.is_control(t) for t in range(PRE, SEP + 1))
    plain = GGUFTokenizer(read_gguf(tiny_path("qwen2")))
    assert not plain.fim.can_infill and plain.special.stop_ids == coder.special.stop_ids - {PAD, REP, SEP}


def test_the_default_model_cannot_infill_but_stops_at_its_repo_marker(default_model_path):
    tok = GGUFTokenizer(read_gguf(default_model_path))
    # SmolLM2 has StarCoder's <reponame> (llama.cpp's FIM_REP, an end of generation) and no FIM markers
    assert tok.tokens[4] == "<reponame>" and tok.fim.rep == 4 and not tok.fim.can_infill
    assert 4 in tok.special.stop_ids
    with pytest.raises(InfillError, match="no fill-in-the-middle tokens"):
        infill_prompt(tok, "a", "b", n_ctx=2048)


def test_metadata_ids_win_over_the_text():
    vocab = {"<|fim_prefix|>": 0, "<PRE>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3}
    f, by_text = find_fim_tokens({"tokenizer.ggml.fim_pre_token_id": 1}, vocab)
    assert (f.pre, f.suf, f.mid, f.pad) == (1, 2, 3, None) and by_text == {2, 3}


@pytest.mark.parametrize("hostile", ["1", 1.0, True, [1], -1, 4, 2**70])
def test_an_id_a_file_gives_that_is_not_a_vocabulary_index_is_no_marker(hostile):
    vocab = {"<PRE>": 0, "<SUF>": 1, "<MID>": 2, "x": 3}
    f, _ = find_fim_tokens({"tokenizer.ggml.fim_pre_token_id": hostile}, vocab)
    assert f.pre is None


def test_the_plain_layout_is_ollamas_template(coder):
    enc = lambda s: coder.encode(s, special=False, add_bos=False)  # noqa: E731
    prefix, suffix = "def add(a, b):\n    return", "\n\nprint(add(1, 2))  # <|fim_middle|>\n"
    ids = infill_prompt(coder, prefix, suffix, n_ctx=2048)
    assert ids == [PRE] + enc(prefix) + [SUF] + enc(suffix) + [MID]
    assert ids.count(MID) == 1              # a marker typed in the code stays text


def test_the_repo_level_layout_is_llama_servers(coder):
    enc = lambda s: coder.encode(s, special=False, add_bos=False)  # noqa: E731
    ids = infill_prompt(coder, "x = ", "\nprint(x)\n", middle="compute", repo_level=True, n_ctx=8192, n_predict=64,
                        extra=[("util.py", "def compute():\n    return 1\n"), ("b.py", "B = 2\n")])
    assert ids == ([REP] + enc("myproject\n") + [SEP] + enc("util.py\n") + enc("def compute():\n    return 1\n")
                   + [SEP] + enc("b.py\n") + enc("B = 2\n") + [SEP] + enc("filename\n")
                   + [PRE] + enc("x = ") + enc("compute") + [SUF] + enc("\nprint(x)\n") + [MID])


def test_the_repo_level_layout_cuts_as_llama_server_does(coder):
    """Prefix: its last 3/4 of a 2048-token window; suffix: its first 1/4 less the middle and the
    two markers; other files: the most recent of what the context leaves after 2 × n_predict."""
    enc = lambda s: coder.encode(s, special=False, add_bos=False)  # noqa: E731
    prefix, suffix, other = "a b " * 2000, "c d " * 1000, "e f " * 5000
    p, s, o = enc(prefix), enc(suffix), enc(other)
    assert len(p) > 1536 and len(s) > 512 and len(o) > 8192
    ids = infill_prompt(coder, prefix, suffix, middle="g", repo_level=True, n_ctx=8192, n_predict=128,
                        extra=[("o.py", other)])
    tail = [PRE] + p[-1536:] + enc("g") + [SUF] + s[:512 - 2 - len(enc("g"))] + [MID]
    assert ids[-len(tail):] == tail
    extra = ([REP] + enc("myproject\n") + [SEP] + enc("o.py\n") + o + [SEP] + enc("filename\n"))
    assert ids[:-len(tail)] == extra[-(8192 - 2048 - 256):]
    # a small context keeps room for the answer
    small = infill_prompt(coder, prefix, suffix, repo_level=True, n_ctx=512, n_predict=64, extra=[("o.py", other)])
    assert len(small) + 64 <= 512 and small[-1] == MID


def test_without_a_file_separator_other_files_are_set_apart_as_snippets(tmp_path):
    tok = GGUFTokenizer(read_gguf(build_fim_model(tiny_path("qwen2"), tmp_path / "c3.gguf",
                                                  ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])))
    enc = lambda s: tok.encode(s, special=False, add_bos=False)  # noqa: E731
    ids = infill_prompt(tok, "p", "s", repo_level=True, n_ctx=4096, extra=[("x.py", "X")])
    assert ids == enc("\n\n--- snippet ---\n\n") + enc("X") + [PRE] + enc("p") + [SUF] + enc("s") + [MID]


# -- the sampler chain llama.vim and llama.vscode ask for, and the line rules -----------------

from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402

from kiln.native.generate import Generation  # noqa: E402
from kiln.native.sampling import Sampler, SamplingParams, infill_filter  # noqa: E402


def _cands(coder, scores: dict[int, float]):
    """Candidates sorted by logit, as the chain keeps them."""
    order = np.array(sorted(scores, key=lambda t: -scores[t]))
    return order, np.array([scores[t] for t in order], dtype=np.float64)


def test_the_infill_sampler_keeps_only_the_enders_when_they_hold_enough(coder):
    eos = coder.special.eos
    a, b = (coder.encode(c, special=False, add_bos=False)[0] for c in "ab")
    # p(eos) ≈ 0.13 of three candidates: 3 × 0.13 × 3 > 0.87 → the enders alone
    order, cand = infill_filter(*_cands(coder, {a: 2.0, b: 1.5, eos: 0.6}), coder)
    assert order.tolist() == [eos]
    order, cand = infill_filter(*_cands(coder, {a: 2.0, b: 1.5, eos: 0.2}), coder)   # ≈ 0.09: not enough
    assert eos in order.tolist() and a in order.tolist()


def test_the_infill_sampler_merges_a_token_into_the_one_it_begins(coder):
    """' t' begins ' the': the likelier of the two takes the other's probability, so two
    spellings of one continuation do not split its mass; then only the clear leaders are left."""
    ids = {t: coder.encode(t, special=False, add_bos=False) for t in (" t", " the", "x", "y")}
    assert all(len(v) == 1 for v in ids.values()), ids
    t, the, x, y = (ids[k][0] for k in (" t", " the", "x", "y"))
    eos = coder.special.eos
    # p: the .39, t .35, x .24, y .02 → ' the' takes ' t' (.74); y is under 0.2; renormalised
    # the .76, x .24 — and x is under 1/(2+1): ' the' is left, and the ender, always
    order, cand = infill_filter(*_cands(coder, {the: 3.0, t: 2.9, x: 2.5, y: 0.0, eos: -8.0}), coder)
    assert sorted(order.tolist()) == sorted([the, eos])
    # nothing clearly ahead: the end of text
    flat = {coder.encode(c, special=False, add_bos=False)[0]: 0.0 for c in "abcdefghijkl"}
    order, cand = infill_filter(*_cands(coder, flat | {eos: -20.0}), coder)
    assert order.tolist() == [eos]


def test_a_named_chain_runs_only_its_samplers(coder):
    logits = np.full(coder.vocab_size, -10.0, np.float32)
    logits[[5, 6, 7]] = [3.0, 2.9, 2.8]
    # no temperature in the chain: temperature 0 would be greedy, but it does not run
    s = Sampler(SamplingParams(samplers=["top_k", "top_p"], top_k=2, top_p=1.0, temperature=0, seed=3), tok=coder)
    assert {s.sample(logits, []) for _ in range(100)} == {5, 6}
    s = Sampler(SamplingParams(samplers=["top_k", "temperature"], top_k=3, temperature=0), tok=coder)
    assert {s.sample(logits, []) for _ in range(20)} == {5}


def _forced(coder, params: SamplingParams, pieces: list[str]) -> tuple[str, str]:
    """Run Generation over logits that force each piece's one token: (text released, reason)."""
    gen = Generation(SimpleNamespace(tokenizer=coder), [1, 2, 3], params)
    out = []
    for piece in pieces:
        [tid] = coder.encode(piece, special=False, add_bos=False)
        logits = np.full(coder.vocab_size, -10.0, np.float32)
        logits[tid] = 10.0
        out.append(gen.step(logits).text)
        if gen.done:
            break
    fin = gen.finish()
    return "".join(out) + fin.text, fin.reason


def test_n_indent_ends_the_answer_at_a_line_indented_less(coder):
    greedy = dict(temperature=0, max_tokens=50)
    pieces = ["x", "\n", " ", " ", "y", "\n", " ", "z", "\n", "w"]
    # the second line (2 spaces) is deep enough for n_indent 2; the third (1 space) is not: cut
    # before its first character, its indentation kept (llama-server's cut)
    text, reason = _forced(coder, SamplingParams(n_indent=2, **greedy), pieces)
    assert (text, reason) == ("x\n  y\n ", "length")
    text, reason = _forced(coder, SamplingParams(**greedy), pieces)
    assert (text, reason) == ("x\n  y\n z\nw", "length")


def test_t_max_predict_ms_ends_the_answer_once_a_line_has_ended(coder):
    text, reason = _forced(coder, SamplingParams(temperature=0, max_tokens=50, t_max_predict_ms=1e-6),
                           ["x", "y", "\n", "z", "w"])
    assert (text, reason) == ("xy\nz", "length")        # the token after the first line ends it


def test_the_markers_and_enders_are_llama_cpps(coder, default_model_path, tmp_path):
    """Where llama-cpp-python is installed (not a test dependency: a session tool, as for the
    references), its vocabulary's FIM ids and end-of-generation set equal Kiln's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from llama_cpp import llama_cpp as L
    coder_path = build_fim_model(tiny_path("qwen2"), tmp_path / "c.gguf")
    for path in (coder_path, default_model_path):
        llm = llama_cpp.Llama(str(path), n_ctx=64, verbose=False)
        v = L.llama_model_get_vocab(llm.model)
        theirs = [getattr(L, f"llama_vocab_fim_{r}")(v) for r in ("pre", "suf", "mid", "pad", "rep", "sep")]
        eog = {i for i in range(L.llama_vocab_n_tokens(v)) if L.llama_vocab_is_eog(v, i)}
        tok = GGUFTokenizer(read_gguf(path))
        f = tok.fim
        assert [-1 if x is None else x for x in (f.pre, f.suf, f.mid, f.pad, f.rep, f.sep)] == theirs
        assert tok.special.stop_ids == eog


@pytest.mark.parametrize("which", ["coder", "default"])
def test_the_infill_sampler_keeps_what_llama_cpps_keeps(which, default_model_path, tmp_path):
    """600 candidate sets — sizes 2–40, some led by an ender, many holding tokens whose texts
    begin one another (so that they merge), logits at four spreads — through llama.cpp's infill
    sampler and Kiln's: the same tokens kept, and the same ones at -inf. Where nothing clearly
    leads, both end the text (llama.cpp with the EOT it found by its text, Kiln with one of the
    same enders: the answer ends the same)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import ctypes
    from llama_cpp import llama_cpp as L
    path = build_fim_model(tiny_path("qwen2"), tmp_path / "c.gguf") if which == "coder" else default_model_path
    llm = llama_cpp.Llama(str(path), n_ctx=64, verbose=False)
    smpl = L.llama_sampler_init_infill(L.llama_model_get_vocab(llm.model))
    tok = GGUFTokenizer(read_gguf(path))

    def theirs(ids, logits):
        arr = (L.llama_token_data * len(ids))()
        for i, (t, lg) in enumerate(zip(ids, logits)):
            arr[i].id, arr[i].logit, arr[i].p = int(t), float(lg), 0.0
        cur = L.llama_token_data_array(data=arr, size=len(ids), selected=-1, sorted=False)
        L.llama_sampler_apply(smpl, ctypes.byref(cur))
        return {arr[i].id: bool(np.isfinite(arr[i].logit)) for i in range(cur.size)}

    by_start = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if len(b) >= 2 and not tok.is_control(i):
            by_start.setdefault(b[:2], []).append(i)
    groups = [g for g in by_start.values() if len(g) >= 3]
    rng, stops = np.random.default_rng(0), sorted(tok.special.stop_ids)
    for _ in range(600):
        ids = rng.choice(tok.vocab_size, size=int(rng.integers(2, 41)), replace=False)
        if groups and rng.random() < 0.7:
            g = groups[int(rng.integers(len(groups)))]
            ids = np.concatenate([rng.choice(g, size=min(len(g), int(rng.integers(2, 8))), replace=False), ids])
        if rng.random() < 0.5:
            ids = np.concatenate([[rng.choice(stops)], ids])
        ids = np.unique(ids)
        logits = (rng.standard_normal(len(ids)) * rng.choice([0.3, 1, 3, 8])).astype(np.float32)
        order = np.argsort(-logits, kind="stable")
        o, c = ids[order], logits[order].astype(np.float64)
        ref = theirs(o, c)
        ko, kc = infill_filter(o, c, tok)
        ours = {int(a): bool(np.isfinite(b)) for a, b in zip(ko, kc)}
        if len(ref) == 1 and len(ours) == 1 and set(ref) | set(ours) <= tok.special.stop_ids:
            continue
        assert ours == ref
