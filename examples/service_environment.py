"""An environment process for the trainer as a service, Atropos-style: it samples its groups
through the service's /v1/turns, scores them with its own copy of grail-train's default task
(copy_digits), and pushes whole scored groups to the trainer, purely over HTTP.

    uv run grail-train mode=service                      # terminal 1: the trainer, waiting
    uv run python examples/service_environment.py --endpoint outputs/DATE/TIME/service/endpoint.json

(`--endpoint` is the file the service writes with its URL and key; `--url` and `--api-key`, or
GRAIL_SERVICE_URL and GRAIL_SERVICE_API_KEY, work too.) It stops when the run has taken all its
batches (or the service is gone), and prints what it pushed and how fast.

The protocol: GET /v1/info once (the group size, the batch size). Then, per group: GET
/v1/status and wait while a batch's worth of groups is already queued (`queued_groups`: more
would wait and may go stale; see --backlog); POST /v1/turns with the problem's messages and n =
rollouts_per_problem: the service samples them with the run's settings and answers with the
prompt's token ids, the policy version that sampled them, and each choice's token ids and
behaviour log-probabilities; score the choices; POST /v1/groups with those ids, log-probs and
version, and each completion's reward, success and finish reason. The service checks that every
pushed token is one it sampled (service.check_spans). A 409 means the group came too late (older
than service.max_staleness allows): it is counted and dropped.

An agent loop of several turns does the same per turn: POST /v1/turns with the episode's token
ids so far (n=1), append the environment's tokens, and push the episode with a sampled_mask
(docs/service.md). Your own environment replaces `CopyDigitsEnv()` (its prompts and its
scorer) and keeps the protocol.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from grail.envs import CopyDigitsEnv
from grail.service.endpoint import add_endpoint_arguments, endpoint_from_arguments


@dataclass
class Tally:
    groups: int = 0
    completions: int = 0
    stale: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Finished(Exception):
    """The run is over: the service stopped, or it has taken all its batches."""


def service_status(service: httpx.Client) -> dict[str, Any]:
    """GET /v1/status; Finished once the run has taken its last batch, or the service is gone."""
    try:
        status = service.get("/v1/status").raise_for_status().json()
    except httpx.TransportError:
        raise Finished from None
    if status["finished"]:
        raise Finished
    return status


def sample(
    service: httpx.Client, messages: list[dict[str, str]], group_size: int
) -> dict[str, Any]:
    """One group of the problem from /v1/turns, sampled with the run's settings."""
    try:
        answer = service.post("/v1/turns", json={"messages": messages, "n": group_size})
    except httpx.TransportError:
        raise Finished from None  # the service has stopped: the run is over
    if answer.status_code == 503:  # the run has taken all its batches
        raise Finished
    return answer.raise_for_status().json()


def to_group(answer: dict[str, Any], env: Any, problem: Any, group_size: int) -> dict[str, Any]:
    """A /v1/turns answer as a scored /v1/groups group."""
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    if len(choices) != group_size:
        raise RuntimeError(f"asked for {group_size} completions, got {len(choices)}")
    completions = []
    for choice in choices:
        score = env.score(problem, choice["text"])
        completions.append(
            {
                "token_ids": choice["token_ids"],
                "logprobs": choice["logprobs"],  # the behaviour policy's, as sampled
                "reward": score.reward,
                "success": score.success,
                "finish_reason": choice["finish_reason"],
                "text": choice["text"],
            }
        )
    return {
        "prompt_ids": answer["prompt_token_ids"],
        "policy_version": answer["policy_version"],  # the weights that sampled the group
        "completions": completions,
    }


def worker(
    number: int,
    workers: int,
    url: str,
    api_key: str,
    info: dict[str, Any],
    seed_start: int,
    backlog: int,
    stop: threading.Event,
    tally: Tally,
) -> None:
    env = CopyDigitsEnv()  # the environment's own task: its prompts and its scorer
    # A turns request waits while the trainer syncs weights: allow for a sync by restart.
    service = httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=300
    )
    group_size = int(info["rollouts_per_problem"])
    seed = seed_start + number
    try:
        while not stop.is_set():
            status = service_status(service)
            if status["queued_groups"] >= backlog:  # the next batch is there: more would wait
                time.sleep(0.1)
                continue
            problem = env.problem(seed)
            answer = sample(service, problem.prompt_messages, group_size)
            group = to_group(answer, env, problem, group_size)
            seed += workers
            try:
                pushed = service.post("/v1/groups", json={"groups": [group]})
            except httpx.TransportError:
                break  # the service has stopped: the run is over
            if pushed.status_code == 503:  # the run has taken all its batches
                break
            if pushed.status_code == 409:  # too old by now (service.max_staleness)
                with tally.lock:
                    tally.stale += 1
                continue
            if pushed.status_code != 200:
                raise RuntimeError(f"POST /v1/groups: {pushed.status_code} {pushed.text[:500]}")
            with tally.lock:
                tally.groups += pushed.json()["accepted"]
                tally.completions += group_size
    except Finished:
        pass
    except Exception as exc:
        with tally.lock:
            tally.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        stop.set()  # one worker seeing the end stops the others
        service.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_endpoint_arguments(parser)
    parser.add_argument("--workers", type=int, default=4, help="groups in flight at once")
    parser.add_argument("--seed-start", type=int, default=0, help="first problem seed")
    parser.add_argument(
        "--backlog",
        type=int,
        help="sample only while fewer groups than this are queued (default: "
        "data.problems_per_iteration, one batch ahead of the trainer)",
    )
    args = parser.parse_args(argv)
    url, api_key = endpoint_from_arguments(parser, args)

    headers = {"Authorization": f"Bearer {api_key}"}
    info = httpx.get(f"{url}/v1/info", headers=headers, timeout=30).raise_for_status().json()
    backlog = args.backlog if args.backlog is not None else int(info["problems_per_iteration"])
    tally, stop = Tally(), threading.Event()
    t0 = time.perf_counter()
    threads = [
        threading.Thread(
            target=worker,
            args=(k, args.workers, url, api_key, info, args.seed_start, backlog, stop, tally),
        )
        for k in range(args.workers)
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except KeyboardInterrupt:  # Ctrl-C: the workers finish the group in hand, then stop
        stop.set()
        for thread in threads:
            thread.join()
    seconds = time.perf_counter() - t0
    print(
        f"{tally.groups} groups accepted ({tally.completions} completions, {tally.stale} groups "
        f"too stale) in {seconds:.1f} s: {tally.groups / seconds:.1f} groups/s"
    )
    if tally.errors:
        sys.exit(f"environment failed: {tally.errors[0]}")


if __name__ == "__main__":
    main()
