"""The moe-stream worker through the daemon: same answers as in RAM, a cache that survives a
worker crash, and no shared-memory segment left behind."""

import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from daemon_harness import Daemon, env_for
from kiln.native import kernels
from kiln.supervisor.core import segments

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.skipif(kernels.kernel_info()["path"] != "compiled", reason="needs the compiled kernels")]


def complete(d, prompt, n=12):
    req = urllib.request.Request(d.http + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def cache_stats(d):
    return d.status()["workers"][0]["stats"]["expert_cache"]


def ready(d):
    d.wait(lambda st: st["workers"][0]["state"] == "running" and st["workers"][0]["worker_state"] == "ready",
           timeout=60, what="stream worker ready")


def settled_stats(d):
    """Cache stats once two heartbeats agree (a heartbeat may predate the last steps)."""
    prev = None
    for _ in range(100):
        cur = cache_stats(d)
        if prev is not None and cur == prev:
            return cur
        prev = cur
        time.sleep(0.3)
    return cur


def stream_worker(model, cache, memory=None):
    settings = {"expert_cache": cache, **({"cache_memory": memory} if memory else {})}
    return {"kind": "moe-stream", "model": str(model), "settings": settings}


def shm_files(home):
    return sorted(p.name for p in segments.SHM_DIR.glob(segments.prefix(Path(home)) + "*"))


@pytest.mark.parametrize("memory", ["shared", "private"])
def test_streamed_answers_equal_in_ram_answers_and_the_cache_survives_a_crash(e8k2_path, tmp_path, memory):
    """In the supervisor's segment the cache survives a worker's crash (warm restart); in the
    worker's own memory (huge pages where shared memory has none) the restart starts cold — and
    the status says which."""
    engine = subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "debug", "generate", str(e8k2_path),
                             "Once upon a time", "--max-tokens", "12", "--json"],
                            capture_output=True, text=True, env=env_for(tmp_path), check=True)
    with Daemon(tmp_path, {"default": stream_worker(e8k2_path, "64MiB", memory)}) as d:
        ready(d)
        assert len(shm_files(tmp_path)) == (memory == "shared")          # no segment for a private cache
        made = [e["event"] for e in d.status()["events"] if e["event"].startswith("segment_")]
        assert made == ["segment_created" if memory == "shared" else "segment_skipped"]
        assert complete(d, "Once upon a time") == json.loads(engine.stdout)["text"]
        st = settled_stats(d)
        assert st["io_mode"] in ("direct", "buffered") and st["misses"] > 0 and st["used"] > 0
        assert st["memory"] == memory and st["warm_restart"] == (memory == "shared") and st["memory_why"]
        hot = tmp_path / "expert-cache" / "default.json"                 # the worker's hot list
        d.wait(lambda s: hot.exists(), timeout=30, what="the hot list saved")
        old = d.status()["workers"][0]["pid"]
        os.kill(old, signal.SIGKILL)
        d.wait(lambda s: s["workers"][0]["pid"] not in (None, old) and s["workers"][0]["worker_state"] == "ready",
               timeout=60, what="restarted")
        warm = cache_stats(d)
        assert warm["warm_slots_at_start"] == (st["used"] if memory == "shared" else 0)   # every slot re-validated
        if memory == "private":                                          # read again from the hot list
            assert 0 < warm["preloaded_at_start"] <= warm["used"]
        assert complete(d, "Once upon a time") == json.loads(engine.stdout)["text"]
        after = settled_stats(d)
        if memory == "shared":
            assert after["hits"] > 0 and after["hit_rate"] > 0.9         # warm from the first token
    assert shm_files(tmp_path) == []                                     # kiln down unlinked it


def test_a_cache_memory_that_is_not_a_choice_fails_the_boot_and_says_the_choices(e8k2_path, tmp_path):
    with Daemon(tmp_path, {"default": stream_worker(e8k2_path, "64MiB", "hugetlb")}) as d:
        w = d.wait_state("default", "fatal", timeout=60)
        assert "cache_memory 'hugetlb' is not one of auto, shared, private" in w["reason"]
        events = [(e["event"], e["detail"]) for e in d.status()["events"] if e["worker"] == "default"]
        exits = [i for i, (e, _) in enumerate(events) if e == "exited"]
        assert w["restarts"] == 0, events                                # no kill while it loaded either
        assert len(exits) == 1 and events[exits[0]][1].startswith("code 3"), events
        assert not any(e == "spawned" for e, _ in events[exits[0]:]), events   # a boot error is not retried


