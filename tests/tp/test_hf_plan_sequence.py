"""hf_tp_plan under sequence parallel: the layer children the plan leaves out run on the whole sequence."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from plait.testing import TP_TRANSLATION_HF_SIZES, named_hf_config, tiny_hf_model, tp_hf_config
from plait.tp import (
    ReplicateOwnParams,
    ReplicateParallel,
    SequenceParallelBlock,
    SequenceParallelNorm,
    hf_tp_plan,
)

MLP_ONLY = {
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def test_unplanned_attention_runs_whole_under_sequence_parallel() -> None:
    """AFMoE / Granite-MoE style: the plan shards the MLP only; attention's weights stay whole."""
    model = transformers.LlamaForCausalLM(tp_hf_config("llama", base_model_tp_plan=MLP_ONLY))
    plan = hf_tp_plan(model, True)
    assert plan is not None
    for layer in (0, 1):
        block = plan[f"model.layers.{layer}.self_attn"]
        assert type(block) is SequenceParallelBlock and block.replicate_params, sorted(plan)
        assert f"model.layers.{layer}.mlp" not in plan  # planned inside: its styles take the Shard(1) input
    assert type(plan["model.layers.*.mlp.gate_proj"]) is ColwiseParallel
    assert type(plan["model.layers.*.input_layernorm"]) is SequenceParallelNorm
    without_sp = hf_tp_plan(model, False)
    assert without_sp is not None and not any("self_attn" in key for key in without_sp)


def test_decoder_norms_are_found_whatever_their_name() -> None:
    """Phi's final norm is ``final_layernorm``: under SP it must take the ``Shard(1)`` stream too."""
    config = named_hf_config("phi_translation")
    model = transformers.PhiForCausalLM(config)
    sp, plain = hf_tp_plan(model, True), hf_tp_plan(model, False)
    assert sp is not None and plain is not None
    assert type(sp["model.final_layernorm"]) is SequenceParallelNorm
    assert type(sp["model.layers.*.input_layernorm"]) is SequenceParallelNorm
    assert type(plain["model.final_layernorm"]) is ReplicateParallel


def test_colwise_on_fused_experts_weights_keeps_the_halves_together() -> None:
    """Inkling's plans say ``colwise`` for ``gate_up_proj [experts, 2 * inter, hidden]``: read as packed."""
    plan = {
        "layers.*.mlp.experts.gate_up_proj": "colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
    }
    config = named_hf_config("mixtral_translation", base_model_tp_plan=plan)
    translated = hf_tp_plan(transformers.MixtralForCausalLM(config), False)
    assert translated is not None
    experts = translated["model.layers.*.mlp.experts"]
    assert experts.param_styles == {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}


def test_a_local_params_block_runs_whole_under_sequence_parallel_keeping_its_style() -> None:
    """Granite-SWA's attention is ``local_params`` (its sinks sharded by head): under SP it runs whole."""
    config = named_hf_config("granite_swa_translation")
    plan = hf_tp_plan(transformers.AutoModelForCausalLM.from_config(config), True)
    assert plan is not None
    assert "model.layers.*.self_attn" not in plan
    block = plan["model.layers.1.self_attn"]
    assert type(block) is SequenceParallelBlock and block.param_styles == {"sinks": "colwise"}
    assert plan["model.layers.*.self_attn.o_proj"].output_layouts == (Replicate(),)  # as without SP


class _AltUp(nn.Module):
    """Gemma3n's AltUp: its decoder calls ``predict`` and ``forward`` as methods, past the module's hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_an_unplanned_block_called_past_its_hooks_runs_through_dtensor(fake_pg: Callable) -> None:
    """Replicated weights: a method call on the Shard(1) stream runs through DTensor, the hooked one whole."""
    torch.manual_seed(0)
    ref, x = _AltUp(), torch.randn(2, 4, 8)
    with fake_pg(1):
        mesh = init_device_mesh("cpu", (1,))
        block = parallelize_module(copy.deepcopy(ref), mesh, SequenceParallelBlock(replicate_params=True))
        stream = DTensor.from_local(x, mesh, (Shard(1),))
        for got, want in ((block.predict(stream), ref.predict(x)), (block(stream), ref(x))):
            assert isinstance(got, DTensor) and got.placements == (Shard(1),)
            torch.testing.assert_close(got.full_tensor(), want)
        assert all(isinstance(p, DTensor) for p in block.parameters())


def test_layers_with_parameters_of_their_own_get_them_replicated_under_sequence_parallel() -> None:
    """Dory's residual rates ``lambda_1`` / ``lambda_2`` on the layer itself meet the Shard(1) stream."""
    model = tiny_hf_model("dory", **TP_TRANSLATION_HF_SIZES, num_key_value_heads=2, head_dim=16)
    plan = hf_tp_plan(model, True)
    assert plan is not None
    assert [type(plan.get(f"model.layers.{i}")) for i in (0, 1)] == [ReplicateOwnParams] * 2
    assert not any(key.endswith(("layers.0", "layers.1")) for key in hf_tp_plan(model, False) or {})


class _KeywordBlock(nn.Module):
    """A block called as Hugging Face's decoders call attention: ``hidden_states=`` by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden_states)


def test_a_whole_block_called_by_keyword_gathers_its_hidden_states_once(fake_pg: Callable) -> None:
    """One all-gather per forward, whether the hidden states come by position or by keyword."""
    from torch.distributed.tensor.debug import CommDebugMode

    with fake_pg(2):
        mesh = init_device_mesh("cpu", (2,))
        block = parallelize_module(_KeywordBlock(), mesh, SequenceParallelBlock(replicate_params=True))
        stream = DTensor.from_local(torch.randn(2, 4, 8), mesh, (Shard(1),))
        for call in (lambda: block(stream), lambda: block(hidden_states=stream)):
            with CommDebugMode() as comm:
                out = call()
            assert isinstance(out, DTensor) and out.placements == (Shard(1),)
            gathers = {k: v for k, v in comm.get_comm_counts().items() if "all_gather" in str(k)}
            assert sum(gathers.values()) == 1, comm.get_comm_counts()
