"""Per-layer in-place compile, the flow's last step; same loss, same state-dict keys; compile_parallelized_model a no-op after."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from plait.mesh import DDPConfig, FSDP2Config, MeshContext
from plait.models import DecoderConfig, DenseDecoder
from plait.sidecar import compile_parallelized_model, parallelize_model
from plait.testing import run_on_ranks

VOCAB = 32


def _model() -> nn.Module:
    return DenseDecoder(
        DecoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_attention_heads=2)
    )


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def _compiled_vs_eager() -> dict:
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    base = _model()
    ctx = MeshContext.build(FSDP2Config(mp_policy=None, enable_compile=True), activation_checkpointing="full")
    plain_ctx = MeshContext.build(FSDP2Config(mp_policy=None), activation_checkpointing="full")
    eager = parallelize_model(copy.deepcopy(base), plain_ctx)
    compiled = parallelize_model(copy.deepcopy(base), ctx)  # compile is the flow's last step
    keys_before = list(compiled.state_dict().keys())
    compile_parallelized_model(eager, plain_ctx)  # not requested: no-op
    compile_parallelized_model(compiled, ctx)  # compiled already: no-op
    eager_compiled = sum(getattr(m, "_compiled_call_impl", None) is not None for m in eager.modules())
    compiled_layers = sum(getattr(m, "_compiled_call_impl", None) is not None for m in compiled.modules())
    losses = []
    for model in (eager, compiled):
        loss = _loss(model, ids)
        loss.backward()
        losses.append(float(loss))
    grad_diff = max(
        float((a.grad.full_tensor() - b.grad.full_tensor()).abs().max())
        for a, b in zip(eager.parameters(), compiled.parameters(), strict=True)
    )
    return {
        "eager": losses[0],
        "compiled": losses[1],
        "grad_diff": grad_diff,
        "compiled_layers": compiled_layers,
        "eager_compiled": eager_compiled,
        "keys_same": keys_before == list(compiled.state_dict().keys()),
        "orig_mod": any("_orig_mod" in k for k in compiled.state_dict()),
    }


def test_per_layer_compile_after_fsdp_matches_eager_and_keeps_keys() -> None:
    for r in run_on_ranks(_compiled_vs_eager, 2, timeout=300.0):
        assert r["compiled_layers"] == 2 and r["eager_compiled"] == 0, r
        assert abs(r["eager"] - r["compiled"]) <= 1e-5, r
        assert r["grad_diff"] <= 1e-5, r
        assert r["keys_same"] and not r["orig_mod"], r


def test_compile_is_a_noop_without_fsdp2_device_mesh() -> None:
    model = _model()
    requested = FSDP2Config(enable_compile=True)
    for ctx in (MeshContext(strategy_config=requested), MeshContext(strategy_config=DDPConfig())):
        compile_parallelized_model(model, ctx)
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model.modules())
