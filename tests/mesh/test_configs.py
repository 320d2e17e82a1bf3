"""Strategy configs: defaults, validation, strict from_dict, strategy names."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from plait.mesh import (
    DDPConfig,
    FSDP2Config,
    MegatronFSDPConfig,
    MoEConfig,
    ParallelismSizes,
    normalize_strategy_name,
    plan_meshes,
    strategy_config_from_dict,
    strategy_name,
)


def test_fsdp2_defaults_follow_spec():
    cfg = FSDP2Config()
    assert cfg.mp_policy == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        output_dtype=torch.bfloat16,
        cast_forward_inputs=True,
    )
    assert cfg.activation_checkpointing_scope == ("all",)
    assert cfg.frozen_multimodal_sharding == "root"
    assert (cfg.fsdp2_forward_prefetch_depth, cfg.fsdp2_backward_prefetch_depth) == (1, 2)
    assert cfg.reshard_after_forward is None and cfg.offload_policy is None and cfg.tp_plan is None


def test_configs_are_frozen():
    with pytest.raises(AttributeError):
        FSDP2Config().sequence_parallel = True  # type: ignore[misc]


def test_fsdp2_from_dict_parses_yaml_forms():
    cfg = FSDP2Config.from_dict(
        {
            "mp_policy": {
                "param_dtype": "bfloat16",
                "reduce_dtype": "torch.float32",
                "cast_forward_inputs": False,
            },
            "offload_policy": {"pin_memory": False},
            "activation_checkpointing_scope": ["language", "Vision"],
            "frozen_multimodal_sharding": "Per-Layer",
            "tp_plan": {"model.layers.*.mlp.up_proj": "colwise"},
            "sequence_parallel": True,
        }
    )
    assert cfg.mp_policy == MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, False)
    assert cfg.offload_policy == CPUOffloadPolicy(pin_memory=False)
    assert cfg.activation_checkpointing_scope == ("language", "vision")
    assert cfg.frozen_multimodal_sharding == "per_layer"
    assert cfg.tp_plan == {"model.layers.*.mlp.up_proj": "colwise"}
    assert FSDP2Config.from_dict({"mp_policy": None}).mp_policy is None


def test_from_dict_unknown_key_names_key_and_allowed():
    with pytest.raises(
        ValueError,
        match=r"unknown key 'FSDP2Config\.sequence_paralel' \(did you mean 'FSDP2Config\.sequence_parallel'\?\)",
    ):
        FSDP2Config.from_dict({"sequence_paralel": True})
    with pytest.raises(ValueError, match=r"unknown key 'DDPConfig\.tp_plan'"):
        DDPConfig.from_dict({"tp_plan": "llama"})


@pytest.mark.parametrize(
    ("cls", "data", "pattern"),
    [
        (FSDP2Config, {"sequence_parallel": "yes"}, r"FSDP2Config.sequence_parallel must be bool, got 'yes'"),
        (
            FSDP2Config,
            {"fsdp2_forward_prefetch_depth": 1.5},
            "fsdp2_forward_prefetch_depth must be int, got 1.5",
        ),
        (FSDP2Config, {"tp_plan": 3}, "tp_plan must be a dict"),
        (FSDP2Config, {"mp_policy": "bf16"}, "mp_policy must be a dict"),
        (DDPConfig, {"bucket_cap_mb": "25"}, "bucket_cap_mb must be float | None, got '25'"),
        (MegatronFSDPConfig, {"zero_dp_strategy": "3"}, "zero_dp_strategy must be int, got '3'"),
        (MoEConfig, {"wrap_outer_model": 1}, "wrap_outer_model must be bool, got 1"),
    ],
)
def test_from_dict_wrong_type_is_type_error(cls, data, pattern):
    with pytest.raises(TypeError, match=pattern):
        cls.from_dict(data)


def test_from_dict_needs_a_mapping():
    with pytest.raises(TypeError, match=r"FSDP2Config must be a mapping of keys to values, got \['a'\]"):
        FSDP2Config.from_dict(["a"])


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (
            lambda: FSDP2Config(fsdp2_backward_prefetch_depth=-1),
            "fsdp2_backward_prefetch_depth must be >= 0, got -1",
        ),
        (lambda: FSDP2Config(enable_async_tensor_parallel=True), "needs sequence_parallel=True"),
        (lambda: FSDP2Config(tp_plan=""), "tp_plan is an empty string"),
        (lambda: DDPConfig(bucket_cap_mb=0), "bucket_cap_mb must be > 0 or None, got 0"),
        (lambda: MegatronFSDPConfig(zero_dp_strategy=4), "zero_dp_strategy must be 0, 1, 2 or 3, got 4"),
        (
            lambda: MegatronFSDPConfig(sequence_parallel=True),
            "Megatron-FSDP does not support sequence parallel",
        ),
        (lambda: MegatronFSDPConfig(unit_modules=()), "unit_modules is empty"),
        (lambda: MoEConfig(lm_head_precision="float33"), "lm_head_precision 'float33' is not a torch dtype"),
        (lambda: FSDP2Config(mp_policy={"param_dtype": "bf16"}), "param_dtype 'bf16' is not a torch dtype"),
        (
            lambda: FSDP2Config(mp_policy={"param": "bfloat16"}),
            r"unknown key\(s\) \['param'\] in FSDP2Config.mp_policy",
        ),
        (lambda: FSDP2Config(offload_policy="gpu"), "offload_policy 'gpu' is not an offload policy"),
    ],
)
def test_config_values_validated_on_construction(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_megatron_and_moe_fields():
    cfg = MegatronFSDPConfig.from_dict(
        {"unit_modules": ["transformers.models.llama.modeling_llama.LlamaDecoderLayer"]}
    )
    assert cfg.unit_modules == ("transformers.models.llama.modeling_llama.LlamaDecoderLayer",)
    assert (cfg.zero_dp_strategy, cfg.overlap_grad_reduce, cfg.preserve_fp32_weights) == (3, True, False)
    moe = MoEConfig.from_dict({"lm_head_precision": "float32", "mp_policy": {"param_dtype": "bfloat16"}})
    assert moe.lm_head_precision is torch.float32
    assert moe.mp_policy.param_dtype is torch.bfloat16
    assert (MoEConfig().ignore_router_for_ac, MoEConfig().reshard_after_forward) == (True, None)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("fsdp2", "fsdp2"), ("FSDP2", "fsdp2"), ("DDP", "ddp"), ("megatron-fsdp", "megatron_fsdp"),
     ("MFSDP", "megatron_fsdp"), (" Megatron_FSDP ", "megatron_fsdp")],
)  # fmt: skip
def test_strategy_names_and_aliases(name, expected):
    assert normalize_strategy_name(name) == expected


def test_unknown_strategy_lists_names():
    with pytest.raises(ValueError, match=r"unknown strategy 'zero3'; allowed: fsdp2, ddp, megatron_fsdp"):
        strategy_config_from_dict({"name": "zero3"})
    with pytest.raises(TypeError, match="strategy name must be a string, got 3"):
        normalize_strategy_name(3)


def test_strategy_config_from_dict_both_forms():
    cfg = strategy_config_from_dict({"name": "FSDP2", "sequence_parallel": True})
    assert isinstance(cfg, FSDP2Config) and cfg.sequence_parallel
    ddp = strategy_config_from_dict("ddp", {"static_graph": True})
    assert isinstance(ddp, DDPConfig) and ddp.static_graph
    assert isinstance(strategy_config_from_dict("mfsdp"), MegatronFSDPConfig)
    assert strategy_name(ddp) == "ddp"
    with pytest.raises(ValueError, match="has no 'name' key"):
        strategy_config_from_dict({"sequence_parallel": True})
    with pytest.raises(ValueError, match=r"unknown key 'DDPConfig\.sequence_parallel'"):
        strategy_config_from_dict({"name": "ddp", "sequence_parallel": True})
    with pytest.raises(TypeError, match="unsupported strategy config 'fsdp2'"):
        strategy_name("fsdp2")


def test_reshard_after_forward_int_is_a_group_that_divides_the_shard_group() -> None:
    """hpZ: an int >= 2 dividing dp_shard x cp; 1, a non-divisor and expert parallel are refused by value."""

    assert FSDP2Config(reshard_after_forward=2).reshard_after_forward == 2
    plan_meshes(FSDP2Config(reshard_after_forward=2), ParallelismSizes(cp_size=2), world_size=4)
    with pytest.raises(ValueError, match=r"reshard_after_forward=1: .* must be >= 2; use False"):
        FSDP2Config(reshard_after_forward=1)
    with pytest.raises(
        ValueError, match=r"=3 must divide the FSDP shard group of 4 ranks .*use one of \[2, 4\]"
    ):
        plan_meshes(FSDP2Config(reshard_after_forward=3), ParallelismSizes(), world_size=4)
    with pytest.raises(ValueError, match=r"=2 with ep_size=2 is not supported"):
        plan_meshes(FSDP2Config(reshard_after_forward=2), ParallelismSizes(ep_size=2), world_size=4)
