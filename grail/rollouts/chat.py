"""A conversation's token ids as the tokenizer's chat template renders it, turn by turn
(`ChatRenderer`): an episode's first prompt, the glue after a sampled turn, and each environment
turn as a suffix of what was already sent (grail/rollouts/episodes.py has the token rules)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grail.core.errors import UserError

_SENTINEL = "\x00grail-assistant-turn\x00"


class TemplateError(UserError):
    """The chat template cannot be continued turn by turn without re-tokenizing."""


def _ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding-like mapping for tokenize=True; 4.x a plain list.
    if not isinstance(encoded, list):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


class ChatRenderer:
    """Token ids of a conversation as the tokenizer's chat template renders it, turn by turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.closing = self._closing_ids()
        # Added tokens at which a text may be cut and tokenized in two (`suffix`): the tokenizer
        # splits its input at them before anything else, unless they absorb the whitespace
        # before them (lstrip), match normalized text or only whole words.
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        self._cuts = tuple(
            sorted(
                {t.content for t in added if not (t.lstrip or t.normalized or t.single_word)},
                key=len,
                reverse=True,
            )
        )
        self._cut_prefixes = {t[:k] for t in self._cuts for k in range(1, len(t))}
        self._longest_cut = max(map(len, self._cuts), default=0)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        generation_prompt: bool,
    ) -> list[int]:
        # What apply_chat_template(tokenize=True) does: the text, tokenized without adding
        # special tokens again. Written out so that `suffix`'s cut path tokenizes as this does.
        return self._encode(self.text(messages, tools, generation_prompt))

    def _encode(self, text: str) -> list[int]:
        return _ids(self.tokenizer(text, add_special_tokens=False))

    def _closing_ids(self) -> list[int]:
        """What the template writes after an assistant message's content (Qwen: <|im_end|>\\n)."""
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}],
            tokenize=False,
        )
        if _SENTINEL not in text:
            raise TemplateError("the chat template does not render an assistant message's content")
        closing = text[text.rindex(_SENTINEL) + len(_SENTINEL) :]
        return self._encode(closing)

    def glue(self, sampled: Sequence[int]) -> list[int]:
        """The closing tokens the policy did not sample: those after its end-of-turn token, or
        all of them when the turn stopped without it (cut at max_new_tokens)."""
        if self.closing and sampled and sampled[-1] == self.closing[0]:
            return self.closing[1:]
        return list(self.closing)

    def text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        generation_prompt: bool,
    ) -> str:
        """The conversation as the template writes it, not tokenized."""
        text = self.tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )
        assert isinstance(text, str)  # one conversation in, one text out
        return text

    def suffix(
        self,
        conversation: Sequence[Mapping[str, Any]],
        new: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> list[int]:
        """The ids the template adds for `new` messages after `conversation` (which ends with an
        assistant turn), up to and including the next generation prompt.

        Rendering and tokenizing the whole conversation twice a turn was the client's largest
        cost in benchmarks/episodes.py (~0.2 ms a render, most of it tokenizing). So the texts
        are compared first: where the new text starts with an added token the tokenizer splits
        at (Qwen's <|im_start|>), and no added token straddles the cut, the tokens of the whole
        are those of the part before it followed by those of the part after it, and only the
        new part is tokenized. Otherwise the token ids of both renders are compared
        (`token_suffix`)."""
        before = self.text(conversation, tools, generation_prompt=False)
        after = self.text([*conversation, *new], tools, generation_prompt=True)
        cut = len(before)
        if after.startswith(before) and after.startswith(self._cuts, cut):
            tail = before[max(0, cut - self._longest_cut + 1) :]
            if not any(tail[i:] in self._cut_prefixes for i in range(len(tail))):
                return self._encode(after[cut:])
        return self.token_suffix(conversation, new, tools)

    def token_suffix(
        self,
        conversation: Sequence[Mapping[str, Any]],
        new: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> list[int]:
        """`suffix` from the token ids of both renders, checking that the one is a prefix of the
        other."""
        before = self.render(conversation, tools, generation_prompt=False)
        after = self.render([*conversation, *new], tools, generation_prompt=True)
        if after[: len(before)] != before:
            at = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
            raise TemplateError(
                "the chat template renders the earlier turns differently once a message is added "
                f"(first difference at token {at}: {self.tokenizer.decode(before[at : at + 8])!r} "
                f"became {self.tokenizer.decode(after[at : at + 8])!r}); grail appends each turn "
                "to the tokens sampled so far and cannot train on such a template"
            )
        return after[len(before) :]
