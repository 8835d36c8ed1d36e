"""GPU lists: `gpu.training_gpus` / `gpu.server_gpus` name each side's GPUs (one trainer rank per
training GPU), old configs keep their placement, and every impossible layout is refused with one
line naming the key before anything starts."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grail.core.config import Config
from grail.core.errors import ConfigError
from grail.core.placement import (
    GpuConfig,
    gpu_layout,
    gpu_placement,
    server_devices,
    trainer_devices,
)
from grail.core.validate import validate
from grail.train.cli import CONF_DIR


def _compose(*overrides: str) -> Config:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="offline_grpo", overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def test_the_issue_layout_composes_from_the_command_line() -> None:
    cfg = _compose("gpu.training_gpus=[1,2,3]", "gpu.server_gpus=[0]")
    validate(cfg)
    assert trainer_devices(cfg.gpu, None, visible=4) == [1, 2, 3]
    assert server_devices(cfg.gpu, None, visible=4) == [0]
    assert trainer_devices(cfg.gpu, 3, visible=8) == [1, 2, 3]  # train.processes agrees
    assert not gpu_layout(cfg.gpu).shared  # apart: the server has its own GPU, whatever strategy


@pytest.mark.parametrize(
    "strategy,set_,processes,server,trainer",
    [
        ("single", {}, None, (0,), (0,)),  # today's default
        ("single", {}, 2, (0,), (0, 1)),  # shared: the server on rank 0's GPU
        ("multi", {}, None, (0,), (1,)),
        ("multi", {}, 3, (0,), (1, 2, 3)),
        ("single", {"server_gpu": 2}, None, (2,), (2,)),
        ("single", {"server_gpus": [2]}, 3, (2,), (2, 0, 1)),  # rank 0 shares the server's GPU
        ("single", {"training_gpus": [4, 5]}, None, (4,), (4, 5)),
        ("multi", {"training_gpus": [0, 2]}, None, (1,), (0, 2)),  # the lowest free GPU
        ("multi", {"server_gpus": [1]}, 2, (1,), (0, 2)),
        ("single", {"server_gpus": [0], "training_gpus": [1, 2, 3]}, None, (0,), (1, 2, 3)),
        ("single", {"server_gpus": [0], "training_gpus": [0, 1]}, 2, (0,), (0, 1)),
        (
            "multi",
            {"server_gpus": [0, 1], "training_gpus": [2, 3, 4, 5, 6, 7]},
            6,
            (0, 1),
            (2, 3, 4, 5, 6, 7),
        ),
    ],
)
def test_unset_sides_are_placed_by_the_strategy(
    strategy: str, set_: dict, processes: int | None, server: tuple, trainer: tuple
) -> None:
    layout = gpu_layout(GpuConfig(strategy=strategy, **set_), processes)  # type: ignore[arg-type]
    assert (layout.server, layout.trainer) == (server, trainer)
    assert layout.shared == bool(set(server) & set(trainer))


@pytest.mark.parametrize(
    "strategy,set_,processes,servers,server,trainer",
    [  # a fleet (generation.servers): one GPU per server unless the lists say otherwise
        ("multi", {}, 2, 2, (0, 1), (2, 3)),
        ("multi", {"training_gpus": [0, 2]}, None, 2, (1, 3), (0, 2)),
        ("single", {}, 2, 2, (0, 1), (0, 1)),  # each server on a rank's GPU
        ("single", {}, None, 4, (0,), (0,)),  # one GPU: the built-in servers share it
        ("single", {"training_gpus": [3, 4, 5]}, None, 2, (3, 4), (3, 4, 5)),
        ("multi", {"server_gpus": [0, 1, 2, 3]}, None, 4, (0, 1, 2, 3), (4,)),
    ],
)
def test_a_fleets_servers_take_a_gpu_each(
    strategy: str, set_: dict, processes: int | None, servers: int, server: tuple, trainer: tuple
) -> None:
    gpu = GpuConfig(strategy=strategy, **set_)  # type: ignore[arg-type]
    layout = gpu_layout(gpu, processes, servers)
    assert (layout.server, layout.trainer) == (server, trainer)


@pytest.mark.parametrize(
    "overrides,placement",
    [  # the scalar keys mean what they meant before the lists
        ([], (0, 0)),
        (["gpu.server_gpu=2"], (2, 2)),
        (["gpu.training_gpu=3"], (3, 3)),
        (["gpu.strategy=multi"], (0, 1)),
        (["gpu.strategy=multi", "gpu.server_gpu=1"], (1, 0)),
        (["gpu.strategy=multi", "gpu.training_gpu=0"], (1, 0)),
        (["gpu.strategy=multi", "gpu.server_gpu=2", "gpu.training_gpu=5"], (2, 5)),
    ],
)
def test_scalar_keys_keep_their_placement(overrides: list[str], placement: tuple[int, int]) -> None:
    cfg = _compose(*overrides)
    validate(cfg)
    assert gpu_placement(cfg.gpu) == placement
    assert trainer_devices(cfg.gpu, None, visible=8) == [placement[1]]
    assert server_devices(cfg.gpu, None, visible=8) == [placement[0]]


@pytest.mark.parametrize(
    "gpu,processes,message",
    [
        ({"training_gpus": [1, 2, 1]}, None, r"gpu.training_gpus=\[1,2,1\] names GPU 1 twice"),
        ({"server_gpus": []}, None, r"gpu.server_gpus=\[\] names no GPU"),
        ({"training_gpus": [0, -1]}, None, r"gpu.training_gpus=\[0,-1\] holds -1"),
        ({"server_gpu": -1}, None, r"gpu.server_gpu must be >= 0"),
        ({"training_gpu": 1, "training_gpus": [1]}, None, r"gpu.training_gpu=1 and gpu.train"),
        (
            {"training_gpus": [1, 2, 3]},
            2,
            r"gpu.training_gpus=\[1,2,3\] names 3 GPU\(s\) but "
            r"train.processes=2",
        ),
        (
            {"strategy": "multi", "server_gpus": [0], "training_gpus": [0, 1]},
            None,
            r"gpu.strategy=multi needs gpu.server_gpus=\[0\] apart .*GPU 0 is in both",
        ),
        (
            {"strategy": "multi", "server_gpu": 1, "training_gpu": 1},
            None,
            r"gpu.strategy=multi needs gpu.server_gpu=1 apart",
        ),
        (
            {"server_gpus": [0, 4], "training_gpus": [0, 1]},
            None,
            r"gpu.server_gpus=\[0,4\] shares only some",
        ),
        ({"server_gpus": [0, 1]}, 1, r"gpu.server_gpus=\[0,1\] needs train.processes >= 2"),
        ({}, 0, r"train.processes must be >= 1"),
    ],
)
def test_impossible_layouts_name_the_key(gpu: dict, processes: int | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        trainer_devices(GpuConfig(**gpu), processes, visible=8)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "gpu,processes,visible,message",
    [
        (
            {"training_gpus": [1, 2, 3]},
            None,
            3,
            r"gpu.training_gpus=\[1,2,3\] puts the training on GPU 3, but this process sees 3",
        ),
        ({"server_gpu": 4}, None, 2, r"gpu.server_gpu=4 puts the server on GPU 4"),
        (
            {"strategy": "multi"},
            8,
            8,
            r"gpu.strategy=multi with train.processes=8 puts the training on GPU 8",
        ),
        (
            {"training_gpus": [0]},
            None,
            0,
            r"gpu.training_gpus=\[0\] names GPUs, but this process "
            "sees none",
        ),
    ],
)
def test_gpus_the_machine_lacks_are_refused(
    gpu: dict, processes: int | None, visible: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        trainer_devices(GpuConfig(**gpu), processes, visible)


def test_on_cpu_the_strategy_and_scalar_keys_are_ignored_as_before() -> None:
    # No GPU: the ranks run on CPU (the default job, the tests), whatever the strategy says.
    for gpu in (GpuConfig(), GpuConfig(strategy="multi", server_gpu=1)):  # type: ignore[arg-type]
        assert trainer_devices(gpu, 2, visible=0) == []
        assert server_devices(gpu, 2, visible=0) == []


def test_validate_refuses_bad_lists_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="names GPU 2 twice"):
        validate(_compose("gpu.training_gpus=[2,2]"))
    with pytest.raises(ConfigError, match="gpu.strategy=multi needs"):
        validate(_compose("gpu.strategy=multi", "gpu.server_gpus=[1]", "gpu.training_gpus=[1]"))


def test_weight_routes_follow_where_the_gpus_are() -> None:
    # lists apart under the default strategy: the server has its own GPU, so NCCL is possible and
    # the shared-tensor route (server on the trainer's device) is not
    apart = ("gpu.server_gpus=[0]", "gpu.training_gpus=[1]", "model.lora.enabled=false")
    validate(_compose("generation=vllm", "generation.weight_transfer=nccl", *apart))
    with pytest.raises(ConfigError, match="generation.weight_transfer=shared needs the server"):
        validate(_compose("generation.weight_transfer=shared", *apart))
    with pytest.raises(ConfigError, match="needs gpu.strategy=multi"):
        validate(
            _compose(
                "generation=vllm",
                "generation.weight_transfer=nccl",
                "gpu.server_gpus=[0]",
                "gpu.training_gpus=[0,1]",
            )
        )
