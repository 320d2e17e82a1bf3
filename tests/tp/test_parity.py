"""TP (and TP + sequence parallel, loss parallel) matches an unsharded reference on real gloo ranks.

Each rank builds the same seeded model, keeps an unsharded copy, parallelizes the other through
``validate_tp_mesh`` / ``resolve_tp_plan`` / ``apply_tp`` and plait.testing's driver trains both on
the same batches (TP ranks share data). The parallel loss runs under ``loss_parallel()`` on
vocab-sharded DTensor logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers  # noqa: F401  (imported here so the rank workers preload it)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from plait.models import DecoderConfig, DenseDecoder
from plait.testing import (
    Parity,
    assert_parity,
    logits_of,
    paired,
    run_on_ranks,
    run_parity,
    token_batches,
    tp_hf_config,
)
from plait.tp import apply_tp, resolve_tp_plan, validate_tp_mesh
from tests.tp._models import UnregisteredLlama, hf_model

Case = tuple[str, bool, dict[str, Any]]  # (model kind, sequence_parallel, builder kwargs)
HEADS = {"num_attention_heads": 8, "num_key_value_heads": 4}


def _build(kind: str, kwargs: dict[str, Any]) -> nn.Module:
    if kind == "dense":
        return DenseDecoder(DecoderConfig(hidden_size=64, intermediate_size=128, **HEADS, **kwargs))
    if kind == "hf-llama-unregistered":
        return UnregisteredLlama(tp_hf_config("llama", **HEADS, **kwargs))
    return hf_model(kind, **HEADS, **kwargs)


def _inspect(reference: nn.Module, model: nn.Module) -> dict[str, Any]:
    logits = logits_of(model(input_ids=torch.zeros(1, 8, dtype=torch.long)))
    heads = {
        (m.num_heads, m.num_key_value_heads) for m in model.modules() if hasattr(m, "num_key_value_heads")
    }
    return {
        "sharded_logits": isinstance(logits, DTensor),  # the loss-parallel head keeps logits vocab-sharded
        "tied_kept": (model.get_output_embeddings().weight is model.get_input_embeddings().weight)
        == reference.config.tie_word_embeddings,
        "local_heads": sorted(heads),
    }


def _tp_parity(mesh: DeviceMesh, kind: str, sp: bool, kwargs: dict[str, Any]) -> Parity:
    def parallelize(model: nn.Module) -> nn.Module:
        validate_tp_mesh(model, mesh)
        hf = "hf" if "unregistered" in kind else None
        plan = resolve_tp_plan(model, sequence_parallel=sp, tp_size=mesh.size(), plan=hf)
        assert apply_tp(model, mesh, plan) is model
        return model

    pair = paired(lambda: _build(kind, kwargs), parallelize)()
    batches = token_batches(pair[0].config.vocab_size, 1)
    return run_parity(lambda: pair, batches, dp_rank=0, case=f"{kind} sp={sp} {kwargs}", inspect=_inspect)


def _parity_cases(cases: list[Case]) -> list[Parity]:
    """Runs on every rank: the driver on each case over a ``tp`` mesh of the whole world."""
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    return [_tp_parity(mesh, *case) for case in cases]


def _check(results: list[list[Parity]], world: int) -> None:
    assert_parity(results)
    assert [p.case for p in results[0]] == [p.case for p in results[-1]] and results[0]
    for rank_results in results:
        for p in rank_results:
            losses = p.reference_losses
            assert abs(losses[-1] - losses[0]) > 1e-3, (p.case, "training must change the loss", losses)
            assert p.extra["sharded_logits"] and p.extra["tied_kept"], (p.case, p.extra)
            if p.case.startswith("dense"):
                assert p.extra["local_heads"] == [(8 // world, 4 // world)], (p.case, p.extra)


DENSE: list[Case] = [
    ("dense", False, {"vocab_size": 96}),
    ("dense", True, {"vocab_size": 96}),
    ("dense", True, {"vocab_size": 101, "tie_word_embeddings": True}),  # vocab % tp != 0, tied head
]
HF: list[Case] = [
    ("llama", False, {"tie": True}),
    ("llama", True, {}),
    ("qwen3", False, {}),
    ("qwen3", True, {}),
]


@pytest.mark.parametrize("world", [2, 4])
def test_dense_and_hf_llama_qwen3_tp_match_reference(world: int) -> None:
    """One multi-rank body per world size (workers reused); world 2 adds the HF-translated plan.

    World 4 runs the HF models once each (Llama with SP, Qwen3 without; both ways at world 2, and
    the other HF families at tp 4 in test_hf_families.py).
    """
    hf = [*HF, ("hf-llama-unregistered", True, {})] if world == 2 else [HF[1], HF[2]]
    cases = DENSE + hf
    _check(run_on_ranks(_parity_cases, world, cases, timeout=400), world)
