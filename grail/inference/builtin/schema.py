"""The bodies the built-in server accepts (pydantic models): the OpenAI completion and chat
completion requests (the subset of vLLM's fields the engine implements, see `app`), and SGLang's
``/update_weights_from_disk`` request. What they ask is checked in `validation`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

# Lists are validated fail-fast (the first wrong element ends it): otherwise pydantic builds an
# error per wrong element, per branch of a union, and a body of a million floats as a prompt held
# the event loop for 90 s. A dict of unsupported settings is kept unvalidated for the same reason.
_Ids = Annotated[list[int], Field(fail_fast=True)]
_Texts = Annotated[list[str], Field(fail_fast=True)]


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions. Unknown fields are ignored (as vLLM)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: str | _Texts | None = None
    stop_token_ids: _Ids | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    # Accepted only at their neutral value: the engine does not implement them.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | _Ids | _Texts | Annotated[list[_Ids], Field(fail_fast=True)]
    seeds: _Ids | None = None  # extension: one seed per prompt (see the module docstring)
    # extension: per prompt, the [start, end) spans of its tokens that were sampled (`app`)
    sampled_spans: Annotated[list[list[_Ids]], Field(fail_fast=True)] | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[dict[str, Any]], Field(fail_fast=True)]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model_path: str = Field(min_length=1)
    weight_version: str | None = None
