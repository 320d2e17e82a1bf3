"""shard_megatron_fsdp: package loading, API check, config translation, unit modules, one-rank path.

Sharding itself runs inside the megatron-fsdp package on CUDA; these tests check everything plait does
around it on CPU, against the real package when it imports and against stand-ins of both API generations.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from plait.mesh import MegatronFSDPConfig, MeshContext, ParallelismSizes
from plait.models import MoEDecoder, MoEDecoderConfig, MoEDecoderLayer
from plait.strategies import check_megatron_fsdp, shard_megatron_fsdp
from plait.strategies._megatron_api import load_api, resolve_unit_modules, translate_config
from tests.strategies._megatron_stand_in import (
    COMMON,
    CURRENT,
    LEGACY,
    Policy,
    install_stand_in,
    stand_in,
)

_HAS_MEGATRON = importlib.util.find_spec("megatron_fsdp") is not None


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return install_stand_in(monkeypatch)


def _model() -> MoEDecoder:
    torch.manual_seed(0)
    return MoEDecoder(MoEDecoderConfig())


# -- package loading and the API check --------------------------------------------------------------


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch, fake_pg: Any) -> None:
    monkeypatch.setitem(sys.modules, "megatron_fsdp", None)
    with pytest.raises(ImportError, match=r"pip install 'plait-strategies\[megatron\]'"):
        load_api(with_optimizer=False)
    model = _model()
    with fake_pg(2):
        ctx = MeshContext.build(MegatronFSDPConfig(), ParallelismSizes())
        with pytest.raises(ImportError, match="optional megatron-fsdp package"):
            shard_megatron_fsdp(model, ctx)


@pytest.mark.parametrize(
    ("params", "with_optimizer", "missing"),
    [
        (["module", "device_mesh", "fsdp_unit_modules"], False, "dp_shard_dim"),
        (COMMON, False, "grad_reduce_in_fp32"),
        ([p for p in CURRENT if p != "nccl_ub"], True, "nccl_ub"),
    ],
)
def test_unsupported_api_names_the_version_needed(
    monkeypatch: pytest.MonkeyPatch, params: list[str], with_optimizer: bool, missing: str
) -> None:
    monkeypatch.setitem(sys.modules, "megatron_fsdp", stand_in("0.1.0", params, []))
    with pytest.raises(
        ImportError,
        match=rf"megatron-fsdp 0.1.0 is not supported: .*lacks parameters .*'{missing}'.*"
        r"needs megatron-fsdp>=0\.2",
    ):
        load_api(with_optimizer=with_optimizer)


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_both_api_generations_are_recognised(monkeypatch: pytest.MonkeyPatch, with_optimizer: bool) -> None:
    monkeypatch.setitem(sys.modules, "megatron_fsdp", stand_in("0.3.0", LEGACY, []))
    assert not load_api(with_optimizer=with_optimizer).policy_api
    monkeypatch.setitem(sys.modules, "megatron_fsdp", stand_in("0.6.1", CURRENT, []))
    assert load_api(with_optimizer=with_optimizer).policy_api


# -- config translation -----------------------------------------------------------------------------

_CONFIG = MegatronFSDPConfig(
    zero_dp_strategy=2,
    grad_reduce_in_fp32=True,
    preserve_fp32_weights=True,
    check_for_nan_in_grad=False,
    init_with_meta_device=True,
    overlap_param_gather=False,
    fsdp_double_buffer=True,
)


def test_translation_for_the_mixed_precision_policy_api(calls: list[dict[str, Any]]) -> None:
    kwargs = translate_config(_CONFIG, load_api(with_optimizer=False))
    assert kwargs["mixed_precision_policy"] == Policy(torch.float32, torch.float32, torch.float32)
    assert kwargs["report_nan_in_param_grad"] is False
    assert kwargs["zero_dp_strategy"] == 2 and kwargs["init_model_with_meta_device"] is True
    assert kwargs["overlap_param_gather"] is False and kwargs["fsdp_double_buffer"] is True
    defaults = translate_config(MegatronFSDPConfig(), load_api(with_optimizer=False))
    assert defaults["mixed_precision_policy"] == Policy(None, None, None)


def test_translation_for_the_flag_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron_fsdp", stand_in("0.3.0", LEGACY, []))
    kwargs = translate_config(_CONFIG, load_api(with_optimizer=False))
    assert "mixed_precision_policy" not in kwargs
    assert (
        kwargs["grad_reduce_in_fp32"],
        kwargs["preserve_fp32_weights"],
        kwargs["check_for_nan_in_grad"],
    ) == (
        True,
        True,
        False,
    )


@pytest.mark.skipif(
    not _HAS_MEGATRON, reason="megatron-fsdp is not installed (pip install 'plait-strategies[megatron]')"
)
@pytest.mark.parametrize("with_optimizer", [False, True])
def test_translation_binds_to_the_real_package(with_optimizer: bool) -> None:
    api = load_api(with_optimizer=with_optimizer)
    kwargs = translate_config(_CONFIG, api)
    extra = {"optimizer": None} if with_optimizer else {}
    inspect.signature(api.entry).bind(
        module=_model(),
        device_mesh=None,
        dp_shard_dim="dp",
        tp_dim="tp",
        fsdp_unit_modules=resolve_unit_modules(_model(), _CONFIG),
        device=torch.device("cpu"),
        **extra,
        **kwargs,
    )
    if api.policy_api:
        policy = kwargs["mixed_precision_policy"]
        assert isinstance(policy, api.package.MixedPrecisionPolicy)
        assert (policy.main_params_dtype, policy.main_grads_dtype) == (torch.float32, torch.float32)


# -- unit modules -----------------------------------------------------------------------------------


class _Block(nn.Linear):
    pass


class _Tower(nn.Module):
    _no_split_modules = ("_Block",)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(2, 2), _Block(2, 2)])


class _Outer(nn.Module):
    _no_split_modules = ("MissingLayer",)

    def __init__(self) -> None:
        super().__init__()
        self.tower = _Tower()


@pytest.mark.parametrize(
    "units",
    [
        ("plait.models.moe.MoEDecoderLayer",),
        ("plait.models.moe:MoEDecoderLayer",),
        (MoEDecoderLayer, "torch.nn.Conv2d"),
    ],
)
def test_unit_modules_from_config(units: tuple[Any, ...]) -> None:
    assert resolve_unit_modules(_model(), MegatronFSDPConfig(unit_modules=units)) == [MoEDecoderLayer]


def test_unit_modules_from_no_split_modules_by_class_name_including_nested() -> None:
    assert resolve_unit_modules(_model(), MegatronFSDPConfig()) == [MoEDecoderLayer]
    assert resolve_unit_modules(_Outer(), MegatronFSDPConfig()) == [_Block]


@pytest.mark.parametrize(
    ("model", "config", "message"),
    [
        (
            nn.Sequential(nn.Linear(2, 2)),
            MegatronFSDPConfig(),
            r"no Megatron-FSDP unit modules found in Sequential \(no _no_split",
        ),
        (
            _Outer(),
            MegatronFSDPConfig(unit_modules=("torch.nn.Conv2d",)),
            r"in _Outer \(MegatronFSDPConfig.unit_modules \['Conv2d'\]",
        ),
        (
            _model(),
            MegatronFSDPConfig(unit_modules=("plait.nowhere.Layer",)),
            r"entry 'plait.nowhere.Layer' is not an importable class",
        ),
        (
            _model(),
            MegatronFSDPConfig(unit_modules=("torch.float32",)),
            r"entry 'torch.float32' is not an importable class",
        ),
        (_model(), MegatronFSDPConfig(unit_modules=(int,)), r"entry <class 'int'> is not an nn.Module class"),
    ],
)
def test_unit_module_errors(model: nn.Module, config: MegatronFSDPConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_unit_modules(model, config)


def test_no_unit_modules_fails_before_touching_the_model(calls: list[dict[str, Any]], fake_pg: Any) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with fake_pg(2):
        ctx = MeshContext.build(MegatronFSDPConfig(), ParallelismSizes())
        with pytest.raises(ValueError, match=r"set MegatronFSDPConfig\.unit_modules"):
            shard_megatron_fsdp(model, ctx)
    assert not calls


# -- the flow around the package --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "shard_dim"), [(ParallelismSizes(), "dp"), (ParallelismSizes(cp_size=2), "dp_cp")]
)
def test_the_package_is_called_with_the_mesh_units_and_options(
    calls: list[dict[str, Any]], fake_pg: Any, sizes: ParallelismSizes, shard_dim: str
) -> None:
    model = _model()
    with fake_pg(4):
        ctx = MeshContext.build(MegatronFSDPConfig(zero_dp_strategy=2), sizes)
        check_megatron_fsdp(model, ctx)  # the plan's check: nothing called yet
        assert not calls
        out = shard_megatron_fsdp(model, ctx)
    assert out is model and len(calls) == 1
    call = calls[0]
    assert call["dp_shard_dim"] == shard_dim and call["tp_dim"] == "tp"
    assert call["device_mesh"] is ctx.device_mesh and call["device"] == torch.device("cpu")
    assert call["fsdp_unit_modules"] == [MoEDecoderLayer] and call["zero_dp_strategy"] == 2


def test_optimizer_is_sharded_too(calls: list[dict[str, Any]], fake_pg: Any) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with fake_pg(2):
        ctx = MeshContext.build(MegatronFSDPConfig(), ParallelismSizes())
        out = shard_megatron_fsdp(model, ctx, optimizer=optimizer)
    assert out == (model, optimizer) and calls[0]["optimizer"] is optimizer


def test_wrong_config_type() -> None:
    with pytest.raises(TypeError, match="needs a MegatronFSDPConfig, got DDPConfig"):
        from plait.mesh import DDPConfig

        shard_megatron_fsdp(nn.Linear(2, 2), MeshContext(device_mesh=None, strategy_config=DDPConfig()))


@pytest.mark.skipif(
    not (_HAS_MEGATRON and torch.cuda.device_count() >= 2),
    reason="the Megatron-FSDP run itself needs megatron-fsdp and >= 2 CUDA GPUs (NCCL); this machine has "
    f"{torch.cuda.device_count()} GPU(s), megatron-fsdp {'installed' if _HAS_MEGATRON else 'not installed'}",
)
def test_megatron_fsdp_trains_like_the_reference_on_gpus() -> None:
    torch.multiprocessing.spawn(_gpu_parity, nprocs=2, join=True)


def _gpu_parity(rank: int) -> None:
    import os

    import torch.distributed as dist

    from tests.strategies._parity import global_batch, lm_loss, local_rows, mean_over_ranks

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    try:
        cfg = MoEDecoderConfig()
        torch.manual_seed(0)
        ref = MoEDecoder(cfg).cuda()
        par = MoEDecoder(cfg).cuda()
        par.load_state_dict(ref.state_dict())
        ctx = MeshContext.build(MegatronFSDPConfig(), ParallelismSizes(), device_type="cuda")
        par, opt = shard_megatron_fsdp(par, ctx, optimizer=torch.optim.SGD(par.parameters(), lr=0.5))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        batch = global_batch(cfg.vocab_size, 2).cuda()
        for _ in range(2):
            ref_loss, par_loss = lm_loss(ref, batch), lm_loss(par, local_rows(batch))
            ref_loss.backward()
            par_loss.backward()
            assert abs(mean_over_ranks(par_loss) - ref_loss.item()) <= 1e-4
            for o in (ref_opt, opt):
                o.step()
                o.zero_grad()
    finally:
        dist.destroy_process_group()


def test_mesh_without_dp_axis_is_rejected(calls: list[dict[str, Any]], fake_pg: Any) -> None:
    with fake_pg(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        with pytest.raises(
            ValueError, match=r"dims from \('dp', 'cp', 'tp'\) including 'dp', got \['dp_shard', 'tp'\]"
        ):
            shard_megatron_fsdp(_model(), MeshContext(device_mesh=mesh, strategy_config=MegatronFSDPConfig()))
    assert not calls
