"""Recipe dataclasses; plain YAML data maps onto them with plait.mesh's strict mapper.

A recipe is a tree of dataclasses. :func:`recipe_from_dict` maps a nested ``dict`` (as the YAML
loader returns it) onto :class:`Recipe` with :func:`plait.mesh.parsing.from_dict`, refusing unknown
keys (named, with the closest allowed key), values of the wrong type and non-finite numbers. The
defaults of :class:`Recipe` *are* the embedded default recipe that ``uv run apps/train`` trains.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from plait.mesh import MoEConfig, from_dict, normalize_strategy_name

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LaunchConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "Recipe",
    "TrainConfig",
    "recipe_from_dict",
    "to_dict",
]

ModelSource = Literal["dense", "moe", "vlm", "hf"]

_FIRST_CLASS_OPTIONS = {
    "sequence_parallel": "parallel.sequence_parallel",
    "enable_compile": "parallel.compile",
    "mp_policy": "parallel.mixed_precision",
    "float8": "parallel.float8",
}
"""Strategy-config keys that have a first-class recipe field: one spelling per setting."""


def _positive(owner: str, **values: int | float | None) -> None:
    for name, value in values.items():
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}")
        if value is not None and value <= 0:
            raise ValueError(f"{owner}.{name} must be > 0, got {value!r}")


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to train and how to build it."""

    source: ModelSource = "dense"
    """Built-in reference model (`dense`, `moe`, `vlm`) or a Hugging Face class (`hf`)."""
    preset: str = "tiny"
    """Size preset of the built-in model (dense: tiny, small, llama3-8b, llama3-70b)."""
    arch: dict[str, Any] = field(default_factory=dict)
    """Architecture fields over the preset (e.g. `num_hidden_layers: 2`); checked strictly."""
    hf_class: str | None = None
    """`transformers` class name for `source: hf`, e.g. `LlamaForCausalLM`."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the HF class's config (`source: hf`)."""
    pretrained_path: str | None = None
    """Local directory with `*.safetensors` (and `config.json` for HF) to load instead of random init."""
    meta_init: bool = True
    """Build on the meta device, parallelize, then materialise only the local shards."""
    freeze_vision: bool = True
    """VLM: keep the vision tower frozen (no gradients, no optimizer state)."""

    def __post_init__(self) -> None:
        if self.source == "hf" and not self.hf_class:
            raise ValueError("model.source 'hf' needs model.hf_class, e.g. 'LlamaForCausalLM'")
        if self.source != "hf" and (self.hf_class or self.hf_config):
            raise ValueError(
                f"model.hf_class/hf_config are only read with model.source 'hf', not {self.source!r}"
            )


@dataclass(kw_only=True)
class ParallelConfig:
    """How the model is split over the ranks."""

    strategy: str = "fsdp2"
    """`fsdp2` (also HSDP with dp_replicate_size > 1), `ddp`, or `megatron_fsdp` (the library's names and
    aliases, e.g. `megatron-fsdp`, `mfsdp`, any case; stored as the canonical name)."""
    dp_size: int | None = None
    """Data-parallel ranks; None = the ranks left after tp (and ep is carved from dp*tp)."""
    dp_replicate_size: int = 1
    """HSDP replicas (dp_replicate_size > 1 shards within and replicates across groups)."""
    tp_size: int = 2
    """Tensor-parallel ranks per model replica."""
    ep_size: int = 1
    """Expert-parallel ranks (MoE models only)."""
    moe: dict[str, Any] = field(default_factory=dict)
    """`MoEConfig` fields (ep_size > 1), e.g. `reshard_after_forward: false`, `lm_head_precision: float32`."""
    cp_size: int = 1
    """Context-parallel ranks: each sequence is split over them (fsdp2; data.seq_len a multiple of 2*cp_size)."""
    pp_size: int = 1
    """Pipeline stages (ranks along ``pp``); > 1 splits the decoder (see ``pipeline``)."""
    pipeline: dict[str, Any] = field(default_factory=dict)
    """With pp_size > 1: ``schedule``, ``microbatches``, ``stages_per_rank``, ``layers_per_stage``
    (plait.pipeline.PipelineConfig, read strictly)."""
    sequence_parallel: bool = True
    """Shard activations between blocks on the sequence dim (ignored, with a warning, when tp_size is 1)."""
    activation_checkpointing: bool | Literal["full", "selective"] = True
    """Recompute activations in backward: True/'full', 'selective', or False."""
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    """`bf16`: bf16 compute with fp32 master weights and fp32 gradient reduction."""
    compile: bool = False
    """torch.compile each transformer layer after parallelization."""
    float8: dict[str, Any] | bool | None = None
    """fsdp2: float8 linears (`plait.mesh.Float8Config` fields, e.g. `{scaling: tensorwise}`; `true` = defaults)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra strategy-config keys (e.g. `fsdp2_forward_prefetch_depth: 2`); not the first-class ones above."""

    def __post_init__(self) -> None:
        try:
            self.strategy = normalize_strategy_name(self.strategy)
        except (TypeError, ValueError) as err:
            raise ValueError(f"parallel.strategy: {err}") from None
        for key, field_name in _FIRST_CLASS_OPTIONS.items():
            if key in self.options:
                raise ValueError(
                    f"parallel.options.{key} duplicates {field_name}; set {field_name} only (one spelling per setting)"
                )
        _positive(
            "parallel",
            dp_replicate_size=self.dp_replicate_size,
            tp_size=self.tp_size,
            ep_size=self.ep_size,
            cp_size=self.cp_size,
            pp_size=self.pp_size,
        )
        if self.dp_size not in (None, -1):
            _positive("parallel", dp_size=self.dp_size)
        if self.moe:
            if self.ep_size == 1:
                raise ValueError(
                    f"parallel.moe {self.moe} is only read with parallel.ep_size > 1, got ep_size 1"
                )
            MoEConfig.from_dict(self.moe)  # unknown keys / wrong types fail here, at load


