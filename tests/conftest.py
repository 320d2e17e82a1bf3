"""Shared pytest setup: the plait.testing fixtures (fake_pg) for every test package."""

import getpass
import os
import tempfile

# Inductor compiles its C++ kernels in a pool of worker processes by default, each importing torch;
# on the 2 cores CI has, compiling in-process is about twice as fast (tests/sidecar/test_compile.py:
# 82 s against 178 s). Set before torch reads it; the rank workers and CLI subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Under ATEN_CPU_CAPABILITY inductor picks its vector ISA from that variable, but its cache key does not
# hold the ISA (torch 2.15): a kernel cached by a native (avx2) run is then built without the vector
# headers and fails ("'at::vec' has not been declared"). One cache per capability keeps them apart.
if capability := os.environ.get("ATEN_CPU_CAPABILITY"):
    default_dir = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{capability}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_dir)

pytest_plugins = ["plait.testing.fixtures"]
