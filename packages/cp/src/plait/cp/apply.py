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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.cp.all_to_all import all_to_all_refusal
from plait.cp.attention import ContextParallelAttention
from plait.cp.choice import CPAttentionChoice, choose_cp_attention, heads_of
from plait.cp.gather import GatheredSequence, WholeSequenceAttention, gather_target
from plait.cp.hf import (
    CP_ATTRIBUTE,
    attach_hf,
    dispatches_attention,
    hf_module_refusal,
    hf_refusal,
    is_hf_model,
    own_forward_refusal,
    own_mask_refusal,
    sequence_mixer_refusal,
    sparse_refusal,
)
from plait.cp.layout import DOCUMENTS_KEY, cp_mesh, global_positions

if TYPE_CHECKING:
    from plait.mesh import MeshContext

__all__ = [
    "apply_context_parallel",
    "check_context_parallel_model",
    "check_cp_inputs",
    "cp_attention_choice",
    "cp_gathered_modules",
]

_FORWARD_ONLY_KWARGS = ("labels", "use_cache", "past_key_values", "cache")
_MEDIA_TOWERS = ("visual", "vision_tower", "vision_model", "audio_tower")
"""Child names of multimodal encoders: their tokens are not sequence-sharded, so their attention must stay."""


def check_context_parallel_model(
    model: nn.Module, mesh_context: MeshContext | None = None, *, variant: str | None = None
) -> None:
    """Refuse (ValueError) a model with an attention the cp step cannot swap; changes nothing.

    The combinations cp does not build with (strategies, other axes, multimodal models) are refused
    by the combination table in plait.mesh; this checks the model's own attention modules and sequence
    mixers (gathered only when ``mesh_context``'s config says ``cp_sequence_mixers='gather'``) and,
    given ``mesh_context``, that ``variant`` (default: the config's ``cp_attention``) can split their heads.
    """
    found = _find_attention(model, gather=_gathers(mesh_context))
    if mesh_context is not None and mesh_context.cp_size > 1:
        chosen = variant or choose_cp_attention(found.attention(), mesh_context).variant
        _check_heads(model, found.attention(), mesh_context, chosen)


def cp_attention_choice(model: nn.Module, mesh_context: MeshContext) -> CPAttentionChoice:
    """The variant the cp step gives ``model``'s attention under ``mesh_context``, and why (``auto`` resolved)."""
    return choose_cp_attention(
        _find_attention(model, gather=_gathers(mesh_context)).attention(), mesh_context
    )


def cp_gathered_modules(model: nn.Module, mesh_context: MeshContext) -> tuple[str, ...]:
    """The modules the cp step runs on the whole sequence (``cp_sequence_mixers='gather'``; see `plait.cp.gather`)."""
    return tuple(_find_attention(model, gather=_gathers(mesh_context)).gathered)


def apply_context_parallel(
    model: nn.Module, mesh_context: MeshContext, *, variant: str | None = None
) -> nn.Module:
    """Make every attention of ``model`` attend over the cp-sharded sequence (no-op when cp is 1).

    ``variant`` is the plan's CP attention (default: the config's ``cp_attention``, ``auto`` resolved
    by `plait.cp.choose_cp_attention`). Sequence mixers cp cannot split run gathered when the config
    says ``cp_sequence_mixers='gather'`` (`plait.cp.gather`). Inputs must then
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
    found = _find_attention(model, gather=_gathers(mesh_context))
    variant = variant or choose_cp_attention(found.attention(), mesh_context).variant
    attention = ContextParallelAttention(mesh, variant)
    _check_heads(model, found.attention(), mesh_context, variant)
    for module in found.fn_modules:
        module.attention_fn = attention
    for hf_model, modules in found.hf_models:
        attach_hf(hf_model, modules, attention)
    for name, module in found.gathered.items():
        for inner in module.modules():
            if hasattr(inner, CP_ATTRIBUTE) or dispatches_attention(inner):
                setattr(inner, CP_ATTRIBUTE, WholeSequenceAttention())
        GatheredSequence(mesh, name, causal_mask=name in found.masked).attach(module)
    guard = _InputGuard(
        mesh.size(), mesh.get_local_rank(), documents=not found.fn_modules, gathered=bool(found.gathered)
    )
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


@dataclass
class _Found:
    """What the cp step swaps: ``attention_fn`` modules, HF models with their attention modules, and
    the sequence mixers it runs gathered (full name -> module; attention inside them runs whole)."""

    fn_modules: list[nn.Module] = field(default_factory=list)
    hf_models: list[tuple[nn.Module, list[nn.Module]]] = field(default_factory=list)
    gathered: dict[str, nn.Module] = field(default_factory=dict)
    masked: set[str] = field(default_factory=set)
    """Gathered sparse attention modules, handed the whole sequence's causal mask."""

    def attention(self) -> list[nn.Module]:
        """Every attention module cp attention splits (not those inside a gathered module)."""
        inside = {id(m) for g in self.gathered.values() for m in g.modules()}
        return [
            m
            for m in self.fn_modules + [m for _, mods in self.hf_models for m in mods]
            if id(m) not in inside
        ]


