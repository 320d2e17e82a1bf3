"""Dev-only: multi-rank gloo harness, fake process group, parity driver and test inputs."""

from plait.testing.fake_pg import fake_process_group
from plait.testing.harness import RankFailure, run_on_ranks
from plait.testing.models import NestedContainerModel, lm_loss, make_batch
from plait.testing.parity import (
    ParityResult,
    assert_models_close,
    clean_fqn,
    full_tensor,
    max_grad_diff,
    max_param_diff,
)

__all__ = [
    "NestedContainerModel",
    "ParityResult",
    "RankFailure",
    "assert_models_close",
    "clean_fqn",
    "fake_process_group",
    "full_tensor",
    "lm_loss",
    "make_batch",
    "max_grad_diff",
    "max_param_diff",
    "run_on_ranks",
]
