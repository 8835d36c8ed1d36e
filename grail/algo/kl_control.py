"""Adaptive KL coefficient: grail's controller (`AdaptiveKLController` in grail's trainer).

After each optimizer step the coefficient β moves by a constant factor when the step's measured
KL leaves a ±20% band around the target, and stays put inside it:

    KL > 1.2 · target:  β ← min(β · rate, β_max)
    KL < 0.8 · target:  β ← max(β / rate, β_min)

grail measures the KL of the step's last micro-batch; here it is the token-weighted mean over all
the step's micro-batches (the same when a step is one micro-batch, and less noisy otherwise).
The KL measured is the estimator's per-token mean against the reference model (``kl`` in the
metrics, without TRL's bias correction). Pure state: the trainer checkpoints ``value``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The band around the target inside which β stays put (grail's 0.8 / 1.2).
BAND_LOW, BAND_HIGH = 0.8, 1.2


@dataclass
class AdaptiveKL:
    value: float  # β now: what the next optimizer step uses
    target: float
    rate: float  # > 1
    min_value: float
    max_value: float

    def __post_init__(self) -> None:
        for name in ("value", "target", "min_value", "max_value"):
            x = getattr(self, name)
            if not (math.isfinite(x) and x > 0):
                raise ValueError(f"adaptive KL {name} must be a finite number > 0, got {x}")
        if not (math.isfinite(self.rate) and self.rate > 1):
            raise ValueError(f"adaptive KL rate must be > 1, got {self.rate}")
        if self.min_value > self.max_value:
            raise ValueError(
                f"adaptive KL min_value ({self.min_value}) exceeds max_value ({self.max_value})"
            )

    def update(self, observed_kl: float) -> float:
        """Move β after an optimizer step whose measured KL was `observed_kl`; the new β. A
        non-finite measurement (a step skipped for a non-finite gradient) leaves β alone."""
        if not math.isfinite(observed_kl):
            return self.value
        if observed_kl > BAND_HIGH * self.target:
            self.value = min(self.max_value, self.value * self.rate)
        elif observed_kl < BAND_LOW * self.target:
            self.value = max(self.min_value, self.value / self.rate)
        return self.value
