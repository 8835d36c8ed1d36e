"""The policy update sharded over 2 ranks (FSDP2 on gloo, CPU) equals the 1-rank update (issue 29).

Two processes (tests/helpers/distributed_update.py) run every case of `CASES` one after another
as ranks 0 and 1, while this process runs the same cases without torch.distributed; then the
returned metrics, the gradient norm and the updated parameters are compared. The two processes
are started once for all cases (each start costs seconds of imports) and are killed if they
outlive their deadline.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed_update import CASES, Case, models_of, run_case

from grail.rollouts.batch import Sample
from grail.train.rank_share import rank_share, share_by_tokens

WORKER = Path(__file__).parent / "helpers" / "distributed_update.py"
WORLD = 2
DEADLINE_S = 300.0  # both ranks, all cases; measured ~60 s on an idle 2-core machine

# Float32 rounding: the ranks add their gradients in another order than one rank's backward.
PARAM_ATOL = 1e-6
METRIC_REL = 1e-5
# Merged per piece, as one rank merges padding-free pieces: exact only at token level
# (sequence-level means are weighted by tokens, the effective sample size is not a mean).
SEQUENCE_LEVEL_METRICS = {
    "ratio_mean",
    "ratio_max",
    "clip_frac_low",
    "clip_frac_high",
    "clip_frac",
    "ratio_cap_frac",
    "logratio_clamp_frac",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_ranks(
    model_dir: Path, out_dir: Path, backend: str = "gloo"
) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    port = _free_port()
    procs = []
    for r in range(WORLD):
        with (out_dir / f"rank{r}.log").open("w") as log:
            argv = [str(WORKER), str(r), str(WORLD), str(port), str(model_dir), str(out_dir)]
            argv.append(backend)
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env
                )
            )
    return procs


def _wait_ranks(procs: list[subprocess.Popen[bytes]], out_dir: Path, deadline: float) -> list[Any]:
    """Both ranks to the end, or killed at `deadline` (or when one fails: the other would wait in
    a collective until its timeout); what each saved."""
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    codes = [p.returncode for p in procs]
    if codes != [0] * WORLD:
        tails = "\n".join(
            f"--- rank {r} (exit {codes[r]}):\n{(out_dir / f'rank{r}.log').read_text()[-3000:]}"
            for r in range(WORLD)
        )
        pytest.fail(f"the ranks did not finish cleanly within {DEADLINE_S:.0f} s:\n{tails}")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _close(got: Any, want: Any) -> bool:
    if want is None or isinstance(want, bool):
        return bool(got == want)
    if math.isnan(want):
        return math.isnan(got)
    return bool(got == pytest.approx(want, rel=METRIC_REL, abs=1e-7))


def test_two_ranks_update_as_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Every loss type, KL on (a sharded reference, and LoRA's adapter-off one), padded and
    packed layouts, several optimizer steps, micro-batches smaller than the world, the
    zero-gradient batch and LoRA: the 2-rank update returns the 1-rank metrics and moves the
    parameters where the 1-rank update does, on every rank alike."""
    deadline = time.monotonic() + DEADLINE_S
    procs = _start_ranks(tiny_model_dir, tmp_path)
    try:  # the 1-rank references while the ranks run
        want = {}
        for case in CASES:
            model, ref = models_of(case, tiny_model_dir)
            want[case.name] = run_case(case, model, ref)
    finally:
        results = _wait_ranks(procs, tmp_path, deadline)
    report = []
    for case in CASES:
        want_metrics, want_params, want_tokens = want[case.name]
        got = results[0][case.name]
        # Every rank returns the same metrics (gathered, then merged alike).
        assert results[1][case.name]["metrics"] == got["metrics"], case.name
        assert set(got["metrics"]) == set(want_metrics), case.name
        exact = set(want_metrics)
        if case.importance_sampling_level == "sequence":
            exact -= SEQUENCE_LEVEL_METRICS
        if case.is_correction != "none":
            exact -= {"is_ess", "is_clip_frac", "is_weight_mean"}
        wrong = {
            k: (got["metrics"][k], want_metrics[k])
            for k in exact
            if not _close(got["metrics"][k], want_metrics[k])
        }
        assert not wrong, f"{case.name}: {wrong}"
        diff = max(float((got["params"][n] - p).abs().max()) for n, p in want_params.items())
        moved = max(
            float((got["params"][n] - p).abs().max())
            for n, p in _initial(case, tiny_model_dir).items()
        )
        assert diff <= PARAM_ATOL, f"{case.name}: parameters differ by {diff}"
        tokens = [results[r][case.name]["tokens"] for r in range(WORLD)]
        if case.zero_advantages:
            assert tokens == [0] * WORLD and want_tokens == 0  # no forward pass anywhere
        else:
            assert moved > 100 * PARAM_ATOL, f"{case.name}: the update did not move the weights"
        if case.batch_size > 1 and not case.zero_advantages:
            # Each rank ran its share only: ranks that each ran the whole batch, FSDP2 averaging
            # their gradients, would pass every check above.
            assert max(tokens) < want_tokens, (case.name, tokens, want_tokens)
        line = _exactness(got["metrics"], want_metrics, exact, diff, moved)
        report.append(f"{case.name}: {line}")
        report[-1] += f"; tokens per rank {tokens} vs 1 rank {want_tokens}"
    print("\n".join(report))


