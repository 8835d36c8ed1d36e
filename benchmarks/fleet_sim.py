"""A fleet of 8-64 inference servers, simulated: what the balancer (grail/rollouts/balance.py, the
real one) makes of slow and failing servers, on more servers than this machine has.

    uv run python benchmarks/fleet_sim.py                          # the table of docs/benchmarks.md
    uv run python benchmarks/fleet_sim.py --servers 8 --groups-per-server 64 --json

Discrete events, no clock, deterministic in --seed. Each server is a batching engine like the
built-in one (grail/inference/builtin/engine.py): every decode step advances each running
sequence by one token; up to --max-batch sequences run at once and the others wait in arrival
order, admitted as rows free up. A step of k sequences lasts

    step_ms(k) = (3.113 + 0.008542 k) / speed

the straight line through the measured graph decode of the ~0.47B preset in bf16 on one H200
(docs/benchmarks.md "The built-in engine's decode paths": 3.66 ms/step at 64 sequences, 5.30 at
256), divided by the server's speed factor (0.5: a server at half speed). Prefill and the HTTP
round trip are not modelled (a 64-token prompt's prefill is about one step).

One iteration is a batch of groups (n samples of one problem: one request, as the fleet sends
them), completion lengths drawn uniformly from 1..--max-len. The balancer places each group;
when a server answers, the next groups are placed. An iteration ends at its last answer (the
weight-sync barrier: the next batch needs the new weights), and the same Balancer carries its
measurements into the next iteration, as the fleet's does across a run. A failing server dies
mid-iteration: its unfinished groups (running or waiting in its queue) are returned and re-sent
to the others from scratch.

    ideal rollouts/s = sum(speeds) x max_batch / step_s(max_batch) / mean completion length
    utilisation      = achieved rollouts/s / ideal

The ideal is every server at a full batch for the whole iteration with no tail; "vs equal" divides
out what no balancer can change: the achieved rate / (the equal fleet's achieved rate x
sum(speeds) / servers), 100% when a fleet with slow servers loses no more than their capacity.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `grail` from a plain checkout

from grail.rollouts.balance import Balancer  # noqa: E402

# The linear fit of step time against running sequences through the two measured points.
MEASURED = ((64, 3.66e-3), (256, 5.30e-3))  # (sequences, seconds per step), H200, 0.47B bf16
STEP_PER_SEQ_S = (MEASURED[1][1] - MEASURED[0][1]) / (MEASURED[1][0] - MEASURED[0][0])
STEP_BASE_S = MEASURED[0][1] - MEASURED[0][0] * STEP_PER_SEQ_S


def step_s(sequences: int, speed: float = 1.0) -> float:
    """Seconds one decode step of `sequences` running sequences takes on a server of `speed`."""
    return (STEP_BASE_S + STEP_PER_SEQ_S * sequences) / speed


class SimServer:
    """One batching engine. Between events its batch is fixed, so its step time is too: the
    server jumps from one sequence's end to the next instead of stepping token by token."""

    def __init__(self, speed: float, max_batch: int) -> None:
        self.speed = speed
        self.max_batch = max_batch
        self.alive = True
        self.t = 0.0  # time of the last step boundary accounted for
        self.step = 0  # steps run so far
        self.running: list[tuple[int, int]] = []  # heap of (step it finishes at, group)
        self.waiting: deque[tuple[int, int]] = deque()  # (group, length), arrival order
        self.remaining: dict[int, int] = {}  # group -> its sequences not finished
        self.version = 0  # bumped whenever the next finish moves; stale events carry old ones

    def next_finish(self) -> float | None:
        if not self.running:
            return None
        return self.t + (self.running[0][0] - self.step) * step_s(len(self.running), self.speed)

    def submit(self, t: float, group: int, lengths: Sequence[int]) -> None:
        """Group `group` arrives at time `t` (no sequence finishes before `t`)."""
        if self.running:
            # Run the whole steps done by `t`; the new sequences join the step in progress (it
            # is recomputed at the new batch size: an error below one step).
            dt = step_s(len(self.running), self.speed)
            whole = math.floor((t - self.t) / dt + 1e-9)
            whole = max(0, min(whole, self.running[0][0] - self.step - 1))
            self.step += whole
            self.t += whole * dt
        else:
            self.t = max(self.t, t)
        self.remaining[group] = len(lengths)
        self.waiting.extend((group, length) for length in lengths)
        self._admit()

    def finish(self) -> tuple[float, list[int]]:
        """Run to the next sequence's end: (that time, the groups whose last sequence it was)."""
        t = self.next_finish()
        if t is None:
            raise RuntimeError("finish() on an idle server")
        self.t, self.step = t, self.running[0][0]
        done = []
        while self.running and self.running[0][0] == self.step:
            _, group = heapq.heappop(self.running)
            self.remaining[group] -= 1
            if self.remaining[group] == 0:
                del self.remaining[group]
                done.append(group)
        self._admit()
        return t, done

    def fail(self) -> list[int]:
        """The server dies: the groups it had not answered, in the order they arrived."""
        lost = list(self.remaining)
        self.alive = False
        self.running.clear()
        self.waiting.clear()
        self.remaining.clear()
        self.version += 1
        return lost

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            group, length = self.waiting.popleft()
            heapq.heappush(self.running, (self.step + length, group))
        self.version += 1


