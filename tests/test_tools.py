"""grail/envs/tools.py: tools described to the model as transformers describes them, calls parsed
from the policy's text in Qwen2.5's format, the policy's mistakes answered as error messages, a
hung tool an environment failure (ToolTimeout) that never blocks the interpreter's exit; and the
round trip through the tiny model's chat template."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from transformers.utils import get_json_schema

from grail.envs.tools import (
    MalformedCall,
    ToolBox,
    ToolCall,
    ToolTimeout,
    ToolTurn,
    parse_tool_calls,
)
from grail.models.tiny import build_tokenizer


def lookup(key: str, default: int | None = None) -> int:
    """Look a key up in the table.

    Args:
        key: The key to look up.
        default: What to give when the key is absent.
    """
    table = {"a": 1, "b": 2}
    if default is None:
        return table[key]
    return table.get(key, default)


def add(x: float, y: float) -> float:
    """Add two numbers.

    Args:
        x: The first number.
        y: The second number.
    """
    return x + y


def _answer(box: ToolBox, text: str, deadline_s: float = 5.0) -> ToolTurn:
    turn = asyncio.run(box.answer(text, deadline_s))
    assert turn is not None
    return turn


def _call(name: str, arguments: Any) -> str:
    """A call as Qwen2.5's template renders it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The tiny model's tokenizer and chat template (tests/test_models.py checks that the saved
    model's template is this one)."""
    return build_tokenizer()


# ---------------------------------------------------------------------------------------------
# Schemas


def test_schemas_are_what_transformers_gives_and_render_in_the_tiny_template(
    tokenizer: Any,
) -> None:
    box = ToolBox([lookup, add])
    assert box.names == ["lookup", "add"]
    assert box.schemas == [get_json_schema(lookup), get_json_schema(add)]
    box.schemas[0]["function"]["name"] = "edited"  # a copy: the box is unchanged
    assert box.schemas[0]["function"]["name"] == "lookup"

    user = {"role": "user", "content": "What is a?"}
    text = tokenizer.apply_chat_template(
        [user], tools=box.schemas, tokenize=False, add_generation_prompt=True
    )
    listed = text[text.index("<tools>\n") + len("<tools>\n") : text.index("\n</tools>")]
    assert [json.loads(line) for line in listed.split("\n")] == box.schemas
    # Qwen2.5's tools block, opening the system turn (the tiny template has no default prompt),
    # with the instruction the parser's format answers.
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert text.endswith(
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is a?<|im_end|>\n<|im_start|>assistant\n"
    )
    # A system message goes first in the system turn, and only there.
    system = {"role": "system", "content": "Be brief."}
    with_system = tokenizer.apply_chat_template([system, user], tools=box.schemas, tokenize=False)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert with_system.count("Be brief.") == 1 and with_system.count("<|im_start|>system") == 1


def _no_docstring(x: int) -> int:
    return x


def _undescribed_argument(x: int, y: int) -> int:
    """Add.

    Args:
        x: The first.
    """
    return x + y


def _untyped(x) -> int:
    """Echo.

    Args:
        x: A value.
    """
    return 1


def _varargs(*numbers: int) -> int:
    """Sum.

    Args:
        numbers: The numbers.
    """
    return sum(numbers)


@pytest.mark.parametrize(
    ("fn", "missing"),
    [
        (_no_docstring, "no docstring"),
        (_undescribed_argument, "no description for the argument 'y'"),
        (_untyped, "missing a type hint"),
        (_varargs, "'numbers' cannot be passed by name"),
    ],
)
def test_a_function_that_cannot_be_described_is_refused_naming_it(fn: Any, missing: str) -> None:
    with pytest.raises(ValueError, match=missing) as err:
        ToolBox([lookup, fn])
    assert fn.__name__ in str(err.value)


def test_two_tools_with_one_name_are_refused() -> None:
    with pytest.raises(ValueError, match="two tools are named 'lookup'"):
        ToolBox([lookup, add, lookup])


# ---------------------------------------------------------------------------------------------
# Parsing


def test_a_text_without_tool_call_is_an_answer() -> None:
    for text in ["42", "", "I would call </tool_call> but", "<tool_cal>{}</tool_cal>"]:
        assert parse_tool_calls(text) is None
        assert asyncio.run(ToolBox([lookup]).answer(text, 1.0)) is None


def test_one_and_several_calls_are_parsed_in_order() -> None:
    assert parse_tool_calls(_call("lookup", {"key": "a"})) == [ToolCall("lookup", {"key": "a"})]
    text = (
        "Let me check.\n"
        + _call("lookup", {"key": "a"})
        + "\nand\n"
        + '<tool_call>{"arguments": {"x": 1, "y": 2.5}, "name": "add"}</tool_call>'  # no newlines
        + "\n"
        + _call("lookup", {"key": "b", "default": 0})
        + " trailing text"
    )
    assert parse_tool_calls(text) == [
        ToolCall("lookup", {"key": "a"}),
        ToolCall("add", {"x": 1, "y": 2.5}),
        ToolCall("lookup", {"key": "b", "default": 0}),
    ]


@pytest.mark.parametrize(
    ("block", "says"),
    [
        ('<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}', "unclosed <tool_call>"),
        ('<tool_call>\n{"name": "lookup", "arguments": {"key": }}\n</tool_call>', "not valid JSON"),
        ("<tool_call>\n\n</tool_call>", "not valid JSON"),
        ('<tool_call>\n["lookup", {"key": "a"}]\n</tool_call>', "must be a JSON object"),
        ('<tool_call>\n{"arguments": {"key": "a"}}\n</tool_call>', 'needs a "name" string'),
        ('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', 'needs a "name" string'),
        ('<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', 'needs a "name" string'),
        ('<tool_call>\n{"name": "lookup"}\n</tool_call>', 'has no "arguments"'),
        (
            _call("lookup", '{"key": "a"}'),
            '"arguments" of lookup must be a JSON object, got string',
        ),
        (_call("lookup", ["a"]), "must be a JSON object, got array"),
        (_call("lookup", None), "must be a JSON object, got null"),
    ],
)
def test_every_malformed_shape_is_an_error_the_model_can_read(block: str, says: str) -> None:
    parsed = parse_tool_calls("Calling. " + block)
    assert parsed is not None and len(parsed) == 1
    (malformed,) = parsed
    assert isinstance(malformed, MalformedCall)
    assert malformed.error.startswith("error: ") and says in malformed.error
    assert '{"name": <tool>, "arguments": {...}}' in malformed.error  # how to write one
    turn = _answer(ToolBox([lookup]), block)
    assert turn.messages == [{"role": "tool", "content": malformed.error}]
    assert (turn.calls, turn.errors) == (0, 1)


def test_an_unclosed_block_ends_the_calls_after_the_good_ones() -> None:
    text = _call("lookup", {"key": "a"}) + '\n<tool_call>\n{"name": "lookup", "argu'
    turn = _answer(ToolBox([lookup]), text)
    assert [m["content"] for m in turn.messages][0] == "1"
    assert turn.messages[1]["content"].startswith("error: unclosed <tool_call>")
    assert (turn.calls, turn.errors) == (1, 1)


# ---------------------------------------------------------------------------------------------
# Answering


def test_calls_run_in_order_and_answer_as_tool_messages() -> None:
    text = (
        _call("lookup", {"key": "b"})
        + _call("add", {"x": 1, "y": 2.5})
        + _call("lookup", {"key": "a"})
    )
    turn = _answer(ToolBox([lookup, add]), text)
    assert turn.messages == [
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": "3.5"},
        {"role": "tool", "content": "1"},
    ]
    assert (turn.calls, turn.errors) == (3, 0)
    assert 0 <= turn.seconds < 5


def _raises(key: str) -> str:
    """Fail.

    Args:
        key: A key.
    """
    return {}[key]  # type: ignore[no-any-return]


def _times_out_itself() -> str:
    """A tool whose own network call timed out."""
    raise TimeoutError("upstream did not answer")


def _raises_bare() -> str:
    """Fail without a message."""
    raise RuntimeError


def _gives_a_set() -> Any:
    """Give what JSON cannot encode."""
    return {1}


def _gives_nan() -> float:
    """Give NaN, which is not JSON."""
    return float("nan")


def _shout(word: str, times: int = 1) -> str:
    """Shout a word.

    Args:
        word: The word.
        times: How many times.
    """
    return (word.upper() + "!") * times


def _pick(colour: str) -> str:
    """Pick a colour.

    Args:
        colour: The colour. (choices: ["red", "blue"])
    """
    return colour


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (_call("lookp", {"key": "a"}), "error: unknown tool 'lookp'; tools: lookup, add, _raises"),
        (_call("lookup", {}), "error: lookup() missing argument 'key'"),
        (
            _call("lookup", {"kee": "a"}),
            "error: lookup() got unexpected argument 'kee'; arguments: key, default",
        ),
        (
            _call("lookup", {"key": 7}),
            "error: lookup() argument 'key' must be string, got integer 7",
        ),
        (
            _call("lookup", {"key": "a", "default": "0"}),
            "error: lookup() argument 'default' must be integer or null, got string \"0\"",
        ),
        (
            _call("add", {"x": True, "y": 1}),
            "error: add() argument 'x' must be number, got boolean true",
        ),
        (_call("lookup", {"key": None}), "error: lookup() argument 'key' must be string, got null"),
        (_call("lookup", {"key": "x"}), "error: lookup raised KeyError: 'x'"),
        (_call("_raises", {"key": "x"}), "error: _raises raised KeyError: 'x'"),
    ],
)
def test_the_policys_mistakes_are_error_messages_and_counted(call: str, error: str) -> None:
    box = ToolBox([lookup, add, _raises])
    turn = _answer(box, call + _call("add", {"x": 1, "y": 1}))  # the next call still runs
    assert turn.messages == [
        {"role": "tool", "content": error},
        {"role": "tool", "content": "2"},
    ]
    unknown = "unknown tool" in error
    assert (turn.calls, turn.errors) == (1 if unknown else 2, 1)