def cached_bytes(path: Path) -> int:
    """How much of a file is in the page cache (mincore over a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, page = os.path.getsize(path), mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = (ctypes.c_ubyte * -(-size // page))()
        try:
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) * page


def test_rss_stays_within_non_expert_weights_plus_cache_while_generating(e8k2_path, tmp_path):
    """While generating, RSS above what the booted worker held (Python, tokenizer, the mapped but
    untouched file) ≤ 1.15 × (non-expert weights + cache segment + KV cache), with a cache of a
    third of the experts.

    The file starts out of the page cache. When it sits there in large folios (a process read it
    whole — earlier tests do), touching a non-expert tensor maps its whole folio, experts beside
    it included: ~40 MB of never-read experts in RSS (no madvise of the mapping prevents it on
    this kernel: MADV_DONTNEED zaps whole folios, MADV_RANDOM and MADV_NOHUGEPAGE change nothing).
    Pages another mapping holds cannot be dropped, so this process's models go first."""
    import gc
    import threading
    gc.collect()                                     # models earlier tests left in this process
    fd = os.open(e8k2_path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    cached = cached_bytes(e8k2_path)
    assert cached <= 4 << 20, f"{cached} bytes of the model stay cached: another process maps it"
    with Daemon(tmp_path, {"default": stream_worker(e8k2_path, "16MiB")}) as d:
        ready(d)
        peak = 0
        t = threading.Thread(target=complete, args=(d, "The history of the printing press", 48))
        t.start()
        while t.is_alive():
            peak = max(peak, d.status()["workers"][0]["rss_bytes"] or 0)
            time.sleep(0.05)
        w = d.status()["workers"][0]
        mem = w["stats"]["memory"]
        cache = settled_stats(d)
        assert cache["misses"] > 0 and cache["io_ms_per_token"] is not None
        budget = 1.15 * (mem["non_expert_bytes"] + mem["cache_bytes"] + mem["kv_cache_bytes"])
        assert peak - mem["rss_after_boot"] <= budget, (peak, mem)


def test_stale_segments_of_a_killed_tree_are_removed_by_the_next_up(e8k2_path, tmp_path):
    d = Daemon(tmp_path, {"default": stream_worker(e8k2_path, "8MiB", "shared")}).start()
    ready(d)
    seg = shm_files(tmp_path)
    pids = [d.proc.pid, d.status()["workers"][0]["pid"]]
    for p in pids:                                                       # kill -9 the whole tree
        os.kill(p, signal.SIGKILL)
    d.proc.wait()
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert shm_files(tmp_path) == seg                                    # the crash leaked it...
    d2 = Daemon(tmp_path, {"default": stream_worker(e8k2_path, "8MiB", "shared")}).start()
    try:
        ready(d2)
        events = [e for e in d2.status()["events"] if e["event"] == "stale_segments_removed"]
        assert events and seg[0] in events[0]["detail"]                  # ...and the next up removed it
        assert len(shm_files(tmp_path)) == 1
    finally:
        d2.stop()
    assert shm_files(tmp_path) == []


def test_a_dense_model_is_refused_by_the_stream_worker(default_model_path, tmp_path):
    with Daemon(tmp_path, {"default": stream_worker(default_model_path, "8MiB")}) as d:
        w = d.wait_state("default", "fatal", timeout=60)
        assert "not a mixture-of-experts model" in w["reason"]


def test_kiln_up_stream_refuses_a_dense_model_and_a_bad_cache_size_before_starting(default_model_path, tmp_path):
    from daemon_harness import kiln
    r = kiln(tmp_path, "up", "--model", str(default_model_path), "--stream")
    assert r.returncode == 1 and "not a mixture-of-experts model" in r.stderr and "without streaming" in r.stderr
    r = kiln(tmp_path, "up", "--model", str(default_model_path), "--stream", "--expert-cache", "5x")
    assert r.returncode == 2 and "'5x' is not a size" in r.stderr
    r = kiln(tmp_path, "status")                         # nothing was started
    assert r.returncode == 1 and "not running" in r.stderr


def test_kiln_up_streams_an_moe_model_whose_experts_do_not_fit(e8k2_path, tmp_path):
    from kiln.native.models.plan import plan
    p = plan(e8k2_path, ctx=2048)
    budget = p["non_expert_bytes"] + p["kv_cache_bytes"] + p["prefix_cache_bytes"] + p["runtime_bytes"] + 40 * 2**20
    # (experts: ~69 MB)
    d = Daemon(tmp_path, {"default": {"kind": "inference", "model": str(e8k2_path), "settings": {"ctx": 2048}}},
               supervisor={"memory_budget": int(budget / 0.9)})
    d.start()
    try:
        ready(d)
        w = d.status()["workers"][0]
        assert w["kind"] == "moe-stream"
        assert "streaming them from disk" in d.output()
        health = d.command("health")
        assert health["workers"]["default"]["expert_cache"]["slots"] > 0
        assert complete(d, "Once upon a time", 4)
    finally:
        d.stop()


def test_kiln_up_streams_qwen35moe_with_the_same_greedy_text_as_in_ram(tmp_path):
    """`kiln up --model tiny-qwen35moe.gguf --stream --expert-cache 25%`: the hybrid model's
    experts stream through the moe-stream worker, its answer equals the engine's in RAM."""
    from conftest import tiny_path
    path = tiny_path("qwen35moe")
    engine = subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "debug", "generate", str(path),
                             "Once upon a time", "--max-tokens", "12", "--json"],
                            capture_output=True, text=True, env=env_for(tmp_path), check=True)
    with Daemon(tmp_path, {}, extra_args=("--model", str(path), "--stream", "--expert-cache", "25%")) as d:
        ready(d)
        w = d.status()["workers"][0]
        assert w["kind"] == "moe-stream"
        assert complete(d, "Once upon a time") == json.loads(engine.stdout)["text"]
        assert settled_stats(d)["misses"] > 0