@dataclass
class IterationResult:
    seconds: float
    answered: list[int]  # groups in the order they were answered, each once
    resent: int  # groups re-sent after a failure
    tokens: int
    rollouts: int
    server_groups: list[int] = field(default_factory=list)  # answered groups per server


def run_iteration(
    balancer: Balancer,
    speeds: Sequence[float],
    lengths: Sequence[Sequence[int]],
    *,
    max_batch: int,
    cost: float,
    fail: tuple[int, float] | None = None,
) -> IterationResult:
    """One batch of groups (`lengths[g]`: group g's completion lengths) through a fleet of
    servers of `speeds`, placed by `balancer`. `fail`: (server, time) it dies at."""
    servers = [SimServer(speed, max_batch) for speed in speeds]
    pending: deque[int] = deque(range(len(lengths)))
    sent_at: dict[int, float] = {}
    placed: dict[int, int] = {}
    answered: list[int] = []
    server_groups = [0] * len(servers)
    resent = 0
    events: list[tuple[float, int, int, int]] = []  # (time, order, server or -1: failure, version)
    order = 0

    def schedule(i: int) -> None:
        nonlocal order
        when = servers[i].next_finish()
        if when is not None:
            heapq.heappush(events, (when, order, i, servers[i].version))
            order += 1

    def dispatch(t: float) -> None:
        while pending:
            i = balancer.choose(cost)
            if i is None:
                return
            group = pending.popleft()
            balancer.started(i, cost)
            servers[i].submit(t, group, lengths[group])
            sent_at[group], placed[group] = t, i
            schedule(i)

    if fail is not None:
        heapq.heappush(events, (fail[1], -1, -1, fail[0]))
    balancer.new_batch(len(lengths), cost)
    dispatch(0.0)
    end = 0.0
    while events and len(answered) < len(lengths):
        t, _, i, version = heapq.heappop(events)
        if i == -1:  # the failure: its groups go back to the front of the queue, in order
            dead = version
            lost = servers[dead].fail()
            balancer.set_aside(dead)
            for _ in lost:
                balancer.failed(dead, cost)
            pending.extendleft(reversed(lost))
            resent += len(lost)
            dispatch(t)
            continue
        if version != servers[i].version:
            continue  # the server's batch changed since this event was scheduled
        t, done = servers[i].finish()
        schedule(i)
        for group in done:
            if placed[group] != i:
                raise RuntimeError(f"group {group} answered by server {i}, sent to {placed[group]}")
            balancer.finished(i, cost, tokens=sum(lengths[group]), seconds=t - sent_at[group])
            answered.append(group)
            server_groups[i] += 1
            end = t
        dispatch(t)
    if len(answered) != len(lengths):
        raise RuntimeError(
            f"{len(lengths) - len(answered)} groups were never answered: no usable server left"
        )
    if fail is not None:
        balancer.restore(fail[0])  # restarted in the background, it rejoins after the sync
    tokens = sum(sum(g) for g in lengths)
    rollouts = sum(len(g) for g in lengths)
    return IterationResult(end, answered, resent, tokens, rollouts, server_groups)


def default_window(max_batch: int, n: int) -> int:
    """Groups a server may hold: twice its batch. A group keeps its place until its longest
    sample ends, and its shorter ones have freed their rows by then, so a window of one batch
    (max_batch / n groups) keeps the engine's batch only about half full; with two, the engine
    queues the rest and admits them as rows free up."""
    return max(1, 2 * math.ceil(max_batch / n))


def draw_batch(rng: random.Random, groups: int, n: int, max_len: int) -> list[list[int]]:
    return [[rng.randint(1, max_len) for _ in range(n)] for _ in range(groups)]


