"""Rollouts of a verifiers environment (`env=verifiers`, grail/envs/verifiers_env.py).

verifiers runs its own agent loop and calls the model itself, in its train mode: it renders each
model call's prompt with the tokenizer's chat template and asks vLLM's tokens-in route,

    POST /inference/v1/generate  {"token_ids": [...], "sampling_params": {"seed", ...}}
      -> {"choices": [{"token_ids": [...], "finish_reason",
                       "logprobs": {"content": [{"token": "token_id:N", "logprob": x}, ...]}}]}

and builds a trace of the episode's token ids with the mask of those the policy sampled and their
log-probs. So grail serves it that route here, on 127.0.0.1 for the length of a batch (the
gateway), and answers each call through grail's own completion client (the built-in server, vLLM,
SGLang or a fleet, as every other rollout): the prompt tokens as verifiers rendered them, the
run's sampling settings (verifiers' own are ignored but for the seed), the turns of concurrent
episodes batched into shared requests (`TurnBatcher`), and a fleet's later turns sent to the
server that answered the episode's first.

Seeds. Episode i of problem p in round r gets `request_seed(base, r, p) + i`, as a single-turn
sample does, passed to verifiers as its sampling seed; verifiers sends it on each of the
episode's calls, and the gateway gives call t of the episode (`X-Session-ID`) `turn_seed(seed,
t)`, as grail's own turn loop does. The same config and seed give the same episodes.

A sample. verifiers splits an episode into branches when re-rendering the conversation changed
the tokens of an earlier turn (the model sampled a tokenization the template does not produce);
each branch holds what the model saw for its turns. grail trains on the episode's last branch:
its earlier turns are context there (mask 0), so no token is trained on that the model did not
sample where it stands. Every episode of a task must start with the same prompt tokens (the
group's prompt).
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from grail.core.errors import first_line
from grail.core.http_thread import LoopServer
from grail.envs.verifiers_env import VerifiersEnv
from grail.inference.completions import SamplingParams
from grail.rollouts.batch import EpisodeStats, Group, Sample
from grail.rollouts.episodes import EnvironmentFailed, EpisodeLimits, TurnBatcher, turn_seed
from grail.rollouts.seeds import request_seed

if TYPE_CHECKING:
    from grail.inference.client import Completer

MODEL_NAME = "grail-policy"


@dataclass
class _Session:
    """What the gateway saw of one episode's calls."""

    calls: int = 0
    finish_reason: str = "stop"
    server: int | None = None  # a fleet's: the one that answered the first call


class Gateway:
    """vLLM's tokens-in route on 127.0.0.1, answered through grail's completion client."""

    def __init__(
        self, turns: TurnBatcher, sampling: SamplingParams, max_tokens: int, key: str
    ) -> None:
        self.turns, self.sampling, self.max_tokens, self.key = turns, sampling, max_tokens, key
        self.sessions: dict[str, _Session] = {}
        self._server: LoopServer | None = None

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            # max_model_len: verifiers ends an episode whose prompt would not fit the budget.
            model = {"id": MODEL_NAME, "object": "model", "max_model_len": self.max_tokens}
            return {"object": "list", "data": [model]}

        @app.post("/inference/v1/generate")
        async def generate(request: Request) -> JSONResponse:
            if request.headers.get("authorization") != f"Bearer {self.key}":
                return JSONResponse({"error": "missing or wrong key"}, status_code=401)
            try:
                body = await request.json()
                prompt = [int(t) for t in body["token_ids"]]
                seed = int(body.get("sampling_params", {})["seed"])
            except (ValueError, KeyError, TypeError) as exc:
                return JSONResponse({"error": f"bad request: {exc!r}"}, status_code=400)
            session = self.sessions.setdefault(request.headers.get("x-session-id", ""), _Session())
            room = self.max_tokens - len(prompt)
            if room < 1:
                message = (
                    f"the prompt's {len(prompt)} tokens leave no room within {self.max_tokens}"
                )
                return JSONResponse({"error": message}, status_code=400)
            sampling = replace(self.sampling, max_tokens=min(self.sampling.max_tokens, room))
            completion, server = await self.turns.complete(
                prompt, sampling, turn_seed(seed, session.calls), session.server
            )
            session.calls += 1
            session.server, session.finish_reason = server, completion.finish_reason
            content = [
                {"token": f"token_id:{t}", "token_id": t, "logprob": lp}
                for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)
            ]
            choice = {
                "index": 0,
                "finish_reason": completion.finish_reason,
                "token_ids": completion.token_ids,
                "logprobs": {"content": content},
            }
            return JSONResponse({"choices": [choice], "prompt_token_ids": None})

        return app

    async def start(self, port: int = 0) -> str:
        """Serve on this event loop, on `port` (0: a free one); the base URL verifiers is given
        (".../v1"). TimeoutError when it does not listen (the port taken)."""
        self._server = LoopServer(self.app(), "127.0.0.1", port, name="the verifiers gateway")
        return f"{await self._server.start()}/v1"

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
        self._server = None


