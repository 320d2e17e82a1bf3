"""Translate a Hugging Face model's ``_tp_plan`` into torch parallel styles (duck typing, no transformers import)."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

from plait.tp.discovery import find_decoder, language_rank, model_embeddings, module_fqn
from plait.tp.embedding import VocabParallelEmbedding
from plait.tp.experts import PARAM_STYLES, ExpertsTensorParallel, LocalParamsParallel, MlaKvAProjParallel
from plait.tp.registry import register_tp_plan
from plait.tp.replicate import ReplicatedWithGradAllReduce, ReplicateParallel
from plait.tp.sequence import SequenceParallelAllGather, SequenceParallelBlock, SequenceParallelNorm
from plait.tp.styles import REFUSED_STYLES, loss_parallel_head, parse_style

__all__ = ["hf_tp_plan", "is_remote_code_model"]

_HEAD_STYLES = frozenset({"colwise_rep", "colwise_gather_output", "colwise"})


def is_remote_code_model(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face ``trust_remote_code`` model (its class lives outside transformers)."""
    module = type(model).__module__
    if module.startswith("transformers_modules"):
        return True
    has_hf_config = hasattr(getattr(model, "config", None), "model_type")
    return (
        getattr(type(model), "_auto_class", None) is not None
        and has_hf_config
        and not module.startswith("transformers.")
    )


def _own_plan(module: nn.Module) -> dict[str, Any]:
    """A module's own HF plan: class ``_tp_plan`` merged with the instance's, else its config's base plan."""
    plan = dict(getattr(type(module), "_tp_plan", None) or {})
    plan.update(vars(module).get("_tp_plan") or {})
    if not plan and getattr(module, "base_model", None) is module:
        plan.update(getattr(getattr(module, "config", None), "base_model_tp_plan", None) or {})
    return plan


def _collect(model: nn.Module) -> dict[str, Any]:
    """The root's plan, completed with the most specific nested provider's keys (prefixed with its path)."""
    plan = _own_plan(model)
    nested = [(fqn, own) for fqn, m in model.named_modules() if fqn and (own := _own_plan(m))]
    if nested:
        fqn, own = max(nested, key=lambda item: (language_rank(item[0]), item[0].count(".")))
        for key, style in own.items():
            plan.setdefault(f"{fqn}.{key}", style)
    return plan


def _family(model: nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} (model_type {model_type!r})" if model_type else type(model).__name__


def _refuse(model: nn.Module, key: str, style: Any, why: str) -> ValueError:
    return ValueError(
        f"the Hugging Face TP plan of {_family(model)} uses style {style!r} for {key!r}: {why}; pass tp_plan= "
        "(a dict, a registered plan name, or 'pkg.mod:ATTR') without it, or use tp_size 1"
    )


