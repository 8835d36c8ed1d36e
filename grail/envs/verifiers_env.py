"""verifiers tasksets (`env=verifiers`): prime-rl's environments, offline against grail's server.

A verifiers (`verifiers.v1`, 0.4) environment is a taskset (tasks with their data and reward
functions) and a harness (the agent loop that talks to the model). It samples from the inference
server itself, so grail does not run its turns: grail/rollouts/verifiers.py runs each episode with
verifiers' own rollout code, its model calls sent to grail's server, and reads back the trace
verifiers builds (token ids, which of them the policy sampled, behaviour log-probs, the reward).

Here: the taskset and harness are named as verifiers names them, by module (`taskset=my_tasks`
imports `my_tasks`, whose `__all__` exports one Taskset subclass, and its Harness unless
`harness` names another module); they run in this process (verifiers' `subprocess` runtime, not
its hosted sandbox). The bundled harnesses install their programs with `uv sync` from the package
index at every start, so an offline run needs a harness of its own that runs its loop in-process
(docs/environments.md has one). Seeds map to tasks as dataset rows do: the tasks are split into
train and test by a hash of their ids (`holdout_fraction`), and seed s is task s mod n of its
split.

The reward is the trace's (`env_reward`: the taskset's weighted reward functions); an episode
succeeds when it earns at least `success_reward`.

verifiers cannot be installed beside vllm, sglang or openenv (it pins mcp 2.0 and openai >= 2.54):
`uv sync --group verifiers` (or `pip install verifiers`) in an environment of its own.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from typing import Any, Literal

from grail.core.errors import UserError
from grail.envs.base import Problem, Score, check_weight


def _message(message: Any) -> dict[str, str]:
    """A verifiers message (pydantic) or a dict as a chat message {"role", "content"}."""
    data = message.model_dump() if hasattr(message, "model_dump") else dict(message)
    content = data.get("content")
    if not isinstance(content, str):  # content parts: their text, in order
        content = "".join(p.get("text", "") for p in content or () if isinstance(p, Mapping))
    return {"role": str(data.get("role")), "content": content}


def split_ids(ids: list[str], fraction: float) -> tuple[set[int], set[int]]:
    """(train, test) positions: the test split is the `fraction` of ids first in sha256 order (at
    least one, never all), so that a task never moves between splits as others are added."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {fraction!r}")
    if len(ids) < 2:
        raise ValueError(f"a holdout split needs at least 2 tasks, got {len(ids)}")
    target = min(max(round(fraction * len(ids)), 1), len(ids) - 1)
    order = sorted(range(len(ids)), key=lambda i: hashlib.sha256(ids[i].encode()).hexdigest())
    test = set(order[:target])
    return set(range(len(ids))) - test, test


class VerifiersEnv:
    """A verifiers taskset's tasks, one per seed; grail/rollouts/verifiers.py runs them."""

    name = "verifiers"
    components: tuple[str, ...] = ("env_reward",)
    # Rollouts come from verifiers' own agent loop (grail/rollouts/verifiers.py), not from grail's
    # requests: RolloutGenerator reads this.
    samples_itself = True

    def __init__(
        self,
        taskset: str = "",
        harness: str = "",
        taskset_args: Mapping[str, Any] | None = None,
        harness_args: Mapping[str, Any] | None = None,
        split: Literal["train", "test"] = "train",
        holdout_fraction: float = 0.1,
        success_reward: float = 1.0,
        max_concurrent: int = 64,
    ) -> None:
        if not taskset:
            raise ValueError("taskset must name the taskset's module (data.env_kwargs.taskset)")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int):
            raise ValueError(f"max_concurrent must be an integer >= 1, got {max_concurrent!r}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be an integer >= 1, got {max_concurrent!r}")
        self.success_reward = check_weight("success_reward", success_reward)
        self.max_concurrent = max_concurrent
        try:
            import verifiers.v1  # noqa: F401 - missing: say how to install it, before anything
        except ImportError as exc:
            raise UserError(
                f"env=verifiers needs the verifiers package ({exc}): uv sync --group verifiers "
                "(or pip install verifiers), in an environment without vllm, sglang or openenv"
            ) from None
        agent: dict[str, Any] = {"runtime": {"type": "subprocess"}}  # not the hosted sandbox
        if harness:
            agent["harness"] = {"id": harness, **(harness_args or {})}
        elif harness_args:
            raise ValueError("harness_args without harness: name the harness's module")
        self.config = {"taskset": {"id": taskset, **(taskset_args or {})}, "agent": agent}
        self._loaded: tuple[asyncio.AbstractEventLoop | None, Any] | None = None
        try:
            tasks = list(self.environment().taskset)
        except Exception as exc:  # verifiers' loaders raise ValueError, ImportError, pydantic's
            raise ValueError(f"verifiers could not load taskset {taskset!r}: {exc}") from exc
        ids = [str(task.data.id) for task in tasks]
        train, test = split_ids(ids, holdout_fraction)
        chosen = train if split == "train" else test
        self.tasks = [task for i, task in enumerate(tasks) if i in chosen]
        self.split = split

    def environment(self) -> Any:
        """verifiers' environment object for the running event loop (it holds asyncio locks
        bound to the loop that first used them: a run has one loop, a test may have several)."""
        import verifiers.v1 as vf

        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if self._loaded is None or (loop is not None and self._loaded[0] is not loop):
            self._loaded = (loop, vf.load_environment(vf.resolve_env_config(self.config)))
        return self._loaded[1]

    def task(self, seed: int) -> Any:
        """The verifiers Task of problem seed `seed`."""
        return self.tasks[seed % len(self.tasks)]

    def problem(self, seed: int) -> Problem:
        """The task's first messages (its system prompt and prompt), for records and reuse."""
        data = self.task(seed).data
        messages = []
        if data.system_prompt:
            messages.append({"role": "system", "content": str(data.system_prompt)})
        prompt = data.prompt
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [_message(m) for m in prompt or ()]
        meta = {"task_id": str(data.id), "split": self.split}
        return Problem(seed, messages, answer="", meta=meta)

    def score(self, problem: Problem, completion: str) -> Score:
        raise TypeError(
            "a verifiers task is scored from its trace (grail/rollouts/verifiers.py), not from "
            "a completion's text"
        )
