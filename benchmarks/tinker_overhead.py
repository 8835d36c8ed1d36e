"""What the Tinker protocol costs: one training-and-sampling round through the official `tinker`
SDK against a `grail-tinker` process, against the same work on grail's trainer and sampler called
directly (grail/tinker/trainer.py and sampler.py in this process, no HTTP, no futures).

    uv run python benchmarks/tinker_overhead.py                     # both shapes, 10 rounds each
    uv run python benchmarks/tinker_overhead.py --rounds 20 --threads 2
    uv run python benchmarks/tinker_overhead.py --sampler builtin   # a grail-serve sampler server

A round is forward_backward (importance_sampling) + optim_step + a snapshot for the sampler +
sampling, on the tiny model, CPU. Shapes:

- `rl`: the default job's iteration: 64 copy_digits prompts x 16 samples of at most 2 tokens
  (64 sample requests in flight, as an RL loop sends them), and a forward/backward over the 1024
  sampled sequences;
- `call`: one datum, one sample request of 1 sample: the per-call overhead alone.

Both sides use `--threads` torch threads (the server's `--threads`, this process's
`torch.set_num_threads` for the direct side) and take turns, round by round. Medians [min-max] of
the round's wall time. `--sampler` is the server's (`grail-tinker --sampler`: a sampler server
pays a weight sync per round, the direct side's engine a copy in memory); results go to
benchmarks/results/tinker_overhead.json (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from client_overhead import default_prompts  # noqa: E402
from common import print_table, spread, write_results  # noqa: E402

from grail.inference.builtin.sampling import SamplingParams  # noqa: E402
from grail.models.loading import load_model  # noqa: E402
from grail.models.tiny import ensure_tiny_model  # noqa: E402
from grail.tinker import wire  # noqa: E402
from grail.tinker.checkpoints import Checkpoints  # noqa: E402
from grail.tinker.sampler import SampleJob, Sampler, Session, Snapshot, engine_for  # noqa: E402
from grail.tinker.trainer import LORA_ALPHA, AdamStep, LoraSpec, Trainer  # noqa: E402

SHAPES = {"rl": (64, 16, 2), "call": (1, 1, 2)}  # prompts, samples per prompt, max_tokens
RANK, LR = 8, 1e-3


def datums(prompts: list[list[int]], n: int, max_tokens: int) -> list[wire.Datum]:
    """Each prompt with `n` made-up completions of `max_tokens` tokens: what a round trains on."""
    rng = np.random.default_rng(0)
    out = []
    for ids in prompts:
        for _ in range(n):
            tokens = ids + rng.integers(3, 500, max_tokens).tolist()
            k = len(tokens) - 1
            inputs = {
                "target_tokens": wire.Tensor(np.array(tokens[1:], dtype=np.int64), [k]),
                "logprobs": wire.Tensor(np.full(k, -6.0, dtype=np.float32), [k]),
                "advantages": wire.Tensor(rng.normal(size=k).astype(np.float32) / k, [k]),
            }
            out.append(wire.Datum(tokens[:-1], inputs))
    return out


def direct_round(
    model_dir: Path, shape: str, run_dir: Path
) -> tuple[Callable[[], None], Callable[[], None]]:
    """One round in this process, and what stops its sampler's engine (a thread) afterwards."""
    prompts_n, n, max_tokens = SHAPES[shape]
    prompts = default_prompts(model_dir, prompts_n)
    data = datums(prompts, n, max_tokens)
    model = load_model(model_dir)
    context = int(model.config.max_position_embeddings)
    trainer = Trainer(model, base_model="tiny", run_dir=run_dir, max_context=context, max_clients=1)
    run = trainer.create("direct:train:0", LoraSpec(rank=RANK, seed=0))
    sampler = Sampler(engine_for(model_dir, "cpu", context), "tiny", Checkpoints(run_dir).resolve)
    adam = AdamStep(LR, 0.9, 0.95, 1e-12, 0.0, 0.0)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0)

    def one() -> None:
        trainer.forward_backward(run.model_id, data, "importance_sampling", {}, False)
        trainer.optim_step(run.model_id, adam)
        key = sampler.add_ephemeral(Snapshot(trainer.adapter_tensors(run), LORA_ALPHA / RANK))
        session = Session("tiny", None, key)
        jobs = [SampleJob(session, p, params, n, None, False, None) for p in prompts]
        for result in sampler.run(jobs):
            assert isinstance(result, bytes), result

    return one, sampler.engine.stop


def sdk_round(service: Any, model_dir: Path, shape: str) -> Callable[[], None]:
    """One round through `service` (a tinker.ServiceClient)."""
    from tinker import types

    prompts_n, n, max_tokens = SHAPES[shape]
    prompts = default_prompts(model_dir, prompts_n)
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(d.tokens),
            loss_fn_inputs={k: t.values for k, t in d.inputs.items()},
        )
        for d in datums(prompts, n, max_tokens)
    ]
    client = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=0).result()
    adam = types.AdamParams(learning_rate=LR)
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    inputs = [types.ModelInput.from_ints(p) for p in prompts]

    def one() -> None:
        fb = client.forward_backward(data, "importance_sampling")
        step = client.optim_step(adam)
        sampler = client.save_weights_and_get_sampling_client().result()
        futures = [sampler.sample(p, n, params) for p in inputs]
        fb.result(), step.result()
        for future in futures:
            future.result()

    return one


def timed(sides: list[Callable[[], None]], rounds: int, warmup: int = 2) -> list[list[float]]:
    """Seconds of each side's round, the sides taking turns round by round (so that a change
    in the machine's load meanwhile falls on both alike), after `warmup` untimed rounds each."""
    for _ in range(warmup):
        for one in sides:
            one()
    seconds: list[list[float]] = [[] for _ in sides]
    for _ in range(rounds):
        for one, out in zip(sides, seconds, strict=True):
            start = time.perf_counter()
            one()
            out.append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds of each side first")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--sampler", default="engine", choices=["engine", "builtin"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.tinker_server import TinkerServer, sdk_service

    torch.set_num_threads(args.threads)
    model_dir = ensure_tiny_model()
    results: dict[str, Any] = {
        "threads": args.threads, "rounds": args.rounds, "sampler": args.sampler, "shapes": {},
    }  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            one, stop = direct_round(model_dir, shape, Path(tmp) / f"direct-{shape}")
            log = Path(tmp) / f"server-{shape}.log"
            extra = ("--threads", str(args.threads), "--sampler", args.sampler)
            try:
                # the session closed before its server stops: its heartbeats would fail on
                with (
                    TinkerServer(Path(tmp) / f"sdk-{shape}", log, *extra) as server,
                    sdk_service(server.url) as service,
                ):
                    sdk_one = sdk_round(service, model_dir, shape)
                    direct, sdk = timed([one, sdk_one], args.rounds, args.warmup)
            finally:
                stop()
            d, s = spread(direct), spread(sdk)
            overhead = s["median"] / d["median"] - 1
            results["shapes"][shape] = {"direct_s": d, "sdk_s": s, "overhead": overhead}
            rows.append([
                shape, f"{d['median']:.3f} [{d['min']:.3f}-{d['max']:.3f}]",
                f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]", f"{overhead:+.0%}",
            ])  # fmt: skip
    title = f"one round, seconds (grail-tinker --sampler {args.sampler})"
    print_table(title, ["shape", "direct", "through the SDK", "overhead"], rows)
    write_results("tinker_overhead", results, args.out)


if __name__ == "__main__":
    main()
