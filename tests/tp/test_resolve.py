"""resolve_tp_plan: each of the six precedence steps, pattern checks, finalize hook, and the errors."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from plait.testing import tp_hf_config
from plait.tp import (
    ExpertsTensorParallel,
    GatherSequenceInput,
    ReplicatedWithGradAllReduce,
    ReplicateParallel,
    RowwiseLocalCopy,
    SequenceParallelAllGather,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    hf_tp_plan,
    register_model_tp_plan,
    register_tp_plan,
    resolve_tp_plan,
)
from tests.tp._models import (
    ConfiguredLM,
    HeadlessPlanLlama,
    NestedPlanVLM,
    RemoteCodeLM,
    TinyLM,
    UnregisteredLlama,
)

PLAN_DICT = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
NOT_A_PLAN = 42
CALLS: list[tuple[Any, ...]] = []


def plan_factory(model: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    CALLS.append((type(model).__name__, sequence_parallel))
    return {"model.layers.*.mlp.down_proj": RowwiseParallel()}


def zero_arg_factory() -> dict[str, Any]:
    return {"lm_head": "colwise_rep"}


def _quiet_resolve(model: nn.Module, **kwargs: Any) -> dict[str, ParallelStyle]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a resolution that should be silent must not warn
        return resolve_tp_plan(model, tp_size=2, **kwargs)


def test_explicit_dict_parses_strings_and_keeps_objects() -> None:
    style = ColwiseParallel()
    plan = _quiet_resolve(TinyLM(), plan={"model.layers.*.self_attn.q_proj": style, "lm_head": "colwise_rep"})
    assert list(plan) == ["model.layers.*.self_attn.q_proj", "lm_head"]
    assert plan["model.layers.*.self_attn.q_proj"] is style
    assert type(plan["lm_head"]) is ColwiseParallel and plan["lm_head"].output_layouts == (Replicate(),)


def test_explicit_dict_wins_over_everything_else() -> None:
    plan = _quiet_resolve(TinyLM(), plan=PLAN_DICT, model_plan=plan_factory)
    assert set(plan) == set(PLAN_DICT)


def test_registered_name_is_called_with_model_and_sequence_parallel() -> None:
    CALLS.clear()
    register_tp_plan("tests-tp-down-only", plan_factory)
    plan = _quiet_resolve(TinyLM(), plan="tests-tp-down-only", sequence_parallel=True)
    assert set(plan) == {"model.layers.*.mlp.down_proj"}
    assert CALLS == [("TinyLM", True)]


def test_import_path_to_dict_and_to_functions() -> None:
    assert set(_quiet_resolve(TinyLM(), plan="tests.tp.test_resolve:PLAN_DICT")) == set(PLAN_DICT)
    CALLS.clear()
    assert set(_quiet_resolve(TinyLM(), plan="tests.tp.test_resolve:plan_factory")) == {
        "model.layers.*.mlp.down_proj"
    }
    assert CALLS == [("TinyLM", False)]
    assert set(_quiet_resolve(TinyLM(), plan="tests.tp.test_resolve:zero_arg_factory")) == {"lm_head"}


@pytest.mark.parametrize(
    "path",
    [
        "tests.tp.no_such_module:PLAN",
        "tests.tp.test_resolve:NO_SUCH_ATTR",
        "tests.tp.test_resolve:NOT_A_PLAN",
    ],
)
def test_invalid_import_path_lists_the_accepted_forms(path: str) -> None:
    with pytest.raises(ValueError, match="import path") as info:
        resolve_tp_plan(TinyLM(), plan=path, tp_size=2)
    assert path in str(info.value)
    assert "a dict" in str(info.value) and "registered plan name" in str(info.value)


def test_unknown_plan_name_and_bad_plan_type() -> None:
    with pytest.raises(ValueError, match=r"unknown tp_plan 'no-such-plan'.*registered.*llama"):
        resolve_tp_plan(TinyLM(), plan="no-such-plan", tp_size=2)
    with pytest.raises(TypeError, match=r"tp_plan must be a dict.*got list"):
        resolve_tp_plan(TinyLM(), plan=["lm_head"], tp_size=2)
    with pytest.raises(
        TypeError, match="value for 'lm_head' must be a ParallelStyle or a style string, got int"
    ):
        resolve_tp_plan(TinyLM(), plan={"lm_head": 3}, tp_size=2)


def test_unknown_style_string_in_a_plan() -> None:
    with pytest.raises(ValueError, match="Unknown parallel style: 'colwize'"):
        resolve_tp_plan(TinyLM(), plan={"lm_head": "colwize"}, tp_size=2)


def test_sidecar_factory_is_used_when_no_plan_and_none_means_no_opinion() -> None:
    CALLS.clear()
    plan = _quiet_resolve(TinyLM(), model_plan=plan_factory, sequence_parallel=True)
    assert set(plan) == {"model.layers.*.mlp.down_proj"} and CALLS == [("TinyLM", True)]
    with pytest.warns(UserWarning, match="default Llama-style plan"):
        plan = resolve_tp_plan(TinyLM(), model_plan=lambda model, sp: None, tp_size=2)
    assert "model.layers.*.self_attn.q_proj" in plan


class QualifiedLM(TinyLM):
    pass


def test_model_class_registry_qualified_then_bare_name() -> None:
    register_model_tp_plan("QualifiedLM", lambda model, sp: {"lm_head": "colwise"})
    assert set(_quiet_resolve(QualifiedLM())) == {"lm_head"}
    register_model_tp_plan(QualifiedLM, lambda model, sp: {"model.norm": "replicate"})  # qualified name wins
    assert set(_quiet_resolve(QualifiedLM())) == {"model.norm"}


def test_built_in_llama_plan_for_registered_hf_classes() -> None:
    import transformers

    model = transformers.Qwen3ForCausalLM(tp_hf_config("qwen3"))
    plan = _quiet_resolve(model)
    assert type(plan["model.embed_tokens"]) is VocabParallelEmbedding
    assert type(plan["model.layers.*.self_attn.q_norm"]) is ReplicatedWithGradAllReduce
    assert type(plan["model.layers.*.input_layernorm"]) is ReplicateParallel
    head = plan["lm_head"]
    assert (head.input_layouts, head.output_layouts, head.use_local_output) == (
        (Replicate(),),
        (Shard(-1),),
        False,
    )
    sp = _quiet_resolve(model, sequence_parallel=True)
    assert type(sp["model.layers.*.input_layernorm"]) is SequenceParallelNorm
    assert sp["model.embed_tokens"].output_layouts == Shard(1)
    # one all-gather per block: the block gathers, its column-wise projections take the full sequence
    assert type(sp["model.layers.*.self_attn"]) is GatherSequenceInput
    assert type(sp["model.layers.*.mlp"]) is GatherSequenceInput
    assert sp["model.layers.*.self_attn.q_proj"].input_layouts == (Replicate(),)
    assert sp["model.layers.*.mlp.down_proj"].output_layouts == (Shard(1),)
    assert sp["lm_head"].input_layouts == (Shard(1),)
    assert "model.rotary_emb" not in sp  # HF rotary only reads dtype/device from the hidden state


def test_what_transformers_puts_in_tp_plan() -> None:
    """Pin the transformers behaviour hf_tp_plan relies on (class plan + instance plan with prefixed keys)."""
    model = UnregisteredLlama(tp_hf_config("llama"))
    assert type(model)._tp_plan == {"lm_head": "colwise_gather_output"}
    instance = vars(model)["_tp_plan"]
    assert instance["model.layers.*.self_attn.q_proj"] == "colwise"
    assert instance["model.layers.*.mlp.down_proj"] == "rowwise"


def test_hf_plan_translation_for_an_unregistered_hf_class() -> None:
    model = UnregisteredLlama(tp_hf_config("llama"))
    plan = _quiet_resolve(model)
    assert set(plan) == {
        "lm_head",
        "model.embed_tokens",
        *(f"model.layers.*.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        *(f"model.layers.*.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
        "model.layers.*.input_layernorm",
        "model.layers.*.post_attention_layernorm",
        "model.norm",
    }
    assert plan["lm_head"].output_layouts == (Shard(-1),) and plan["lm_head"].use_local_output is False
    assert type(plan["model.embed_tokens"]) is VocabParallelEmbedding
    assert type(plan["model.layers.*.self_attn.o_proj"]) is RowwiseLocalCopy  # its own output tensor
    sp = hf_tp_plan(model, True)
    assert sp is not None
    assert type(sp["model.layers.*.post_attention_layernorm"]) is SequenceParallelNorm
    assert sp["model.layers.*.self_attn.o_proj"].output_layouts == (Shard(1),)
    assert sp["lm_head"].input_layouts == (Shard(1),)


def test_hf_sequence_parallel_without_head_in_plan_gathers_the_final_norm() -> None:
    plan = hf_tp_plan(HeadlessPlanLlama(tp_hf_config("llama")), True)
    assert plan is not None and "lm_head" not in plan
    assert type(plan["model.norm"]) is SequenceParallelAllGather
    assert type(plan["model.layers.*.input_layernorm"]) is SequenceParallelNorm


def test_hf_plan_with_embed_missing_is_completed() -> None:
    model = UnregisteredLlama(tp_hf_config("llama"))
    vars(model)["_tp_plan"] = {k: v for k, v in vars(model)["_tp_plan"].items() if "embed" not in k}
    model.model._tp_plan = {}
    model.config.base_model_tp_plan = {}
    plan = hf_tp_plan(model, False)
    assert plan is not None and type(plan["model.embed_tokens"]) is VocabParallelEmbedding


def test_hf_nested_provider_prefers_language_model_and_shards_fused_experts() -> None:
    plan = _quiet_resolve(NestedPlanVLM())
    prefix = "model.language_model."
    assert type(plan[f"{prefix}embed_tokens"]) is VocabParallelEmbedding  # added: the plan lacked it
    assert type(plan[f"{prefix}layers.*.self_attn.q_proj"]) is ColwiseParallel
    assert plan[f"{prefix}layers.*.mlp.down_proj"].input_layouts == (Replicate(),)  # rowwise_split_input
    experts = plan[f"{prefix}layers.*.mlp.experts"]  # never silently replicated
    assert type(experts) is ExpertsTensorParallel
    assert experts.param_styles == {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    assert not any(key.endswith(("gate_up_proj", "experts.down_proj", "mlp.gate")) for key in plan)
    assert not any(key.startswith("vision_tower") for key in plan)


@pytest.mark.parametrize(
    ("key", "style", "why"),
    [
        ("model.layers.*.mlp", "all_reduce", "all-reduce of a module's output"),
        ("model.layers.*.mlp.gate_proj", "ep_router", "does not implement"),
        ("model.layers.*.mlp.gate_proj.weight", "replicate", "a parameter can only take"),
    ],
)
def test_hf_plan_refuses_styles_it_does_not_build(key: str, style: str, why: str) -> None:
    model = UnregisteredLlama(tp_hf_config("llama"))
    vars(model)["_tp_plan"][key] = style
    with pytest.raises(
        ValueError, match=rf"UnregisteredLlama \(model_type 'llama'\).*{style!r}.*{why}.*tp_size 1"
    ):
        resolve_tp_plan(model, tp_size=2)


def test_hf_plan_refuses_sharded_parameters_without_an_owner_style() -> None:
    model = UnregisteredLlama(tp_hf_config("llama"))
    vars(model)["_tp_plan"]["model.norm.weight"] = "colwise"
    with pytest.raises(ValueError, match=r"gives 'model\.norm' itself no style"):
        resolve_tp_plan(model, tp_size=2)


def test_hf_plan_unmatched_pattern_is_a_warning_and_dropped() -> None:
    model = UnregisteredLlama(tp_hf_config("llama"))
    vars(model)["_tp_plan"]["model.layers.*.self_attn.qkv_proj"] = "colwise"
    with pytest.warns(UserWarning, match=r"'model.layers.\*.self_attn.qkv_proj' matches no module"):
        plan = resolve_tp_plan(model, tp_size=2)
    assert "model.layers.*.self_attn.qkv_proj" not in plan and "model.layers.*.self_attn.q_proj" in plan


def test_hf_plan_with_an_untranslatable_style() -> None:
    model = UnregisteredLlama(tp_hf_config("llama"))
    vars(model)["_tp_plan"]["model.layers.*.self_attn.q_proj"] = "packed_colwise"
    with pytest.raises(ValueError, match=r"'packed_colwise' for 'model\.layers\.\*\.self_attn\.q_proj'"):
        resolve_tp_plan(model, tp_size=2)


def test_explicit_unmatched_pattern_is_an_error_with_hints() -> None:
    with pytest.raises(ValueError, match=r"'model.layers.\*.attn.q_proj' matches no module") as info:
        resolve_tp_plan(TinyLM(), plan={"model.layers.*.attn.q_proj": "colwise"}, tp_size=2)
    assert "similar modules: 'model.layers.0.self_attn.q_proj'" in str(info.value)


def test_default_plan_warns_and_covers_the_decoder() -> None:
    with pytest.warns(UserWarning, match="no TP plan found for TinyLM; using the default Llama-style plan"):
        plan = resolve_tp_plan(TinyLM(qk_norm=True), tp_size=2)
    assert type(plan["model.layers.*.self_attn.k_norm"]) is ReplicatedWithGradAllReduce
    assert type(plan["model.layers.*.mlp.gate_proj"]) is ColwiseParallel
    assert plan["lm_head"].output_layouts == (Shard(-1),)


def test_default_plan_on_a_model_without_decoder() -> None:
    with (
        pytest.warns(UserWarning, match="default Llama-style plan"),
        pytest.raises(ValueError, match="Sequential has no Llama-style decoder"),
    ):
        resolve_tp_plan(nn.Sequential(nn.Linear(2, 2)), tp_size=2)


def test_remote_code_without_plan_at_tp_above_one() -> None:
    with pytest.raises(ValueError, match=r"RemoteCodeLM is remote code .*tp_size 2.*register_model_tp_plan"):
        resolve_tp_plan(RemoteCodeLM(), tp_size=2)
    with pytest.warns(UserWarning, match="default Llama-style plan"):
        assert resolve_tp_plan(RemoteCodeLM(), tp_size=1)
    assert _quiet_resolve(RemoteCodeLM(), plan=PLAN_DICT)  # an explicit plan is fine
    transformers_modules_cls = type(
        "DynamicLM", (ConfiguredLM,), {"__module__": "transformers_modules.x.modeling"}
    )
    with pytest.raises(ValueError, match="DynamicLM is remote code"):
        resolve_tp_plan(transformers_modules_cls(), tp_size=4)


def test_finalize_can_edit_in_place_or_return_a_new_plan() -> None:
    def drop_head(model: nn.Module, plan: dict[str, ParallelStyle]) -> None:
        del plan["lm_head"]

    plan = _quiet_resolve(TinyLM(), plan={**PLAN_DICT, "lm_head": "colwise"}, finalize=drop_head)
    assert set(plan) == set(PLAN_DICT)
    plan = _quiet_resolve(TinyLM(), plan=PLAN_DICT, finalize=lambda model, plan: {"lm_head": "colwise_rep"})
    assert set(plan) == {"lm_head"} and isinstance(plan["lm_head"], ColwiseParallel)
    with pytest.raises(ValueError, match=r"'model\.nope' matches no module"):
        resolve_tp_plan(
            TinyLM(), plan=PLAN_DICT, tp_size=2, finalize=lambda model, plan: {"model.nope": "colwise"}
        )


def test_factories_build_fresh_style_objects() -> None:
    first = _quiet_resolve(TinyLM(), plan="llama")
    second = _quiet_resolve(TinyLM(), plan="llama")
    assert all(first[key] is not second[key] for key in first)
