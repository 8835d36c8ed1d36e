"""A verifiers (`verifiers.v1`) taskset and an in-process harness, as a user writes them for
prime-rl: tests/test_verifiers_env.py runs them under grail (`env=verifiers`). verifiers finds them
by top-level module name (`data.env_kwargs.taskset=verifiers_digits`: tests/ is on the path)
through `__all__`."""

from __future__ import annotations

import random
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult

__all__ = ["Digits", "DigitsData", "DigitsHarness", "DigitsHarnessConfig", "DigitsTask"]

FOLLOW_UP = "Now the same digits reversed."


class DigitsData(vf.TaskData):
    digits: str


class DigitsTask(vf.Task[DigitsData, vf.State]):
    @vf.reward
    async def exact(self, task: DigitsData, trace: vf.Trace) -> float:
        """Half a point for each reply that is right: the digits, then the digits reversed."""
        replies = [(m.content or "").strip() for m in trace.assistant_messages]
        return (
            sum(r == w for r, w in zip(replies, [task.digits, task.digits[::-1]], strict=False)) / 2
        )


class Digits(vf.Taskset[DigitsTask, vf.TasksetConfig]):
    def load(self) -> Any:
        rng = random.Random(0)
        for i in range(12):
            digits = "".join(rng.choice("0123456789") for _ in range(3))
            data = DigitsData(id=f"digits-{i}", digits=digits, prompt=f"Repeat: {digits}")
            yield DigitsTask(data, self.config.task)


class DigitsHarnessConfig(vf.HarnessConfig):
    id: str = "verifiers_digits"


class DigitsHarness(vf.Harness[DigitsHarnessConfig]):
    """The chat loop in this process (no program to install): the prompt, then a follow-up."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(  # type: ignore[override]
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: Any,
        data: Any,
    ) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            for follow_up in (None, FOLLOW_UP):
                if follow_up is not None:
                    messages.append({"role": "user", "content": follow_up})
                answer = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")
