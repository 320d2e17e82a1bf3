"""Which sidecar `get_model_parallelizer` returns: class attribute, inherited, registry, default, errors."""

from __future__ import annotations

import pytest
from torch import nn

from plait.sidecar import ModelParallelizer, get_model_parallelizer, register_model_parallelizer


class OwnSidecar(ModelParallelizer):
    """A sidecar subclass the models below point at."""


OWN = OwnSidecar()
LAZY = OwnSidecar(layer_group_paths={"language": "blocks"})


class WithAttribute(nn.Module):
    parallelizer = OWN


class InheritsAttribute(WithAttribute):
    pass


class WithSidecarClass(nn.Module):
    parallelizer = OwnSidecar


class ByQualifiedName(nn.Module):
    pass


class ByBareName(nn.Module):
    pass


class Plain(nn.Module):
    pass


class NotASidecar:
    parallelize = "not callable"


class WithBadAttribute(nn.Module):
    parallelizer = NotASidecar()


class RegisteredBad(nn.Module):
    pass


def test_class_attribute_and_inherited_attribute() -> None:
    assert get_model_parallelizer(WithAttribute()) is OWN
    assert get_model_parallelizer(InheritsAttribute()) is OWN


def test_sidecar_class_attribute_is_instantiated() -> None:
    resolved = get_model_parallelizer(WithSidecarClass())
    assert type(resolved) is OwnSidecar


def test_registry_qualified_name_wins_over_bare_name_and_lazy_paths_import() -> None:
    other = OwnSidecar()
    register_model_parallelizer("ByQualifiedName", other)
    register_model_parallelizer(f"{__name__}.ByQualifiedName", f"{__name__}:LAZY")
    assert get_model_parallelizer(ByQualifiedName()) is LAZY
    register_model_parallelizer("ByBareName", other)
    assert get_model_parallelizer(ByBareName()) is other


class ByLazyClassPath(nn.Module):
    pass


def test_lazy_path_to_a_sidecar_class_is_instantiated_once() -> None:
    register_model_parallelizer("ByLazyClassPath", f"{__name__}:OwnSidecar")
    first = get_model_parallelizer(ByLazyClassPath())
    assert type(first) is OwnSidecar
    assert get_model_parallelizer(ByLazyClassPath()) is first


def test_registry_does_not_override_the_class_attribute() -> None:
    register_model_parallelizer("WithAttribute", OwnSidecar())
    assert get_model_parallelizer(WithAttribute()) is OWN


def test_default_is_one_shared_plain_model_parallelizer() -> None:
    first, second = get_model_parallelizer(Plain()), get_model_parallelizer(nn.Linear(2, 2))
    assert type(first) is ModelParallelizer
    assert first is second


def test_object_without_callable_parallelize_is_a_type_error_naming_object_and_class() -> None:
    with pytest.raises(TypeError, match=r"WithBadAttribute\.parallelizer.*NotASidecar"):
        get_model_parallelizer(WithBadAttribute())
    register_model_parallelizer("RegisteredBad", f"{__name__}:NotASidecar")
    with pytest.raises(TypeError, match=r"RegisteredBad.*NotASidecar"):
        get_model_parallelizer(RegisteredBad())


def test_malformed_registry_path_is_rejected_at_registration() -> None:
    with pytest.raises(ValueError, match=r"pkg\.module:ATTR"):
        register_model_parallelizer("Anything", "no_colon_here")


def test_constructor_arguments_override_class_attributes_per_instance() -> None:
    def factory(model: nn.Module, sequence_parallel: bool) -> dict:
        return {}

    class WithPlan(ModelParallelizer):
        layer_group_paths = ("model.layers",)

    custom = WithPlan(tp_plan=factory, layer_group_paths={"language": "decoder.blocks"})
    assert custom.tp_plan is factory
    assert custom.layer_group_paths == {"language": "decoder.blocks"}
    assert WithPlan().layer_group_paths == ("model.layers",)
    assert WithPlan.tp_plan is None
