"""Layer-group discovery: explicit paths first, then structure; errors name the model class."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from plait.models import VLM as TinyVLM
from plait.models import DecoderConfig, DenseDecoder
from plait.sharding import LayerGroup, apply_activation_checkpointing, discover_layer_groups


class _Layer(nn.Module):
    def __init__(self, experts: int = 0) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        if experts:
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(experts))


class _Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(experts=8) for _ in range(3))  # the experts list is longer
        self.extra = nn.ModuleList(_Layer() for _ in range(2))


class _Vision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): _Layer() for i in range(2)})  # numeric keys: a layer container
        self.heads = nn.ModuleDict({"cls": _Layer(), "reg": _Layer()})  # named keys: not one


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Backbone()
        self.vision_tower = _Vision()
        self.audio = nn.ModuleDict({"encoder": nn.ModuleDict({"layers": nn.ModuleList([_Layer()])})})


def _summary(groups: list[LayerGroup]) -> list[tuple[str, str, int]]:
    return [(g.kind, g.path, len(g.layers)) for g in groups]


def test_structural_discovery_keeps_the_longest_container_per_kind() -> None:
    model = _Model()
    groups = discover_layer_groups(model)
    assert _summary(groups) == [
        ("language", "model.layers", 3),
        ("vision", "vision_tower.blocks", 2),
        ("audio", "audio.encoder.layers", 1),
    ]
    assert groups[0].layers == list(model.model.layers)


def test_explicit_paths_win_and_the_first_resolving_candidate_is_used() -> None:
    model = _Model()
    by_kind = discover_layer_groups(model, {"language": ("language_model.layers", "model.extra")})
    assert _summary(by_kind) == [("language", "model.extra", 2)]
    listed = discover_layer_groups(model, ["model.layers", ("visual.blocks", "vision_tower.blocks")])
    assert _summary(listed) == [("language", "model.layers", 3), ("vision", "vision_tower.blocks", 2)]


def test_unresolvable_explicit_paths_fall_back_to_structure_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="layer_group_paths"):
        groups = discover_layer_groups(_Model(), {"language": "language_model.layers"})
    assert [g.path for g in groups] == ["model.layers", "vision_tower.blocks", "audio.encoder.layers"]


def test_bad_explicit_paths_are_rejected() -> None:
    with pytest.raises(ValueError, match="'model' resolves to _Backbone"):
        discover_layer_groups(_Model(), {"language": "model"})
    with pytest.raises(ValueError, match="'speech'"):
        discover_layer_groups(_Model(), {"speech": "model.layers"})


def test_a_model_without_layer_container_is_an_error_naming_its_class() -> None:
    class FlatNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
            self.empty = nn.ModuleList()

    with pytest.raises(ValueError, match="FlatNet has no layer container"):
        discover_layer_groups(FlatNet())


def test_shared_models_groups_and_per_submodule_roles() -> None:
    vlm = TinyVLM()
    groups = discover_layer_groups(vlm)
    assert _summary(groups) == [("vision", "visual.blocks", 2), ("language", "language_model.layers", 2)]
    assert apply_activation_checkpointing(vlm, groups, scope="vision") == 8  # norm1, attn, norm2, mlp x 2
    assert vlm.config.use_cache is False
    wrapped = sorted(f for f, m in vlm.named_modules() if isinstance(m, CheckpointWrapper))
    assert wrapped == [f"visual.blocks.{i}.{r}" for i in range(2) for r in ("attn", "mlp", "norm1", "norm2")]
    decoder = DenseDecoder(DecoderConfig())
    assert _summary(discover_layer_groups(decoder)) == [("language", "model.layers", 2)]
