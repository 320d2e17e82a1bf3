"""The float8 gate on torch's fake process group with meta tensors: what converts, what is refused, what the flow applies."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

from plait.float8 import plan_float8
from plait.mesh import Float8Config, FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder, MoEDecoder, MoEDecoderConfig
from plait.sidecar import get_parallel_plan, parallelize_model, plan_parallelism
from plait.testing import fake_process_group


def _meta(build: type = DenseDecoder, config: object = None) -> nn.Module:
    with torch.device("meta"):
        return build(config or DecoderConfig())


def _ctx(sizes: ParallelismSizes | None = None, **float8: object) -> MeshContext:
    return MeshContext.build(
        FSDP2Config(mp_policy=None, float8=Float8Config(**float8)), sizes or ParallelismSizes()
    )


def test_tp_plan_gets_float8_styles_and_dims_that_shard_below_16_stay_high_precision() -> None:
    with fake_process_group(4):
        plan = plan_parallelism(_meta(), _ctx(ParallelismSizes(tp_size=2)))
    float8 = plan.float8
    assert float8 is not None and (float8.scaling, float8.emulate, float8.fsdp_all_gather) == (
        "tensorwise",
        True,
        False,
    )
    skipped = dict(float8.skipped)
    assert skipped["lm_head"] == "the output head (kept in high precision)"
    assert skipped["model.layers.0.self_attn.k_proj"] == "32 x 8 features per TP rank are not multiples of 16"
    styles = plan.tp_plan
    assert type(styles["model.layers.*.self_attn.q_proj"]) is Float8ColwiseParallel
    assert type(styles["model.layers.*.mlp.down_proj"]) is Float8RowwiseParallel
    assert type(styles["model.layers.*.self_attn.k_proj"]) is ColwiseParallel  # skipped: torch's own style
    assert type(styles["lm_head"]) is ColwiseParallel
    assert plan.describe()["float8"]["converted"]["model.layers.*.mlp.up_proj"] == "2 modules"


def test_a_pattern_over_converted_and_skipped_modules_is_split_per_module() -> None:
    with fake_process_group(2):
        plan = plan_parallelism(
            _meta(), _ctx(ParallelismSizes(tp_size=2), skip=["model.layers.1.mlp.down_proj"])
        )
    styles = plan.tp_plan
    assert "model.layers.*.mlp.down_proj" not in styles
    assert type(styles["model.layers.0.mlp.down_proj"]) is Float8RowwiseParallel
    assert type(styles["model.layers.1.mlp.down_proj"]) is RowwiseParallel
    assert (
        dict(plan.float8.skipped)["model.layers.1.mlp.down_proj"]
        == "Float8Config.skip 'model.layers.1.mlp.down_proj'"
    )


def test_the_flow_converts_exactly_the_planned_linears_before_tp_and_fsdp() -> None:
    with fake_process_group(4):
        model = parallelize_model(_meta(), _ctx(ParallelismSizes(tp_size=2)))
    plan = get_parallel_plan(model)
    converted = [fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert converted == list(plan.float8.modules) and len(converted) == 10
    assert not isinstance(model.lm_head, Float8Linear)


@pytest.mark.parametrize(("scaling", "granularity"), [("tensorwise", "TENSORWISE"), ("rowwise", "AXISWISE")])
def test_the_converted_linears_run_the_planned_recipe(scaling: str, granularity: str) -> None:
    with fake_process_group(2):
        model = parallelize_model(_meta(), _ctx(scaling=scaling, fsdp_all_gather=scaling == "tensorwise"))
    configs = {type(m).__name__: m.config for m in model.modules() if isinstance(m, Float8Linear)}
    config = configs["Float8Linear"]
    assert config.cast_config_weight.scaling_granularity.name == granularity
    assert config.emulate and config.enable_fsdp_float8_all_gather == (scaling == "tensorwise")


def test_include_and_skip_patterns_and_the_empty_result() -> None:
    model = DenseDecoder(DecoderConfig())
    only_mlp = plan_float8(model, Float8Config(include=["*.mlp.*"], skip=["*.gate_proj"]), device_type="cpu")
    assert [m.rpartition(".")[2] for m in only_mlp.modules] == ["up_proj", "down_proj"] * 2
    with pytest.raises(
        ValueError, match=r"no linear of DenseDecoder can be converted .*not matched by Float8Config.include"
    ):
        plan_float8(model, Float8Config(include=["nothing"]), device_type="cpu")
    with pytest.raises(ValueError, match=r"emulate=False on a cpu mesh.*set emulate=True"):
        plan_float8(model, Float8Config(emulate=False), device_type="cpu")


def test_moe_experts_and_routers_are_never_converted() -> None:
    model = MoEDecoder(MoEDecoderConfig())
    skipped = dict(plan_float8(model, Float8Config(), device_type="cpu").skipped)
    assert any(reason == "an MoE router" for reason in skipped.values()), skipped
    assert not [
        fqn for fqn in plan_float8(model, Float8Config(), device_type="cpu").modules if ".experts" in fqn
    ]


@pytest.mark.parametrize(
    ("build", "sizes", "float8", "match"),
    [
        (
            "moe",
            ParallelismSizes(),
            {},
            r"float8 .* with an MoE model is not supported: float8 expert weights",
        ),
        ("moe", ParallelismSizes(ep_size=2), {}, r"ep_size=2 with float8"),
        (
            "dense",
            ParallelismSizes(tp_size=2),
            {"scaling": "rowwise"},
            r"tensorwise scale; set Float8Config.scaling",
        ),
    ],
)
def test_plan_parallelism_refuses_before_anything_changes(
    build: str, sizes: ParallelismSizes, float8: dict, match: str
) -> None:
    with fake_process_group(4):
        model = _meta(MoEDecoder, MoEDecoderConfig()) if build == "moe" else _meta()
        with pytest.raises(ValueError, match=match):
            parallelize_model(model, _ctx(sizes, **float8))
        assert not any(isinstance(m, Float8Linear) for m in model.modules())


_HIDDEN = """
import sys
sys.modules["torchao"] = None  # torchao is not installed
import torch
from plait.float8 import precompute_float8_scales
from plait.mesh import Float8Config, FSDP2Config, MeshContext
from plait.models import DenseDecoder
from plait.sidecar import plan_parallelism
from plait.testing import fake_process_group
precompute_float8_scales(torch.nn.Linear(2, 2))  # a no-op without torchao
with fake_process_group(2):
    ctx = MeshContext.build(FSDP2Config(float8=Float8Config()))
    try:
        plan_parallelism(DenseDecoder(), ctx)
    except ImportError as err:
        print(err)
"""


def test_without_torchao_asking_for_float8_is_one_line_naming_the_extra() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _HIDDEN], capture_output=True, text=True, timeout=120, check=True
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "FSDP2Config.float8 needs torchao" in lines[0], out.stdout + out.stderr
    assert "pip install 'plait-float8[torchao]'" in lines[0]
