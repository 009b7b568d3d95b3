"""The prefix cache (native/prefix_cache.py): blocks of prompts shared across sequences, kept in
RAM under a budget and on disk across processes — copied in, they are what prefilling makes,
bit for bit; a file that is not exactly the block asked for is ignored, said and deleted."""

import io
import json
import time
from contextlib import redirect_stderr

import numpy as np
import pytest

from kiln.native.generate import Finish
from kiln.native.prefix_cache import BLOCK, PrefixCache, chain_keys, layout_of
from kiln.native.sampling import SamplingParams
from kiln.native.scheduler import Scheduler

SHA = "5" * 64


@pytest.fixture(scope="module")
def system(default_model):
    """A shared 'system prompt' of 3 blocks and a bit, and two conversations after it."""
    rng = np.random.default_rng(7)
    sys_ids = [int(t) for t in rng.integers(3, 40000, 3 * BLOCK + 20)]
    return sys_ids, sys_ids + [int(t) for t in rng.integers(3, 40000, 30)], sys_ids + [int(t) for t in rng.integers(3, 40000, 25)]


def fresh(m, prompt):
    return m.forward(prompt, m.new_cache(512), all_logits=True)


def cache_for(m, tmp_path, ram=1 << 30, disk=1 << 30, sha=SHA, log=None):
    return PrefixCache(layout_of(m.new_cache(8), sha, "m"), ram, tmp_path, disk, log=log)


def wait_written(pc, n, timeout=20):
    end = time.monotonic() + timeout
    while pc.stats()["written"] < n:
        assert time.monotonic() < end, pc.stats()
        time.sleep(0.01)