class VerifiersRunner:
    """A verifiers environment's episodes, G per problem seed, as `Group`s."""

    def __init__(
        self,
        env: VerifiersEnv,
        tokenizer: Any,
        client: Completer,
        sampling: SamplingParams,
        limits: EpisodeLimits,
        *,
        base_seed: int = 0,
    ) -> None:
        self.env, self.sampling, self.limits, self.base_seed = env, sampling, limits, base_seed
        # verifiers loads the tokenizer itself, by the name or directory it was loaded from
        self.tokenizer_name = str(tokenizer.name_or_path)
        self._turns = TurnBatcher(client)
        # The gateway's port, kept from batch to batch: verifiers' renderer caches what
        # GET /v1/models says per URL, for the life of the process.
        self._port = 0
        # verifiers reads the gateway's key from an environment variable it is told the name of:
        # one per runner (the training and the evaluation runners may generate at once).
        self._key = secrets.token_urlsafe(24)
        self._key_variable = f"GRAIL_VERIFIERS_KEY_{secrets.token_hex(4).upper()}"
        os.environ[self._key_variable] = self._key

    async def generate_groups(
        self,
        problem_seeds: Sequence[int],
        replicas: int,
        *,
        round_index: int = 0,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Group]:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        _unbind_renderers_lock()
        self._turns.new_batch(len(problem_seeds) * replicas, self.sampling)
        gateway = Gateway(self._turns, self.sampling, self.limits.max_tokens, self._key)
        try:
            url = await gateway.start(self._port)
        except TimeoutError:
            if not self._port:
                raise
            url = await gateway.start(0)  # the port was taken meanwhile: any other
        self._port = int(url.rsplit(":", 1)[1].split("/")[0])
        slots = asyncio.Semaphore(self.env.max_concurrent)
        environment = self.env.environment()

        async def group(seed: int) -> Group:
            first = request_seed(self.base_seed, round_index, seed)
            episodes = [
                self._episode(environment, seed, first + i, url, slots) for i in range(replicas)
            ]
            runs = await asyncio.gather(*episodes)
            if on_progress is not None:
                on_progress(1)
            prompts = {tuple(prompt) for prompt, _, _ in runs}
            if len(prompts) > 1:
                raise EnvironmentFailed(
                    f"environment 'verifiers' at seed {seed}: its episodes began with different "
                    "prompt tokens (a taskset whose prompt is not the same for every episode)"
                )
            samples = []
            for _, sample, trace_id in runs:
                session = gateway.sessions.get(trace_id, _Session())
                truncated = session.finish_reason == "length"
                samples.append(
                    replace(
                        sample,
                        finish_reason=session.finish_reason,
                        episode=EpisodeStats(turns=session.calls, truncated=truncated),
                    )
                )
            return Group(self.env.problem(seed), list(runs[0][0]), samples)

        try:
            async with environment.serving():
                return list(await asyncio.gather(*(group(int(s)) for s in problem_seeds)))
        finally:
            await gateway.stop()
            await self._turns.aclose()

    async def _episode(
        self, environment: Any, seed: int, sampling_seed: int, url: str, slots: asyncio.Semaphore
    ) -> tuple[list[int], Sample, str]:
        """One episode: its prompt ids, the sample of its last branch, its trace's id."""
        import verifiers.v1 as vf
        from renderers import DefaultRendererConfig

        client = vf.TrainClientConfig(
            base_url=url,
            api_key_var=self._key_variable,
            renderer=DefaultRendererConfig(),
            renderer_model_name=self.tokenizer_name,
        )
        sampling = vf.SamplingConfig(
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            max_tokens=self.sampling.max_tokens,
            seed=sampling_seed,
        )
        context = vf.ModelContext(model=MODEL_NAME, client=client, sampling=sampling)
        what = f"environment 'verifiers' at seed {seed}"
        [slot] = environment.slots(self.env.task(seed), 1)
        episode = await environment.run_slot(slot, context, slots)
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        if errors or not episode.traces:
            detail = first_line(errors[0].message) if errors else "no trace"
            raise EnvironmentFailed(f"{what}: the episode failed: {detail}")
        trace = episode.traces[0]
        branches = [b for b in trace.branches if b.trainable]
        if not branches:
            raise EnvironmentFailed(f"{what}: its trace has no trainable branch")
        # The prompt: what the first call was sent (the first branch, up to its first sampled
        # token); the sample: the last branch after it, whose earlier turns are context there.
        first_mask = [int(m) for m in branches[0].sampled_mask]
        if 1 not in first_mask:
            raise EnvironmentFailed(f"{what}: the model sampled no token in its first branch")
        prompt = list(branches[0].token_ids)[: first_mask.index(1)]
        branch = branches[-1]
        ids, mask = list(branch.token_ids), [int(m) for m in branch.sampled_mask]
        logprobs = [float(x) for x in branch.logprobs]
        if ids[: len(prompt)] != prompt or 1 in mask[: len(prompt)]:
            raise EnvironmentFailed(f"{what}: its last branch does not begin with its prompt")
        start = len(prompt)
        reward = float(trace.reward if trace.reward is not None else 0.0)
        replies = trace.assistant_messages
        sample = Sample(
            completion_ids=ids[start:],
            behaviour_logprobs=logprobs[start:],
            finish_reason="stop",
            text=str(replies[-1].content or "") if replies else "",
            reward=reward,
            components={"env_reward": reward},
            success=reward >= self.env.success_reward,
            sampled_mask=mask[start:],
            episode=None,  # what the gateway saw of its calls, added by generate_groups
        )
        return prompt, sample, str(trace.id)


def _unbind_renderers_lock() -> None:
    """A new lock for renderers' GET /v1/models lookup, on the running event loop.

    renderers (0.1.12, verifiers' renderer) keeps that lock in a module global, and an asyncio
    lock binds itself to the loop of its first contended acquire: the first lookup of a later
    event loop (a second run in one process, a test) then fails every episode with "is bound to
    a different event loop". Replacing it is harmless: at worst two lookups run at once."""
    import renderers.client

    if hasattr(renderers.client, "_max_prompt_len_lock"):
        renderers.client._max_prompt_len_lock = asyncio.Lock()
