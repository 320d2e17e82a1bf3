"""The training loop: distributed-correct loss, clipping, schedule, validation, checkpoints, metrics.

Loss: each optimizer step sums the token losses of all its micro-batches on all data-parallel
ranks and divides by the global count of target tokens (an all-reduce over ``dp_cp``). Data
parallelism averages gradients over its ranks, so each rank back-propagates
``local_sum * dp_cp_size / global_tokens``: the gradient is exactly that of the global token mean.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from plait.cp import DOCUMENTS_KEY, shard_sequence
from plait.float8 import precompute_float8_scales
from plait.mesh import (
    DistributedInfo,
    MeshContext,
    StrategyConfig,
    check_ranks_agree,
    describe_config,
    init_distributed,
)
from plait.pipeline import Pipeline
from plait.train.batches import GlobalSampler, PackedDataset, document_positions, synthetic_images
from plait.train.checkpoint import Checkpointer, step_dir_name
from plait.train.checks import check_vocabulary
from plait.train.config import Recipe, to_dict
from plait.train.data import Corpus, check_corpus_ids, prepare_corpus
from plait.train.errors import Stopped
from plait.train.export import export_model
from plait.train.integrity import check_finite
from plait.train.lifecycle import RankLifecycle
from plait.train.loss import IGNORE_INDEX, TokenLoss, token_loss_sum
from plait.train.metrics import MetricsLogger, flops_per_token, memory_mib, peak_tflops, throughput
from plait.train.models import hf_logits
from plait.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from plait.train.pipelining import build_pipeline
from plait.train.runlock import lock_run_dir
from plait.train.setup import build_mesh_context, build_parallel_model, check_recipe
from plait.train.summary import compile_text, describe_mesh, layout_of, model_class_name, weights_text
from plait.train.tokenizer import load_tokenizer

__all__ = ["SetupError", "Trainer", "run"]


def _scalar(t: torch.Tensor) -> float:
    return float(t.full_tensor() if isinstance(t, DTensor) else t)


class Trainer:
    """One rank's training job; :meth:`fit` runs it to the end."""

    def __init__(self, recipe: Recipe, config: StrategyConfig, info: DistributedInfo) -> None:
        self.recipe = recipe
        self.info = info
        self.device = info.device
        self.run_dir = Path(recipe.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        torch.manual_seed(recipe.train.seed)
        self.ctx: MeshContext = build_mesh_context(recipe, config)
        self.pipe: Pipeline | None = None
        if recipe.parallel.pp_size > 1:  # the local stages; self.model is their state view
            self._pp_loss_scale = 1.0
            self.pipe = build_pipeline(recipe, self.ctx, self.device, self._pipeline_loss)
            self.model = self.pipe.state_module()
        else:
            self.model = build_parallel_model(recipe, self.ctx, self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, recipe.optim)
        self.token_loss = TokenLoss(
            self.model, recipe.train.loss == "chunked", recipe.train.loss_chunk_tokens
        )
        self.scheduler = build_scheduler(self.optimizer, recipe.optim, recipe.train.steps)
        self._init_data_parallel()
        self.tokenizer = load_tokenizer(recipe.data.tokenizer, recipe.data.eos_token)
        self.corpus: Corpus = prepare_corpus(
            recipe.data,
            self.tokenizer,
            self.run_dir / "token_cache",
            local_rank=info.local_rank,
            device=self.device,
        )
        check_corpus_ids(self.corpus, check_vocabulary(recipe, self.tokenizer))
        self.sampler = GlobalSampler(
            len(self.corpus.train),
            recipe.data.micro_batch_size,
            self.dp_rank,
            self.dp_size,
            seed=recipe.train.seed,
            shuffle=recipe.data.shuffle,
        )
        self.run_lock = lock_run_dir(self.run_dir)  # before the first write: a second job stops here
        self._logger: MetricsLogger | None = None
        self.flops_per_token = flops_per_token(getattr(self.model, "module", self.model), recipe.data.seq_len)
        self.step = 0
        self.checkpointer = Checkpointer(recipe, self.ckpt_root)
        self._saved_step = -1

    @property
    def logger(self) -> MetricsLogger:
        """The metrics logger, opened (its ``run_start`` record written) on first use: after the checks."""
        if self._logger is None:
            recipe, info = self.recipe, self.info
            self._logger = MetricsLogger(
                self.run_dir / "metrics.jsonl",
                total_steps=recipe.train.steps,
                enabled=info.rank == 0,
                log_every=recipe.train.log_every,
                tensorboard_dir=self.run_dir / "tensorboard" if recipe.train.tensorboard else None,
                run_info={"name": recipe.name, "world_size": info.world_size, "device": str(self.device)},
            )
        return self._logger

    def _init_data_parallel(self) -> None:
        if self.ctx.device_mesh is None:
            self.dp_rank, self.dp_size = self.info.rank, self.info.world_size
            self.reduce_group, self.reduce_size = None, self.info.world_size
            return
        dp, dp_cp = self.ctx.dp_mesh(), self.ctx.dp_cp_mesh()
        self.dp_rank, self.dp_size = dp.get_local_rank(), dp.size()
        self.reduce_group, self.reduce_size = dp_cp.get_group(), dp_cp.size()

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        if self.reduce_size > 1:
            dist.all_reduce(value, group=self.reduce_group)
        return value

    # -- batches ------------------------------------------------------------------------------

    def _batch(self, dataset: PackedDataset, indices: list[int]) -> dict[str, torch.Tensor]:
        inputs, labels = dataset.batch(indices)
        batch = {"input_ids": inputs.to(self.device), "labels": labels.to(self.device)}
        if self.recipe.data.document_masking:  # the model (and cp) keep attention inside each document
            batch["position_ids"] = document_positions(batch["input_ids"], self.tokenizer.eos_id)
        if self.recipe.model.source == "vlm":
            vision = getattr(self.model, "module", self.model).config.vision_config  # DDP wraps as .module
            images = synthetic_images(indices, vision.num_channels, vision.image_size, self.recipe.train.seed)
            batch["pixel_values"] = images.to(self.device)
        return shard_sequence(batch, self.ctx) if self.ctx.cp_size > 1 else batch  # this cp rank's tokens

    def _logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return hf_logits(self.model(batch["input_ids"], **_model_kwargs(batch, "pixel_values")))

    @contextlib.contextmanager
    def _gradient_sync(self, enabled: bool) -> Iterator[None]:
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(enabled)
            yield
        elif not enabled and hasattr(self.model, "no_sync"):
            with self.model.no_sync():
                yield
        else:
            yield

    # -- steps --------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns its metrics."""
        start = time.perf_counter()
        cfg = self.recipe.train
        batches = [self._batch(self.corpus.train, self.sampler.next_indices()) for _ in range(cfg.grad_accum)]
        local_tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        global_tokens = float(self._all_reduce(torch.tensor([float(local_tokens)], device=self.device)))
        scale = self.reduce_size / max(global_tokens, 1.0)
        loss_sum = torch.zeros(1, device=self.device)
        for i, batch in enumerate(batches):
            if self.pipe is not None:
                loss_sum += self._pipeline_backward(batch, scale)
                continue
            with self._gradient_sync(i == len(batches) - 1):
                token_loss = self.token_loss(lambda b=batch: self._logits(b), batch["labels"], scale)
            loss_sum += _scalar(token_loss.detach())
        loss = float(self._all_reduce(loss_sum)) / max(global_tokens, 1.0)
        pp_group = self.pipe.pp_group if self.pipe is not None else None
        grad_norm = clip_grad_norm(self.params, self.recipe.optim.grad_clip, extra_group=pp_group)
        check_finite(self.step, loss, float(grad_norm))  # before the step: no NaN weights, no NaN checkpoint
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        precompute_float8_scales(self.model)  # FSDP float8 all-gather: the next step's weight scales
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        speed = throughput(
            global_tokens,
            time.perf_counter() - start,
            self.info.world_size,
            self.flops_per_token,
            peak_tflops(self.device),
        )
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": float(grad_norm),
            **speed,
            "mem_mib": memory_mib(self.device),
        }

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels) * self._pp_loss_scale

    def _pipeline_backward(self, batch: dict[str, torch.Tensor], scale: float) -> float:
        """One micro-batch through the pipeline; return its token-loss sum.

        Each pipeline microbatch back-propagates ``sum * scale * m``; the schedule divides the
        gradients by ``m``, which leaves ``sum * scale`` per microbatch, as the plain step does.
        """
        assert self.pipe is not None
        self._pp_loss_scale = scale * self.pipe.microbatches
        # under cp every stage takes the positions (and document ids) of shard_sequence
        return float(self.pipe.step(batch["input_ids"], batch["labels"], **_model_kwargs(batch))) / scale

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss over the first ``val_batches`` micro-batches of the validation split."""
        cfg, val = self.recipe, self.corpus.val
        mbs = cfg.data.micro_batch_size
        totals = torch.zeros(2, device=self.device)
        for j in range(cfg.train.val_batches):
            first = (j * self.dp_size + self.dp_rank) * mbs
            batch = self._batch(val, [(first + i) % len(val) for i in range(mbs)])
            if self.pipe is not None:
                self._pp_loss_scale = float(self.pipe.microbatches)  # evaluate's mean -> the token-loss sum
                totals[0] += float(
                    self.pipe.evaluate(batch["input_ids"], batch["labels"], **_model_kwargs(batch))
                )
                totals[1] += float((batch["labels"] != IGNORE_INDEX).sum())
                continue
            totals[0] += _scalar(self.token_loss(lambda b=batch: self._logits(b), batch["labels"], None))
            totals[1] += float((batch["labels"] != IGNORE_INDEX).sum())
        totals = self._all_reduce(totals)
        return float(totals[0] / totals[1].clamp_min(1.0))

    # -- checkpoints --------------------------------------------------------------------------

    def resume(self) -> None:
        """Restore model, optimizer, scheduler, data position and RNG from the chosen checkpoint."""
        found = self.checkpointer.find()
        if found is None:
            return
        path, manifest = found
        state = self.checkpointer.load(path, manifest, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["data"])
        self.step = self._saved_step = int(manifest["step"])
        self.logger.event("resume", step=self.step, path=str(path))

    def save(self) -> None:
        """Save a checkpoint of the current step (all ranks)."""
        state = {"data": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict()}
        path = self.checkpointer.save(self.step, self.model, self.optimizer, state)
        self._saved_step = self.step
        self.logger.event("checkpoint", step=self.step, path=str(path))

    # -- the job ------------------------------------------------------------------------------

    def _summary(self) -> str:
        layout = layout_of(self.model)
        corpus = self.corpus
        return "\n".join(
            [
                f"run {self.recipe.name} -> {self.run_dir}",
                describe_mesh(self.ctx, self.info.world_size),
                f"device {self.device} | backend {dist.get_backend()} | compile {compile_text(self.model)}",
                f"model {model_class_name(self.model)} ({self.recipe.model.source}, preset {self.recipe.model.preset})",
                weights_text(
                    self.recipe.model.pretrained_path,
                    self.recipe.train.seed,
                    self.recipe.parallel.mixed_precision,
                ),
                layout.brief(),
                f"data {self.recipe.data.source} (tokenizer {self.tokenizer.name}): {corpus.describe()}, "
                f"{len(corpus.train)} train / {len(corpus.val)} val sequences of {self.recipe.data.seq_len} tokens",
                f"global batch {self.recipe.data.micro_batch_size * self.dp_size * self.recipe.train.grad_accum} "
                f"sequences (micro {self.recipe.data.micro_batch_size} x dp {self.dp_size} x accum "
                f"{self.recipe.train.grad_accum})",
            ]
        )

    def fit(self, stop: Callable[[int], bool] | None = None) -> None:
        """Resume if asked, train to ``train.steps``, validate, checkpoint, export.

        ``stop(step)``, asked after every step on every rank, ends the job there (SIGTERM): a
        checkpoint of that step is saved and :class:`Stopped` raised. The run directory's lock is
        released however this ends.
        """
        try:
            self._fit(stop)
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def _fit(self, stop: Callable[[int], bool] | None) -> None:
        cfg, ckpt = self.recipe.train, self.recipe.checkpoint
        self.resume()  # its checks first: a refused resume writes neither recipe.yaml nor run_start
        if self.info.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "recipe.yaml").write_text(yaml.safe_dump(to_dict(self.recipe), sort_keys=False))
        self.logger.info(self._summary())
        while self.step < cfg.steps:
            self.step += 1
            self.logger.step(self.step, **self.train_step())
            if (cfg.val_every and self.step % cfg.val_every == 0) or self.step == cfg.steps:
                self.logger.validation(self.step, self.validate())
            if ckpt.every and self.step % ckpt.every == 0:
                self.save()
            if stop is not None and stop(self.step):
                self._stop()
        if self._saved_step != self.step:
            self.save()
        self.checkpointer.wait()
        if ckpt.export:
            stage = self.pipe.modules[0] if self.pipe is not None else None
            path = export_model(self.model, self.run_dir / "export", self.recipe.model, config_model=stage)
            self.logger.event("export", path=str(path))
        self.logger.close()

    def _stop(self) -> None:
        ckpt = self.recipe.checkpoint
        if not ckpt.every:
            saved = "nothing saved (checkpoint.every is 0)"
        else:
            if self.step % ckpt.every:
                self.save()
            self.checkpointer.wait()
            saved = f"checkpoint {self.ckpt_root / step_dir_name(self.step)} saved; run again to resume"
        self.logger.close()
        raise Stopped(f"stopped by SIGTERM at step {self.step} of {self.recipe.train.steps}; {saved}")


class SetupError(Exception):
    """A recipe that fails while the job is being set up (mesh, model, data), raised on every rank."""


def run(recipe: Recipe, config: StrategyConfig | None = None) -> None:
    """Train ``recipe`` on this rank (under a launcher, or alone as a world of one).

    Args:
        recipe: the job.
        config: its strategy config from :func:`check_recipe` (None = check here).

    Raises:
        SetupError: the recipe is impossible (checked before any collective where possible).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # DTensor logs a warning per multi-dim redistribute (e.g. full weights at export); keep the log readable.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    try:
        config = config if config is not None else check_recipe(recipe, world)
        backend = _backend(recipe)
    except (ValueError, TypeError) as err:
        raise SetupError(str(err)) from err
    info = init_distributed(backend=backend)
    life = RankLifecycle(info.rank, info.world_size).start()
    try:
        check_ranks_agree("the recipe", describe_config(to_dict(recipe), "recipe"))
        try:
            trainer = Trainer(recipe, config, info)
        except (ValueError, TypeError) as err:
            raise SetupError(str(err)) from err
        trainer.fit(stop=life.should_stop)
    except Exception as err:
        settled = life.settle(err)
        if settled is err:
            raise
        raise settled from err
    finally:
        life.close()
        dist.destroy_process_group()


def _backend(recipe: Recipe) -> str:
    wanted = recipe.train.device
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device 'cuda' but CUDA is not available; use train.device: auto or cpu")
    if wanted == "cpu" or not torch.cuda.is_available() or torch.cuda.device_count() < local_world:
        return "gloo"
    return "nccl"


def _model_kwargs(batch: dict[str, torch.Tensor], *extra: str) -> dict[str, torch.Tensor]:
    """The batch's forward inputs besides ``input_ids``: positions, document ids and ``extra`` keys."""
    return {k: batch[k] for k in ("position_ids", DOCUMENTS_KEY, *extra) if k in batch}
