"""Tiny, unmodified Hugging Face MoE models and a lean multi-rank parity driver for expert parallel.

Each family is built from its own ``transformers`` config class (``HF_MOE_FAMILIES`` of
:mod:`plait.testing.hf_models`) with random weights (no download). The driver compares, per
parameter and relative to the reference's largest entry, step-0 gradients and the parameters after
2 SGD steps, the router auxiliary loss on this rank's rows, the state-dict keys, and the expert
bytes each rank holds; the reference's router margins are recorded over every forward. Needs
plait-sidecar and transformers, which plait-testing does not declare.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn
from torch.distributed.tensor import DTensor

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.sidecar import parallelize_model
from plait.testing.hf_models import HF_MOE_FAMILIES, HF_MOE_SIZES, hf_moe_config
from plait.testing.parity import clean_fqn, full_tensor
from plait.testing.routing import Margins, record_routing_margins

__all__ = [
    "HF_MOE_LAYOUTS",
    "HF_MOE_SEEDS",
    "HFMoEResult",
    "expert_bytes",
    "hf_moe_available",
    "hf_moe_cases",
    "hf_moe_model",
    "hf_moe_parity",
    "hf_moe_reference_margin",
]

VOCAB, SEQ, ROWS = HF_MOE_SIZES["vocab_size"], 8, 8
"""ROWS: the global batch, the same for every layout (each data-parallel rank takes ROWS / dp rows)."""
SGD_LR = 0.5
HF_MOE_SEEDS = {"mixtral": 12, "qwen2_moe": 2, "qwen3_moe": 1, "olmoe": 13, "deepseek_v3": 2, "gpt_oss": 1}
"""Init seed per family whose reference keeps a >= 2e-3 router margin (:func:`hf_moe_reference_margin`)."""
HF_MOE_LAYOUTS = {"ep=2": {"ep_size": 2}, "ep=4": {"ep_size": 4}, "ep=2 x tp=2": {"ep_size": 2, "tp_size": 2}}
"""On 4 ranks: ep=2 is ep_shard=2 x ep=2. Under tp=2 the model's own Hugging Face plan applies (its
expert entries dropped: the experts are expert-parallel)."""


def hf_moe_available(family: str) -> bool:
    """Whether the locked transformers has this family of :data:`HF_MOE_FAMILIES`."""
    return hasattr(transformers, HF_MOE_FAMILIES[family][0])


def hf_moe_model(family: str, seed: int | None = None) -> nn.Module:
    """The tiny causal LM of ``family`` with seeded random weights (eager attention)."""
    config = hf_moe_config(family)
    torch.manual_seed(HF_MOE_SEEDS[family] if seed is None else seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def _batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def _loss(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = model(input_ids=ids[:, :-1])
    logits = out.logits.full_tensor() if isinstance(out.logits, DTensor) else out.logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    return loss, getattr(out, "aux_loss", None)


def _relative(ref: nn.Module, par: nn.Module, grads: bool) -> tuple[float, str]:
    worst, where = 0.0, ""
    par_named = {clean_fqn(n): p for n, p in par.named_parameters()}
    for name, r in sorted(ref.named_parameters()):
        p = par_named[name]
        a, b = (r.grad, p.grad) if grads else (r, p)
        if a is None and b is None:
            continue
        a = torch.zeros_like(r) if a is None else full_tensor(a)
        b = torch.zeros_like(r) if b is None else full_tensor(b)
        diff = float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
        if diff > worst:
            worst, where = diff, name
    return worst, where


def expert_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of expert parameters this rank holds, bytes of all expert parameters)."""
    held = total = 0
    for name, p in model.named_parameters():
        if ".experts." in clean_fqn(name):
            local = p.to_local() if isinstance(p, DTensor) else p
            held += local.numel() * local.element_size()
            total += p.numel() * p.element_size()
    return held, total


@dataclass
class HFMoEResult:
    """One family x layout on one rank."""

    case: str
    loss_diff: float = 0.0
    grad_rel: float = 0.0
    worst_grad: str = ""
    param_rel: float = 0.0
    worst_param: str = ""
    aux_diff: float = 0.0
    same_keys: bool = False
    held_ratio: float = 0.0
    """held expert bytes x (ep x ep_shard) / total expert bytes; 1.0 = exactly 1/(ep x ep_shard)."""
    margins: Margins = field(default_factory=Margins)

    def check(self) -> None:
        """Assert the router margin, fp32 parity (1e-5), unchanged keys and 1/(ep x ep_shard) expert bytes."""
        self.margins.check()
        assert self.loss_diff <= 1e-5, self
        assert self.grad_rel <= 1e-5, self
        assert self.param_rel <= 1e-5, self
        assert self.aux_diff <= 1e-5, self
        assert self.same_keys, self
        assert abs(self.held_ratio - 1.0) <= 0.02, self


def hf_moe_reference_margin(family: str, seed: int) -> float:
    """One process: the reference's smallest router margin over :func:`hf_moe_parity`'s two SGD steps."""
    model = hf_moe_model(family, seed)
    margins = record_routing_margins(model)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    for step in range(2):
        _loss(model, _batch(step, ROWS))[0].backward()
        opt.step()
        opt.zero_grad()
    return margins.smallest


def hf_moe_parity(family: str, layout: str, seed: int | None = None) -> HFMoEResult:
    """Run one family at one layout of :data:`HF_MOE_LAYOUTS` on the current ranks."""
    sizes = HF_MOE_LAYOUTS[layout]
    config = FSDP2Config(mp_policy=None)
    ctx = MeshContext.build(config, ParallelismSizes(**sizes))
    result = HFMoEResult(f"{family} {layout}")
    ref = hf_moe_model(family, seed)
    keys = list(ref.state_dict())
    par = parallelize_model(copy.deepcopy(ref), ctx)
    record_routing_margins(ref, result.margins)
    dp_rank, dp = dist.get_rank(ctx.dp_mesh().get_group()), ctx.dp_mesh().size()
    ep_shard = ctx.ep_shard_mesh().size()
    held, total = expert_bytes(par)
    result.held_ratio = held * ctx.ep_size * ep_shard / total
    result.same_keys = [clean_fqn(k) for k in par.state_dict()] == keys
    opts = [torch.optim.SGD(m.parameters(), lr=SGD_LR) for m in (ref, par)]
    for step in range(2):
        batch, per_rank = _batch(step, ROWS), ROWS // dp
        rows = batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        (ref_loss, _), (par_loss, par_aux) = _loss(ref, batch), _loss(par, rows)
        ref_loss.backward()
        par_loss.backward()
        mean = par_loss.detach().clone()
        dist.all_reduce(mean, group=ctx.dp_mesh().get_group())
        result.loss_diff = max(result.loss_diff, abs(float(mean) / dp - float(ref_loss.detach())))
        if step == 0:
            result.grad_rel, result.worst_grad = _relative(ref, par, grads=True)
            with torch.no_grad():
                ref_aux = _loss(ref, rows)[1]
            result.aux_diff = float((ref_aux - par_aux).abs()) if ref_aux is not None else 0.0
        for opt in opts:
            opt.step()
            opt.zero_grad()
    result.param_rel, result.worst_param = _relative(ref, par, grads=False)
    return result


def hf_moe_cases(cases: list[tuple[str, str]]) -> list[HFMoEResult]:
    """Several (family, layout) cases in one multi-rank body."""
    return [hf_moe_parity(family, layout) for family, layout in cases]
