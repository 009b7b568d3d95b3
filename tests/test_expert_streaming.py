"""Experts streamed from disk through a small slot cache give the in-RAM logits bit for bit."""

import errno
import time

import numpy as np
import pytest

from conftest import reference, tiny_path
from fidelity import assert_meets_bars, measure
from kiln.native import kernels, runners
from kiln.native.experts.cache import ExpertCache, segment_bytes
from kiln.native.experts.source import StreamedExperts
from kiln.native.experts.store import ExpertStore, expert_map
from kiln.native.model import load_model

pytestmark = pytest.mark.skipif(kernels.kernel_info()["path"] != "compiled",
                                reason="slots are multiplied in place by the compiled kernels")


def test_the_expert_map_points_at_each_experts_bytes(e8k2_path):
    m = load_model(e8k2_path)
    emap = expert_map(m.gguf)
    assert len(emap) == 30 * 3
    s = emap[(7, "down")]
    off, n = s.range(5)
    whole = m.gguf.raw("blk.7.ffn_down_exps.weight")
    assert bytes(m.gguf._map[off:off + n]) == bytes(whole[5 * n:6 * n])
    assert off % 32 == 0


def test_a_cache_is_never_sized_beyond_the_experts_the_model_has(e8k2_path):
    """`expert_cache = 25%` of RAM for a small MoE: a slot per expert, not gigabytes of slots
    nothing will ever fill (the plan, the events and a shared segment's size would say so)."""
    from kiln.native.gguf_file import read_gguf
    g, store = read_gguf(e8k2_path, skip_arrays=True), ExpertStore(e8k2_path)
    try:
        probe = ExpertCache.__new__(ExpertCache)
        probe._geometry(g, store)
        count = probe.expert_count
        assert count == 30 * 8                                   # SmolLM2's 30 layers x 8 experts
        slots, size = segment_bytes(g, store, 8 << 30)
        assert slots == count and size == ExpertCache.index_bytes(count) + count * probe.slot_bytes
        slots, _ = segment_bytes(g, store, 10 * probe.slot_bytes)
        assert slots == 9                                        # the index takes its share of a small budget
    finally:
        store.close()


# None: in RAM; 8 = all experts; 1 and 2 (evicting) with the whole suite: the decode-step test below
# evicts at 1 and 3 slots in the fast tier
@pytest.mark.parametrize("slots_per_layer", [None, pytest.param(1, marks=pytest.mark.slow),
                                             pytest.param(2, marks=pytest.mark.slow), 8])
def test_streamed_logits_equal_in_ram_logits(e8k2_path, slots_per_layer):
    ref, _ = reference("smollm2-moe-e8k2")
    ids = ref["prompts"][1]["ids"]
    m = load_model(e8k2_path)
    in_ram = m.forward(ids, m.new_cache(), all_logits=True)
    if slots_per_layer is None:
        return
    cache = ExpertCache(m.gguf, ExpertStore(e8k2_path), slots=30 * slots_per_layer)
    m.expert_provider = cache
    streamed = m.forward(ids, m.new_cache(), all_logits=True)
    assert np.array_equal(streamed, in_ram)
    st = cache.stats()
    assert st["misses"] > 0 and st["bytes_read"] > 0 and st["used"] <= cache.slots
    if slots_per_layer == 8:                                          # everything fits: a second pass only hits
        before = st["misses"]
        m.forward(ids, m.new_cache(), all_logits=True)
        assert cache.stats()["misses"] == before


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "olmoe", "qwen35moe", "gpt-oss", "deepseek2", "deepseek2-v3"])
def test_tiny_moe_architectures_stream_bit_exactly(arch):
    ref, _ = reference(f"tiny/tiny-{arch}")
    ids = ref["prompts"][1]["ids"]
    m = load_model(tiny_path(arch))
    in_ram = m.forward(ids, m.new_cache(), all_logits=True)
    m.expert_provider = ExpertCache(m.gguf, ExpertStore(tiny_path(arch)), slots=2)
    assert np.array_equal(m.forward(ids, m.new_cache(), all_logits=True), in_ram)


