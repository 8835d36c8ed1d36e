"""The service's book of completions and groups: what was handed out, what was scored, what is
queued for training and what a batch took. Pure state (no HTTP, no threads, no files): the
service (grail/service/source.py) calls it from one event loop and saves `to_json()` after every
change.

A group is GRPO's unit, `data.rollouts_per_problem` samples of one prompt. It comes either from
`/v1/completions` (the service sampled it; the client sends a reward per sample id) or from
`/v1/groups` (an environment sampled and scored it itself). It is queued once every sample has a
reward, and trained in arrival order.

Staleness: a group sampled by policy version v is trainable until the trainer holds version
v + max_staleness. Past that its rewards get 409 and a queued group is dropped when a batch is
taken; both are counted.

Sample ids carry their group's version and number, "v{version}-g{group}-s{index}", so that a
reward for a sample the ledger no longer keeps (its group trained long ago) still gets the right
answer: 409 stale, not 404 unknown.

Turns: `/v1/turns` samples for clients that build their own groups or episodes and push them. The
ledger keeps what each turn produced, keyed by the tokens before it and its own tokens
(`span_key`), until a pushed group uses it or it goes stale. With `service.check_spans` every
sampled span of a pushed completion (each run of 1s in its `sampled_mask`; the whole completion
without one) must be such a turn, with its log-probabilities: the service then trains only on
tokens its inference server produced, under the version that produced them.
"""

from __future__ import annotations

import hashlib
import math
import re
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from grail.core.http_api import APIError
from grail.rollouts.batch import Sample

SOURCES = ("completions", "groups")  # where a group came from: which route
_SAMPLE_ID = re.compile(r"v(\d+)-g(\d+)-s(\d+)")


def new_sample(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    finish_reason: str,
    text: str,
    reward: float = 0.0,
    success: bool = False,
    sampled_mask: Sequence[int] | None = None,
) -> Sample:
    """A completion as the service keeps it: the loop's `Sample` (its reward and success stay 0.0
    and False until a client sends them; `ServiceGroup.rewarded` says which have)."""
    return Sample(
        completion_ids=list(token_ids),
        behaviour_logprobs=list(logprobs),
        finish_reason=finish_reason,
        text=text,
        reward=reward,
        components={},
        success=success,
        sampled_mask=None if sampled_mask is None else list(sampled_mask),
    )


@dataclass
class TurnRecord:
    """What one turn sampled by `/v1/turns` produced, beside its key (`span_key`)."""

    policy_version: int
    logprobs: list[float]


@dataclass
class ServiceGroup:
    """The samples of one prompt, and where and under which policy version they were made."""

    id: str
    prompt_ids: list[int]
    policy_version: int
    source: str  # one of SOURCES
    samples: list[Sample]
    rewarded: list[bool]  # per sample: whether its reward came (a pushed group's all have)

    @property
    def complete(self) -> bool:
        return all(self.rewarded)

    def sample_id(self, index: int) -> str:
        """The id clients reward sample `index` by: "v{version}-g{group}-s{index}"."""
        return f"{self.id}-s{index}"


@dataclass
class PushedGroup:
    """A group as an environment sends it to /v1/groups (rewards, success and masks set; the
    logprobs as sent, anything finite at the mask's 0s)."""

    prompt_ids: list[int]
    policy_version: int
    samples: list[Sample]


@dataclass
class RewardEntry:
    id: str
    reward: float
    success: bool | None = None


@dataclass
class Counters:
    """What the service turned away or let lapse, for /v1/status and the metrics."""

    # Rewards refused because their sample's version was too old; a pushed group refused as too
    # old counts each of its samples' rewards.
    rejected_stale_rewards: int = 0
    expired_samples: int = 0  # handed out, never rewarded before they went stale
    dropped_stale_groups: int = 0  # complete, but too old by the time a batch was taken
    expired_turns: int = 0  # sampled by /v1/turns, in no pushed group before they went stale


def group_id(version: int, group: int) -> str:
    return f"v{version}-g{group:06d}"


