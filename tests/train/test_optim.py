"""Schedule shape (the clipping it uses is tested with the library: tests/mesh/test_grad_norm_and_init.py)."""

from __future__ import annotations

import pytest

from plait.train.optim import lr_factor


def test_warmup_then_cosine_to_the_floor():
    kw = {"warmup_steps": 4, "total_steps": 20, "min_lr_ratio": 0.1}
    assert [lr_factor(s, **kw) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_factor(4, **kw) == pytest.approx(1.0)
    assert lr_factor(12, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(20, **kw) == pytest.approx(0.1)
    assert lr_factor(0, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == pytest.approx(1.0)
