"""Dev-only: multi-rank gloo harness, fake process group, parity driver and test inputs."""

from plait.testing.driver import (
    BF16,
    FP32,
    Inputs,
    Parity,
    Tolerances,
    assert_parity,
    logits_of,
    paired,
    run_parity,
    token_batches,
)
from plait.testing.fake_pg import fake_process_group
from plait.testing.harness import RankFailure, run_on_ranks, start_forkserver
from plait.testing.hf_models import TINY_HF_SIZES, tiny_hf_config, tiny_hf_model
from plait.testing.models import NestedContainerModel, lm_loss, make_batch
from plait.testing.parity import (
    clean_fqn,
    full_tensor,
    max_grad_diff,
    max_param_diff,
)

__all__ = [
    "BF16",
    "FP32",
    "TINY_HF_SIZES",
    "Inputs",
    "Parity",
    "Tolerances",
    "assert_parity",
    "logits_of",
    "paired",
    "run_parity",
    "token_batches",
    "NestedContainerModel",
    "RankFailure",
    "clean_fqn",
    "fake_process_group",
    "full_tensor",
    "lm_loss",
    "make_batch",
    "max_grad_diff",
    "max_param_diff",
    "run_on_ranks",
    "start_forkserver",
    "tiny_hf_config",
    "tiny_hf_model",
]
