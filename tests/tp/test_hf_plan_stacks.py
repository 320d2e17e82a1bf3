"""hf_tp_plan finds the plan's block stacks by their keys and lays each part out for the Shard(1) stream.

Translation only (no ranks): the parity of these layouts is in ``test_hf_families.py``.
"""

from __future__ import annotations

import pytest
import transformers
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import RowwiseParallel

from plait.testing import TP_TRANSLATION_HF_SIZES, tiny_hf_model, tp_hf_config
from plait.tp import (
    AllReduceParallel,
    IdentityExpertParallel,
    ReplicatedWithGradAllReduce,
    ReplicateOwnParams,
    ReplicateParallel,
    RowwiseLocalCopy,
    SequenceParallelBlock,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    hf_tp_plan,
    layer_containers,
)
from tests.tp._hf_families import GATHERED_MLP


def test_a_stack_named_otherwise_is_found_from_the_plan_keys() -> None:
    """GPT-NeoX: ``gpt_neox.embed_in`` + ``gpt_neox.layers``, no ``embed_tokens``."""
    model = tiny_hf_model("gpt_neox", **TP_TRANSLATION_HF_SIZES)
    plan = hf_tp_plan(model, True)
    assert plan is not None and layer_containers(model, plan) == ["gpt_neox.layers"]
    embed = plan["gpt_neox.embed_in"]
    assert type(embed) is VocabParallelEmbedding and embed.output_layouts == Shard(1)
    dense = plan["gpt_neox.layers.*.attention.dense"]
    assert type(dense) is RowwiseParallel and dense.output_layouts == (Shard(1),)
    for norm in ("gpt_neox.layers.*.input_layernorm", "gpt_neox.layers.*.post_attention_layernorm"):
        assert type(plan[norm]) is SequenceParallelNorm
    assert type(hf_tp_plan(model, False)["gpt_neox.final_layer_norm"]) is ReplicateParallel


def test_two_stacks_and_a_decoder_parameter() -> None:
    """HRM: two ``*_module.layers`` stacks, each with its final norm; the decoder's own initial state."""
    model = tiny_hf_model("hrm_text", **TP_TRANSLATION_HF_SIZES)
    plan = hf_tp_plan(model, True)
    assert plan is not None
    assert layer_containers(model, plan) == ["model.L_module.layers", "model.H_module.layers"]
    for stack in ("L_module", "H_module"):
        assert type(plan[f"model.{stack}.layers.*.input_layernorm"]) is SequenceParallelNorm
        assert type(plan[f"model.{stack}.final_norm"]) is SequenceParallelNorm
    assert type(plan["model"]) is ReplicateOwnParams  # z_L_init meets the Shard(1) stream


def test_a_block_without_a_rowwise_projection_runs_whole() -> None:
    """Gathered column-wise outputs (Qwen3-Next's linear attention) are whole, not this rank's slice."""
    model = transformers.LlamaForCausalLM(tp_hf_config("llama", base_model_tp_plan=GATHERED_MLP))
    plan = hf_tp_plan(model, True)
    assert plan is not None
    assert [type(plan[f"model.layers.{i}.mlp"]) for i in (0, 1)] == [SequenceParallelBlock] * 2
    assert "model.layers.0.self_attn" not in plan  # has its row-wise o_proj: takes the Shard(1) input


def test_an_unplanned_module_outside_the_stacks_gets_replicated_dtensor_weights() -> None:
    """Gemma3n's per-layer projection runs on the Shard(1) stream: replicated weights, DTensor output."""
    model = tiny_hf_model("gemma3n_text", **TP_TRANSLATION_HF_SIZES, num_key_value_heads=2, head_dim=16, num_kv_shared_layers=1,
                          vocab_size_per_layer_input=96, hidden_size_per_layer_input=8)  # fmt: skip
    plan = hf_tp_plan(model, True)
    assert plan is not None
    projection = plan["model.per_layer_model_projection"]
    assert type(projection) is ReplicateParallel and not projection.use_local_output
    assert "lm_head" in plan and "model.per_layer_model_projection" not in (hf_tp_plan(model, False) or {})


def test_a_replicated_embedding_starts_the_sequence_parallel_stream() -> None:
    config = tp_hf_config(
        "llama", base_model_tp_plan={"embed_tokens": "replicate", "layers.*.mlp.down_proj": "rowwise"}
    )
    plan = hf_tp_plan(transformers.LlamaForCausalLM(config), True)
    assert plan is not None
    embed = plan["model.embed_tokens"]
    assert (
        type(embed) is ReplicateParallel and embed.output_layouts == Shard(1) and not embed.use_local_output
    )


