"""plait.models' classes bring their own TP plan as class data; plait.tp registers nothing for them."""

from __future__ import annotations

import warnings

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from plait.models import VLM, DecoderConfig, DenseDecoder, VLMConfig
from plait.tp import resolve_tp_plan


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_reference_models_resolve_their_class_plan_without_the_default_warning(
    sequence_parallel: bool,
) -> None:
    for model, prefix in ((DenseDecoder(DecoderConfig()), "model"), (VLM(VLMConfig()), "language_model")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the default Llama-style plan would warn
            plan = resolve_tp_plan(model, sequence_parallel=sequence_parallel, tp_size=2)
        assert isinstance(plan[f"{prefix}.layers.*.self_attn.q_proj"], ColwiseParallel)
        assert isinstance(plan[f"{prefix}.layers.*.mlp.down_proj"], RowwiseParallel)
        assert "lm_head" in plan and f"{prefix}.embed_tokens" in plan


def test_a_subclass_without_the_attribute_falls_back_to_the_default_plan() -> None:
    class Bare(DenseDecoder):
        _tp_plan = None

    with pytest.warns(UserWarning, match="default Llama-style plan"):
        resolve_tp_plan(Bare(DecoderConfig()), tp_size=2)
