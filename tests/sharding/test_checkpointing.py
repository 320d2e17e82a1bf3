"""Activation checkpointing: recompute is real (FLOPs), results are bit-identical, scopes pick the right groups."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from plait.sharding import LayerGroup, apply_activation_checkpointing, discover_layer_groups, selective_policy


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


class _TopkRouter(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.mlp = nn.Linear(hidden, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, _ = torch.topk(self.mlp(x), k=2, dim=-1)
        return x * values.sum(-1, keepdim=True)


class _CountTopk(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += func is torch.ops.aten.topk.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("save_ops", "expected_calls"), [(None, 4), ({torch.ops.aten.topk}, 2)])
def test_save_ops_are_not_recomputed(save_ops: set | None, expected_calls: int) -> None:
    model = nn.Sequential()
    model.layers = nn.ModuleList(_TopkRouter() for _ in range(2))
    plain = copy.deepcopy(model)
    apply_activation_checkpointing(model, discover_layer_groups(model), whole_layer=True, save_ops=save_ops)
    x = torch.randn(2, 5, 32)
    counter = _CountTopk()
    with counter:
        out = model.layers[1](model.layers[0](x))
        out.sum().backward()
    assert counter.calls == expected_calls  # 2 layers: forward only, or forward + recompute
    ref = plain.layers[1](plain.layers[0](x))
    ref.sum().backward()
    assert torch.equal(out, ref)


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
