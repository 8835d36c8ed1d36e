"""A completion client whose "model" is a Python function of the conversation so far: scripted
episodes through the real turn loop (tests/test_lookup.py, tests/test_trl_environment.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from grail.inference.completions import Completion, SamplingParams

Policy = Callable[[str], str]


class ScriptedPolicy:
    """A completion client whose "model" is `policy(conversation so far) -> turn text`: the
    text's tokens are sent back with <|im_end|>, as a server's stopped turn."""

    def __init__(self, tokenizer: Any, policy: Policy) -> None:
        self.tokenizer, self.policy = tokenizer, policy

    def _one(self, prompt: Sequence[int]) -> Completion:
        text = self.policy(self.tokenizer.decode(list(prompt)))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        return Completion(list(ids), [0.0] * len(ids), "stop", text)

    async def complete(
        self, prompt_ids: Sequence[int], n: int, sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        return [self._one(prompt_ids) for _ in range(n)]

    async def complete_many(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        on_done: Callable[[int], None] | None = None,
        spans: Any = None,
    ) -> list[list[Completion]]:
        return [await self.complete(p, n, sampling, s) for p, s in zip(prompts, seeds, strict=True)]

    async def aclose(self) -> None:
        pass
