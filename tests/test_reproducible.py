"""`reproducible=true` (grail/core/reproducible.py): what it pins, in the trainer and the server.
Whether the numbers then agree is tests/test_fingerprint.py's question."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grail.core.config import Config, GenerationConfig
from grail.core.errors import ConfigError
from grail.core.reproducible import REPRODUCIBLE_ENV, apply_reproducible_env, check_torch_honours
from grail.inference.builtin.server import parse_args
from grail.train.components import server_manager_from_config


def test_the_variables_win_over_the_callers() -> None:
    env = {"ATEN_CPU_CAPABILITY": "avx512", "PATH": "/bin"}
    apply_reproducible_env(env)
    assert env == {**REPRODUCIBLE_ENV, "PATH": "/bin"}


@pytest.mark.parametrize("reproducible", [True, False])
def test_the_builtin_server_gets_them_on_cpu(tmp_path: Path, reproducible: bool) -> None:
    cfg = Config(reproducible=reproducible, generation=GenerationConfig(server_threads=None))
    server = server_manager_from_config(cfg, tmp_path, tmp_path / "run", cuda_available=False)
    assert server.env_overrides == (REPRODUCIBLE_ENV if reproducible else {})
    # grail-serve pins its own kernels unless told not to, so one started by hand computes as
    # the one a reproducible run starts (tests/test_external_servers.py checks the numbers).
    assert ("--no-reproducible" in server.server_args()) is not reproducible
    assert parse_args(["--model", "tiny"]).reproducible
    if reproducible:
        env = server.child_env()
        assert {k: env[k] for k in REPRODUCIBLE_ENV} == REPRODUCIBLE_ENV
        assert env["OMP_NUM_THREADS"] == "1"  # fixed, whatever the machine's cores


@pytest.mark.parametrize(
    ("capability", "avx2", "fails"),
    [
        ("AVX2", True, False),
        ("AVX512", True, True),  # torch ran an operation before the variable was set
        ("DEFAULT", True, True),  # ATEN_CPU_CAPABILITY=default won over the pin: plain kernels
        ("DEFAULT", False, False),  # Arm, old x86: nothing to pin; the key names the capability
    ],
)
def test_torch_on_other_kernels_is_an_error_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch, capability: str, avx2: bool, fails: bool
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: avx2)
    if fails:
        with pytest.raises(ConfigError, match="ATEN_CPU_CAPABILITY=avx2"):
            check_torch_honours()
    else:
        assert check_torch_honours() == capability
