"""A run without float8 never imports torchao (its import time, and the torch warnings it prints)."""

from __future__ import annotations

import subprocess
import sys

_BODY = """
import sys
from torch import nn
import plait.sidecar
from plait.float8 import precompute_float8_scales
precompute_float8_scales(nn.Linear(16, 16))  # the trainer calls it after every optimizer step
print(sorted(m for m in sys.modules if m.split(".")[0] == "torchao"))
"""


def test_the_flow_and_the_per_step_precompute_leave_torchao_unimported() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _BODY], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
    assert "Enum subclass" not in out.stderr, out.stderr
