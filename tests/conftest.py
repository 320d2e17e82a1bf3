"""Shared pytest setup: the plait.testing fixtures (fake_pg) for every test package."""

import os

# Inductor compiles its C++ kernels in a pool of worker processes by default, each importing torch;
# on the 2 cores CI has, compiling in-process is about twice as fast (tests/sidecar/test_compile.py:
# 82 s against 178 s). Set before torch reads it; the rank workers and CLI subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

pytest_plugins = ["plait.testing.fixtures"]
