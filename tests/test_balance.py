"""The fleet's balancer (grail/rollouts/balance.py): where each group goes, what it records."""

from __future__ import annotations

from collections import Counter

import pytest

from grail.rollouts.balance import SPEED_SMOOTHING, Balancer

COST = 1000.0  # a group's expected tokens


def _fill(balancer: Balancer, groups: int) -> list[int]:
    """Place `groups` groups, none answered; the servers chosen, in order."""
    chosen = []
    for _ in range(groups):
        server = balancer.choose(COST)
        assert server is not None
        balancer.started(server, COST)
        chosen.append(server)
    return chosen


def _measure(balancer: Balancer, speeds: list[float]) -> None:
    """Give every server one answered group at its speed (tokens / s)."""
    for server, speed in enumerate(speeds):
        balancer.started(server, COST)
        balancer.finished(server, COST, tokens=int(speed * 10), seconds=10.0)


def test_an_idle_fleet_fills_evenly_in_index_order() -> None:
    balancer = Balancer(servers=4, window=8)
    assert _fill(balancer, 4) == [0, 1, 2, 3]
    assert Counter(_fill(balancer, 12)) == {0: 3, 1: 3, 2: 3, 3: 3}


def test_groups_answered_one_at_a_time_reach_every_server() -> None:
    # An episode batch's first turns come as their resets finish; on a loaded machine each may
    # be answered before the next comes. A server not measured yet counts as exactly the one
    # measured, and that tie once went to the lower index: server 0 took every group of every
    # batch and server 1 was never measured (a flaky fleet test of episodes, CI of 38c5854).
    balancer = Balancer(servers=2, window=4)
    balancer.new_batch(8, COST)
    chosen = []
    for _ in range(2):
        server = balancer.choose(COST)
        assert server is not None
        balancer.started(server, COST)
        balancer.finished(server, COST, tokens=500, seconds=1.0)
        chosen.append(server)
    assert chosen == [0, 1]


def test_equal_measured_servers_split_the_work_evenly() -> None:
    balancer = Balancer(servers=3, window=10)
    _measure(balancer, [500.0, 500.0, 500.0])
    assert Counter(_fill(balancer, 30)) == {0: 10, 1: 10, 2: 10}


def test_a_half_speed_server_gets_groups_only_when_the_fast_windows_are_full() -> None:
    # A group on a half-speed server takes twice as long whatever else it holds: while a faster
    # server has room the group finishes sooner there; once their windows are full, the
    # half-speed server takes groups while it would finish them within WAIT_MARGIN of a fast
    # server's next slot (its first two), and then they wait for that slot.
    balancer = Balancer(servers=3, window=4)
    _measure(balancer, [250.0, 500.0, 500.0])
    chosen = _fill(balancer, 10)
    assert chosen[:8].count(0) == 0
    assert Counter(chosen) == {0: 2, 1: 4, 2: 4}
    assert balancer.choose(COST) is None


def test_a_third_speed_server_gets_nothing_while_the_fast_servers_answer() -> None:
    # Even with the fast windows full, waiting for one of their slots beats a third-speed
    # server: small batches, where the window is a server's even share, must not give it one.
    balancer = Balancer(servers=2, window=4)
    _measure(balancer, [500.0 / 3, 500.0])
    assert _fill(balancer, 4) == [1, 1, 1, 1]
    assert balancer.choose(COST) is None
    balancer.finished(1, COST, tokens=5000, seconds=10.0)
    assert balancer.choose(COST) == 1


def test_a_server_measured_slow_is_probed_at_the_start_of_a_long_batch_it_fits() -> None:
    # Server 0 was measured at a third of the speed: the rule leaves it idle, so only a probe
    # measures it again. It gets the first group of a batch after one it held nothing in, when
    # that group would end before the batch does: in a batch of 16 groups per server (four
    # windows of 4), a third-speed group (3 units) ends before the even share (16 / 4 + 1 = 5).
    balancer = Balancer(servers=2, window=4)
    _measure(balancer, [500.0 / 3, 500.0])
    balancer.new_batch(groups=2, cost=COST)  # the batch after the measuring one
    assert balancer.choose(COST) == 1  # server 0 held a group in the last batch: no probe
    balancer.started(1, COST)
    balancer.finished(1, COST, tokens=5000, seconds=10.0)
    assert not balancer.probe_fits(0, groups=4, cost=COST)  # 2 per server: (2/4 + 1) < 3
    balancer.new_batch(groups=4, cost=COST)
    assert balancer.choose(COST) == 1  # too short a batch to risk a slow group
    balancer.started(1, COST)
    balancer.finished(1, COST, tokens=5000, seconds=10.0)
    balancer.new_batch(groups=32, cost=COST)  # 16 per server: it fits
    assert balancer.choose(COST) == 0  # the probe
    balancer.started(0, COST)
    assert balancer.choose(COST) == 1  # one probe; then the rule
    balancer.started(1, COST)
    # answering at full speed now, it is measured again; a few answers and it has its share
    for _ in range(6):
        balancer.finished(0, COST, tokens=5000, seconds=10.0)
        balancer.started(0, COST)
    balancer.finished(0, COST, tokens=5000, seconds=10.0)
    balancer.finished(1, COST, tokens=5000, seconds=10.0)
    assert Counter(_fill(balancer, 8)) == {0: 4, 1: 4}


