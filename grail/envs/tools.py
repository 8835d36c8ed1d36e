"""Tools an environment offers the policy: described to it, called from its text, answered.

An episode may offer tools, plain Python functions (sync or `async def`) with type hints and a
Google-style docstring. `ToolBox` turns them into the JSON schemas a chat template's `tools=`
argument takes (transformers' `get_json_schema`, so the model sees them exactly as transformers
would describe them), finds the calls in an assistant turn, runs them and writes each result as
the template's tool message.

Call format: Qwen2.5's (Hermes'), what Qwen2.5's chat template renders for an assistant's
`tool_calls` and what vLLM's `hermes` tool parser reads back:

    <tool_call>
    {"name": "lookup", "arguments": {"key": "x"}}
    </tool_call>

A turn may hold several such blocks (run in order) and text around them (ignored); a turn with no
`<tool_call>` is an answer, not a tool turn. As in vLLM's parser, a block is the text between
`<tool_call>` and the next `</tool_call>`, and JSON ignores the whitespace around the object.
Stricter than vLLM where it would guess: a block left open (vLLM parses the rest of the text) and
a call without an `arguments` object are malformed.

Whose fault is what. A malformed block, an unknown tool, arguments that do not fit the function,
a tool that raises or returns what JSON cannot encode: the policy's mistakes, which it must be
able to learn from, so each becomes a short `error: ...` tool message and is counted in
`ToolTurn.errors`; the episode goes on. A tool that does not return within the deadline is the
environment's failure, not the policy's: `ToolTimeout`, which the turn loop reports naming the
environment and the seed.

Pure: nothing here imports torch (transformers is imported when a ToolBox is built; describing a
function makes transformers import torch).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grail.core.errors import first_line
from grail.core.threads import in_daemon_thread

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_SHAPE = '<tool_call>\n{"name": <tool>, "arguments": {...}}\n</tool_call>'
_MAX_ERROR_CHARS = 300  # an error message is for the model to read: a line, not a traceback

# The JSON types a schema names, as the Python types `json.loads` gives (bool is not a number).
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


class ToolTimeout(TimeoutError):
    """A tool did not return within the turn's deadline: the environment's failure (a hung tool),
    not the policy's mistake. Its thread, if it had one, is abandoned (a daemon)."""


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call, as the policy wrote it (the tool may still be unknown)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A `<tool_call>` block that is not a call; `error` is what the model is told."""

    error: str


@dataclass(frozen=True)
class ToolTurn:
    """The environment's answer to a turn holding tool calls.

    `messages`: one {"role": "tool", "content": ...} per block, in order (the chat template's tool
    message). `calls`: well-formed calls of known tools, whether or not they then failed;
    `errors`: the policy's mistakes (malformed blocks, unknown tools, bad arguments, tools that
    raised or returned what JSON cannot encode), one per failed block; `seconds`: the turn's wall
    time."""

    messages: list[dict[str, str]]
    calls: int
    errors: int
    seconds: float


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall] | None:
    """The `<tool_call>` blocks of an assistant turn, in order; None when it has none (an answer).

    A block left open ends the list: everything after its `<tool_call>` is its (unclosed) body."""
    if CALL_OPEN not in text:
        return None
    calls: list[ToolCall | MalformedCall] = []
    start = text.find(CALL_OPEN)
    while start != -1:
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        if end == -1:
            calls.append(MalformedCall(f"error: unclosed {CALL_OPEN}; write {CALL_SHAPE}"))
            break
        calls.append(_parse_call(text[body_start:end]))
        start = text.find(CALL_OPEN, end + len(CALL_CLOSE))
    return calls


def _parse_call(body: str) -> ToolCall | MalformedCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return MalformedCall(
            f"error: tool call is not valid JSON ({exc.msg} at char {exc.pos}); write {CALL_SHAPE}"
        )
    if not isinstance(call, dict):
        return MalformedCall(f"error: tool call must be a JSON object; write {CALL_SHAPE}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(f'error: tool call needs a "name" string; write {CALL_SHAPE}')
    if "arguments" not in call:
        return MalformedCall(f'error: tool call of {name} has no "arguments"; write {CALL_SHAPE}')
    arguments = call["arguments"]
    if not isinstance(arguments, dict):
        return MalformedCall(
            f'error: "arguments" of {name} must be a JSON object, got {_json_type(arguments)}; '
            f"write {CALL_SHAPE}"
        )
    return ToolCall(name, arguments)


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    return next((name for name, fits in _JSON_TYPES.items() if fits(value)), type(value).__name__)


def _fits(value: Any, schema: dict[str, Any]) -> bool:
    """Whether `value` has a type `schema` allows (top level only: cheap, and what a model most
    often gets wrong). Types the schema does not name (Any, image, ...) are not checked."""
    if value is None and schema.get("nullable"):
        return True
    if "anyOf" in schema:
        return any(_fits(value, option) for option in schema["anyOf"])
    types = schema.get("type")
    names = [types] if isinstance(types, str) else list(types or [])
    known = [name for name in names if name in _JSON_TYPES]
    if known and not any(_JSON_TYPES[name](value) for name in known):
        return False
    return "enum" not in schema or value in schema["enum"]


def _got(value: Any) -> str:
    """A parsed value for an error message: its JSON type and text ("integer 7", "null")."""
    text = json.dumps(value, ensure_ascii=False)
    return text if value is None else f"{_json_type(value)} {text}"


def _wanted(schema: dict[str, Any]) -> str:
    """What a schema asks for, in a few words ("integer", "string or null", "one of [...]")."""
    if "enum" in schema:
        return f"one of {json.dumps(schema['enum'])}"
    if "anyOf" in schema:
        return " or ".join(_wanted(option) for option in schema["anyOf"])
    types = schema.get("type")
    names = [types] if isinstance(types, str) else list(types or [])
    return " or ".join([*names, *(["null"] if schema.get("nullable") else [])])


def _describe(fn: Callable[..., Any]) -> dict[str, Any]:
    """fn's JSON schema as transformers builds it; a ValueError naming fn and what is missing."""
    from transformers.utils import get_json_schema

    label = getattr(fn, "__name__", repr(fn))
    try:
        schema: dict[str, Any] = get_json_schema(fn)
    except Exception as exc:  # transformers' DocstringParsingException, TypeHintParsingException
        raise ValueError(f"tool {label} cannot be described to the model: {exc}") from exc
    for param in inspect.signature(fn).parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise ValueError(
                f"tool {label}: parameter {param.name!r} cannot be passed by name "
                f"({param.kind.description}); a tool's arguments come as a JSON object"
            )
    return schema


