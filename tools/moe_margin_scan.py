"""Scan init seeds of the reference MoE decoder for a clear router top-k margin over a parity run.

The MoE parity tests in tests/sidecar/test_moe.py assert that every token's k-th router logit stays
``MIN_MARGIN`` (relative) above its (k+1)-th through all steps they compare; this finds seeds that do.
Usage: ``uv run python tools/moe_margin_scan.py FIRST_SEED LAST_SEED [DP]`` (prints JSON per config; DP is
the number of data-parallel rows of the global batch, 4 unless given: 2 for dp_shard 2 x cp 2).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from plait.models import MoEDecoder, MoEDecoderConfig
from plait.testing import ADAMW_LR, MIN_MARGIN, SGD_LR, global_batch, logits_of, record_routing_margins

CONFIGS = {
    "skewed": MoEDecoderConfig(vocab_size=64, num_experts=8, zero_token_experts=(1, 2, 6)),
    "one_local": MoEDecoderConfig(vocab_size=64, num_experts=2, num_experts_per_tok=1, norm_topk_prob=False),
    "ac": MoEDecoderConfig(vocab_size=64, num_experts=8, zero_token_experts=(1, 6)),
}


def smallest_margin(cfg: MoEDecoderConfig, seed: int, dp: int = 4) -> float:
    """The reference's smallest relative margin over the parity driver's 6 steps (2 SGD, 3 AdamW)."""
    torch.manual_seed(seed)
    model = MoEDecoder(cfg)
    margins = record_routing_margins(model)

    def step(s: int) -> None:
        batch = global_batch(cfg.vocab_size, dp, s)
        logits = logits_of(model(batch["input_ids"]))
        F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).backward()

    sgd = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    for s in (0, 1):
        step(s)
        sgd.step()
        sgd.zero_grad()
    adamw = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    for s in range(3, 6):
        step(s)
        adamw.step()
        adamw.zero_grad()
    return margins.smallest


def main() -> None:
    first, last = int(sys.argv[1]), int(sys.argv[2])
    dp = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    for name, cfg in CONFIGS.items():
        good = {s: m for s in range(first, last) if (m := smallest_margin(cfg, s, dp)) >= MIN_MARGIN}
        print(json.dumps({"config": name, "seeds_with_margin": good}))


if __name__ == "__main__":
    main()
