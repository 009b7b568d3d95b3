"""The expert read pool: urgent reads first, unwanted guesses cancelled, slots never reused while
a read may still write into them."""

import threading

import pytest

from kiln.native.expert_io import AHEAD, DEMAND, FILL, ExpertRead, ReadCancelled, ReadPool

DEADLINE = 10


@pytest.fixture
def pool():
    p = ReadPool(1)
    yield p
    p.close()


def blocked(pool: ReadPool) -> threading.Event:
    """Occupy the pool's one thread until the returned event is set, so what is submitted
    meanwhile queues up."""
    gate, running = threading.Event(), threading.Event()

    def hold():
        running.set()
        gate.wait(DEADLINE)
    pool.submit(DEMAND, hold)
    assert running.wait(DEADLINE)
    return gate


def read(pool, priority, log, name, parts=3):
    return ExpertRead(pool, priority, [lambda i=i: log.append((name, i)) for i in range(parts)], lambda: name)


def test_demand_reads_go_before_guesses_and_guesses_before_fills(pool):
    log = []
    gate = blocked(pool)
    fill, ahead, demand = read(pool, FILL, log, "fill"), read(pool, AHEAD, log, "ahead"), read(pool, DEMAND, log, "demand")
    gate.set()
    assert [r.future.result(DEADLINE) for r in (fill, ahead, demand)] == ["fill", "ahead", "demand"]
    assert [n for n, _ in log] == ["demand"] * 3 + ["ahead"] * 3 + ["fill"] * 3


def test_a_guess_turned_needed_is_hurried_ahead_of_other_guesses(pool):
    log = []
    gate = blocked(pool)
    first, second = read(pool, AHEAD, log, "first"), read(pool, AHEAD, log, "second")
    second.hurry(pool, DEMAND)
    gate.set()
    first.future.result(DEADLINE), second.future.result(DEADLINE)
    assert [n for n, _ in log] == ["second"] * 3 + ["first"] * 3       # each part ran once


def test_a_guess_cancelled_before_it_starts_reads_nothing(pool):
    log = []
    gate = blocked(pool)
    r = read(pool, AHEAD, log, "guess")
    assert r.cancel() == []
    gate.set()
    with pytest.raises(ReadCancelled):
        r.future.result(DEADLINE)
    assert log == []


def test_a_cancelled_read_completes_only_after_its_running_part_ends():
    """The slot is reused once the future is done: a part writing into it must have finished."""
    pool = ReadPool(1)
    try:
        started, finish, log = threading.Event(), threading.Event(), []

        def slow_part():
            started.set()
            finish.wait(DEADLINE)
            log.append("part 0 done")
        r = ExpertRead(pool, AHEAD, [slow_part, lambda: log.append("part 1"), lambda: log.append("part 2")],
                       lambda: "views")
        assert started.wait(DEADLINE)
        assert r.cancel() == [0]                     # part 0 had started
        assert not r.future.done()
        finish.set()
        with pytest.raises(ReadCancelled):
            r.future.result(DEADLINE)
        assert log == ["part 0 done"]                # parts 1 and 2 were skipped
    finally:
        pool.close()


def test_a_failed_part_fails_the_read_after_the_other_parts_stop(pool):
    def bad():
        raise OSError(5, "Input/output error")
    log = []
    r = ExpertRead(pool, DEMAND, [lambda: log.append(0), bad, lambda: log.append(2)], lambda: "views")
    with pytest.raises(OSError, match="Input/output error"):
        r.future.result(DEADLINE)
    assert log == [0]                                # the part after the failure was not read
