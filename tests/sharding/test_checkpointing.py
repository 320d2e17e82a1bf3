"""Activation checkpointing: recompute is real (FLOPs), results are bit-identical, scopes pick the right groups."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    set_checkpoint_early_stop,
)
from torch.utils.flop_counter import FlopCounterMode

from plait.sharding import LayerGroup, apply_activation_checkpointing, discover_layer_groups
from plait.sharding.selective import ForwardDepth, policy_context_fn, selective_policy


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).transpose(1, 3).unbind(2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h))


class _Mlp(nn.Module):
    """``n_linear`` chained linears: the layer's matmul count is 2 (attention) + n_linear."""

    def __init__(self, hidden: int, n_linear: int) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(n_linear))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            x = F.silu(linear(x))
        return x


class _Layer(nn.Module):
    def __init__(self, hidden: int, n_linear: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attn = _Attention(hidden, heads=4)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = _Mlp(hidden, n_linear)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.input_layernorm(x)))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Config:
    use_cache = True


class _Model(nn.Module):
    def __init__(self, n_linear: int = 2, vocab: int = 50, hidden: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.config = _Config()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Layer(hidden, n_linear) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _Tower(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Layer(hidden, 1) for _ in range(2))


class _Vlm(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.visual = _Tower(hidden)
        self.audio_tower = _Tower(hidden)
        self.language_model = _Model(hidden=hidden)


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(3))


def _run(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward + backward with a fixed RNG (dropout active); returns the output and every gradient."""
    torch.manual_seed(7)
    out = model(ids)
    out.square().mean().backward()
    return out.detach(), {
        n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()
    }


def _flops(model: nn.Module, ids: torch.Tensor, backward: bool = True) -> int:
    counter = FlopCounterMode(display=False)
    with counter, set_checkpoint_early_stop(False):
        out = model(ids)
        if backward:
            out.square().mean().backward()
    return counter.get_total_flops()


def _checkpointed(n_linear: int, **kwargs: object) -> tuple[nn.Module, nn.Module, int]:
    torch.manual_seed(0)
    plain = _Model(n_linear)
    model = copy.deepcopy(plain)
    count = apply_activation_checkpointing(model, discover_layer_groups(model), **kwargs)  # type: ignore[arg-type]
    return plain, model, count


@pytest.mark.parametrize(
    ("kwargs", "expected_count"),
    [
        ({}, 8),  # per-submodule: attention, mlp, two norms, per layer
        ({"whole_layer": True}, 2),
        ({"mode": "selective"}, 2),
    ],
)
@pytest.mark.parametrize("n_linear", [1, 2])  # 3 and 4 matmuls per layer: odd and even
def test_checkpointed_model_matches_plain_model_exactly(
    kwargs: dict, expected_count: int, n_linear: int
) -> None:
    plain, model, count = _checkpointed(n_linear, **kwargs)
    assert count == expected_count
    assert model.config.use_cache is False
    ids = _ids()
    out_plain, grads_plain = _run(plain, ids)
    out_ckpt, grads_ckpt = _run(model, ids)
    assert torch.equal(out_plain, out_ckpt)
    assert grads_plain.keys() == grads_ckpt.keys()
    for name, grad in grads_plain.items():
        assert torch.equal(grad, grads_ckpt[name]), name


def test_full_checkpointing_recomputes_the_layers_forward() -> None:
    plain, model, _ = _checkpointed(2, whole_layer=True)
    ids = _ids()
    with torch.no_grad():
        layer_forward = _flops(nn.Sequential(*plain.layers), plain.embed(ids), backward=False)
    assert layer_forward > 0
    assert _flops(model, ids) == _flops(plain, ids) + layer_forward


@pytest.mark.parametrize("n_linear", [1, 2])
def test_selective_checkpointing_recomputes_part_of_the_forward(n_linear: int) -> None:
    plain, full, _ = _checkpointed(n_linear, whole_layer=True)
    _, selective, _ = _checkpointed(n_linear, mode="selective")
    ids = _ids()
    plain_flops, selective_flops, full_flops = _flops(plain, ids), _flops(selective, ids), _flops(full, ids)
    assert plain_flops < selective_flops < full_flops


class _Ctx:
    def __init__(self, is_recompute: bool) -> None:
        self.is_recompute = is_recompute


@pytest.mark.parametrize("n_matmuls", [3, 4])
def test_selective_policy_counts_forward_and_recompute_separately(n_matmuls: int) -> None:
    aten = torch.ops.aten
    policy = selective_policy()
    ops = [aten.mm.default, aten.addmm.default, aten.bmm.default, aten.mm.default][:n_matmuls]
    forward = [policy(_Ctx(False), op) for op in ops]
    recompute = [policy(_Ctx(True), op) for op in ops]
    assert forward == recompute
    assert forward[:2] == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE]
    assert (
        policy(_Ctx(True), aten._scaled_dot_product_flash_attention_for_cpu.default)
        == CheckpointPolicy.MUST_SAVE
    )
    assert policy(_Ctx(False), aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE


class _BiasedRouter(nn.Module):
    """Scores, a bias added (a buffer tests change before backward) and top-k, like an MoE router."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, 8)
        self.register_buffer("bias", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, _ = torch.topk(self.proj(x) + self.bias, k=2, dim=-1)
        return values.softmax(-1).sum(-1, keepdim=True)


class _GroupMaskRouter(_BiasedRouter):
    """Builds its top-k mask in place, as transformers' DeepseekV3TopkRouter does (zeros, then scatter_)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x) + self.bias
        mask = torch.zeros_like(scores)
        mask.scatter_(-1, scores.topk(2, dim=-1).indices, 1.0)
        return (scores.softmax(-1) * mask).sum(-1, keepdim=True)


class _RoutedMlp(nn.Module):
    def __init__(self, hidden: int, router: type[nn.Module] = _BiasedRouter) -> None:
        super().__init__()
        self.router = router(hidden)
        self.up = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.up(x)) * self.router(x)


class _RoutedLayer(nn.Module):
    def __init__(self, hidden: int = 32, router: type[nn.Module] = _BiasedRouter) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attn = _Attention(hidden, heads=4)
        self.mlp = _RoutedMlp(hidden, router)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(x)


class _RoutedModel(nn.Module):
    def __init__(self, router: type[nn.Module] = _BiasedRouter) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_RoutedLayer(router=router) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _CountOps(TorchDispatchMode):
    """Counts calls of each aten op (forward, recompute and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


_SAVE_INSIDE_CASES = [{}, {"whole_layer": True}, {"mode": "selective"}]
_SAVE_INSIDE_IDS = ["full", "full-whole-layer", "selective"]


def _routed(
    save_routers: bool, router: type[nn.Module] = _BiasedRouter, **kwargs: Any
) -> tuple[nn.Module, nn.Module, list[nn.Module]]:
    """A plain 2-layer routed model and its checkpointed copy (routers as ``save_inside`` when asked)."""
    torch.manual_seed(0)
    plain = _RoutedModel(router)
    model = copy.deepcopy(plain)
    routers = [layer.get_submodule("mlp.router") for layer in model.layers]
    save_inside = routers if save_routers else ()
    apply_activation_checkpointing(model, discover_layer_groups(model), save_inside=save_inside, **kwargs)
    return plain, model, routers


@pytest.mark.parametrize("kwargs", _SAVE_INSIDE_CASES, ids=_SAVE_INSIDE_IDS)
@pytest.mark.parametrize("save_routers", [False, True])
def test_save_inside_ops_run_once_instead_of_again_in_the_recompute(save_routers: bool, kwargs: dict) -> None:
    _, model, _ = _routed(save_routers, **kwargs)
    counter = _CountOps()
    with counter, set_checkpoint_early_stop(False):
        model(torch.randn(2, 5, 32)).sum().backward()
    topk = counter.calls[torch.ops.aten.topk.default]
    assert topk == (2 if save_routers else 4)  # 2 layers: forward only, or forward + recompute
    assert counter.calls[torch.ops.aten.silu.default] == 4  # the rest of the MLP is recomputed


@pytest.mark.parametrize("kwargs", _SAVE_INSIDE_CASES, ids=_SAVE_INSIDE_IDS)
def test_the_recompute_reuses_the_saved_router_outputs(kwargs: dict) -> None:
    """A router changed between forward and backward: gradients stay those of the forward's routing."""
    plain, saved, routers = _routed(True, **kwargs)
    _, recomputed, recomputed_routers = _routed(False, **kwargs)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5))
    losses = [model(x).square().mean() for model in (plain, saved, recomputed)]
    with torch.no_grad():
        for router in (*routers, *recomputed_routers):
            router.bias.copy_(torch.linspace(-3.0, 3.0, 8))  # other top-k picks than the forward's
    for loss in losses:
        loss.backward()
    grads = [
        {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in m.named_parameters()}
        for m in (plain, saved, recomputed)
    ]
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name
    assert any(not torch.equal(grad, grads[2][name]) for name, grad in grads[0].items())


@pytest.mark.parametrize("kwargs", _SAVE_INSIDE_CASES, ids=_SAVE_INSIDE_IDS)
def test_a_router_that_fills_a_fresh_tensor_in_place_is_saved(kwargs: dict) -> None:
    """Saving a router's ``zeros_like`` would cache a tensor its ``scatter_`` then mutates; the mask is
    rebuilt from the saved top-k, so a router changed before backward still routes as in forward."""
    plain, saved, routers = _routed(True, _GroupMaskRouter, **kwargs)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5))
    losses = [model(x).square().mean() for model in (plain, saved)]
    with torch.no_grad():
        for router in routers:
            router.bias.copy_(torch.linspace(-3.0, 3.0, 8))
    for loss in losses:
        loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in saved.named_parameters()}
    for name, param in plain.named_parameters():
        assert torch.equal(param.grad, grads[name]), name


