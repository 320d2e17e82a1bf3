"""Stage split in one process: balance, explicit counts, pruning keeps keys and chains to the full forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.models import VLM, DecoderConfig, DenseDecoder, VLMConfig
from plait.pipeline import PipelineConfig, find_decoder_parts, plan_stages
from plait.pipeline.split import PrunedModule, StageUnion, build_stage_module, check_untied_across_stages
from plait.testing import pipeline_decoder


def _chain(model: nn.Module, num_stages: int, layers_per_stage: list[int] | None = None) -> list[nn.Module]:
    parts = find_decoder_parts(model)
    specs = plan_stages(model, parts, num_stages, layers_per_stage)
    return [build_stage_module(model, parts, spec, num_stages) for spec in specs]


@pytest.mark.parametrize("kind", ["dense", "moe", "llama"])
def test_stages_chain_to_the_full_forward_with_the_full_models_keys(kind: str) -> None:
    torch.manual_seed(0)
    model = pipeline_decoder(kind, 5)
    ids = torch.randint(0, 96, (2, 8))
    expected = model(ids)
    expected = expected if isinstance(expected, torch.Tensor) else expected.logits
    stages = _chain(model, 3)
    h = ids
    for stage in stages:
        out = stage(h, return_dict=False) if kind == "llama" else stage(h)
        h = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(h, expected, rtol=0, atol=0)
    keys = [k for stage in stages for k in stage.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())  # each key on exactly one stage
    union = StageUnion(stages, find_decoder_parts(model))
    assert sorted(union.state_dict()) == sorted(model.state_dict())
    first, *_, last = stages
    assert isinstance(last.get_submodule(find_decoder_parts(model).embedding), PrunedModule)
    assert isinstance(first.get_submodule("lm_head"), PrunedModule)
    assert all(p is dict(model.named_parameters())[n] for s in stages for n, p in s.named_parameters())


def test_balanced_by_parameter_count_and_explicit_counts() -> None:
    # vocab 2048 x hidden 32 = 65,536 per table vs 9,216 per layer: the end stages take fewer layers
    model = DenseDecoder(DecoderConfig(vocab_size=2048, num_hidden_layers=12))
    parts = find_decoder_parts(model)
    balanced = [len(s.layers) for s in plan_stages(model, parts, 3)]
    assert sum(balanced) == 12 and balanced[1] > balanced[0] and balanced[1] > balanced[2], balanced
    even = DenseDecoder(DecoderConfig(vocab_size=8, num_hidden_layers=8))
    assert [len(s.layers) for s in plan_stages(even, find_decoder_parts(even), 4)] == [2, 2, 2, 2]
    explicit = plan_stages(model, parts, 3, [1, 10, 1])
    assert [s.layers for s in explicit] == [(0,), tuple(range(1, 11)), (11,)]


def test_split_refusals() -> None:
    model = DenseDecoder(DecoderConfig(num_hidden_layers=2))
    parts = find_decoder_parts(model)
    with pytest.raises(ValueError, match="3 pipeline stages but DenseDecoder has only 2 layers"):
        plan_stages(model, parts, 3)
    with pytest.raises(ValueError, match="layers_per_stage"):
        plan_stages(model, parts, 2, [2, 1])
    tied = DenseDecoder(DecoderConfig(tie_word_embeddings=True))
    with pytest.raises(ValueError, match="ties its input embedding and output head"):
        check_untied_across_stages(tied, find_decoder_parts(tied))
    with pytest.raises(ValueError, match="cannot place parameters"):
        find_decoder_parts(VLM(VLMConfig()))


def test_config_refusals() -> None:
    with pytest.raises(ValueError, match="is not one of"):
        PipelineConfig(schedule="dualpipe")
    with pytest.raises(ValueError, match="runs one stage per rank"):
        PipelineConfig(schedule="1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match="needs stages_per_rank=2"):
        PipelineConfig(schedule="zbv_zero_bubble", stages_per_rank=3)
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        PipelineConfig(microbatches=0)
    with pytest.raises(ValueError, match="needs microbatches >= pp_size"):
        PipelineConfig(schedule="1f1b", microbatches=2).check_for(4)
    with pytest.raises(ValueError, match="multiple of"):
        PipelineConfig(schedule="interleaved_1f1b", microbatches=7).check_for(2)
    with pytest.raises(ValueError, match="unknown pipeline option"):
        PipelineConfig.from_dict({"schedul": "1f1b"})
    assert PipelineConfig.from_dict({"layers_per_stage": [1, 2]}).layers_per_stage == (1, 2)
    assert PipelineConfig(schedule="interleaved_1f1b").num_microbatches(2) == 4
