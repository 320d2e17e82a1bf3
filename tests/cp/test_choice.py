"""``cp_attention: auto``: all_to_all when it can split the local heads and sends less (G + r < cp)."""

from __future__ import annotations

import pytest

from plait.cp import apply_context_parallel, cp_attention_choice
from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder


def _ctx(cp: int, tp: int = 1, variant: str = "auto") -> MeshContext:
    return MeshContext.build(
        FSDP2Config(mp_policy=None, cp_attention=variant), ParallelismSizes(cp_size=cp, tp_size=tp)
    )


def _decoder(heads: int, kv_heads: int) -> DenseDecoder:
    return DenseDecoder(
        DecoderConfig(
            vocab_size=64, hidden_size=8 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads
        )
    )


@pytest.mark.parametrize(
    ("heads", "kv", "cp", "tp", "variant", "why"),
    [
        (8, 8, 4, 1, "all_to_all", "G 1 + r 1 < cp 4"),  # MHA: a quarter of Q/K/V/O each way
        (8, 2, 4, 1, "all_gather", "G 4 + r 2 >= cp 4"),  # GQA 4: Q and O dominate
        (32, 8, 8, 1, "all_to_all", "G 4 + r 1 < cp 8"),  # Llama-3-8B's heads at cp 8
        (16, 2, 8, 1, "all_gather", "G 8 + r 4 >= cp 8"),  # 2 KV heads repeated 4 times
        (6, 6, 4, 1, "all_gather", "6 query heads / tp 1 do not divide by cp 4"),
        (8, 8, 2, 2, "all_gather", "G 1 + r 1 >= cp 2"),  # cp 2: all_gather sends 2, all_to_all 2
    ],
)
def test_the_rule(fake_pg, heads: int, kv: int, cp: int, tp: int, variant: str, why: str) -> None:
    with fake_pg(cp * tp):
        choice = cp_attention_choice(_decoder(heads, kv), _ctx(cp, tp))
    assert (choice.variant, why in choice.reason) == (variant, True), choice


def test_the_cp_step_uses_the_choice_and_an_explicit_variant_wins(fake_pg) -> None:
    with fake_pg(4):
        model = apply_context_parallel(_decoder(8, 8), _ctx(4))
        assert model.model.layers[0].self_attn.attention_fn.variant == "all_to_all"
        model = apply_context_parallel(_decoder(8, 8), _ctx(4, variant="ring"))
        assert model.model.layers[0].self_attn.attention_fn.variant == "ring"
        assert cp_attention_choice(_decoder(8, 8), _ctx(4, variant="ring")).reason == "set by cp_attention"