def test_entries_for_parts_the_config_did_not_build_are_skipped_with_a_warning() -> None:
    """Beam with dense MLPs only: its experts entries apply to nothing, and are not refused."""
    plan = {
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts": "moe_tp_experts",
    }
    model = transformers.LlamaForCausalLM(tp_hf_config("llama", base_model_tp_plan=plan))
    with pytest.warns(
        UserWarning, match=r"'model\.layers\.\*\.mlp\.experts\.gate_up_proj' matches no module"
    ):
        translated = hf_tp_plan(model, False)
    assert translated is not None and not any("experts" in key for key in translated)


def test_an_all_reduce_owner_shards_its_own_weights() -> None:
    """Inkling's shared experts: 3-D ``gate_proj`` / ``up_proj`` column-wise, ``down_proj`` row-wise."""
    model = tiny_hf_model("inkling_text", **TP_TRANSLATION_HF_SIZES, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)  # fmt: skip
    plan = hf_tp_plan(model, False)
    assert plan is not None
    shared = plan["model.layers.*.mlp.shared_experts"]
    assert type(shared) is AllReduceParallel
    assert shared.param_styles == {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}


def test_a_norm_pattern_that_would_catch_a_nested_norm_becomes_one_entry_per_layer() -> None:
    """Nemotron-H: ``layers.*.norm`` would also match the Mamba mixer's own gated ``mixer.norm``."""
    model = tiny_hf_model("nemotron_h", **TP_TRANSLATION_HF_SIZES, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
                          mamba_head_dim=16, ssm_state_size=16, n_groups=1, layers_block_type=["mamba", "attention"])  # fmt: skip
    for sp, norm in ((True, SequenceParallelNorm), (False, ReplicateParallel)):
        plan = hf_tp_plan(model, sp)
        assert plan is not None and "model.layers.*.norm" not in plan
        assert [type(plan.get(f"model.layers.{i}.norm")) for i in (0, 1)] == [norm, norm]


def test_module_list_children_are_wrapped_element_by_element() -> None:
    """LongCat-Flash: two attentions and two norms per layer in lists; an identity expert in the experts."""
    latent = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
              "v_head_dim": 8, "head_dim": 8}  # fmt: skip
    model = tiny_hf_model("longcat_flash", **TP_TRANSLATION_HF_SIZES, **latent, num_key_value_heads=4, num_layers=1,
                          n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32,
                          ffn_hidden_size=96, moe_topk=2)  # fmt: skip
    plan = hf_tp_plan(model, True)
    assert plan is not None
    assert type(plan["model.layers.*.mlp.experts.identity_expert"]) is IdentityExpertParallel
    assert [type(plan.get(f"model.layers.0.self_attn.{i}")) for i in (0, 1)] == [SequenceParallelBlock] * 2
    assert type(plan["model.layers.*.input_layernorm.1"]) is SequenceParallelNorm
    assert "model.layers.0.self_attn" not in plan and "model.layers.0.input_layernorm" not in plan


def test_a_norm_inside_the_embedding_gets_summed_gradients_under_sequence_parallel() -> None:
    """Inkling's ``embed_tokens.embed_norm`` runs inside the embedding's forward, on this rank's rows."""
    model = tiny_hf_model("inkling_text", **TP_TRANSLATION_HF_SIZES, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)  # fmt: skip
    norm = (hf_tp_plan(model, True) or {})["model.embed_tokens.embed_norm"]
    assert type(norm) is ReplicatedWithGradAllReduce and norm.input_layouts == Shard(1)
    assert "model.embed_tokens.embed_norm" not in (hf_tp_plan(model, False) or {})  # whole rows: complete


def test_row_wise_outputs_of_a_translated_plan_may_be_updated_in_place() -> None:
    """Llama4 adds the routed experts into the shared expert's output in place (``out.add_``)."""
    model = tiny_hf_model("llama4_text", **TP_TRANSLATION_HF_SIZES, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          intermediate_size_mlp=96)  # fmt: skip
    plan = hf_tp_plan(model, False)
    assert plan is not None
    assert type(plan["model.layers.*.feed_forward.shared_expert.down_proj"]) is RowwiseLocalCopy
    assert (
        type((hf_tp_plan(model, True) or {})["model.layers.*.self_attn.o_proj"]) is RowwiseParallel
    )  # Shard(1)


def test_an_output_layout_with_a_plain_output_is_refused() -> None:
    """``output_layouts`` only means something for a DTensor output: never accepted and ignored."""
    with pytest.raises(ValueError, match=r"output_layouts=.*use_local_output=False"):
        ReplicateParallel(output_layouts=Shard(1))  # the message names the placement
