"""A client of the trainer as a service: it teaches grail-train's default task (copy_digits) from
another process, purely over HTTP. It asks for completions with the official `openai` client,
scores them with its own copy of the task, and sends the rewards back with httpx.

    uv run grail-train mode=service                      # terminal 1: the trainer, waiting
    uv run python examples/service_client.py --endpoint outputs/DATE/TIME/service/endpoint.json

(`--endpoint` is the file the service writes with its URL and key; `--url` and `--api-key`, or
GRAIL_SERVICE_URL and GRAIL_SERVICE_API_KEY, work too.) The client stops when the run has trained
all its iterations, and prints what it sent and how fast.

Your own client replaces `score` (a simulator, a test suite, a person) and the prompts; the
protocol stays: POST /v1/completions -> one group of samples with ids, POST /v1/rewards with a
reward per id (all of a group at once, or one by one).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from grail.envs import CopyDigitsEnv
from grail.service.endpoint import add_endpoint_arguments, endpoint_from_arguments


@dataclass
class Tally:
    groups: int = 0
    rewards: int = 0
    stale: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def worker(
    number: int,
    workers: int,
    url: str,
    api_key: str,
    model: str,
    seed_start: int,
    stop: threading.Event,
    tally: Tally,
) -> None:
    env = CopyDigitsEnv()  # the client's own task: its prompts and its scorer
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, timeout=300, max_retries=2)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60)
    seed = seed_start + number
    try:
        while not stop.is_set():
            problem = env.problem(seed)
            seed += workers
            try:
                # `messages` instead of a prompt: the service renders them with the model's chat
                # template, as the trainer's evaluation renders the task's prompts.
                response = client.completions.create(
                    model=model,
                    prompt=None,
                    extra_body={"messages": problem.prompt_messages},
                )
            except openai.APIStatusError as exc:
                if exc.status_code == 503:  # the run has taken all its batches
                    break
                raise
            except openai.APIConnectionError:
                break  # the service has stopped: the run is over
            rewards: list[dict[str, Any]] = []
            for choice in response.choices:
                score = env.score(problem, choice.text)
                sample_id = choice.id  # type: ignore[attr-defined]  # the service's extension
                rewards.append({"id": sample_id, "reward": score.reward, "success": score.success})
            try:
                answer = http.post("/v1/rewards", json={"rewards": rewards})
            except httpx.TransportError:
                break
            if answer.status_code == 409:  # trained on too late (service.max_staleness)
                with tally.lock:
                    tally.stale += 1
                continue
            answer.raise_for_status()
            with tally.lock:
                tally.groups += 1
                tally.rewards += answer.json()["accepted"]
    except Exception as exc:
        with tally.lock:
            tally.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        stop.set()  # one worker seeing the end stops the others
        http.close()
        client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_endpoint_arguments(parser)
    parser.add_argument("--workers", type=int, default=8, help="groups in flight at once")
    parser.add_argument("--seed-start", type=int, default=0, help="first problem seed")
    args = parser.parse_args(argv)
    url, api_key = endpoint_from_arguments(parser, args)

    headers = {"Authorization": f"Bearer {api_key}"}
    info = httpx.get(f"{url}/v1/info", headers=headers, timeout=30).raise_for_status().json()
    tally, stop = Tally(), threading.Event()
    t0 = time.perf_counter()
    threads = [
        threading.Thread(
            target=worker,
            args=(k, args.workers, url, api_key, info["model"], args.seed_start, stop, tally),
        )
        for k in range(args.workers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - t0
    print(
        f"{tally.groups} groups rewarded ({tally.rewards} rewards, {tally.stale} groups too "
        f"stale) in {seconds:.1f} s: {tally.groups / seconds:.1f} groups/s"
    )
    if tally.errors:
        sys.exit(f"client failed: {tally.errors[0]}")


if __name__ == "__main__":
    main()
