"""OpenEnv environments as episodes (`env=openenv`): a server the user runs, or a class served here.

OpenEnv (the `openenv` package) serves an environment over HTTP and a WebSocket: `reset(seed)`
gives the first observation, `step(action)` the next one with its reward and `done`. Here one
episode is one WebSocket session on the server's `/ws` (its HTTP `/reset` and `/step` build a new
environment per request, so they cannot carry an episode):

    reset(seed)     -> {"type": "reset", "data": {"seed": seed, **reset_kwargs}}
                       the observation becomes the first user message (after system_prompt)
    step(turn)      -> {"type": "step", "data": {action_field: the assistant's text}}
                       reward and done come from the environment; until done, the observation
                       is the next user message
    close()         -> {"type": "close"}, then the socket is closed

An episode's reward is the sum of its steps' rewards (`env_reward`), and it succeeds when it ends
(done) with at least `success_reward`. Seeds reach the environment's `reset(seed=...)`: an
environment that seeds its randomness from it gives the same episodes for the same seeds, as grail
needs for its reruns and rollout reuse.

Which action field receives the text, and which observation field is shown, are read from the
server's `GET /schema` (the only string field of each), or named by `action_field` and
`observation_field`; without an observation field to show, the observation is shown as JSON
(without `done`, `reward` and `metadata`). A URL that does not answer `/schema` as OpenEnv does is
refused before anything starts. Every call has a deadline (connect_timeout_s, message_timeout_s):
a server that dies or hangs fails the episode in one line naming its URL.

Sessions. OpenEnv's server allows one session at a time unless started with
`max_concurrent_envs`; `max_sessions` (default 1) caps the episodes in flight to match it.

In-process. `environment=package.module:Class` (an `openenv.core.env_server.interfaces.
Environment` subclass whose `step` is annotated with its action and observation classes) is served
here by OpenEnv's own server (`create_app`) on 127.0.0.1, `max_sessions` sessions at once (more
than one needs the class's SUPPORTS_CONCURRENT_SESSIONS): this needs the `openenv` extra.

The client side is written here on `websockets` rather than with `openenv`'s EnvClient: openenv
cannot be installed beside vllm (it needs fastmcp 3 and so mcp 1; vllm >= 0.33 needs mcp 2), and
a URL must be usable from a vllm install. The protocol is five JSON messages, checked against
OpenEnv's own server in tests/test_openenv.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import typing
from collections.abc import Mapping
from typing import Any

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from grail.core.errors import UserError
from grail.core.http_thread import ServerThread
from grail.core.imports import SpecError, import_spec
from grail.envs.base import Problem, check_weight
from grail.envs.episodes import Step

_NOT_SHOWN = ("done", "reward", "metadata")  # sent beside an observation's fields, not in them


class OpenEnvError(RuntimeError):
    """An OpenEnv server failed an episode's call: it answered an error, junk, or not in time."""


def _string_fields(schema: Mapping[str, Any]) -> list[str]:
    """The fields of a JSON schema (pydantic's) whose values are strings (or optional ones)."""
    fields = []
    for name, prop in (schema.get("properties") or {}).items():
        kinds = [prop, *prop.get("anyOf", ())] if isinstance(prop, Mapping) else []
        if name not in _NOT_SHOWN and any(k.get("type") == "string" for k in kinds):
            fields.append(name)
    return fields


def _ws_url(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https"):
        raise ValueError(f"url {url!r} is not an http:// or https:// URL")
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest.rstrip('/')}/ws"


class _Session:
    """One episode: a WebSocket session on the server."""

    def __init__(self, env: OpenEnvEnv, socket: Any) -> None:
        self.env, self.socket = env, socket
        self.problem = Problem(-1, [], "")  # set by OpenEnvEnv.reset
        self.total = 0.0

    async def call(self, message: dict[str, Any]) -> tuple[dict[str, Any], float, bool]:
        """Send `message`; the answer's observation fields, reward (None: 0) and done."""
        env = self.env
        # A refused session (at capacity) gets an error frame and the close: when the close beats
        # the send, the frame is still there to read (as OpenEnv's own client does).
        with contextlib.suppress(ConnectionClosed):
            await self.socket.send(json.dumps(message))
        try:
            async with asyncio.timeout(env.message_timeout_s):
                raw = await self.socket.recv()
        except TimeoutError:
            raise OpenEnvError(
                f"OpenEnv server {env.url} did not answer {message['type']} within "
                f"{env.message_timeout_s:g} s (data.env_kwargs.message_timeout_s)"
            ) from None
        except Exception as exc:  # the connection dropped: websockets' ConnectionClosed, OSError
            raise OpenEnvError(
                f"OpenEnv server {env.url} lost the session during {message['type']}: {exc}"
            ) from None
        return env.parse(raw, message["type"])

    async def step(self, text: str) -> Step:
        observation, reward, done = await self.call(
            {"type": "step", "data": {self.env.action_field: text}}
        )
        self.total += reward
        components = {"env_reward": reward}
        if done:
            success = self.total >= self.env.success_reward
            return Step(reward=reward, done=True, success=success, components=components)
        message = {"role": "user", "content": self.env.show(observation)}
        return Step(messages=[message], reward=reward, components=components)

    async def close(self) -> None:
        try:
            async with asyncio.timeout(self.env.connect_timeout_s):
                await self.socket.send(json.dumps({"type": "close"}))
                await self.socket.close()
        except Exception:  # noqa: BLE001 - already gone: nothing left to release
            pass