def _exactness(
    got: dict[str, Any], want: dict[str, Any], exact: set[str], diff: float, moved: float
) -> str:
    """The case's line of the exactness report (-s shows it)."""

    def rel(k: str) -> float:
        a, b = got[k], want[k]
        if a is None or b is None or isinstance(b, bool) or (math.isnan(a) and math.isnan(b)):
            return 0.0
        return abs(a - b) / max(abs(b), 1e-12)

    worst = max(exact, key=rel)
    line = (
        f"max|param diff| {diff:.1e} (moved {moved:.1e}), loss_total rel {rel('loss_total'):.1e}"
        f", grad_norm rel {rel('grad_norm'):.1e}, worst metric {worst} rel {rel(worst):.1e}"
    )
    inexact = {k: f"{rel(k):.1e}" for k in sorted(set(want) - exact)}
    return line + (f"; not compared: {inexact}" if inexact else "")


def _initial(case: Case, model_dir: Path) -> dict[str, torch.Tensor]:
    model, _ = models_of(case, model_dir)
    return {n: p.detach() for n, p in model.named_parameters()}


def _sample(completion_tokens: int) -> Sample:
    n = completion_tokens
    return Sample([7] * n, [-1.0] * n, "length", "", 0.0, {}, False, 1.0)


def test_shares_balance_tokens_deterministically() -> None:
    """Longest first to the least-loaded rank, the lowest on a tie; each share in batch order."""
    assert share_by_tokens([5, 1, 4, 4, 2], 2) == [[0, 1, 4], [2, 3]]  # 8 tokens each
    assert share_by_tokens([3], 2) == [[0], []]
    assert share_by_tokens([1, 1, 1], 1) == [[0, 1, 2]]


def test_every_rank_runs_as_many_passes_as_the_rank_with_most_pieces() -> None:
    items = [([1] * 4, _sample(n)) for n in (6, 1, 1, 1, 1)]  # 10, 5, 5, 5, 5 tokens
    shares = [rank_share(items, 2, r, micro_batch_tokens=10) for r in range(2)]
    # rank 0: the 10-token sample and one of 5; rank 1: three of 5 (two pieces of <= 10).
    assert [len(s.pieces) for s in shares] == [2, 2]
    assert {s.passes for s in shares} == {2}
    padded = [rank_share(items, 3, r, micro_batch_tokens=0) for r in range(3)]
    assert [len(s.pieces) for s in padded] == [1, 1, 1] and {s.passes for s in padded} == {1}
    alone = [rank_share(items[:1], 2, r, micro_batch_tokens=0) for r in range(2)]
    assert [len(s.pieces) for s in alone] == [1, 0] and {s.passes for s in alone} == {1}
