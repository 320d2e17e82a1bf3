"""Translate a Hugging Face model's ``_tp_plan`` into torch parallel styles (duck typing, no transformers import)."""

from __future__ import annotations

import warnings
from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from plait.tp.discovery import family_name, language_rank, model_embeddings, module_fqn
from plait.tp.embedding import VocabParallelEmbedding
from plait.tp.experts import (
    PARAM_STYLES,
    AllReduceParallel,
    ExpertsTensorParallel,
    IdentityExpertParallel,
    LocalParamsParallel,
    MlaKvAProjParallel,
)
from plait.tp.hf_sequence import layer_containers, replicated_norms, sequence_parallel_plan
from plait.tp.registry import register_tp_plan
from plait.tp.styles import REFUSED_STYLES, RowwiseLocalCopy, loss_parallel_head, parse_style

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


def _refuse(model: nn.Module, key: str, style: Any, why: str) -> ValueError:
    return ValueError(
        f"the Hugging Face TP plan of {family_name(model)} uses style {style!r} for {key!r}: {why}; pass tp_plan= "
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
    if style == "all_reduce" and params:
        return AllReduceParallel(_fused_halves(model, key, params))
    if params:
        raise _refuse(
            model,
            key,
            style,
            f"the plan also shards its parameters {sorted(params)}, which that style cannot run",
        )
    if style == "moe_identity_expert":
        return IdentityExpertParallel()
    if style == "mla_kv_a_proj":
        return MlaKvAProjParallel(_rope_dim(model, key))
    try:
        parsed = parse_style(style)
    except ValueError:
        why = (
            REFUSED_STYLES.get(style, "plait does not implement that style") if isinstance(style, str) else ""
        )
        raise _refuse(model, key, style, why or "not a style string") from None
    if type(parsed) is RowwiseParallel:  # a model's own code may update its output in place (Llama4)
        return RowwiseLocalCopy(
            input_layouts=parsed.input_layouts[0], output_layouts=parsed.output_layouts[0]
        )
    return parsed


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


def _present(model: nn.Module, raw: dict[str, Any]) -> dict[str, Any]:
    """The entries that name a module or parameter this instance has.

    A family's plan covers every layout its config can build (MoE layers, a vision adapter); an
    entry for a part this config did not build (Beam with only dense MLPs) applies to nothing, as
    in transformers, and is not refused for a style it would never run (a warning names it).
    """
    names = [fqn for fqn, _ in model.named_modules() if fqn] + [name for name, _ in model.named_parameters()]
    kept = {key: style for key, style in raw.items() if any(fnmatchcase(name, key) for name in names)}
    for key in sorted(set(raw) - set(kept)):
        warnings.warn(
            f"Hugging Face TP plan pattern {key!r} matches no module or parameter of {type(model).__name__}; "
            "skipping it",
            UserWarning,
            stacklevel=4,
        )
    return kept


def hf_tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle] | None:
    """Translate the model's Hugging Face TP plan, or return ``None`` when it has none.

    The root's class ``_tp_plan`` merged with its instance ``_tp_plan``, completed by the most specific
    nested provider (a ``language_model`` / ``text_model`` path first, then the deepest), keys prefixed
    with its path. The input embedding is added as vocab-parallel when missing, entries naming
    parameters (fused experts' ``gate_up_proj``, attention sinks) go to their owner's style
    (``moe_tp_experts`` shards every expert, ``local_params``), and a gathered ``lm_head`` becomes a
    loss-parallel head (vocab-sharded ``DTensor`` logits). A style plait does not implement is refused,
    naming the family, the entry, the style and a way out; entries naming nothing in this instance are
    skipped. The norms of the plan's block stacks get replicated DTensor weights, and with
    ``sequence_parallel`` the plan is re-laid-out for a ``Shard(1)`` residual stream.

    Raises:
        ValueError: a style plait cannot translate, or an entry that cannot be made sequence parallel
            (both before any collective).
    """
    raw = _present(model, _collect(model))
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
        return sequence_parallel_plan(model, plan, head, embed)
    containers = layer_containers(model, plan)
    return replicated_norms(model, plan, containers, sequence_parallel=False) if containers else plan


register_tp_plan("hf", hf_tp_plan)
