"""Reward functions beyond an environment's own score: built-ins, `module:function` plugins and
remote HTTP scorers (an `http://` or `https://` URL; grail/envs/rewards/remote.py, docs/rewards.md).

A reward function has the TRL signature

    fn(prompts: list[str], completions: list[str], **kwargs) -> list[float]

called once per batch; kwargs carry per-sample lists (`answers`, and every key of the problems'
`meta`, e.g. `keywords`). Named parameters after the first two are fine as long as the batch
supplies them (TRL's `def reward(prompts, completions, answer, **kwargs)` style), and `**kwargs`
is required so that new batch keys never break an old plugin.

Built-ins (see each function): `correctness`, `keyword_match`, `strict_format`.
Plugins: `"package.module:function"` (dotted attributes allowed: `"pkg.mod:Class.method"`).
Remote scorers: `"https://host/path"`, or a mapping with the URL as `fn` and the HTTP options
(`REMOTE_OPTIONS`); the harness POSTs the batch as JSON and reads back one number per sample.

`score_completions` is the one place where a batch is scored: the environment's score, then each
extra reward, whose value v (unweighted) is stored in `components[name]` and whose weighted value
w·v is added to `reward`:

    reward = env_reward + Σ_j w_j · v_j

so a reward's name (the function's name unless the spec sets `name`) must not be one of the
environment's `components`: `check_names` refuses it, before the run starts.

Problems are never hidden: any plugin that cannot be imported, cannot take the arguments,
raises, or returns something other than a list of one finite number per sample raises a
`RewardError` naming the plugin spec (and the sample index where the problem is one sample);
remote scorers are held to the same checks (`check_reward_values`).

Deadlines: a built-in or plugin gets `timeout_s` seconds per call (an entry key; default
`PLUGIN_TIMEOUT_S`), after which the batch fails with a `RewardTimeout` naming it. The call runs
in a daemon thread (grail/core/threads.py): one that never returns is abandoned, still running,
and cannot keep the process alive. A remote scorer's `timeout_s` bounds each of its attempts
instead (grail/envs/rewards/remote.py), so its calls are not wrapped again.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from grail.core.errors import ConfigError
from grail.core.imports import SpecError, import_spec
from grail.core.threads import DeadlineExceeded, call_with_deadline
from grail.envs.base import Environment, Problem, Score
from grail.envs.rewards.base import (
    RewardError,
    RewardFn,
    RewardTimeout,
    check_reward_values,
    check_timeout,
)
from grail.envs.rewards.builtins import correctness, keyword_match, strict_format
from grail.envs.rewards.remote import REMOTE_OPTIONS, RemoteReward, is_remote_spec

# How long one call of a built-in or plugin (one batch) may take, unless its entry sets
# `timeout_s`. A batch is every sample of a generation round (hundreds to a few thousand
# completions); a sane plugin spends milliseconds per sample, so a minute is far beyond what one
# needs, yet short enough that a stuck plugin ends the run in about a minute instead of never.
# A plugin that is slow on purpose (a model as judge) sets its own.
PLUGIN_TIMEOUT_S = 60.0

# Keys every entry may carry; a URL entry also takes the rest of REMOTE_OPTIONS.
ENTRY_KEYS = ("fn", "weight", "name", "timeout_s")

# ---------------------------------------------------------------------------------------------
# Built-ins


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "correctness": correctness,
    "keyword_match": keyword_match,
    "strict_format": strict_format,
}


# ---------------------------------------------------------------------------------------------
# Loading and validation


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # some C callables have no signature; a bad call is still caught when run


def _check_signature(spec: str, fn: Callable[..., Any]) -> None:
    sig = _signature(fn)
    if sig is None:
        return
    usage = "use fn(prompts, completions, **kwargs)"
    try:
        sig.bind_partial([], [])
    except TypeError:
        raise RewardError(
            spec, f"signature {sig} cannot take (prompts, completions) positionally; {usage}"
        ) from None
    if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        raise RewardError(spec, f"signature {sig} has no **kwargs; {usage}")


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in by name, the callable at `"package.module:attr"`, or a remote scorer at an
    `http(s)://` URL (default options; `RewardFunctions.from_specs` takes them from the entry);
    checked, not yet called. A URL is only parsed here: the scorer is not contacted."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(str(spec), "a reward spec must be a non-empty string")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if is_remote_spec(spec):
        return RemoteReward(spec)
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise RewardError(
            spec,
            f"not a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) and not a "
            "'package.module:function' plugin spec",
        )
    try:
        obj = import_spec(spec)
    except SpecError as exc:
        raise RewardError(spec, str(exc)) from exc.__cause__
    if not callable(obj):
        raise RewardError(spec, f"{attr_path!r} is a {type(obj).__name__}, not callable")
    _check_signature(spec, obj)
    return obj


def call_reward_fn(
    spec: str,
    fn: RewardFn,
    prompts: list[str],
    completions: list[str],
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout_s: float | None = PLUGIN_TIMEOUT_S,
) -> list[float]:
    """Call `fn(prompts, completions, **kwargs)` once on the batch and check its result: a list of
    len(completions) finite reals. With `timeout_s`, a call still running after that many
    seconds raises a `RewardTimeout` and is abandoned (None, or a remote scorer: no deadline
    here; a remote scorer's options bound its attempts)."""
    kwargs = dict(kwargs or {})
    sig = _signature(fn)
    if sig is not None:
        try:
            sig.bind(prompts, completions, **kwargs)
        except TypeError as exc:
            raise RewardError(
                spec, f"cannot be called with this batch ({exc}); it provides {sorted(kwargs)}"
            ) from None

    def call() -> object:
        return fn(prompts, completions, **kwargs)

    try:
        if timeout_s is None or isinstance(fn, RemoteReward):  # it bounds its own attempts
            values = call()
        else:
            values = call_with_deadline(call, timeout_s=timeout_s, name="grail-reward")
    except RewardError:
        raise
    except DeadlineExceeded:
        raise RewardTimeout(
            spec,
            f"did not return within timeout_s={timeout_s:g} s (it is left running); set a "
            "larger timeout_s on its data.rewards entry if it needs longer",
        ) from None
    except Exception as exc:
        raise RewardError(spec, f"raised {type(exc).__name__}: {exc}") from exc
    return check_reward_values(spec, values, len(completions))


def _safe_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    # An entry as shown in an error message: header values may be credentials, so never shown.
    shown = dict(entry)
    if isinstance(shown.get("headers"), Mapping):
        shown["headers"] = {k: "***" for k in shown["headers"]}
    return shown


def _copied(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    # Fresh lists per function, so one plugin mutating its arguments cannot affect the next.
    return {k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()}


@dataclass(frozen=True)
class WeightedReward:
    name: str  # key in Score.components
    spec: str  # what the user wrote: a built-in name, "module:function" or a scorer's URL
    fn: RewardFn
    weight: float
    # Seconds one call may take (a built-in or plugin); None for a remote scorer, whose own
    # options bound each attempt.
    timeout_s: float | None = PLUGIN_TIMEOUT_S


class RewardFunctions:
    """An ordered, weighted collection of reward functions with unique names.

    Close it (`close()`, or use it as a context manager) to release the HTTP connections of its
    remote scorers; one never closed holds no thread and does not delay the interpreter's exit.
    """

    def __init__(self, rewards: Sequence[WeightedReward] = ()) -> None:
        names = [r.name for r in rewards]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"reward names must be unique; repeated: {dupes} (set `name`)")
        self.rewards = list(rewards)

    @classmethod
    def from_specs(cls, specs: Sequence[str | Mapping[str, Any]] | None) -> RewardFunctions:
        """From `[{"fn": "correctness", "weight": 1.0, "name": "optional"}, "strict_format"]`.

        A bare string means weight 1.0. The name defaults to the spec (the built-in name, or
        the function name of a plugin, e.g. "pkg.mod:len_penalty" -> "len_penalty"), and to
        "remote" for a URL. Any entry may set `timeout_s` (for a built-in or plugin: seconds per
        call, default `PLUGIN_TIMEOUT_S`); a URL entry may also set the other options in
        `REMOTE_OPTIONS`. Nothing is contacted here: URLs are only parsed.
        """
        if specs is None:
            return cls()
        if isinstance(specs, str | bytes | Mapping) or not isinstance(specs, Sequence):
            raise ConfigError(
                f"reward specs (data.rewards) must be a list, got {type(specs).__name__}"
            )
        rewards = []
        for i, item in enumerate(specs):
            entry: Mapping[str, Any] = {"fn": item} if isinstance(item, str) else item
            if not isinstance(entry, Mapping):
                raise ConfigError(f"reward spec #{i} must be a string or a mapping, got {item!r}")
            unknown = sorted(set(entry) - {*ENTRY_KEYS, *REMOTE_OPTIONS})
            if unknown:
                url_only = [k for k in REMOTE_OPTIONS if k not in ENTRY_KEYS]
                raise ConfigError(
                    f"reward spec #{i} has unknown key(s) {unknown}; allowed: "
                    f"{', '.join(ENTRY_KEYS)} (and for a URL scorer: {', '.join(url_only)})"
                )
            if "fn" not in entry:
                raise ConfigError(f"reward spec #{i} has no 'fn' key: {_safe_entry(entry)}")
            spec = entry["fn"]
            options = {k: entry[k] for k in REMOTE_OPTIONS if k in entry}
            weight = entry.get("weight", 1.0)
            if (
                isinstance(weight, bool)
                or not isinstance(weight, numbers.Real)
                or not math.isfinite(float(weight))
            ):
                raise ConfigError(f"reward spec #{i} ({spec!r}): weight must be finite, {weight!r}")
            timeout_s: float | None
            if is_remote_spec(spec):
                fn: RewardFn = RemoteReward.from_options(spec, options, where=f"reward spec #{i}")
                default_name, timeout_s = "remote", None
            else:
                url_only = [k for k in options if k not in ENTRY_KEYS]
                if url_only:
                    raise ConfigError(
                        f"reward spec #{i} ({spec!r}): {url_only[0]!r} is only for a "
                        "remote scorer (an http:// or https:// URL as `fn`)"
                    )
                timeout_s = check_timeout(
                    f"reward spec #{i} ({spec!r})", entry.get("timeout_s", PLUGIN_TIMEOUT_S)
                )
                fn = load_reward_fn(spec)
                default_name = str(spec).strip().rpartition(":")[2]
            name = entry.get("name") or default_name
            rewards.append(
                WeightedReward(str(name), str(spec).strip(), fn, float(weight), timeout_s)
            )
        return cls(rewards)

    def close(self) -> None:
        """Release the remote scorers' HTTP connections (idempotent); plugins are left alone."""

        for r in self.rewards:
            if isinstance(r.fn, RemoteReward):
                r.fn.close()

    def __enter__(self) -> RewardFunctions:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def check_names(self, env_name: str, components: Collection[str]) -> None:
        """Refuse a reward named like a component of the environment's score (its value would
        replace the component's): called with the environment's `components` before the run
        starts, and on every scored batch."""
        for r in self.rewards:
            if r.name in components:
                raise RewardError(
                    r.spec,
                    f"name {r.name!r} is already a component of environment {env_name!r} "
                    f"({', '.join(components)}); give the reward another name with `name:`, "
                    f"e.g. {{fn: {r.spec}, name: {r.name}_bonus}}",
                )

    def __len__(self) -> int:
        return len(self.rewards)

    def __iter__(self) -> Iterator[WeightedReward]:
        return iter(self.rewards)

    def __call__(
        self, prompts: list[str], completions: list[str], **kwargs: Any
    ) -> dict[str, list[float]]:
        """Unweighted values of each function on the batch, by name."""
        return {
            r.name: call_reward_fn(
                r.spec,
                r.fn,
                list(prompts),
                list(completions),
                _copied(kwargs),
                timeout_s=r.timeout_s,
            )
            for r in self.rewards
        }


# ---------------------------------------------------------------------------------------------
# Scoring a batch


def _last_user_message(problem: Problem) -> str:
    for message in reversed(problem.prompt_messages):
        if message.get("role") == "user":
            return message.get("content", "")
    return problem.prompt_messages[-1].get("content", "") if problem.prompt_messages else ""


def reward_kwargs(problems: Sequence[Problem]) -> dict[str, list[Any]]:
    """Per-sample kwargs for reward functions: `answers`, then each meta key (None where absent)."""
    kwargs: dict[str, list[Any]] = {"answers": [p.answer for p in problems]}
    keys: list[str] = []
    for p in problems:
        keys.extend(k for k in p.meta if k not in keys)
    for key in keys:
        if key in ("answers", "prompts", "completions"):
            raise ValueError(f"problem meta key {key!r} clashes with a reward-function argument")
        kwargs[key] = [p.meta.get(key) for p in problems]
    return kwargs


def score_completions(
    env: Environment,
    problems: Sequence[Problem],
    completions: Sequence[str],
    extra_rewards: RewardFunctions | None = None,
    prompts: Sequence[str] | None = None,
) -> list[Score]:
    """Score a batch: `env.score` per sample, then each extra reward once on the whole batch.

    `prompts` are what the extra rewards see as their first argument: the rendered prompt text
    when the caller has it (chat template applied), else the last user message of each problem.
    Extra values are stored unweighted in `components[name]` and added as weight·value to
    `reward`; `success` stays the environment's verdict.
    """
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    scores = [env.score(p, c) for p, c in zip(problems, completions, strict=True)]
    return with_extra_rewards(env.name, problems, completions, scores, extra_rewards, prompts)


def with_extra_rewards(
    env_name: str,
    problems: Sequence[Problem],
    completions: Sequence[str],
    scores: Sequence[Score],
    extra_rewards: RewardFunctions | None,
    prompts: Sequence[str] | None = None,
) -> list[Score]:
    """`scores` (the environment's, one per completion) with each extra reward added, called
    once on the whole batch (`score_completions`; an episode's completion is its last answer)."""
    scores = list(scores)
    if extra_rewards is None or len(extra_rewards) == 0:
        return scores
    if prompts is None:
        prompt_texts = [_last_user_message(p) for p in problems]
    else:
        if len(prompts) != len(problems):
            raise ValueError(f"{len(prompts)} prompts for {len(problems)} problems")
        prompt_texts = list(prompts)
    kwargs = reward_kwargs(problems)
    rewards = [s.reward for s in scores]
    components = [dict(s.components) for s in scores]
    extra_rewards.check_names(env_name, list(dict.fromkeys(k for c in components for k in c)))
    for r in extra_rewards:
        values = call_reward_fn(
            r.spec,
            r.fn,
            list(prompt_texts),
            list(completions),
            _copied(kwargs),
            timeout_s=r.timeout_s,
        )
        for i, v in enumerate(values):
            rewards[i] += r.weight * v
            components[i][r.name] = v
    return [
        replace(s, reward=rw, components=comp)
        for s, rw, comp in zip(scores, rewards, components, strict=True)
    ]
