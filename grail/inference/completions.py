"""What a completion request and its answer are, for every backend (built-in, vLLM, SGLang):
`SamplingParams`, `Completion`, the one request body the client sends (`request_body`) and the
checked parsing of each backend's answer (`parse_completions`). Pure: no I/O; the client that
sends them is grail/inference/client.py, the server facts they rely on are in docs/protocols.md.

Prompts go as token ids and the returned token ids are what we train on; text is only for
scoring. So an answer without `token_ids`, or with a log-probability list of another length, is
an error, never an empty or misaligned completion. The answers differ in two details, handled by
`backend`: vLLM and the built-in server send a -inf log-probability as -9999.0, SGLang as `null`
(pydantic writes infinities as null); vLLM may end a sample with "repetition" (read as "stop"),
SGLang can leave `finish_reason` null, which is an error here rather than a guess.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from grail.core.choices import BACKENDS, Backend

# vLLM sends -inf log-probabilities as this value (JSON has no infinity).
VLLM_NEG_INF = -9999.0
#: finish reasons a Completion carries: "stop" (EOS or a stop string), "length" (max_tokens or the
#: context length), "abort" (the server cancelled the request)
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
# Other spellings, per backend, of the same three reasons.
_FINISH_ALIASES: dict[str, dict[str, str]] = {
    "builtin": {},
    "vllm": {"repetition": "stop"},  # vLLM's opt-in repetition detector ended the sample
    "sglang": {},
}
# Log-probabilities are <= 0; a little slack for float round-off in the server.
_LOGPROB_SLACK = 1e-3
#: Fields the client sends itself; `extra_body` may not set them.
RESERVED_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "n",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "seeds",
        "logprobs",
        "return_token_ids",
        "sampled_spans",
    }
)


class GenerationError(RuntimeError):
    """A completion request failed for good (after the SDK's retries, or at once for 4xx and
    malformed answers). `attempts` is how many HTTP attempts were made (at most)."""

    def __init__(self, message: str, *, attempts: int, status_code: int | None = None) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.status_code = status_code


class MalformedResponseError(GenerationError):
    """The server answered 200 with a body that is not a valid completion response."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, all of them sent explicitly on every request.

    top_k = -1 disables top-k. Log-probabilities match the trainer's log-softmax(logits / T) only
    with top_p = 1 and top_k = -1 (or a server that reports processed log-probabilities).
    `stop_token_ids` and `ignore_eos` (never stop on EOS) are sent only when set, so a request
    that does not use them is what it always was; vLLM, SGLang and the built-in server take both
    (docs/protocols.md).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int, got {self.top_k!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if isinstance(self.stop, str):  # a bare string would be sent as a list of characters
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")


@dataclass(frozen=True)
class Completion:
    """One sampled completion: the server's token ids, one behaviour log-probability per token
    (-inf where the server sent vLLM's -9999.0), why it stopped ("stop", "length", "abort"), and
    its text (for scoring only)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


def check_prompt(prompt_ids: Sequence[int], name: str = "prompt_ids") -> list[int]:
    ids = list(prompt_ids)
    if not ids:
        raise ValueError(f"{name} is empty")
    for i, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"{name}[{i}] = {tok!r} is not a non-negative int token id")
    return ids


def check_seed(seed: object, name: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{name} must be an int, got {seed!r}")
    return seed


def check_seed_count(prompts: Sequence[object], seeds: Sequence[object]) -> None:
    """One seed per prompt (a client's `complete_many`, the fleet's before it splits a batch)."""
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds (one per prompt)")


def request_body(
    model: str,
    prompts: Sequence[Sequence[int]],
    n: int,
    sampling: SamplingParams,
    seeds: Sequence[int],
    spans: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> dict[str, Any]:
    """The JSON body of one /v1/completions request for `prompts` (before the client's
    `extra_body`). One prompt goes as a flat token-id list with the standard `seed`; several go
    as a list of token-id lists with the built-in server's `seeds` extension, one per prompt
    (sample i of prompt j is sampled with seeds[j] + i). `spans` (the built-in server's
    `sampled_spans` extension, one list per prompt): the [start, end) positions of each prompt's
    tokens that the policy sampled (empty lists for an episode's first turn), so that the
    server's prefix cache keeps the samples and continues them
    (grail/inference/builtin/prefix_cache.py); not sent when None."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompts[0]) if len(prompts) == 1 else [list(p) for p in prompts],
        "n": n,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "stop": list(sampling.stop),
        "logprobs": 0,
        "return_token_ids": True,
    }
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if spans is not None:
        if len(spans) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(spans)} lists of spans")
        body["sampled_spans"] = [[[start, end] for start, end in s] for s in spans]
    if len(prompts) == 1:
        body["seed"] = seeds[0]
    else:
        body["seeds"] = list(seeds)
    return body


