"""`reproducible=true`: the same config and seed give the same metrics on any x86-64 CPU with AVX2
of one vendor (Intel and AMD CPUs still round differently: docs/benchmarks.md).

Without it a CPU run is reproducible only on the machine that ran it. Measured on the default job
(first 5 iterations, 2-core AMD EPYC with AVX2, `scripts/fingerprint.py`; docs/benchmarks.md):
each of these alone changed the metrics from the first iteration on:
- torch's CPU kernels (ATen picks AVX-512, AVX2 or plain code by the CPU: `ATEN_CPU_CAPABILITY`);
  its vector width and instructions change the rounding of every reduction;
- MKL's GEMMs (MKL picks kernels and blocking by CPU and cache sizes; `MKL_CBWR` pins them);
- the thread counts of the trainer and of the built-in server (reductions split by thread), which
  grail derives from the cores a run may use (grail/core/placement.py).

So a reproducible run pins all three: ATen's AVX2 kernels (the same instructions, so the same
results, on every CPU that has them, AVX-512 ones included), MKL's `COMPATIBLE` branch (the only
CNR branch MKL honours on AMD as well as Intel: asked for `AVX2`, MKL on the AMD EPYC ran its own
`AUTO` dispatch instead, per MKL_VERBOSE's `CNR:AUTO`) and one thread each for trainer and server
unless `train.threads` / `generation.server_threads` say otherwise. oneDNN is left alone: the
default job never calls it (ONEDNN_VERBOSE printed nothing). On a CPU without AVX2 (Arm, old x86)
torch cannot run AVX2 kernels, and results match only machines of the same kind.

Both variables are read lazily: ATen's at the first kernel dispatch, MKL's at its first call. So
they are set in the trainer's own environment before the first tensor operation (grail-train does
it right after composing the config) and in the built-in server's environment at its start;
`check_torch_honours` then confirms that torch took the AVX2 kernels.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from grail.core.errors import ConfigError

# The values `reproducible=true` pins (docstring above for why each).
REPRODUCIBLE_ENV: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}
# Threads of the trainer and of the built-in server when the config leaves them unset: one each,
# so that a run never needs more than one core in sync mode (two pipelined) and a sweep's parallel
# runs never oversubscribe a small machine (docs/benchmarks.md has the cost).
REPRODUCIBLE_THREADS = 1


def apply_reproducible_env(env: MutableMapping[str, str]) -> None:
    """Pin the variables of `REPRODUCIBLE_ENV` in `env` (a process's environment, or a child's),
    over any value set there: a reproducible run that a stray variable could change would not be."""
    env.update(REPRODUCIBLE_ENV)


def pin_this_process() -> None:
    """Make this process run the kernels a reproducible run pins, leaving its environment (what
    its children inherit) as it was: for a process that runs reproducible work in-process beside
    children that pin their own (the test session). Must run before torch's first operation."""
    import os

    saved = {name: os.environ.get(name) for name in REPRODUCIBLE_ENV}
    apply_reproducible_env(os.environ)
    try:
        import torch

        # ATen reads its variable at the first dispatch, MKL its own at the first GEMM.
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    check_torch_honours()


def check_torch_honours() -> str:
    """Raise if torch, in this process, runs other kernels than a reproducible run pins; return
    torch's CPU capability. Where the CPU has no AVX2, the run goes on (matching only machines of
    its kind), and the capability returned says so in the fingerprint key."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX2" or not torch.cpu._is_avx2_supported():
        return capability
    # AVX512: torch ran an operation before the variable was set; DEFAULT on a CPU with AVX2:
    # something set ATEN_CPU_CAPABILITY=default after grail pinned it (both round differently).
    raise ConfigError(
        f"reproducible=true needs torch's AVX2 CPU kernels, but this process already runs "
        f"{capability} ones: torch ran a tensor operation before grail could set "
        f"ATEN_CPU_CAPABILITY=avx2. Set ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE in the "
        f"environment before starting, or set reproducible=false"
    )


def cpu_vendor() -> str:
    """The CPU's vendor as the kernel names it (`GenuineIntel`, `AuthenticAMD`; "unknown" where
    /proc/cpuinfo has none): with the kernels pinned, Intel and AMD CPUs still round the default
    job differently from its second iteration on (docs/benchmarks.md), so the key names it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def fingerprint_key(trainer_threads: int, server_threads: int) -> dict[str, Any]:
    """What decides a CPU run's numbers besides the config and the code: torch's version (its
    kernels and the MKL it bundles), its CPU capability, the CPU's vendor, MKL's branch and the
    thread counts.
    Call after the first tensor operation of the process (torch reads its capability then)."""
    import os

    import torch

    return {
        "torch": torch.__version__.split("+")[0],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_vendor": cpu_vendor(),
        "mkl_cbwr": os.environ.get("MKL_CBWR", "off"),
        "trainer_threads": trainer_threads,
        "server_threads": server_threads,
    }
