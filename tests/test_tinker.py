"""grail-tinker driven by the official `tinker` SDK (the pinned version in pyproject), against a
real `grail-tinker` process on the tiny model, on CPU: one server for the module.

- the losses equal their documented formulas computed directly on the same datums;
- a supervised cross_entropy loop drives the loss down and writes one metrics record per step;
- save_state, then load_state (with the optimizer) in a new client continues exactly;
- sampling: seeds, num_samples, max_tokens, stop; its logprobs are the trainer's;
- checkpoints listed and deleted through the RestClient;
- every bad input gets its clear exception at once (API key, model, model_id, context, NaN,
  loss, body size, a request_id this server start never issued);
- every test closes the SDK sessions it opens (`no_session_left_open` checks).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from helpers.tinker_server import (
    API_KEY,
    TinkerServer,
    close_service,
    no_session_left_open,  # noqa: F401 (autouse: a test leaving an SDK session open fails)
    sdk_service,
)
from tinker import types
from transformers import AutoModelForCausalLM

from grail.core.records import metric_records, read_metrics, validate_metrics
from grail.envs.base import Problem, Score
from grail.envs.copy_digits import CopyDigitsEnv
from grail.models.loading import load_tokenizer
from grail.models.tiny import ensure_tiny_model

MAX_REQUEST_BYTES = 2_000_000
TEXTS = [
    "the cat sat on the mat and the cat sat on the mat",
    "one two three four five six seven eight nine ten",
    "hello world, hello grail, hello tinker",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    root = tmp_path_factory.mktemp("tinker")
    extra = ("--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-training-clients", "16")
    with TinkerServer(root / "run", root / "server.log", *extra) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: TinkerServer) -> Iterator[tinker.ServiceClient]:
    with sdk_service(server.url) as client:
        # its session (and heartbeat) now, before the first test's no_session_left_open looks
        client.create_sampling_client(base_model="tiny").result()
        yield client


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(ensure_tiny_model())


@pytest.fixture(scope="module")
def base_model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32).eval()


def sft_datum(tokenizer: Any, text: str, prompt_tokens: int = 3) -> types.Datum:
    ids = tokenizer.encode(text)
    weights = [0.0] * (prompt_tokens - 1) + [1.0] * (len(ids) - prompt_tokens)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
    )


def direct_logprobs(model: torch.nn.Module, datum: types.Datum) -> torch.Tensor:
    """log softmax(logits_t)[target_t] of the base model, one unpadded row."""
    ids = torch.tensor([datum.model_input.to_ints()])
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def test_losses_equal_their_formulas(
    service: tinker.ServiceClient, tokenizer: Any, base_model: torch.nn.Module
) -> None:
    """A fresh adapter is the base model (LoRA's B starts at 0), so the server's losses must be
    the formulas of grail/tinker/losses.py over the base model's log-probabilities."""
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    sft = [sft_datum(tokenizer, t) for t in TEXTS]
    out = client.forward(sft, "cross_entropy").result()
    expected = 0.0
    for datum, got in zip(sft, out.loss_fn_outputs, strict=True):
        logp = direct_logprobs(base_model, datum)
        weights = torch.tensor(datum.loss_fn_inputs["weights"].data)
        np.testing.assert_allclose(got["logprobs"].data, logp.numpy(), rtol=1e-4, atol=1e-5)
        expected += float((-weights * logp).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)

    # importance_sampling and ppo: sampler logprobs q off from logp so that ppo clips both ways
    rng = np.random.default_rng(0)
    rl, direct = [], []
    for datum in sft:
        logp = direct_logprobs(base_model, datum)
        q = logp + torch.from_numpy(rng.uniform(-0.5, 0.5, len(logp)).astype(np.float32))
        adv = torch.from_numpy(rng.normal(size=len(logp)).astype(np.float32))
        rl.append(
            types.Datum(
                model_input=datum.model_input,
                loss_fn_inputs={
                    "target_tokens": datum.loss_fn_inputs["target_tokens"],
                    "logprobs": q.numpy(),
                    "advantages": adv.numpy(),
                },
            )
        )
        direct.append((logp, q, adv))
    is_loss = client.forward(rl, "importance_sampling").result().metrics["loss:sum"]
    ratio = [torch.exp(logp - q) for logp, q, _ in direct]
    assert is_loss == pytest.approx(
        sum(float((-r * a).sum()) for r, (_, _, a) in zip(ratio, direct, strict=True)), rel=1e-4
    )
    for lo, hi in ((0.8, 1.2), (0.9, 1.05)):
        config = {"clip_low_threshold": lo, "clip_high_threshold": hi}
        ppo = client.forward(rl, "ppo", config).result().metrics["loss:sum"]
        want = sum(
            float(-torch.minimum(r * a, torch.clamp(r, lo, hi) * a).sum())
            for r, (_, _, a) in zip(ratio, direct, strict=True)
        )
        assert ppo == pytest.approx(want, rel=1e-4)
        cispo = client.forward(rl, "cispo", config).result().metrics["loss:sum"]
        want = sum(
            float((-torch.clamp(r, lo, hi) * logp * a).sum())
            for r, (logp, _, a) in zip(ratio, direct, strict=True)
        )
        assert cispo == pytest.approx(want, rel=1e-4)
    dro = client.forward(rl, "dro", {"beta": 0.3}).result().metrics["loss:sum"]
    want = sum(float(-(logp * a - 0.15 * (logp - q) ** 2).sum()) for logp, q, a in direct)
    assert dro == pytest.approx(want, rel=1e-4)


def test_supervised_loop_lowers_the_loss_and_writes_records(
    service: tinker.ServiceClient, tokenizer: Any, server: TinkerServer
) -> None:
    client = service.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    data = [sft_datum(tokenizer, t) for t in TEXTS]
    losses = []
    for _ in range(10):
        fb = client.forward_backward(data, "cross_entropy")
        step = client.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fb.result().metrics["loss:sum"])
        assert step.result().metrics["grad_norm:mean"] > 0
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.6 * losses[0], losses
    run_dir = server.run_dir / "runs" / client.model_id.replace(":", "-")
    records = metric_records(run_dir, "train")
    assert [r["iteration"] for r in records] == list(range(10))
    for record, loss in zip(records, losses, strict=True):
        validate_metrics(record, "train_iteration")
        assert record["loss_total"] == pytest.approx(loss)
        assert record["lr"] == pytest.approx(5e-3)


