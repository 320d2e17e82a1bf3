"""Tensor- and sequence-parallel plans, styles and validation."""

__all__: list[str] = []
