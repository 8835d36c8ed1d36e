"""`train.nodes=2` simulated on one machine: two grail-train processes, node ranks 0 and 1, one
trainer rank each, meeting through torch's static rendezvous at 127.0.0.1 (grail/core/nodes.py,
grail/train/distributed.py), training one run in one directory, as two machines sharing a
filesystem would. Node 0 drives and owns the run directory; node 1 only runs its rank.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

from helpers.rank_runs import COMPARED, finish, start_grail_train, train_record

SHORT = ["train.iterations=2", "eval.enabled=false", "train.collective_timeout_s=120"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_nodes_train_one_run_as_one_process_does(one_process_run: Path, tmp_path: Path) -> None:
    one, run = one_process_run, tmp_path / "two_nodes"  # only one's iteration 0 is compared
    nodes = [*SHORT, "train.nodes=2", f"train.rdzv_endpoint=127.0.0.1:{free_port()}"]
    # Node 1 first: it waits at the rendezvous for node 0, as a node that starts early does.
    node1 = start_grail_train(run, *nodes, "train.node_rank=1")
    node0 = start_grail_train(run, *nodes, "train.node_rank=0")
    code0, out0 = finish(node0, 240)
    code1, out1 = finish(node1, 60)
    assert code0 == 0, out0[-3000:]
    assert code1 == 0, out1[-3000:]
    assert "2 trainer process(es)" in out0
    # Node 1 writes no records and no summary: node 0's lines only say how the run went.
    assert "iter 000:" in out0 and "iter 000:" not in out1
    assert "node 1 of 2" in out1

    first_one, first_two = train_record(one, 0), train_record(run, 0)
    for key in COMPARED:
        a, b = first_one[key], first_two[key]
        assert isinstance(a, float) and isinstance(b, float)
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (key, a, b)
    assert first_two["trainer_processes"] == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["trainer_processes"] == 2
    # Each node's rank wrote its shard of the optimizer's state into the shared run directory.
    shards = sorted(p.name for p in (run / "checkpoints" / "iter_001" / "optimizer").iterdir())
    assert [s for s in shards if s.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]
    overrides = (run / ".hydra" / "overrides.yaml").read_text()
    assert "train.node_rank=0" in overrides  # node 0's: node 1 did not write .hydra/


def test_a_node_that_never_meets_node_0_ends_with_one_line(tmp_path: Path) -> None:
    # No node 0 at the endpoint (it failed before it launched, or the endpoint is wrong): node 1
    # waits at the rendezvous for train.collective_timeout_s, then ends with one line, having
    # written nothing into the run directory, which is node 0's. Nothing listens there, so the
    # wait ends the same way however short it is: 1 s, the least the static rendezvous takes (whole
    # seconds); 5 s made the run 8 s longer.
    port = free_port()
    base = ["eval.enabled=false", "train.nodes=2", f"train.rdzv_endpoint=127.0.0.1:{port}"]
    node1 = start_grail_train(tmp_path, *base, "train.node_rank=1", "train.collective_timeout_s=1")
    code, out = finish(node1, 120)
    assert code == 1, out[-3000:]
    errors = [line for line in out.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1, out[-3000:]
    assert "node 1 of 2: the trainer's nodes did not meet" in errors[0], errors[0]
    assert "Traceback" not in out
    assert not (tmp_path / "summary.json").exists()
    assert not (tmp_path / ".hydra").exists()


def test_nodes_started_with_different_configs_refuse_in_one_line(tmp_path: Path) -> None:
    # Node 1 with another learning rate would train its shards with it while node 0 records its
    # own: the ranks compare their configs when they meet, before anything trains.
    nodes = [*SHORT, "train.nodes=2", f"train.rdzv_endpoint=127.0.0.1:{free_port()}"]
    node1 = start_grail_train(tmp_path, *nodes, "train.node_rank=1", "train.lr=0.5")
    node0 = start_grail_train(tmp_path, *nodes, "train.node_rank=0")
    for code, out in (finish(node0, 180), finish(node1, 60)):
        assert code == 2, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        errors = [line for line in out.splitlines() if "[ERROR]" in line]
        assert len(errors) == 1, out[-3000:]
        assert "the nodes were started with different configs: train.lr (node 0: " in errors[0]
        assert "node 1: 0.5)" in errors[0] and "train.kl_coef" not in errors[0]
    assert not list(tmp_path.glob("metrics/train_iter_*.json"))