@dataclass(kw_only=True)
class DataConfig:
    """Where tokens come from and how they are batched."""

    source: Literal["stdlib", "files", "hf_datasets"] = "stdlib"
    """`stdlib`: this Python's standard-library sources; `files`: the local `paths`; `hf_datasets`: a
    local `datasets` dataset (`paths`: its data files, or a `save_to_disk` directory; extra `datasets`)."""
    paths: list[str] = field(default_factory=list)
    """Files or glob patterns (`.jsonl`/`.json`/`.parquet` read by `text_key`; others as text)."""
    text_key: str = "text"
    """JSON Lines / Parquet field (or dataset column) holding the document text."""
    streaming: bool = False
    """`hf_datasets` only: read the files lazily as an `IterableDataset` (no Arrow copy written)."""
    hf_split: str | None = None
    """`hf_datasets` with a saved `DatasetDict` only: its split to read (None = its only split, or `train`)."""
    tokenizer: str = "bytes"
    """`bytes` (ids 0-255, EOS 256), or a local `tokenizer.json` / HF model directory holding one."""
    eos_token: str | None = None
    """End-of-document token of a tokenizer file (None = its tokenizer_config.json, or a usual name)."""
    max_bytes: int | None = None
    """Stop reading the corpus after this many bytes of text (None = all of it); a cut is announced."""
    seq_len: int = 128
    """Tokens per packed training sequence."""
    micro_batch_size: int = 4
    """Sequences per data-parallel rank per micro-batch."""
    val_fraction: float = 0.02
    """Share of documents held out for validation (every k-th document)."""
    shuffle: bool = True
    """Shuffle sequences each epoch (seeded)."""
    document_masking: bool = False
    """Attention stays inside each packed document: `position_ids` restart after every EOS (HF models)."""

    def __post_init__(self) -> None:
        _positive(
            "data", max_bytes=self.max_bytes, seq_len=self.seq_len, micro_batch_size=self.micro_batch_size
        )
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction must be in (0, 0.5), got {self.val_fraction!r}")
        if self.source in ("files", "hf_datasets") and not self.paths:
            raise ValueError(f"data.source {self.source!r} needs data.paths (files or glob patterns)")
        if self.source != "hf_datasets" and (self.streaming or self.hf_split is not None):
            key = "data.streaming" if self.streaming else "data.hf_split"
            raise ValueError(
                f"{key} is only read with data.source: hf_datasets, got data.source {self.source!r}"
            )


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW, warmup + cosine schedule, gradient clipping."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr` (end of the cosine)."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to `lr`."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to 1-D parameters: norms and biases)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value (None = no clipping)."""

    def __post_init__(self) -> None:
        _positive("optim", lr=self.lr, eps=self.eps, grad_clip=self.grad_clip)
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas must have two values, got {self.betas!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps!r}")


