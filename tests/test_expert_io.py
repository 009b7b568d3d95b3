"""The expert read queue: urgent reads first, unwanted guesses cancelled, slots never reused while
a read may still write into them — real reads of a real file, by the compiled reader
(native/_reader.c) and its Python-thread twin alike. The disk's failures and stalls are
simulated with the reader's `fault` (a healthy disk cannot be made to fail on purpose)."""

import errno
import mmap

import numpy as np
import pytest

from kiln.native.experts.io import AHEAD, DEMAND, FILL, ReadCancelled, ReadQueue, compiled_reader
from kiln.native.experts.store import ExpertStore

DEADLINE = 10
CHUNK = 64 << 10
SLOT = 4 * CHUNK                                   # a read: one part of 4 chunks


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("io") / "experts.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 8 * SLOT + 1000, np.uint8).tobytes())
    return path


@pytest.fixture(params=["compiled", "python"])
def setup(request, data_file):
    if request.param == "compiled" and compiled_reader() is None:
        pytest.skip("the compiled reader is not built")
    store = ExpertStore(data_file)
    buf = mmap.mmap(-1, 8 * SLOT)
    q = ReadQueue(store, 1, 8, 4, CHUNK, python=request.param == "python")
    assert q.kind == request.param
    yield store, q, np.frombuffer(buf, np.uint8), data_file.read_bytes()
    q.reader.fault()
    q.close()
    store.close()


def submit(q, mem, slot, priority, log=None, name=None, file_slot=None, need=SLOT):
    fs = slot if file_slot is None else file_slot
    parts = [(fs * SLOT, SLOT, need, mem.ctypes.data + slot * SLOT)]
    return q.submit(slot, priority, parts, lambda: (log.append(name) if log is not None else None) or name,
                    lambda at, exc: OSError(exc.errno, f"slot {slot} at {at}: {exc.strerror}"))


def wait_until(cond):
    import time
    deadline = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.005)


def hold_first(q, mem):
    """A read of slot 7 whose first chunk the one thread takes and is held on until the faults
    are cleared: what is submitted meanwhile queues up."""
    q.reader.fault(7 * SLOT, 7 * SLOT + 1, 0, -1.0)
    r = submit(q, mem, 7, DEMAND)
    wait_until(lambda: q.stats()["chunks_in_flight"] == 1)
    return r


def test_reads_put_the_files_bytes_in_the_slot(setup):
    store, q, mem, data = setup
    reads = [submit(q, mem, s, DEMAND, name=s) for s in range(3)]
    assert [r.result(DEADLINE) for r in reads] == [0, 1, 2]
    assert mem[:3 * SLOT].tobytes() == data[:3 * SLOT]
    assert q.stats()["bytes"] == 3 * SLOT


def test_demand_reads_go_before_guesses_and_guesses_before_fills(setup):
    _, q, mem, _ = setup
    log = []
    held = hold_first(q, mem)
    fill, ahead, demand = (submit(q, mem, s, p, log, n) for s, p, n in ((0, FILL, "fill"), (1, AHEAD, "ahead"),
                                                                          (2, DEMAND, "demand")))
    q.reader.fault()
    for r in (held, fill, ahead, demand):
        r.result(DEADLINE)
    assert log == ["demand", "ahead", "fill"]


def test_a_guess_turned_needed_is_hurried_ahead_of_other_guesses(setup):
    _, q, mem, data = setup
    log = []
    held = hold_first(q, mem)
    first, second = submit(q, mem, 0, AHEAD, log, "first"), submit(q, mem, 1, AHEAD, log, "second")
    second.hurry(DEMAND)
    q.reader.fault()
    for r in (held, first, second):
        r.result(DEADLINE)
    assert log == ["second", "first"]
    assert q.stats()["bytes"] == 3 * SLOT                          # each chunk read once
    assert mem[:2 * SLOT].tobytes() == data[:2 * SLOT]


def test_a_guess_cancelled_before_it_starts_reads_nothing(setup):
    _, q, mem, _ = setup
    held = hold_first(q, mem)
    r = submit(q, mem, 0, AHEAD)
    assert r.cancel() == 0
    q.reader.fault()
    with pytest.raises(ReadCancelled):
        r.result(DEADLINE)
    held.result(DEADLINE)
    assert not mem[:SLOT].any() and q.stats()["bytes"] == SLOT