def test_a_set_aside_or_unmeasured_server_is_not_probed() -> None:
    balancer = Balancer(servers=3, window=4)
    _measure(balancer, [500.0 / 3, 500.0, 500.0])
    balancer.new_batch(groups=3, cost=COST)
    balancer.set_aside(0)
    balancer.new_batch(groups=300, cost=COST)
    assert 0 not in balancer._probes
    balancer.restore(0)  # a new process: unmeasured, it gets groups by the rule, no probe due
    balancer.new_batch(groups=300, cost=COST)
    assert 0 not in balancer._probes


def test_a_half_speed_server_answering_later_asks_for_about_half_the_groups() -> None:
    # The pull the window makes: each answer frees one slot, and the groups waiting go where
    # the balancer says, or wait for the next answer. Server 0 answers at half the rate of the
    # others (each server answers its groups one after another), over a long queue.
    balancer = Balancer(servers=3, window=2)
    speeds = [0.5, 1.0, 1.0]
    busy: list[list[float]] = [[], [], []]  # when each group in flight is answered
    clock, waiting = 0.0, 300
    taken = Counter[int]()

    def place() -> None:
        nonlocal waiting
        while waiting and (server := balancer.choose(COST)) is not None:
            balancer.started(server, COST)
            done = max([clock, *busy[server]]) + 1 / speeds[server]
            busy[server].append(done)
            taken[server] += 1
            waiting -= 1

    place()
    while any(busy):
        server = min((i for i in range(3) if busy[i]), key=lambda i: (min(busy[i]), i))
        clock = min(busy[server])
        busy[server].remove(clock)
        balancer.finished(server, COST, tokens=100, seconds=1 / speeds[server])
        place()
    assert sum(taken.values()) == 300
    assert taken[0] / taken[1] == pytest.approx(0.5, abs=0.05)


def test_an_unmeasured_server_counts_as_the_mean_of_the_measured() -> None:
    balancer = Balancer(servers=3, window=8)
    _measure(balancer, [100.0, 300.0])  # servers 0 and 1; the mean 200 for server 2
    # Finish times: 0 -> 1000/100, 1 -> 1000/300, 2 -> 1000/200: the fastest first, then 2.
    assert balancer.choose(COST) == 1
    balancer.set_aside(1)
    assert balancer.choose(COST) == 2


def test_set_aside_servers_get_nothing_until_restored() -> None:
    balancer = Balancer(servers=3, window=8)
    balancer.set_aside(1)
    assert balancer.usable() == [0, 2]
    assert 1 not in _fill(balancer, 12)
    with pytest.raises(ValueError, match="server 1 is set aside"):
        balancer.started(1, COST)
    balancer.restore(1)
    assert balancer.usable() == [0, 1, 2]
    assert balancer.choose(COST) == 1  # the idle one


def test_a_restored_server_counts_as_unmeasured_and_gets_groups_again() -> None:
    # Measured at a third of the others' speed before it died, a restarted server would wait
    # behind WAIT_MARGIN for good (never answering, never measured again): restored, it counts
    # as the mean of the measured servers.
    balancer = Balancer(servers=2, window=4)
    _measure(balancer, [500.0 / 3, 500.0])
    balancer.set_aside(0)
    balancer.restore(0)
    assert balancer.loads[0].tokens_per_s is None
    assert 0 in _fill(balancer, 4)


def test_none_when_every_usable_window_is_full_or_no_server_is_usable() -> None:
    balancer = Balancer(servers=2, window=3)
    _fill(balancer, 6)
    assert balancer.choose(COST) is None
    with pytest.raises(ValueError, match="server 0's window of 3 groups is full"):
        balancer.started(0, COST)
    balancer.finished(1, COST, tokens=10, seconds=1.0)
    assert balancer.choose(COST) == 1
    balancer.set_aside(0)
    balancer.set_aside(1)
    assert balancer.choose(COST) is None and balancer.usable() == []