def test_save_then_load_state_continues_exactly(
    service: tinker.ServiceClient, tokenizer: Any
) -> None:
    data = [sft_datum(tokenizer, t) for t in TEXTS]
    adam = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0)

    def step(client: tinker.TrainingClient) -> float:
        loss = client.forward_backward(data, "cross_entropy")
        client.optim_step(adam).result()
        return float(loss.result().metrics["loss:sum"])

    first = service.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    for _ in range(2):
        step(first)
    path = first.save_state("resume-me").result().path
    after_save = [step(first), step(first)]
    next_loss = first.forward(data, "cross_entropy").result().metrics["loss:sum"]

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert [step(resumed), step(resumed)] == after_save
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == next_loss

    # weights only: the same first loss, then a fresh optimizer takes another path
    weights_only = service.create_training_client_from_state(path).result()
    assert step(weights_only) == after_save[0]
    assert step(weights_only) != after_save[1]


def test_sampling(service: tinker.ServiceClient, tokenizer: Any, server: TinkerServer) -> None:
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    data = [sft_datum(tokenizer, t) for t in TEXTS]
    client.forward_backward(data, "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("one two"))
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0, top_p=0.95, top_k=50)
    first = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(first.sequences) == 3
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert all(1 <= len(s.tokens) <= 6 for s in first.sequences)

    # the sampler's logprobs are the trained policy's (the trainer's, on the same tokens)
    seq = first.sequences[0]
    full = prompt.to_ints() + seq.tokens
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
    )
    trained = client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    tail = trained.data[-len(seq.tokens) :]
    np.testing.assert_allclose(seq.logprobs, tail, atol=2e-4)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], trained.data, atol=2e-4)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(full), 2).result()
    assert last[:-2] == [None] * (len(full) - 2) and last[-2:] == scored[-2:]
    too_long = types.SamplingParams(max_tokens=1024)  # the prompt + 1024 > the context
    quick(
        lambda: sampler.sample(prompt, 1, too_long).result(),
        tinker.BadRequestError,
        "over the model's context",
    )

    # a stop string ends the sample (its tokens stay); greedy is deterministic without a seed
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    text = tokenizer.decode(sampler.sample(prompt, 1, greedy).result().sequences[0].tokens)
    stop_at = text.strip()[:1]
    if stop_at:
        stopped = sampler.sample(
            prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop_at])
        ).result()
        assert stopped.sequences[0].stop_reason == "stop"

    # named sampler weights: a sampling client from the path; listed and deleted (RestClient)
    path = client.save_weights_for_sampler("snap").result().path
    named = service.create_sampling_client(model_path=path).result()
    assert [s.tokens for s in named.sample(prompt, 3, params).result().sequences] == [
        s.tokens for s in first.sequences
    ]
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    ids = [c.checkpoint_id for c in rest.list_checkpoints(client.model_id).result().checkpoints]
    assert ids == ["sampler_weights/snap"]
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)
    run = rest.get_training_run(client.model_id).result()
    assert (run.training_run_id, run.lora_rank) == (client.model_id, 4)
    listed = rest.list_training_runs(limit=100).result()
    assert client.model_id in [r.training_run_id for r in listed.training_runs]
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(client.model_id).result().checkpoints == []

    # the base model: a sampling client by name
    base = service.create_sampling_client(base_model="tiny").result()
    assert len(base.sample(prompt, 2, params).result().sequences) == 2