def test_o_direct_refused_falls_back_to_buffered_reads_and_says_so(e8k2_path):
    store = ExpertStore(e8k2_path)
    assert store.io_mode == "direct"
    m = load_model(e8k2_path)
    ids = reference("smollm2-moe-e8k2")[0]["prompts"][0]["ids"]
    in_ram = m.forward(ids, m.new_cache(), all_logits=True)
    m.expert_provider = ExpertCache(m.gguf, store, slots=30)
    # what tmpfs/overlayfs answer an O_DIRECT read (the reader's simulated disk)
    m.expert_provider.io.reader.fault(0, 1 << 40, errno.EINVAL, 0.0, True)
    assert np.array_equal(m.forward(ids, m.new_cache(), all_logits=True), in_ram)
    st = m.expert_provider.stats()
    assert st["io_mode"] == "buffered" and "EINVAL" in st["fallback_reason"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-moe-e8k2", "tiny/tiny-qwen2moe", "tiny/tiny-qwen3moe", "tiny/tiny-olmoe",
                                  "tiny/tiny-qwen35moe", "tiny/tiny-gpt-oss", "tiny/tiny-deepseek2",
                                  "tiny/tiny-deepseek2-v3"])
def test_streamed_models_meet_llama_cpps_bars(name, e8k2_path):
    """Prompts and greedy continuations through a 25 % slot cache, held to the engine's bars."""
    path = e8k2_path if name == "smollm2-moe-e8k2" else tiny_path(name.removeprefix("tiny/tiny-"))
    ref, npz = reference(name)
    m = load_model(path)
    cache = ExpertCache(m.gguf, ExpertStore(path), slots=max(1, m.config.n_layer * m.config.n_expert // 4))
    m.expert_provider = cache
    assert_meets_bars(measure(m, ref, npz), f"{name} streamed")
    assert cache.stats()["misses"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "lrfu"])
@pytest.mark.parametrize("slots_per_layer", [1, 3, 8])
def test_decode_steps_stream_bit_exactly_with_read_ahead_and_the_compiled_path(e8k2_path, slots_per_layer, policy,
                                                                              monkeypatch):
    """Decode steps — where the next layer's experts are read ahead while this one computes, the
    resident experts are computed first, and a layer whose chosen experts are all resident runs
    in the one compiled call through the cache's address table — give the in-RAM logits."""
    ids = reference("smollm2-moe-e8k2")[0]["prompts"][1]["ids"]
    m = load_model(e8k2_path)
    steps = np.random.default_rng(3).integers(0, m.config.n_vocab, 24).tolist()

    def run():
        cache = m.new_cache(len(ids) + len(steps) + 1)
        out = [m.forward(ids, cache)]
        out += [m.forward([t], cache) for t in steps]
        return np.stack(out)
    in_ram = run()
    c = ExpertCache(m.gguf, ExpertStore(e8k2_path), slots=30 * slots_per_layer, policy=policy)
    c.RA_MIN_PRECISION = 0                      # read every guess: its effect on the bits is the point
    m.expert_provider = c
    fused = {"calls": 0}
    real = runners.decode_layer

    def count(*a, **kw):
        ok = real(*a, **kw)
        fused["calls"] += bool(ok and kw.get("experts", (None,))[0] is not None)
        return ok
    monkeypatch.setattr(runners, "decode_layer", count)
    real_ffn = StreamedExperts.compiled_ffn

    def count_ffn(*a):
        ok = real_ffn(*a)
        fused["steps"] = fused.get("steps", 0) + ok
        return ok
    monkeypatch.setattr(StreamedExperts, "compiled_ffn", count_ffn)
    assert np.array_equal(run(), in_ram)
    if slots_per_layer < 8:
        assert fused.get("steps", 0) > 0          # layers whose experts arrived during the FFN
    st = c.stats()
    assert st["misses"] > 0 and st["used"] <= c.slots
    if slots_per_layer >= 3:
        assert st["read_ahead"]["reads"] + st["fill_reads"] > 0 and st["read_ahead"]["recall"] is not None
    if slots_per_layer == 8:
        assert fused["calls"] > 0                 # layers whose chosen experts were resident
    c.close()


@pytest.mark.slow
def test_without_the_compiled_reader_python_threads_read_the_same_bits(e8k2_path, monkeypatch):
    """An install without the compiled module reads experts on Python threads (expert_io's
    ThreadReader): decode steps through a small cache still give the in-RAM logits."""
    from kiln.native.experts import io as expert_io
    monkeypatch.setattr(expert_io, "compiled_reader", lambda: None)
    ids = reference("smollm2-moe-e8k2")[0]["prompts"][1]["ids"]
    m = load_model(e8k2_path)
    steps = np.random.default_rng(4).integers(0, m.config.n_vocab, 12).tolist()

    def run():
        cache = m.new_cache(len(ids) + len(steps) + 1)
        return np.stack([m.forward(ids, cache)] + [m.forward([t], cache) for t in steps])
    in_ram = run()
    c = ExpertCache(m.gguf, ExpertStore(e8k2_path), slots=60)
    assert c.io.kind == "python"
    m.expert_provider = c
    assert np.array_equal(run(), in_ram)
    assert c.stats()["misses"] > 0 and c.stats()["bytes_read"] > 0
    c.close()


def test_read_ahead_stops_reading_the_ranks_whose_guesses_go_unused(e8k2_path):
    """Reading ahead experts the next layer does not use costs a read it needs when the disk is
    the limit: a rank whose guesses are used less than 60 % of the time is no longer read, and
    the guesses are still scored (recall, the rate per rank)."""
    m = load_model(e8k2_path)
    c = ExpertCache(m.gguf, ExpertStore(e8k2_path), slots=90)
    for step in range(40):                         # rank 0 always right, rank 1 always wrong
        layer = 1 + step % 28
        c.request(0, [0], rows=1, pin=False)
        c.read_ahead(layer, [[1, 6 + step % 2]])
        c.request(layer, [0, 1], pin=False)
    st = c.stats()["read_ahead"]
    assert st["used_by_rank"][0] > 0.9 and st["used_by_rank"][1] < c.RA_MIN_PRECISION
    # the decayed rate of a wrong rank falls below 0.6 after 10 guesses (0.95 ** 10 = 0.599)
    wrong_reads = st["reads"] - st["used"]
    assert 1 <= wrong_reads <= 10 and st["recall"] is not None and 0.4 < st["recall"] < 0.6
    c.close()


def test_a_guess_its_layer_did_not_choose_is_cancelled_and_its_slot_freed(e8k2_path):
    """While the disk is busy, guesses queue behind the reads the forward waits for; when the
    layer routes elsewhere the guesses not yet read are dropped — they would only delay the
    next layer's misses — and their slots go back to the free list."""
    m = load_model(e8k2_path)
    c = ExpertCache(m.gguf, ExpertStore(e8k2_path), slots=8, threads=1)
    held = c.map[(2, "gate")].range(1)[0]
    c.io.reader.fault(held, held + 1, 0, -1.0)     # the disk stalls on expert 1 of layer 2 ...
    c.request(2, [1], pin=False)
    deadline = time.monotonic() + 10               # ... and the one I/O thread is in that read
    while c.io.stats()["chunks_in_flight"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    c.read_ahead(3, [[6, 7]])
    assert {(3, 6), (3, 7)} <= set(c.pending)
    free_before = len(c.free)
    c.request(3, [0], pin=False)                   # layer 3 routes to expert 0, not 6 or 7
    assert (3, 6) not in c.index and (3, 7) not in c.index
    c.io.reader.fault()
    c.weights(3, 0)                                # the demanded read completes
    for fut, _ in list(c.cancelling):
        fut.exception(10)
    c._reap()
    st = c.stats()
    assert st["read_ahead"]["cancelled"] == 2 and st["read_ahead"]["wasted_bytes"] == 0
    assert len(c.free) == free_before + 2 - 1      # the guesses' slots back, one taken by expert 0
    assert not c.cancelling and set(c.index) == {(2, 1), (3, 0)}
    c.close()


def test_the_used_slots_are_the_resident_ones_not_the_reads_in_flight(e8k2_path):
    """`used` counts experts a forward could use now (and a warm restart would find), `reading`
    the reads still in flight; a read the disk has not delivered is not used yet."""
    m = load_model(e8k2_path)
    c = ExpertCache(m.gguf, ExpertStore(e8k2_path), slots=8, threads=1)
    held = c.map[(2, "gate")].range(1)[0]
    c.io.reader.fault(held, held + 1, 0, -1.0)     # the disk stalls on expert 1 of layer 2
    c.request(2, [1, 3], pin=False)
    st = c.stats()
    assert (st["used"], st["reading"]) == (0, 2)
    c.io.reader.fault()
    c.weights(2, 1)
    c.weights(2, 3)
    st = c.stats()
    assert (st["used"], st["reading"]) == (2, 0)
    c.close()


@pytest.mark.parametrize("during", ["prompt", "decode"])
def test_a_failed_expert_read_fails_the_forward_with_where_and_loses_nothing(e8k2_path, during):
    """An I/O error reading an expert fails that forward — a prompt's (the Python path) or a
    decode step's (the compiled steps) — with which expert, which file and the disk's words; the
    slot it was read into goes back, nothing stays pinned, and the next forward (the disk well
    again) gives the in-RAM logits."""
    m = load_model(e8k2_path)
    ids = reference("smollm2-moe-e8k2")[0]["prompts"][1]["ids"]
    in_ram = m.forward(ids, m.new_cache(), all_logits=True)
    c = ExpertCache(m.gguf, ExpertStore(e8k2_path), slots=30 * 2)
    m.expert_provider = c
    kv = m.new_cache(len(ids) + 300)
    if during == "decode":
        m.forward(ids, kv)
    # layer 5's experts that must be read again fail: one byte of each up projection that no
    # aligned read of another expert covers
    up = expert_map(m.gguf)[(5, "up")]
    bad = [off + n // 2 for off, n in (up.range(e) for e in range(8) if (5, e) not in c.index)]
    for b in bad:                                 # the disk fails there (simulated)
        c.io.reader.fault(b, b + 1, errno.EIO)
    steps = iter(np.random.default_rng(5).integers(0, m.config.n_vocab, 256).tolist())
    with pytest.raises(OSError, match=r"reading expert \d of layer 5 \(blk\.5\.ffn_up_exps\.weight.*Input/output error") as err:
        if during == "prompt":
            m.forward(ids, m.new_cache(), all_logits=True)
        for t in steps:                           # until layer 5 chooses one of them
            m.forward([t], kv)
    c.io.reader.fault()
    e = int(str(err.value).split("reading expert ")[1].split()[0])
    assert (5, e) not in c.index and not c.busy
    assert c.stats()["read_errors"] >= 1 and "Input/output error" in c.stats()["last_read_error"]
    assert len(c.free) + len(c.index) + len(c.cancelling) == c.slots
    assert np.array_equal(m.forward(ids, m.new_cache(), all_logits=True), in_ram)


@pytest.mark.parametrize("reader", ["compiled", "python"])
def test_a_split_models_experts_stream_from_its_parts(reader, tmp_path, monkeypatch):
    """A model split in three files (as the big MoE models ship): each expert is read from the part
    that holds it — O_DIRECT, by the C reader or the Python one — and the logits are the unsplit
    file's in RAM, bit for bit."""
    from split_gguf import split

    from kiln.native.experts import io
    if reader == "python":
        monkeypatch.setattr(io, "compiled_reader", lambda: None)
    ids = reference("tiny/tiny-qwen3moe")[0]["prompts"][1]["ids"]
    whole = load_model(tiny_path("qwen3moe"))
    in_ram = whole.forward(ids, whole.new_cache(), all_logits=True)
    parts = split(tiny_path("qwen3moe"), tmp_path, 3)
    m = load_model(parts[0])
    assert len(m.gguf.parts) == 3 and len({s.part for s in expert_map(m.gguf).values()}) >= 2
    store = ExpertStore(parts[0], parts=m.gguf.parts)
    m.expert_provider = ExpertCache(m.gguf, store, slots=2)
    assert np.array_equal(m.forward(ids, m.new_cache(), all_logits=True), in_ram)
    assert m.expert_provider.io.kind == reader and m.expert_provider.stats()["misses"] > 0
    assert store.io_mode == "direct" and len(store.fds) == 3
    # a read that fails names the part's file it came from, not the first one
    layer, proj = next(k for k, s in expert_map(m.gguf).items() if s.part == 2)
    c = ExpertCache(m.gguf, ExpertStore(parts[0], parts=m.gguf.parts), slots=2, threads=1)
    off, n = c.map[(layer, proj)].range(0)
    assert off >> io.PART_SHIFT == 2
    c.io.reader.fault(off, off + n, errno.EIO)
    with pytest.raises(OSError, match=f"from {parts[2]}"):
        c.request(layer, [0], pin=False)
        c.weights(layer, 0)
    c.close()
    with pytest.raises(ValueError, match="split in 3 files but the expert store reads 1"):
        ExpertCache(m.gguf, ExpertStore(parts[0]), slots=2)
