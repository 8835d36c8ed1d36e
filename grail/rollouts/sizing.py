"""How a fleet's batch is cut into requests and how many of them one server may hold: pure
arithmetic, for the fleet's client (grail/rollouts/fleet_client.py) and the run that builds it
(grail/rollouts/server.py)."""

from __future__ import annotations

import math

from grail.inference.completions import SamplingParams

# A batch goes in at least this many requests per server, so that the balancer has requests to
# move: with one request per server a slow server would hold its whole share to the end.
REQUESTS_PER_SERVER = 4


def request_size(most: int, prompts: int, servers: int) -> int:
    """Prompts in one request of a batch of `prompts`: at most `most` (what one server takes in
    one request), but few enough that each of `servers` gets `REQUESTS_PER_SERVER` requests."""
    spread = math.ceil(prompts / (REQUESTS_PER_SERVER * servers))
    return max(1, min(most, spread))


def window_for(batch_sequences: int, n: int, per_request: int, requests: int, servers: int) -> int:
    """Requests one server may have in flight: about twice its batch (`batch_sequences`
    sequences), in requests of `per_request` prompts of n samples, but no more than its even
    share of a batch of `requests`. A request holds its slot until its longest sample ends, so a
    window of one batch kept the simulated engine half full (docs/benchmarks.md, "A fleet of
    servers, simulated"). The cap: with a window larger than the batch, measured speeds that
    differ by noise alone sent a small batch to one server (4 x 4 samples all went to the first)."""
    batches = math.ceil(2 * batch_sequences / (n * per_request))
    return max(1, min(batches, math.ceil(requests / servers)))


def group_cost(n: int, sampling: SamplingParams) -> float:
    """Expected tokens of one prompt's group: what the balancer weighs requests by."""
    return n * (sampling.max_tokens or 1)