def parse_completions(
    data: Any, n: int, backend: Backend = Backend.builtin, *, prompts: int = 1
) -> list[Completion]:
    """Parse an OpenAI completion response into `prompts * n` Completions, ordered by choice
    index (prompt-major: choice p * n + i is sample i of prompt p).

    Each choice needs `token_ids` (ints), `logprobs.token_logprobs` (one number per token; -9999.0
    is read as -inf, and so is null from SGLang), `finish_reason` (one of FINISH_REASONS or a
    backend's alias for one) and `text`. Anything else raises MalformedResponseError. The ids are
    kept exactly as sent (EOS included when the sample stopped on it).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")

    def bad(what: str) -> MalformedResponseError:
        return MalformedResponseError(f"malformed completion response: {what}", attempts=1)

    total = prompts * n
    if not isinstance(data, dict):
        raise bad(f"expected a JSON object, got {type(data).__name__}")
    choices = data.get("choices")
    if not isinstance(choices, list):
        raise bad(f"no 'choices' list (keys: {sorted(data)})")
    if len(choices) != total:
        asked = f"n={n}" if prompts == 1 else f"{prompts} prompts x n={n} = {total}"
        raise bad(f"asked for {asked} completions, got {len(choices)} choices")
    by_index: dict[int, Completion] = {}
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            raise bad(f"choice {position} is not an object")
        index = choice.get("index", position)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < total:
            raise bad(f"choice {position} has index {index!r}, expected 0..{total - 1}")
        if index in by_index:
            raise bad(f"choice index {index} appears twice")
        by_index[index] = _parse_choice(choice, index, bad, backend)
    return [by_index[i] for i in range(total)]


def _parse_choice(
    choice: dict, index: int, bad: Callable[[str], Exception], backend: str
) -> Completion:
    where = f"choices[{index}]"
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise bad(
            f"{where} has no 'token_ids': the server ignored return_token_ids=true "
            "(vLLM needs >= 0.10.2; SGLang and the built-in server support it)"
        )
    if not isinstance(token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids
    ):
        raise bad(f"{where}.token_ids is not a list of non-negative ints")
    if not token_ids:
        raise bad(f"{where} has no tokens")
    logprobs = choice.get("logprobs")
    token_logprobs = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(token_logprobs, list):
        raise bad(f"{where} has no 'logprobs.token_logprobs' list (was logprobs=0 honoured?)")
    values: list[float] = []
    for j, value in enumerate(token_logprobs):
        if value is None and backend == "sglang":
            values.append(-math.inf)
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad(f"{where}.logprobs.token_logprobs[{j}] = {value!r} is not a number")
        value = float(value)
        if value == VLLM_NEG_INF:
            value = -math.inf
        elif math.isnan(value) or value > _LOGPROB_SLACK:
            raise bad(f"{where}.logprobs.token_logprobs[{j}] = {value} is not a log-probability")
        values.append(value)
    if len(values) != len(token_ids):
        raise bad(f"{where} has {len(token_ids)} token ids but {len(values)} log-probabilities")
    finish_reason = choice.get("finish_reason")
    if not isinstance(finish_reason, str):
        raise bad(f"{where}.finish_reason is {finish_reason!r}, expected one of {FINISH_REASONS}")
    finish_reason = _FINISH_ALIASES[backend].get(finish_reason, finish_reason)
    if finish_reason not in FINISH_REASONS:
        raise bad(f"{where}.finish_reason {finish_reason!r} is not one of {FINISH_REASONS}")
    text = choice.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}.text is {text!r}, expected a string")
    return Completion(token_ids=token_ids, logprobs=values, finish_reason=finish_reason, text=text)


def decode_json(body: bytes) -> Any:
    """A response body's JSON, read by orjson (4x json's speed on answers with log-probs); a
    body orjson refuses (NaN or Infinity, which some servers write and json reads) by json."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(body)
    except ValueError:
        text = body[:200].decode("utf-8", "replace")
        raise MalformedResponseError(
            f"malformed completion response: body is not JSON: {text!r}", attempts=1
        ) from None


def error_message(body: Any) -> str | None:
    """The server's own words in a JSON error answer: OpenAI's {"error": {"message"}},
    FastAPI's {"detail"}, SGLang's and the built-in server's {"message"}; None if it has none."""
    if isinstance(body, dict):
        for key in ("message", "detail", "error"):
            value = body.get(key)
            if value:
                if isinstance(value, dict) and value.get("message"):
                    return str(value["message"])
                return str(value)
    return None
