"""Style strings map to fresh style objects with the documented layouts; unknown names are refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from plait.tp import (
    ReplicatedWithGradAllReduce,
    ReplicateParallel,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    parse_style,
)

EXPECTED = {
    "colwise": (ColwiseParallel, (Replicate(),), (Shard(-1),)),
    "rowwise": (RowwiseParallel, (Shard(-1),), (Replicate(),)),
    "colwise_rep": (ColwiseParallel, (Replicate(),), (Replicate(),)),
    "colwise_gather_output": (ColwiseParallel, (Replicate(),), (Replicate(),)),
    "rowwise_rep": (RowwiseParallel, (Replicate(),), (Replicate(),)),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_linear_style_strings_have_documented_layouts(name: str) -> None:
    cls, inputs, outputs = EXPECTED[name]
    style = parse_style(name)
    assert type(style) is cls
    assert style.input_layouts == inputs
    assert style.output_layouts == outputs


def test_special_style_strings() -> None:
    sp = parse_style("sequence_parallel")
    assert isinstance(sp, SequenceParallelNorm) and isinstance(sp, SequenceParallel)
    assert sp.sequence_sharding == (Shard(1),)
    grad_sum = parse_style("replicated_with_grad_allreduce")
    assert type(grad_sum) is ReplicatedWithGradAllReduce and grad_sum.input_layouts == Shard(-2)
    assert type(parse_style("replicate")) is ReplicateParallel
    embed = parse_style("embedding_rowwise")
    assert type(embed) is VocabParallelEmbedding
    assert (embed.input_layouts, embed.output_layouts, embed.use_local_output) == (
        Replicate(),
        Replicate(),
        True,
    )


@pytest.mark.parametrize(
    "name", [*EXPECTED, "sequence_parallel", "replicated_with_grad_allreduce", "embedding_rowwise"]
)
def test_each_call_returns_a_new_object(name: str) -> None:
    assert parse_style(name) is not parse_style(name)


@pytest.mark.parametrize("name", ["colwsie", "ROWWISE", "", "moe_tp_experts"])
def test_unknown_style_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=rf"Unknown parallel style: '{name}'"):
        parse_style(name)


def test_plait_tp_imports_neither_transformers_nor_sharding() -> None:
    code = "import sys, plait.tp; print(sorted(m for m in ('transformers', 'plait.sharding') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