@pytest.mark.parametrize(
    ("tool", "arguments", "content", "ok"),
    [
        (
            _times_out_itself,
            {},
            "error: _times_out_itself raised TimeoutError: upstream did not answer",
            False,
        ),
        (_raises_bare, {}, "error: _raises_bare raised RuntimeError", False),
        (
            _gives_a_set,
            {},
            "error: _gives_a_set returned what JSON cannot encode: "
            "Object of type set is not JSON serializable",
            False,
        ),
        (
            _gives_nan,
            {},
            "error: _gives_nan returned what JSON cannot encode: "
            "Out of range float values are not JSON compliant",
            False,
        ),
        (_shout, {"word": "hé", "times": 2}, "HÉ!HÉ!", True),
        (_pick, {"colour": "blue"}, "blue", True),
        (
            _pick,
            {"colour": "green"},
            'error: _pick() argument \'colour\' must be one of ["red", "blue"], got string "green"',
            False,
        ),
    ],
)
def test_results_and_failures_of_a_tool(
    tool: Any, arguments: dict[str, Any], content: str, ok: bool
) -> None:
    turn = _answer(ToolBox([tool]), _call(tool.__name__, arguments))
    (message,) = turn.messages
    assert message["role"] == "tool"
    assert message["content"].removesuffix(": nan") == content  # some Pythons name the value
    assert (turn.calls, turn.errors) == (1, 0 if ok else 1)


