"""What the built-in server lets in (docs/protocols.md): the per-request limits (`Limits`, one
``grail-serve`` flag each, checked before any tokenizing: 400 naming the flag), and the admission
of sequences into the engine's queue (`Admission`: 503 while it is full)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from grail.core.http_api import APIError

# 8 MiB holds about 1.2 million token ids as JSON (at most 7 bytes each with the comma): the
# harness's largest request, 256 sequences of which n share a prompt, carries 256 / n prompts, so
# 8 MiB is 128 prompts of 9k tokens at n=2, or 16 of 75k tokens at n=16. It parses in ~0.15 s.
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
DEFAULT_MAX_N = 1024  # GRPO groups are 2 to a few hundred samples
# The harness's client keeps at most 64 requests (generation.max_concurrency) of at most 256
# sequences (the batch size) in flight: 64 full batches waiting are what it sends at most.
QUEUED_BATCHES = 64


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, and how much work may wait in it; each field is
    the `grail-serve` flag of the same name (`for_engine` gives the defaults)."""

    max_request_bytes: int
    max_n: int
    #: prompts x n x max_tokens of one request
    max_request_tokens: int
    #: sequences submitted and not finished (waiting or decoding)
    max_queued_seqs: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    @classmethod
    def for_engine(
        cls,
        max_batch_size: int,
        max_model_len: int,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_n: int = DEFAULT_MAX_N,
        max_request_tokens: int | None = None,
        max_queued_seqs: int | None = None,
    ) -> Limits:
        """The limits of a server with this batch size and context; None sizes a limit to them:
        a request may generate one full batch (max_batch_size sequences of max_model_len tokens,
        so a request the engine can decode at once is never refused), and 64 full batches may
        wait."""
        return cls(
            max_request_bytes=max_request_bytes,
            max_n=max_n,
            max_request_tokens=(
                max_batch_size * max_model_len if max_request_tokens is None else max_request_tokens
            ),
            max_queued_seqs=(
                QUEUED_BATCHES * max_batch_size if max_queued_seqs is None else max_queued_seqs
            ),
        )


def check_request_size(limits: Limits, prompts: int, n: int, max_tokens: int) -> None:
    """400 naming the limit and its flag when a request asks too much; before any tokenizing."""
    if n > limits.max_n:
        raise APIError(
            f"n={n} is more than this server allows per prompt (--max-n {limits.max_n})",
            param="n",
        )
    sequences = prompts * n
    if sequences > limits.max_queued_seqs:
        raise APIError(
            f"the request asks for {sequences} sequences ({prompts} prompt(s) x n={n}), more "
            f"than the server ever holds at once (--max-queued-seqs {limits.max_queued_seqs}); "
            "split the prompts over several requests",
            param="prompt" if prompts > 1 else "n",
        )
    tokens = sequences * max_tokens
    if tokens > limits.max_request_tokens:
        raise APIError(
            f"the request may generate {tokens} tokens ({prompts} prompt(s) x n={n} x "
            f"max_tokens={max_tokens}), more than one request may "
            f"(--max-request-tokens {limits.max_request_tokens}); lower n or max_tokens, or "
            "split the prompts over several requests",
            param="max_tokens",
        )


class Admission:
    """Counts the sequences submitted to the engine and not finished (waiting or decoding), and
    refuses a request that would take them past the limit: 503, since the same request succeeds
    once the engine has worked through its queue (the harness's client retries 503)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.unfinished = 0
        self._lock = threading.Lock()

    def reserve(self, count: int) -> None:
        with self._lock:
            if self.unfinished + count > self.limit:
                raise APIError(
                    f"the server is busy: {self.unfinished} sequences are waiting or decoding and "
                    f"this request adds {count}, more than --max-queued-seqs {self.limit} in "
                    "all; retry later",
                    status=503,
                )
            self.unfinished += count

    def release(self, count: int) -> None:
        with self._lock:
            self.unfinished -= count


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token stands for: a text of more than ``max_model_len`` times this
    cannot fit the context, whatever it tokenizes to. Vocabulary entries spell a byte-level BPE
    token one character per byte (a text character is at least one byte), a SentencePiece one
    with its own characters, so an entry is never shorter than the text it matches."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def check_text_length(chars: int, limit: int, what: str, param: str) -> None:
    if chars > limit:
        raise APIError(
            f"{what} has {chars} characters, more than the model's context can hold (at most "
            f"{limit} characters: the context length in tokens times the longest token); "
            "shorten it",
            param=param,
        )


def message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' contents (text parts of list contents included)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            texts = (part.get("text") for part in content if isinstance(part, dict))
            total += sum(len(text) for text in texts if isinstance(text, str))
    return total