def _gathers(mesh_context: MeshContext | None) -> bool:
    config = None if mesh_context is None else mesh_context.strategy_config
    return getattr(config, "cp_sequence_mixers", "refuse") == "gather"


def _find_attention(model: nn.Module, *, gather: bool) -> _Found:
    """Every attention and sequence mixer of ``model``; raises (ValueError) for what cp cannot handle."""
    found, problems, claimed = _Found(), [], set()
    for name, module in model.named_modules():
        if id(module) in claimed:
            continue
        if name.rsplit(".", 1)[-1] in _MEDIA_TOWERS:
            problems.append(
                f"{name} ({type(module).__name__}): a multimodal tower; cp is not built for multimodal models"
            )
            claimed.update(id(m) for m in module.modules())
        elif is_hf_model(module):
            claimed.update(id(m) for m in module.modules())
            if (why := hf_refusal(module)) is not None:
                problems.append(f"{name or '<root>'}: {why}")
            found.hf_models.append((module, _hf_parts(name, module, gather, found, problems)))
        elif callable(getattr(module, "attention_fn", None)):
            found.fn_modules.append(module)
        elif _looks_like_attention(module):
            problems.append(
                f"{name or '<root>'} ({type(module).__name__}): computes attention itself; give it an "
                "attention_fn attribute with SDPA semantics, or use a transformers model"
            )
    if not problems and not found.attention() and not found.gathered:
        problems.append(f"<root> ({type(model).__name__}): no attention found to split over cp")
    if problems:
        raise ValueError(
            "context parallel (cp_size > 1) cannot handle this model's attention:\n  " + "\n  ".join(problems)
        )
    return found


def _hf_parts(
    prefix: str, hf_model: nn.Module, gather: bool, found: _Found, problems: list[str]
) -> list[nn.Module]:
    """The HF model's attention modules; its sequence mixers go to ``found.gathered`` (or ``problems``)."""
    attention, mixers, sparse = [], [], set()
    for sub_name, sub in hf_model.named_modules():
        if _attends_elsewhere(sub):
            problems.append(
                f"{_join(prefix, sub_name)}: {type(sub).__name__} calls transformers' attention functions "
                "without causal attention over the sequence (is_causal=False; over layers or blocks?); cp "
                "cannot tell what it attends over"
            )
        elif _looks_like_attention(sub, hf=True) and (why := hf_module_refusal(sub)):
            problems.append(f"{_join(prefix, sub_name)}: {why}")
        elif _looks_like_attention(sub, hf=True) and (why := sparse_refusal(sub) or own_mask_refusal(sub)):
            mixers.append((sub_name, why))
            sparse.add(sub_name)
        elif _looks_like_attention(sub, hf=True) and (why := own_forward_refusal(sub)):
            mixers.append((sub_name, why))
        elif _looks_like_attention(sub, hf=True):
            attention.append(sub)
        elif why := sequence_mixer_refusal(sub):
            mixers.append((sub_name, why))
    targets = {}
    for sub_name, why in mixers:
        target = gather_target(hf_model, sub_name)
        if gather and target is not None:
            targets[target] = hf_model.get_submodule(target)
        else:
            hint = _GATHER_HINT if target is not None else ""
            problems.append(f"{_join(prefix, sub_name)}: {why}{hint}")
    for target, module in targets.items():  # the outermost of nested targets
        if not any(target.startswith(other + ".") for other in targets):
            found.gathered[_join(prefix, target)] = module
            if target in sparse:
                found.masked.add(_join(prefix, target))
    return attention


_GATHER_HINT = (
    " (FSDP2Config.cp_sequence_mixers='gather' runs it on the whole sequence on every cp rank: exact, "
    "no memory saved in it)"
)


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


def _looks_like_attention(module: nn.Module, *, hf: bool = False) -> bool:
    """An attention module: ``nn.MultiheadAttention``, a class named ``*Attention`` or, in a transformers
    model, a causal module that calls its attention functions (``LongcatFlashMLA``)."""
    if isinstance(module, nn.MultiheadAttention) or type(module).__name__.endswith("Attention"):
        return True
    return hf and getattr(module, "is_causal", None) is True and dispatches_attention(module)


def _attends_elsewhere(module: nn.Module) -> bool:
    """A transformers module that is not named ``*Attention``, calls the attention functions and is not causal."""
    if type(module).__name__.endswith("Attention") or getattr(module, "is_causal", None) is not False:
        return False
    return dispatches_attention(module)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name or "<root>"


class _InputGuard:
    """Forward pre-hook: the inputs must be this rank's load-balanced part, with its global positions."""

    def __init__(self, cp_size: int, cp_rank: int, *, documents: bool, gathered: bool) -> None:
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.documents = documents  # whether the attention receives the forward's document ids
        self.gathered = gathered  # gathered sequence mixers, which do not
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
        if self.gathered:
            raise ValueError(
                f"{name} under cp_size={self.cp_size}: packed documents ({DOCUMENTS_KEY}=) do not reach the "
                "sequence mixers cp runs gathered (cp_sequence_mixers='gather'); they would mix across documents"
            )
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