def _with_op_policy(model: nn.Module) -> set[str]:
    """The checkpoint wrappers that run under a selective-checkpoint ``context_fn``."""
    wrappers = ((f, m) for f, m in model.named_modules() if isinstance(m, CheckpointWrapper))
    return {fqn for fqn, m in wrappers if "context_fn" in m.checkpoint_fn.keywords}


def test_full_mode_gives_the_op_policy_only_to_wrappers_holding_a_save_inside_module() -> None:
    assert _with_op_policy(_routed(True)[1]) == {"layers.0.mlp", "layers.1.mlp"}
    assert len(_wrapped_paths(_routed(True)[1])) == 6  # and the norms and attention, plain
    assert _with_op_policy(_routed(False)[1]) == set()


def test_forward_depth_counts_nesting_and_unwinds_after_an_error() -> None:
    outer, inner = nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)
    outer.append(inner)
    depth = ForwardDepth([outer, inner])
    seen: list[int] = []
    inner.register_forward_pre_hook(lambda *_: seen.append(depth.depth))
    outer(torch.zeros(1, 2))
    assert seen == [2] and depth.depth == 0
    with pytest.raises(RuntimeError):
        outer(torch.zeros(1, 3))
    assert depth.depth == 0


def test_profiler_markers_stay_out_of_the_saved_op_accounting() -> None:
    """A checkpointed call may emit more record_function markers in its recompute than in its forward."""
    depth = ForwardDepth([])
    context_fn = policy_context_fn(selective=True, save_inside=depth)
    assert torch.ops.profiler._record_function_enter_new.default in SAC_IGNORED_OPS
    layer = nn.Linear(4, 4)
    calls = {"n": 0}

    def region(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:  # the recompute: one marker more, as a nested FSDP unit's hooks emit
            with torch.profiler.record_function("extra"):
                pass
        with torch.profiler.record_function("marker"):
            return torch.tanh(layer(x))

    x = torch.randn(2, 4, requires_grad=True)
    checkpoint(region, x, use_reentrant=False, context_fn=context_fn).sum().backward()
    assert x.grad is not None and calls["n"] == 2


def test_per_submodule_wraps_each_role_once_and_skips_wrapped() -> None:
    _, model, count = _checkpointed(2)
    layer = model.layers[0]
    for role in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
        assert isinstance(getattr(layer, role), CheckpointWrapper), role
    assert not isinstance(layer.dropout, CheckpointWrapper)
    assert apply_activation_checkpointing(model, discover_layer_groups(model)) == 0
    assert count == 8
    _, whole, _ = _checkpointed(2, whole_layer=True)
    assert apply_activation_checkpointing(whole, discover_layer_groups(whole), mode=True) == 0
    assert not any(
        isinstance(m, CheckpointWrapper) for m in whole.layers[0]._checkpoint_wrapped_module.children()
    )


def _wrapped_paths(model: nn.Module) -> set[str]:
    return {fqn for fqn, m in model.named_modules() if isinstance(m, CheckpointWrapper)}


@pytest.mark.parametrize(
    ("scope", "prefixes"),
    [
        ("all", {"visual", "audio_tower", "language_model"}),
        ("language", {"language_model"}),
        ("vision", {"visual"}),
        ("multimodal", {"visual", "audio_tower"}),
        ("vision+language", {"visual", "language_model"}),
        (("audio",), {"audio_tower"}),
    ],
)
def test_scope_selects_the_right_groups(scope: object, prefixes: set[str]) -> None:
    model = _Vlm()
    groups = discover_layer_groups(model)
    assert {(g.kind, g.path) for g in groups} == {
        ("vision", "visual.blocks"),
        ("audio", "audio_tower.blocks"),
        ("language", "language_model.layers"),
    }
    count = apply_activation_checkpointing(model, groups, scope=scope, whole_layer=True)  # type: ignore[arg-type]
    assert count == 2 * len(prefixes)
    assert {path.split(".")[0] for path in _wrapped_paths(model)} == prefixes
    for group in groups:  # the groups now hold the wrapped layers
        wrapped = group.path.split(".")[0] in prefixes
        assert all(isinstance(layer, CheckpointWrapper) == wrapped for layer in group.layers)


def test_frozen_layers_are_skipped_and_an_empty_selection_warns() -> None:
    model = _Vlm()
    model.visual.requires_grad_(False)
    groups = discover_layer_groups(model)
    with pytest.warns(UserWarning, match="selects no trainable layer"):
        assert apply_activation_checkpointing(model, groups, scope="vision") == 0
    assert _wrapped_paths(model) == set()
    assert model.language_model.config.use_cache is True


def test_unknown_mode_or_scope_is_rejected() -> None:
    model = _Model()
    groups: list[LayerGroup] = discover_layer_groups(model)
    with pytest.raises(ValueError, match="'partial'"):
        apply_activation_checkpointing(model, groups, mode="partial")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="text"):
        apply_activation_checkpointing(model, groups, scope="text")
    assert _wrapped_paths(model) == set()
