"""Dev-only: multi-rank gloo harness, fake process group, parity helpers and tiny models."""

__all__: list[str] = []
