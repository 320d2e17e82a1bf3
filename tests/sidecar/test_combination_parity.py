"""Combinations the table builds that no other parity test covered, through ``parallelize_model``.

Each case is one point of the combination table (``plait.mesh.combinations``); the generated table test
(``tests/mesh/test_combination_table.py``) names the case that covers each pair. Every case runs
plait.testing's parity driver on real gloo ranks, fp32: the loss and every parameter's gradient at step
0, the parameters after 2 SGD steps and 3 AdamW losses against the unsharded single-process reference
(tolerances ``plait.testing.FP32``). Each case also proves that the combination really ran: the meshes
the parameters live on, the activation-checkpoint wrappers, the compiled layers, the local sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder, MoEDecoder, MoEDecoderConfig
from plait.sidecar import parallelize_model
from plait.testing import (
    GLOBAL_BATCH_SEQ,
    Inputs,
    Margins,
    Parity,
    cp_local_inputs,
    global_batch,
    local_slice,
    paired,
    record_routing_margins,
    run_on_ranks,
    run_parity,
)
from tests.sidecar._parity import BATCH_STEPS

VOCAB = 64
MOE = MoEDecoderConfig(vocab_size=VOCAB, num_experts=8, zero_token_experts=(1, 2, 6))
MOE_SEED = 17
"""tests/sidecar/test_moe.py's model and seed: a >= 1.3e-3 relative top-k margin on the ``BATCH_STEPS`` batches."""


@dataclass(frozen=True)
class Case:
    """One point of the table: the world, the model, the sizes, FSDP2 options and the AC mode."""

    world: int
    model: str
    """``dense`` (plait.models' decoder) or ``moe`` (its MoE decoder: top-2 of 8 experts, 3 never chosen)."""
    sizes: dict[str, int]
    options: dict[str, Any] = field(default_factory=dict)
    ac: str | bool = False
    meshes: tuple[str, ...] = ()
    """Mesh dims some parameter must be sharded or replicated over (proof that the axes were applied)."""
    seed: int = MOE_SEED
    """The MoE model's init seed: another where ``MOE_SEED``'s router margin is too thin on the case's batches."""


CASES: dict[str, Case] = {
    # dp_replicate x ac_full; dp_replicate x ac_selective (with dp_shard x / fsdp2 x ac_selective)
    "hsdp_ac_full": Case(4, "dense", {"dp_replicate_size": 2}, ac="full", meshes=("dp_replicate",)),
    "hsdp_ac_selective": Case(4, "dense", {"dp_replicate_size": 2}, ac="selective", meshes=("dp_replicate",)),
    # tp x ac_selective; sp x ac_full; sp x ac_selective
    "tp_ac_selective": Case(4, "dense", {"tp_size": 2}, ac="selective", meshes=("dp_shard", "tp")),
    "tp_sp_ac_full": Case(4, "dense", {"tp_size": 2}, {"sequence_parallel": True}, "full", ("tp",)),
    "tp_sp_ac_selective": Case(4, "dense", {"tp_size": 2}, {"sequence_parallel": True}, "selective", ("tp",)),
    # cp x ac_selective
    "cp_ac_selective": Case(
        4, "dense", {"cp_size": 2}, {"cp_attention": "ring"}, "selective", ("dp_shard_cp",)
    ),
    # ep x ac_selective (routing saved, not recomputed); dp_replicate x ep
    "ep_ac_selective": Case(4, "moe", {"ep_size": 2}, ac="selective", meshes=("ep",)),
    "hsdp_ep": Case(4, "moe", {"dp_replicate_size": 2, "ep_size": 2}, meshes=("dp_replicate", "ep")),
    # cp x ep: the expert mesh folds over dp_shard x cp; with selective AC the routing is saved
    # (2 data-parallel rows a batch: seed 5 keeps a 1.7e-3 margin there, tools/moe_margin_scan.py 0 40 2)
    "cp_ep": Case(4, "moe", {"cp_size": 2, "ep_size": 2}, meshes=("dp_shard_cp", "ep"), seed=5),
    "cp_ep_ac_selective": Case(
        4,
        "moe",
        {"cp_size": 2, "ep_size": 2},
        {"cp_attention": "ring"},
        "selective",
        ("dp_shard_cp", "ep"),
        seed=5,
    ),
    # ep x sp: the MoE block runs whole on the gathered sequence (SequenceParallelBlock), its experts
    # expert-parallel over dp_shard x tp; with full AC the routing is saved (2 data-parallel rows a
    # batch, as cp_ep: seed 5)
    "ep_sp": Case(
        4, "moe", {"ep_size": 2, "tp_size": 2}, {"sequence_parallel": True}, "full", ("ep", "tp"), seed=5
    ),
    # dp_replicate x tp, dp_replicate x sp, dp_replicate x cp: FSDP2 refuses pure replication
    # (dp_replicate == dp), so these need dp_shard 2 as well: 8 ranks.
    "hsdp_tp_sp": Case(
        8,
        "dense",
        {"dp_replicate_size": 2, "tp_size": 2},
        {"sequence_parallel": True},
        meshes=("dp_replicate", "tp"),
    ),
    "hsdp_cp": Case(
        8, "dense", {"dp_replicate_size": 2, "cp_size": 2}, meshes=("dp_replicate", "dp_shard_cp")
    ),
}
COMPILED: dict[str, Case] = {
    # compile x fsdp2 / dp_shard / tp / sp / ac_selective
    "compile_tp_sp_ac_selective": Case(
        4, "dense", {"tp_size": 2}, {"enable_compile": True, "sequence_parallel": True}, "selective", ("tp",)
    ),
    # compile x dp_replicate / ac_full
    "compile_hsdp_ac_full": Case(
        4, "dense", {"dp_replicate_size": 2}, {"enable_compile": True}, "full", ("dp_replicate",)
    ),
    "compile_cp": Case(4, "dense", {"cp_size": 2}, {"enable_compile": True}, meshes=("dp_shard_cp",)),
    "compile_ep": Case(4, "moe", {"ep_size": 2}, {"enable_compile": True}, meshes=("ep",)),
}
COMPILED_IN_CI = ("compile_tp_sp_ac_selective",)
"""The compiled case tools/test runs (inductor's build dominates: the others run in tools/slow_tests)."""


