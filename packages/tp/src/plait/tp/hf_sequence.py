"""Lay a translated Hugging Face TP plan out for sequence parallel, and give decoder norms replicated weights.

Works on the plan's layer containers (``model.layers``, GPT-J's ``transformer.h``, HRM's two
``*_module.layers`` stacks), found from the plan's own keys, so no family naming is assumed.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from plait.tp.discovery import family_name, find_decoder, model_embeddings, module_fqn
from plait.tp.embedding import VocabParallelEmbedding
from plait.tp.replicate import ReplicatedWithGradAllReduce, ReplicateOwnParams, ReplicateParallel
from plait.tp.sequence import SequenceParallelAllGather, SequenceParallelBlock, SequenceParallelNorm
from plait.tp.styles import RowwiseLocalCopy, loss_parallel_head

__all__ = ["layer_containers", "replicated_norms", "sequence_parallel_plan"]

_ROWWISE = (RowwiseParallel, RowwiseLocalCopy)
_SEQUENCE_READY = (ColwiseParallel, *_ROWWISE, ReplicatedWithGradAllReduce)


def layer_containers(model: nn.Module, plan: dict[str, ParallelStyle]) -> list[str]:
    """FQNs of the ``nn.ModuleList`` block stacks that the plan's keys index (``h.*.attn``, ``layers.3.mlp``).

    Falls back to the Llama-style decoder's ``layers``, else to the one stack beside the input
    embedding, when no key indexes a stack (Nemotron-H's plan without MoE layers names only
    ``embeddings``).
    """
    found: list[str] = []
    for key in plan:
        parts = key.split(".")
        for i, part in enumerate(parts[1:], start=1):
            if part != "*" and not part.isdigit():
                continue
            fqn = ".".join(parts[:i])
            try:
                stack = model.get_submodule(fqn)
            except AttributeError:
                continue
            if isinstance(stack, nn.ModuleList) and len(stack) and fqn not in found:
                found.append(fqn)
            break
    return found or _embedding_siblings(model)


def _embedding_siblings(model: nn.Module) -> list[str]:
    """The one non-empty ``nn.ModuleList`` beside the input embedding (a plan naming only the embedding)."""
    decoder = find_decoder(model)
    if decoder is not None and len(decoder[1].layers):
        return [f"{decoder[0]}.layers" if decoder[0] else "layers"]
    embed = module_fqn(model, model_embeddings(model, "get_input_embeddings"))
    if embed is None:
        return []
    parent = _parent(embed)
    owner = model.get_submodule(parent) if parent else model
    prefix = f"{parent}." if parent else ""
    stacks = [f"{prefix}{n}" for n, c in owner.named_children() if isinstance(c, nn.ModuleList) and len(c)]
    return stacks if len(stacks) == 1 else []


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _block_children(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """A layer's children, a ``nn.ModuleList`` child as its elements (LongCat-Flash's two attentions
    and two norms per layer: ``self_attn.0``, ``input_layernorm.1``), since a list is never called."""
    found = []
    for name, child in layer.named_children():
        if isinstance(child, nn.ModuleList):
            found.extend((f"{name}.{i}", element) for i, element in enumerate(child))
        else:
            found.append((name, child))
    return found


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _block(key: str, layers: str) -> str:
    return key[len(layers) :].split(".", 1)[0]


def _whole_sequence_blocks(plan: dict[str, ParallelStyle], layers: str) -> set[str]:
    """Layer children (``mlp``, ``self_attn``) that cannot take a sequence-sharded input.

    Such a block (fused experts, latent attention, local parameters, or one without a row-wise
    projection to hand back this rank's ``Shard(1)`` slice) runs on the gathered sequence.
    """
    blocks, styles = set(), {}
    for key, style in plan.items():
        if not key.startswith(layers):
            continue
        styles.setdefault(_block(key, layers), set()).add(type(style))
        if type(style) in _SEQUENCE_READY:
            continue
        if "." in key[len(layers) :] or getattr(style, "param_styles", None):  # inside, or the block's own
            blocks.add(_block(key, layers))
    # Column-wise projections without a row-wise one (Qwen3-Next's linear attention, all
    # `colwise_gather_output`) return a whole plain tensor, not this rank's Shard(1) slice.
    blocks.update(b for b, types in styles.items() if ColwiseParallel in types and not types & set(_ROWWISE))
    return blocks


def _unplanned_blocks(plan: dict[str, ParallelStyle], stack: nn.Module, container: str) -> list[str]:
    """Layer children with parameters that no plan entry reaches (AFMoE's attention, Mamba mixers), norms aside.

    Under SP their plain weights would meet the ``Shard(1)`` residual stream, so they run whole.
    """
    found = []
    for index, layer in enumerate(stack):
        for name, child in _block_children(layer):
            fqn = f"{container}.{index}.{name}"
            inner = [fqn, *(f"{fqn}.{sub}" for sub, _ in child.named_modules() if sub)]
            planned = any(fnmatchcase(f, key) for f in inner for key in plan)
            if not planned and not _is_norm(child) and any(True for _ in child.parameters()):
                found.append(fqn)
    return found


def _relayout(
    model: nn.Module, key: str, style: ParallelStyle, layers: list[str], whole: set[str]
) -> ParallelStyle:
    """One entry of the plan under SP, or a refusal naming the family, the entry and the way out."""
    inside = next((lay for lay in layers if key.startswith(lay)), None)
    if inside is not None and f"{inside}{_block(key, inside)}" in whole:
        return style  # the block runs on the whole sequence, as without SP
    if inside is not None and type(style) is ColwiseParallel:
        # Sharded or gathered output alike: a Shard(1) DTensor input (the residual stream) is
        # all-gathered by the style itself, a plain one is whole already.
        return style
    if inside is not None and type(style) in _ROWWISE:
        return RowwiseParallel(
            input_layouts=style.input_layouts[0], output_layouts=Shard(1), use_local_output=False
        )
    if inside is not None and isinstance(style, ReplicatedWithGradAllReduce):
        return style
    raise ValueError(
        f"cannot combine sequence_parallel with the Hugging Face TP plan entry {key!r} "
        f"({type(style).__name__}) of {family_name(model)}; set sequence_parallel=False or pass tp_plan="
    )


def _embedding(style: ParallelStyle) -> ParallelStyle | None:
    """The input embedding's style with a ``Shard(1)`` output (the start of the residual stream)."""
    if isinstance(style, VocabParallelEmbedding):
        return VocabParallelEmbedding(output_layouts=Shard(1), use_local_output=False)
    if type(style) is ReplicateParallel:  # a whole embedding on every rank: keep this rank's slice
        return ReplicateParallel(output_layouts=Shard(1), use_local_output=False)
    return None


def _inside_embedding(
    model: nn.Module, embed: str, plan: dict[str, ParallelStyle]
) -> dict[str, ParallelStyle]:
    """Parameterised modules inside the input embedding (Inkling's ``embed_norm``), read as sequence-sharded.

    The embedding's own forward runs around the lookup on this rank's ``Shard(1)`` rows, so their
    gradients are partial and are summed over TP.
    """
    return {
        f"{embed}.{sub}": ReplicatedWithGradAllReduce(input_dim=1)
        for sub, module in model.get_submodule(embed).named_modules()
        if sub
        and any(True for _ in module.parameters(recurse=False))
        and not any(fnmatchcase(f"{embed}.{sub}", key) for key in plan)
    }


def sequence_parallel_plan(
    model: nn.Module, plan: dict[str, ParallelStyle], head: str | None, embed: str | None
) -> dict[str, ParallelStyle]:
    """Re-lay-out a translated plan for sequence parallel (a ``Shard(1)`` residual stream between blocks).

    Raises:
        ValueError: the model has no block stack, or an entry cannot run on a sequence-sharded stream.
    """
    containers = layer_containers(model, plan)
    if not containers:
        raise ValueError(
            f"sequence_parallel with the Hugging Face TP plan of {family_name(model)} needs the plan to "
            "index a stack of blocks (an nn.ModuleList such as `layers.*`); set sequence_parallel=False or pass tp_plan="
        )
    layers = [f"{c}.*." for c in containers]
    whole = {f"{lay}{b}" for lay in layers for b in _whole_sequence_blocks(plan, lay)}
    out: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        if key == head:
            out[key] = loss_parallel_head(sequence_parallel=True)
        elif key == embed and (start := _embedding(style)) is not None:
            out[key] = start
            out.update(_inside_embedding(model, embed, plan))
        else:
            out[key] = _relayout(model, key, style, layers, whole)
    for container in containers:
        _wrap_blocks(out, plan, model.get_submodule(container), container, whole)
        out.update(_layer_own_params(out, model.get_submodule(container), container))
    norms = replicated_norms(model, out, containers, sequence_parallel=True)
    final = _final_norm(model, containers)
    if head not in out and final and isinstance(norms.get(final), SequenceParallelNorm):
        norms[final] = SequenceParallelAllGather()  # the head is not in the plan: the full sequence
    return {**norms, **_outer_modules(model, norms, containers, head)}


def _wrap_blocks(
    out: dict[str, ParallelStyle],
    plan: dict[str, ParallelStyle],
    stack: nn.Module,
    container: str,
    whole: set[str],
) -> None:
    """Whole-sequence blocks, one entry per layer, in place of their pattern entries."""
    pattern = f"{container}.*."
    for block in sorted(b[len(pattern) :] for b in whole if b.startswith(pattern)):
        # A block with its own style (attention sinks, local_params) keeps it inside the wrapper.
        # One entry per layer: fnmatch's `*` also crosses dots (`layers.*.mlp` would match AXK2's
        # `layers.0.input_layernorm.mlp`).
        for index, layer in enumerate(stack):
            for name, _ in _block_children(layer):
                if name == block or name.startswith(f"{block}."):
                    out[f"{container}.{index}.{name}"] = SequenceParallelBlock(plan.get(f"{pattern}{block}"))
        out.pop(f"{pattern}{block}", None)
    for fqn in _unplanned_blocks(out, stack, container):
        out[fqn] = SequenceParallelBlock(replicate_params=True)


def _layer_own_params(
    plan: dict[str, ParallelStyle], stack: nn.Module, container: str
) -> dict[str, ParallelStyle]:
    """Layers holding parameters of their own (Dory's residual rates ``lambda_1``), replicated.

    The layer's forward applies them to the ``Shard(1)`` stream between its children: as
    ``Replicate()`` DTensors they run through DTensor, whose rules give complete gradients.
    """
    return {
        f"{container}.{index}": ReplicateOwnParams()
        for index, layer in enumerate(stack)
        if any(True for _ in layer.parameters(recurse=False))
        and not any(fnmatchcase(f"{container}.{index}", key) for key in plan)
    }


def _covered(fqn: str, plan: dict[str, ParallelStyle]) -> bool:
    """Whether an entry of ``plan`` names ``fqn`` or one of its ancestors."""
    parts = fqn.split(".")
    return any(fnmatchcase(".".join(parts[:i]), key) for i in range(1, len(parts) + 1) for key in plan)


def _outer_modules(
    model: nn.Module, plan: dict[str, ParallelStyle], containers: list[str], head: str | None
) -> dict[str, ParallelStyle]:
    """Styles for modules outside the block stacks whose own parameters no entry reaches.

    Gemma3n's per-layer projection and HY-V4's hyper-connection head run on the ``Shard(1)``
    stream: their parameters become replicated DTensors and they run through DTensor (complete
    gradients by DTensor's own rules). A module holding planned ones (HRM's initial state on the
    decoder) only has its own parameters replicated. The head (whole input after the final norm's
    gather) stays as it is.
    """
    stacks = tuple(f"{c}." for c in containers)
    out: dict[str, ParallelStyle] = {}
    for fqn, module in model.named_modules():
        if fqn in (head, *containers) or fqn.startswith(stacks) or _covered(fqn, plan):
            continue
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        inner = any(True for child in module.children() for _ in child.parameters())
        out[fqn] = ReplicateOwnParams() if inner else ReplicateParallel(use_local_output=False)
    return out


def _final_norm(model: nn.Module, containers: list[str]) -> str | None:
    """The last norm beside the last block stack (``model.norm``, GPT-J's ``transformer.ln_f``)."""
    parent = _parent(containers[-1])
    owner = model.get_submodule(parent) if parent else model
    names = [name for name, child in owner.named_children() if _is_norm(child)]
    prefix = f"{parent}." if parent else ""
    return f"{prefix}{names[-1]}" if names else None


def replicated_norms(
    model: nn.Module, plan: dict[str, ParallelStyle], containers: list[str], *, sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """Give the norms of each block and beside each block stack replicated weights, where the plan has none.

    Sequence-parallel norms under SP, else ``ReplicateParallel``, so that every parameter is a DTensor.
    Found by class name, whatever the attribute is called (Phi's ``final_layernorm``, GPT-J's ``ln_1``).
    A block norm gets one pattern entry (``layers.*.input_layernorm``) unless that pattern would also
    match a nested module (fnmatch's ``*`` crosses dots: Nemotron-H's ``layers.*.norm`` would catch
    the Mamba mixer's own gated ``mixer.norm``); then one entry per layer.
    """
    norms: dict[str, list[str]] = {}
    for container in containers:
        for index, layer in enumerate(model.get_submodule(container)):
            for name, child in _block_children(layer):
                if _is_norm(child):
                    norms.setdefault(f"{container}.*.{name}", []).append(f"{container}.{index}.{name}")
        parent = _parent(container)
        owner = model.get_submodule(parent) if parent else model
        prefix = f"{parent}." if parent else ""
        norms.update(
            {f"{prefix}{n}": [f"{prefix}{n}"] for n, child in owner.named_children() if _is_norm(child)}
        )
    fqns = [fqn for fqn, _ in model.named_modules()]
    out = dict(plan)
    for pattern, intended in norms.items():
        todo = [fqn for fqn in intended if not any(fnmatchcase(fqn, key) for key in out)]
        exact = set(todo) == {fqn for fqn in fqns if fnmatchcase(fqn, pattern)}
        for key in [pattern] if exact else todo:
            out[key] = SequenceParallelNorm() if sequence_parallel else ReplicateParallel()
    return out
