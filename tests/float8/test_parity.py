"""Float8 through the shared flow: FSDP2, TP, FSDP2 x TP and HSDP, with AC, against the unsharded float8 model.

DP-only cases (FSDP2, rowwise, float8 all-gather, HSDP) are held to the fp32 contract (measured: exact
or within 1e-7; the reference runs each data-parallel micro-batch on its own, so its activation scales
are each rank's). TP cases are held to it at step 0 and to a band after: see ``FLOAT8_TP``.
"""

from __future__ import annotations

from typing import Any

from plait.mesh import Float8Config, ParallelismSizes
from plait.testing import run_on_ranks
from tests.float8._cases import check, float8_case


def _two_ranks() -> list[tuple[Any, ...]]:
    tensorwise = {"float8": Float8Config()}
    return [
        float8_case("fsdp", ParallelismSizes(), tensorwise),
        float8_case("fsdp_rowwise", ParallelismSizes(), {"float8": Float8Config(scaling="rowwise")}),
        float8_case("fsdp_all_gather", ParallelismSizes(), {"float8": Float8Config(fsdp_all_gather=True)}),
        float8_case("tp", ParallelismSizes(tp_size=2), tensorwise),
        float8_case("tp_ac_selective", ParallelismSizes(tp_size=2), tensorwise, "selective"),
    ]


def _four_ranks() -> list[tuple[Any, ...]]:
    tensorwise = {"float8": Float8Config()}
    return [
        float8_case("fsdp_tp", ParallelismSizes(tp_size=2), tensorwise),
        float8_case("hsdp_ac_full", ParallelismSizes(dp_replicate_size=2), tensorwise, "full"),
    ]


def _report(results: list[list[tuple[Any, ...]]]) -> None:
    for rank in results:
        for parity, *_ in rank:
            print(
                f"{parity.case}: loss {parity.loss_diff:.2e} grad {parity.grad_diff:.2e} ({parity.worst_grad}) "
                f"param {parity.param_diff:.2e} adamw {max(parity.adamw_loss_diffs):.2e}"
            )


def test_float8_parity_on_two_ranks() -> None:
    results = run_on_ranks(_two_ranks, 2)
    _report(results)
    for rank in results:
        check(rank)


def test_float8_parity_on_four_ranks() -> None:
    results = run_on_ranks(_four_ranks, 4)
    _report(results)
    for rank in results:
        check(rank)
