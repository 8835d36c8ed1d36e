"""Sampling seeds: stable across machines and Python runs (unlike `hash`), so a fixed config
reproduces the same samples (grail/rollouts/generation.py, grail/rollouts/episodes.py)."""

from __future__ import annotations

import hashlib


def stable_hash(key: str) -> int:
    """A 64-bit hash of `key`, the same on every machine and Python run (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def request_seed(base_seed: int, round_index: int, problem_seed: int) -> int:
    """A stable 31-bit sampling seed for one request (same on every machine and Python run)."""
    # Leave head-room below 2**31 so that seed + replicate index stays a valid 32-bit seed.
    return stable_hash(f"{base_seed}:{round_index}:{problem_seed}") % (2**31 - 2**16)
