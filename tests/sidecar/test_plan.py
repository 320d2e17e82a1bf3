"""`plan_parallelism`: one plan, made before anything changes, that the flow applies exactly.

Layouts run on torch's fake process group with meta tensors (no ranks, no memory): the FSDP units
the flow creates, with their reshard-after-forward values, are the plan's; every refusal of the
combination table is raised by the plan with the table's line; a sidecar may adjust the plan.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule

from plait.mesh import (
    FSDP2Config,
    MeshContext,
    MoEConfig,
    ParallelismSizes,
    clean_fqn,
    context_request,
    refusal_of,
)
from plait.models import DecoderConfig, DenseDecoder, MoEDecoder, MoEDecoderConfig
from plait.sidecar import (
    ModelParallelizer,
    ParallelPlan,
    get_parallel_plan,
    parallelize_model,
    plan_parallelism,
)
from plait.testing import fake_process_group


def _dense(**overrides: Any) -> nn.Module:
    with torch.device("meta"):
        return DenseDecoder(DecoderConfig(num_hidden_layers=3, **overrides))


def _moe() -> nn.Module:
    with torch.device("meta"):
        return MoEDecoder(MoEDecoderConfig(num_hidden_layers=3))


def _created_units(model: nn.Module) -> dict[str, bool]:
    """Each FSDP unit of ``model`` (modules joined by +) and whether it reshards after forward."""
    units: dict[int, list[str]] = {}
    states: dict[int, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()  # torch keeps the unit's settings private
            units.setdefault(id(state), []).append(clean_fqn(name) or "<root>")
            states[id(state)] = state
    groups = {key: state._fsdp_param_group for key, state in states.items()}  # None: no own parameters
    return {
        "+".join(sorted(names)): groups[key] is not None and groups[key].post_forward_mesh_info is not None
        for key, names in units.items()
    }


LAYOUTS: dict[str, tuple[Callable[[], nn.Module], Callable[[], MeshContext]]] = {
    "fsdp": (_dense, lambda: MeshContext.build(FSDP2Config(mp_policy=None), activation_checkpointing="full")),
    "hsdp+tp+sp": (
        _dense,
        lambda: MeshContext.build(
            FSDP2Config(sequence_parallel=True), ParallelismSizes(dp_replicate_size=2, tp_size=2)
        ),
    ),
    "explicit reshard": (_dense, lambda: MeshContext.build(FSDP2Config(reshard_after_forward=False))),
    "untied, large tables": (
        lambda: _dense(vocab_size=4096),
        lambda: MeshContext.build(FSDP2Config(), activation_checkpointing="selective"),
    ),
    "moe ep, head in bf16, no root unit": (
        _moe,
        lambda: MeshContext.build(
            FSDP2Config(),
            ParallelismSizes(ep_size=4),
            moe_config=MoEConfig(lm_head_precision=torch.bfloat16, wrap_outer_model=True),
            activation_checkpointing="full",
        ),
    ),
    "moe ep x tp, routing saved": (
        _moe,
        lambda: MeshContext.build(
            FSDP2Config(), ParallelismSizes(ep_size=2, tp_size=2), activation_checkpointing="selective"
        ),
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_flow_creates_exactly_the_planned_units(layout: str) -> None:
    build_model, build_ctx = LAYOUTS[layout]
    with fake_process_group(8):
        model, ctx = build_model(), build_ctx()
        planned = plan_parallelism(model, ctx)
        result = parallelize_model(model, ctx)
        applied = get_parallel_plan(result)
        created = _created_units(result)
    assert applied is not None and applied.describe() == planned.describe()
    expected = {
        "+".join(sorted(u.name.split("+"))): bool(u.reshard_after_forward) for u in planned.fsdp_units
    }
    assert created == expected
    assert planned.fsdp_units[-1].name == "<root>"
    assert [u.name for u in planned.fsdp_units if u.role == "experts"] == [
        f"model.layers.{i}.mlp.experts" for i in range(3) if planned.ep
    ]


def test_plan_names_the_tp_plan_source_and_every_decision() -> None:
    with fake_process_group(8):
        model = _moe()
        ctx = MeshContext.build(
            FSDP2Config(), ParallelismSizes(ep_size=2, tp_size=2), activation_checkpointing=True
        )
        plan = plan_parallelism(model, ctx)
    described = plan.describe()
    assert described["tp_plan_source"] == "default Llama-style plan"
    assert described["sizes"] == {"dp_shard": 4, "tp": 2, "ep_shard": 4, "ep": 2}  # ep_shard = dp*tp/ep
    assert described["activation_checkpointing"] == "full"
    assert described["ac_save_inside"] == [f"model.layers.{i}.mlp.router" for i in range(3)]
    assert not any("experts" in pattern or "router" in pattern for pattern in plan.tp_plan)
    assert "tp_plan_source: default Llama-style plan" in plan.text()


@pytest.mark.parametrize(
    ("sizes", "config", "ac", "model"),
    [
        (ParallelismSizes(tp_size=2, ep_size=2), FSDP2Config(sequence_parallel=True), False, _moe),
        (ParallelismSizes(tp_size=2), FSDP2Config(), False, _dense),  # built: no refusal
    ],
)
def test_the_plan_refuses_with_the_combination_tables_line(
    sizes: ParallelismSizes, config: FSDP2Config, ac: bool, model: Callable[[], nn.Module]
) -> None:
    with fake_process_group(8):
        ctx = MeshContext.build(config, sizes, activation_checkpointing=ac)
        built = model()
        features = ["moe"] if isinstance(built, MoEDecoder) else []
        line = refusal_of(context_request(ctx, features=features))
        if line is None:
            assert plan_parallelism(built, ctx).tp
            return
        with pytest.raises(ValueError) as info:
            plan_parallelism(built, ctx)
    assert str(info.value) == line and "\n" not in line


class _NoCheckpointing(ModelParallelizer):
    def _adjust_plan(self, model: nn.Module, mesh_context: MeshContext, plan: ParallelPlan) -> ParallelPlan:
        return dataclasses.replace(plan, ac_mode=None)


class _Adjusted(DenseDecoder):
    parallelizer = _NoCheckpointing()


def test_a_sidecar_adjusts_the_plan_before_it_is_applied() -> None:
    with fake_process_group(4):
        with torch.device("meta"):
            model = _Adjusted(DecoderConfig())
        result = parallelize_model(model, MeshContext.build(FSDP2Config(), activation_checkpointing="full"))
    assert get_parallel_plan(result).ac_mode is None
    assert not any(isinstance(m, CheckpointWrapper) for m in result.modules())


def test_apply_is_gated_calls_of_at_most_40_lines() -> None:
    source = textwrap.dedent(inspect.getsource(ModelParallelizer._apply))
    function = ast.parse(source).body[0]
    assert function.end_lineno - function.lineno + 1 <= 40
    tests = [node.test for node in ast.walk(function) if isinstance(node, ast.If)]
    gates = [ast.unparse(test) for test in tests]
    assert all(gate.startswith(("plan.", "mesh_context.reapply")) for gate in gates), gates
