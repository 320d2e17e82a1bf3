"""A model that brings its own sidecar: every overridden hook takes effect, and it still trains correctly."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.models import DecoderConfig, DenseDecoder
from plait.sidecar import ModelParallelizer, get_model_parallelizer, parallelize_model
from plait.testing import run_on_ranks
from tests.sidecar._parity import Parity, assert_parity, run_parity

VOCAB = 64
LAYERS = 4


class PairedSidecar(ModelParallelizer):
    """Two decoder layers per FSDP unit, a marking primitive, whole-layer AC and a stricter TP check."""

    def _apply_fsdp_sharding(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None,
        offload_policy: OffloadPolicy | None = None,
        **options: Any,
    ) -> None:
        layers = module.model.layers
        for i in range(0, len(layers), 2):
            self._fully_shard_module(
                [layers[i], layers[i + 1]],
                mesh=mesh,
                mp_policy=mp_policy or MixedPrecisionPolicy(),
                offload_policy=offload_policy or OffloadPolicy(),
            )

    def _fully_shard_module(self, module: nn.Module | list[nn.Module], **kwargs: Any) -> nn.Module:
        for m in module if isinstance(module, list) else [module]:
            m.sharded_by_paired_sidecar = True
        return super()._fully_shard_module(module, **kwargs)

    def _use_full_layer_activation_checkpointing(self, model: nn.Module) -> bool:
        return True

    def _validate_tp_mesh(self, model: nn.Module, tp_mesh: DeviceMesh) -> None:
        raise ValueError(f"PairedDecoder does not support tensor parallelism (tp_size={tp_mesh.size()})")


class PairedDecoder(DenseDecoder):
    """The reference decoder, owning the sidecar above."""

    parallelizer = PairedSidecar()


def _build() -> nn.Module:
    return PairedDecoder(
        DecoderConfig(
            vocab_size=VOCAB,
            num_hidden_layers=LAYERS,
            tie_word_embeddings=True,
        )
    )


def _units(model: nn.Module) -> dict[str, Any]:
    layers = list(model.model.layers)
    states = {id(layer._get_fsdp_state()) for layer in layers if isinstance(layer, FSDPModule)}
    return {
        "layer_units": len(states),
        "layers_are_fsdp": all(isinstance(layer, FSDPModule) for layer in layers),
        "marked": all(getattr(m, "sharded_by_paired_sidecar", False) for m in [model, *layers]),
        "whole_layers_checkpointed": all(isinstance(layer, CheckpointWrapper) for layer in layers),
        "submodules_checkpointed": sum(
            isinstance(m, CheckpointWrapper) for layer in layers for m in layer.modules() if m is not layer
        ),
    }


def _custom_sidecar_run() -> tuple[Parity, str]:
    ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(), activation_checkpointing=True)
    parity = run_parity("paired", _build, ctx, VOCAB, inspect=_units)
    tp_ctx = MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(tp_size=2))
    try:
        parallelize_model(_build(), tp_ctx)
        tp_error = ""
    except ValueError as exc:
        tp_error = str(exc)
    return parity, tp_error


def test_model_owned_sidecar_hooks_take_effect_and_training_matches_reference() -> None:
    assert isinstance(get_model_parallelizer(_build()), PairedSidecar)
    results = run_on_ranks(_custom_sidecar_run, 2)
    assert_parity([parity for parity, _ in results])
    for parity, tp_error in results:
        units = parity.extra
        assert units["layers_are_fsdp"] and units["layer_units"] == LAYERS // 2, units
        assert units["marked"], units
        assert units["whole_layers_checkpointed"] and units["submodules_checkpointed"] == 0, units
        assert "tp_size=2" in tp_error and "PairedDecoder" in tp_error, tp_error
