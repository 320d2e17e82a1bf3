"""What context parallel refuses, on every rank before any collective (fake process group, one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.cp import (
    ContextParallelAttention,
    apply_context_parallel,
    check_context_parallel_model,
    cp_mesh,
    global_positions,
)
from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder, sdpa_attention
from plait.testing import cp_decoder, named_hf_config


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)


class CrossAttention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block()])
        self.xattn = CrossAttention()


def _ctx(mixers: str = "refuse", **sizes: int) -> MeshContext:
    config = FSDP2Config(mp_policy=None, cp_sequence_mixers=mixers)
    return MeshContext.build(config, ParallelismSizes(cp_size=2, **sizes))


def test_unknown_attention_is_refused_by_name(fake_pg) -> None:
    with fake_pg(2):
        model = _Custom()
        with pytest.raises(ValueError, match=r"layers\.0\.mha \(MultiheadAttention\)") as err:
            apply_context_parallel(model, _ctx())
        assert "xattn (CrossAttention)" in str(err.value)
        with pytest.raises(ValueError, match=r"<root> \(Linear\): no attention found"):
            apply_context_parallel(nn.Linear(2, 2), _ctx())


def test_a_window_the_attention_call_does_not_carry_and_dropout_are_refused(fake_pg) -> None:
    """Qwen3's sliding window reaches cp (passed as sliding_window=); a forward that leaves it to the mask does not."""
    from transformers import Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    class MaskOnlyAttention(Qwen3Attention):
        def forward(self, *args, **kwargs):  # the window would live in the mask alone
            return super().forward(*args, **kwargs)

    with fake_pg(2):
        apply_context_parallel(Qwen3ForCausalLM(named_hf_config("qwen3_sliding_window")), _ctx())
        model = Qwen3ForCausalLM(named_hf_config("qwen3_sliding_window"))
        model.model.layers[1].self_attn.__class__ = MaskOnlyAttention
        with pytest.raises(
            ValueError, match=r"layers\.1\.self_attn: MaskOnlyAttention has window but its forward"
        ):
            apply_context_parallel(model, _ctx())
        llama = cp_decoder("llama")
        llama.config.attention_dropout = 0.1
        with pytest.raises(ValueError, match=r"attention_dropout=0\.1"):
            apply_context_parallel(llama, _ctx())
        assert llama.config._attn_implementation == "sdpa"  # nothing changed


def test_config_names_the_variant() -> None:
    assert FSDP2Config().cp_attention == "all_gather"
    with pytest.raises(
        ValueError,
        match=r"cp_attention must be one of \['all_gather', 'ring', 'all_to_all', 'auto'\], got 'ulysses'",
    ):
        FSDP2Config(cp_attention="ulysses")


def _a2a_ctx(**sizes: int) -> MeshContext:
    return MeshContext.build(
        FSDP2Config(mp_policy=None, cp_attention="all_to_all"), ParallelismSizes(**sizes)
    )


def test_all_to_all_refuses_heads_that_do_not_divide_by_cp(fake_pg) -> None:
    """Named per module, before anything changes; the local heads are counted after TP."""
    three_heads = DenseDecoder(DecoderConfig(num_attention_heads=3, num_key_value_heads=1, head_dim=8))
    with fake_pg(2):
        ctx = _a2a_ctx(cp_size=2)
        check_context_parallel_model(three_heads)  # without a context: only the attention modules
        for call in (check_context_parallel_model, apply_context_parallel):
            with pytest.raises(
                ValueError, match=r"layers\.0\.self_attn \(3 query heads, tp_size=1\): "
            ) as err:
                call(three_heads, ctx)
            assert "3 local query heads (after TP) do not divide by cp_size=2" in str(err.value)
            assert "layers.1.self_attn" in str(err.value)
        assert all(layer.self_attn.attention_fn is sdpa_attention for layer in three_heads.model.layers)
        check_context_parallel_model(three_heads, ctx, variant="all_gather")  # the other variants can
    with fake_pg(8):
        llama = cp_decoder("llama")  # 4 heads: 2 per tp rank, not divisible by cp 4
        with pytest.raises(ValueError, match=r"\(4 query heads, tp_size=2\): .*2 local query heads"):
            apply_context_parallel(llama, _a2a_ctx(cp_size=4, tp_size=2))
        assert llama.config._attn_implementation == "sdpa"


def test_all_to_all_call_refuses_heads_it_cannot_split(fake_pg) -> None:
    """An attention_fn module whose heads the apply step cannot count is refused when called, before the exchange."""
    with fake_pg(2):
        attention = ContextParallelAttention(cp_mesh(_a2a_ctx(cp_size=2)), "all_to_all")
        q = torch.zeros(1, 3, 8, 8)
        with pytest.raises(ValueError, match=r"3 local query heads .* do not divide by cp_size=2"):
            attention(q, q[:, :1], q[:, :1], enable_gqa=True)


