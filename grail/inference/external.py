"""Servers the user runs (`generation.urls`): an OpenAI-compatible server that grail did not
start and never stops, e.g. a `grail-serve`, `vllm serve` or SGLang started by hand.

`external_server(backend, url, ...)` makes one. Its class is the backend's own manager class
(`BACKEND_CLASSES[backend]`) with `ExternalServer` in front, which replaces the process parts:

- launch = the start-up checks below, each failing with one line naming the URL
  (`ExternalServerError`), and then the run's initial weights loaded into the server;
- stop = let go of the connections (the server runs on, also after Ctrl-C or an error);
- is_alive / check_alive = an HTTP health check (the backend's `ready_path`), bounded;
- recover = check that it answers again and load the newest weights, else
  `ExternalServerGone`: grail cannot restart a server it did not start.

Everything else is the backend's: weight syncs go through its admin routes (the built-in
server's and SGLang's `/update_weights_from_disk`, vLLM's pause / reload / resume, which need
`VLLM_SERVER_DEV_MODE=1` in the server's environment), in place, never with a restart.

Start-up checks, in order:
1. reachable: GET `ready_path` answers 200 (connection refused, a timeout, another status);
2. an OpenAI server serving the model: GET /v1/models lists `model` (`generation.url_model`),
   or, with none named, exactly one model, which is then requested;
3. log-probabilities: a 1-token completion asking for them, parsed by the client's own
   `parse_completions` (token ids and one log-probability per token);
4. the weights: the trainer's initial weights, which the run wrote into its `weights`
   directory, are loaded through the disk route's admin endpoint, so the first batch is drawn
   from them. The server must read that path (a disk it shares with the trainer); if it cannot,
   or has no such route, the run stops here rather than train off-policy on the server's own
   weights.

Weights reach an external server from disk only: every sync writes them into the run's
`weights` directory (in the trainer's dtype: grail does not know the server's) and asks the
server to reload it. Every HTTP call is bounded: `check_timeout_s` for health and the model
list, the run's request timeout for the test completion, `weight_sync_timeout` for reloads.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from typing import Any

import httpx

from grail.core.choices import WeightSyncMode
from grail.core.server_urls import server_root
from grail.inference.backends import BACKEND_CLASSES
from grail.inference.backends.gpu import GpuServer
from grail.inference.completions import (
    MalformedResponseError,
    SamplingParams,
    error_message,
    parse_completions,
    request_body,
)
from grail.inference.errors import (
    ExternalServerError,
    ExternalServerGone,
    ServerError,
    WeightSyncError,
)
from grail.inference.process import ServerManager, SyncResult

logger = logging.getLogger(__name__)

#: seconds a health check or the model list may take
CHECK_TIMEOUT_S = 10.0
# The served model's name before `launch` has asked the server (ServerManager wants a name).
_UNKNOWN_MODEL = "(the one model the server lists)"


def _one_line(text: object) -> str:
    """The first line of an error's text: a user's server may answer with a page of it."""
    lines = str(text).strip().splitlines()
    return lines[0] if lines else type(text).__name__


class ExternalServer(ServerManager):
    """A server at `url` that grail did not start (module docstring). Put in front of a backend's
    manager class (`external_server`); `model_path` is the run's weights directory, which the
    server reloads at start and at every sync."""

    def __init__(
        self,
        url: str,
        model_path: str | os.PathLike[str],
        *,
        model: str | None,
        log_dir: str | os.PathLike[str],
        request_timeout_s: float = 120.0,
        check_timeout_s: float = CHECK_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        self.url = url
        self._root = server_root(url)
        self.requested_model = model
        self.request_timeout_s = float(request_timeout_s)
        self.check_timeout_s = float(check_timeout_s)
        self._check_client: httpx.Client | None = None
        if isinstance(self, GpuServer):
            # Never used to place anything (grail runs no process): they satisfy the GPU
            # backends' checks. dtype None: weights are written in the trainer's dtype.
            kwargs.update(device="cuda:0", dtype=None, weight_transfer="disk")
        super().__init__(model_path, model or _UNKNOWN_MODEL, log_dir=log_dir, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- addresses ----------------------------------------------------------------------------

    @property
    def root_url(self) -> str:
        return self._root

    @property
    def model_name(self) -> str:
        return self.served_model_name

    def served_dtype(self) -> str | None:
        return None  # unknown: the server casts what it loads to what it computes in

    def _where(self) -> str:
        return f"the {self.kind} server at {self.url}"

    # -- HTTP, bounded ------------------------------------------------------------------------

    def _http(self) -> httpx.Client:
        if self._check_client is None:
            self._check_client = httpx.Client(
                timeout=httpx.Timeout(self.check_timeout_s, connect=min(5.0, self.check_timeout_s)),
                headers=self._headers(),
                trust_env=False,  # the user's server, as the rollout client reaches it
            )
        return self._check_client

    def _get(self, path: str) -> httpx.Response | str:
        """GET `path` of the server: the response, or what kept it from answering."""
        try:
            return self._http().get(f"{self._root}{path}")
        except httpx.ConnectError:
            return "refuses connections (is it running, and listening there?)"
        except httpx.TimeoutException:
            return f"did not answer GET {path} within {self.check_timeout_s:g} s"
        except httpx.HTTPError as exc:
            return f"cannot be reached ({type(exc).__name__}: {_one_line(exc)})"

    def _health_problem(self) -> str | None:
        """Why the server does not answer its health route; None when it does."""
        answer = self._get(self.ready_path)
        if isinstance(answer, str):
            return answer
        if answer.status_code != 200:
            return f"answers GET {self.ready_path} with HTTP {answer.status_code}"
        return None

    # -- lifetime -----------------------------------------------------------------------------

    def start(self) -> None:
        raise ServerError(f"grail does not start {self._where()}: launch() checks it")

    def launch(self, timeout: float | None = None) -> float:
        """The start-up checks, then the run's initial weights loaded into the server; the
        seconds taken. Raises `ExternalServerError` (one line naming the URL) at the first
        check that fails."""
        t0 = time.perf_counter()
        problem = self._health_problem()
        if problem is not None:
            raise self._start_error(problem)
        self.served_model_name = self._served_model()
        self._check_logprobs()
        try:
            self.update_weights(self.model_path)
        except WeightSyncError as exc:
            raise self._start_error(
                f"could not load the run's weights from {self.model_path} ({_one_line(exc)}); it "
                "must read that directory (a disk it shares with the trainer) through its "
                "weight-reload route, and grail will not train on the server's own weights"
            ) from None
        self._ready = True
        seconds = time.perf_counter() - t0
        logger.info(
            "using %s (model %r, not started by grail), with the run's weights after %.1f s",
            self._where(),
            self.served_model_name,
            seconds,
        )
        return seconds

    def _start_error(self, what: str) -> ExternalServerError:
        return ExternalServerError(f"generation.urls: {self._where()} {what}")

    def _served_model(self) -> str:
        """The model to request: `requested_model` if the server lists it, else the one model
        it lists."""
        answer = self._get("/v1/models")
        if isinstance(answer, str):
            raise self._start_error(answer)
        names: list[Any] | None = None
        if answer.status_code == 200:
            with contextlib.suppress(ValueError, TypeError, KeyError):  # not a model list
                names = [card["id"] for card in answer.json()["data"]]
        if names is None or not all(isinstance(name, str) for name in names):
            raise self._start_error(
                f"is not an OpenAI-compatible server: GET /v1/models answered HTTP "
                f"{answer.status_code} without a model list"
            )
        listed = ", ".join(map(repr, names)) or "none"
        if self.requested_model is not None:
            if self.requested_model not in names:
                raise self._start_error(
                    f"does not serve the model {self.requested_model!r} "
                    f"(generation.url_model); it lists {listed}"
                )
            return self.requested_model
        if len(names) != 1:
            raise self._start_error(
                f"lists {len(names)} models ({listed}): name the one to request with "
                "generation.url_model"
            )
        return str(names[0])

    def _check_logprobs(self) -> None:
        """A 1-token completion asking for log-probabilities, parsed as every rollout is."""
        sampling = SamplingParams(max_tokens=1)
        body = request_body(self.served_model_name, [[0]], 1, sampling, [0])
        try:
            response = self._http().post(
                f"{self._root}/v1/completions", json=body, timeout=self.request_timeout_s
            )
        except httpx.HTTPError as exc:
            raise self._start_error(
                f"did not complete a 1-token prompt ({type(exc).__name__}: {_one_line(exc)})"
            ) from None
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code != 200:
            message = error_message(data) or response.text[:200]
            raise self._start_error(
                f"refused a 1-token completion with HTTP {response.status_code}: "
                f"{_one_line(message)}"
            )
        try:
            parse_completions(data, 1, self.kind)  # type: ignore[arg-type]
        except MalformedResponseError as exc:
            raise self._start_error(
                f"gives completions grail cannot train on ({_one_line(exc)}): it must return "
                "token ids and their log-probabilities"
            ) from None

    def is_alive(self) -> bool:
        return self._health_problem() is None

    def check_alive(self) -> None:
        """Raise `ExternalServerGone` if the server does not answer its health route."""
        problem = self._health_problem()
        if problem is not None:
            raise ExternalServerGone(
                f"{self._where()} {problem}; grail did not start it and cannot restart it"
            )

    def restart(self, model_path: str | os.PathLike[str]) -> float:
        raise ServerError(f"grail cannot restart {self._where()}: it did not start it")

    def sync_weights(
        self,
        checkpoint_dir: str | os.PathLike[str],
        mode: WeightSyncMode = WeightSyncMode.in_place,
        *,
        fallback: bool = True,
        weight_version: str | None = None,
    ) -> SyncResult:
        """The backend's in-place reload, without its restart fallback. A server that stopped
        answering raises `ExternalServerGone` (a run with it alone ends in that one line)."""
        try:
            return super().sync_weights(
                checkpoint_dir,
                WeightSyncMode.in_place,
                fallback=False,
                weight_version=weight_version,
            )
        except WeightSyncError as exc:
            problem = self._health_problem()
            if problem is None:
                raise
            raise ExternalServerGone(
                f"{self._where()} {problem} when given new weights; grail did not start it and "
                "cannot restart it"
            ) from exc

    def recover(self) -> float:
        """Check that the server answers again, serves the same model, and load the newest
        weights (`model_path`); the seconds taken. Raises `ExternalServerGone` otherwise."""
        t0 = time.perf_counter()
        problem = self._health_problem()
        if problem is not None:
            raise ExternalServerGone(
                f"{self._where()} {problem}, and grail cannot restart a server it did not start"
            )
        try:
            name = self._served_model()
            if name != self.served_model_name:
                raise ExternalServerError(f"now serves {name!r}, not {self.served_model_name!r}")
            self.update_weights(self.model_path)
        except (ExternalServerError, WeightSyncError) as exc:
            raise ExternalServerGone(
                f"{self._where()} answers again but cannot serve the run: {_one_line(exc)}"
            ) from None
        self.recoveries += 1
        logger.warning("%s answers again, with the newest weights", self._where())
        return time.perf_counter() - t0

    def stop(self, timeout: float | None = None) -> None:
        """Let go of the connections; the server runs on (grail did not start it)."""
        for client in (self._control_client, self._check_client):
            if client is not None:
                client.close()
        self._control_client = self._check_client = None


@functools.cache
def external_class(backend: str) -> type[ExternalServer]:
    """`ExternalServer` in front of `backend`'s manager class."""
    base = BACKEND_CLASSES[backend]
    return type(f"External{base.__name__}", (ExternalServer, base), {})


def external_server(
    backend: str,
    url: str,
    model_path: str | os.PathLike[str],
    *,
    model: str | None,
    log_dir: str | os.PathLike[str],
    request_timeout_s: float = 120.0,
) -> ExternalServer:
    """The server of `backend` ("builtin", "vllm" or "sglang") at `url`, which will serve the
    weights in `model_path` once launched (module docstring)."""
    if backend not in BACKEND_CLASSES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_CLASSES)}, got {backend!r}")
    return external_class(backend)(
        url, model_path, model=model, log_dir=log_dir, request_timeout_s=request_timeout_s
    )
