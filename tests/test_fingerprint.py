"""The default job's first iterations, sync and pipelined, against the committed fingerprint
(tests/data/fingerprint.json; scripts/fingerprint.py writes it and says when to renew it).

Exact: the default job runs with `reproducible=true` (its default), so its numbers depend on the
code, the config and the fingerprint's key (torch version, CPU capability, CPU vendor, MKL branch,
thread counts), not on the machine. The key is read in a child process, as the runs see it (this
process's own kernels are not the runs'). A key with no committed fingerprint (another torch
version, a CPU without AVX2, a vendor never recorded) skips with the reason: the test never fails
on a CPU whose numbers were never recorded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import fingerprint  # noqa: E402


@pytest.mark.learning
def test_default_job_matches_the_committed_fingerprint(tmp_path: Path) -> None:
    key = fingerprint.current_key(reproducible=True)
    committed = fingerprint.committed_for(key)
    if committed is None:
        pytest.skip(
            f"no committed fingerprint for this machine's key {json.dumps(key, sort_keys=True)}; "
            "`uv run python scripts/fingerprint.py --add` records one"
        )
    assert fingerprint.tiny_model_sha256() == committed["model_sha256"], (
        "the tiny model's weights changed (grail/models/tiny.py)"
    )
    for mode, overrides in fingerprint.MODES.items():
        metrics = fingerprint.run_default_job(
            tmp_path / mode, overrides + fingerprint.REPRODUCIBLE, committed["iterations"]
        )
        diff = fingerprint.first_difference(committed["runs"][mode], metrics)
        assert diff is None, (
            f"{mode}: the default job's metrics changed at {diff}. If the change is deliberate, "
            "renew the fingerprint and the README's default-job numbers together "
            "(scripts/fingerprint.py --write)"
        )


def test_first_difference_names_the_first_differing_metric() -> None:
    expected = {"sync": {"train_iter_000": {"entropy": 6.25, "kl": None}}}
    assert fingerprint.first_difference(expected, json.loads(json.dumps(expected))) is None
    changed = {"sync": {"train_iter_000": {"entropy": 6.250000000000001, "kl": None}}}
    assert fingerprint.first_difference(expected, changed) == (
        "sync.train_iter_000.entropy: 6.25 != 6.250000000000001"
    )
    missing: dict[str, dict[str, dict[str, object]]] = {"sync": {}}
    assert fingerprint.first_difference(expected, missing) == (
        "sync.train_iter_000: {'entropy': 6.25, 'kl': None} != None"
    )


def test_the_committed_fingerprint_leaves_out_timings() -> None:
    for entry in fingerprint.load():
        for runs in entry["runs"].values():
            for record in runs.values():
                assert not set(record) & set(fingerprint._NOT_COMPARED)