def _slots_budget(path, slots: int) -> str:
    """An expert_cache size that holds exactly `slots` experts of the model."""
    from kiln.native.experts.cache import ENTRY_BYTES, ExpertCache
    from kiln.native.experts.store import ExpertStore
    from kiln.native.gguf_file import read_gguf
    probe = ExpertCache.__new__(ExpertCache)
    probe._geometry(read_gguf(path), ExpertStore(path))
    return f"{4096 + slots * (probe.slot_bytes + ENTRY_BYTES)}B"


def test_the_mla_moe_streams_a_quarter_of_its_experts_to_the_in_ram_text_and_a_cache_too_small_is_named(tmp_path):
    """deepseek2 (MLA, shared experts) through the moe-stream worker with 2 of its 8 experts
    resident: the answer is the in-RAM engine's; a cache holding 1 expert — fewer than the 2 a
    token uses in a layer — fails the worker's boot naming the size it needs."""
    from conftest import tiny_path
    path = tiny_path("deepseek2")
    engine = subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "debug", "generate", str(path),
                             "Once upon a time", "--max-tokens", "12", "--json"],
                            capture_output=True, text=True, env=env_for(tmp_path), check=True)
    workers = {"default": stream_worker(path, _slots_budget(path, 2)),
               "small": stream_worker(path, _slots_budget(path, 1))}
    with Daemon(tmp_path, workers) as d:
        w = d.wait_state("small", "fatal", timeout=60)
        assert "holds 1 expert(s)" in w["reason"] and "uses 2 per token" in w["reason"] and "at least" in w["reason"]
        ready(d)
        assert d.command("health")["workers"]["default"]["expert_cache"]["slots"] == 2
        assert complete(d, "Once upon a time") == json.loads(engine.stdout)["text"]
        assert settled_stats(d)["misses"] > 0
