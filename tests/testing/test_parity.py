"""Parity helpers: name cleaning, DTensor gathering, and differences that point at the culprit."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from plait.models import DecoderConfig, DenseDecoder
from plait.testing import (
    clean_fqn,
    full_tensor,
    lm_loss,
    make_batch,
    max_grad_diff,
    max_param_diff,
    run_on_ranks,
)


def _pair() -> tuple[DenseDecoder, DenseDecoder]:
    torch.manual_seed(0)
    ref = DenseDecoder(DecoderConfig())
    par = copy.deepcopy(ref)
    ids, labels = make_batch(128, 2, 8, seed=1)
    for model in (ref, par):
        lm_loss(model(ids), labels).backward()
    return ref, par


def test_clean_fqn_strips_wrappers_and_optionally_ddp():
    name = (
        "module._orig_mod.model.layers.0._checkpoint_wrapped_module._fsdp_wrapped_module.mlp.up_proj.weight"
    )
    assert clean_fqn(name) == "module.model.layers.0.mlp.up_proj.weight"
    assert clean_fqn(name, strip_ddp=True) == "model.layers.0.mlp.up_proj.weight"
    assert clean_fqn("modules.x", strip_ddp=True) == "modules.x"


def test_identical_models_have_zero_difference():
    ref, par = _pair()
    assert max_grad_diff(ref, par)[0] == 0.0
    assert max_param_diff(ref, par)[0] == 0.0
    assert max_grad_diff(ref, par, relative=True)[0] == 0.0


def test_a_perturbed_parameter_and_gradient_are_found_by_name():
    ref, par = _pair()
    target = par.model.layers[1].mlp.down_proj
    with torch.no_grad():
        target.weight[0, 0] += 0.5
    target.weight.grad[1, 2] -= 0.25
    assert max_param_diff(ref, par) == (pytest.approx(0.5), "model.layers.1.mlp.down_proj.weight")
    assert max_grad_diff(ref, par) == (pytest.approx(0.25), "model.layers.1.mlp.down_proj.weight")
    scale = ref.model.layers[1].mlp.down_proj.weight.grad.abs().max().item()
    rel, name = max_grad_diff(ref, par, relative=True)
    assert name == "model.layers.1.mlp.down_proj.weight" and rel == pytest.approx(0.25 / scale)


def test_wrapped_parameter_names_match_the_reference():
    ref, par = _pair()
    par.model.layers[0] = checkpoint_wrapper(par.model.layers[0])
    wrapper = nn.Module()
    wrapper.module = par
    assert max_grad_diff(ref, wrapper, strip_ddp=True)[0] == 0.0


def test_subset_compares_only_the_parameters_the_parallel_side_holds():
    ref, par = _pair()
    del par.lm_head  # a pipeline rank without the last stage
    assert max_grad_diff(ref, par, subset=True)[0] == 0.0
    par.model.layers[1].mlp.down_proj.weight.grad[0, 0] += 0.5
    assert max_grad_diff(ref, par, subset=True)[1] == "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(AssertionError, match=r"missing in the parallel model \['lm_head\.weight'\]"):
        max_param_diff(ref, par)
    par.extra = nn.Linear(2, 2)
    with pytest.raises(
        AssertionError, match=r"only in the parallel model \['extra\.bias', 'extra\.weight'\]"
    ):
        max_param_diff(ref, par, subset=True)


def test_mismatched_names_and_one_sided_none_grads_fail_loudly():
    ref, par = _pair()
    untied = DenseDecoder(DecoderConfig(tie_word_embeddings=True))
    with pytest.raises(AssertionError, match=r"lm_head\.weight"):
        max_param_diff(ref, untied)
    par.model.norm.weight.grad = None
    with pytest.raises(
        AssertionError, match=r"model\.norm\.weight: gradient is None in the parallel model only"
    ):
        max_grad_diff(ref, par)


def test_nan_is_the_worst_difference_and_unmeasured_results_never_pass():
    ref, par = _pair()
    par.lm_head.weight.grad[0, 0] = math.nan
    diff, name = max_grad_diff(ref, par)
    assert math.isnan(diff) and name == "lm_head.weight"


def _sharded_grads_and_loss_parallel() -> tuple[float, float, float]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref, par = _pair()
    for p in par.parameters():
        p.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
    grad_diff = max_grad_diff(ref, par)[0]
    ids, labels = make_batch(128, 2, 8, seed=1)
    logits = ref(ids).detach().requires_grad_()
    plain = lm_loss(logits, labels)
    sharded = distribute_tensor(logits.detach(), mesh, [Shard(2)]).requires_grad_()
    with torch.distributed.tensor.parallel.loss_parallel():
        loss = lm_loss(sharded, labels)
        loss.backward()
    plain.backward()
    return (
        grad_diff,
        abs(full_tensor(loss).item() - plain.item()),
        (full_tensor(sharded.grad) - logits.grad).abs().max().item(),
    )


def test_dtensor_grads_are_gathered_and_lm_loss_works_under_loss_parallel():
    for grad_diff, loss_diff, logit_grad_diff in run_on_ranks(_sharded_grads_and_loss_parallel, 2):
        assert grad_diff == 0.0
        assert loss_diff < 1e-6 and logit_grad_diff < 1e-6
