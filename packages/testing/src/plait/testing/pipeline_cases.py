"""Rank-side pipeline parity through plait.testing's driver: a `Pipeline` vs the unsharded model, fp32.

The driver's reference trains on the whole global batch; the pipeline trains each data-parallel
replica on its rows through its schedule (the ``parallel_step`` hook) and each rank compares the
parameters of its own stages, named as in the full model (``subset``). Needs plait-pipeline, which
plait-testing does not declare.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder, MoEDecoder, MoEDecoderConfig
from plait.pipeline import Pipeline, PipelineConfig, pipeline_model
from plait.testing.driver import Inputs, run_parity, token_batches
from plait.testing.hf_models import tiny_hf_model
from plait.testing.models import lm_loss
from plait.testing.tolerances import Parity

__all__ = ["PIPELINE_VOCAB", "pipeline_decoder", "pipeline_parity"]

PIPELINE_VOCAB = 96


def pipeline_decoder(kind: str, layers: int) -> nn.Module:
    """A tiny decoder: ``dense``/``moe`` (plait reference models) or ``llama`` (Hugging Face)."""
    if kind == "dense":
        return DenseDecoder(DecoderConfig(vocab_size=PIPELINE_VOCAB, num_hidden_layers=layers))
    if kind == "moe":
        return MoEDecoder(MoEDecoderConfig(vocab_size=PIPELINE_VOCAB, num_hidden_layers=layers))
    return tiny_hf_model("llama", seed=None, vocab_size=PIPELINE_VOCAB, num_hidden_layers=layers)


def _pipeline_step(pipe: Pipeline, batch: Inputs) -> torch.Tensor:
    kwargs, labels = batch
    return pipe.step(kwargs["input_ids"], labels)


def pipeline_parity(
    case: str,
    kind: str,
    layers: int,
    sizes: ParallelismSizes,
    pipe_config: PipelineConfig,
    per_replica_batch: int = 4,
    fsdp: FSDP2Config | None = None,
) -> Parity:
    """The driver's loss, gradients, params after 2 SGD steps and AdamW losses on this rank's stages.

    ``Parity.extra`` holds ``stage_indices`` and this rank's FSDP units (``fsdp_units``) and how many
    of them free their gathered parameters after forward (``resharded_after_forward``, PP wants 0).
    """
    torch.manual_seed(0)
    reference = pipeline_decoder(kind, layers)
    ctx = MeshContext.build(fsdp or FSDP2Config(mp_policy=None), sizes)
    pipe = pipeline_model(copy.deepcopy(reference), ctx, lm_loss, pipe_config)
    dp_mesh = ctx.dp_mesh()
    return run_parity(
        lambda: (reference, pipe),
        token_batches(PIPELINE_VOCAB, dp_mesh.size(), batch=per_replica_batch),
        dp_rank=dp_mesh.get_local_rank(),
        case=case,
        parallel_step=_pipeline_step,
        subset=True,
        inspect=lambda _ref, pipe: {
            "stage_indices": list(pipe.stage_indices),
            **_reshard_counts(pipe.modules),
        },
    )


def _reshard_counts(modules: list[nn.Module]) -> dict[str, int]:
    units = [m for root in modules for m in root.modules() if isinstance(m, FSDPModule)]
    # torch keeps the setting private: a unit that reshards after forward has a post-forward mesh.
    groups = [u._get_fsdp_state()._fsdp_param_group for u in units]
    resharded = sum(g is not None and g.post_forward_mesh_info is not None for g in groups)
    return {"fsdp_units": len(units), "resharded_after_forward": resharded}
