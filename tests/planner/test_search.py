"""The planner's search is fast and finds a fitting, legal layout; refusals name their reason.

Only plait-planner's own dependencies: model sizes are literal configs. Sizes against built models,
``plan --auto --write`` and the measured memory comparison are in tests/train/test_plan_auto.py.
"""

from __future__ import annotations

import time

import pytest

from plait.planner import Layout, ModelShape, cluster, refusal, search

LLAMA_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}
MOE_SMALL = {
    **LLAMA_8B,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
}
LLAMA_405B = {
    "vocab_size": 128256,
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
}
DEEPSEEK_V3 = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


@pytest.mark.parametrize(
    ("name", "config", "nodes", "limit"),
    [
        ("llama-3.1-8b", LLAMA_8B, 8, 10.0),
        ("llama-3.1-405b", LLAMA_405B, 2048, 60.0),
        ("deepseek-v3", DEEPSEEK_V3, 2048, 60.0),
    ],
)
def test_search_is_fast_and_finds_a_fitting_legal_layout(
    name: str, config: dict, nodes: int, limit: float
) -> None:
    shape = ModelShape.from_config(config)
    start = time.perf_counter()
    result = search(shape, cluster("h100", nodes=nodes), global_tokens=nodes * 8 * 8192, seq_len=8192)
    took = time.perf_counter() - start
    assert took <= limit, (name, took)
    best = result.candidates[0]
    assert best.fits and refusal(best.layout, shape) is None, best.layout
    assert best.layout.world == nodes * 8
    assert result.rejected["out of memory"] > 0  # the search does reject: memory is priced


def test_refusals_name_the_reason_and_the_combination_table() -> None:
    shape = ModelShape.from_config(LLAMA_8B)
    assert refusal(Layout(seq_len=8192, tp=64), shape).startswith("heads not divisible")
    assert refusal(Layout(seq_len=8192, ep=2, dp_shard=2), shape).startswith("ep without experts")
    moe = ModelShape.from_config(MOE_SMALL)
    float8_free = refusal(Layout(seq_len=1024, ep=2, dp_shard=2), moe)
    assert float8_free is None


def test_where_nothing_fits_on_the_gpus_cpu_offload_is_priced_and_proposed() -> None:
    """Llama-3.1-405B on one node: no layout fits its state on 8 GPUs; offloaded to the host, one does."""
    from plait.planner import GIB, estimate_memory

    shape = ModelShape.from_config(LLAMA_405B)
    machine = cluster("h200", nodes=1, host_memory_gib=1024.0)
    layout = Layout(seq_len=4096, dp_shard=8, ac="full")
    kept, offloaded = (
        estimate_memory(shape, layout),
        estimate_memory(shape, Layout(**{**vars(layout), "offload": True})),
    )
    assert offloaded.parameters == offloaded.optimizer == offloaded.gradients == 0.0
    assert offloaded.host == pytest.approx(kept.parameters + kept.optimizer + kept.gradients)
    assert offloaded.peak < kept.peak - 500 * GIB
    alone = search(shape, machine, global_tokens=8 * 4096, seq_len=4096, offload=False)
    assert not any(c.fits for c in alone.candidates) and not any(c.layout.offload for c in alone.candidates)
    found = search(shape, machine, global_tokens=8 * 4096, seq_len=4096)
    best = found.candidates[0]
    assert best.fits and best.layout.offload and best.memory.host <= machine.host_bytes, best.layout
    assert best.time is not None and best.time.host > 0  # the optimizer steps on the host
    small_host = search(shape, cluster("h200", nodes=1), global_tokens=8 * 4096, seq_len=4096)
    assert small_host.rejected["offloaded state over the host memory"] > 0