def test_forward_refuses_inputs_not_split_by_shard_sequence(fake_pg) -> None:
    with fake_pg(2, rank=1):
        model = apply_context_parallel(cp_decoder("llama"), _ctx())
        assert model.config._attn_implementation == "plait_cp"
        ids = torch.zeros(1, 8, dtype=torch.long)
        good = global_positions(16, 1, 2)[None]
        with pytest.raises(ValueError, match="needs position_ids="):
            model(input_ids=ids)
        with pytest.raises(ValueError, match="are not the global positions"):
            model(input_ids=ids, position_ids=torch.arange(8)[None])
        with pytest.raises(ValueError, match="labels= is not supported"):
            model(input_ids=ids, position_ids=good, labels=ids)
        with pytest.raises(ValueError, match="padding attention_mask"):
            model(input_ids=ids, position_ids=good, attention_mask=torch.zeros(1, 8))


def test_multimodal_models_are_refused(fake_pg) -> None:
    models = pytest.importorskip("plait.models")
    with fake_pg(2), pytest.raises(ValueError, match=r"visual \(VisionTower\): a multimodal tower"):
        apply_context_parallel(models.VLM(), _ctx())


@pytest.mark.parametrize(
    ("model_type", "match"),
    [
        ("llama4_text", r"has chunked attention layers \(config\.attention_chunk_size=8\)"),
        ("deepseek_v32", r"self_attn: DeepseekV32Attention has indexer \(DeepseekV32Indexer\): sparse"),
        (
            "lfm2_moe",
            r"layers\.0\.conv\.conv: a convolution over the sequence \(Conv1d, kernel 3\).*cp_sequence_mixers='gather'",
        ),
        ("minimax", r"self_attn: MiniMaxLightningAttention computes attention in its own forward"),
        (
            "doge",
            r"self_attn: DogeAttention hands its attention function a mask it builds itself \(attn_mask\)",
        ),
    ],
)
def test_attention_cp_cannot_see_is_refused_by_name(fake_pg, model_type: str, match: str) -> None:
    """Chunks in the mask alone, an indexer choosing keys over the whole sequence, a causal conv over time,
    lightning attention: each gave a silent mismatch or a crash in tools/hf_sweep's cp cases."""
    from transformers import AutoModelForCausalLM

    from plait.testing import sweep_hf_config

    with fake_pg(2):
        model = AutoModelForCausalLM.from_config(sweep_hf_config(model_type, 2, cp=2))
        with pytest.raises(ValueError, match=match):
            check_context_parallel_model(model, _ctx())
        with pytest.raises(ValueError, match=match):
            apply_context_parallel(model, _ctx())
        assert model.config._attn_implementation == "eager"  # nothing changed


def _sweep_model(model_type: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from plait.testing import sweep_hf_config

    return AutoModelForCausalLM.from_config(sweep_hf_config(model_type, 2, cp=2))


@pytest.mark.parametrize(
    ("model_type", "gathered"),
    [
        ("lfm2_moe", ("model.layers.0.conv",)),  # the short convolution's block, not the Conv1d alone
        ("minimax", ("model.layers.1.self_attn",)),  # lightning attention computed in its own forward
        ("qwen3_next", ("model.layers.0.linear_attn", "model.layers.1.linear_attn")),
        ("deepseek_v32", ("model.layers.0.self_attn", "model.layers.1.self_attn")),  # DSA indexers
        ("llama", ()),
    ],
)
def test_gather_picks_the_layer_child_holding_each_sequence_mixer(
    fake_pg, model_type: str, gathered: tuple
) -> None:
    from plait.cp import cp_gathered_modules

    with fake_pg(2):
        model = _sweep_model(model_type)
        assert cp_gathered_modules(model, _ctx("gather")) == gathered
        apply_context_parallel(model, _ctx("gather"))
        for name in gathered:  # its hooks are attached; attention elsewhere is switched to cp
            module = model.get_submodule(name)
            assert module._forward_pre_hooks and module._forward_hooks, name
        assert model.config._attn_implementation == "plait_cp"


def test_attention_functions_used_over_blocks_are_refused_by_name(fake_pg) -> None:
    """Inkling 2 attends over its layers' outputs through transformers' attention functions (is_causal=False)."""
    with (
        fake_pg(2),
        pytest.raises(
            ValueError, match=r"mlp_input: Inkling2BlockAttentionResidual calls transformers' attention"
        ),
    ):
        check_context_parallel_model(_sweep_model("inkling2_text"), _ctx("gather"))


def test_a_tensor_the_attention_function_would_drop_is_refused(fake_pg) -> None:
    """An additive position_bias= (Inkling's) reaching split cp attention is refused, not dropped."""
    from transformers import AttentionInterface

    with fake_pg(2, rank=1):
        model = apply_context_parallel(cp_decoder("llama"), _ctx())
        attention = AttentionInterface()["plait_cp"]
        module = model.model.layers[0].self_attn
        q = torch.zeros(1, 4, 8, 8)
        with pytest.raises(ValueError, match=r"\['position_bias'\] \(tensors cp attention does not apply"):
            attention(module, q, q, q, None, position_bias=torch.zeros(1, 4, 8, 8))


def test_compressed_attention_is_refused_even_when_gathering(fake_pg) -> None:
    """DeepSeek V4 pools keys over windows with tensors cp cannot gather: refused by name, not run."""
    with fake_pg(2), pytest.raises(ValueError, match=r"DeepseekV4Attention has compressor \(DeepseekV4"):
        check_context_parallel_model(_sweep_model("deepseek_v4"), _ctx("gather"))
