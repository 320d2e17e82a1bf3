"""``parallel.float8`` in the trainer: the linears train as torchao's Float8Linear (CPU: emulated).

Float8 rounding differs from fp32 by design, so the run is compared with the fp32 run of the same
recipe within a band (the first loss within 2 %, and not equal: the setting is not ignored), and the
scales are recomputed after each optimizer step (FSDP float8 all-gather).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.testing import run_on_ranks
from tests.train.test_cp_trainer import RECIPE

FLOAT8 = ["parallel.float8={scaling: tensorwise, fsdp_all_gather: true}"]


def _losses(run_dir: str, overrides: list[str]) -> tuple[list[float], int]:
    """Three training losses and how many Float8Linear modules the trainer's model holds."""
    import torch
    import torch.distributed as dist

    from plait.mesh import DistributedInfo
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe
    from plait.train.trainer import Trainer

    recipe = load_recipe("hf_llama", [*RECIPE, f"out_dir={run_dir}", *overrides])
    world = dist.get_world_size()
    info = DistributedInfo(
        rank=dist.get_rank(), world_size=world, local_rank=dist.get_rank(), device=torch.device("cpu")
    )
    trainer = Trainer(recipe, check_recipe(recipe, world), info)
    converted = sum(type(m).__name__ == "Float8Linear" for m in trainer.model.modules())
    return [trainer.train_step()["loss"] for _ in range(3)], converted


def test_float8_trains_close_to_fp32_and_is_not_ignored(tmp_path: Path) -> None:
    fp32 = run_on_ranks(_losses, 2, str(tmp_path / "fp32"), [])
    float8 = run_on_ranks(_losses, 2, str(tmp_path / "float8"), FLOAT8)
    (ref, none), (got, converted) = fp32[0], float8[0]
    assert none == 0 and converted > 0, (none, converted)
    assert got[0] != ref[0] and abs(got[0] - ref[0]) <= 0.02 * ref[0], (ref, got)
    assert got[2] < got[0], got  # it trains
    assert float8[0][0] == float8[1][0]  # the ranks agree


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["parallel.strategy=ddp"], r"parallel.float8 needs parallel.strategy 'fsdp2' \(got 'ddp'\)"),
        (["parallel.options.float8=true"], r"parallel.options.float8 duplicates parallel.float8"),
        (["parallel.tp_size=2", "parallel.sequence_parallel=true"], r"float8"),
    ],
)
def test_float8_is_refused_where_not_built(overrides: list[str], match: str) -> None:
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe

    with pytest.raises(ValueError, match=match):
        check_recipe(load_recipe("hf_llama", [*RECIPE, *FLOAT8, *overrides]), 4, devices=False)
