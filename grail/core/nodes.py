"""Where this grail-train process stands in a trainer that spans several machines (`train.nodes`).

torchrun's static multi-node launch, as its users know it (`--nnodes=2 --node-rank=R
--master-addr=H --master-port=P`): every node runs the same grail-train command, with its own node
rank; node 0 hosts the rendezvous store at `train.rdzv_endpoint` (its address, a free port) and
its first rank is global rank 0, which drives the run. The node rank is known before anything
starts (not assigned by an elastic rendezvous), because only node 0's grail-train may claim the
run directory (its lock, `.hydra/`, summary.json): the other nodes only launch their ranks.

Under SLURM (hydra/launcher=slurm with `nodes: 2`, one task per node) the fields left unset come
from the job's environment: the node rank from SLURM_NODEID, the endpoint from the job's first
host (`scontrol show hostnames`, what SLURM's own examples use) and a port from the job id, so
that jobs sharing a node do not collide.

Every node must run with the same config, the node rank aside: the ranks compare their
`shared_settings` when they meet (grail/train/distributed.py) and refuse a difference with
`config_differences`' one line. (A node with another `train.lr` would train its shards with it
while node 0 records its own; another `train.kl_coef` would have the nodes run different
collectives, which fails inside gloo without saying why.)
"""

from __future__ import annotations

import dataclasses
import enum
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grail.core.errors import ConfigError

SLURM_PORT_BASE = 20000  # the rendezvous port of a SLURM job: base + job id modulo the span
SLURM_PORT_SPAN = 20000
SCONTROL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class NodePlan:
    nodes: int  # how many nodes the trainer spans
    node_rank: int  # this node's (0 drives the run)
    endpoint: str | None  # HOST:PORT of node 0's rendezvous store; None on one node

    @classmethod
    def single(cls) -> NodePlan:
        """One node: the ranks meet on 127.0.0.1."""
        return cls(1, 0, None)

    @property
    def drives(self) -> bool:
        """This node hosts global rank 0: it claims the run directory and drives the loop."""
        return self.node_rank == 0


def node_plan(
    nodes: int, node_rank: int | None, endpoint: str | None, environ: Mapping[str, str]
) -> NodePlan:
    """This process's place among `nodes` nodes: the config's node rank and endpoint, else the
    SLURM job's (`environ`). One node: rank 0, no endpoint (the ranks meet on 127.0.0.1)."""
    if nodes < 1:
        raise ConfigError(f"train.nodes must be >= 1, got {nodes}")
    if nodes == 1:
        if node_rank not in (None, 0):
            raise ConfigError(f"train.node_rank={node_rank} but train.nodes=1")
        return NodePlan(1, 0, None)
    slurm = "SLURM_JOB_ID" in environ
    if node_rank is None:
        if not slurm:
            raise ConfigError(
                f"train.nodes={nodes} needs this node's rank: train.node_rank=0 on the node "
                "that drives the run, 1.. on the others (under SLURM it is SLURM_NODEID)"
            )
        node_rank = _slurm_int(environ, "SLURM_NODEID")
        job_nodes = _slurm_int(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
        if job_nodes != nodes:
            raise ConfigError(
                f"train.nodes={nodes} but the SLURM job has {job_nodes} node(s) "
                "(hydra.launcher.nodes)"
            )
    if not 0 <= node_rank < nodes:
        raise ConfigError(f"train.node_rank={node_rank} is not in 0..{nodes - 1}")
    if endpoint is None:
        if not slurm:
            raise ConfigError(
                f"train.nodes={nodes} needs train.rdzv_endpoint=HOST:PORT: node 0's address "
                "and a free port there, the same on every node"
            )
        endpoint = slurm_endpoint(environ)
    _check_endpoint(endpoint)
    return NodePlan(nodes, node_rank, endpoint)


def slurm_endpoint(environ: Mapping[str, str]) -> str:
    """The SLURM job's rendezvous endpoint: its first host (node 0), a port from its job id."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError("SLURM_JOB_NODELIST is not set: set train.rdzv_endpoint=HOST:PORT")
    job_id = _slurm_int(environ, "SLURM_JOB_ID")
    return f"{first_host(nodelist)}:{SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN}"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (`gpu[03-05,07],cpu1` -> gpu03): `scontrol show
    hostnames` where SLURM's tools are installed, else the list's own syntax, read here."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=True,
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass  # no scontrol on this machine (or it failed): the list is simple to read
    return _first_of_nodelist(nodelist)


def _first_of_nodelist(nodelist: str) -> str:
    # The first entry: a name, optionally with a bracketed range list whose first item is taken
    # (`gpu[03-05,07]` -> gpu03, keeping the zero padding of the range's start).
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None or not match.group(1):
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _check_endpoint(endpoint: str) -> None:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"train.rdzv_endpoint must be HOST:PORT, got {endpoint!r}")


def _slurm_int(environ: Mapping[str, str], *names: str) -> int:
    for name in names:
        value = environ.get(name)
        if value is not None:
            if not value.strip().isdigit():
                raise ConfigError(f"{name}={value!r} is not a number")
            return int(value)
    raise ConfigError(f"{names[0]} is not set in this SLURM job's environment")


# ---- the nodes of a run agree on its config ---------------------------------------------------

#: Config keys that differ between the nodes of one run by design: which node this is. (Hydra's run
#: directory is no config key: it may be mounted at another path on each node.)
PER_NODE_KEYS = frozenset({"train.node_rank"})
SHOWN_CHARS = 60  # a value longer than this is cut in the message


class NodesDiffer(ConfigError):
    """The nodes of one run were started with different configs: the message names the keys."""


def shared_settings(config: Any) -> dict[str, Any]:
    """`config` (grail.core.config.Config, a dataclass of dataclasses) as dotted key -> value,
    less `PER_NODE_KEYS`: what every node of a run must agree on."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                walk(f"{prefix}{field.name}.", getattr(value, field.name))
        elif prefix[:-1] not in PER_NODE_KEYS:
            flat[prefix[:-1]] = value

    walk("", config)
    return flat


_MISSING = object()  # a key one node's config lacks (another version of grail there)


def config_differences(settings: Sequence[tuple[int, Mapping[str, Any]]]) -> str | None:
    """One line naming every key whose value differs between the nodes, with each node's value,
    from (node rank, `shared_settings`) of every rank; None when the nodes agree."""
    by_node: dict[int, Mapping[str, Any]] = {}
    for node, node_settings in settings:
        by_node.setdefault(node, node_settings)
    nodes = sorted(by_node)
    keys = sorted({key for node_settings in by_node.values() for key in node_settings})
    parts = []
    for key in keys:
        values = [by_node[node].get(key, _MISSING) for node in nodes]
        if all(value == values[0] for value in values[1:]):
            continue
        shown: dict[str, list[int]] = {}  # each value, with the nodes that have it
        for node, value in zip(nodes, values, strict=True):
            shown.setdefault(_shown(value), []).append(node)
        parts.append(
            f"{key} ("
            + "; ".join(
                f"node{'s' if len(have) > 1 else ''} {', '.join(map(str, have))}: {text}"
                for text, have in shown.items()
            )
            + ")"
        )
    if not parts:
        return None
    return (
        f"the nodes were started with different configs: {', '.join(parts)}; start every node "
        f"with the same command and overrides (only {', '.join(sorted(PER_NODE_KEYS))} differs "
        "between them)"
    )


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "(no such key)"
    text = repr(value.value if isinstance(value, enum.Enum) else value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
