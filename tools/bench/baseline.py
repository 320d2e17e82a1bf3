"""The hand-written contender: a torchtitan-style FSDP2 + TP parallelization of a Llama-style decoder.

What a careful user writes without plait: one 3-D mesh ``(dp_replicate, dp_shard, tp)``, the TP
plan spelled out with torch's own ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` /
``PrepareModuleInput`` (vocab-sharded input embedding, loss-parallel output head), then
``fully_shard`` on every transformer block (the last one kept unsharded after forward, as
torchtitan does) and on the root. No explicit prefetch, no separate embedding units.

The model must use Hugging Face Llama naming (``model.embed_tokens``, ``model.layers[i].self_attn.
{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``model.norm``, ``lm_head``) — plait's
``DenseDecoder`` and ``transformers``' ``LlamaForCausalLM`` both do.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["BaselineMeshes", "build_baseline_meshes", "parallelize_baseline"]


@dataclass(frozen=True)
class BaselineMeshes:
    """The meshes the baseline uses: FSDP (1-D shard, or 2-D replicate x shard for HSDP) and TP."""

    world: DeviceMesh
    fsdp: DeviceMesh | None
    tp: DeviceMesh | None


def build_baseline_meshes(dp_replicate: int, dp_shard: int, tp: int) -> BaselineMeshes:
    """One CPU mesh ``(dp_replicate, dp_shard, tp)`` with tp innermost, as torchtitan lays it out."""
    world = init_device_mesh(
        "cpu", (dp_replicate, dp_shard, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )
    if dp_replicate > 1:
        fsdp: DeviceMesh | None = world["dp_replicate", "dp_shard"]
    else:
        fsdp = world["dp_shard"] if dp_shard > 1 else None
    return BaselineMeshes(world=world, fsdp=fsdp, tp=world["tp"] if tp > 1 else None)


def _decoder(model: nn.Module) -> nn.Module:
    decoder = getattr(model, "model", None)
    if decoder is None or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no `model.layers`; the baseline only knows Llama naming"
        )
    return decoder


def _gather_hidden_states(*, hf_call: bool) -> PrepareModuleInput:
    """All-gather the attention input once (Hugging Face layers pass ``hidden_states=`` by keyword)."""
    if hf_call:
        return PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
    # plait.models' DenseDecoder: ``self_attn(hidden_states, position_embeddings)``.
    return PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))


def _apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """The Llama TP plan, written out by hand (torchtitan's ``apply_tp``, HF module names)."""
    sp = sequence_parallel
    decoder = _decoder(model)
    top = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp
        ),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        top["model.norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    tp = tp_mesh.size()
    for block in decoder.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(
                output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp
            ),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(
                output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp
            ),
        }
        if sp:
            plan |= {
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                # One all-gather of the block input for q/k/v together, one for gate/up together.
                "self_attn": _gather_hidden_states(
                    hf_call=type(model).__module__.startswith("transformers.")
                ),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        parallelize_module(block, tp_mesh, plan)
        attn = block.self_attn
        for name in ("num_heads", "num_key_value_heads"):
            if isinstance(getattr(attn, name, None), int):
                setattr(attn, name, getattr(attn, name) // tp)


def _apply_fsdp(model: nn.Module, fsdp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    """``fully_shard`` each block (the last one stays gathered after forward), then the root."""
    layers = _decoder(model).layers
    for index, block in enumerate(layers):
        fully_shard(block, mesh=fsdp_mesh, mp_policy=mp_policy, reshard_after_forward=index < len(layers) - 1)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp_policy)


def parallelize_baseline(
    model: nn.Module,
    meshes: BaselineMeshes,
    *,
    mp_policy: MixedPrecisionPolicy,
    sequence_parallel: bool = False,
) -> nn.Module:
    """TP (when the TP mesh has > 1 rank) then FSDP2 over the data-parallel ranks; returns ``model``.

    The output head leaves vocab-sharded ``DTensor`` logits under TP: compute the loss under
    ``torch.distributed.tensor.parallel.loss_parallel()``.
    """
    if sequence_parallel and meshes.tp is None:
        raise ValueError("sequence_parallel needs tp > 1 in --mesh")
    if meshes.tp is not None:
        _apply_tp(model, meshes.tp, sequence_parallel)
    if meshes.fsdp is not None:
        _apply_fsdp(model, meshes.fsdp, mp_policy)
    return model
