"""Rank-side body of the combination matrix: one model on one mesh of the six axes, against the unsharded model.

A layout is a set of axes, each at size 2: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``sp``
(tensor parallel with sequence parallel) and ``ep``. The expert mesh folds over the data, context and
tensor ranks of a stage; ``ep`` without ``cp`` brings ``dp_shard 2`` (experts spread over data ranks),
and so does ``dp_replicate`` (FSDP2 refuses pure replication). :func:`combination_parity` trains the model through
``parallelize_model`` (or ``pipeline_model`` with ``pp``) beside the unsharded reference with
plait.testing's driver (loss and every gradient at step 0, parameters after 2 SGD steps, 3 AdamW
losses; fp32) and returns one row. Needs plait-sidecar and plait-pipeline, which plait-testing does
not declare.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder, MoEDecoder, MoEDecoderConfig
from plait.pipeline import Pipeline, PipelineConfig, pipeline_model
from plait.sidecar import parallelize_model
from plait.testing.cp_cases import cp_local_inputs
from plait.testing.driver import Inputs, paired, run_parity, token_batches
from plait.testing.hf_models import tiny_hf_model
from plait.testing.hf_moe import hf_moe_model
from plait.testing.models import lm_loss
from plait.testing.routing import Margins, record_routing_margins
from plait.testing.sweep import case_row

__all__ = [
    "COMBINATION_AXES",
    "COMBINATION_MODELS",
    "combination_parity",
    "combination_sizes",
    "combination_world",
]

COMBINATION_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "sp", "ep")
COMBINATION_MODELS = ("dense", "moe", "llama", "mistral", "qwen3_moe")
"""plait.models' dense and MoE decoders, transformers' Llama, Mistral (a 5-token sliding window over
8-token sequences) and Qwen3-MoE (unmodified classes)."""

_VOCAB = 64
_MOE = MoEDecoderConfig(vocab_size=_VOCAB, num_hidden_layers=2, num_experts=4)
_MOE_SEED = 59
_QWEN3_MOE_SEED = 32
"""Init seeds of the widest top-k margins found (60 and 40 seeds scanned over the driver's 6 steps at
1, 2 and 4 replicas): 1.03e-3 and 7.4e-4 relative. A row whose margin falls below ``MIN_MARGIN``
says so (``margin_ok``); float32 rounding differs between CPUs by ~1e-6 relative."""
_ROWS = 2
"""Rows per data-parallel replica and step (a pipeline splits them into 2 microbatches)."""


def combination_sizes(axes: Iterable[str]) -> dict[str, int]:
    """The ``ParallelismSizes`` fields of a layout (every named axis at 2, ``dp_shard`` where needed; resolved)."""
    axes = set(axes)
    unknown = axes - set(COMBINATION_AXES)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; use {COMBINATION_AXES}")
    needs_shard = ("ep" in axes and "cp" not in axes) or "dp_replicate" in axes
    replicas = 2 if "dp_replicate" in axes else 1
    return {
        "pp_size": 2 if "pp" in axes else 1,
        "dp_size": replicas * (2 if "dp_shard" in axes or needs_shard else 1),
        "dp_replicate_size": replicas,
        "cp_size": 2 if "cp" in axes else 1,
        "tp_size": 2 if axes & {"tp", "sp"} else 1,
        "ep_size": 2 if "ep" in axes else 1,
    }


def combination_world(axes: Iterable[str]) -> int:
    """The ranks a layout needs."""
    sizes = combination_sizes(axes)
    return sizes["pp_size"] * sizes["dp_size"] * sizes["cp_size"] * sizes["tp_size"]


def _build(model: str, layers: int, seed: int | None = None) -> nn.Module:
    if model == "dense":
        return DenseDecoder(DecoderConfig(vocab_size=_VOCAB, num_hidden_layers=layers))
    if model == "moe":
        torch.manual_seed(_MOE_SEED if seed is None else seed)
        return MoEDecoder(_MOE)
    if model == "llama":
        return tiny_hf_model("llama", seed=None, vocab_size=_VOCAB, num_hidden_layers=layers)
    if model == "mistral":
        return tiny_hf_model(
            "mistral",
            seed=None,
            vocab_size=_VOCAB,
            num_hidden_layers=layers,
            sliding_window=5,
            attn_implementation="sdpa",
        )
    if model == "qwen3_moe":
        return hf_moe_model("qwen3_moe", seed=_QWEN3_MOE_SEED if seed is None else seed)
    raise ValueError(f"unknown model {model!r}; use one of {COMBINATION_MODELS}")


def _facts(modules: list[nn.Module]) -> dict[str, Any]:
    """The parameters' mesh dims and the checkpoint wrappers: proof that the layout was applied."""
    every = [m for root in modules for m in root.modules()]
    dims = {
        d
        for root in modules
        for p in root.parameters()
        if isinstance(p, DTensor)
        for d in p.device_mesh.mesh_dim_names or ()
    }
    return {"mesh_dims": sorted(dims), "checkpointed": sum(isinstance(m, CheckpointWrapper) for m in every)}


