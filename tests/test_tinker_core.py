"""grail/tinker/core.py and checkpoints.py in-process (the SDK-driven tests are
tests/test_tinker.py): sessions whose client died are reaped, on a timer; request ids are new on
every start and bound to their client; checkpoint names and paths are checked (whole names, as
every name and id grail checks); the key, the address and the tiny presets grail-tinker starts
with; the gradients of the losses whose formulas hold a term constant; no step after the runs
ended; a checkpoint loads into a client of its shape whatever its seed."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from grail.models.loading import load_model
from grail.models.tiny import TINY_PRESETS, ensure_tiny_model
from grail.tinker import core as tinker_core
from grail.tinker import losses, wire
from grail.tinker.checkpoints import Checkpoints
from grail.tinker.core import ModelInfo, TinkerCore
from grail.tinker.errors import Busy, NotFound, UserFault
from grail.tinker.jobs import Result
from grail.tinker.trainer import AdamStep, LoraSpec, Trainer


def bare_core(**timing: float) -> TinkerCore:
    info = ModelInfo(name="tiny", arch="qwen2", tokenizer_id="/x", max_context=16)
    return TinkerCore(None, None, None, info, max_pending=4, **timing)  # type: ignore[arg-type]


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


def test_a_dead_clients_session_is_reaped_on_a_timer() -> None:
    """No other client needs to come: the reaper finishes a session whose heartbeats stopped,
    and queues the unload of its clients (their runs end), while a live session stays."""
    core = bare_core(session_timeout_s=0.3, reap_interval_s=0.05)
    alive, dead = core.create_session(), core.create_session()
    core.start_reaper()
    try:
        deadline = time.monotonic() + 10
        while dead not in core.finished and time.monotonic() < deadline:
            assert core.heartbeat(alive)
            time.sleep(0.02)
    finally:
        core.stop_reaper()
    assert dead in core.finished and alive in core.sessions
    queued: Any = core.jobs._train.get_nowait()  # the unload of the dead session's clients
    assert queued[0] is None


def test_request_ids_are_new_on_every_start_and_bound_to_their_client() -> None:
    """Ids restarted at req-1 on every start and were looked up alone: after a restart an old
    client's pending futures answered with a new client's results."""
    before, after = bare_core(), bare_core()  # one server, started twice
    old = before.jobs.submit(lambda: Result(json={}), "session-a:train:0", "session-a")
    new = after.jobs.submit(lambda: Result(json={}), "session-b:train:0", "session-b")
    assert old != new and old.startswith("req-") and new.startswith("req-")
    with pytest.raises(NotFound, match="not issued by this server"):
        asyncio.run(after.jobs.retrieve(old))
    for model, session in (("session-a:train:0", None), (None, "session-a")):
        with pytest.raises(NotFound, match="is not a request of"):
            asyncio.run(after.jobs.retrieve(new, model, session))
    entry = after.jobs.entries[new]
    entry.result = Result(json={"ok": True})
    entry.done.set()
    assert asyncio.run(after.jobs.retrieve(new, "session-b:train:0", "session-b")) == entry.result


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


def test_names_and_ids_are_checked_whole(tmp_path: Path) -> None:
    """`re.match` with `$` let a name end in a newline; every name and id grail checks is
    matched whole."""
    import jsonschema

    from grail.core.records import checkpoint_iteration
    from grail.models.loading import is_hub_id

    checkpoints = Checkpoints(tmp_path)
    with pytest.raises(UserFault, match="checkpoint name"):
        checkpoints.directory("s:train:0", "weights", "step-1\n")
    with pytest.raises(UserFault, match="is not one this server issues"):
        checkpoints.directory("s:train:0\n", "weights", "step-1")
    assert is_hub_id("Qwen/Qwen3-8B") and not is_hub_id("Qwen/Qwen3-8B\n")
    assert checkpoint_iteration("iter_005") == 5 and checkpoint_iteration("iter_005\n") is None
    schema = json.loads(
        (Path(__file__).parents[1] / "grail/schemas/train_iteration.schema.json").read_text()
    )
    key = schema["properties"]["rollouts_reused"]["properties"]["key"]
    jsonschema.validate("a" * 64, key)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate("a" * 64 + "\n", key)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--api-key", "secret"], "only sends keys that start with 'tml-'"),
        (["--api-key", ""], "give --api-key"),
        (["--api-key", "tml-"], "--api-key: 0 characters after 'tml-', too short to be secret"),
        (["--api-key", "tml-local"], "5 characters after 'tml-', too short"),
    ],
)
def test_grail_tinker_refuses_a_key_the_sdk_cannot_send(
    argv: list[str],
    match: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from grail.tinker.cli import main

    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_info:  # a key let through fails on the model instead
        main([*argv, "--model", str(tmp_path / "no-model"), "--port", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_grail_tinker_serves_every_tiny_preset_by_name(name: str) -> None:
    """`--model tiny-wide` was taken for a directory of that name (only `tiny` was a preset)."""
    from grail.tinker.cli import _model_dir

    assert _model_dir(name) == ensure_tiny_model(name=name)


@pytest.mark.parametrize(
    ("host", "warned"),
    [("127.0.0.1", False), ("localhost", False), ("::1", False), ("0.0.0.0", True),
     ("::", True), ("10.1.2.3", True), ("myhost", True)],
)  # fmt: skip
def test_grail_tinker_warns_when_other_machines_can_reach_it(
    host: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from grail.tinker.cli import check_args, parse_args

    args = parse_args(["--host", host, "--api-key", "tml-" + "0" * 16])
    with caplog.at_level(logging.WARNING, logger="grail.tinker"):
        check_args(args)
    lines = [r.getMessage() for r in caplog.records if r.name == "grail.tinker"]
    assert lines == ([f"--host {host}: grail-tinker is reachable from other machines; anyone "
                      "who can reach port 8000 with the API key can train and sample "
                      "(--host 127.0.0.1 keeps it local)"] if warned else [])  # fmt: skip


def test_the_queue_is_bounded() -> None:
    """Past --max-pending requests queued or running, a request gets 429 (Busy), which the SDK
    backs off from and retries; nothing is queued for it."""
    core = bare_core()  # max_pending=4, workers not started: everything stays pending
    for _ in range(4):
        core.jobs.submit(lambda: Result(json={}), "s:train:0", "s")
    with pytest.raises(Busy, match="--max-pending") as refused:
        core.jobs.submit(lambda: Result(json={}), "s:train:0", "s")
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


def test_load_state_takes_a_checkpoint_of_the_clients_shape_whatever_its_seed(
    tmp_path: Path,
) -> None:
    """The seed only draws an adapter's first weights, which loading replaces: a client of
    another seed takes the checkpoint; one of another rank, or a checkpoint of another base
    model, is refused."""
    trainer = Trainer(
        load_model(ensure_tiny_model()), base_model="tiny", run_dir=tmp_path, max_context=64,
        max_clients=3,
    )  # fmt: skip
    saved = trainer.create("s:train:0", LoraSpec(rank=4, seed=0))
    directory = tmp_path / "state"
    trainer.save_state(saved.model_id, directory)
    other = trainer.create("s:train:1", LoraSpec(rank=4, seed=1))
    want = trainer.adapter_tensors(saved)
    assert any(not torch.equal(v, trainer.adapter_tensors(other)[k]) for k, v in want.items())
    trainer.load_state(other.model_id, directory, optimizer=True, create=False)
    got = trainer.adapter_tensors(other)
    assert all(torch.equal(v, got[k]) for k, v in want.items())

    wider = trainer.create("s:train:2", LoraSpec(rank=8, seed=0))
    with pytest.raises(UserFault, match="LoRA shape \\(rank 4"):
        trainer.load_state(wider.model_id, directory, optimizer=False, create=False)
    config = json.loads((directory / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "Qwen/Qwen3-8B"
    (directory / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserFault, match="trained on base model 'Qwen/Qwen3-8B'"):
        trainer.load_state(other.model_id, directory, optimizer=False, create=False)
