"""Which server of a fleet takes the next group: the fleet's balancer, pure decision logic.

No I/O, no asyncio, no clock, no randomness: the fleet's client (grail/rollouts/fleet_client.py)
tells the balancer what happened (a group sent, answered, failed; a server set aside or back)
and asks it where the next group goes. The same object runs inside the simulated fleet of
benchmarks/fleet_sim.py, which is where its rule and its window were chosen (docs/benchmarks.md,
"A fleet of servers, simulated").

The rule. Among usable servers with a free window slot, the one where the group would finish
first, unless a full server would finish it clearly sooner (`WAIT_MARGIN`): then it waits here
for a slot there:

    argmin_i  (outstanding_i / window + cost) / speed_i
    ties -> the server sent the fewest groups in this batch, then the lowest index

where outstanding_i is the cost of the groups server i has not answered yet, speed_i its smoothed
measured rate of one request (a server not measured yet counts as the mean of the measured ones, or
1.0 when none is), and window the most groups a server holds. A batching server decodes the groups
it holds side by side, so a new group does not queue behind all of them, as (outstanding + cost) /
speed would have it: it shares the batch, and each group already there slows it a little
(outstanding / window, a full window doubling its time, about what a full batch does to the engine's
step: 5.3 ms against 3.1 ms for a nearly empty one; for a full window, also about when a slot frees
and the group then runs). The consequence that matters: a server measured at half speed, where any
group takes twice as long, gets a group only when every faster server's window is full, and a third-
speed one not even then: the group waits for a fast server's slot. The wait matters in small
batches, where the window is capped at a server's even share (`window_for`, rollouts/sizing.py):
taking any free window gave a third-speed server its even share of every batch
(tests/test_fleet.py). An idle fleet fills evenly, one group each in index order, and so do groups
that come one at a time, each answered before the next (an episode's first turns, as their
environments' resets finish): a server not measured yet counts as exactly the measured one, and
ties go to the lowest index only among servers given as many groups, else the measured server
would take every group and the other would never be measured. The simulation
(benchmarks/fleet_sim.py) is why: with a batch of 8 groups per server, (outstanding + cost) / speed
gives a half-speed server about half a share, and the iteration waits ~2x for its longest group
(6.9 s against 3.8 s with equal servers); this rule gives it none (4.1 s), and costs equal fleets
3-9% (4.1 s against 3.8 at 32 servers: the noise of the measured speeds spreads their loads a
little).

Probes. Only answers update a speed, so a server once measured slow -- by noise, or by a slowness
that has passed (a GPU shared for a while) -- would wait behind `WAIT_MARGIN` for the rest of the
run. So when a batch starts (`new_batch`), a server that held no group through the last one is
given the batch's first group (a probe) if that group would end before the batch does, as the
rule's model expects it to last (`probe_fits`): at the start of a long batch a slow group costs
nothing, while in a short one, where the iteration lasts about one group, it would make the
batch wait, and there the fast servers absorb a missing server's share at no cost anyway.

The window. A batching server (the built-in engine, vLLM, SGLang) decodes all the requests it
holds at once, so it must hold several to run a full batch; but a group handed to a server can no
longer move. With at most `window` groups in flight per server the rest of the batch waits here,
and a slow server, answering later, asks for fewer. A group holds its place until its longest
sample ends, while its shorter samples have freed their rows, so a window of max_num_seqs / n
groups keeps the batch only about half full: the simulation's choice is twice that (a full
engine queues the rest and admits them as rows free up). More only moves the queue into the
servers, where it can no longer be rebalanced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Smoothing of the measured speed: speed <- (1 - a) speed + a x (tokens / seconds). A group's
# rate varies with its completion lengths (its latency is its longest sample's, its tokens all of
# them), so one group is a noisy sample: at 0.3 one outlier moves the estimate by 30%, while a
# server whose speed really changed (a GPU now shared, thermal throttling) is re-learned within
# ~3 answers (0.7^3 = 0.34 of the old value left) -- a few of the ~8 groups a server answers per
# iteration.
SPEED_SMOOTHING = 0.3

# A group waits for a slot on a full server only when every server with a free window would take
# more than this times as long: a third-speed server then gets nothing while the fast ones
# answer (small batches, where the window is a server's even share, gave it its even share),
# a half-speed one still gets a group once the fast windows are full (as long as a fast slot
# would take). Waiting on any smaller difference waits on the noise of the measured speeds:
# equal fleets then queued for the server measured fastest, 75.4% of the ideal instead of 89.7%
# (8 servers, 128 groups each, benchmarks/fleet_sim.py).
WAIT_MARGIN = 1.25


@dataclass
class ServerLoad:
    """What the balancer knows of one server."""

    in_flight: int = 0  # groups sent and not yet answered
    outstanding: float = 0.0  # their cost (the caller's unit: expected tokens)
    # Smoothed tokens / seconds of its answered groups (a request's rate, not the server's whole
    # throughput: on a batching server it hardly depends on how many requests share the batch,
    # so it compares servers without rewarding the one that was given more); None before its
    # first answer.
    tokens_per_s: float | None = None
    usable: bool = True  # False while set aside (dead, unreachable, restarting)
    batch_groups: int = 0  # groups sent to it since the current batch started (`new_batch`)
    # For records: answered requests, their tokens, their summed latency (request-seconds, which
    # exceed wall time when requests overlap; busy_s / requests is the mean latency), and the
    # groups that failed on this server.
    requests: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    failures: int = 0


class Balancer:
    """The routing decisions of a fleet of `servers` servers, each holding at most `window`
    groups."""

    def __init__(self, servers: int, window: int) -> None:
        if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
            raise ValueError(f"Balancer servers must be an integer >= 1, got {servers!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"Balancer window must be an integer >= 1, got {window!r}")
        self.window = window
        self.loads: list[ServerLoad] = [ServerLoad() for _ in range(servers)]
        self._probes: list[int] = []  # servers due a probe in this batch, in index order

    def new_batch(self, groups: int, cost: float) -> None:
        """A batch of `groups` groups of `cost` each starts: the servers that held no group
        through the last batch, measured, and whose one group fits in this one (`probe_fits`),
        get its first groups (the module's "Probes")."""
        _check_cost(cost)
        self._probes = [
            i
            for i, load in enumerate(self.loads)
            if load.usable
            and load.batch_groups == 0
            and load.tokens_per_s is not None
            and self.probe_fits(i, groups, cost)
        ]
        for load in self.loads:
            load.batch_groups = 0

    def probe_fits(self, server: int, groups: int, cost: float) -> bool:
        """Whether one group of `cost` on `server`, at its measured speed, would end before a
        batch of `groups` groups spread evenly over the usable servers at the fastest measured
        speed: ``cost / speed_server <= (groups / usable * cost / window + cost) / fastest``, the
        rule's finish time of a server holding its even share."""
        measured = [
            load.tokens_per_s
            for load in self.loads
            if load.usable and load.tokens_per_s is not None
        ]
        speed = self._load(server).tokens_per_s
        if speed is None or not measured:
            return False
        share = groups / len(self.usable()) * cost
        return cost / speed <= (share / self.window + cost) / max(measured)

    def choose(self, cost: float) -> int | None:
        """A server due a probe (`new_batch`), else the server with a free window where a group
        of `cost` would finish first (the module's rule), or None when the group should wait for
        a slot (every free server would take `WAIT_MARGIN` times as long as a full one, or none
        is free: the caller waits for an answer, then asks again) or no server is usable (the
        caller tells these apart with `usable()`)."""
        _check_cost(cost)
        while self._probes:
            probe = self._probes.pop(0)
            if self.has_room(probe) and self.loads[probe].batch_groups == 0:
                return probe  # the module's "Probes"
        measured = [load.tokens_per_s for load in self.loads if load.tokens_per_s is not None]
        unknown = sum(measured) / len(measured) if measured else 1.0
        free: int | None = None
        best = (math.inf, 0)  # the free server's finish, then its groups in this batch
        full_finish = math.inf
        for i, load in enumerate(self.loads):
            if not load.usable:
                continue
            speed = load.tokens_per_s if load.tokens_per_s is not None else unknown
            finish = (load.outstanding / self.window + cost) / speed
            if load.in_flight >= self.window:
                full_finish = min(full_finish, finish)
            elif (finish, load.batch_groups) < best:  # strict: a full tie keeps the lower index
                free, best = i, (finish, load.batch_groups)
        if best[0] > WAIT_MARGIN * full_finish:
            return None  # wait for a slot on a full server (`WAIT_MARGIN`)
        return free

    def started(self, server: int, cost: float) -> None:
        """A group of `cost` was sent to `server` (the one `choose` named)."""
        load = self._load(server)
        _check_cost(cost)
        if not load.usable:
            raise ValueError(f"server {server} is set aside; it takes no groups until restored")
        if load.in_flight >= self.window:
            raise ValueError(f"server {server}'s window of {self.window} groups is full")
        load.in_flight += 1
        load.outstanding += cost
        load.batch_groups += 1

    def finished(self, server: int, cost: float, *, tokens: int, seconds: float) -> None:
        """`server` answered a group of `cost` with `tokens` completion tokens, `seconds` after
        it was sent."""
        load = self._load(server)
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if not seconds >= 0 or math.isinf(seconds):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        self._release(server, load, cost)
        load.requests += 1
        load.tokens += tokens
        load.busy_s += seconds
        if seconds > 0:  # an instant answer (a cache, a clock's resolution) measures nothing
            rate = tokens / seconds
            load.tokens_per_s = (
                rate
                if load.tokens_per_s is None
                else (1 - SPEED_SMOOTHING) * load.tokens_per_s + SPEED_SMOOTHING * rate
            )

    def failed(self, server: int, cost: float) -> None:
        """A group of `cost` sent to `server` came back unanswered: its work leaves the server's
        queue (the caller sends it again) and the server's failures count it."""
        load = self._load(server)
        self._release(server, load, cost)
        load.failures += 1

    def withdrawn(self, server: int, cost: float) -> None:
        """A group of `cost` sent to `server` was called back before its answer (the batch
        failed elsewhere, or was cancelled): its work leaves the queue, and it is no failure."""
        self._release(server, self._load(server), cost)

    def set_aside(self, server: int) -> None:
        """`server` takes no new groups until `restore` (its in-flight ones the caller fails)."""
        self._load(server).usable = False

    def restore(self, server: int) -> None:
        """`server` takes groups again, as a server not measured yet (the mean of the others):
        it is a new process, and a speed measured before it was set aside (noisy, or what made
        it fail) could keep it waiting behind `WAIT_MARGIN` for good, never answering a group
        that would measure it again."""
        load = self._load(server)
        load.usable, load.tokens_per_s = True, None

    def has_room(self, server: int) -> bool:
        """Whether `server` takes a group now: not set aside, and a free slot in its window."""
        load = self._load(server)
        return load.usable and load.in_flight < self.window

    def usable(self) -> list[int]:
        """The servers not set aside, in index order."""
        return [i for i, load in enumerate(self.loads) if load.usable]

    def _load(self, server: int) -> ServerLoad:
        if isinstance(server, bool) or not isinstance(server, int):
            raise ValueError(f"server must be an index, got {server!r}")
        if not 0 <= server < len(self.loads):
            raise ValueError(f"server {server} is not in this fleet of {len(self.loads)}")
        return self.loads[server]

    def _release(self, server: int, load: ServerLoad, cost: float) -> None:
        _check_cost(cost)
        if load.in_flight == 0:
            raise ValueError(f"server {server} has no group in flight")
        load.in_flight -= 1
        # An empty queue is exactly empty: float subtraction would leave a drift that grows
        # over a long run.
        load.outstanding = 0.0 if load.in_flight == 0 else max(0.0, load.outstanding - cost)


def _check_cost(cost: float) -> None:
    if not (cost >= 0 and math.isfinite(cost)):
        raise ValueError(f"a group's cost must be finite and >= 0, got {cost!r}")
