"""A model split by layer ranges (issue 41 item 4), in one process (fast tier): a first stage and
later stages wired together as the workers wire them over the wire — the logits are the whole
model's, bit for bit, through prefill, decode, batches of sequences, a rolled-back draft and a
reused prefix; a later stage that lost a sequence says so, and the first stage starts it over."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.native.model import Model
from kiln.native.stages import StageCaches, StageStateLost, stage_layers


def wire(path, count: int):
    """A first stage whose `remote` runs the later stages in this process, as workers/pipeline.py
    does through the router (rows as bytes, back as bytes)."""
    whole = Model(path)
    n = whole.config.n_layer
    first = Model(path, stage=stage_layers(n, 0, count))
    later = [StageCaches(Model(path, stage=stage_layers(n, i, count)), 512, 6) for i in range(1, count)]
    calls = []

    def remote(x, seqs, keep):
        picked = np.arange(x.shape[0])[keep]
        for i, st in enumerate(later):
            last = i == len(later) - 1
            x = st.run(np.frombuffer(x.tobytes(), np.float32).reshape(x.shape).copy(), [list(s) for s in seqs],
                       picked.tolist() if last else None)
        calls.append(seqs)
        return x
    first.remote = remote
    return whole, first, later, calls


@pytest.fixture(scope="module")
def two(default_model_path):
    return wire(default_model_path, 2)


def test_stage_layers_share_the_model_and_bad_splits_are_named():
    assert [stage_layers(30, i, 3) for i in range(3)] == [(0, 10), (10, 20), (20, 30)]
    assert [stage_layers(7, i, 2) for i in range(2)] == [(0, 3), (3, 7)]
    for bad in ((2, 2), (0, 31), (-1, 2)):
        with pytest.raises(ValueError, match="stages"):
            stage_layers(30, *bad)


def test_a_first_stage_holds_only_its_share(two, default_model_path):
    whole, first, later, _ = two
    assert first.weight_bytes + later[0].model.weight_bytes == whole.weight_bytes + 0   # tied head: once, in the first
    assert later[0].model.token_embd is None and later[0].model.output is None
    assert sum(L is not None for L in first.layers) == stage_layers(whole.config.n_layer, 0, 2)[1]
    with pytest.raises(ValueError, match="range of the model"):
        Model(default_model_path, stage=(3, 3))


def test_prefill_decode_and_a_rolled_back_draft_match_the_whole_model_bit_for_bit(two):
    whole, first, _, calls = two
    toks = whole.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    cw, cf = whole.new_cache(512), first.new_cache(512)
    assert np.array_equal(whole.forward(toks, cw), first.forward(toks, cf))
    t = int(np.argmax(whole.forward([11], cw)))
    assert t == int(np.argmax(first.forward([11], cf)))
    for _ in range(6):                                       # decode
        lw, lf = whole.forward([t], cw), first.forward([t], cf)
        assert np.array_equal(lw, lf)
        t = int(np.argmax(lw))
    draft = [t, 5, 6, 7]                                      # a speculative check, then its rejection
    assert np.array_equal(whole.forward(draft, cw, all_logits=True), first.forward(draft, cf, all_logits=True))
    cw.truncate(cw.n - 3)
    cf.truncate(cf.n - 3)
    assert np.array_equal(whole.forward([9], cw), first.forward([9], cf))
    assert calls[-1][0][1] == cf.n - 1                        # the stage was told where the rows start


def test_a_batch_of_sequences_and_a_reused_prefix_match(two):
    whole, first, _, _ = two
    a = whole.tokenizer.encode("One two three four five")
    b = whole.tokenizer.encode("Red green")
    ws, fs = [whole.new_cache(512) for _ in range(2)], [first.new_cache(512) for _ in range(2)]
    assert np.array_equal(whole.forward_runs([(a, ws[0]), (b, ws[1])]), first.forward_runs([(a, fs[0]), (b, fs[1])]))
    assert np.array_equal(whole.forward_batch([3, 4], ws), first.forward_batch([3, 4], fs))
    for c in ws + fs:
        c.truncate(2)                                          # a follow-up turn keeps a prefix
    assert np.array_equal(whole.forward_runs([(b, ws[0]), (a, ws[1])]), first.forward_runs([(b, fs[0]), (a, fs[1])]))
    assert np.array_equal(whole.hidden(a, whole.new_cache(64)), first.hidden(a, first.new_cache(64)))


def test_three_stages_match_too(default_model_path):
    whole, first, later, _ = wire(default_model_path, 3)
    toks = whole.tokenizer.encode("Hello there, how")
    cw, cf = whole.new_cache(128), first.new_cache(128)
    assert np.array_equal(whole.forward(toks, cw), first.forward(toks, cf))
    assert np.array_equal(whole.forward([42], cw), first.forward([42], cf))
    assert len(later) == 2 and all(st.caches for st in later)


def test_a_stage_that_lost_a_sequence_says_so_and_the_first_stage_starts_it_over(two):
    whole, first, later, _ = two
    toks = whole.tokenizer.encode("Once upon a time")
    cw, cf = whole.new_cache(128), first.new_cache(128)
    whole.forward(toks, cw)
    first.forward(toks, cf)
    later[0].caches.clear()                                   # the stage restarted
    with pytest.raises(StageStateLost, match="holds nothing"):
        first.forward([7], cf)
    assert cf.n == 0                                          # started over: the next call sends everything
    cw.truncate(0)
    assert np.array_equal(whole.forward(toks, cw), first.forward(toks, cf))


def test_stage_caches_refuse_bad_sequences_and_keep_at_most_capacity(two):
    _, _, later, _ = two
    st = StageCaches(later[0].model, 64, 2)
    x = np.zeros((1, later[0].model.config.n_embd), np.float32)
    for bad in (["u", 0], [1, 0, 1], ["u", -1, 1], ["u", 0, 0]):
        with pytest.raises(ValueError, match="uid, start, rows"):
            st.segments([bad])
    with pytest.raises(ValueError, match="exceed the context"):
        st.segments([["u", 0, 65]])
    with pytest.raises(ValueError, match="rows for sequences"):
        st.run(np.zeros((2, x.shape[1]), np.float32), [["u", 0, 1]], None)
    for i in range(4):
        st.run(x, [[f"s{i}", 0, 1]], None)
    assert list(st.caches) == ["s2", "s3"] and st.evicted == 2
    with pytest.raises(StageStateLost):
        st.run(x, [["s0", 1, 1]], None)


def test_a_stage_that_restarted_is_sent_the_whole_sequence_again_and_the_bits_hold(two):
    whole, first, later, _ = two
    toks = whole.tokenizer.encode("Once upon a time there")
    cw, cf = whole.new_cache(128), first.new_cache(128)
    assert np.array_equal(whole.forward(toks, cw), first.forward(toks, cf))
    later[0].caches.clear()                                   # the stage restarted: it holds nothing

    class Lost(StageStateLost):
        code = "stage_state_lost"                              # as the worker's OpError names it

    real = first.remote

    def remote(x, seqs, keep):
        try:
            return real(x, seqs, keep)
        except StageStateLost as e:
            raise Lost(str(e)) from None
    first.remote = remote
    try:
        assert np.array_equal(whole.forward([7, 8], cw, all_logits=True), first.forward([7, 8], cf, all_logits=True))
        assert cf.n == cw.n and cf.tokens == cw.tokens
        assert np.array_equal(whole.forward([9], cw), first.forward([9], cf))
    finally:
        first.remote = real


class _Submitting:
    """A remote with `submit`, as workers/pipeline.py's: each part's answer collected after the
    next part is computed (here the later stage computes at once; the order of calls is the
    point, and the bits)."""
    pipelines = True

    def __init__(self, inner):
        self.inner, self.parts = inner, []

    def __call__(self, x, seqs, keep):
        return self.inner(x, seqs, keep)

    def submit(self, x, seqs, keep):
        self.parts.append((seqs[0][1], x.shape[0], len(np.arange(x.shape[0])[keep])))
        out = self.inner(x, seqs, keep)
        return type("Done", (), {"result": lambda self: out})()


def test_a_long_prompt_goes_through_in_parts_and_the_bits_hold(two):
    from kiln.native.model import PIPELINE_ROWS
    whole, first, _, _ = two
    real = first.remote
    first.remote = sub = _Submitting(real)
    try:
        toks = (whole.tokenizer.encode("Count: one two three four five six seven eight nine ten. ") * 20)[:3 * PIPELINE_ROWS + 5]
        assert len(toks) == 3 * PIPELINE_ROWS + 5
        cw, cf = whole.new_cache(512), first.new_cache(512)
        assert np.array_equal(whole.forward(toks, cw), first.forward(toks, cf))
        T = len(toks)
        assert [p[0] for p in sub.parts] == [T * i // 4 for i in range(4)] and sum(p[1] for p in sub.parts) == T
        assert [p[2] for p in sub.parts] == [0, 0, 0, 1]        # only the last row comes back
        assert cf.n == cw.n == len(toks) and cf.tokens == cw.tokens
        more = toks[:2 * PIPELINE_ROWS]
        assert np.array_equal(whole.forward(more, cw, all_logits=True), first.forward(more, cf, all_logits=True))
        assert np.array_equal(whole.forward([5], cw), first.forward([5], cf))
    finally:
        first.remote = real


def test_a_stage_worker_refuses_hostile_frames_by_name(default_model_path):
    from kiln.workers.stage import MAX_ROWS, StageWorker
    from kiln.workers.worker import OpError, Request
    w = StageWorker("s", {"model": str(default_model_path), "stage": [1, 2], "ctx": 64})
    w.boot()
    n = w.model.config.n_embd
    row = np.zeros((1, n), np.float32).tobytes()
    cases = [([], {"seqs": [["u", 0, 1]]}, "one buffer"), ([row, row], {"seqs": [["u", 0, 1]]}, "one buffer"),
             ([row[:-4]], {"seqs": [["u", 0, 1]]}, "one buffer"),
             ([b"\0" * 4 * n * (MAX_ROWS + 1)], {"seqs": [["u", 0, MAX_ROWS + 1]]}, f"at most {MAX_ROWS}"),
             ([row * 2], {"seqs": [["u", 0, 1]]}, "rows for sequences"),
             ([row], {"seqs": [["u", 70, 1]]}, "exceed the context"),
             ([row], {"seqs": [["u", 0, 1]], "keep": [5]}, "outside the batch"),
             ([row], {"seqs": [["u", 3, 1]]}, "holds nothing")]
    for buffers, body, words in cases:
        with pytest.raises(OpError, match=words):
            w._forward(Request("r", "stage_forward", body, buffers, None))
    out = w._forward(Request("r", "stage_forward", {"seqs": [["v", 0, 1]]}, [row], None))
    assert out.body["rows"] == 1 and len(out.buffers[0]) == 4 * n
