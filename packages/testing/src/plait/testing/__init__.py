"""Dev-only: multi-rank gloo harness, fake process group, parity driver, test inputs and configs.

The case bodies of :mod:`plait.testing.hf_moe`, :mod:`plait.testing.pipeline_cases`,
:mod:`plait.testing.combination_cases` and
:mod:`plait.testing.cp_cases` need runtime packages plait-testing does not declare (plait-sidecar,
plait-pipeline, plait-cp): their names are listed here but load on first use, so the package
imports with its own dependencies alone.
"""

from __future__ import annotations

import importlib
from typing import Any

from plait.testing.driver import (
    ADAMW_LR,
    SGD_LR,
    STEPS,
    Inputs,
    logits_of,
    paired,
    run_parity,
    token_batches,
)
from plait.testing.fake_pg import fake_process_group
from plait.testing.harness import RankFailure, run_on_ranks, start_forkserver
from plait.testing.hf_models import (
    HF_MOE_FAMILIES,
    HF_MOE_SIZES,
    NAMED_HF_CONFIGS,
    TINY_HF_SIZES,
    TP_FAMILY_HF_SIZES,
    TP_TRANSLATION_HF_SIZES,
    hf_moe_config,
    named_hf_config,
    tiny_hf_config,
    tiny_hf_model,
    tp_hf_config,
)
from plait.testing.hf_sweep_configs import (
    SWEEP_HF_HEADS,
    SWEEP_HF_OVERRIDES,
    SWEEP_HF_SIZES,
    sweep_hf_config,
    sweep_hf_families,
)
from plait.testing.models import (
    GLOBAL_BATCH_ROWS_PER_RANK,
    GLOBAL_BATCH_SEQ,
    NestedContainerModel,
    global_batch,
    lm_loss,
    local_slice,
    make_batch,
)
from plait.testing.parity import (
    clean_fqn,
    full_tensor,
    max_grad_diff,
    max_param_diff,
)
from plait.testing.routing import MIN_MARGIN, Margins, record_routing_margins
from plait.testing.sweep import case_row, merge_rows, run_cases
from plait.testing.tolerances import BF16, FP32, Parity, Tolerances, assert_parity

_LAZY = {
    "plait.testing.combination_cases": (
        "COMBINATION_AXES",
        "COMBINATION_MODELS",
        "combination_parity",
        "combination_sizes",
        "combination_world",
    ),
    "plait.testing.cp_cases": (
        "CP_SEQ",
        "CP_VOCAB",
        "PACKED_DOCUMENTS",
        "cp_decoder",
        "cp_local_inputs",
        "cp_parity",
        "packed_positions",
        "packed_positions",
    ),
    "plait.testing.hf_moe": (
        "HF_MOE_LAYOUTS",
        "HF_MOE_SEEDS",
        "HFMoEResult",
        "expert_bytes",
        "hf_moe_available",
        "hf_moe_cases",
        "hf_moe_model",
        "hf_moe_parity",
        "hf_moe_reference_margin",
    ),
    "plait.testing.memory_probe": ("measure_step", "run_layout"),
    "plait.testing.pipeline_cases": ("PIPELINE_VOCAB", "pipeline_decoder", "pipeline_parity"),
}
_LAZY_MODULE = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    """Load a case body's module on first use of one of its names."""
    module = _LAZY_MODULE.get(name)
    if module is None:
        raise AttributeError(f"module 'plait.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "ADAMW_LR",
    "measure_step",
    "run_layout",
    "BF16",
    "COMBINATION_AXES",
    "COMBINATION_MODELS",
    "CP_SEQ",
    "CP_VOCAB",
    "FP32",
    "GLOBAL_BATCH_ROWS_PER_RANK",
    "GLOBAL_BATCH_SEQ",
    "HFMoEResult",
    "HF_MOE_FAMILIES",
    "HF_MOE_LAYOUTS",
    "HF_MOE_SEEDS",
    "HF_MOE_SIZES",
    "Inputs",
    "MIN_MARGIN",
    "PACKED_DOCUMENTS",
    "Margins",
    "NAMED_HF_CONFIGS",
    "NestedContainerModel",
    "PIPELINE_VOCAB",
    "Parity",
    "RankFailure",
    "SGD_LR",
    "STEPS",
    "SWEEP_HF_HEADS",
    "SWEEP_HF_OVERRIDES",
    "SWEEP_HF_SIZES",
    "TINY_HF_SIZES",
    "TP_FAMILY_HF_SIZES",
    "TP_TRANSLATION_HF_SIZES",
    "Tolerances",
    "assert_parity",
    "case_row",
    "clean_fqn",
    "combination_parity",
    "combination_sizes",
    "combination_world",
    "cp_decoder",
    "cp_local_inputs",
    "cp_parity",
    "expert_bytes",
    "fake_process_group",
    "full_tensor",
    "global_batch",
    "hf_moe_available",
    "hf_moe_cases",
    "hf_moe_config",
    "hf_moe_model",
    "hf_moe_parity",
    "hf_moe_reference_margin",
    "lm_loss",
    "local_slice",
    "logits_of",
    "make_batch",
    "max_grad_diff",
    "max_param_diff",
    "merge_rows",
    "named_hf_config",
    "paired",
    "pipeline_decoder",
    "pipeline_parity",
    "record_routing_margins",
    "run_cases",
    "run_on_ranks",
    "run_parity",
    "start_forkserver",
    "sweep_hf_config",
    "sweep_hf_families",
    "tiny_hf_config",
    "tiny_hf_model",
    "token_batches",
    "tp_hf_config",
]