def _split_param_entries(
    model: nn.Module, raw: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """Separate entries naming parameters (``experts.gate_up_proj``) from entries naming modules.

    Returns:
        The module entries and, per owner pattern, ``{parameter name: style}``.
    """
    params = [name for name, _ in model.named_parameters()]
    modules: dict[str, Any] = {}
    owned: dict[str, dict[str, str]] = {}
    for key, style in raw.items():
        if isinstance(style, str) and any(fnmatchcase(name, key) for name in params):
            if style not in PARAM_STYLES:
                raise _refuse(model, key, style, f"a parameter can only take one of {sorted(PARAM_STYLES)}")
            owner, _, name = key.rpartition(".")
            owned.setdefault(owner, {})[name] = style
        else:
            modules[key] = style
    return modules, owned


def _rope_dim(model: nn.Module, key: str) -> int:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    rope = getattr(config, "qk_rope_head_dim", None)
    if not isinstance(rope, int) or rope <= 0:
        raise _refuse(model, key, "mla_kv_a_proj", "the config has no positive `qk_rope_head_dim`")
    return rope


def _fused_halves(model: nn.Module, key: str, params: dict[str, str]) -> dict[str, str]:
    """Read ``colwise`` on fused 3-D experts weights as ``packed_colwise`` when the shapes say they are fused.

    The row-wise weight's input features are the column-wise weight's outputs after the forward
    combines them pairwise (``gate * act(up)``): a column-wise output twice the row-wise input holds
    two fused halves, and a plain split would give one rank all gates and the other all ups
    (Inkling's plans say ``colwise`` for ``gate_up_proj [experts, 2 * inter, hidden]``).
    """
    owner = next((m for fqn, m in model.named_modules() if fnmatchcase(fqn, key)), None)
    if owner is None:
        return params
    weights = {n: p for n, p in owner.named_parameters(recurse=False) if p.ndim == 3}
    inner = {weights[n].shape[-1] for n, style in params.items() if style == "rowwise" and n in weights}
    return {
        n: "packed_colwise"
        if style == "colwise" and n in weights and weights[n].shape[-2] in {2 * i for i in inner}
        else style
        for n, style in params.items()
    }


def _translate(model: nn.Module, key: str, style: Any, params: dict[str, str]) -> ParallelStyle:
    """One module entry as a style; ``params`` are the plan's entries for that module's own parameters."""
    if isinstance(style, ParallelStyle):
        return style
    if style == "moe_tp_experts":
        return ExpertsTensorParallel(_fused_halves(model, key, params))
    if style == "local_params":
        return LocalParamsParallel(params)
    if params:
        raise _refuse(
            model,
            key,
            style,
            f"the plan also shards its parameters {sorted(params)}, which that style cannot run",
        )
    if style == "mla_kv_a_proj":
        return MlaKvAProjParallel(_rope_dim(model, key))
    try:
        return parse_style(style)
    except ValueError:
        why = (
            REFUSED_STYLES.get(style, "plait does not implement that style") if isinstance(style, str) else ""
        )
        raise _refuse(model, key, style, why or "not a style string") from None


def _translate_all(model: nn.Module, raw: dict[str, Any], head: str | None) -> dict[str, ParallelStyle]:
    modules, owned = _split_param_entries(model, raw)
    orphans = sorted(set(owned) - set(modules))
    if orphans:
        owner = orphans[0]
        raise _refuse(
            model,
            f"{owner}.{next(iter(owned[owner]))}",
            next(iter(owned[owner].values())),
            f"the plan shards parameters of {owner!r} but gives {owner!r} itself no style that runs them "
            "(moe_tp_experts or local_params)",
        )
    plan: dict[str, ParallelStyle] = {}
    for key, style in modules.items():
        if head is not None and fnmatchcase(head, key) and style in _HEAD_STYLES:
            plan[key] = loss_parallel_head(sequence_parallel=False)
        else:
            plan[key] = _translate(model, key, style, owned.get(key, {}))
    return plan


_SEQUENCE_READY = (ColwiseParallel, RowwiseParallel, ReplicatedWithGradAllReduce)


def _block(key: str, layers: str) -> str:
    return key[len(layers) :].split(".", 1)[0]


def _whole_sequence_blocks(plan: dict[str, ParallelStyle], layers: str) -> set[str]:
    """Layer children (``mlp``, ``self_attn``) holding an entry that cannot take a sequence-sharded input.

    Such a block (fused experts, latent attention, local parameters) runs on the gathered sequence.
    """
    blocks = set()
    for key, style in plan.items():
        if not key.startswith(layers) or type(style) in _SEQUENCE_READY:
            continue
        if "." in key[len(layers) :] or getattr(style, "param_styles", None):  # inside, or the block's own
            blocks.add(_block(key, layers))
    return blocks


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _unplanned_blocks(plan: dict[str, ParallelStyle], base: nn.Module, prefix: str) -> list[str]:
    """Layer children with parameters that no plan entry reaches (AFMoE's attention), norms aside.

    Under SP their plain weights would meet the ``Shard(1)`` residual stream, so they run whole.
    """
    found = []
    for index, layer in enumerate(base.layers):
        for name, child in layer.named_children():
            fqn = f"{prefix}layers.{index}.{name}"
            inner = [fqn, *(f"{fqn}.{sub}" for sub, _ in child.named_modules() if sub)]
            planned = any(fnmatchcase(f, key) for f in inner for key in plan)
            if not planned and not _is_norm(child) and any(True for _ in child.parameters()):
                found.append(fqn)
    return found


def _sequence_parallel(
    model: nn.Module, plan: dict[str, ParallelStyle], head: str | None
) -> dict[str, ParallelStyle]:
    """Re-layout a translated Llama-style plan for sequence parallel (``Shard(1)`` residual stream)."""
    decoder = find_decoder(model)
    if decoder is None or len(decoder[1].layers) == 0:
        raise ValueError(
            f"sequence_parallel with the Hugging Face TP plan of {type(model).__name__} needs a Llama-style decoder "
            "(`embed_tokens` + `layers`); set sequence_parallel=False or pass tp_plan="
        )
    base_fqn, base = decoder
    prefix = f"{base_fqn}." if base_fqn else ""
    layers = f"{prefix}layers.*."
    whole = _whole_sequence_blocks(plan, layers)
    out: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        if key == head:
            out[key] = loss_parallel_head(sequence_parallel=True)
        elif isinstance(style, VocabParallelEmbedding) and key == f"{prefix}embed_tokens":
            out[key] = VocabParallelEmbedding(output_layouts=Shard(1), use_local_output=False)
        elif key.startswith(layers) and _block(key, layers) in whole:
            out[key] = style  # the block runs on the whole sequence, as without SP
        elif key.startswith(layers) and type(style) is ColwiseParallel:
            # Sharded or gathered output alike: a Shard(1) DTensor input (the residual stream) is
            # all-gathered by the style itself, a plain one is whole already.
            out[key] = style
        elif key.startswith(layers) and type(style) is RowwiseParallel:
            out[key] = RowwiseParallel(
                input_layouts=style.input_layouts[0], output_layouts=Shard(1), use_local_output=False
            )
        elif key.startswith(layers) and isinstance(style, ReplicatedWithGradAllReduce):
            out[key] = style
        else:
            raise ValueError(
                f"cannot combine sequence_parallel with the Hugging Face TP plan entry {key!r} "
                f"({type(style).__name__}) of {_family(model)}; set sequence_parallel=False or pass tp_plan="
            )
    for block in sorted(whole):
        # A block with its own style (attention sinks, local_params) keeps it inside the wrapper.
        # One entry per layer: fnmatch's `*` also crosses dots (`layers.*.mlp` would match AXK2's
        # `layers.0.input_layernorm.mlp`).
        for index, layer in enumerate(base.layers):
            if isinstance(getattr(layer, block, None), nn.Module):
                out[f"{prefix}layers.{index}.{block}"] = SequenceParallelBlock(plan.get(f"{layers}{block}"))
        out.pop(f"{layers}{block}", None)
    for fqn in _unplanned_blocks(out, base, prefix):
        out[fqn] = SequenceParallelBlock()
    norms = _add_norms(out, base_fqn, base, sequence_parallel=True)
    final = [f"{prefix}{name}" for name, child in base.named_children() if _is_norm(child)][-1:]
    if head not in out and final and isinstance(norms.get(final[0]), SequenceParallelNorm):
        norms[final[0]] = SequenceParallelAllGather()  # the head is not in the plan: the full sequence
    return norms


def _add_norms(
    plan: dict[str, ParallelStyle], base_fqn: str, base: nn.Module, *, sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """Give the decoder's norms (direct children of any layer or of the decoder) replicated weights.

    Sequence-parallel norms under SP, else ``ReplicateParallel``, so that every parameter is a DTensor.
    Found by class name, whatever the attribute is called (Phi's ``final_layernorm``).
    """
    prefix = f"{base_fqn}." if base_fqn else ""
    norms = {
        f"{prefix}layers.*.{name}": f"{prefix}layers.{index}.{name}"
        for index, layer in enumerate(base.layers)
        for name, child in layer.named_children()
        if _is_norm(child)
    }
    norms.update(
        {f"{prefix}{name}": f"{prefix}{name}" for name, child in base.named_children() if _is_norm(child)}
    )
    out = dict(plan)
    for pattern, fqn in norms.items():
        if not any(fnmatchcase(fqn, key) for key in out):
            out[pattern] = SequenceParallelNorm() if sequence_parallel else ReplicateParallel()
    return out


def hf_tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle] | None:
    """Translate the model's Hugging Face TP plan, or return ``None`` when it has none.

    The root's class ``_tp_plan`` merged with its instance ``_tp_plan``, completed by the most specific
    nested provider (a ``language_model`` / ``text_model`` path first, then the deepest), keys prefixed
    with its path. The input embedding is added as vocab-parallel when missing, entries naming
    parameters (fused experts' ``gate_up_proj``, attention sinks) go to their owner's style
    (``moe_tp_experts`` shards every expert, ``local_params``), and a gathered ``lm_head`` becomes a
    loss-parallel head (vocab-sharded ``DTensor`` logits). A style plait does not implement is refused,
    naming the family, the entry, the style and a way out. For a Llama-style decoder the norms get replicated DTensor weights, and with
    ``sequence_parallel`` the plan is re-laid-out for a ``Shard(1)`` residual stream.

    Raises:
        ValueError: a style plait cannot translate, or an entry that cannot be made sequence parallel
            (both before any collective).
    """
    raw = _collect(model)
    if not raw:
        return None
    head = module_fqn(model, model_embeddings(model, "get_output_embeddings"))
    plan = _translate_all(model, raw, head)
    embed = module_fqn(model, model_embeddings(model, "get_input_embeddings"))
    if plan and embed is not None and not any(fnmatchcase(embed, key) for key in plan):
        plan = {embed: VocabParallelEmbedding(), **plan}
    if not plan:
        return None
    if sequence_parallel:
        return _sequence_parallel(model, plan, head)
    decoder = find_decoder(model)
    return (
        plan
        if decoder is None or len(decoder[1].layers) == 0
        else _add_norms(plan, *decoder, sequence_parallel=False)
    )


register_tp_plan("hf", hf_tp_plan)
