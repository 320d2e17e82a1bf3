"""The parity contract: tolerances, what one rank measured (:class:`Parity`) and its check.

Every package's parity tests measure with :mod:`plait.testing.driver` and judge with these: the loss
and every parameter's gradient at step 0, the parameters after 2 SGD steps, and the AdamW losses
against a floor measured in the same run (:data:`ADAMW_FLOOR_FACTOR`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ADAMW_FLOOR_FACTOR", "BF16", "FP32", "Parity", "Tolerances", "assert_parity"]


ADAMW_FLOOR_FACTOR = 10.0
"""AdamW losses may differ by this many times the floor measured in the same run.

AdamW divides each update by the root of the squared gradient's running mean, so a near-zero
gradient moves its parameter by about the learning rate whatever its size: a rounding difference of
1e-9 in such a gradient becomes a step of ~1e-2 in one run and not in the other. The size of that
amplification depends on the model, the data and the CPU's kernels, so no fixed tolerance fits. The
floor is measured in the same run (see `_adamw_floor`): twins of the reference take the same AdamW
steps from the same state, one in float64 and one in fp32 with its gradients disturbed each step by
as much as the parallel run's gradients differed at step 0; the largest loss difference is how far
that much rounding moves AdamW here (on one CPU's kernels: 1e-3 where the parallel run was 1.1e-4
off, tests/tp/test_parity.py's tied tp4 case). A real defect (a missing average, a wrong shard) moves the loss at step 0 already and is
caught there; the factor leaves room for a different draw of the same size of rounding."""


@dataclass(frozen=True)
class Tolerances:
    """Largest accepted differences: loss (abs), gradient (relative), parameters after SGD (abs), AdamW loss (abs).

    ``adamw_loss`` is the least bound of the AdamW losses; the bound is ``ADAMW_FLOOR_FACTOR`` times
    the floor measured in the same run where that is larger.
    """

    loss: float
    grad: float
    param: float
    adamw_loss: float


FP32 = Tolerances(loss=1e-5, grad=1e-5, param=1e-5, adamw_loss=1e-4)
"""Both sides in fp32: only summation order differs (fp32 epsilon 1.2e-7, a few hundred terms deep).

The AdamW losses' least bound, 1e-4, is 2e-5 of the test models' loss (ln(vocab) ~ 4-5), far below
what a defect gives (1e-2 and more, and a defect shows at step 0 already); two fp32 runs whose
summation orders differ measured up to 1.1e-5 apart where the float64 floor was 8.8e-7 (Qwen3, FSDP
x TP x SP), so the floor alone can undershoot one run's amplification by more than the factor."""

BF16 = Tolerances(loss=5e-3, grad=5e-2, param=2e-2, adamw_loss=1e-2)
"""Parallel side in the library default (FSDP2: bf16 parameters for compute, fp32 master weights and
fp32 gradient reduction), reference in fp32. bf16 keeps 8 significant bits (unit roundoff
2^-9 = 2e-3) and every matmul input, activation and output is rounded, about ten roundings deep in
the 2-layer test models, twice over for gradients (forward, then backward). Measured on the test
models (tests/sidecar/test_bf16_parity.py, 4 gloo ranks, FSDP2 / HSDP / TP+SP / MoE EP / DDP):
loss <= 1.6e-3, gradients <= 2.8e-2 of the parameter's largest reference entry, parameters after
2 SGD steps <= 5.6e-3, AdamW losses <= 3.7e-3. The bounds are 2-3.5 times those, and still refuse
real defects: a missing gradient average measures > 1 (tests/testing/test_driver.py), a wrong shard
or a dropped reduction is O(1). A bf16 MoE test must not route on near-ties (bf16 router logits
would pick other experts than the fp32 reference): route every token to every expert."""


@dataclass
class Parity:
    """What one rank measured; every number is a max difference between parallel and reference."""

    case: str
    loss_diff: float
    grad_diff: float
    """Relative to the reference's max |gradient| of the same parameter (floored, see the module doc)."""
    worst_grad: str
    param_diff: float
    worst_param: str
    adamw_loss_diffs: list[float]
    adamw_floor: float
    """The reference against its twin over the same AdamW steps (see :data:`ADAMW_FLOOR_FACTOR`)."""
    grads_compared: int
    extra: dict[str, Any] = field(default_factory=dict)
    reference_losses: list[float] = field(default_factory=list)
    """The reference's loss at each of the ``STEPS`` steps (a test can check that training moved it)."""

    def check(self, tol: Tolerances = FP32) -> None:
        """Assert every measurement is within ``tol`` (NaN fails)."""
        label = f"{self.case}: " if self.case else ""
        assert self.grads_compared > 0, f"{label}no gradients compared"
        assert self.loss_diff <= tol.loss, f"{label}loss differs by {self.loss_diff:.3g} (tol {tol.loss:g})"
        assert self.grad_diff <= tol.grad, (
            f"{label}gradient of {self.worst_grad} differs by {self.grad_diff:.3g} relative (tol {tol.grad:g})"
        )
        assert self.param_diff <= tol.param, (
            f"{label}after 2 SGD steps {self.worst_param} differs by {self.param_diff:.3g} (tol {tol.param:g})"
        )
        worst = max(self.adamw_loss_diffs, default=math.nan)
        bound = max(tol.adamw_loss, ADAMW_FLOOR_FACTOR * self.adamw_floor)
        assert worst <= bound, (
            f"{label}AdamW losses differ by {self.adamw_loss_diffs} (tol {bound:g}: the larger of "
            f"{tol.adamw_loss:g} and {ADAMW_FLOOR_FACTOR:g} x the floor {self.adamw_floor:.3g})"
        )


def assert_parity(results: Sequence[Parity | Sequence[Parity]], tol: Tolerances = FP32) -> None:
    """``check`` every result of every rank (a flat list, or one list per rank)."""
    flat = [p for r in results for p in ([r] if isinstance(r, Parity) else r)]
    assert flat, "no parity results"
    for parity in flat:
        parity.check(tol)
