"""ModelParallelizer sidecars, resolution, dispatch and compile: parallelize_model."""

__all__: list[str] = []
