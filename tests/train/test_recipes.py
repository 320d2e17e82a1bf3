"""Recipes map strictly onto dataclasses; overrides obey the same rules; shipped recipes all load."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.train.config import Recipe
from plait.train.recipes import RECIPES_DIR, apply_overrides, load_recipe, parse_override


def test_default_recipe_is_fsdp_tp_sp_with_ac_on_four_ranks():
    recipe = load_recipe()
    assert recipe == Recipe()
    assert (recipe.parallel.strategy, recipe.parallel.tp_size, recipe.parallel.sequence_parallel) == (
        "fsdp2",
        2,
        True,
    )
    assert recipe.parallel.activation_checkpointing is True
    assert recipe.launch.nproc_per_node == 4
    assert recipe.data.source == "stdlib"


def test_overrides_are_yaml_parsed_and_nested():
    recipe = load_recipe(
        None,
        [
            "train.steps=7",
            "optim.lr=1e-3",
            "data.paths=[a.txt, b.jsonl]",
            "data.source=files",
            "model.arch.hidden_size=64",
        ],
    )
    assert recipe.train.steps == 7
    assert recipe.optim.lr == pytest.approx(1e-3)
    assert recipe.data.paths == ["a.txt", "b.jsonl"]
    assert recipe.model.arch == {"hidden_size": 64}


def test_unknown_key_is_named_with_a_suggestion(tmp_path: Path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  stepz: 3\n")
    with pytest.raises(
        ValueError, match=r"unknown recipe key 'train\.stepz' \(did you mean 'train\.steps'\?\)"
    ):
        load_recipe(str(path))
    with pytest.raises(ValueError, match=r"unknown recipe key 'optim\.learning_rate'"):
        load_recipe(None, ["optim.learning_rate=0.1"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.steps=ten", r"train\.steps must be int, got 'ten' \(str\)"),
        ("train.steps=2.5", r"train\.steps must be int, got 2\.5 \(float\)"),
        ("parallel.sequence_parallel=1", r"parallel\.sequence_parallel must be bool, got 1 \(int\)"),
        ("parallel.strategy=zero3", r"parallel\.strategy must be one of 'fsdp2', 'ddp', 'megatron_fsdp'"),
        ("data.paths=a.txt", r"data\.paths must be a list, got 'a\.txt' \(str\)"),
        ("train=3", r"train must be a mapping"),
    ],
)
def test_wrong_types_are_rejected_naming_the_key(override: str, message: str):
    with pytest.raises((TypeError, ValueError), match=message):
        load_recipe(None, [override])


def test_values_are_validated():
    with pytest.raises(ValueError, match=r"train\.steps must be > 0, got 0"):
        load_recipe(None, ["train.steps=0"])
    with pytest.raises(ValueError, match=r"data\.val_fraction must be in \(0, 0\.5\)"):
        load_recipe(None, ["data.val_fraction=0.9"])


def test_override_syntax_errors():
    with pytest.raises(ValueError, match=r"KEY\.PATH=VALUE"):
        parse_override("train.steps")
    with pytest.raises(TypeError, match=r"'train\.steps' is 3, not a mapping"):
        apply_overrides({"train": {"steps": 3}}, ["train.steps.x=1"])


def test_int_is_accepted_for_float_and_float_kept():
    assert load_recipe(None, ["optim.lr=1"]).optim.lr == 1.0
    assert isinstance(load_recipe(None, ["optim.lr=1"]).optim.lr, float)


@pytest.mark.parametrize("path", sorted(RECIPES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_load(path: Path):
    recipe = load_recipe(str(path))
    assert recipe.name == path.stem


def test_recipes_found_by_bare_name():
    assert load_recipe("hsdp").parallel.dp_replicate_size == 2
    with pytest.raises(ValueError, match="recipe 'nope' not found"):
        load_recipe("nope")
