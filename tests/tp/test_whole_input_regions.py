"""Whole-input modules inside a sharded block whose output meets the shards directly (Dots3's K-RoPE norm)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from plait.testing import run_on_ranks
from plait.testing.parity import full_tensor
from plait.tp import apply_tp


class SharedKeyBlock(nn.Module):
    """``q`` column-wise over heads; a shared key normed on the whole input and broadcast to the local heads."""

    def __init__(self, hidden: int = 16, heads: int = 4, head_dim: int = 4) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.RMSNorm(head_dim)  # whole input; its output meets this rank's heads: partial grad
        self.in_norm = nn.RMSNorm(hidden)  # whole input, only into q_proj: complete grad (no second sum)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(self.in_norm(x)).unflatten(-1, (-1, self.head_dim))
        k = self.k_norm(self.k_a_proj(x)).unsqueeze(-2).expand_as(q)
        return self.o_proj((q * k).flatten(-2))


def _checks() -> dict[str, float]:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    torch.manual_seed(0)
    ref = SharedKeyBlock()
    with torch.no_grad():
        for norm in (ref.k_norm, ref.in_norm):
            norm.weight.uniform_(0.5, 1.5)
    par = copy.deepcopy(ref)
    plan = {"q_proj": "colwise", "k_norm": "replicated_with_grad_allreduce", "o_proj": "rowwise"}
    apply_tp(par, mesh, plan)
    x = torch.randn(2, 3, 16)
    ref(x).pow(2).sum().backward()
    par(x).pow(2).sum().backward()
    par_params = dict(par.named_parameters())
    return {
        name: ((full_tensor(par_params[name].grad) - p.grad).abs().max() / p.grad.abs().max()).item()
        for name, p in ref.named_parameters()
    }


def test_whole_input_norm_feeding_sharded_heads_gets_a_complete_gradient() -> None:
    for rank, result in enumerate(run_on_ranks(_checks, 2)):
        assert max(result.values()) <= 1e-5, (rank, result)
