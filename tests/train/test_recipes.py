"""Recipes map strictly onto dataclasses; overrides obey the same rules; shipped recipes all load."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.train.config import OptimConfig, Recipe
from plait.train.models import build_model
from plait.train.recipes import MAX_DEPTH, RECIPES_DIR, apply_overrides, load_recipe, parse_override


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
        (
            "parallel.strategy=zero3",
            r"parallel\.strategy: unknown strategy 'zero3'; allowed: fsdp2, ddp, megatron_fsdp",
        ),
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


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return str(path)


def test_strategy_names_are_the_librarys():
    assert load_recipe(None, ["parallel.strategy=Megatron-FSDP"]).parallel.strategy == "megatron_fsdp"
    assert load_recipe(None, ["parallel.strategy=mfsdp"]).parallel.strategy == "megatron_fsdp"
    assert load_recipe(None, ["parallel.strategy=DDP", "parallel.tp_size=1"]).parallel.strategy == "ddp"


@pytest.mark.parametrize(
    ("option", "field"),
    [
        ("sequence_parallel=false", "parallel.sequence_parallel"),
        ("enable_compile=true", "parallel.compile"),
        ("mp_policy=null", "parallel.mixed_precision"),
    ],
)
def test_options_cannot_respell_a_first_class_field(option: str, field: str):
    key = option.partition("=")[0]
    with pytest.raises(ValueError, match=rf"parallel\.options\.{key} duplicates {field}; set {field} only"):
        load_recipe(None, [f"parallel.options.{option}"])
    assert load_recipe(None, ["parallel.options.fsdp2_forward_prefetch_depth=2"]).parallel.options == {
        "fsdp2_forward_prefetch_depth": 2
    }


def test_aliases_are_refused_so_an_alias_bomb_never_expands(tmp_path: Path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    with pytest.raises(
        ValueError, match=r"r\.yaml', line 2: YAML aliases \(\*a\) are not allowed in a recipe"
    ):
        load_recipe(_write(tmp_path, bomb))
    with pytest.raises(ValueError, match=r"--set data\.paths: line 1: YAML aliases"):
        load_recipe(None, ["data.paths=[&x a, *x]"])


def test_duplicate_keys_are_refused_with_both_lines(tmp_path: Path):
    with pytest.raises(ValueError, match=r"line 3: duplicate key 'steps' \(first at line 2\)"):
        load_recipe(_write(tmp_path, "train:\n  steps: 3\n  steps: 4\n"))


def test_nesting_deeper_than_the_bound_is_one_line_not_a_recursion_error(tmp_path: Path):
    deep = "model:\n  arch:\n    x: " + "[" * 5000 + "]" * 5000 + "\n"
    with pytest.raises(ValueError, match=rf"nesting deeper than {MAX_DEPTH} levels"):
        load_recipe(_write(tmp_path, deep))
    nested = "".join("  " * i + f"k{i}:\n" for i in range(MAX_DEPTH + 2))
    with pytest.raises(ValueError, match="nesting deeper"):
        load_recipe(_write(tmp_path, nested))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr=.inf", r"optim\.lr must be a finite number, got inf"),
        ("optim.grad_clip=.nan", r"optim\.grad_clip must be a finite number, got nan"),
        ("optim.betas=[0.9, .inf]", r"optim\.betas\[1\] must be a finite number, got inf"),
        ("model.arch.rope_theta=-.inf", r"model\.arch\.rope_theta must be a finite number, got -inf"),
    ],
)
def test_non_finite_numbers_are_refused(override: str, message: str):
    with pytest.raises((TypeError, ValueError), match=message):
        recipe = load_recipe(None, [override])
        build_model(recipe.model, "meta")
    with pytest.raises(ValueError, match=r"optim\.lr must be a finite number, got inf"):
        OptimConfig(lr=float("inf"))


def test_hf_config_keys_are_checked_against_the_config_class():
    pytest.importorskip("transformers")
    recipe = load_recipe(
        None, ["model.source=hf", "model.hf_class=LlamaForCausalLM", "model.hf_config.hiden_size=64"]
    )
    with pytest.raises(
        ValueError,
        match=r"model\.hf_config key 'hiden_size' is not a field of LlamaConfig \(did you mean 'hidden_size'\?\)",
    ):
        build_model(recipe.model, "meta")
    ok = load_recipe(
        None,
        [
            "model.source=hf",
            "model.hf_class=LlamaForCausalLM",
            "model.hf_config={hidden_size: 32, num_hidden_layers: 1, attn_implementation: eager}",
        ],
    )
    assert build_model(ok.model, "meta").config.hidden_size == 32
