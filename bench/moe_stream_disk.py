"""The raw disk figures of bench/moe_stream.py: O_DIRECT reads of the model file as a disk
benchmark does (a few reused buffers), into destinations spread as the expert cache's slots are,
and beside an in-RAM decode in another process (`python moe_stream_disk.py --busy MODEL`)."""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import sys
import time
from pathlib import Path

import numpy as np


def raw_direct_reads(path: Path, read_bytes: int, seq_bytes: int = 1 << 30, chunk: int = 8 << 20,
                     n_random: int = 192, quick: bool = False) -> dict:
    """O_DIRECT read throughput of the file's disk: sequential chunks, and reads of `read_bytes`
    (one expert projection) at random aligned offsets, 1, 4 and 16 at a time — each into huge
    pages (as the expert cache reads) and into 4 KiB pages (`_4k`): the pages a read lands in
    change what the disk delivers (native/expert_memory.py). `raw_gb_s` is the best.

    `_spread`: the random reads 1 and 4 at a time again, each into a different 2 MiB of a 1 GiB
    region — as the expert cache's reads land all over its slots. The reads above reuse a few
    buffers, and on this VM (where a read is the host copying into guest memory) that alone makes
    them ~25 % faster (4 buffers 2.26 GB/s, 16: 1.86, 64: 1.69, 192: 1.77, alternated). It is not
    the guest's CPU cache: touching a spread destination's every line or every page just before
    its read does not help (2.17 / 2.57 GB/s against 2.49, 4 in flight, 8 rounds) — it is how the
    host maps the guest's memory, out of the guest's reach. `raw_spread_gb_s` is the best of those, beside `raw_gb_s`, not in it.
    `random_qd4_staged_gb_s`: the spread reads through a reused buffer per thread and a copy.

    Then the same random reads into huge pages beside an in-RAM decode of the model in another
    process (`_beside_decode`): what the disk delivers while the two vCPUs compute, as they do
    during a streamed decode. On a shared VM the disk is slower then (the guest's I/O needs CPU
    too); `raw_beside_decode_gb_s` is the best of those, reported beside `raw_gb_s`, not in it.

    `quick`: only into huge pages, 512 MiB sequential and the random reads 1 and 4 at a time
    (~1 s), nothing beside decode — the raw figure taken around each streamed run."""
    if quick:
        seq_bytes, n_random = min(seq_bytes, 512 << 20), min(n_random, 128)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.fstat(fd).st_size
    size_r = -(-read_bytes // 4096) * 4096
    out = {}
    try:
        for huge, tag in ((True, ""),) if quick else ((True, ""), (False, "_4k")):
            evict(path)
            buf = _buffers(1, chunk, huge)[0]
            n = min(seq_bytes, size // chunk * chunk)
            t = time.perf_counter()
            for off in range(0, n, chunk):
                os.preadv(fd, [buf], off)
            out[f"sequential{tag}_gb_s"] = round(n / (time.perf_counter() - t) / 1e9, 3)
            for depth in (1, 4) if quick else (1, 4, 16):
                out[f"random_qd{depth}{tag}_gb_s"] = _random_reads(fd, size, size_r, depth, n_random, huge, depth)
        out["raw_gb_s"] = max(v for k, v in out.items() if k.endswith("_gb_s"))
        for depth in (1, 4):
            out[f"random_qd{depth}_spread_gb_s"] = _random_reads(fd, size, size_r, depth, n_random, True, 50 + depth,
                                                                 spread=True)
        out["raw_spread_gb_s"] = max(out["random_qd1_spread_gb_s"], out["random_qd4_spread_gb_s"])
        if quick:
            return out
        out["random_qd4_staged_gb_s"] = _staged_reads(fd, size, size_r, 4, n_random, 70)
        with _busy_decoding(path):
            for depth in (1, 4):
                out[f"random_qd{depth}_beside_decode_gb_s"] = _random_reads(fd, size, size_r, depth, n_random, True,
                                                                            100 + depth)
        out["raw_beside_decode_gb_s"] = max(out["random_qd1_beside_decode_gb_s"], out["random_qd4_beside_decode_gb_s"])
        out["read_bytes"] = size_r
    finally:
        os.close(fd)
    return out


def _buffers(n: int, each: int, huge: bool) -> list:
    """n buffers of `each` bytes, in huge pages (each on its own) or in 4 KiB pages."""
    from kiln.native.experts.memory import private_buffer
    stride = -(-each // (2 << 20)) * (2 << 20)
    region = private_buffer(n * stride + (2 << 20), huge) if huge else mmap.mmap(-1, n * stride)
    base = memoryview(region)
    skip = -np.frombuffer(region, np.uint8).ctypes.data % (2 << 20) if huge else 0
    return [base[skip + i * stride: skip + i * stride + each] for i in range(n)]


_SPREAD: list = []                      # the 1 GiB region of the spread reads, made once


def _random_reads(fd: int, size: int, each: int, depth: int, n: int, huge: bool, seed: int,
                  spread: bool = False) -> float:
    """GB/s of n reads of `each` bytes at random aligned offsets, `depth` in flight, into `depth`
    buffers reused — or (`spread`) each into a random 2 MiB of a 1 GiB region of huge pages."""
    from concurrent.futures import ThreadPoolExecutor
    rnd = random.Random(seed)
    if spread:
        if not _SPREAD:
            _SPREAD.extend(_buffers(512, 2 << 20, True))
            for b in _SPREAD:                                 # touched: no first-touch faults in the reads
                np.frombuffer(b, np.uint8)[::4096] = 0
        bufs = [_SPREAD[rnd.randrange(len(_SPREAD))][:each] for _ in range(n)]
    else:
        bufs = _buffers(depth, each, huge)
    offs = [rnd.randrange(0, size - each) // 4096 * 4096 for _ in range(n)]
    with ThreadPoolExecutor(depth) as pool:
        t = time.perf_counter()
        list(pool.map(lambda i: os.preadv(fd, [bufs[i % len(bufs)]], offs[i]), range(n)))
        return round(n * each / (time.perf_counter() - t) / 1e9, 3)


def _staged_reads(fd: int, size: int, each: int, depth: int, n: int, seed: int) -> float:
    """GB/s of the spread reads done another way: each thread reads into its own reused buffer
    (the fast case above), then copies into the spread destination. Whether staging could win
    the reused buffers' speed for the cache's slots: on this VM it does not (2.20 GB/s against
    2.41 direct and 3.24 reused, 4 in flight, medians of 6 alternated rounds; 2.31 / 2.38 / 2.93
    in another 8) — the copy takes the vCPU time the host's copy into guest memory needs."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    _random_reads(fd, size, each, 1, 1, True, seed, spread=True)           # the spread region exists
    rnd = random.Random(seed)
    dests = [np.frombuffer(_SPREAD[rnd.randrange(len(_SPREAD))][:each], np.uint8) for _ in range(n)]
    offs = [rnd.randrange(0, size - each) // 4096 * 4096 for _ in range(n)]
    stages, own = iter(_buffers(depth, each, True)), threading.local()

    def one(i: int) -> None:
        if not hasattr(own, "buf"):
            own.buf = next(stages)
        os.preadv(fd, [own.buf], offs[i])
        np.copyto(dests[i], np.frombuffer(own.buf, np.uint8))

    with ThreadPoolExecutor(depth) as pool:
        t = time.perf_counter()
        list(pool.map(one, range(n)))
        return round(n * each / (time.perf_counter() - t) / 1e9, 3)


@contextlib.contextmanager
def _busy_decoding(path: Path):
    """An in-RAM decode of the model running in another process (`--busy`) for the block's length."""
    import subprocess
    proc = subprocess.Popen([sys.executable, __file__, "--busy", str(path)], stdout=subprocess.PIPE, text=True,
                            env=worker_env())
    try:
        if proc.stdout.readline().strip() != "decoding":
            raise RuntimeError(f"the background decode did not start (exit {proc.wait()})")
        yield
    finally:
        proc.kill()
        proc.wait()


def busy_decode(path: Path) -> None:
    """Decode in RAM until killed (the compute beside `raw_direct_reads`' `_beside_decode` reads)."""
    from kiln.native.model import load_model
    model = load_model(path)
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    kv = model.new_cache(1 << 16)
    steps = np.random.default_rng(7).integers(0, model.config.n_vocab, (1 << 16) - 1).tolist()
    model.forward(steps[:4], kv)
    model.forward(steps[4:5], kv)
    print("decoding", flush=True)
    for tok in steps[5:]:
        model.forward([tok], kv)


def file_pmd_mapped() -> int:
    """Bytes of mapped files this process maps in 2 MiB pages: where the page cache put the
    in-RAM model's weights moves its speed (31–44 tok/s for the same decode on this VM)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("FilePmdMapped:")), 0)
    except OSError:
        return 0


def evict(path: Path) -> None:
    """Drop the file from the page cache (clean pages nobody maps)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def worker_env() -> dict:
    """The environment a worker runs in: the supervisor sets libgomp's spin (supervisor/processes.py)
    unless the user did, so the bench measures the engine as `kiln up` runs it."""
    env = dict(os.environ)
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = "30000"
    return env


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--busy":
        busy_decode(Path(sys.argv[2]))
    else:
        sys.exit("usage: moe_stream_disk.py --busy MODEL (run by bench/moe_stream.py)")
