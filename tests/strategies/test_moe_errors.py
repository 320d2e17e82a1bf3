"""The expert-parallel checks refuse bad setups before touching the model, naming the value and the fix.

``check_expert_parallel`` and ``validate_moe_tp_plan`` are what the plan calls; combinations expert
parallel does not build with (sequence parallel, async TP, DDP) are refused by the combination table.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from plait.mesh import (
    FSDP2Config,
    MeshContext,
    MoEConfig,
    ParallelismSizes,
    check_combination,
    context_request,
)
from plait.models import GroupedExperts, MoEDecoder, MoEDecoderConfig
from plait.strategies import (
    ExpertParallel,
    apply_expert_parallel,
    check_expert_parallel,
    validate_moe_tp_plan,
)


def _untouched(model: nn.Module) -> bool:
    return not any(isinstance(p, DTensor) for p in model.parameters())


def _moe(
    fake_pg: Any,
    world: int,
    model: nn.Module,
    config: FSDP2Config,
    moe: MoEConfig | None = None,
    **sizes: int,
) -> None:
    with fake_pg(world):
        ctx = MeshContext.build(config, ParallelismSizes(**sizes), moe_config=moe)
        check_combination(context_request(ctx, features=["moe"]))
        blocks = check_expert_parallel(model, ctx)
        if config.tp_plan is not None:
            validate_moe_tp_plan(model, config.tp_plan, blocks)
        apply_expert_parallel(blocks, ctx.ep_mesh())


def test_experts_not_divisible_by_ep(fake_pg: Any) -> None:
    model = MoEDecoder(MoEDecoderConfig(num_experts=6))
    with pytest.raises(
        ValueError, match=r"num_experts \(6\) of 'model.layers.0.mlp.experts' .* ep_size \(4\)"
    ):
        _moe(fake_pg, 8, model, FSDP2Config(mp_policy=None), ep_size=4)
    assert _untouched(model)


def test_expert_parallel_style_checks_divisibility(fake_pg: Any) -> None:
    experts = GroupedExperts(6, 8, 4)
    with fake_pg(4), pytest.raises(ValueError, match=r"num_experts \(6\) of GroupedExperts .* ep_size \(4\)"):
        parallelize_module(experts, init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)), ExpertParallel())
    assert _untouched(experts)


@pytest.mark.parametrize(
    ("root", "moe", "message"),
    [
        ((2, 3), (3, 2), r"ep_size 2 must divide dp\*cp\*tp = 3\*1\*1 = 3"),
        (
            (2, 4),
            (4, 2),
            r"moe_mesh \(ep_shard=4, ep=2\) spans 8 ranks but dp\*cp\*tp = 4\*1\*1 = 4; ep_shard must be 2",
        ),
    ],
)
def test_ep_must_tile_dp_cp_tp(
    fake_pg: Any, root: tuple[int, int], moe: tuple[int, int], message: str
) -> None:
    model = MoEDecoder(MoEDecoderConfig())
    with fake_pg(root[0] * root[1]):
        device_mesh = init_device_mesh("cpu", root, mesh_dim_names=("pp", "dp_shard"))
        moe_mesh = init_device_mesh("cpu", moe, mesh_dim_names=("ep_shard", "ep"))
        ctx = MeshContext.from_meshes(device_mesh, moe_mesh, strategy_config=FSDP2Config(mp_policy=None))
        with pytest.raises(ValueError, match=message):
            check_expert_parallel(model, ctx)
    assert _untouched(model)


@pytest.mark.parametrize(
    ("pattern", "hit"),
    [
        ("model.layers.*.mlp.experts", "model.layers.0.mlp.experts"),
        ("model.layers.*.mlp.router.gate", "model.layers.0.mlp.router"),
        ("model.layers.1.mlp.*", "model.layers.1.mlp.router"),
    ],
)
def test_tp_plan_may_not_touch_experts_routers_or_gates(fake_pg: Any, pattern: str, hit: str) -> None:
    model = MoEDecoder(MoEDecoderConfig())
    plan = {"model.layers.*.self_attn.q_proj": "colwise", pattern: "colwise"}
    with pytest.raises(ValueError, match=rf"tp_plan pattern '{pattern}' .*inside MoE experts/router '{hit}'"):
        _moe(fake_pg, 4, model, FSDP2Config(mp_policy=None, tp_plan=plan), tp_size=2, ep_size=2)
    assert _untouched(model)


def test_model_default_plan_drops_expert_and_router_entries_but_refuses_mixed_patterns(fake_pg: Any) -> None:
    model = MoEDecoder(MoEDecoderConfig())
    attention = {"model.layers.*.self_attn.q_proj": "colwise"}
    default = attention | {"model.layers.*.mlp.experts": "colwise", "model.layers.*.mlp.router": "replicate"}
    with fake_pg(4):
        ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(tp_size=2, ep_size=2))
        blocks = check_expert_parallel(model, ctx)
        assert validate_moe_tp_plan(model, default, blocks, model_default=True) == attention
        with pytest.raises(ValueError, match=r"'model.layers.1.\*' .*router .* pass a tp_plan without it"):
            validate_moe_tp_plan(model, {"model.layers.1.*": "colwise"}, blocks, model_default=True)
        assert (
            validate_moe_tp_plan(model, default, [], model_default=True) == default
        )  # ep 1: TP shards experts


def test_async_tp_is_rejected(fake_pg: Any) -> None:
    model = MoEDecoder(MoEDecoderConfig())
    options = {"sequence_parallel": True, "enable_async_tensor_parallel": True}
    with pytest.raises(ValueError, match="enable_async_tensor_parallel=True is not supported: no parity run"):
        _moe(fake_pg, 4, model, FSDP2Config(mp_policy=None, **options), tp_size=2, ep_size=2)
    assert _untouched(model)


class _PerExpertMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)])
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])


def test_per_expert_module_list_is_rejected(fake_pg: Any) -> None:
    with pytest.raises(
        ValueError, match=r"'experts' is a per-expert ModuleList; expert parallel needs one experts module"
    ):
        _moe(fake_pg, 4, _PerExpertMoE(), FSDP2Config(mp_policy=None), ep_size=2)


def test_dense_model_is_rejected(fake_pg: Any) -> None:
    dense = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="Sequential has no MoE block"):
        _moe(fake_pg, 4, dense, FSDP2Config(mp_policy=None), ep_size=2)


def test_experts_without_common_expert_dim_are_rejected(fake_pg: Any) -> None:
    model = MoEDecoder(MoEDecoderConfig())
    model.model.layers[0].mlp.experts.w2 = nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"GroupedExperts does not follow the experts contract .*'w2': 3"):
        _moe(fake_pg, 4, model, FSDP2Config(mp_policy=None), ep_size=2)


def test_unwrapped_outer_model_with_own_parameters_is_rejected(fake_pg: Any) -> None:
    model = MoEDecoder(MoEDecoderConfig())
    model.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match="wrap_outer_model=False, but MoEDecoder owns parameters directly"):
        _moe(fake_pg, 4, model, FSDP2Config(mp_policy=None), MoEConfig(wrap_outer_model=False), ep_size=2)
    assert _untouched(model)


def test_lm_head_precision_on_a_tied_head_is_rejected(fake_pg: Any) -> None:
    model = MoEDecoder(MoEDecoderConfig(tie_word_embeddings=True))
    with pytest.raises(ValueError, match=r"lm_head_precision=torch\.float32 needs an untied output head"):
        _moe(
            fake_pg, 4, model, FSDP2Config(mp_policy=None), MoEConfig(lm_head_precision="float32"), ep_size=2
        )
    assert _untouched(model)


def test_resharding_experts_under_selective_checkpointing_is_rejected(fake_pg: Any) -> None:
    model = MoEDecoder(MoEDecoderConfig())
    with fake_pg(4):
        ctx = MeshContext.build(
            FSDP2Config(mp_policy=None),
            ParallelismSizes(ep_size=2),
            moe_config=MoEConfig(reshard_after_forward=True),
            activation_checkpointing="selective",
        )
        with pytest.raises(ValueError, match=r"MoEConfig.reshard_after_forward=True .*selective"):
            check_expert_parallel(model, ctx)
    assert _untouched(model)


def test_ep_on_ddp_is_rejected(fake_pg: Any) -> None:
    from plait.mesh import DDPConfig

    model = MoEDecoder(MoEDecoderConfig())
    with fake_pg(4):
        ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(ep_size=2))
        ddp = MeshContext(device_mesh=None, moe_mesh=ctx.moe_mesh, strategy_config=DDPConfig())
        with pytest.raises(ValueError, match=r"DDP does not support ep_size=2"):
            check_combination(context_request(ddp, features=["moe"]))
    assert _untouched(model)