def span_key(context_ids: Sequence[int], span_ids: Sequence[int]) -> str:
    """The key of a sampled span: its tokens and every token before it (prompt included), so
    that a span matches only where the server produced it."""
    digest = hashlib.sha256(len(context_ids).to_bytes(8, "little"))
    digest.update(array("q", context_ids).tobytes())
    digest.update(array("q", span_ids).tobytes())
    return digest.hexdigest()


def sampled_spans(mask: Sequence[int] | None, length: int) -> list[tuple[int, int]]:
    """The [start, end) runs of 1s in a sampled mask (the whole completion without one)."""
    if mask is None:
        return [(0, length)]
    spans, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    return spans


@dataclass
class Ledger:
    group_size: int  # data.rollouts_per_problem
    max_staleness: int  # service.max_staleness
    policy_version: int = 0
    next_group: int = 0
    next_turn: int = 0
    open: dict[str, ServiceGroup] = field(default_factory=dict)  # awaiting rewards
    queue: list[ServiceGroup] = field(default_factory=list)  # complete, oldest first
    # Groups a batch took, by iteration, until a checkpoint covers that iteration: a run resumed
    # from an older checkpoint trains on them again (`rewind`).
    taken: dict[int, list[ServiceGroup]] = field(default_factory=dict)
    # Complete groups (queued, taken or trained) still inside the staleness window: a second
    # reward for one of their samples is "already rewarded", not "unknown".
    closed: dict[str, int] = field(default_factory=dict)  # group id -> policy version
    counters: Counters = field(default_factory=Counters)
    # What /v1/turns sampled and no pushed group has used yet, by `span_key` (several turns may
    # share a key: the same tokens sampled twice after the same context).
    turns: dict[str, list[TurnRecord]] = field(default_factory=dict)

    # -- what clients do --------------------------------------------------------------------

    def new_group_number(self) -> int:
        """The number of the next group (part of its ids, and of its sampling seed)."""
        number = self.next_group
        self.next_group += 1
        return number

    def new_turn_number(self) -> int:
        """The number of the next `/v1/turns` request (part of its sampling seed)."""
        number = self.next_turn
        self.next_turn += 1
        return number

    def record_turns(
        self, number: int, keys: Sequence[str], logprobs: Sequence[list[float]]
    ) -> None:
        """Keep what turn request `number` (from `new_turn_number`) sampled with the current
        policy: one `span_key` and its log-probabilities per sample."""
        self.next_turn = max(self.next_turn, number + 1)
        for key, lps in zip(keys, logprobs, strict=True):
            self.turns.setdefault(key, []).append(TurnRecord(self.policy_version, list(lps)))

    def hand_out(
        self,
        number: int,
        prompt_ids: list[int],
        samples: Sequence[tuple[list[int], list[float], str, str]],
    ) -> ServiceGroup:
        """Register group `number` (from `new_group_number`), just sampled with the current
        policy: (token ids, log-probs, finish reason, text) per sample. Returns it with its
        sample ids."""
        if len(samples) != self.group_size:
            raise ValueError(f"{len(samples)} samples for a group of {self.group_size}")
        version = self.policy_version
        group = ServiceGroup(
            group_id(version, number),
            list(prompt_ids),
            version,
            "completions",
            [new_sample(ids, lps, reason, text) for ids, lps, reason, text in samples],
            [False] * len(samples),
        )
        self.open[group.id] = group
        return group

    def add_rewards(self, entries: Sequence[RewardEntry]) -> int:
        """Attach rewards to handed-out samples: all of them or, on any bad entry, none
        (APIError naming the first). Groups whose every sample now has a reward are queued."""
        if not entries:
            raise APIError("rewards is empty: send at least one {id, reward}", 400, "rewards")
        seen: set[str] = set()
        targets: list[tuple[ServiceGroup, int, RewardEntry]] = []
        for k, entry in enumerate(entries):
            param = f"rewards.{k}"
            if entry.id in seen:
                raise APIError(f"sample {entry.id!r} appears twice in this request", 400, param)
            seen.add(entry.id)
            check_finite(entry.reward, f"{param}.reward")
            targets.append((*self._awaiting_reward(entry.id, param), entry))
        for group, index, entry in targets:
            sample = group.samples[index]
            sample.reward = float(entry.reward)
            # The client's verdict; absent: reward > 0.
            sample.success = entry.success if entry.success is not None else entry.reward > 0
            group.rewarded[index] = True
        for group in {id(g): g for g, _, _ in targets}.values():
            if group.complete:
                self._enqueue(self.open.pop(group.id))
        return len(targets)

    def add_groups(self, groups: Sequence[PushedGroup], *, check_spans: bool) -> list[ServiceGroup]:
        """Queue groups an environment sampled and scored itself: all of them or, when one is
        bad, none (APIError naming what is wrong). `check_spans` (service.check_spans): every
        sampled span must be a turn `/v1/turns` produced; the turns used are then spent."""
        if not groups:
            raise APIError("groups is empty: send at least one group", 400, "groups")
        for k, group in enumerate(groups):
            self._check_group(group, f"groups.{k}")
        if check_spans:
            for key, used in self._turns_used(groups).items():
                left = [r for i, r in enumerate(self.turns[key]) if i not in used]
                if left:
                    self.turns[key] = left
                else:
                    del self.turns[key]
        added = []
        for group in groups:
            number = self.new_group_number()
            version = group.policy_version
            added.append(
                ServiceGroup(
                    group_id(version, number),
                    list(group.prompt_ids),
                    version,
                    "groups",
                    # The context tokens' logprobs (a mask's 0s) are 0.0, as in the harness's own
                    # episodes: no behaviour policy sampled them, and what a client sent there
                    # must not reach a metric.
                    [replace(s, behaviour_logprobs=masked_logprobs(s)) for s in group.samples],
                    [True] * len(group.samples),
                )
            )
            self._enqueue(added[-1])
        return added

    def _check_group(self, group: PushedGroup, param: str) -> None:
        if len(group.samples) != self.group_size:
            raise APIError(
                f"a group has {len(group.samples)} completions; data.rollouts_per_problem="
                f"{self.group_size} (GRPO normalises rewards within a group of that size)",
                400,
                f"{param}.completions",
            )
        version = group.policy_version
        if version > self.policy_version:
            raise APIError(
                f"policy_version {version} is ahead of the trainer's {self.policy_version}: "
                "it is the version whose weights sampled the group (GET /v1/status before "
                "generating)",
                400,
                f"{param}.policy_version",
            )
        if self.too_stale(version):
            self.counters.rejected_stale_rewards += len(group.samples)
            raise APIError(self._stale_message(version), 409, f"{param}.policy_version")
        for i, sample in enumerate(group.samples):
            where = f"{param}.completions.{i}"
            ids, logprobs = sample.completion_ids, sample.behaviour_logprobs
            if len(logprobs) != len(ids):
                raise APIError(
                    f"{len(logprobs)} logprobs for {len(ids)} token_ids: "
                    "one behaviour log-probability per generated token",
                    400,
                    f"{where}.logprobs",
                )
            for lp in logprobs:
                check_finite(lp, f"{where}.logprobs")
            mask = sample.sampled_mask
            if mask is not None and len(mask) != len(ids):
                raise APIError(
                    f"a sampled_mask of {len(mask)} for {len(ids)} token_ids: one 0 or 1 per token",
                    400,
                    f"{where}.sampled_mask",
                )
            if mask is not None and not any(mask):
                raise APIError(
                    "a sampled_mask with no 1: the policy sampled none of these tokens, so there "
                    "is nothing to train on",
                    400,
                    f"{where}.sampled_mask",
                )
            check_finite(sample.reward, f"{where}.reward")

    def _turns_used(self, groups: Sequence[PushedGroup]) -> dict[str, set[int]]:
        """The turn records the groups' sampled spans are, by key and index; APIError naming
        the first span that is not a turn of this service (or not with its log-probs), or a
        group whose policy_version is newer than a turn it holds."""
        used: dict[str, set[int]] = {}
        for k, group in enumerate(groups):
            for i, sample in enumerate(group.samples):
                where = f"groups.{k}.completions.{i}"
                ids = sample.completion_ids
                for start, end in sampled_spans(sample.sampled_mask, len(ids)):
                    key = span_key([*group.prompt_ids, *ids[:start]], ids[start:end])
                    records = self.turns.get(key, [])
                    taken = used.setdefault(key, set())
                    lps = sample.behaviour_logprobs[start:end]
                    index = next(
                        (j for j, r in enumerate(records) if j not in taken and r.logprobs == lps),
                        None,
                    )
                    span = f"tokens {start}..{end - 1}"
                    if index is None:
                        why = (
                            "carry other logprobs than /v1/turns returned for them"
                            if len(records) > len(taken)
                            else "are not a turn this run's /v1/turns sampled after the tokens "
                            "before them (or one already pushed, or gone stale)"
                        )
                        raise APIError(
                            f"{where}: {span} (sampled, by the mask) {why}; service.check_spans "
                            "trains only on what this run's inference server produced: sample "
                            "each turn with POST /v1/turns and push its token_ids and logprobs "
                            "as returned, or set service.check_spans=false to trust pushed tokens",
                            400,
                            f"{where}.token_ids",
                        )
                    taken.add(index)
                    version = records[index].policy_version
                    if group.policy_version > version:
                        raise APIError(
                            f"groups.{k}.policy_version {group.policy_version} is newer than "
                            f"version {version}, which sampled {where} {span}: send the oldest "
                            "version that sampled any of the group's turns",
                            400,
                            f"groups.{k}.policy_version",
                        )
        return used

    # -- what the trainer does ------------------------------------------------------------

    def take(self, count: int, iteration: int) -> list[ServiceGroup] | None:
        """The `count` oldest queued groups for `iteration`, or None while fewer are queued.
        Groups gone stale are dropped first (counted)."""
        fresh = [g for g in self.queue if not self.too_stale(g.policy_version)]
        self.counters.dropped_stale_groups += len(self.queue) - len(fresh)
        self.queue = fresh
        if len(self.queue) < count:
            return None
        batch, self.queue = self.queue[:count], self.queue[count:]
        self.taken[iteration] = batch
        return batch

    def advance(self, policy_version: int) -> None:
        """The trainer now holds `policy_version`: samples handed out too long ago expire."""
        self.policy_version = policy_version
        for gid, group in list(self.open.items()):
            if self.too_stale(group.policy_version):
                self.counters.expired_samples += group.rewarded.count(False)
                del self.open[gid]
        self.closed = {g: v for g, v in self.closed.items() if not self.too_stale(v)}
        for key, records in list(self.turns.items()):
            fresh = [r for r in records if not self.too_stale(r.policy_version)]
            self.counters.expired_turns += len(records) - len(fresh)
            if fresh:
                self.turns[key] = fresh
            else:
                del self.turns[key]

    def checkpointed(self, iteration: int) -> None:
        """A checkpoint now holds every update up to `iteration`: a resume never goes back
        past it, so what those iterations took is needed no more."""
        self.taken = {i: g for i, g in self.taken.items() if i > iteration}

    def rewind(self, start_iteration: int) -> int:
        """A run resumed at `start_iteration` (its checkpoint's policy version): the groups
        later iterations took go back to the front of the queue, in order; how many did."""
        again = [g for i in sorted(self.taken) if i >= start_iteration for g in self.taken[i]]
        self.taken = {i: g for i, g in self.taken.items() if i < start_iteration}
        self.queue = again + self.queue
        self.policy_version = start_iteration
        return len(again)

    # -- state ------------------------------------------------------------------------------

    def too_stale(self, version: int) -> bool:
        return version + self.max_staleness < self.policy_version

    def outstanding(self) -> int:
        """Samples handed out and not yet rewarded."""
        return sum(g.rewarded.count(False) for g in self.open.values())

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["taken"] = {str(i): groups for i, groups in data["taken"].items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Ledger:
        def groups(items: list[dict[str, Any]]) -> list[ServiceGroup]:
            return [group_from_json(g) for g in items]

        return cls(
            group_size=data["group_size"],
            max_staleness=data["max_staleness"],
            policy_version=data["policy_version"],
            next_group=data["next_group"],
            next_turn=data.get("next_turn", 0),  # absent from ledgers saved before /v1/turns
            open={g.id: g for g in groups(list(data["open"].values()))},
            queue=groups(data["queue"]),
            taken={int(i): groups(items) for i, items in data["taken"].items()},
            closed=dict(data["closed"]),
            counters=Counters(**data["counters"]),
            turns={
                key: [TurnRecord(**r) for r in records]
                for key, records in data.get("turns", {}).items()
            },
        )

    # -- internals --------------------------------------------------------------------------

    def _enqueue(self, group: ServiceGroup) -> None:
        self.queue.append(group)
        self.closed[group.id] = group.policy_version

    def _awaiting_reward(self, sid: str, param: str) -> tuple[ServiceGroup, int]:
        """The handed-out sample `sid` (its group and index), still waiting for its reward; else
        APIError saying why not (malformed 400, stale 409, already rewarded 409, unknown 404)."""
        match = _SAMPLE_ID.fullmatch(sid)
        if match is None:
            raise APIError(
                f"{sid!r} is not a sample id (ids look like 'v3-g000042-s0', as "
                "/v1/completions returned them)",
                400,
                f"{param}.id",
            )
        version, number, index = (int(x) for x in match.groups())
        gid = group_id(version, number)
        if number >= self.next_group or version > self.policy_version or index >= self.group_size:
            # Not one of ours, whatever its version says: never handed out, not stale.
            raise APIError(f"no sample {sid} was handed out by this run", 404, f"{param}.id")
        if self.too_stale(version):
            self.counters.rejected_stale_rewards += 1
            raise APIError(f"sample {sid}: {self._stale_message(version)}", 409, f"{param}.id")
        group = self.open.get(gid)
        if group is None or index >= len(group.samples):
            if gid in self.closed:
                raise APIError(f"sample {sid} already has a reward", 409, f"{param}.id")
            raise APIError(f"no sample {sid} was handed out by this run", 404, f"{param}.id")
        if group.rewarded[index]:
            raise APIError(f"sample {sid} already has a reward", 409, f"{param}.id")
        return group, index

    def _stale_message(self, version: int) -> str:
        return (
            f"sampled by policy version {version}, the trainer is at version "
            f"{self.policy_version}: older than service.max_staleness={self.max_staleness} "
            "allows, so it is not trained on (ask for fresh completions)"
        )


def masked_logprobs(sample: Sample) -> list[float]:
    """The sample's behaviour logprobs with 0.0 at its context tokens (a mask's 0s)."""
    if sample.sampled_mask is None:
        return list(sample.behaviour_logprobs)
    pairs = zip(sample.behaviour_logprobs, sample.sampled_mask, strict=True)
    return [lp if sampled else 0.0 for lp, sampled in pairs]


def sample_from_json(data: dict[str, Any]) -> tuple[Sample, bool]:
    """A sample as the ledger or its journal wrote it, and whether its reward had come. Reads the
    shape before one sample type too (an id, token_ids, logprobs, a reward of null until sent,
    a success of null for reward > 0)."""
    if "token_ids" not in data:
        return Sample(**data), True
    reward, success = data["reward"], data["success"]
    sample = new_sample(
        data["token_ids"],
        data["logprobs"],
        data["finish_reason"],
        data["text"],
        reward=float(reward or 0.0),
        success=bool(success) if success is not None else (reward or 0.0) > 0,
        sampled_mask=data.get("sampled_mask"),
    )
    return sample, reward is not None


def group_from_json(data: dict[str, Any]) -> ServiceGroup:
    """A group as `Ledger.to_json` wrote it (or before one sample type: `sample_from_json`)."""
    read = [sample_from_json(s) for s in data["samples"]]
    return ServiceGroup(
        id=data["id"],
        prompt_ids=data["prompt_ids"],
        policy_version=data["policy_version"],
        source=data["source"],
        samples=[sample for sample, _ in read],
        rewarded=data.get("rewarded", [has for _, has in read]),
    )


def check_finite(value: float, param: str) -> None:
    if not math.isfinite(value):
        raise APIError(f"{param} must be a finite number, got {value}", 400, param)
