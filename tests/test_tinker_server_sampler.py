"""grail-tinker with a sampler server (`--sampler builtin|vllm|sglang`, grail/tinker/
server_sampler.py) in the place of the in-process engine:

- through the official SDK, `--sampler builtin` (a real grail-serve process fed each snapshot's
  merged weights through the disk route) samples what `--sampler engine` samples: the same tokens
  for the same seed, the same log-probabilities, for trained snapshots, the base model, stops and
  prompt log-probabilities; snapshots interleave; the sampler server goes when the server stops;
- against the vLLM / SGLang stand-ins (tests/helpers/fake_gpu_server.py, their real command
  lines): a snapshot reaches the server as a directory holding the merged weights, which the
  server reloads, and the SDK's stop settings are sent as the server takes them.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.fake_gpu_server import RELOAD_ROUTES, FakeSGLangServer, FakeVLLMServer, calls, info
from helpers.grail_process import alive, servers_of, wait_for
from helpers.tinker_server import (
    TinkerServer,
    no_session_left_open,  # noqa: F401 (autouse: a test leaving an SDK session open fails)
    sdk_service,
)
from safetensors.torch import load_file
from tinker import types

import grail.inference.backends as backends
from grail.inference.builtin.sampling import SamplingParams
from grail.models.loading import load_model, load_tokenizer
from grail.models.tiny import ensure_tiny_model
from grail.tinker.sampler import SampleJob, Sampler, Session, Snapshot
from grail.tinker.server_sampler import start_server_engine

TEXTS = ["one two three four five six seven eight nine ten", "hello world, hello tinker"]


def _samples(url: str, tokenizer: Any) -> dict[str, Any]:
    """One SFT step, then what a loop asks of its samplers, from the server at `url`."""
    with sdk_service(url) as service:
        client = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
            for ids in (tokenizer.encode(t) for t in TEXTS)
        ]
        client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        first = client.save_weights_and_get_sampling_client().result()
        # a second snapshot of another client, sampled between two samples of the first
        other = service.create_lora_training_client(base_model="tiny", rank=8, seed=5).result()
        other.forward_backward(data, "cross_entropy")
        other.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        second = other.save_weights_and_get_sampling_client().result()
        base = service.create_sampling_client(base_model="tiny").result()
        prompt = types.ModelInput.from_ints(tokenizer.encode("one two"))
        params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)

        def sample(sampler: Any, p: types.SamplingParams = params, n: int = 3) -> list[Any]:
            return list(sampler.sample(prompt, n, p).result().sequences)

        out = {
            "first": sample(first),
            "second": sample(second),
            "first again": sample(first),
            "base": sample(base),
            "no stop": sample(first, types.SamplingParams(max_tokens=5, seed=2, stop=[])),
            "stop token": sample(first, types.SamplingParams(max_tokens=8, seed=4, stop=[7, 9])),
        }
        full = prompt.to_ints() + out["first"][0].tokens
        out["prompt logprobs"] = first.compute_logprobs(types.ModelInput.from_ints(full)).result()
        return out


def test_a_sampler_server_samples_what_the_engine_samples_and_goes_with_its_server(
    tmp_path: Path,
) -> None:
    tokenizer = load_tokenizer(ensure_tiny_model())
    sampler_dir = tmp_path / "builtin" / "sampler"
    with (
        TinkerServer(tmp_path / "engine", tmp_path / "engine.log") as engine_server,
        TinkerServer(tmp_path / "builtin", tmp_path / "ours.log", "--sampler", "builtin") as ours,
    ):
        children = servers_of(sampler_dir / "model")
        assert children, "no sampler server process serves the run's sampler directory"
        engine = _samples(engine_server.url, tokenizer)
        builtin = _samples(ours.url, tokenizer)
    for key in ("first", "second", "first again", "base", "no stop", "stop token"):
        assert [s.tokens for s in builtin[key]] == [s.tokens for s in engine[key]], key
        assert [s.stop_reason for s in builtin[key]] == [s.stop_reason for s in engine[key]], key
        for mine, theirs in zip(builtin[key], engine[key], strict=True):
            np.testing.assert_allclose(mine.logprobs, theirs.logprobs, atol=1e-5, err_msg=key)
    # the snapshots were told apart, and the first came back after the second
    assert [s.tokens for s in builtin["first again"]] == [s.tokens for s in builtin["first"]]
    assert [s.tokens for s in builtin["second"]] != [s.tokens for s in builtin["first"]]
    # stop=[]: not even EOS stops a sample; stop token ids end it (the token stays)
    assert all(len(s.tokens) == 5 for s in builtin["no stop"])
    stopped = [s for s in builtin["stop token"] if s.stop_reason == "stop"]
    assert all(s.tokens[-1] in (7, 9, tokenizer.eos_token_id) for s in stopped)
    assert builtin["prompt logprobs"][0] is None and engine["prompt logprobs"][0] is None
    np.testing.assert_allclose(
        builtin["prompt logprobs"][1:], engine["prompt logprobs"][1:], atol=1e-5
    )
    # the sampler server stopped with grail-tinker, and left its log
    wait_for(
        lambda: not any(alive(pid) for pid in children),
        15,
        f"sampler server {children} to end with grail-tinker",
    )
    assert (sampler_dir / "logs" / "builtin-tinker-sampler.log").is_file()


@pytest.mark.parametrize(("kind", "fake"), [("vllm", FakeVLLMServer), ("sglang", FakeSGLangServer)])
def test_a_snapshot_reaches_a_gpu_server_as_merged_weights_it_reloads(
    kind: str, fake: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backends, "VLLMServer" if kind == "vllm" else "SGLangServer", fake)
    model_dir = ensure_tiny_model()
    directory = tmp_path / "sampler" / "model"
    engine = start_server_engine(
        kind,
        model_dir,
        directory,
        load=lambda: load_model(model_dir),
        trainer_device="cpu",
        server_device="cuda:0",  # the stand-in only reads the flag
        dtype="float32",
        weight_transfer="disk",
        start_timeout=30.0,
    )
    try:
        base = load_model(model_dir)
        # the served checkpoint has its own output layer (untied), equal to the embedding
        served = load_file(str(directory / "model.safetensors"))
        assert torch.equal(served["lm_head.weight"], served["model.embed_tokens.weight"])

        module = "model.layers.1.self_attn.q_proj"
        a, b = torch.randn(2, 64), torch.randn(64, 2)
        tensors = {
            f"base_model.model.{module}.lora_A.weight": a,
            f"base_model.model.{module}.lora_B.weight": b,
        }
        sampler = Sampler(engine, "tiny", lambda *_: None)
        key = sampler.add_ephemeral(Snapshot(tensors, 16.0))
        params = SamplingParams(max_tokens=3, stop_token_ids=(7,), ignore_eos=True)
        job = SampleJob(Session("tiny", None, key), [1, 2, 3], params, 2, 5, False, None)
        (answer,) = sampler.run([job])
        assert isinstance(answer, bytes), answer

        # the server reloaded the directory, which holds W + 16 B A for the layer, W elsewhere,
        # in the server's dtype (bfloat16)
        reloads = [c for c in calls(engine.server) if c["path"] in RELOAD_ROUTES]
        assert len(reloads) == 1 and str(directory) in str(reloads[0])
        served = load_file(str(directory / "model.safetensors"))
        merged = base.get_parameter(f"{module}.weight") + 16.0 * b @ a
        assert torch.equal(served[f"{module}.weight"], merged.to(torch.bfloat16))
        other = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(served[other], base.get_parameter(other).to(torch.bfloat16))

        # the request: token ids in, both seeds, the SDK's stops as the server takes them
        (request,) = [c["body"] for c in calls(engine.server) if c["path"] == "/v1/completions"]
        assert request["prompt"] == [1, 2, 3] and request["n"] == 2 and request["seed"] == 5
        assert request["stop_token_ids"] == [7] and request["ignore_eos"] is True

        # a sampler server that died is restarted on the weights it served, and samples again
        dead = engine.server.pid
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        wait_for(lambda: not engine.server.is_alive(), 10, "the killed server to be gone")
        (answer,) = sampler.run([job])
        assert isinstance(answer, bytes), answer
        assert engine.server.recoveries == 1 and engine.server.pid != dead
        assert str(directory) in " ".join(info(engine.server)["argv"])
    finally:
        engine.stop()
    assert not engine.server.is_alive()