def _build(kind: str, seed: int = MOE_SEED) -> nn.Module:
    """The seeded model of a case (``paired`` seeds 0 before calling this)."""
    if kind == "dense":
        return DenseDecoder(DecoderConfig(vocab_size=VOCAB))
    torch.manual_seed(seed)
    return MoEDecoder(MOE)


def _batches(dp_size: int) -> list[list[Inputs]]:
    """The driver's global batches: the sidecar tests' ``BATCH_STEPS``, one micro-batch per dp rank.

    8 tokens a sequence: a multiple of ``2 * cp`` (context parallel cuts it into ``2 * cp`` chunks).
    """
    out = []
    for step in BATCH_STEPS:
        batch = global_batch(VOCAB, dp_size, step)
        rows = [local_slice(batch, r) for r in range(dp_size)]
        out.append([({"input_ids": r["input_ids"]}, r["labels"]) for r in rows])
    return out


def _facts(model: nn.Module) -> dict[str, Any]:
    """What the parallelization did: parameter mesh dims, AC wrappers, compiled layers."""
    dims = {
        d for p in model.parameters() if isinstance(p, DTensor) for d in p.device_mesh.mesh_dim_names or ()
    }
    return {
        "mesh_dims": dims,
        "checkpointed": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
        "compiled": sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()),
    }


def _parity(name: str, case: Case) -> tuple[Parity, Margins | None]:
    """This rank's parity for ``case`` (and the reference's router margins for a MoE model)."""
    ctx = MeshContext.build(
        FSDP2Config(mp_policy=None, **case.options),
        ParallelismSizes(**case.sizes),
        activation_checkpointing=case.ac,
    )

    def parallelize(model: nn.Module) -> nn.Module:
        return parallelize_model(model, ctx)  # compiles the layers when the case sets enable_compile

    local_seq: list[int] = []
    local = cp_local_inputs(ctx, local_seq)

    margins = Margins() if case.model == "moe" else None
    dp = ctx.dp_mesh()
    parity = run_parity(
        paired(lambda: _build(case.model, case.seed), parallelize),
        _batches(dp.size()),
        dp_rank=dp.get_local_rank(),
        case=name,
        prepare_reference=(lambda ref: record_routing_margins(ref, margins)) if margins else None,
        local_inputs=local if ctx.cp_size > 1 else None,
        inspect=lambda _ref, par: _facts(par) | {"local_seq": local_seq[:1]},
    )
    return parity, margins


def check_combination_case(name: str, case: Any, results: list[tuple[Parity, Margins | None]]) -> None:
    """Parity on every rank, and the facts that show the combination was applied."""
    for parity, margins in results:
        parity.check()
        if margins is not None:
            margins.check()  # no top-k near-tie: CPU rounding cannot flip an expert choice
        facts = parity.extra
        assert set(case.meshes) <= facts["mesh_dims"], (name, facts)
        assert (facts["checkpointed"] > 0) == bool(case.ac), (name, facts)
        assert (facts["compiled"] > 0) == bool(case.options.get("enable_compile")), (name, facts)
        if getattr(case, "sizes", {}).get("cp_size", 1) > 1:
            assert facts["local_seq"] == [GLOBAL_BATCH_SEQ // case.sizes["cp_size"]], (name, facts)


@pytest.mark.parametrize("name", list(CASES))
def test_combination_matches_reference(name: str) -> None:
    case = CASES[name]
    check_combination_case(name, case, run_on_ranks(_parity, case.world, name, case, timeout=300))


@pytest.mark.parametrize(
    "name",
    [name if name in COMPILED_IN_CI else pytest.param(name, marks=pytest.mark.slow) for name in COMPILED],
)
def test_compiled_combination_matches_reference(name: str) -> None:
    case = COMPILED[name]
    check_combination_case(name, case, run_on_ranks(_parity, case.world, name, case, timeout=600))