def on_disk(m, prompt, tmp_path) -> PrefixCache:
    """A prefix cache that has written `prompt`'s whole blocks to tmp_path."""
    pc = cache_for(m, tmp_path)
    c = m.new_cache(512)
    m.forward(prompt, c)
    pc.publish(c)
    wait_written(pc, len(prompt) // BLOCK)
    return pc


def test_a_second_conversation_reuses_the_shared_blocks_bit_for_bit(default_model, system, tmp_path):
    m = default_model
    _, a, b = system
    pc = cache_for(m, tmp_path, disk=0)
    c = m.new_cache(512)
    m.forward(a, c)
    assert pc.publish(c) == len(a) // BLOCK
    c2 = m.new_cache(512)
    n = pc.extend(c2, b, 0)
    assert n == 3 * BLOCK                                 # the shared whole blocks, not a's own
    assert np.array_equal(m.forward(b[n:], c2, all_logits=True), fresh(m, b)[n:])
    assert pc.stats()["hits_ram"] == 3 and pc.stats()["reused_tokens"] == 3 * BLOCK


def test_blocks_come_back_from_disk_in_another_process_s_cache(default_model, system, tmp_path):
    m = default_model
    _, a, _ = system
    on_disk(m, a, tmp_path)
    again = cache_for(m, tmp_path)                        # a restarted worker: empty RAM
    c2 = m.new_cache(512)
    n = again.extend(c2, a, 0)
    assert n == len(a) // BLOCK * BLOCK and again.stats()["hits_disk"] == len(a) // BLOCK
    assert np.array_equal(m.forward(a[n:], c2, all_logits=True), fresh(m, a)[n:])
    other = cache_for(m, tmp_path, sha="6" * 64)          # another model's folder: nothing
    assert other.extend(m.new_cache(512), a, 0) == 0


def _corrupt(kind: str, path, pc_other):
    raw = bytearray(path.read_bytes())
    if kind == "truncated":
        path.write_bytes(raw[:len(raw) // 2])
    elif kind == "bit-flipped":
        raw[-100] ^= 0x10
        path.write_bytes(raw)
    elif kind == "garbage":
        path.write_bytes(b"\x00" * 64 + b"not a block")
    elif kind == "huge header":
        raw[12:16] = (1 << 31).to_bytes(4, "little")
        path.write_bytes(raw)
    elif kind == "wrong model":                            # a valid block of another model, renamed
        head_len = int.from_bytes(raw[12:16], "little")
        head = json.loads(raw[16:16 + head_len])
        head["layout"] = pc_other.layout
        new = json.dumps(head).encode()
        path.write_bytes(bytes(raw[:12]) + len(new).to_bytes(4, "little") + new + bytes(raw[16 + head_len:]))
    elif kind == "other tokens":
        head_len = int.from_bytes(raw[12:16], "little")
        head = json.loads(raw[16:16 + head_len])
        head["tokens"][0] += 1
        new = json.dumps(head).encode()
        path.write_bytes(bytes(raw[:12]) + len(new).to_bytes(4, "little") + new + bytes(raw[16 + head_len:]))


@pytest.mark.parametrize("kind", ["truncated", "bit-flipped", "garbage", "huge header", "wrong model", "other tokens"])
def test_a_hostile_or_stale_block_file_is_ignored_said_and_deleted(default_model, system, tmp_path, kind):
    m = default_model
    _, a, _ = system
    pc = on_disk(m, a, tmp_path)
    second = pc.dir / chain_keys(a, 2, pc.root)[1].hex()
    _corrupt(kind, second, cache_for(m, tmp_path / "x", sha="7" * 64))
    said = io.StringIO()
    again = cache_for(m, tmp_path, log=lambda msg: said.write(msg + "\n"))
    c2 = m.new_cache(512)
    with redirect_stderr(io.StringIO()):
        n = again.extend(c2, a, 0)
    assert n == BLOCK                                     # the first block only: the second is refused
    assert f"ignored {second}" in said.getvalue() and not second.exists()
    assert again.stats()["rejected"] == 1
    assert np.array_equal(m.forward(a[n:], c2, all_logits=True), fresh(m, a)[n:])


def test_ram_is_held_to_its_budget_and_disk_trimmed_to_its_own(default_model, system, tmp_path):
    m = default_model
    _, a, _ = system
    block = layout_of(m.new_cache(8), SHA, "m")["block_bytes"]
    pc = cache_for(m, tmp_path, ram=2 * block, disk=int(2.5 * block))
    c = m.new_cache(512)
    m.forward(a, c)
    pc.publish(c)
    assert pc.stats()["blocks"] == 2 and pc.stats()["ram_bytes"] <= 2 * block
    wait_written(pc, 3)
    assert sum(p.stat().st_size for p in pc.dir.iterdir()) <= 2.5 * block


def test_what_a_plain_run_did_not_make_is_not_published(default_model, system, tmp_path):
    m = default_model
    _, a, _ = system
    pc = cache_for(m, tmp_path, disk=0)
    c = m.new_cache(512)
    m.forward(a, c)
    m.shift_cache(c, BLOCK + 3, 40)                      # after a context shift: only what precedes n_keep
    assert pc.publish(c) == 1
    c.adapter = object()                                  # a LoRA's keys are not the model's
    assert pc.publish(c) == 0 and pc.extend(c, a, 0) == 0


def answer(job) -> list:
    out = []
    while not isinstance(out[-1] if out else None, Finish):
        out.append(job.events.get(timeout=120))
    return out


def test_the_scheduler_reuses_another_slot_s_prompt(default_model, system, tmp_path):
    """Two conversations with one system prompt, in two slots: the second's prefill starts
    after the shared blocks, and its answer is the one it gets without the cache."""
    m = default_model
    _, a, b = system
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    want = answer(Scheduler(m, 512, slots=2).submit(b, greedy, lambda: False))
    sched = Scheduler(m, 512, slots=2, prefix=cache_for(m, tmp_path, disk=0))
    answer(sched.submit(a, greedy, lambda: False))
    stop = []
    sched.submit(a, SamplingParams(temperature=0.0, max_tokens=260, ignore_eos=True), lambda: bool(stop))
    try:                                                  # a's slot is busy: b runs in the other one
        got = answer(sched.submit(b, greedy, lambda: False))
    finally:
        stop.append(1)
    assert got[-1].cached_tokens == 3 * BLOCK and want[-1].cached_tokens == 0, sched.load()["prefix_cache"]
    assert [e.id for e in got[:-1]] == [e.id for e in want[:-1]]


def test_a_recurrent_model_restarts_from_the_last_prompt_s_end_not_from_zero():
    """Qwen3.5's delta-net states cannot be rolled back, so a next turn that leaves the cached
    path (the answer rendered otherwise, another question) used to recompute everything: now
    it restarts from the states kept at the previous prompt's end, with the same logits."""
    from conftest import tiny_path
    from kiln.native.generate import Sequence
    from kiln.native.model import load_model
    m = load_model(tiny_path("qwen35"))
    rng = np.random.default_rng(3)
    a = [int(t) for t in rng.integers(3, m.config.n_vocab, 70)]
    seq = Sequence(m, 256)
    list(seq.generate(a, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    b = a + [int(t) for t in rng.integers(3, m.config.n_vocab, 20)]
    assert seq.cache.n == len(a) + 5 and seq.cache.common_prefix(b) == len(a)
    logits, reused = seq.prefill(b)
    assert reused == len(a) and np.array_equal(logits, m.forward(b, m.new_cache(256)))
    with pytest.raises(ValueError, match="cannot be rolled back"):
        seq.cache.truncate(len(a) - 1)                    # no checkpoint there


def test_a_slow_disk_holds_back_at_most_write_behind_bytes(default_model, system, tmp_path, monkeypatch):
    """Blocks wait for the disk in a bounded queue: past WRITE_BEHIND bytes a block stays in RAM
    only (counted), so a slow or stuck disk never grows the worker's memory."""
    import threading
    from kiln.native import prefix_cache
    m = default_model
    _, a, _ = system
    block = layout_of(m.new_cache(8), SHA, "m")["block_bytes"]
    monkeypatch.setattr(prefix_cache, "WRITE_BEHIND", 2 * block)
    gate, real = threading.Event(), prefix_cache.kv_file.write
    monkeypatch.setattr(prefix_cache.kv_file, "write", lambda *args: gate.wait(20) and real(*args))
    pc = cache_for(m, tmp_path)
    c = m.new_cache(512)
    m.forward(a, c)
    assert pc.publish(c) == len(a) // BLOCK >= 4
    assert pc.stats()["not_written"] == len(a) // BLOCK - 2 and pc.queued <= 2 * block
    gate.set()
    wait_written(pc, 2)
    assert pc.queued == 0


def test_a_folder_that_cannot_be_made_leaves_the_cache_in_ram(default_model, system, tmp_path):
    """KILN_HOME read-only, full, or its cache path a file: said once, and prompts are still
    cached in RAM — a worker never fails to start over its cache."""
    m = default_model
    _, a, b = system
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the folder would go")
    said = []
    pc = cache_for(m, blocker / "prefix", log=said.append)
    assert pc.dir is None and "prompts are cached in RAM only" in said[0]
    c = m.new_cache(512)
    m.forward(a, c)
    assert pc.publish(c) == len(a) // BLOCK
    assert pc.extend(m.new_cache(512), b, 0) == 3 * BLOCK