class OpenEnvEnv:
    """An OpenEnv environment's episodes: one WebSocket session each on the server at `url`, or
    on OpenEnv's server for the `environment` class started here. The seed goes to `reset`, the
    assistant's text into the action's `action_field`, the observation's `observation_field` (or
    the observation as JSON) back as the user's turn; rewards are summed into `env_reward`, and
    `max_sessions` caps the episodes in flight (the server's `max_concurrent_envs`)."""

    name = "openenv"
    components: tuple[str, ...] = ("env_reward",)

    def __init__(
        self,
        url: str = "",
        environment: str = "",
        action_field: str = "",
        observation_field: str = "",
        reset_kwargs: Mapping[str, Any] | None = None,
        system_prompt: str = "",
        max_sessions: int = 1,
        success_reward: float = 1.0,
        api_key: str = "",
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
    ) -> None:
        if bool(url) == bool(environment):
            raise ValueError(
                "give exactly one of url (an OpenEnv server's http:// URL) and environment "
                "(package.module:Class, served here)"
            )
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an integer >= 1, got {max_sessions!r}")
        for key, value in (
            ("connect_timeout_s", connect_timeout_s),
            ("message_timeout_s", message_timeout_s),
        ):
            if check_weight(key, value) == 0:
                raise ValueError(f"{key} must be > 0, got {value!r}")
        self.max_episodes = max_sessions  # the turn loop's cap on episodes in flight
        self.success_reward = check_weight("success_reward", success_reward)
        self.reset_kwargs = dict(reset_kwargs or {})
        if "seed" in self.reset_kwargs:
            raise ValueError("reset_kwargs must not set 'seed': each episode's seed is sent")
        self.system_prompt = system_prompt
        self.connect_timeout_s, self.message_timeout_s = connect_timeout_s, message_timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._server: ServerThread | None = None
        if environment:
            url = self._serve(environment, max_sessions)
        self.url = url.rstrip("/")
        self.ws_url = _ws_url(self.url)
        schema = self._schema()
        self.action_field = self._action_field(schema["action"], action_field)
        self.observation_field = self._observation_field(schema["observation"], observation_field)

    # -- set-up -----------------------------------------------------------------------------------

    def _serve(self, environment: str, max_sessions: int) -> str:
        try:
            from openenv.core.env_server.http_server import create_app
            from openenv.core.env_server.interfaces import Environment
            from openenv.core.env_server.types import Action, Observation
        except ImportError as exc:
            raise UserError(
                f"environment={environment!r} is served with OpenEnv's server, which is not "
                f"installed ({exc}): uv sync --extra openenv (or pip install 'grail[openenv]')"
            ) from None
        try:
            cls = import_spec(environment)
        except SpecError as exc:
            raise ValueError(f"environment {environment!r}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(
                f"environment {environment!r} is not a subclass of OpenEnv's "
                "openenv.core.env_server.interfaces.Environment"
            )
        try:
            hints = typing.get_type_hints(getattr(cls, "step"))  # noqa: B009 - mypy sees a bare type
        except Exception:  # noqa: BLE001 - unresolvable annotations are treated as missing
            hints = {}
        action = next((h for k, h in hints.items() if k != "return"), None)
        observation = hints.get("return")
        if not (isinstance(action, type) and issubclass(action, Action)) or not (
            isinstance(observation, type) and issubclass(observation, Observation)
        ):
            raise ValueError(
                f"environment {environment!r}: annotate its step as "
                "`def step(self, action: YourAction) -> YourObservation` (OpenEnv Action and "
                "Observation subclasses): the server is built from them"
            )
        try:
            app = create_app(
                cls, action, observation, env_name=cls.__name__, max_concurrent_envs=max_sessions
            )
        except Exception as exc:  # OpenEnv's ConcurrencyConfigurationError and kin
            raise ValueError(f"environment {environment!r}: OpenEnv refused it: {exc}") from exc
        self._server = ServerThread(
            app, "127.0.0.1", 0, name=f"grail-openenv-{cls.__name__}", stop_timeout_s=10.0
        )
        return self._server.start()

    def _schema(self) -> dict[str, Any]:
        """The server's GET /schema; a ValueError when the URL is not an OpenEnv server."""
        try:
            answer = httpx.get(
                f"{self.url}/schema", headers=self.headers, timeout=self.connect_timeout_s
            )
        except httpx.HTTPError as exc:
            raise ValueError(
                f"no OpenEnv server answers at {self.url} (data.env_kwargs.url): {exc}"
            ) from None
        try:
            schema = answer.json() if answer.status_code == 200 else None
        except ValueError:
            schema = None
        if not (
            isinstance(schema, dict)
            and isinstance(schema.get("action"), dict)
            and isinstance(schema.get("observation"), dict)
        ):
            raise ValueError(
                f"{self.url} answers but is not an OpenEnv environment: GET /schema gave HTTP "
                f"{answer.status_code} {answer.text[:120]!r}, not its action and observation "
                "schemas"
            )
        return schema

    def _action_field(self, schema: Mapping[str, Any], named: str) -> str:
        fields = list(schema.get("properties") or {})
        required = set(schema.get("required") or ())
        if named:
            if named not in fields:
                raise ValueError(
                    f"action_field {named!r}: the environment's action has fields "
                    f"{', '.join(fields) or '(none)'}"
                )
            field = named
        else:
            strings = _string_fields(schema)
            if len(strings) != 1:
                raise ValueError(
                    f"the environment's action has {len(strings)} string fields "
                    f"({', '.join(strings) or 'none'}): name the one for the policy's text with "
                    "data.env_kwargs.action_field"
                )
            field = strings[0]
        others = sorted(required - {field})
        if others:
            raise ValueError(
                f"the environment's action also requires {', '.join(others)}: grail sends only "
                f"the policy's text, as {field!r}"
            )
        return field

    def _observation_field(self, schema: Mapping[str, Any], named: str) -> str | None:
        fields = [f for f in schema.get("properties") or {} if f not in _NOT_SHOWN]
        if named:
            if named not in fields:
                raise ValueError(
                    f"observation_field {named!r}: the environment's observation has fields "
                    f"{', '.join(fields) or '(none)'}"
                )
            return named
        strings = _string_fields(schema)
        return strings[0] if len(strings) == 1 else None  # None: shown as JSON

    # -- episodes ---------------------------------------------------------------------------------

    async def reset(self, seed: int) -> _Session:
        local = self.url.split("://", 1)[1].startswith(("127.0.0.1", "localhost", "[::1]"))
        try:
            socket = await connect(
                self.ws_url,
                open_timeout=self.connect_timeout_s,
                close_timeout=self.connect_timeout_s,
                max_size=2**26,
                additional_headers=self.headers or None,
                proxy=None if local else True,
            )
        except Exception as exc:
            raise OpenEnvError(f"OpenEnv server {self.url}: cannot open a session: {exc}") from None
        session = _Session(self, socket)
        try:
            observation, _, done = await session.call(
                {"type": "reset", "data": {"seed": seed, **self.reset_kwargs}}
            )
            if done:
                raise OpenEnvError(f"OpenEnv server {self.url}: reset(seed={seed}) gave done=true")
        except BaseException:
            await session.close()
            raise
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        first = {"role": "user", "content": self.show(observation)}
        session.problem = Problem(seed, [*system, first], answer="", meta={"url": self.url})
        return session

    def parse(self, raw: str | bytes, what: str) -> tuple[dict[str, Any], float, bool]:
        """An answer's observation fields, reward and done; an OpenEnvError naming the server
        for an error, or for anything not shaped as OpenEnv's observation answer."""
        try:
            loaded = json.loads(raw)
        except ValueError:
            loaded = None
        answer: dict[str, Any] = loaded if isinstance(loaded, dict) else {}
        data: dict[str, Any] = answer["data"] if isinstance(answer.get("data"), dict) else {}
        if answer.get("type") == "error":
            hint = ""
            if data.get("code") == "CAPACITY_REACHED":
                hint = (
                    f"; it allows {data.get('max_sessions')} sessions: set "
                    "data.env_kwargs.max_sessions to at most that"
                )
            raise OpenEnvError(
                f"OpenEnv server {self.url} refused {what}: {data.get('message')} "
                f"({data.get('code')}){hint}"
            )
        observation = data.get("observation")
        if answer.get("type") != "observation" or not isinstance(observation, dict):
            raise OpenEnvError(
                f"OpenEnv server {self.url} answered {what} with {str(raw)[:120]!r}, not an "
                "observation"
            )
        reward, done = data.get("reward"), data.get("done", False)
        reward = 0.0 if reward is None else reward
        number = isinstance(reward, int | float) and not isinstance(reward, bool)
        if not number or not math.isfinite(reward):
            raise OpenEnvError(f"OpenEnv server {self.url} answered {what} with reward {reward!r}")
        if not isinstance(done, bool):
            raise OpenEnvError(f"OpenEnv server {self.url} answered {what} with done {done!r}")
        return observation, float(reward), done

    def show(self, observation: Mapping[str, Any]) -> str:
        """An observation as the text of a user message."""
        if self.observation_field is not None:
            value = observation.get(self.observation_field, "")
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        shown = {k: v for k, v in observation.items() if k not in _NOT_SHOWN}
        return json.dumps(shown, ensure_ascii=False)

    def close(self) -> None:
        """Stop the in-process server, if this serves the environment itself."""
        if self._server is not None:
            self._server.close()
