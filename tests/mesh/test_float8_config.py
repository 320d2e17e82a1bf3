"""``Float8Config`` and ``FSDP2Config.float8``: defaults, validation, YAML forms, the combination table's rules."""

from __future__ import annotations

import pytest

from plait.mesh import Float8Config, FSDP2Config, ParallelismSizes, check_combination, combination_request


def test_defaults_convert_every_eligible_linear_tensorwise() -> None:
    cfg = Float8Config()
    assert (cfg.scaling, cfg.fsdp_all_gather, cfg.include, cfg.skip, cfg.emulate) == (
        "tensorwise",
        False,
        ("*",),
        (),
        None,
    )
    assert FSDP2Config().float8 is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"scaling": "blockwise"},
            ValueError,
            r"scaling must be one of \['tensorwise', 'rowwise'\], got 'blockwise'",
        ),
        (
            {"scaling": "rowwise", "fsdp_all_gather": True},
            ValueError,
            r"set fsdp_all_gather=False or scaling",
        ),
        ({"include": []}, ValueError, r"include is empty.*use \['\*'\] or turn float8 off"),
        ({"skip": ["lm_head", " "]}, ValueError, r"skip holds an empty pattern.*remove it"),
        ({"emulate": "yes"}, TypeError, r"emulate must be"),
    ],
)
def test_nonsense_is_refused_naming_the_value_and_the_fix(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Float8Config(**kwargs)


def test_yaml_forms() -> None:
    cfg = FSDP2Config.from_dict({"float8": {"scaling": "rowwise", "skip": ["*.down_proj"]}})
    assert cfg.float8 == Float8Config(scaling="rowwise", skip=("*.down_proj",))
    assert FSDP2Config.from_dict({"float8": True}).float8 == Float8Config()
    assert FSDP2Config.from_dict({"float8": False}).float8 is None
    assert FSDP2Config.from_dict({"float8": None}).float8 is None
    with pytest.raises(ValueError, match=r"unknown key 'FSDP2Config.float8.recipe'"):
        FSDP2Config.from_dict({"float8": {"recipe": "rowwise"}})


@pytest.mark.parametrize(
    ("options", "sizes", "match"),
    [
        (
            {"sequence_parallel": True},
            {"tp_size": 2},
            r"sequence_parallel=True with float8 .* set sequence_parallel to False",
        ),
        ({}, {"cp_size": 2}, r"cp_size=2 with float8 .* is not supported: .*set cp_size to 1"),
        ({}, {"pp_size": 2}, r"pp_size=2 with float8 .* pipeline path"),
    ],
)
def test_the_table_refuses_what_no_parity_run_covers(options: dict, sizes: dict, match: str) -> None:
    cfg = FSDP2Config(float8=Float8Config(), **options)
    with pytest.raises(ValueError, match=match):
        check_combination(combination_request(cfg, ParallelismSizes(dp_size=1, **sizes)))


def test_rowwise_under_tp_is_refused_and_tensorwise_is_built() -> None:
    sizes = ParallelismSizes(dp_size=1, tp_size=2)
    rowwise = FSDP2Config(float8=Float8Config(scaling="rowwise"))
    with pytest.raises(
        ValueError, match=r"tp_size=2 with Float8Config.scaling='rowwise' .* tensorwise scale"
    ):
        check_combination(combination_request(rowwise, sizes))
    check_combination(combination_request(FSDP2Config(float8=Float8Config()), sizes))
    check_combination(combination_request(FSDP2Config(float8=Float8Config(), enable_compile=True), sizes))
    for features, match in ((["moe"], "grouped GEMMs"), (["multimodal"], "media towers")):
        with pytest.raises(ValueError, match=match):
            check_combination(
                combination_request(FSDP2Config(float8=Float8Config()), sizes, features=features)
            )
