"""`apply_context_parallel`: the cp step of the shared flow — check every attention, then swap it.

Two kinds of attention are handled, without changing a model class:
- a module with an ``attention_fn`` attribute (SDPA semantics ``(q, k, v, *, is_causal, scale,
  enable_gqa)``, as plait's reference decoders have): the attribute is set to a
  `ContextParallelAttention`;
- a transformers model that dispatches through ``AttentionInterface``: switched to ``"plait_cp"``.
Anything else that looks like attention (``nn.MultiheadAttention``, a class named ``*Attention``
neither of those reaches, a window, soft-cap or sinks a transformers module does not pass to its
attention function, attention dropout) is refused by name before anything is changed and before any
collective, identically on every rank.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.cp.all_to_all import all_to_all_refusal
from plait.cp.attention import ContextParallelAttention
from plait.cp.choice import CPAttentionChoice, choose_cp_attention, heads_of
from plait.cp.hf import attach_hf, hf_module_refusal, hf_refusal, is_hf_model, sequence_mixer_refusal
from plait.cp.layout import DOCUMENTS_KEY, cp_mesh, global_positions

if TYPE_CHECKING:
    from plait.mesh import MeshContext

__all__ = ["apply_context_parallel", "check_context_parallel_model"]

_FORWARD_ONLY_KWARGS = ("labels", "use_cache", "past_key_values", "cache")
_MEDIA_TOWERS = ("visual", "vision_tower", "vision_model", "audio_tower")
"""Child names of multimodal encoders: their tokens are not sequence-sharded, so their attention must stay."""


def check_context_parallel_model(
    model: nn.Module, mesh_context: MeshContext | None = None, *, variant: str | None = None
) -> None:
    """Refuse (ValueError) a model with an attention the cp step cannot swap; changes nothing.

    The combinations cp does not build with (strategies, other axes, multimodal models) are refused
    by the combination table in plait.mesh; this checks the model's own attention modules and, given
    ``mesh_context``, that ``variant`` (default: the config's ``cp_attention``) can split their heads.
    """
    fn_modules, hf_models = _find_attention(model)
    if mesh_context is not None and mesh_context.cp_size > 1:
        modules = fn_modules + [m for _, mods in hf_models for m in mods]
        chosen = variant or choose_cp_attention(modules, mesh_context).variant
        _check_heads(model, modules, mesh_context, chosen)


def cp_attention_choice(model: nn.Module, mesh_context: MeshContext) -> CPAttentionChoice:
    """The variant the cp step gives ``model``'s attention under ``mesh_context``, and why (``auto`` resolved)."""
    fn_modules, hf_models = _find_attention(model)
    return choose_cp_attention(fn_modules + [m for _, mods in hf_models for m in mods], mesh_context)


def apply_context_parallel(
    model: nn.Module, mesh_context: MeshContext, *, variant: str | None = None
) -> nn.Module:
    """Make every attention of ``model`` attend over the cp-sharded sequence (no-op when cp is 1).

    ``variant`` is the plan's CP attention (default: the config's ``cp_attention``, ``auto`` resolved
    by `plait.cp.choose_cp_attention`). Inputs must then
    be split with `plait.cp.shard_sequence` and the forward given its
    ``position_ids``; a forward without them, with a padding ``attention_mask``, ``labels`` (the
    model would shift them across chunk boundaries) or a KV cache is refused before it runs.

    Raises:
        ValueError: naming the module and the reason, for an attention this step cannot handle
            (``all_to_all`` included: local query heads that do not divide by cp); nothing is
            changed then.
    """
    mesh = cp_mesh(mesh_context)
    if mesh is None:
        return model
    fn_modules, hf_models = _find_attention(model)
    modules = fn_modules + [m for _, mods in hf_models for m in mods]
    variant = variant or choose_cp_attention(modules, mesh_context).variant
    attention = ContextParallelAttention(mesh, variant)
    _check_heads(model, modules, mesh_context, variant)
    for module in fn_modules:
        module.attention_fn = attention
    for hf_model, modules in hf_models:
        attach_hf(hf_model, modules, attention)
    guard = _InputGuard(mesh.size(), mesh.get_local_rank(), documents=not fn_modules)
    model.register_forward_pre_hook(guard, with_kwargs=True)
    return model


def check_cp_inputs(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Run the input checks ``apply_context_parallel`` attached to ``model`` on forward ``kwargs``, now.

    For callers whose ranks would not all reach the forward before a collective (a pipeline's later
    stages wait for activations): every rank refuses the same inputs up front. No-op on a model without
    context parallel. Raises the forward's ``ValueError``.
    """
    for hook in list(model._forward_pre_hooks.values()):
        if isinstance(hook, _InputGuard):
            hook(model, (), kwargs)


def _find_attention(model: nn.Module) -> tuple[list[nn.Module], list[tuple[nn.Module, list[nn.Module]]]]:
    """``attention_fn`` modules and ``(hf_model, its attention modules)``; raises for anything else."""
    fn_modules: list[nn.Module] = []
    hf_models: list[tuple[nn.Module, list[nn.Module]]] = []
    problems: list[str] = []
    claimed: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in claimed:
            continue
        if name.rsplit(".", 1)[-1] in _MEDIA_TOWERS:
            problems.append(
                f"{name} ({type(module).__name__}): a multimodal tower; cp is not built for multimodal models"
            )
            claimed.update(id(m) for m in module.modules())
        elif is_hf_model(module):
            why = hf_refusal(module)
            if why is not None:
                problems.append(f"{name or '<root>'}: {why}")
            modules = []
            for sub_name, sub in module.named_modules():
                claimed.add(id(sub))
                if _looks_like_attention(sub):
                    modules.append(sub)
                    if sub_why := hf_module_refusal(sub):
                        problems.append(f"{_join(name, sub_name)}: {sub_why}")
                elif mixer_why := sequence_mixer_refusal(sub):
                    problems.append(f"{_join(name, sub_name)}: {mixer_why}")
            hf_models.append((module, modules))
        elif callable(getattr(module, "attention_fn", None)):
            fn_modules.append(module)
        elif _looks_like_attention(module):
            problems.append(
                f"{name or '<root>'} ({type(module).__name__}): computes attention itself; give it an "
                "attention_fn attribute with SDPA semantics, or use a transformers model"
            )
    if not problems and not fn_modules and not any(mods for _, mods in hf_models):
        problems.append(f"<root> ({type(model).__name__}): no attention found to split over cp")
    if problems:
        raise ValueError(
            "context parallel (cp_size > 1) cannot handle this model's attention:\n  " + "\n  ".join(problems)
        )
    return fn_modules, hf_models


def _check_heads(model: nn.Module, modules: list[nn.Module], mesh_context: MeshContext, variant: str) -> None:
    """Refuse, naming the modules, query heads that ``all_to_all`` cannot split over cp.

    Head counts are read from ``num_heads`` (plait.models) or ``config.num_attention_heads``
    (transformers); a module with neither is checked when it is called.
    """
    if variant != "all_to_all":
        return
    names = {id(m): n for n, m in model.named_modules()}
    problems = []
    for module in modules:
        heads = heads_of(module)[0]
        if heads is None or heads % mesh_context.tp_size:
            continue  # unknown here, or refused by tensor parallel itself
        why = all_to_all_refusal(heads // mesh_context.tp_size, mesh_context.cp_size)
        if why is not None:
            problems.append(
                f"{names[id(module)] or '<root>'} ({heads} query heads, tp_size={mesh_context.tp_size}): {why}"
            )
    if problems:
        raise ValueError("context parallel cannot split these attention heads:\n  " + "\n  ".join(problems))


def _looks_like_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or type(module).__name__.endswith("Attention")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name or "<root>"


class _InputGuard:
    """Forward pre-hook: the inputs must be this rank's load-balanced part, with its global positions."""

    def __init__(self, cp_size: int, cp_rank: int, *, documents: bool) -> None:
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.documents = documents  # whether the attention receives the forward's document ids
        self._checked: Any = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for key in _FORWARD_ONLY_KWARGS:
            value = kwargs.get(key)
            if value is not None and value is not False:
                raise ValueError(
                    f"{type(module).__name__} under cp_size={self.cp_size}: {key}= is not supported; compute the "
                    "loss outside the model with labels split by plait.cp.shard_sequence, and train without a KV cache"
                )
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError(
                f"{type(module).__name__} under cp_size={self.cp_size}: a padding attention_mask cannot be honoured "
                "across cp ranks; pack the sequences without padding"
            )
        positions, documents = kwargs.get("position_ids"), kwargs.get(DOCUMENTS_KEY)
        if positions is None:
            raise ValueError(
                f"{type(module).__name__} under cp_size={self.cp_size} needs position_ids=: pass the batch "
                "from plait.cp.shard_sequence (its position_ids are the tokens' global positions)"
            )
        if documents is None:
            self._check_positions(module, positions)
        else:
            self._check_documents(module, positions, documents)

    def _check_documents(self, module: nn.Module, positions: torch.Tensor, documents: torch.Tensor) -> None:
        """Packed documents: ids of the whole sequence that agree with this rank's positions."""
        name = type(module).__name__
        if not self.documents:
            raise ValueError(
                f"{name} under cp_size={self.cp_size}: packed documents ({DOCUMENTS_KEY}=) reach only a "
                "transformers model's attention; an attention_fn module would attend across documents"
            )
        local = positions.shape[-1]
        if documents.shape != (positions.shape[0], local * self.cp_size):
            raise ValueError(
                f"{name} under cp_size={self.cp_size}: {DOCUMENTS_KEY} must be the whole sequence's "
                f"[{positions.shape[0]}, {local * self.cp_size}], got {tuple(documents.shape)}; pass the batch "
                "from plait.cp.shard_sequence"
            )
        index = global_positions(local * self.cp_size, self.cp_rank, self.cp_size, device=documents.device)
        mine = documents.index_select(1, index)
        same = mine[:, 1:] == mine[:, :-1]
        steps = positions[:, 1:] == positions[:, :-1] + 1
        inside = torch.ones_like(same)
        inside[:, local // 2 - 1] = False  # the head and tail chunks are not neighbours
        if not bool((same == steps)[inside].all()):
            raise ValueError(
                f"{name} under cp_size={self.cp_size}: {DOCUMENTS_KEY} disagree with position_ids on cp rank "
                f"{self.cp_rank} (a document continues exactly where positions step by 1); pass the batch "
                "from plait.cp.shard_sequence"
            )

    def _check_positions(self, module: nn.Module, positions: torch.Tensor) -> None:
        if self._checked is not None and self._checked() is positions:
            return
        local = positions.shape[-1]
        expected = global_positions(local * self.cp_size, self.cp_rank, self.cp_size, device=positions.device)
        if not bool((positions == expected).all()):
            raise ValueError(
                f"{type(module).__name__} under cp_size={self.cp_size}: position_ids on cp rank {self.cp_rank} "
                "are not the global positions plait.cp.shard_sequence gives (packed documents: pass the batch "
                f"through shard_sequence, which adds their {DOCUMENTS_KEY})"
            )
        self._checked = weakref.ref(positions)
