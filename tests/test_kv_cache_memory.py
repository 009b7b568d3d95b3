"""The KV cache's memory while it grows: a longer prompt reallocates every layer's keys and values,
and the peak must stay near the cache's own size — a peak RSS of twice the cache was what put a
model's resident memory over llama.cpp's (issue 37)."""

import tracemalloc

import numpy as np

from kiln.native.kv_cache import KVCache

LAYERS, HEADS, DIM = 12, 4, 64


def _room(positions: int) -> int:
    """Bytes of one layer's keys (or values) for that many positions, fp16."""
    return positions * HEADS * DIM * 2


def test_growing_the_cache_holds_one_old_buffer_beside_the_new_ones_not_all():
    tracemalloc.start()
    try:
        cache = KVCache(LAYERS, HEADS, DIM, max_tokens=4096)
        cache.begin(list(range(1000)))
        k = np.ones((1000, HEADS, DIM), np.float32)
        for layer in range(LAYERS):
            cache.store(layer, k, k)
        cache.commit(list(range(1000)))
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        cache.begin(list(range(1500)))                       # 1,024 positions of room -> 2,560
        now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    old, new = 2 * LAYERS * _room(1024), 2 * LAYERS * _room(2560)
    assert abs((now - held) - (new - old)) < 64 * 1024      # the old buffers are gone
    # the peak: the new room and one old buffer, not the new room beside the whole old cache
    assert peak - held <= new - old + _room(1024) + 64 * 1024, (peak - held, new, old)
    assert cache.n == 1000
    for layer in range(LAYERS):
        keys, _ = cache.store(layer, k[:1], k[:1])
        assert np.array_equal(keys[:1000], np.ones((1000, HEADS, DIM), np.float16))