def _inspect_model(_reference: nn.Module, parallel: nn.Module) -> dict[str, Any]:
    return _facts([parallel])


def _inspect_pipeline(_reference: nn.Module, pipe: Pipeline) -> dict[str, Any]:
    return _facts(pipe.modules)


def _pipelined(
    model: str, ctx: MeshContext, seed: int | None
) -> tuple[Callable[[], tuple[nn.Module, Pipeline]], Margins | None, Any]:
    """The reference and its pipeline (1F1B, 2 microbatches); the margins are the reference's only,
    recorded after the copy (a stage's shape inference runs a forward on placeholder inputs)."""
    torch.manual_seed(0)
    reference = _build(model, 4, seed)
    pipe = pipeline_model(copy.deepcopy(reference), ctx, lm_loss, PipelineConfig(microbatches=_ROWS))
    margins = record_routing_margins(reference) if "moe" in model else None
    return (lambda: (reference, pipe)), margins, _inspect_pipeline


def _pipeline_step(pipe: Pipeline, batch: Inputs) -> torch.Tensor:
    kwargs, labels = batch
    rest = {k: v for k, v in kwargs.items() if k != "input_ids"}  # cp: position_ids for every stage
    return pipe.step(kwargs["input_ids"], labels, **rest)


def combination_parity(
    model: str, axes: tuple[str, ...], ac: str | bool = False, seed: int | None = None
) -> dict[str, Any]:
    """This rank's row for ``model`` on the layout ``axes`` with activation checkpointing ``ac``.

    ``seed``: a MoE model's init seed instead of the matrix's (one with a wider router margin on
    this layout's batches).

    The row holds the driver's measurements and ``ok`` (fp32 tolerances), the reference's smallest
    router margin for a MoE model (``margin_ok``: no top-k near-tie another CPU's rounding could flip),
    the parameters' mesh dims, the checkpoint wrappers and the local sequence length under cp.
    """
    sizes = combination_sizes(axes)
    ctx = MeshContext.build(
        FSDP2Config(mp_policy=None, sequence_parallel="sp" in axes),
        ParallelismSizes(**sizes),
        activation_checkpointing=ac,
    )
    dp = ctx.dp_mesh()
    local_seq: list[int] = []
    margins: Margins | None = None
    kwargs: dict[str, Any] = {
        "dp_rank": dp.get_local_rank(),
        "case": f"{model} {'+'.join(axes)} ac={ac}",
        "local_inputs": cp_local_inputs(ctx, local_seq) if ctx.cp_size > 1 else None,
    }
    if ctx.pp_size > 1:
        models, margins, inspect = _pipelined(model, ctx, seed)
        kwargs |= {"parallel_step": _pipeline_step, "subset": True}
    else:
        margins = Margins() if "moe" in model else None
        models = paired(lambda: _build(model, 4, seed), lambda m: parallelize_model(m, ctx))
        if margins is not None:
            kwargs["prepare_reference"] = partial(record_routing_margins, margins=margins)
        inspect = _inspect_model
    parity = run_parity(models, token_batches(_VOCAB, dp.size(), batch=_ROWS), inspect=inspect, **kwargs)
    row = case_row(parity)
    row |= row.pop("extra") | {"local_seq": local_seq[:1]}
    if margins is not None:
        row["margin"] = margins.smallest
        try:
            margins.check()
            row["margin_ok"] = True
        except AssertionError:
            row["margin_ok"] = False
    return row
