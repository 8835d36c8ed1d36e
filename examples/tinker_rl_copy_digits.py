"""An RL loop written against the official `tinker` SDK, run on grail (`grail-tinker`): GRPO-style
policy gradient on copy_digits, on CPU.

    uv run grail-train train.iterations=80 eval.enabled=false hydra.run.dir=outputs/warm80
    uv run python examples/tinker_rl_copy_digits.py --model outputs/warm80/checkpoints/iter_079

The first line makes the base: the tiny model is random-initialised, and under LoRA its frozen
random embeddings and norms keep its logits near uniform, so LoRA alone cannot teach it the task
(docs/lora.md); 80 iterations of the default job (full fine-tuning) give a base that knows its
tokens (held-out success ~0.09). The second starts `grail-tinker --model BASE` itself (or give
`--base-url` and `--api-key` of a running one) and trains a LoRA adapter over it through the SDK.

Each iteration: save the weights for the sampler, sample a group of completions per problem,
score them (grail/envs/copy_digits.py), centre the rewards within each group, and take one
`importance_sampling` step on the sampled tokens (their sampling log-probabilities as `logprobs`,
the centred reward as every completion token's advantage). Every `--eval-every` iterations the
held-out success rate (seeds the training never sees, `--eval-replicates` samples each) is
printed; nothing here is grail-specific but the environment and the base model's name.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")  # the SDK would send telemetry to base_url

import numpy as np  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from grail.envs.base import Environment  # noqa: E402
from grail.envs.copy_digits import CopyDigitsEnv  # noqa: E402

EVAL_SEED_BASE = 1_000_000  # held-out problems: never drawn for training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running grail-tinker (default: start one)")
    p.add_argument("--model", default="tiny", help="grail-tinker --model, when starting one")
    p.add_argument(
        "--api-key",
        default=os.environ.get("TINKER_API_KEY"),
        help="the key of the server at --base-url (default $TINKER_API_KEY); a server started "
        "here gets a random one",
    )
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--problems", type=int, default=32, help="problems per iteration")
    p.add_argument("--group", type=int, default=16, help="samples per problem")
    p.add_argument("--max-tokens", type=int, default=2, help="the digit and a stop")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-problems", type=int, default=64)
    p.add_argument("--eval-replicates", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def start_server(api_key: str, model: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run_dir = Path(tempfile.mkdtemp(prefix="grail-tinker-rl-"))
    command = [
        sys.executable, "-m", "grail.tinker.cli", "--model", model, "--port", str(port),
        "--api-key", api_key, "--run-dir", str(run_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"grail-tinker exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return proc, url, run_dir
        except httpx.TransportError:
            time.sleep(0.2)
    proc.terminate()
    raise TimeoutError("grail-tinker did not start within 120 s")


def prompt_tokens(tokenizer, env: Environment, seed: int) -> tuple[object, list[int]]:  # type: ignore[no-untyped-def]
    problem = env.problem(seed)
    text = tokenizer.apply_chat_template(
        problem.prompt_messages, tokenize=False, add_generation_prompt=True
    )
    return problem, tokenizer.encode(text, add_special_tokens=False)


def success_rate(sampler, tokenizer, env, args) -> float:  # type: ignore[no-untyped-def]
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed)
    futures = []
    for i in range(args.eval_problems):
        problem, ids = prompt_tokens(tokenizer, env, EVAL_SEED_BASE + i)
        prompt = types.ModelInput.from_ints(ids)
        futures.append((problem, sampler.sample(prompt, args.eval_replicates, params)))
    wins = []
    for problem, future in futures:
        for seq in future.result().sequences:
            wins.append(env.score(problem, tokenizer.decode(seq.tokens)).success)
    return float(np.mean(wins))


def main() -> None:
    args = parse_args()
    proc = None
    url = args.base_url
    if url is None:
        args.api_key = f"tml-{secrets.token_hex(16)}"  # grail-tinker refuses guessable keys
        proc, url, run_dir = start_server(args.api_key, args.model)
    elif not args.api_key:
        sys.exit("give --api-key (or set TINKER_API_KEY) for the server at --base-url")
    try:
        run(args, url)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(15)
            # the server's records and checkpoints stay: the run as grail-report sees it
            print(f"the server's run directory: uv run grail-report {run_dir}/runs", flush=True)


def run(
    args: argparse.Namespace, url: str, env: Environment | None = None
) -> list[tuple[int, float]]:
    """The loop against the grail-tinker at `url`; the held-out success by iteration."""
    env = env or CopyDigitsEnv()
    rest = tinker.RestClient(base_url=url, api_key=args.api_key)
    base_model = rest.get_server_capabilities().result().supported_models[0].model_name
    assert base_model is not None
    with tinker.ServiceClient(base_url=url, api_key=args.api_key) as service:
        trainer = service.create_lora_training_client(
            base_model=base_model, rank=args.rank, seed=args.seed
        ).result()
        tokenizer = trainer.get_tokenizer()
        adam = types.AdamParams(learning_rate=args.lr, beta2=0.99)
        start = time.monotonic()
        curve = []
        for it in range(args.iterations + 1):
            sampler = trainer.save_weights_and_get_sampling_client().result()
            if it % args.eval_every == 0:
                curve.append((it, success_rate(sampler, tokenizer, env, args)))
                print(f"iteration {it:3d}  held-out success {curve[-1][1]:.3f}  "
                      f"({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
            if it == args.iterations:
                break
            groups = []
            for k in range(args.problems):
                seed = it * args.problems + k
                problem, ids = prompt_tokens(tokenizer, env, seed)
                prompt = types.ModelInput.from_ints(ids)
                # A seed per request: the same --seed gives the same samples, so the same curve
                # (grail-tinker's kernels are pinned: --reproducible), whatever the batching.
                params = types.SamplingParams(
                    max_tokens=args.max_tokens, temperature=1.0, seed=args.seed * 1_000_003 + seed
                )
                groups.append((problem, ids, sampler.sample(prompt, args.group, params)))
            data, rewards = [], []
            for problem, ids, future in groups:
                seqs = future.result().sequences
                scores = [env.score(problem, tokenizer.decode(s.tokens)).reward for s in seqs]
                rewards.extend(scores)
                mean = float(np.mean(scores))
                for seq, reward in zip(seqs, scores, strict=True):
                    if reward == mean:  # no signal from this sample
                        continue
                    tokens = ids + seq.tokens
                    n_prompt, n_done = len(ids) - 1, len(seq.tokens)
                    advantage = (reward - mean) / (args.problems * args.group)
                    data.append(
                        types.Datum(
                            model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={
                                "target_tokens": tokens[1:],
                                "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                                "advantages": [0.0] * n_prompt + [advantage] * n_done,
                            },
                        )
                    )
            if data:
                trainer.forward_backward(data, "importance_sampling")
                trainer.optim_step(adam).result()
            if it % args.eval_every == 0:
                print(f"               train reward {np.mean(rewards):.3f}", flush=True)
        print("held-out success by iteration: "
              + ", ".join(f"{it}: {s:.3f}" for it, s in curve)
              + f"  ({time.monotonic() - start:.0f} s)")  # fmt: skip
        return curve


if __name__ == "__main__":
    main()
