"""`parallelize_model` end to end on 4 gloo ranks: FSDP, HSDP, FSDP+TP (+SP, +AC) match the reference.

Models: the plait reference decoder and Hugging Face Llama / Qwen3 built from tiny configs.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder
from plait.testing import run_on_ranks, tiny_hf_model
from tests.sidecar._parity import Parity, assert_parity, run_parity

VOCAB = 160  # the untied tables (2 x 5,120) outweigh a layer (9,216): they get their own FSDP units

CASES: dict[str, tuple[ParallelismSizes, dict[str, Any], str | bool]] = {
    "fsdp": (ParallelismSizes(), {}, False),
    "hsdp": (ParallelismSizes(dp_replicate_size=2), {}, False),
    "fsdp_tp": (ParallelismSizes(tp_size=2), {}, False),
    "fsdp_tp_sp": (ParallelismSizes(tp_size=2), {"sequence_parallel": True}, False),
    "fsdp_tp_ac": (ParallelismSizes(tp_size=2), {}, "full"),
}


def build_model(kind: str) -> nn.Module:
    """A tiny decoder: ``dense`` (plait reference: hidden 32, 2 layers of 9,216), HF ``llama`` or ``qwen3`` (tied)."""
    if kind == "dense":
        return DenseDecoder(DecoderConfig(vocab_size=VOCAB))
    tied = {"tie_word_embeddings": True} if kind == "qwen3" else {}
    return tiny_hf_model(kind, seed=None, vocab_size=VOCAB, **tied)


def structure(model: nn.Module) -> dict[str, Any]:
    """What the parallelization did: FSDP units, DTensor parameters and their meshes, AC wrappers."""
    params = list(model.parameters())
    meshes = {tuple(p.device_mesh.mesh_dim_names or ()) for p in params if isinstance(p, DTensor)}
    return {
        # one unit per fully_shard call: [lm_head, model.norm] share one state
        "fsdp_units": len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)}),
        "root_is_fsdp": isinstance(model, FSDPModule),
        "dtensor_params": sum(isinstance(p, DTensor) for p in params),
        "params": len(params),
        "meshes": meshes,
        "checkpointed": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
    }


KIND_CASES = {
    "dense": list(CASES),
    # the HF models on the layouts where their modules meet something the reference decoder's do not
    # (the translated TP plan under SP, AC wrappers, HSDP's replicas, Qwen3's tied head under FSDP); TP
    # alone on both runs in tests/tp/test_parity.py, every layout on 116 families in tools/hf_sweep
    "llama": ["hsdp", "fsdp_tp_sp", "fsdp_tp_ac"],
    "qwen3": ["fsdp", "fsdp_tp_sp"],
}
"""The cases of :data:`CASES` each model kind runs."""


def _dense_cases(kind: str) -> list[Parity]:
    results = []
    for name in KIND_CASES[kind]:
        sizes, options, ac = CASES[name]
        ctx = MeshContext.build(FSDP2Config(mp_policy=None, **options), sizes, activation_checkpointing=ac)
        results.append(
            run_parity(
                f"{kind}/{name}", lambda: build_model(kind), ctx, VOCAB, inspect=structure, clip_norm=True
            )
        )
    return results


@pytest.mark.parametrize("kind", ["dense", "llama", "qwen3"])
def test_parallelize_model_matches_unsharded_reference(kind: str) -> None:
    results = run_on_ranks(_dense_cases, 4, kind)
    assert_parity(results)
    for rank_results in results:
        by_case = {p.case.split("/")[1]: p.extra for p in rank_results}
        for case, s in by_case.items():
            # root + 2 layers, + the input table and the head when untied (Qwen3 ties them)
            assert s["root_is_fsdp"] and s["fsdp_units"] == (3 if kind == "qwen3" else 5), (case, s)
            # torch's plain clip_grad_norm_ works: every parameter lives on one mesh
            assert s["grad_norm_diff"] <= 1e-5, (case, s)
            assert s["dtensor_params"] == s["params"], (case, s)
            assert s["checkpointed"] == (8 if case == "fsdp_tp_ac" else 0), (case, s)
        assert sorted(by_case) == sorted(KIND_CASES[kind])
        meshes = {"fsdp": {("dp_shard",)}, "hsdp": {("dp_replicate", "dp_shard")}}
        for case, s in by_case.items():
            assert s["meshes"] == meshes.get(case, {("dp_shard", "tp")}), (case, s)


def _post_forward_group_sizes(model: nn.Module) -> list[tuple[str, int]]:
    """The group each FSDP unit keeps its parameters sharded over between forward and backward (0: gathered)."""
    sizes = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            info = group.post_forward_mesh_info if group is not None else None
            sizes.append((name, info.shard_mesh_size if info is not None else 0))
    return sizes


def _hpz(kind: str) -> Parity:
    ctx = MeshContext.build(FSDP2Config(mp_policy=None, reshard_after_forward=2), ParallelismSizes())
    return run_parity(
        f"{kind}/hpz",
        lambda: build_model(kind),
        ctx,
        VOCAB,
        inspect=lambda m: {"groups": _post_forward_group_sizes(m)},
    )


def _hpz_cases(kind: str) -> list[Parity]:
    return [_hpz(kind)]


@pytest.mark.parametrize("kind", ["dense", "llama"])
def test_reshard_after_forward_to_a_group_of_two(kind: str) -> None:
    """dp_shard 4, reshard_after_forward=2 (hpZ): every layer unit re-shards to pairs, the input table
    fully (needed last in backward), the root and the head stay gathered."""
    results = run_on_ranks(_hpz_cases, 4, kind)
    assert_parity(results)
    for (parity,) in results:
        groups = dict(parity.extra["groups"])
        assert [size for name, size in groups.items() if ".layers." in name] == [2, 2], groups
        assert groups[""] == 0 and groups["model.embed_tokens"] == 4, groups