@dataclass(kw_only=True)
class TrainConfig:
    """The loop."""

    steps: int = 200
    """Optimizer steps."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    seed: int = 0
    """Seed of weights, data order and RNG."""
    log_every: int = 10
    """Print a metrics line every N steps, and the first and last step (metrics.jsonl gets every step)."""
    val_every: int = 50
    """Validation loss every N steps (0 = only at the end)."""
    val_batches: int = 4
    """Micro-batches per validation."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: CUDA when available for every local rank, else CPU (gloo)."""
    tensorboard: bool = False
    """Also write metrics as TensorBoard events under `<run dir>/tensorboard/` (extra `tensorboard`)."""
    loss: Literal["full", "chunked"] = "full"
    """`chunked`: the head's matmul and the cross-entropy run `loss_chunk_tokens` tokens at a time (no full logits)."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of `loss: chunked` (None = 1024; its largest block: this many tokens x the local vocabulary, fp32)."""

    def __post_init__(self) -> None:
        _positive("train", steps=self.steps, grad_accum=self.grad_accum, val_batches=self.val_batches)
        _positive("train", log_every=self.log_every, loss_chunk_tokens=self.loss_chunk_tokens)
        if self.loss not in ("full", "chunked"):
            raise ValueError(f"train.loss must be 'full' or 'chunked', got {self.loss!r}")
        if self.loss_chunk_tokens is not None and self.loss != "chunked":
            raise ValueError(
                f"train.loss_chunk_tokens {self.loss_chunk_tokens} is only read with train.loss: chunked, got "
                f"train.loss {self.loss!r}"
            )
        if self.val_every < 0:
            raise ValueError(f"train.val_every must be >= 0, got {self.val_every!r}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Sharded checkpoints and the final export."""

    every: int = 100
    """Save every N steps; the final step is always saved (0 = only the final step)."""
    keep: int = 2
    """Keep the last K complete checkpoints."""
    resume: bool = True
    """Resume from the newest complete checkpoint in the run directory, if any."""
    resume_from: str | None = None
    """Resume from this checkpoint directory instead (e.g. `runs/x/checkpoints/step_00000003`)."""
    export: bool = True
    """Write the weights in the Hugging Face layout to `<run>/export/` at the end (each rank its shards)."""
    async_save: bool = False
    """Write the shards in the background (`torch.distributed.checkpoint.async_save`); finished at the next save."""

    def __post_init__(self) -> None:
        _positive("checkpoint", keep=self.keep)
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0, got {self.every!r}")


@dataclass(kw_only=True)
class LaunchConfig:
    """Local launch when not started by torchrun."""

    nproc_per_node: int = 4
    """Ranks to start on this machine."""
    max_restarts: int = 0
    """Restarts of the whole local job after a rank failure (resumes from the last checkpoint); never after a user error."""
    oversubscribe: bool = False
    """Allow more ranks than the machine runs well (one per GPU, or 4 per CPU core)."""

    def __post_init__(self) -> None:
        _positive("launch", nproc_per_node=self.nproc_per_node)
        if self.max_restarts < 0:
            raise ValueError(f"launch.max_restarts must be >= 0, got {self.max_restarts!r}")


@dataclass(kw_only=True)
class Recipe:
    """A whole training job. The defaults are the embedded default recipe."""

    name: str = "default"
    """Run name; the run directory is `out_dir`."""
    out_dir: str = "runs/{name}"
    """Run directory (metrics, checkpoints, export); `{name}` is replaced by `name`."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def __post_init__(self) -> None:
        if self.name in ("", ".", "..") or "/" in self.name or "\0" in self.name:
            raise ValueError(
                f"name {self.name!r} must be one path component (no '/', not '.', '..' or empty): it names "
                "the run directory runs/<name>; use e.g. name: my_run, and out_dir to place the run elsewhere"
            )
        if not self.out_dir.strip():
            raise ValueError(f"out_dir {self.out_dir!r} is empty; name the run directory, e.g. runs/{{name}}")

    @property
    def run_dir(self) -> str:
        """The run directory with `{name}` filled in."""
        return self.out_dir.replace("{name}", self.name)


def to_dict(obj: Any) -> dict[str, Any]:
    """A recipe (or any of its parts) as plain data, ready for YAML/JSON."""
    return dataclasses.asdict(obj)


def recipe_from_dict(data: Any) -> Recipe:
    """Map plain recipe data onto :class:`Recipe` strictly (see :func:`plait.mesh.parsing.from_dict`)."""
    return from_dict(Recipe, data, what="recipe")