async def _fetch(key: str) -> dict[str, Any]:
    """Fetch a record.

    Args:
        key: Its key.
    """
    await asyncio.sleep(0)
    return {"key": key, "values": [1, 2.5, None], "note": "café"}


def test_an_async_tool_is_awaited_and_a_non_string_result_is_json() -> None:
    turn = _answer(ToolBox([_fetch]), _call("_fetch", {"key": "k"}))
    assert turn.messages == [
        {"role": "tool", "content": '{"key": "k", "values": [1, 2.5, null], "note": "café"}'}
    ]
    assert (turn.calls, turn.errors) == (1, 0)


class _Counter:
    """An episode's state, changed by its tools (bound methods)."""

    def __init__(self) -> None:
        self.total = 0

    def bump(self, by: int) -> int:
        """Add to the total.

        Args:
            by: How much to add.
        """
        self.total += by
        return self.total


def test_bound_methods_are_tools_of_their_object() -> None:
    counter = _Counter()
    box = ToolBox([counter.bump])
    assert list(box.schemas[0]["function"]["parameters"]["properties"]) == ["by"]
    turn = _answer(box, _call("bump", {"by": 2}) + _call("bump", {"by": 3}))
    assert [m["content"] for m in turn.messages] == ["2", "5"] and counter.total == 5


def test_a_long_error_is_cut_to_a_line() -> None:
    def _verbose() -> str:
        """Fail at length."""
        raise ValueError("x" * 1000 + "\nsecond line")

    (message,) = _answer(ToolBox([_verbose]), _call("_verbose", {})).messages
    assert len(message["content"]) == 300 and message["content"].endswith("xxx...")


# ---------------------------------------------------------------------------------------------
# Deadline: a hung tool is the environment's failure


_RELEASE = threading.Event()


def _hangs(key: str) -> str:
    """Wait until released.

    Args:
        key: Ignored.
    """
    _RELEASE.wait()
    return key


async def _hangs_async(key: str) -> str:
    """Wait for an hour.

    Args:
        key: Ignored.
    """
    await asyncio.sleep(3600)
    return key


@pytest.mark.timeout(30)  # a tool that blocks the loop or the exit fails, not hangs
def test_a_hung_sync_tool_raises_tool_timeout_in_bounded_time_in_a_daemon_thread() -> None:
    _RELEASE.clear()
    t0 = time.monotonic()
    try:
        with pytest.raises(
            ToolTimeout, match=r"tool '_hangs' did not return within the 0.2 s deadline"
        ):
            asyncio.run(ToolBox([_hangs]).answer(_call("_hangs", {"key": "a"}), 0.2))
        assert time.monotonic() - t0 < 2
        assert issubclass(ToolTimeout, TimeoutError)
        stuck = [t for t in threading.enumerate() if t.name == "grail-tool-_hangs"]
        assert stuck and all(t.daemon for t in stuck)
    finally:
        _RELEASE.set()  # even when the test fails: a thread joined at exit must not hang pytest