def quick(call: Callable[[], object], error: type[Exception], match: str) -> None:
    """`call` raises `error` whose text holds `match`, at once (no retry loop, no hang)."""
    start = time.monotonic()
    with pytest.raises(error, match=match):
        call()
    assert time.monotonic() - start < 10


def test_bad_inputs_get_clear_errors(
    service: tinker.ServiceClient, server: TinkerServer, tokenizer: Any
) -> None:
    with sdk_service(server.url, api_key="tml-wrong") as wrong:
        quick(
            lambda: wrong.create_lora_training_client("tiny").result(),
            tinker.AuthenticationError,
            "invalid or missing API key",
        )
    # ids restarted at req-1 on every start: an old client's future got a new client's result
    polled = httpx.post(
        f"{server.url}/api/v1/retrieve_future", json={"request_id": "req-1"},
        headers={"X-API-Key": API_KEY}, timeout=10,
    )  # fmt: skip
    assert polled.status_code == 404 and "not issued by this server" in polled.text
    quick(
        lambda: service.create_lora_training_client(base_model="Qwen/Qwen3-8B").result(),
        tinker.NotFoundError,
        "is not served here",
    )
    client = service.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    good = sft_datum(tokenizer, TEXTS[0])
    long_ids = [1] * 1025  # the tiny model's context is 1024
    too_long = types.Datum(
        model_input=types.ModelInput.from_ints(long_ids),
        loss_fn_inputs={"target_tokens": long_ids, "weights": [1.0] * len(long_ids)},
    )
    quick(
        lambda: client.forward_backward([too_long], "cross_entropy").result(),
        tinker.BadRequestError,
        "longer than the model's context",
    )
    nan = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={
            "target_tokens": good.loss_fn_inputs["target_tokens"],
            "logprobs": [0.0] * good.model_input.length,
            "advantages": [math.nan] + [1.0] * (good.model_input.length - 1),
        },
    )
    quick(
        lambda: client.forward_backward([nan], "importance_sampling").result(),
        tinker.BadRequestError,
        "NaN or inf",
    )
    # finite inputs, infinite loss: found while the job runs, so it fails through the future
    overflow = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={
            "target_tokens": good.loss_fn_inputs["target_tokens"],
            "logprobs": [-1e30] * good.model_input.length,
            "advantages": [1.0] * good.model_input.length,
        },
    )
    quick(
        lambda: client.forward_backward([overflow], "importance_sampling").result(),
        tinker.RequestFailedError,
        "accumulated since the last optim_step was dropped",
    )
    quick(
        lambda: client.forward_backward([good], "gspo").result(),
        tinker.BadRequestError,
        "not supported",
    )
    quick(
        lambda: client.forward_backward([good], "dro").result(),
        tinker.BadRequestError,
        "dro needs loss_fn_config",
    )
    quick(
        lambda: client.forward_backward([good], "ppo", {"clip_eps": 0.2}).result(),
        tinker.BadRequestError,
        "clip_eps",
    )
    # 150 datums of 1000 tokens: 16 bytes a token on the wire (int32 input, int64 target,
    # float32 weight), 2.4 MB in one chunk of the SDK's
    ids = [5] * 1000
    huge = [
        types.Datum(
            model_input=types.ModelInput.from_ints(ids),
            loss_fn_inputs={"target_tokens": ids, "weights": [1.0] * 1000},
        )
        for _ in range(150)
    ]
    quick(
        lambda: client.forward_backward(huge, "cross_entropy").result(),
        tinker.APIStatusError,
        "over this server's limit",
    )
    quick(
        lambda: service.create_training_client_from_state(
            "tinker://nobody:train:0/weights/x"
        ).result(),
        tinker.NotFoundError,
        "no checkpoint",
    )
    client.model_id = "session-nobody:train:9"  # an id the server never issued
    quick(
        lambda: client.forward_backward([good], "cross_entropy").result(),
        tinker.NotFoundError,
        "unknown model_id",
    )


