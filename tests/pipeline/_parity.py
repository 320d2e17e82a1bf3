"""Rank-side pipeline parity: a `Pipeline` vs the unsharded model, per-parameter, fp32.

Every rank builds the same seeded model and keeps an unsharded copy as the reference, which trains
on the whole global batch; the pipeline trains each data-parallel replica on its slice. Each rank
compares the parameters of its own stages (names are the full model's) with the reference.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder, MoEDecoder, MoEDecoderConfig
from plait.pipeline import PipelineConfig, pipeline_model
from plait.testing import clean_fqn, full_tensor

SEQ = 8
SGD_LR = 0.2
VOCAB = 96


@dataclass
class PipeParity:
    case: str
    loss_diff: float
    grad_diff: float
    worst_grad: str
    param_diff: float
    worst_param: str
    compared: int
    stage_indices: list[int]
    fsdp_units: int
    """FSDP units on this rank's stages."""
    resharded_after_forward: int
    """Of those, units that free their gathered parameters after forward (PP wants 0)."""


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(kind: str, layers: int) -> nn.Module:
    """A tiny seeded decoder: ``dense``/``moe`` (plait reference models) or ``llama`` (Hugging Face)."""
    if kind == "dense":
        return DenseDecoder(DecoderConfig(vocab_size=VOCAB, num_hidden_layers=layers))
    if kind == "moe":
        return MoEDecoder(MoEDecoderConfig(vocab_size=VOCAB, num_hidden_layers=layers))
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def _logits(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _max_diff(reference: nn.Module, modules: list[nn.Module], attr: str) -> tuple[float, str, int, float]:
    """Max abs difference of ``attr`` ('grad' or 'data') over the local stage params; the reference scale."""
    ref = dict(reference.named_parameters())
    worst, worst_name, count = 0.0, "", 0
    for module in modules:
        for name, p in module.named_parameters():
            name = clean_fqn(name)
            r = ref[name]
            a = full_tensor(p.grad if attr == "grad" else p)
            b = r.grad if attr == "grad" else r
            diff = (a.float() - b.detach().float()).abs().max().item()
            count += 1
            if diff > worst or not worst_name:
                worst, worst_name = diff, name
    scale = max((r.grad if attr == "grad" else r).abs().max().item() for r in ref.values())
    return worst, worst_name, count, scale


def run_case(
    case: str,
    kind: str,
    layers: int,
    sizes: ParallelismSizes,
    pipe_config: PipelineConfig,
    per_replica_batch: int = 4,
    fsdp: FSDP2Config | None = None,
) -> PipeParity:
    """One step's loss and gradients, then params after 2 SGD steps, vs the unsharded reference."""
    torch.manual_seed(0)
    reference = build(kind, layers)
    ctx = MeshContext.build(fsdp or FSDP2Config(mp_policy=None), sizes)
    pipe = pipeline_model(copy.deepcopy(reference), ctx, lm_loss, pipe_config)
    dp_mesh = ctx.dp_mesh()
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    lo = dp_rank * per_replica_batch

    def step(index: int) -> tuple[float, float]:
        inputs, labels = _batch(index, dp_size * per_replica_batch)
        ref_loss = lm_loss(_logits(reference(inputs)), labels)
        ref_loss.backward()
        loss = pipe.step(inputs[lo : lo + per_replica_batch], labels[lo : lo + per_replica_batch])
        dist.all_reduce(loss, group=dp_mesh.get_group())
        return float(ref_loss.detach()), float(loss) / dp_size

    ref_loss, loss = step(0)
    grad_diff, worst_grad, compared, grad_scale = _max_diff(reference, pipe.modules, "grad")
    opts = [
        torch.optim.SGD(reference.parameters(), lr=SGD_LR),
        torch.optim.SGD(list(pipe.parameters()), lr=SGD_LR),
    ]
    for index in (1, 2):
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if index == 1:
            step(index)
    param_diff, worst_param, _, param_scale = _max_diff(reference, pipe.modules, "data")
    return PipeParity(
        case=case,
        loss_diff=abs(ref_loss - loss) / max(abs(ref_loss), 1e-12),
        grad_diff=grad_diff / grad_scale,
        worst_grad=worst_grad,
        param_diff=param_diff / param_scale,
        worst_param=worst_param,
        compared=compared,
        stage_indices=list(pipe.stage_indices),
        **_reshard_counts(pipe.modules),
    )


def _reshard_counts(modules: list[nn.Module]) -> dict[str, int]:
    units = [m for root in modules for m in root.modules() if isinstance(m, FSDPModule)]
    # torch keeps the setting private: a unit that reshards after forward has a post-forward mesh.
    groups = [u._get_fsdp_state()._fsdp_param_group for u in units]
    resharded = sum(g is not None and g.post_forward_mesh_info is not None for g in groups)
    return {"fsdp_units": len(units), "resharded_after_forward": resharded}


def assert_pipe_parity(results: list[list[PipeParity]]) -> None:
    """Every rank's every case within 1e-5 (relative to the reference's largest |value|)."""
    flat = [p for rank in results for p in rank]
    assert flat
    for p in flat:
        assert p.compared > 0, f"{p.case}: no parameters compared"
        assert p.loss_diff <= 1e-5, f"{p.case}: loss differs by {p.loss_diff:.2e}"
        assert p.grad_diff <= 1e-5, f"{p.case}: grad {p.worst_grad} differs by {p.grad_diff:.2e}"
        assert p.param_diff <= 1e-5, (
            f"{p.case}: after 2 SGD steps {p.worst_param} differs by {p.param_diff:.2e}"
        )
