"""TP (and TP + sequence parallel, loss parallel) matches an unsharded reference on real gloo ranks.

Each rank builds the same seeded model, keeps an unsharded copy, parallelizes the other through
``validate_tp_mesh`` / ``resolve_tp_plan`` / ``apply_tp`` and trains both on the same batch (TP ranks
share data). The parallel loss runs under ``loss_parallel()`` on vocab-sharded DTensor logits.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers  # noqa: F401  (imported here so the rank workers preload it)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from plait.models import DecoderConfig, DenseDecoder
from plait.testing import run_on_ranks
from plait.testing.models import lm_loss, make_batch
from plait.testing.parity import max_grad_diff, max_param_diff
from plait.tp import apply_tp, resolve_tp_plan, validate_tp_mesh
from tests.tp._models import UnregisteredLlama, hf_config, hf_model

Case = tuple[str, bool, dict[str, Any]]  # (model kind, sequence_parallel, builder kwargs)


def _build(kind: str, kwargs: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    if kind == "dense":
        config = DecoderConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, **kwargs
        )
        return DenseDecoder(config)
    if kind == "hf-llama-unregistered":
        return UnregisteredLlama(hf_config("llama", num_attention_heads=8, num_key_value_heads=4, **kwargs))
    return hf_model(kind, num_attention_heads=8, num_key_value_heads=4, **kwargs)


def _logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=input_ids) if hasattr(model, "generation_config") else model(input_ids)
    return out.logits if hasattr(out, "logits") else out


def _step_losses(kind: str, sp: bool, kwargs: dict[str, Any], steps: int, make_opt: Any) -> tuple[Any, ...]:
    """Train reference and TP copies ``steps`` steps; return per-step losses and the two models."""
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = _build(kind, kwargs)
    par = copy.deepcopy(ref)
    validate_tp_mesh(par, mesh)
    plan = resolve_tp_plan(
        par, sequence_parallel=sp, tp_size=world, plan="hf" if "unregistered" in kind else None
    )
    assert apply_tp(par, mesh, plan) is par
    ref_opt, par_opt = make_opt(ref), make_opt(par)
    vocab = ref.config.vocab_size
    ref_losses, par_losses, first = [], [], None
    for step in range(steps):
        ids, labels = make_batch(vocab, batch=2, seq=8, seed=step)
        ref_loss = lm_loss(_logits(ref, ids), labels)
        ref_loss.backward()
        logits = _logits(par, ids)
        assert isinstance(logits, DTensor), "the loss-parallel head keeps logits vocab-sharded"
        with loss_parallel():
            par_loss = lm_loss(logits, labels)
            par_loss.backward()
        if first is None:
            first = max_grad_diff(ref, par)
        ref_losses.append(ref_loss.item())
        par_losses.append(par_loss.full_tensor().item() if isinstance(par_loss, DTensor) else par_loss.item())
        ref_opt.step()
        par_opt.step()
        ref_opt.zero_grad()
        par_opt.zero_grad()
    return ref_losses, par_losses, first, ref, par


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, foreach=True)  # foreach: every parameter is a DTensor


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def _parity_cases(cases: list[Case]) -> dict[str, dict[str, Any]]:
    """Runs on every rank: for each case, loss + gradients at step 1, params after 2 SGD steps, 3 AdamW losses."""
    results: dict[str, dict[str, Any]] = {}
    for kind, sp, kwargs in cases:
        ref_losses, par_losses, (grad_diff, worst_grad), ref, par = _step_losses(kind, sp, kwargs, 2, _sgd)
        param_diff, worst_param = max_param_diff(ref, par)
        tied = par.get_output_embeddings().weight is par.get_input_embeddings().weight
        adam_ref, adam_par, *_ = _step_losses(kind, sp, kwargs, 3, _adamw)
        results[f"{kind} sp={sp} {kwargs}"] = {
            "loss_diff": abs(ref_losses[0] - par_losses[0]),
            "grad_diff": grad_diff,
            "worst_grad": worst_grad,
            "param_diff": param_diff,
            "worst_param": worst_param,
            "adamw_loss_diff": max(abs(a - b) for a, b in zip(adam_ref, adam_par, strict=True)),
            "loss_moved": abs(adam_ref[-1] - adam_ref[0]),
            "tied_kept": tied == ref.config.tie_word_embeddings,
            "local_heads": _local_heads(par),
        }
    return results


def _local_heads(model: nn.Module) -> list[tuple[int, int]]:
    return sorted(
        {(m.num_heads, m.num_key_value_heads) for m in model.modules() if hasattr(m, "num_key_value_heads")}
    )


def _check(results: list[dict[str, dict[str, Any]]], world: int, expect_heads: bool) -> None:
    assert results[0].keys() == results[-1].keys() and results[0]
    for rank_results in results:
        for case, r in rank_results.items():
            assert r["loss_diff"] <= 1e-5, (case, r)
            assert r["grad_diff"] <= 1e-5, (case, r["worst_grad"], r["grad_diff"])
            assert r["param_diff"] <= 1e-5, (case, r["worst_param"], r["param_diff"])
            assert r["adamw_loss_diff"] <= 1e-4, (case, r)
            assert r["loss_moved"] > 1e-3, (
                case,
                "training must change the loss for the comparison to mean anything",
            )
            assert r["tied_kept"], case
            if expect_heads and case.startswith("dense"):
                assert r["local_heads"] == [(8 // world, 4 // world)], (case, r["local_heads"])


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
def test_dense_decoder_tp_matches_reference(world: int) -> None:
    _check(run_on_ranks(_parity_cases, world, DENSE, timeout=300), world, expect_heads=True)


@pytest.mark.parametrize("world", [2, 4])
def test_hf_llama_and_qwen3_tp_match_reference(world: int) -> None:
    _check(run_on_ranks(_parity_cases, world, HF, timeout=300), world, expect_heads=False)


def test_hf_translated_plan_with_sequence_parallel_matches_reference() -> None:
    _check(run_on_ranks(_parity_cases, 2, [("hf-llama-unregistered", True, {})], timeout=300), 2, False)
