"""plait.models' reference decoders get plait.tp's one Llama-style plan through the registry."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

from plait.models import VLM, DecoderConfig, DenseDecoder, VLMConfig
from plait.tp import llama_tp_plan, resolve_tp_plan
from plait.tp.registry import model_class_plan


def _layout(plan: dict) -> dict[str, type]:
    return {pattern: type(style) for pattern, style in plan.items()}


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("model", [DenseDecoder(DecoderConfig()), VLM(VLMConfig())], ids=["dense", "vlm"])
def test_reference_models_resolve_the_registered_llama_plan_without_the_default_warning(
    model: nn.Module, sequence_parallel: bool
) -> None:
    assert model_class_plan(model) is llama_tp_plan
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default Llama-style plan would warn
        plan = resolve_tp_plan(model, sequence_parallel=sequence_parallel, tp_size=2)
    assert _layout(plan) == _layout(llama_tp_plan(model, sequence_parallel))
    prefix = "model" if isinstance(model, DenseDecoder) else "language_model"
    assert f"{prefix}.layers.*.self_attn.q_proj" in plan and f"{prefix}.embed_tokens" in plan
    assert "lm_head" in plan


def test_the_dense_decoder_carries_no_plan_of_its_own() -> None:
    assert not hasattr(DenseDecoder, "_tp_plan")


def test_a_subclass_is_not_registered_and_falls_back_to_the_default_plan() -> None:
    class Custom(DenseDecoder):
        pass

    model = Custom(DecoderConfig())
    assert model_class_plan(model) is None
    with pytest.warns(UserWarning, match="default Llama-style plan"):
        plan = resolve_tp_plan(model, tp_size=2)
    assert _layout(plan) == _layout(llama_tp_plan(model, False))