def test_failed_work_is_returned_and_counted() -> None:
    balancer = Balancer(servers=2, window=4)
    _fill(balancer, 4)  # two each
    balancer.set_aside(0)
    balancer.failed(0, COST)
    balancer.failed(0, COST)
    dead = balancer.loads[0]
    assert (dead.in_flight, dead.outstanding, dead.failures) == (0, 0.0, 2)
    assert (dead.requests, dead.tokens) == (0, 0)  # a failure is not an answer
    # The returned groups go to the other server, up to its window.
    assert _fill(balancer, 2) == [1, 1]
    assert balancer.choose(COST) is None
    with pytest.raises(ValueError, match="server 0 has no group in flight"):
        balancer.failed(0, COST)


def test_the_records_add_up() -> None:
    balancer = Balancer(servers=2, window=4)
    answers = [(0, 120, 2.0), (1, 80, 1.0), (0, 60, 1.5), (1, 100, 0.5)]
    for server, _, _ in answers:
        balancer.started(server, COST)
    for server, tokens, seconds in answers:
        balancer.finished(server, COST, tokens=tokens, seconds=seconds)
    zero = balancer.loads[0]
    one = balancer.loads[1]
    assert (zero.requests, zero.tokens, zero.busy_s) == (2, 180, 3.5)
    assert (one.requests, one.tokens, one.busy_s) == (2, 180, 1.5)
    assert all(load.in_flight == 0 and load.outstanding == 0.0 for load in balancer.loads)
    # The speed: the first answer's rate, then smoothed towards each new one.
    first, second = 120 / 2.0, 60 / 1.5
    assert zero.tokens_per_s == pytest.approx(
        (1 - SPEED_SMOOTHING) * first + SPEED_SMOOTHING * second
    )
    assert one.tokens_per_s == pytest.approx((1 - SPEED_SMOOTHING) * 80 + SPEED_SMOOTHING * 200)


def test_an_instant_answer_is_recorded_but_measures_no_speed() -> None:
    balancer = Balancer(servers=1, window=1)
    balancer.started(0, COST)
    balancer.finished(0, COST, tokens=5, seconds=0.0)
    load = balancer.loads[0]
    assert (load.requests, load.tokens, load.tokens_per_s) == (1, 5, None)


def test_outstanding_work_follows_the_costs() -> None:
    balancer = Balancer(servers=1, window=3)
    balancer.started(0, 100.0)
    balancer.started(0, 250.0)
    assert balancer.loads[0].outstanding == 350.0
    balancer.finished(0, 100.0, tokens=90, seconds=1.0)
    assert balancer.loads[0].outstanding == 250.0
    balancer.failed(0, 250.0)
    assert balancer.loads[0].outstanding == 0.0


@pytest.mark.parametrize(
    ("servers", "window", "named"),
    [
        (0, 4, "servers"),
        (-1, 4, "servers"),
        (2, 0, "window"),
        (2, 1.5, "window"),
        (True, 2, "servers"),
    ],
)
def test_bad_sizes_are_rejected_naming_them(servers: int, window: int, named: str) -> None:
    with pytest.raises(ValueError, match=f"Balancer {named} must be an integer >= 1"):
        Balancer(servers=servers, window=window)


def test_bad_calls_are_rejected_naming_the_bad_value() -> None:
    balancer = Balancer(servers=2, window=2)
    with pytest.raises(ValueError, match="server 2 is not in this fleet of 2"):
        balancer.started(2, COST)
    with pytest.raises(ValueError, match="server 2 is not in this fleet of 2"):
        balancer.set_aside(2)
    with pytest.raises(ValueError, match="cost must be finite and >= 0, got -1"):
        balancer.choose(-1.0)
    with pytest.raises(ValueError, match="cost must be finite and >= 0, got nan"):
        balancer.started(0, float("nan"))
    balancer.started(0, COST)
    with pytest.raises(ValueError, match="tokens must be >= 0, got -3"):
        balancer.finished(0, COST, tokens=-3, seconds=1.0)
    with pytest.raises(ValueError, match="seconds must be finite and >= 0, got -1"):
        balancer.finished(0, COST, tokens=3, seconds=-1.0)
    assert balancer.loads[0].in_flight == 1  # a rejected call changed nothing


def test_a_withdrawn_group_leaves_the_queue_and_is_no_failure() -> None:
    balancer = Balancer(2, window=1)
    balancer.started(0, 10.0)
    assert balancer.choose(1.0) == 1  # server 0's window is full
    balancer.withdrawn(0, 10.0)
    load = balancer.loads[0]
    assert (load.in_flight, load.outstanding, load.failures, load.requests) == (0, 0.0, 0, 0)
    with pytest.raises(ValueError, match="server 0 has no group in flight"):
        balancer.withdrawn(0, 10.0)
