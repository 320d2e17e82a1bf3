"""Pipeline combinations the table builds that no other parity test covered, through ``pipeline_model``.

Each case is pp 2 with one more axis or technique of the combination table; the generated table test
(``tests/mesh/test_combination_table.py``) names the case that covers each pair. plait.testing's
parity driver trains the pipeline (its schedule is the ``parallel_step``) beside the unsharded
reference, fp32, and compares each rank's own stages (``subset``): loss and every gradient at step 0,
parameters after 2 SGD steps, 3 AdamW losses (``plait.testing.FP32``). Each case also shows that its
technique really ran in the stages (meshes, checkpoint wrappers, compiled layers).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import MoEDecoder, MoEDecoderConfig, TopKRouter
from plait.pipeline import Pipeline, PipelineConfig, pipeline_model
from plait.testing import (
    PIPELINE_VOCAB,
    Inputs,
    Margins,
    Parity,
    cp_local_inputs,
    lm_loss,
    pipeline_decoder,
    record_routing_margins,
    run_on_ranks,
    run_parity,
    token_batches,
)
from tests.sidecar.test_combination_parity import check_combination_case

LAYERS = 4
MOE = MoEDecoderConfig(vocab_size=PIPELINE_VOCAB, num_hidden_layers=2, num_experts=4)
MOE_SEED = 5
"""Top-2 of 4 experts, one layer a stage: its reference keeps a >= 1.3e-3 relative top-k margin here."""


@dataclass(frozen=True)
class Case:
    """pp 2 with: the world, the model (``dense`` / ``moe``), more sizes, FSDP2 options, the AC mode."""

    world: int
    model: str
    sizes: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    ac: str | bool = False
    meshes: tuple[str, ...] = ()
    """Mesh dims some stage parameter must live on (proof that the axis was applied in the stages)."""


CASES: dict[str, Case] = {
    "pp_ac_full": Case(4, "dense", ac="full", meshes=("dp_shard",)),  # pp x ac_full
    "pp_ac_selective": Case(4, "dense", ac="selective", meshes=("dp_shard",)),  # pp x ac_selective
    "pp_ep": Case(4, "moe", {"ep_size": 2}, meshes=("ep",)),  # pp x ep (pp 2 x dp_shard 2, ep 2)
    "pp_ep_ac_full": Case(4, "moe", {"ep_size": 2}, ac="full", meshes=("ep",)),  # pp x ep x ac_full
    "pp_ep_ac_selective": Case(4, "moe", {"ep_size": 2}, ac="selective", meshes=("ep",)),
    "pp_compile": Case(4, "dense", options={"enable_compile": True}, meshes=("dp_shard",)),  # pp x compile
    # pp x dp_replicate: FSDP2 refuses pure replication (dp_replicate == dp), so HSDP 2 x 2 per stage.
    "pp_hsdp": Case(8, "dense", {"dp_replicate_size": 2}, meshes=("dp_replicate", "dp_shard")),
    # pp x sp: Shard(1) activations cross the stages as DTensors (the stages find the tp mesh by name)
    "pp_sp": Case(4, "dense", {"tp_size": 2}, {"sequence_parallel": True}, meshes=("tp",)),
    # pp x cp: each stage's attention is context-parallel; position_ids reach every stage with the batch
    "pp_cp": Case(4, "dense", {"cp_size": 2}, meshes=("dp_shard_cp",)),
}


def _step(pipe: Pipeline, batch: Inputs) -> torch.Tensor:
    kwargs, labels = batch
    rest = {k: v for k, v in kwargs.items() if k != "input_ids"}  # cp: position_ids for every stage
    return pipe.step(kwargs["input_ids"], labels, **rest)


def _facts(pipe: Pipeline) -> dict[str, Any]:
    """What the stages hold: parameter mesh dims, AC wrappers, compiled layers."""
    modules = [m for root in pipe.modules for m in root.modules()]
    params = [p for root in pipe.modules for p in root.parameters()]
    return {
        "mesh_dims": {
            d for p in params if isinstance(p, DTensor) for d in p.device_mesh.mesh_dim_names or ()
        },
        "checkpointed": sum(isinstance(m, CheckpointWrapper) for m in modules),
        "compiled": sum(getattr(m, "_compiled_call_impl", None) is not None for m in modules),
    }


def _rebias_routers_in_backward(pipe: Pipeline) -> Pipeline:
    """Block experts 0 and 2 in each stage's backward, unblock them in its forward.

    A router recomputed in backward (activation checkpointing that does not save routing) would then
    pick other experts than the forward did, and the gradients would leave the reference's.
    """
    for stage in pipe.modules:
        routers = [m for m in stage.modules() if isinstance(m, TopKRouter)]

        def rebias(bias: float, routers: list[TopKRouter] = routers) -> None:
            with torch.no_grad():
                for router in routers:
                    router.expert_bias[[0, 2]] = bias

        def arm(_module: nn.Module, _args: Any, output: Any) -> None:
            for tensor in output if isinstance(output, tuple) else (output,):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad: (rebias(-1.0e4), grad)[1])

        stage.register_forward_pre_hook(lambda _module, _args: rebias(0.0))
        stage.register_forward_hook(arm)
    return pipe


def _parity(name: str, case: Case, rebias: bool = False) -> tuple[Parity, Margins | None]:
    """This rank's parity for ``case`` (1F1B, 4 microbatches), and the reference's router margins.

    With ``rebias``, each stage's routers are re-biased between its forward and its backward.
    """
    torch.manual_seed(MOE_SEED if case.model == "moe" else 0)
    reference: nn.Module = MoEDecoder(MOE) if case.model == "moe" else pipeline_decoder("dense", LAYERS)
    ctx = MeshContext.build(
        FSDP2Config(mp_policy=None, **case.options),
        ParallelismSizes(pp_size=2, **case.sizes),
        activation_checkpointing=case.ac,
    )
    pipe = pipeline_model(copy.deepcopy(reference), ctx, lm_loss, PipelineConfig(microbatches=4))
    if rebias:
        _rebias_routers_in_backward(pipe)
    # The reference's routers only: a stage's shape inference runs a forward on placeholder inputs.
    margins = record_routing_margins(reference) if case.model == "moe" else None
    dp = ctx.dp_mesh()
    local_seq: list[int] = []
    parity = run_parity(
        lambda: (reference, pipe),
        token_batches(PIPELINE_VOCAB, dp.size(), batch=4),
        dp_rank=dp.get_local_rank(),
        case=name,
        parallel_step=_step,
        subset=True,
        local_inputs=cp_local_inputs(ctx, local_seq) if ctx.cp_size > 1 else None,
        inspect=lambda _ref, pipe: _facts(pipe) | {"local_seq": local_seq[:1]},
    )
    return parity, margins


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_combination_matches_reference(name: str) -> None:
    case = CASES[name]
    check_combination_case(name, case, run_on_ranks(_parity, case.world, name, case, timeout=600))


# selective: the same saving path (tools/slow_tests)
@pytest.mark.parametrize(
    "name", ["pp_ep_ac_full", pytest.param("pp_ep_ac_selective", marks=pytest.mark.slow)]
)
def test_routing_is_saved_not_recomputed_in_pipeline_stages(name: str) -> None:
    # Each stage's routers block two experts during its backward only; the gradients still equal the
    # reference's, so the checkpointed layers reused the forward's routing in their recompute.
    case = CASES[name]
    check_combination_case(name, case, run_on_ranks(_parity, case.world, name, case, True, timeout=600))
