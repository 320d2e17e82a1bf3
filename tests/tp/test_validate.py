"""Head-count validation, apply_tp's refusals (all before any collective), and async TP errors."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel

from plait.testing.fake_pg import fake_process_group
from plait.tp import apply_tp, enable_async_tp, llama_tp_plan, validate_tp_mesh
from tests.tp._models import ConfiguredLM, TinyLM


@pytest.fixture
def tp4() -> Iterator[DeviceMesh]:
    with fake_process_group(8, rank=5):
        yield init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))["tp"]


def test_heads_not_divisible_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be divisible by tp_size \(4\)"):
        validate_tp_mesh(ConfiguredLM(heads=6, kv_heads=2, hidden=12), 4)


def test_kv_heads_not_divisible_names_both_numbers() -> None:
    with pytest.raises(
        ValueError, match=r"num_key_value_heads \(2\) must be divisible by tp_size \(4\)"
    ) as info:
        validate_tp_mesh(ConfiguredLM(heads=8, kv_heads=2), 4)
    assert "[1, 2]" in str(info.value)  # the tp sizes that would work


def test_kv_heads_default_to_heads_and_valid_sizes_pass() -> None:
    model = ConfiguredLM(heads=4, kv_heads=None)
    validate_tp_mesh(model, 4)
    validate_tp_mesh(model, 2)
    model.config.num_key_value_heads = 2
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) must be divisible by tp_size \(4\)"):
        validate_tp_mesh(model, 4)


def test_language_config_text_config_first_then_deepest_language_path() -> None:
    model = ConfiguredLM(heads=4, kv_heads=4)
    model.config.text_config = SimpleNamespace(num_attention_heads=6, num_key_value_heads=6)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\)"):
        validate_tp_mesh(model, 4)
    vlm = nn.Module()
    vlm.config = SimpleNamespace(num_attention_heads=8)  # e.g. a vision config at the root
    vlm.language_model = nn.Module()
    vlm.language_model.config = SimpleNamespace(num_attention_heads=12, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) must be divisible by tp_size \(2\)"):
        validate_tp_mesh(vlm, 2)


def test_nested_sub_model_config_is_not_the_language_config() -> None:
    # phi4_multimodal: the root config sizes the decoder; a deeper vision tower has its own config
    model = ConfiguredLM(heads=4, kv_heads=4)
    model.model.vision = nn.Module()
    model.model.vision.tower = nn.Module()
    model.model.vision.tower.config = SimpleNamespace(num_attention_heads=2)
    validate_tp_mesh(model, 4)
    model.model.config = SimpleNamespace(num_attention_heads=6, num_key_value_heads=6)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\)"):  # the decoder's own config
        validate_tp_mesh(model, 4)


def test_invalid_sizes_and_heads() -> None:
    with pytest.raises(ValueError, match="tp_size must be a positive int, got 0"):
        validate_tp_mesh(ConfiguredLM(), 0)
    model = ConfiguredLM()
    model.config.num_attention_heads = 0
    with pytest.raises(ValueError, match="num_attention_heads must be a positive int, got 0"):
        validate_tp_mesh(model, 2)
    validate_tp_mesh(TinyLM(), 3)  # no config: nothing to check


def test_validate_accepts_a_mesh(tp4: DeviceMesh) -> None:
    validate_tp_mesh(ConfiguredLM(heads=8, kv_heads=4), tp4)
    with pytest.raises(ValueError, match=r"\(2\) must be divisible by tp_size \(4\)"):
        validate_tp_mesh(ConfiguredLM(heads=8, kv_heads=2), tp4)


def test_apply_tp_refusals_happen_before_any_change(tp4: DeviceMesh) -> None:
    model = TinyLM(heads=4, kv_heads=2)
    with pytest.raises(ValueError, match=r"'model.layers.\*.attn.q_proj' matches no module"):
        apply_tp(model, tp4, {"model.layers.*.attn.q_proj": "colwise"})
    with pytest.raises(
        ValueError, match=r"matched by tp_plan patterns 'model\.layers\.\*\.mlp\.up_proj' and '\*up_proj'"
    ):
        apply_tp(model, tp4, {"model.layers.*.mlp.up_proj": "colwise", "*up_proj": "colwise"})
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.num_key_value_heads \(2\) must be divisible"
    ):
        apply_tp(model, tp4, {"model.layers.*.self_attn.k_proj": ColwiseParallel()})
    with pytest.raises(ValueError, match="1-D TP mesh"):
        apply_tp(model, init_device_mesh("cpu", (2, 4)), {"lm_head": "colwise"})
    tied = TinyLM(tie=True)
    with pytest.raises(ValueError, match=r"tied parameters .*\['lm_head'\] is not in the tp_plan"):
        apply_tp(tied, tp4, {"model.embed_tokens": "embedding_rowwise"})
    assert all(not hasattr(p, "placements") for p in (*model.parameters(), *tied.parameters()))


def test_apply_tp_rewrites_local_heads_and_reties(tp4: DeviceMesh) -> None:
    model = TinyLM(hidden=32, heads=8, kv_heads=4, tie=True)
    returned = apply_tp(model, tp4, llama_tp_plan(model, False))
    assert returned is model
    for layer in model.model.layers:
        attn = layer.self_attn
        assert (attn.num_heads, attn.num_key_value_heads, attn.head_dim) == (2, 1, 4)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.to_local().shape == (13, 32)  # vocab 50 over 4 ranks: 13, 13, 13, 11


def test_async_tp_needs_sequence_parallel(tp4: DeviceMesh) -> None:
    with pytest.raises(ValueError, match="needs sequence_parallel=True"):
        enable_async_tp(tp4, sequence_parallel=False)


def test_async_tp_on_cpu_is_a_clear_error(tp4: DeviceMesh) -> None:
    with pytest.raises(ValueError, match="CUDA symmetric memory, but the TP mesh is on 'cpu'"):
        enable_async_tp(tp4, sequence_parallel=True)