def test_a_cancelled_read_completes_only_after_its_running_chunk_ends(setup):
    """The slot is reused once the read is done: a chunk writing into it must have finished."""
    _, q, mem, data = setup
    q.reader.fault(0, 1, 0, -1.0)                                  # the first chunk of slot 0 is held
    r = submit(q, mem, 0, AHEAD)
    wait_until(lambda: q.stats()["chunks_in_flight"] == 1)
    assert r.cancel() == 1                                         # one chunk had started
    q.collect(0.0)
    assert not r.done()
    q.reader.fault()
    with pytest.raises(ReadCancelled):
        r.result(DEADLINE)
    assert mem[:CHUNK].tobytes() == data[:CHUNK] and not mem[CHUNK:SLOT].any()


def test_a_failed_chunk_fails_the_read_says_where_and_the_rest_is_not_read(setup):
    _, q, mem, data = setup
    q.reader.fault(CHUNK, CHUNK + 1, errno.EIO)
    r = submit(q, mem, 0, DEMAND)
    with pytest.raises(OSError, match=f"slot 0 at {CHUNK}: Input/output error"):
        r.result(DEADLINE)
    assert mem[:CHUNK].tobytes() == data[:CHUNK] and not mem[2 * CHUNK:SLOT].any()
    q.reader.fault()
    assert submit(q, mem, 0, DEMAND, name="again").result(DEADLINE) == "again"   # the slot reads again
    assert mem[:SLOT].tobytes() == data[:SLOT]


def test_a_read_short_of_the_bytes_needed_fails_and_past_them_does_not(setup):
    _, q, mem, data = setup
    tail = len(data) - 8 * SLOT                                    # 1000 bytes after the last full slot
    big = mmap.mmap(-1, 2 * SLOT)
    dest = np.frombuffer(big, np.uint8)
    ok = q.submit(0, DEMAND, [(8 * SLOT, SLOT, tail, dest.ctypes.data)], lambda: "ok", lambda at, e: e)
    assert ok.result(DEADLINE) == "ok" and dest[:tail].tobytes() == data[8 * SLOT:]
    short = q.submit(1, DEMAND, [(8 * SLOT, SLOT, tail + 1, dest.ctypes.data + SLOT)], lambda: "ok", lambda at, e: e)
    with pytest.raises(OSError) as err:
        short.result(DEADLINE)
    assert err.value.errno == errno.EIO


def test_o_direct_refused_at_read_turns_to_buffered_reads_and_says_so(setup):
    store, q, mem, data = setup
    if store.io_mode != "direct":
        pytest.skip("O_DIRECT is not available for this file system")
    q.reader.fault(0, 1 << 40, errno.EINVAL, 0.0, True)           # what tmpfs/overlayfs answer O_DIRECT
    assert submit(q, mem, 0, DEMAND, name="read").result(DEADLINE) == "read"
    assert store.io_mode == "buffered" and "EINVAL" in store.fallback_reason
    assert mem[:SLOT].tobytes() == data[:SLOT]


@pytest.mark.parametrize("kind", ["compiled", "python"])
def test_the_time_at_each_queue_depth_adds_up_to_the_time_reading(kind, data_file):
    """depth_seconds: how deep the disk's queue was while reading (the bench's read_queue_depth)."""
    from kiln.native.experts.cache import mean_depth
    if kind == "compiled" and compiled_reader() is None:
        pytest.skip("the compiled reader is not built")
    store = ExpertStore(data_file)
    buf = mmap.mmap(-1, 8 * SLOT)
    mem = np.frombuffer(buf, np.uint8)
    q = ReadQueue(store, 3, 8, 4, CHUNK, python=kind == "python")
    try:
        for s in range(3):                                  # each read's first chunk held: 3 in flight
            q.reader.fault(s * SLOT, s * SLOT + 1, 0, -1.0)
        reads = [submit(q, mem, s, DEMAND) for s in range(3)]
        wait_until(lambda: q.stats()["chunks_in_flight"] == 3)
        wait_until(lambda: q.stats()["depth_seconds"][2] > 0.05)
        q.reader.fault()
        for r in reads:
            r.result(DEADLINE)
        st = q.stats()
        depth = st["depth_seconds"]
        assert len(depth) == 8 and depth[2] > 0.05 and not any(depth[3:])
        assert sum(depth) == pytest.approx(st["busy_seconds"], abs=1e-6)
        assert 2.0 < mean_depth(depth) <= 3.0
        assert mean_depth([0.0] * 8) is None
    finally:
        q.reader.fault()
        q.close()
        store.close()
