"""Where a grail-train process stands among `train.nodes` machines (grail/core/nodes.py): from the
config, or from a SLURM job's environment (faked here: no cluster)."""

from __future__ import annotations

import pytest

from grail.core.config import Config
from grail.core.errors import ConfigError
from grail.core.nodes import (
    SLURM_PORT_BASE,
    NodePlan,
    config_differences,
    first_host,
    node_plan,
    shared_settings,
)

# What SLURM sets in each task of a 2-node job (srun, one task per node), node 1's task.
SLURM = {
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NODEID": "1",
}


def test_one_node_needs_nothing() -> None:
    assert node_plan(1, None, None, {}) == NodePlan(1, 0, None)
    assert node_plan(1, None, None, SLURM).drives  # a 1-node SLURM job is a single node


def test_the_config_gives_the_node_rank_and_endpoint() -> None:
    plan = node_plan(2, 1, "10.0.0.5:29500", {})
    assert plan == NodePlan(2, 1, "10.0.0.5:29500") and not plan.drives
    assert node_plan(2, 0, "10.0.0.5:29500", {}).drives


@pytest.mark.parametrize(
    ("node_rank", "endpoint", "says"),
    [
        (None, "h:1", "train.node_rank=0 on the node"),
        (0, None, "train.rdzv_endpoint=HOST:PORT"),
        (2, "h:1", "train.node_rank=2 is not in 0..1"),
        (0, "h", "train.rdzv_endpoint must be HOST:PORT"),
        (0, "h:port", "train.rdzv_endpoint must be HOST:PORT"),
    ],
)
def test_what_is_missing_or_wrong_is_named(
    node_rank: int | None, endpoint: str | None, says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        node_plan(2, node_rank, endpoint, {})


def test_a_slurm_job_gives_them_from_its_environment() -> None:
    plan = node_plan(2, None, None, SLURM)
    assert plan.node_rank == 1 and not plan.drives
    # The first host of the job (node 0's), a port from the job id: every task computes the same.
    assert plan.endpoint == f"gpu07:{SLURM_PORT_BASE + 123456 % 20000}"
    assert node_plan(2, None, None, {**SLURM, "SLURM_NODEID": "0"}).drives


def test_the_config_wins_over_slurm() -> None:
    assert node_plan(2, 0, "login1:4000", SLURM) == NodePlan(2, 0, "login1:4000")


def test_a_slurm_job_of_another_size_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"train.nodes=4 but the SLURM job has 2 node\(s\)"):
        node_plan(4, None, None, SLURM)
    with pytest.raises(ConfigError, match="SLURM_NODEID is not set"):
        node_plan(2, None, None, {k: v for k, v in SLURM.items() if k != "SLURM_NODEID"})


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu07", "gpu07"),
        ("gpu[03-05,07]", "gpu03"),
        ("gpu[003-004],cpu1", "gpu003"),
        ("a-node-1,a-node-2", "a-node-1"),
        ("n[9,10]", "n9"),
    ],
)
def test_the_first_host_of_a_node_list(
    nodelist: str, first: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the list is read here
    assert first_host(nodelist) == first


def test_the_slurm_nodes_launcher_preset_composes() -> None:
    from hydra import compose, initialize_config_dir

    from grail.train.cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            config_name="offline_grpo",
            overrides=["hydra/launcher=slurm_nodes", "train.nodes=2"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node) == (2, 1)  # one grail-train per node
    assert launcher.max_num_timeout == 0  # slurm.yaml's settings underneath
    assert cfg.train.nodes == 2 and cfg.train.node_rank is None and cfg.train.rdzv_endpoint is None


def test_the_nodes_agree_when_only_the_node_rank_differs() -> None:
    node0, node1 = Config(), Config()
    node0.train.node_rank, node1.train.node_rank = 0, 1
    settings = shared_settings(node0)
    assert "train.node_rank" not in settings and settings["train.lr"] == node0.train.lr
    # every rank sends its node's settings: two ranks per node here
    gathered = [(0, settings), (0, settings), (1, shared_settings(node1)), (1, settings)]
    assert config_differences(gathered) is None


def test_a_difference_is_one_line_naming_each_key_and_node() -> None:
    node0, node1, node2 = Config(), Config(), Config()
    node1.train.lr, node1.train.kl_coef = 2e-3, 0.05
    node2.train.lr = 2e-3
    node1.train.loss_type = node2.train.loss_type = type(node0.train.loss_type)("grpo")
    said = config_differences(
        [(n, shared_settings(c)) for n, c in enumerate((node0, node1, node2))]
    )
    assert said is not None and "\n" not in said
    lr, kl = repr(Config().train.lr), repr(Config().train.kl_coef)
    assert f"train.lr (node 0: {lr}; nodes 1, 2: 0.002)" in said
    assert f"train.kl_coef (nodes 0, 2: {kl}; node 1: 0.05)" in said
    assert "train.loss_type (node 0: 'dapo'; nodes 1, 2: 'grpo')" in said  # an Enum, by value
    assert "train.node_rank" in said  # what may differ
    # a key one node's grail does not know, and a long value cut short
    long = {"data.path": "x" * 200}
    said = config_differences([(0, {"seed": 0, **long}), (1, {"seed": 0, "data.path": "y"})])
    assert said is not None and "data.path (node 0: 'xxx" in said and "...;" in said
    said = config_differences([(0, {"seed": 0}), (1, {"seed": 0, "new.key": 1})])
    assert said is not None and "new.key (node 0: (no such key); node 1: 1)" in said
