"""The service's ledger on disk: a snapshot plus a journal of what changed since.

Every change the service makes to its ledger (grail/service/ledger.py) is one JSON line appended
to the journal and fsynced before the answer that depends on it goes out (~0.2 ms here, where
rewriting the whole ledger per request cost tens of ms and grew with the queue). A snapshot is
written (atomically) when a checkpoint lets the ledger forget what older iterations took, and
the journal starts again:

    RUN_DIR/service/ledger.json              {"generation": k, "ledger": {...}}
    RUN_DIR/service/journal.<k>.jsonl        the changes since snapshot k, oldest first

Loading replays journal k onto snapshot k. The ledger's operations are deterministic in their
inputs, so the replay rebuilds exactly the state the killed process had. A last line cut short
(a crash in the middle of a write) is ignored: its answer never went out.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from grail.core.records import atomic_write_text, read_json
from grail.service.ledger import Counters, Ledger, PushedGroup, RewardEntry, sample_from_json

log = logging.getLogger(__name__)

SNAPSHOT = "ledger.json"


class LedgerStore:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.generation = 0
        self._fd: int | None = None

    def _journal(self, generation: int) -> Path:
        return self.dir / f"journal.{generation}.jsonl"

    def load(self) -> Ledger | None:
        """The saved ledger with its journal replayed, or None when there is none."""
        saved = read_json(self.dir / SNAPSHOT)
        if saved is None:
            return None
        self.generation = int(saved["generation"])
        ledger = Ledger.from_json(saved["ledger"])
        journal = self._journal(self.generation)
        lines = journal.read_text().splitlines() if journal.exists() else []
        for number, line in enumerate(lines):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines) - 1:
                    log.warning("%s: ignoring a last line cut short", journal)
                    break
                raise
            replay(ledger, event)
        return ledger

    def snapshot(self, ledger: Ledger) -> None:
        """Write `ledger` as the new snapshot and start an empty journal for it."""
        self.generation += 1
        self._close()
        self._journal(self.generation).unlink(missing_ok=True)
        payload = {"generation": self.generation, "ledger": ledger.to_json()}
        atomic_write_text(self.dir / SNAPSHOT, json.dumps(payload))
        # Only now: a crash before the new snapshot is in place leaves the old one and its journal.
        for journal in self.dir.glob("journal.*.jsonl"):
            if journal != self._journal(self.generation):
                journal.unlink(missing_ok=True)

    def append(self, event: dict[str, Any]) -> None:
        if self._fd is None:
            self._fd = os.open(
                self._journal(self.generation), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
            )
        os.write(self._fd, (json.dumps(event) + "\n").encode())
        os.fsync(self._fd)

    def close(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def replay(ledger: Ledger, event: dict[str, Any]) -> None:
    """Apply one journal line: the same call, with the same inputs, the service made."""
    op = event["op"]
    if op == "hand_out":
        ledger.next_group = max(ledger.next_group, event["number"] + 1)
        samples = [tuple(s) for s in event["samples"]]
        ledger.hand_out(event["number"], event["prompt_ids"], samples)
    elif op == "rewards":
        ledger.add_rewards([RewardEntry(*entry) for entry in event["entries"]])
    elif op == "turns":
        ledger.record_turns(event["number"], event["keys"], event["logprobs"])
    elif op == "groups":
        ledger.add_groups(
            [
                PushedGroup(
                    g["prompt_ids"],
                    g["policy_version"],
                    [sample_from_json(s)[0] for s in g["samples"]],
                )
                for g in event["groups"]
            ],
            # The check it passed, so that it spends the same turns again (absent: before
            # service.check_spans, when pushed groups were not checked).
            check_spans=event.get("check_spans", False),
        )
    elif op == "take":
        ledger.take(event["count"], event["iteration"])
    elif op == "advance":
        ledger.advance(event["policy_version"])
    elif op == "counters":
        ledger.counters = Counters(**event["counters"])
    else:
        raise ValueError(f"unknown journal operation {op!r}")
