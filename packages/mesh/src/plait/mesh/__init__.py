"""Mesh axis names, parallelism sizes, device meshes, MeshContext and strategy configs."""

__all__: list[str] = []