@dataclass(frozen=True)
class Scenario:
    name: str
    speeds: Callable[[int], list[float]]
    fails: bool = False
    # The speeds hold in the first iteration only; every server runs at 1.0 after it (a slowness
    # that passed: the balancer must measure the server again to use it).
    recovers: bool = False

    def speeds_at(self, servers: int, iteration: int) -> list[float]:
        if self.recovers and iteration > 0:
            return [1.0] * servers
        return self.speeds(servers)


def _slow(count: Callable[[int], int]) -> Callable[[int], list[float]]:
    # The slow servers take the lowest indices: the balancer's ties go to them first.
    return lambda n: [0.5 if i < count(n) else 1.0 for i in range(n)]


def _third(n: int) -> list[float]:
    return [1 / 3] + [1.0] * (n - 1)


SCENARIOS = (
    Scenario("all equal", lambda n: [1.0] * n),
    Scenario("one at half speed", _slow(lambda n: 1)),
    Scenario("10% at half speed", _slow(lambda n: max(1, round(n / 10)))),
    Scenario("one at a third of the speed", _third),
    Scenario("one at a third, then recovered", _third, recovers=True),
    Scenario("one fails mid-iteration", lambda n: [1.0] * n, fails=True),
)


@dataclass
class Outcome:
    servers: int
    scenario: str
    window: int
    iteration_s: float  # the last iteration (measurements settled)
    first_iteration_s: float  # the first (no measurement yet)
    # every iteration's seconds, and server 0's groups in each (the slow, failing or recovered
    # server of the scenarios)
    each_iteration_s: list[float]
    server0_groups: list[int]
    rollouts_per_s: float
    ideal_rollouts_per_s: float
    utilisation: float
    capacity: float  # the last iteration's mean server speed (1.0: all at full speed)
    vs_equal: float | None = None
    failure_cost_s: float | None = None
    resent: int = 0
    slow_share: float | None = None  # the slow servers' share of the groups / their fair share


def simulate(
    servers: int,
    scenario: Scenario,
    *,
    window: int,
    groups_per_server: int = 8,
    n: int = 16,
    max_len: int = 1024,
    max_batch: int = 256,
    iterations: int = 3,
    seed: int = 0,
    fail_at: float | None = None,
    balancer_factory: Callable[[int, int], Balancer] = Balancer,
) -> tuple[Outcome, list[IterationResult]]:
    """`iterations` iterations of one scenario; a failing scenario's server 0 dies in the last
    one at `fail_at` seconds (the caller passes half the equal fleet's iteration)."""
    if scenario.fails and fail_at is None:
        raise ValueError(f"scenario {scenario.name!r} needs fail_at")
    rng = random.Random(seed)  # the same seed draws the same batches for every scenario
    balancer = balancer_factory(servers, window)
    cost = n * (max_len + 1) / 2  # expected tokens: the caller knows the distribution, not the draw
    results = []
    for it in range(iterations):
        batch = draw_batch(rng, groups_per_server * servers, n, max_len)
        last = it == iterations - 1
        fail = (0, fail_at) if scenario.fails and last and fail_at is not None else None
        speeds = scenario.speeds_at(servers, it)
        results.append(
            run_iteration(balancer, speeds, batch, max_batch=max_batch, cost=cost, fail=fail)
        )
    final = results[-1]
    rate = final.rollouts / final.seconds
    mean_len = final.tokens / final.rollouts
    ideal = sum(speeds) * max_batch / step_s(max_batch) / mean_len
    slow = [i for i, s in enumerate(speeds) if s < 1.0]
    share = None
    if slow:
        fair = sum(speeds[i] for i in slow) / sum(speeds)
        share = sum(final.server_groups[i] for i in slow) / sum(final.server_groups) / fair
    elif scenario.recovers:  # the once-slow server's share, now that it runs at full speed
        share = final.server_groups[0] / sum(final.server_groups) * servers
    outcome = Outcome(
        servers=servers,
        scenario=scenario.name,
        window=window,
        iteration_s=final.seconds,
        first_iteration_s=results[0].seconds,
        each_iteration_s=[r.seconds for r in results],
        server0_groups=[r.server_groups[0] for r in results],
        rollouts_per_s=rate,
        ideal_rollouts_per_s=ideal,
        utilisation=rate / ideal,
        capacity=sum(speeds) / servers,
        resent=final.resent,
        slow_share=share,
    )
    return outcome, results


