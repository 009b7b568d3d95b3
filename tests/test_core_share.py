"""The compute-thread count follows the cores other processes leave (fast tier: a fake clock and
fake CPU counters), and the real counters read on this machine."""

import pytest

from kiln.native.core_share import INTERVAL, CoreShare, _machine_busy, _own_busy


class Machine:
    """CPU-seconds: the rest of the machine at `others` cores, this process at `ours`."""

    def __init__(self):
        self.t = 0.0
        self.others = self.ours = 0.0
        self.busy_total = self.own_total = 0.0

    def advance(self, seconds, others, ours):
        self.t += seconds
        self.busy_total += (others + ours) * seconds
        self.own_total += ours * seconds


def share(m, cores=2, threads=2):
    return CoreShare(threads, cores=cores, clock=lambda: m.t, machine=lambda: m.busy_total, own=lambda: m.own_total)


def test_all_threads_while_the_machine_is_quiet_and_one_while_another_process_computes():
    m = Machine()
    s = share(m)
    assert s.threads() == 2                       # nothing known yet: all of them
    m.advance(INTERVAL, others=0.05, ours=2.0)    # a supervisor answering HTTP: a sliver
    assert s.threads() == 2
    m.advance(INTERVAL, others=0.7, ours=1.3)     # a CPU-bound process took most of a core
    assert s.threads() == 1 and abs(s.others - 0.7) < 1e-9
    m.advance(INTERVAL, others=1.0, ours=1.0)     # it goes on: stay on one core
    assert s.threads() == 1
    m.advance(INTERVAL, others=0.0, ours=1.0)     # it stopped: both cores again
    assert s.threads() == 2


def test_it_looks_at_most_every_interval_and_never_drops_below_one_thread():
    m = Machine()
    s = share(m, cores=4, threads=4)
    s.threads()
    m.advance(INTERVAL / 2, others=4.0, ours=0.0)
    assert s.threads() == 4                       # too soon to look again
    m.advance(INTERVAL, others=4.0, ours=0.0)
    assert s.threads() == 1                       # every core busy: still one thread
    m.advance(INTERVAL, others=1.6, ours=2.4)
    assert s.threads() == 2                       # two cores' worth left


def test_the_counters_are_read_from_proc():
    busy, own = _machine_busy(), _own_busy()
    assert busy is not None and busy > 0 and own > 0
    x = 0
    for i in range(3_000_000):                    # burn some CPU: both counters move
        x += i
    assert _own_busy() > own and _machine_busy() >= busy


@pytest.mark.parametrize("idle_s, told", [(30, False), (1.0, True)], ids=["stale-look", "scheduler-resumed"])
def test_after_idling_what_others_did_meanwhile_is_not_held_against_us(idle_s, told):
    """Idle long enough that the last look is stale, or woken by the scheduler after any idle
    spell: another process using the cores we left was not contention."""
    m = Machine()
    s = share(m)
    s.threads()
    m.advance(INTERVAL, others=1.0, ours=1.0)
    assert s.threads() == 1
    m.advance(idle_s, others=2.0, ours=0.0)
    if told:
        s.resume()
    assert s.threads() == 2
    m.advance(INTERVAL, others=0.1, ours=1.9)
    assert s.threads() == 2
