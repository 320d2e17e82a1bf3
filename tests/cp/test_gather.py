"""Gathered sequence mixers: which module is gathered, and the whole-sequence attention inside one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.cp.gather import WholeSequenceAttention, gather_target


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, groups=4)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = _Mixer()
        self.conv = nn.Conv1d(4, 4, 3)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer()])
        self.head_conv = nn.Conv1d(4, 4, 3)


def test_the_gathered_module_is_the_decoder_layers_child_holding_the_mixer() -> None:
    model = _Model()
    assert gather_target(model, "layers.0.mixer.conv") == "layers.0.mixer"
    assert gather_target(model, "layers.0.conv") == "layers.0.conv"  # directly in the layer: itself
    assert gather_target(model, "head_conv") is None  # no decoder layer holds it: refused


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(2, 4, 8, 8), torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8)


def test_whole_sequence_attention_keeps_only_the_top_k_keys_and_the_mask() -> None:
    """DSA hands top-k ``indices`` and the causal mask: only chosen, visible keys are attended."""
    q, k, v = _qkv()
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None].expand(2, 1, 8, 8)
    indices = torch.stack([torch.arange(8).clamp(max=s).flip(0)[:3] for s in range(8)])[None].expand(2, 8, 3)
    got = WholeSequenceAttention()(
        q, k, v, causal, is_causal=True, scale=0.3, enable_gqa=True, indices=indices
    )
    keep = torch.zeros(2, 8, 8, dtype=torch.bool).scatter(-1, indices, True)[:, None] & causal
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_whole_sequence_attention_adds_the_position_bias_inside_the_window() -> None:
    """Inkling's additive position_bias with a sliding window: eager attention's formula."""
    q, k, v = _qkv()
    bias = torch.randn(2, 4, 8, 8)
    got = WholeSequenceAttention()(
        q, k, v, is_causal=True, scale=0.3, enable_gqa=True, window=3, position_bias=bias
    )
    rows, cols = torch.arange(8)[:, None], torch.arange(8)[None, :]
    hidden = (cols > rows) | (rows - cols >= 3)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3 + bias
    want = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
