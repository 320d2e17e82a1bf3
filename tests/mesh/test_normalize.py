"""Activation-checkpointing scope / mode and frozen-multimodal sharding normalisation."""

from __future__ import annotations

import pytest

from plait.mesh import (
    normalize_ac_scope,
    normalize_activation_checkpointing,
    normalize_frozen_multimodal_sharding,
)


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        ("all", ("all",)),
        (None, ("all",)),
        ("default", ("all",)),
        ("AUTO", ("all",)),
        ("language", ("language",)),
        ("vision+audio", ("vision", "audio")),
        ("Vision,AUDIO", ("vision", "audio")),
        (" language , vision ", ("language", "vision")),
        ("multi-modal", ("multimodal",)),
        ("Multi_Modal+language", ("multimodal", "language")),
        (["vision", "vision"], ("vision",)),
        (("language", "audio+vision"), ("language", "audio", "vision")),
    ],
)
def test_ac_scope_normalised_to_tuple(scope, expected):
    assert normalize_ac_scope(scope) == expected


@pytest.mark.parametrize(
    ("scope", "pattern"),
    [
        ("all,vision", r"mixes 'all' with \['vision'\]"),
        ("auto+language", r"mixes 'all' with \['language'\]"),
        ("text", r"unknown activation_checkpointing_scope 'text'.*all, language, vision, audio, multimodal"),
        ("vision+videos", "unknown activation_checkpointing_scope 'videos'"),
        (" , ", "names no scope"),
    ],
)
def test_ac_scope_errors_name_the_value(scope, pattern):
    with pytest.raises(ValueError, match=pattern):
        normalize_ac_scope(scope)


def test_ac_scope_wrong_types():
    with pytest.raises(TypeError, match=r"must be a string or a list of strings, got 3 \(int\)"):
        normalize_ac_scope(3)
    with pytest.raises(TypeError, match=r"entries must be strings, got 1 \(int\)"):
        normalize_ac_scope(["vision", 1])


@pytest.mark.parametrize(
    ("value", "expected"),
    [(False, False), (None, False), (True, "full"), ("full", "full"), ("Selective", "selective")],
)
def test_activation_checkpointing_mode(value, expected):
    assert normalize_activation_checkpointing(value) == expected


def test_activation_checkpointing_mode_errors():
    with pytest.raises(ValueError, match="unknown activation_checkpointing 'partial'"):
        normalize_activation_checkpointing("partial")
    with pytest.raises(TypeError, match=r"got 1 \(int\)"):
        normalize_activation_checkpointing(1)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("root", "root"), ("ROOT", "root"), ("per-layer", "per_layer"), ("Per_Layer", "per_layer"),
     ("replicate", "replicate")],
)  # fmt: skip
def test_frozen_multimodal_sharding(value, expected):
    assert normalize_frozen_multimodal_sharding(value) == expected


def test_frozen_multimodal_sharding_errors():
    with pytest.raises(
        ValueError, match=r"unknown frozen_multimodal_sharding 'shard'.*root, per_layer, replicate"
    ):
        normalize_frozen_multimodal_sharding("shard")
    with pytest.raises(TypeError, match=r"must be a string .* got None \(NoneType\)"):
        normalize_frozen_multimodal_sharding(None)
