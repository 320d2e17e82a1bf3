"""Dev-only: multi-rank gloo harness, fake process group, parity helpers and tiny models."""

from plait.testing.fake_pg import fake_process_group
from plait.testing.harness import RankFailure, run_on_ranks

__all__ = ["RankFailure", "fake_process_group", "run_on_ranks"]
