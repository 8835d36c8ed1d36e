"""What the service's routes do, on the service's event loop: sample completions through the
inference server, keep the ledger (grail/service/ledger.py) and journal every change to it
(grail/service/store.py) before answering, hold new completions back while the weights change,
and hand the trainer its batches.

Everything here runs on one event loop (uvicorn's, in the service thread), so the ledger is never
touched by two coroutines at once; the trainer's thread reaches it only through coroutines it
submits to that loop (grail/service/source.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, astuple
from typing import Any

from grail.core.http_api import APIError
from grail.inference.client import Completer
from grail.inference.completions import Completion, GenerationError, SamplingParams
from grail.rollouts.seeds import request_seed
from grail.service.ledger import Ledger, PushedGroup, RewardEntry, ServiceGroup, span_key
from grail.service.store import LedgerStore

log = logging.getLogger(__name__)

# Request seeds of the service's completions and turns (training rounds are >= 0, evaluation -1).
SERVICE_ROUND = -2
TURNS_ROUND = -3


class WaitTimeout(Exception):
    """No batch's worth of groups arrived within service.wait_timeout_s."""


class ServiceCore:
    def __init__(
        self,
        ledger: Ledger,
        store: LedgerStore,
        client: Completer,
        sampling: SamplingParams,
        tokenizer: Any,
        *,
        model_name: str,
        base_seed: int,
        iterations: int,
        info: dict[str, Any],
        check_spans: bool,
    ) -> None:
        self.ledger, self.store = ledger, store
        self.client, self.sampling, self.tokenizer = client, sampling, tokenizer
        self.model_name, self.base_seed = model_name, base_seed
        self.iterations = iterations
        self._info = info
        self.check_spans = check_spans  # service.check_spans: pushed spans must be our turns
        self._vocab_size = len(tokenizer)
        self._in_flight = 0  # completions being sampled now
        self._paused = False  # new completions wait: the weights are changing
        self._taking = False  # the trainer waits for a batch
        self._finished = False  # every iteration's batch is taken: no more completions
        self._changed: asyncio.Condition | None = None

    @property
    def group_size(self) -> int:
        return self.ledger.group_size

    # -- lifetime (the app's lifespan) --------------------------------------------------------

    def started(self) -> None:
        self._changed = asyncio.Condition()

    async def stopped(self) -> None:
        await self.client.aclose()

    @property
    def changed(self) -> asyncio.Condition:
        assert self._changed is not None, "the service's app has not started"
        return self._changed

    # -- routes ---------------------------------------------------------------------------------

    async def complete(self, prompt_ids: list[int]) -> ServiceGroup:
        """Sample a group of the prompt with the current weights and hand it out."""
        async with self._sampling():
            number = self.ledger.new_group_number()
            seed = request_seed(self.base_seed, SERVICE_ROUND, number)
            samples = await self._sample(prompt_ids, self.group_size, seed)
            # Registered before the count drops: the weights (and version) cannot change
            # between sampling and handing out.
            outputs = [(c.token_ids, c.logprobs, c.finish_reason, c.text) for c in samples]
            group = self.ledger.hand_out(number, prompt_ids, outputs)
            self.store.append(
                {"op": "hand_out", "number": number, "prompt_ids": prompt_ids, "samples": outputs}
            )
        return group

    async def turns(self, prompt_ids: list[int], n: int) -> tuple[int, list[Completion]]:
        """Sample `n` turns after `prompt_ids` with the current weights, for a client that
        pushes them in its own groups (/v1/groups); kept for service.check_spans. Returns the
        policy version that sampled them, and them."""
        async with self._sampling():
            number = self.ledger.new_turn_number()
            samples = await self._sample(
                prompt_ids, n, request_seed(self.base_seed, TURNS_ROUND, number)
            )
            version = self.ledger.policy_version
            keys = [span_key(prompt_ids, c.token_ids) for c in samples]
            logprobs = [c.logprobs for c in samples]
            self.ledger.record_turns(number, keys, logprobs)
            self.store.append({"op": "turns", "number": number, "keys": keys, "logprobs": logprobs})
        return version, samples

    async def add_rewards(self, entries: list[RewardEntry]) -> int:
        with self._journal_refusals():
            accepted = self.ledger.add_rewards(entries)
        self.store.append({"op": "rewards", "entries": [astuple(e) for e in entries]})
        await self._notify()
        return accepted

    async def add_groups(self, groups: list[PushedGroup]) -> list[ServiceGroup]:
        self._refuse_when_finished()
        with self._journal_refusals():
            added = self.ledger.add_groups(groups, check_spans=self.check_spans)
        self.store.append(
            {
                "op": "groups",
                "groups": [asdict(g) for g in groups],
                "check_spans": self.check_spans,
            }
        )
        await self._notify()
        return added

    def status(self) -> dict[str, Any]:
        ledger = self.ledger
        return {
            "policy_version": ledger.policy_version,
            "iterations_done": ledger.policy_version,  # one update per iteration
            "iterations_total": self.iterations,
            "queued_groups": len(ledger.queue),
            "open_groups": len(ledger.open),
            "outstanding_samples": ledger.outstanding(),
            "waiting_for_groups": self._taking,
            "syncing_weights": self._paused,
            "finished": self._finished,
            **vars(ledger.counters),
        }

    def info(self) -> dict[str, Any]:
        s = self.sampling
        return {
            "model": self.model_name,
            "max_staleness": self.ledger.max_staleness,
            "rollouts_per_problem": self.group_size,
            "sampling": {
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k,
                "max_tokens": s.max_tokens,
            },
            **self._info,
        }

    def sampling_summary(self) -> str:
        s = self.sampling
        return (
            f"generation.temperature={s.temperature}, top_p={s.top_p}, top_k={s.top_k}, "
            f"max_new_tokens={s.max_tokens}"
        )

    # -- prompts ------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        if not text:
            raise APIError("prompt is empty", 400, "prompt")
        return [int(t) for t in self.tokenizer.encode(text)]

    def render_messages(self, messages: list[dict[str, str]]) -> list[int]:
        if not messages:
            raise APIError("messages is empty", 400, "messages")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        except Exception as exc:  # the template's own error (a role it does not know, ...)
            message = f"the chat template refused the messages: {exc}"
            raise APIError(message, 400, "messages") from None
        if not isinstance(ids, list):  # transformers 5: a BatchEncoding-like mapping
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        bad = next((t for t in ids if t >= self._vocab_size), None)
        if bad is not None:
            raise APIError(
                f"{param}: token id {bad} is outside the vocabulary (size {self._vocab_size})",
                400,
                param,
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        # As the inference servers decode a completion's text (vLLM's skip_special_tokens=True).
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    # -- the trainer's side (submitted from its thread) ----------------------------------------

    async def take(
        self,
        count: int,
        iteration: int,
        timeout_s: float | None,
        on_queued: Callable[[int], None] | None = None,
    ) -> list[ServiceGroup]:
        """Wait until `count` groups are queued and take them for `iteration`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        shown = 0
        async with self.changed:
            self._taking = True
            try:
                while (groups := self.ledger.take(count, iteration)) is None:
                    if on_queued is not None and min(len(self.ledger.queue), count) > shown:
                        on_queued(min(len(self.ledger.queue), count) - shown)
                        shown = min(len(self.ledger.queue), count)
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise WaitTimeout(
                            f"iteration {iteration} waited {timeout_s:g} s "
                            f"(service.wait_timeout_s) for {count} groups "
                            f"(data.problems_per_iteration) and got {len(self.ledger.queue)}: "
                            "are the clients running? The queue is saved: resume=true goes on"
                        )
                    with contextlib.suppress(TimeoutError):  # the deadline, checked above
                        await asyncio.wait_for(self.changed.wait(), left)
            finally:
                self._taking = False
            if on_queued is not None and count > shown:
                on_queued(count - shown)
            self._finished = iteration + 1 >= self.iterations
            self.store.append({"op": "take", "count": count, "iteration": iteration})
        return groups

    async def pause(self) -> None:
        """Hold new completions back and wait for those being sampled: the weights change next."""
        async with self.changed:
            self._paused = True
            await self.changed.wait_for(lambda: self._in_flight == 0)

    async def resume(self, policy_version: int | None) -> None:
        """The weights are `policy_version`'s now (None: unchanged): completions go on."""
        if policy_version is not None:
            self.ledger.advance(policy_version)
            self.store.append({"op": "advance", "policy_version": policy_version})
        async with self.changed:
            self._paused = False
            self.changed.notify_all()

    async def checkpointed(self, iteration: int) -> None:
        self.ledger.checkpointed(iteration)
        self.store.snapshot(self.ledger)

    # -- internals ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _sampling(self) -> AsyncIterator[None]:
        """Around a sampling request: it waits while the weights change, and a weight change
        waits for it (`pause`)."""
        async with self.changed:
            await self.changed.wait_for(lambda: not self._paused)
            self._refuse_when_finished()
            self._in_flight += 1
        try:
            yield
        finally:
            async with self.changed:
                self._in_flight -= 1
                self.changed.notify_all()

    async def _sample(self, prompt_ids: list[int], n: int, seed: int) -> list[Completion]:
        try:
            return await self.client.complete(prompt_ids, n, self.sampling, seed)
        except GenerationError as exc:
            raise APIError(f"the inference server failed: {exc}", 502) from exc

    def _refuse_when_finished(self) -> None:
        if self._finished:
            raise APIError(
                f"the run has taken the batches of all its train.iterations={self.iterations}: "
                "nothing more is trained",
                503,
            )

    @contextlib.contextmanager
    def _journal_refusals(self) -> Iterator[None]:
        """A refused request changes nothing but the counts of stale refusals: journal those."""
        before = astuple(self.ledger.counters)
        try:
            yield
        finally:
            if astuple(self.ledger.counters) != before:
                self.store.append({"op": "counters", "counters": asdict(self.ledger.counters)})

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()