@pytest.mark.timeout(30)  # a tool that blocks the loop or the exit fails, not hangs
def test_a_hung_async_tool_is_cancelled_at_the_deadline() -> None:
    async def run() -> None:
        with pytest.raises(ToolTimeout, match="'_hangs_async'"):
            await ToolBox([_hangs_async]).answer(_call("_hangs_async", {"key": "a"}), 0.2)
        await asyncio.sleep(0)  # the cancellation lands
        others = asyncio.all_tasks() - {asyncio.current_task()}
        assert not others, others

    t0 = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - t0 < 2


def _naps(seconds: float) -> str:
    """Sleep a while.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "rested"


@pytest.mark.timeout(30)  # a tool that blocks the loop or the exit fails, not hangs
def test_the_deadline_bounds_the_whole_turn_not_each_call() -> None:
    box = ToolBox([_naps])
    assert _answer(box, _call("_naps", {"seconds": 0.05}) * 2, 1.0).errors == 0
    t0 = time.monotonic()
    with pytest.raises(ToolTimeout, match="'_naps'"):
        asyncio.run(box.answer(_call("_naps", {"seconds": 0.3}) * 2, 0.5))
    assert time.monotonic() - t0 < 0.9


_HUNG_CHILD = """
import asyncio, time
from grail.envs.tools import ToolBox, ToolTimeout
def sleep(seconds: float) -> str:
    '''Sleep.

    Args:
        seconds: How long.
    '''
    time.sleep(seconds)
    return "slept"
call = '<tool_call>\\n{"name": "sleep", "arguments": {"seconds": 3600}}\\n</tool_call>'
try:
    asyncio.run(ToolBox([sleep]).answer(call, 0.2))
except ToolTimeout as exc:
    print("timeout:", exc, flush=True)
"""


def test_a_hung_tool_does_not_keep_the_process_alive() -> None:
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _HUNG_CHILD], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "timeout: tool 'sleep' did not return within the 0.2 s deadline\n"
    assert time.monotonic() - t0 < 60  # seconds of imports; the sleep would take an hour


# ---------------------------------------------------------------------------------------------
# Round trip through the tiny model's chat template


def _assistant_turn(rendered: str) -> str:
    """The content of the last assistant turn in a rendered conversation."""
    start = rendered.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    return rendered[start : rendered.index("<|im_end|>", start)]


def test_what_the_template_renders_parses_back_to_the_same_calls(tokenizer: Any) -> None:
    box = ToolBox([lookup, add])
    calls = [ToolCall("lookup", {"key": "ä b"}), ToolCall("add", {"x": 1, "y": -2.5})]
    user = {"role": "user", "content": "Sum them."}
    structured = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ],
    }
    rendered = tokenizer.apply_chat_template([user, structured], tools=box.schemas, tokenize=False)
    content = _assistant_turn(rendered)
    assert content.startswith("Checking.\n<tool_call>\n{")
    assert parse_tool_calls(content) == calls
    # Arguments as a JSON string (what OpenAI-style APIs return) render the same.
    as_string = {
        **structured,
        "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls
        ],
    }
    again = tokenizer.apply_chat_template([user, as_string], tools=box.schemas, tokenize=False)
    assert parse_tool_calls(_assistant_turn(again)) == calls

    # The policy's own text, kept as the assistant message's content, parses the same after
    # rendering and through the tokenizer's ids (what the turn loop sees).
    policy = {"role": "assistant", "content": content}
    text = tokenizer.apply_chat_template([user, policy], tools=box.schemas, tokenize=False)
    assert parse_tool_calls(_assistant_turn(text)) == calls
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    assert parse_tool_calls(tokenizer.decode(ids)) == calls


def test_tool_messages_render_as_one_user_turn_appended_to_the_conversation(
    tokenizer: Any,
) -> None:
    box = ToolBox([lookup, add])
    user = {"role": "user", "content": "Sum them."}
    policy = {
        "role": "assistant",
        "content": _call("lookup", {"key": "a"}) + "\n" + _call("add", {"x": 1, "y": 2}),
    }
    turn = _answer(box, policy["content"])
    before = tokenizer.apply_chat_template([user, policy], tools=box.schemas, tokenize=False)
    after = tokenizer.apply_chat_template(
        [user, policy, *turn.messages],
        tools=box.schemas,
        tokenize=False,
        add_generation_prompt=True,
    )
    # What the turn loop appends: the earlier turns are rendered unchanged.
    assert after.startswith(before)
    assert after[len(before) :] == (
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n"
        "<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
