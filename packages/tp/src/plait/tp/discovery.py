"""Find a model's parts that plans refer to: the decoder stack, the embeddings, module FQNs."""

from __future__ import annotations

from torch import nn

__all__ = [
    "family_name",
    "find_decoder",
    "language_rank",
    "model_embeddings",
    "module_fqn",
    "output_head_fqn",
]

_LANGUAGE_PARTS = ("language_model", "text_model")


def language_rank(fqn: str) -> int:
    """1 when ``fqn`` lies on a ``language_model`` / ``text_model`` path, else 0 (for preferring those)."""
    return int(any(part in _LANGUAGE_PARTS for part in fqn.split(".")))


def family_name(model: nn.Module) -> str:
    """The model's class and Hugging Face ``model_type`` (when it has one), for messages."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} (model_type {model_type!r})" if model_type else type(model).__name__


def find_decoder(model: nn.Module) -> tuple[str, nn.Module] | None:
    """Find the Llama-style decoder stack: a module with an ``embed_tokens`` embedding and ``layers``.

    Prefers a module on a ``language_model`` / ``text_model`` path, then the shallowest one.
    """
    found = [
        (fqn, module)
        for fqn, module in model.named_modules()
        if isinstance(getattr(module, "embed_tokens", None), nn.Embedding)
        and isinstance(getattr(module, "layers", None), nn.ModuleList)
    ]
    if not found:
        return None
    return max(found, key=lambda item: (language_rank(item[0]), -item[0].count(".") - bool(item[0])))


def module_fqn(model: nn.Module, target: nn.Module | None) -> str | None:
    """The FQN of ``target`` inside ``model`` (``None`` when absent or when it is the root)."""
    if target is None:
        return None
    for fqn, module in model.named_modules():
        if module is target and fqn:
            return fqn
    return None


def model_embeddings(model: nn.Module, getter: str) -> nn.Module | None:
    """``model.get_input_embeddings()`` / ``get_output_embeddings()`` when the model has them."""
    method = getattr(model, getter, None)
    try:
        found = method() if callable(method) else None
    except (AttributeError, NotImplementedError):
        return None
    return found if isinstance(found, nn.Module) else None


def output_head_fqn(model: nn.Module) -> str | None:
    """The FQN of the output head: ``get_output_embeddings()`` or an ``lm_head`` attribute, when a Linear."""
    head = model_embeddings(model, "get_output_embeddings") or getattr(model, "lm_head", None)
    return module_fqn(model, head if isinstance(head, nn.Linear) else None)
