"""Expert parallel on unmodified Hugging Face MoE classes (fast subset; the matrix: tools/moe_hf_sweep.py).

Fused 3-D experts (Mixtral: gate_up_proj [E, 2I, H]) and the transposed, biased layout (GPT-OSS:
[E, H, 2I] + biases), at ep=2 x ep_shard=2, ep=4 and ep=2 x tp=2: per-parameter gradients and SGD
parameters <= 1e-5 relative, the router aux loss unchanged, state-dict keys unchanged, held expert
bytes = total / (ep x ep_shard) within 2 %, and the reference's router margin asserted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.sidecar import parallelize_model
from plait.testing import hf_moe_cases, hf_moe_model, named_hf_config, run_on_ranks

CASES = [("mixtral", "ep=2"), ("gpt_oss", "ep=4"), ("qwen3_moe", "ep=2 x tp=2")]


def test_hugging_face_moe_families_match_reference_under_expert_parallel() -> None:
    for rank in run_on_ranks(hf_moe_cases, 4, CASES, timeout=600):
        for result in rank:
            result.check()


def test_dense_model_with_ep_is_refused_before_any_collective(fake_pg: Any) -> None:
    config = named_hf_config("llama_one_layer")
    with fake_pg(4):
        ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(ep_size=2))
        with pytest.raises(ValueError, match=r"LlamaForCausalLM has no MoE block .* use ep_size 1"):
            parallelize_model(transformers.LlamaForCausalLM(config), ctx)


def test_experts_not_divisible_by_ep_are_refused_naming_the_numbers(fake_pg: Any) -> None:
    model = hf_moe_model("mixtral")  # 4 experts
    with fake_pg(8):
        ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(ep_size=8))
        with pytest.raises(
            ValueError,
            match=r"num_experts \(4\) of 'model.layers.0.mlp.experts' must be divisible by ep_size \(8\)",
        ):
            parallelize_model(model, ctx)


def test_own_hf_plan_under_ep_x_tp_leaves_experts_to_ep_and_a_user_plan_on_them_is_refused(
    fake_pg: Any,
) -> None:
    model = hf_moe_model("mixtral")
    own_plan = {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()}
    assert "model.layers.*.mlp.experts" in own_plan  # the HF plan shards the experts (moe_tp_experts)
    with fake_pg(4):
        ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(ep_size=2, tp_size=2))
        par = parallelize_model(model, ctx)
        experts = par.model.layers[0].mlp.experts.gate_up_proj
        q_proj = par.model.layers[0].self_attn.q_proj.weight
        assert experts.device_mesh.mesh_dim_names == ("ep_shard", "ep"), experts.device_mesh
        assert q_proj.device_mesh.mesh_dim_names == ("dp_shard", "tp"), q_proj.device_mesh
        user_plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.mlp.gate": "replicate"}
        user = MeshContext.build(
            FSDP2Config(mp_policy=None, tp_plan=user_plan), ParallelismSizes(ep_size=2, tp_size=2)
        )
        with pytest.raises(
            ValueError,
            match=r"pattern 'model.layers.\*.mlp.gate' matches .*router 'model.layers.0.mlp.gate'.* remove the pattern",
        ):
            parallelize_model(hf_moe_model("mixtral"), user)


def _local_bytes(model: Any) -> int:
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters()
    )


def test_mixtral_under_tp_alone_holds_at_most_055_of_a_tp_run_with_replicated_experts(fake_pg: Any) -> None:
    # Mixtral's proportions (8 experts, top-2, intermediate 3.5 x hidden, few KV heads): experts hold most
    # weights. Gradients and optimizer state take each parameter's placement, so the parameter bytes'
    # ratio is the held state's (tools/bench/moe_bench.py measures all three after AdamW steps: 0.521).
    config = named_hf_config("mixtral_proportions")
    own = {f"model.{k}": v for k, v in config.base_model_tp_plan.items()}
    without_experts = {k: v for k, v in own.items() if ".experts" not in k}
    replicated = without_experts | {
        "model.embed_tokens": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    }
    held = {}
    with fake_pg(2):
        for name, plan in (("sharded", None), ("replicated", replicated)):
            torch.manual_seed(0)
            ctx = MeshContext.build(FSDP2Config(mp_policy=None, tp_plan=plan), ParallelismSizes(tp_size=2))
            held[name] = _local_bytes(parallelize_model(transformers.MixtralForCausalLM(config), ctx))
    total = _local_bytes(transformers.MixtralForCausalLM(config))
    assert held["sharded"] <= 0.55 * held["replicated"], held
    assert held["sharded"] <= 0.51 * total, (held, total)  # everything but norms and routers halves


def test_per_expert_module_containers_of_the_locked_transformers_are_refused(fake_pg: Any) -> None:
    # transformers 5.24: SwitchTransformers and NLLB-MoE keep a per-expert ModuleDict (VitPose a
    # ModuleList); every causal-LM MoE family stacks its experts in fused 3-D parameters.
    config = named_hf_config("switch_transformers")
    with fake_pg(2):
        ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(ep_size=2))
        with pytest.raises(
            ValueError,
            match=r"'encoder.block.1.layer.1.mlp.experts' is a per-expert SwitchTransformersExperts \(an nn.ModuleDict\)",
        ):
            parallelize_model(transformers.SwitchTransformersForConditionalGeneration(config), ctx)
