"""Rank side: one family at one mesh, parallelized by ``parallelize_model``, against the unsharded model.

Under cp each rank's rows are split along the sequence by ``plait.testing.cp_local_inputs`` (the CP
parity tests' path: `plait.cp.shard_sequence`, this rank's chunks with their global ``position_ids``).
"""

from __future__ import annotations

import copy
import traceback
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from plait.testing import SWEEP_HF_SIZES, sweep_hf_config

if TYPE_CHECKING:
    from plait.mesh import MeshContext

VOCAB = SWEEP_HF_SIZES["vocab_size"]
SEQ = 16
ROWS = 2  # per data-parallel rank
LR = 0.5
TOLERANCE = 1e-5


def build_model(model_type: str, tp: int, dtype: torch.dtype, cp: int = 1) -> nn.Module:
    """The family's seeded tiny model with the heads of ``tp`` (those of tp 2 below 2), noisy 1-D weights.

    ``cp > 1``: its sliding windows / attention chunks shrunk to matter at 16 tokens (``SWEEP_CP_WINDOWS``).
    """
    import transformers

    config = sweep_hf_config(model_type, max(tp, 2), cp)
    if dtype == torch.float64:  # grouped_mm has no float64 kernel: fused experts run the per-expert loop
        config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # zero-initialised vectors (Gemma's 1 + w norms) would hide gradient errors
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def next_tokens(ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The forward's inputs and the labels of a ``[rows, SEQ + 1]`` token batch."""
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def local_batch(ctx: MeshContext, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """This rank's part of the global batch: its data-parallel rows, under cp its chunks of them."""
    from plait.testing import cp_local_inputs

    dp_rank = ctx.dp_mesh().get_local_rank()
    batch = next_tokens(ids[dp_rank * ROWS : (dp_rank + 1) * ROWS])
    return cp_local_inputs(ctx, [])(batch) if ctx.cp_size > 1 else batch


def lm_loss(model: nn.Module, batch: tuple[dict[str, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross entropy of ``(inputs, labels)``, backward run; the (full) loss detached."""
    kwargs, labels = batch
    logits = model(**kwargs).logits
    sharded = isinstance(logits, DTensor)
    with loss_parallel() if sharded else nullcontext():
        loss = F.cross_entropy(
            logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)), labels.flatten()
        )
        loss.backward()
    return (loss.full_tensor() if sharded else loss).detach()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def relative_diff(ref: nn.Module, par: nn.Module, grads: bool) -> tuple[float, str]:
    """Largest per-parameter ``max|x - x_ref| / max|x_ref|`` (a collective: same order on every rank)."""
    par_params = {name.replace("_checkpoint_wrapped_module.", ""): p for name, p in par.named_parameters()}
    worst, worst_name = 0.0, ""
    for name, r in sorted(ref.named_parameters()):
        p = par_params[name]
        a, b = (r.grad, p.grad) if grads else (r, p)
        if a is None and b is None:
            continue
        if a is None or b is None:
            return float("inf"), f"{name} (gradient missing on one side)"
        got = _full(b)
        scale = a.abs().max().item() or 1.0
        diff = (got.float() - a.float()).abs().max().item() / scale
        if diff != diff or diff > worst or not worst_name:  # NaN counts as the worst
            worst, worst_name = diff, name
    return worst, worst_name


def _is_refusal(exc: BaseException) -> bool:
    """A ValueError / TypeError raised by plait itself (not by torch or transformers)."""
    if not isinstance(exc, ValueError | TypeError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and "/plait/" in frames[-1].filename


def parallel_copy(ref: nn.Module, tp: int, sp: bool, cp: int) -> tuple[nn.Module, MeshContext]:
    """A copy of ``ref`` through ``parallelize_model`` at dp_shard = world / (tp * cp) x cp x tp, fp32."""
    from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
    from plait.sidecar import parallelize_model

    mixers = "gather" if cp > 1 else "refuse"
    config = FSDP2Config(mp_policy=None, sequence_parallel=sp, cp_sequence_mixers=mixers)
    ctx = MeshContext.build(config, ParallelismSizes(tp_size=tp, cp_size=cp))
    return parallelize_model(copy.deepcopy(ref), ctx), ctx


def run_case(model_type: str, tp: int, sp: bool, dtype: str = "float32", cp: int = 1) -> dict[str, Any]:
    """Parallelize (dp_shard = world / (tp * cp)) and compare; every rank returns the same kind of record.

    ``dtype="float64"`` tells a real error from float32 rounding that a family's numerics amplify.
    """
    try:
        ref = build_model(model_type, tp, getattr(torch, dtype), cp)
    except Exception as exc:  # the tiny config does not build: needs an override, not a plait result
        return {"status": "config", "message": f"{type(exc).__name__}: {exc}"[:400]}
    try:
        par, ctx = parallel_copy(ref, tp, sp, cp)
    except Exception as exc:
        status = "refused" if _is_refusal(exc) else "crash"
        return {"status": status, "message": f"{type(exc).__name__}: {exc}"[:600]}
    try:
        return _compare(ref, par, ctx)
    except Exception as exc:  # a refusal at the first forward (plait's input checks) or a crash
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return {
            "status": "refused" if _is_refusal(exc) else "crash",
            "message": f"{type(exc).__name__}: {exc} [{where.filename}:{where.lineno}]"[:600],
        }


def global_batch(ctx: MeshContext, step: int) -> torch.Tensor:
    """The step's ``[dp * ROWS, SEQ + 1]`` tokens, the same on every rank."""
    rows = ctx.dp_mesh().size() * ROWS
    return torch.randint(3, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def _compare(ref: nn.Module, par: nn.Module, ctx: MeshContext) -> dict[str, Any]:
    world = dist.get_world_size()
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LR) for m in (ref, par)]
    out: dict[str, Any] = {}
    for step in range(2):
        ids = global_batch(ctx, step)
        try:
            ref_loss = lm_loss(ref, next_tokens(ids))
        except Exception as exc:  # the unsharded tiny model itself fails: a config problem
            return {"status": "config", "message": f"reference: {type(exc).__name__}: {exc}"[:400]}
        par_loss = lm_loss(par, local_batch(ctx, ids))
        if step == 0:
            dist.all_reduce(par_loss)
            out["loss_diff"] = abs(ref_loss.item() - par_loss.item() / world)
            out["grad_diff"], out["worst_grad"] = relative_diff(ref, par, grads=True)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out["param_diff"], out["worst_param"] = relative_diff(ref, par, grads=False)
    ok = max(out["loss_diff"], out["grad_diff"], out["param_diff"]) <= TOLERANCE
    out["status"] = "pass" if ok else "mismatch"
    return out