class ToolBox:
    """The tools of one episode: their schemas for the chat template, and `answer` for a turn."""

    def __init__(self, functions: Sequence[Callable[..., Any]]) -> None:
        self._tools: dict[str, Callable[..., Any]] = {}
        self._schemas: dict[str, dict[str, Any]] = {}
        self._parameters: dict[str, Mapping[str, inspect.Parameter]] = {}
        for fn in functions:
            schema = _describe(fn)
            name = schema["function"]["name"]
            if name in self._tools:
                raise ValueError(f"two tools are named {name!r}; tool names must be unique")
            self._tools[name] = fn
            self._schemas[name] = schema
            self._parameters[name] = inspect.signature(fn).parameters

    @property
    def names(self) -> list[str]:
        """The tools' names, in the order given (what the model calls them by)."""
        return list(self._tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """What `tokenizer.apply_chat_template(..., tools=...)` takes (copies: safe to edit)."""
        return copy.deepcopy(list(self._schemas.values()))

    async def answer(self, text: str, deadline_s: float) -> ToolTurn | None:
        """Run the calls in `text`, in order, and answer each with a tool message; None when the
        text holds no `<tool_call>` (the turn is an answer for the environment).

        `deadline_s` bounds the whole turn (all its calls): the environment's step deadline. A
        tool still running when it passes raises `ToolTimeout`; everything else a call can get
        wrong is an `error: ...` message and counts in `errors`."""
        parsed = parse_tool_calls(text)
        if parsed is None:
            return None
        started = time.monotonic()
        messages: list[dict[str, str]] = []
        calls = errors = 0
        for call in parsed:
            if isinstance(call, MalformedCall):
                content, ok = call.error, False
            else:
                left = deadline_s - (time.monotonic() - started)
                content, ok = await self._run(call, left, deadline_s)
                calls += int(call.name in self._tools)
            errors += not ok
            messages.append({"role": "tool", "content": content})
        return ToolTurn(messages, calls, errors, time.monotonic() - started)

    def _check(self, call: ToolCall) -> str | None:
        """What is wrong with the call's tool or arguments, None when it can run."""
        if call.name not in self._tools:
            return f"error: unknown tool {call.name!r}; tools: {', '.join(self._tools) or 'none'}"
        parameters = self._parameters[call.name]
        unexpected = [key for key in call.arguments if key not in parameters]
        if unexpected:
            return (
                f"error: {call.name}() got unexpected argument {unexpected[0]!r}; "
                f"arguments: {', '.join(parameters) or 'none'}"
            )
        for key, param in parameters.items():
            if key not in call.arguments and param.default is param.empty:
                return f"error: {call.name}() missing argument {key!r}"
        properties = self._schemas[call.name]["function"]["parameters"].get("properties", {})
        for key, value in call.arguments.items():
            schema = properties.get(key, {})
            if not _fits(value, schema):
                return _short(
                    f"error: {call.name}() argument {key!r} must be {_wanted(schema)}, "
                    f"got {_got(value)}"
                )
        return None

    async def _run(self, call: ToolCall, left_s: float, deadline_s: float) -> tuple[str, bool]:
        """(tool message content, whether the call succeeded)."""
        problem = self._check(call)
        if problem is not None:
            return problem, False
        late = ToolTimeout(
            f"tool {call.name!r} did not return within the {deadline_s:g} s deadline"
        )
        if left_s <= 0:
            raise late
        task = asyncio.ensure_future(_invoke(self._tools[call.name], call.arguments, call.name))
        try:
            done, _ = await asyncio.wait({task}, timeout=left_s)
        finally:  # past the deadline, or this turn cancelled: an async tool is cancelled, a
            task.cancel()  # sync one's daemon thread abandoned (a no-op on a finished task)
        if not done:
            raise late
        try:
            result = task.result()
        except Exception as exc:
            raised = type(exc).__name__ + (f": {first_line(exc)}" if str(exc) else "")
            return _short(f"error: {call.name} raised {raised}"), False
        if isinstance(result, str):
            return result, True
        try:
            return json.dumps(result, ensure_ascii=False, allow_nan=False), True
        except (TypeError, ValueError) as exc:
            return _short(f"error: {call.name} returned what JSON cannot encode: {exc}"), False


async def _invoke(fn: Callable[..., Any], arguments: dict[str, Any], name: str) -> Any:
    """fn(**arguments): awaited if async; in a daemon thread if sync, so that a hung tool blocks
    neither the event loop nor the interpreter's exit."""
    if inspect.iscoroutinefunction(fn):
        result = await fn(**arguments)
    else:
        call = functools.partial(fn, **arguments)
        result = await in_daemon_thread(call, name=f"grail-tool-{name}")
    if inspect.isawaitable(result):  # a plain callable that returned a coroutine
        result = await result
    return result


def _short(message: str) -> str:
    return message if len(message) <= _MAX_ERROR_CHARS else message[: _MAX_ERROR_CHARS - 3] + "..."