def test_the_docs_example_runs(
    server: TinkerServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/tinker.md's quick start, as written but for the port and key of this server."""
    text = (Path(__file__).parents[1] / "docs" / "tinker.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'tinker.ServiceClient(base_url="http://127.0.0.1:8000")' in code
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)  # the key its shell exports
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    try:
        exec(compile(code.replace("http://127.0.0.1:8000", server.url), "docs/tinker.md", "exec"),
             namespace)  # fmt: skip
    finally:
        if isinstance(namespace.get("service"), tinker.ServiceClient):
            close_service(namespace["service"])  # a no-op after the example's own close
    lines = capsys.readouterr().out.splitlines()
    losses = [float(line.split()[1]) for line in lines[:5]]
    assert losses == sorted(losses, reverse=True), lines


@pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")  # peft on the tiny tied model
def test_custom_loss_and_peft_load(
    service: tinker.ServiceClient, tokenizer: Any, server: TinkerServer, base_model: torch.nn.Module
) -> None:
    """forward_backward_custom (the SDK runs the loss, the server a cross_entropy backward), and
    a saved state loaded by peft gives the server's log-probabilities."""
    from peft import PeftModel

    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    data = [sft_datum(tokenizer, t) for t in TEXTS]

    def mean_nll(
        batch: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum(-lp.mean() for lp in logprobs)
        return loss, {"mean_nll": float(loss.detach())}

    out = client.forward_backward_custom(data, mean_nll).result()
    assert out.metrics["mean_nll"] == pytest.approx(out.metrics["loss:sum"])
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = client.save_state("for-peft").result().path
    served = client.forward(data[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    directory = server.run_dir / "runs" / path.removeprefix("tinker://").replace(":", "-")
    directory = directory.parent.parent / "checkpoints" / "weights" / "for-peft"
    fresh = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(fresh, directory).eval()
    np.testing.assert_allclose(
        direct_logprobs(peft_model, data[0]).numpy(), served.data, rtol=1e-4, atol=1e-5
    )


def test_the_rl_example_runs_on_policy(server: TinkerServer) -> None:
    """examples/tinker_rl_copy_digits.py for two small iterations: sample groups, score, centre,
    importance_sampling. The sampler serves the learner's policy: the records' logprob_mismatch
    (mean |logp - q| over the sampled tokens) is float rounding. Its learning numbers, from a
    warm base, are in docs/tinker.md."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    import tinker_rl_copy_digits as example

    class AnyReward(CopyDigitsEnv):
        """copy_digits' prompts, a reward every completion gets (its length in characters, mod
        3): the random tiny model almost never copies the digit, and a group of equal rewards
        gives no step to check."""

        def score(self, problem: Problem, completion: str) -> Score:
            return Score(len(completion) % 3 / 2, {}, False)

    args = example.parse_args([])
    args.iterations, args.problems, args.group, args.eval_every = 2, 4, 8, 2
    args.eval_problems, args.eval_replicates, args.api_key = 4, 2, API_KEY
    before = set((server.run_dir / "runs").iterdir())
    example.run(args, server.url, AnyReward())
    (run_dir,) = set((server.run_dir / "runs").iterdir()) - before
    records = metric_records(run_dir, "train")
    assert len(records) == 2
    for record in records:
        assert record["tinker"]["loss_fns"] == ["importance_sampling"]
        assert record["logprob_mismatch"] < 1e-4


def test_training_clients_do_not_touch_each_other(
    service: tinker.ServiceClient, tokenizer: Any
) -> None:
    """Two clients stepping in turn (each its own adapter and optimizer over one base model)
    get, bit for bit, the losses a client with the same seed and data gets alone."""
    data_a = [sft_datum(tokenizer, t) for t in TEXTS[:2]]
    data_b = [sft_datum(tokenizer, TEXTS[2])]
    adam = types.AdamParams(learning_rate=1e-2)

    def step(client: tinker.TrainingClient, data: list[types.Datum]) -> float:
        loss = client.forward_backward(data, "cross_entropy")
        client.optim_step(adam)
        return float(loss.result().metrics["loss:sum"])

    a = service.create_lora_training_client(base_model="tiny", rank=4, seed=21).result()
    b = service.create_lora_training_client(
        base_model="tiny", rank=8, seed=22, train_mlp=False
    ).result()
    interleaved = []
    for _ in range(3):
        interleaved.append(step(a, data_a))
        step(b, data_b)
    alone = service.create_lora_training_client(base_model="tiny", rank=4, seed=21).result()
    assert [step(alone, data_a) for _ in range(3)] == interleaved


@pytest.mark.learning
def test_an_rl_loop_through_the_sdk_improves_held_out_success(
    warm_base: Path, tmp_path: Path
) -> None:
    """examples/tinker_rl_copy_digits.py, unchanged, on copy_digits over a base that knows its
    tokens (`warm_base`; from the random tiny model LoRA cannot learn: docs/lora.md): sample
    groups, score, centre, importance_sampling. Held-out success rises: 0.312 -> 0.664 at 16
    with --seed 1 (seeded requests, kernels pinned by grail-tinker's --reproducible: the same on
    every x86-64 CPU with AVX2; seeds 0 and 2 give 0.398 -> 0.375 and 0.371 -> 0.664 at 16,
    0.891 and 0.652 at 32: docs/tinker.md)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    import tinker_rl_copy_digits as example

    args = example.parse_args([])
    args.iterations, args.eval_every, args.api_key, args.seed = 16, 16, API_KEY, 1
    with TinkerServer(tmp_path / "run", tmp_path / "server.log", "--model", str(warm_base)) as srv:
        curve = example.run(args, srv.url)
    (first_it, first), (last_it, last) = curve
    assert "CPU kernels AVX2 (pinned: --reproducible)" in (tmp_path / "server.log").read_text()
    assert (first_it, last_it) == (0, 16)
    assert last >= first + 0.15, curve


def test_ended_runs_are_done_for_grail_report(tmp_path: Path, tokenizer: Any) -> None:
    """A client whose session closed, and one still loaded when the server stops, each leave a
    summary.json in grail-train's shape: grail-report lists both runs as done, not incomplete.
    A client that never stepped leaves no run directory."""
    import csv

    from grail.report.cli import main as grail_report

    datum = sft_datum(tokenizer, TEXTS[0])
    adam = types.AdamParams(learning_rate=1e-3)
    ids: list[str] = []
    services: list[tinker.ServiceClient] = []
    try:
        with TinkerServer(tmp_path / "run", tmp_path / "server.log") as server:
            for steps in (2, 1):
                service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
                services.append(service)
                client = service.create_lora_training_client(base_model="tiny", rank=4).result()
                service.create_lora_training_client(base_model="tiny", rank=4).result()  # idle
                for _ in range(steps):
                    client.forward_backward([datum], "cross_entropy")
                    client.optim_step(adam).result()
                ids.append(client.model_id.replace(":", "-"))
                if steps == 2:
                    close_service(service)  # the other session stays open
            runs = server.run_dir / "runs"
            closed = runs / ids[0] / "summary.json"
            deadline = time.monotonic() + 30
            while not closed.exists() and time.monotonic() < deadline:  # unloaded as a job
                time.sleep(0.05)
            assert not (runs / ids[1] / "summary.json").exists()  # still loaded
    finally:
        # The open session's heartbeats would go on failing against the stopped server (and
        # warn into later tests); its finish request, retried against nobody, is cut short.
        for service in services:
            close_service(service, "interrupted", timeout=2.0)
    assert sorted(p.name for p in runs.iterdir()) == sorted(ids)  # the idle ones left nothing
    summaries = {i: read_metrics(runs / i / "summary.json") for i in ids}
    assert [summaries[i]["tinker"]["ended"] for i in ids] == ["session finished", "server stopped"]
    assert [summaries[i]["iterations"] for i in ids] == [2, 1]
    assert all(s["status"] == "completed" and s["wall_time_s"] > 0 for s in summaries.values())

    assert grail_report([str(runs), "--out", str(tmp_path / "report")]) == 0
    with open(tmp_path / "report" / "summary.csv") as f:
        rows = {row["run"]: row for row in csv.DictReader(f)}
    assert {name: row["status"] for name, row in rows.items()} == dict.fromkeys(ids, "done")