def fleet_table(sizes: Sequence[int], *, window: int, **kwargs: Any) -> list[Outcome]:
    """Every scenario at every fleet size, with "vs equal" and the failure's cost filled in."""
    outcomes = []
    for servers in sizes:
        equal, _ = simulate(servers, SCENARIOS[0], window=window, **kwargs)
        for scenario in SCENARIOS:
            if scenario is SCENARIOS[0]:
                outcome = equal
            else:
                fail_at = equal.iteration_s / 2 if scenario.fails else None
                outcome, _ = simulate(servers, scenario, window=window, fail_at=fail_at, **kwargs)
            if not scenario.fails:
                outcome.vs_equal = outcome.rollouts_per_s / (
                    equal.rollouts_per_s * outcome.capacity
                )
            else:
                outcome.failure_cost_s = outcome.iteration_s - equal.iteration_s
            outcomes.append(outcome)
    return outcomes


class EvenSplit(Balancer):
    """The baseline the balancer is measured against: groups dealt in turn to the server with
    the fewest in flight, speed ignored (what a round-robin router does)."""

    def choose(self, cost: float) -> int | None:
        free = [
            (load.in_flight, i)
            for i, load in enumerate(self.loads)
            if load.usable and load.in_flight < self.window
        ]
        return min(free)[1] if free else None


class NoProbes(Balancer):
    """The balancer without its probes (`new_batch` does nothing): what a server measured slow
    got before them."""

    def new_batch(self, groups: int, cost: float) -> None:
        pass


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="8,16,32,64", help="fleet sizes, comma-separated")
    parser.add_argument("--groups-per-server", type=int, default=8, help="batch = this x servers")
    parser.add_argument("--group-size", type=int, default=16, help="samples per group (n)")
    parser.add_argument("--max-len", type=int, default=1024, help="lengths uniform in 1..this")
    parser.add_argument("--max-batch", type=int, default=256, help="sequences a server decodes")
    parser.add_argument("--window", type=int, default=None, help="default: 2 x max_batch / n")
    parser.add_argument(
        "--even-split", action="store_true", help="the baseline: round robin, speed ignored"
    )
    parser.add_argument(
        "--no-probes", action="store_true", help="the balancer without its probes (before them)"
    )
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print the outcomes as JSON")
    parser.add_argument("--out", type=Path, default=None, help="results file (default: results/)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.servers.split(",")]
    window = args.window or default_window(args.max_batch, args.group_size)
    common_kwargs: dict[str, Any] = {
        "groups_per_server": args.groups_per_server,
        "n": args.group_size,
        "max_len": args.max_len,
        "max_batch": args.max_batch,
        "iterations": args.iterations,
        "seed": args.seed,
        "balancer_factory": (
            EvenSplit if args.even_split else NoProbes if args.no_probes else Balancer
        ),
    }
    outcomes = fleet_table(sizes, window=window, **common_kwargs)

    import common  # the benchmarks' shared module (imports torch: only when run as a script)

    print(
        f"step_ms(k) = {1e3 * STEP_BASE_S:.3f} + {1e3 * STEP_PER_SEQ_S:.6f} k; "
        f"{args.groups_per_server} groups of {args.group_size} per server per iteration, "
        f"lengths 1..{args.max_len}, max batch {args.max_batch}, window {window} groups, "
        f"last of {args.iterations} iterations, seed {args.seed}"
        + (", even split (the baseline)" if args.even_split else "")
    )
    common.print_table(
        "A fleet of servers, simulated (the last iteration)",
        [
            "servers",
            "scenario",
            "iteration s",
            "first iter. s",
            "rollouts/s",
            "ideal",
            "utilisation",
            "vs equal",
            "slow share",
            "failure cost s",
        ],
        [
            (
                o.servers,
                o.scenario,
                o.iteration_s,
                o.first_iteration_s,
                o.rollouts_per_s,
                o.ideal_rollouts_per_s,
                _pct(o.utilisation),
                _pct(o.vs_equal),
                "" if o.slow_share is None else f"{o.slow_share:.2f}",
                "" if o.failure_cost_s is None else f"+{o.failure_cost_s:.2f} ({o.resent} re-sent)",
            )
            for o in outcomes
        ],
    )
    results: dict[str, Any] = {
        "model": {"step_base_s": STEP_BASE_S, "step_per_seq_s": STEP_PER_SEQ_S},
        "args": {**vars(args), "out": str(args.out) if args.out else None, "window": window},
        "outcomes": [asdict(o) for o in outcomes],
    }
    if args.json:
        import json

        print(json.dumps(results["outcomes"], indent=2))
    common.write_results("fleet_sim", results, args.out)


if __name__ == "__main__":
    main()
