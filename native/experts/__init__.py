"""The MoE expert store: a model's experts streamed from its file into a cache of fixed slots
instead of held in RAM, bit for bit the in-RAM answers.

    store.py       where each (layer, expert, projection) lies in the file; how the file is opened
    io.py          the reads: C threads (or Python ones), priorities, chunks, cancelling
    memory.py      where the slots live: private huge pages or the supervisor's shared segment
    slots.py       an expert's place in its slot; the index a restarted worker re-attaches
    cache.py       ExpertCache: residency, eviction, hits and misses, stats
    policy.py      which expert to evict (lru, lfu, lrfu) and the replays that compare them
    read_ahead.py  guesses for the next layer read while this one computes, and their score
    runs.py        a layer's experts computed as they arrive
    warm.py        the hottest experts saved, and preloaded at start
    source.py      where a forward's routed experts come from: the mapped file or the cache
"""
