"""Training app: recipes, models, data, checkpoints and the torchrun entry point."""

__all__: list[str] = []
