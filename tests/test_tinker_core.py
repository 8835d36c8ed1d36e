"""grail/tinker/core.py and checkpoints.py in-process (the SDK-driven tests are
tests/test_tinker.py): sessions whose client died are reaped, checkpoint names and paths are
checked; the gradients of the losses whose formulas hold a term constant; no step after the runs
ended."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from grail.models.loading import load_model
from grail.models.tiny import ensure_tiny_model
from grail.tinker import core as tinker_core
from grail.tinker import losses, wire
from grail.tinker.checkpoints import Checkpoints
from grail.tinker.core import ModelInfo, TinkerCore
from grail.tinker.errors import Busy, NotFound, UserFault
from grail.tinker.jobs import Result
from grail.tinker.trainer import AdamStep, LoraSpec, Trainer


def bare_core() -> TinkerCore:
    info = ModelInfo(name="tiny", arch="qwen2", tokenizer_id="/x", max_context=16)
    return TinkerCore(None, None, None, info, max_pending=4)  # type: ignore[arg-type]


def test_a_session_without_heartbeats_is_finished_and_its_clients_unloaded() -> None:
    core = bare_core()
    alive, dead = core.create_session(), core.create_session()
    core.sessions[dead] -= tinker_core.SESSION_TIMEOUT_S + 1
    core.reap_stale()
    assert dead in core.finished and dead not in core.sessions
    assert alive in core.sessions
    assert core.heartbeat(alive) and not core.heartbeat(dead)  # False: the SDK gets a 410
    queued: Any = core.jobs._train.get_nowait()  # the unload of the dead session's clients
    assert queued[0] is None
    with pytest.raises(NotFound, match="unknown session"):
        core.heartbeat("session-never")


def test_checkpoint_paths_are_checked(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path)
    assert checkpoints.path("s:train:0", "weights", "a") == "tinker://s:train:0/weights/a"
    for name in ("../up", ".hidden", "a/b", ""):
        with pytest.raises(UserFault, match="checkpoint name"):
            checkpoints.directory("s:train:0", "weights", name)
    with pytest.raises(UserFault, match="not a checkpoint path"):
        checkpoints.resolve("s3://bucket/x", "weights")
    with pytest.raises(UserFault, match="but weights are needed"):
        checkpoints.resolve("tinker://s:train:0/sampler_weights/a", "weights")
    with pytest.raises(NotFound, match="no checkpoint"):
        checkpoints.resolve("tinker://s:train:0/weights/a", "weights")
    checkpoints.directory("s:train:0", "weights", "a").mkdir(parents=True)
    assert [c["checkpoint_id"] for c in checkpoints.list("s:train:0")] == ["weights/a"]
    checkpoints.delete("s:train:0", "weights/a")
    assert checkpoints.list("s:train:0") == []


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--api-key", "secret"], "only sends keys that start with 'tml-'"),
        (["--api-key", ""], "give --api-key"),
    ],
)
def test_grail_tinker_refuses_a_key_the_sdk_cannot_send(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from grail.tinker.cli import main

    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


def test_the_queue_is_bounded() -> None:
    """Past --max-pending requests queued or running, a request gets 429 (Busy), which the SDK
    backs off from and retries; nothing is queued for it."""
    core = bare_core()  # max_pending=4, workers not started: everything stays pending
    for _ in range(4):
        core.jobs.submit(lambda: Result(json={}))
    with pytest.raises(Busy, match="--max-pending") as refused:
        core.jobs.submit(lambda: Result(json={}))
    assert refused.value.status == 429
    assert core.jobs._train.qsize() == 4


def test_cispo_holds_its_clipped_ratio_constant_and_dro_pulls_back_to_the_sampler() -> None:
    """The gradients the documented formulas mean (the SDK tests compare the values): cispo's
    d L / d logp_t is -clip(ratio_t) * A_t, the ratio not differentiated; dro's is
    -(A_t - beta * (logp_t - q_t))."""
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    q = torch.tensor([-1.5, -1.0, -0.5])
    adv = torch.tensor([1.0, -2.0, 0.5])
    inputs = {"logprobs": q, "advantages": adv}
    losses.cispo(logp, inputs, {}).sum().backward()
    ratio = torch.exp(logp.detach() - q).clamp(losses.PPO_CLIP_LOW, losses.PPO_CLIP_HIGH)
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, -ratio * adv)
    logp.grad = None
    losses.dro(logp, inputs, {"beta": 0.5}).sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, -(adv - 0.5 * (logp.detach() - q)))


def test_no_step_is_taken_after_the_runs_end_and_the_summary_follows_the_last_record(
    tmp_path: Path,
) -> None:
    model_dir = ensure_tiny_model()
    model = load_model(model_dir)
    trainer = Trainer(model, base_model="tiny", run_dir=tmp_path, max_context=64, max_clients=1)
    run = trainer.create("s:train:0", LoraSpec(rank=4, seed=0))
    ids = [5, 6, 7, 8, 9]
    k = len(ids) - 1
    datum = wire.Datum(
        ids[:-1],
        {
            "target_tokens": wire.Tensor(np.array(ids[1:], dtype=np.int64), [k]),
            "weights": wire.Tensor(np.ones(k, dtype=np.float32), [k]),
        },
    )
    adam = AdamStep(1e-3, 0.9, 0.95, 1e-8, 0.0, 0.0)
    trainer.forward_backward(run.model_id, [datum], "cross_entropy", {}, False)
    trainer.optim_step(run.model_id, adam)
    trainer.forward_backward(run.model_id, [datum], "cross_entropy", {}, False)
    trainer.end_runs("server stopped")
    with pytest.raises(UserFault, match="the server is stopping"):
        trainer.optim_step(run.model_id, adam)
    records = sorted((run.run_dir / "metrics").glob("train_iter_*.json"))
    assert [r.name for r in records] == ["train_iter_000.json"]
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["iterations"] == 1
