"""The combination table, generated: every entry is built (a named parity test covers it) or refused.

Entries are every pair of axes, strategies and techniques a request can hold (``table_pairs()``) and
every triple a rule names. An entry is *refused* when ``refusal_of`` answers for a request holding it
(one line naming the settings and a fix, needing no process group, so every rank raises it before
any collective), and *built* when ``BUILT_BY`` names the parity test that covers it: a multi-rank
test comparing the loss and every parameter's gradient with the unsharded single-process reference
(fp32, 1e-5 relative to the largest reference gradient). No entry may be both, none may be neither.

Only plait.mesh is imported (tests/mesh runs with plait-mesh alone); the named tests are checked by
parsing their files.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from plait.mesh import DDPConfig, Float8Config, FSDP2Config, MegatronFSDPConfig, ParallelismSizes
from plait.mesh.combinations import (
    COMBINATION_RULES,
    STRATEGIES,
    CombinationRequest,
    CombinationRule,
    combination_request,
    refusal_of,
    table_pairs,
)

ROOT = Path(__file__).resolve().parents[2]

DENSE = "tests/sidecar/test_dense_parity.py::test_parallelize_model_matches_unsharded_reference[dense]"
"""4 ranks, plait's decoder: fsdp (dp_shard 4), hsdp (2 x 2), fsdp_tp, fsdp_tp_sp, fsdp_tp_ac (full)."""
CP = "tests/sidecar/test_cp_parity.py::test_cp4_and_with_fsdp_tp_sp_ac"
"""4 ranks: cp 4; dp_shard 2 x cp 2; cp 2 x tp 2 + sp; cp 2 x tp 2 + full AC."""
EP = "tests/sidecar/test_moe.py::test_expert_parallel_in_the_fsdp2_flow_matches_reference"
"""4 ranks, plait's MoE decoder: ep 2 and ep 4 over dp_shard 4, ep 2 x tp 2."""
EP_AC = "tests/sidecar/test_moe.py::test_fsdp_options_moe_options_and_sidecar_hooks_apply_to_moe_models"
"""4 ranks: ep 2 with full AC (the "sidecar + full AC" case)."""
PP = "tests/pipeline/test_parity.py::test_two_stages_with_fsdp_and_with_tp_on_four_ranks"
"""4 ranks: pp 2 x dp_shard 2 (FSDP2), pp 2 x tp 2."""
DDP = "tests/sidecar/test_ddp.py::test_ddp_matches_reference"
"""DDP through parallelize_model: world 2 with full AC, world 4 with selective AC and without."""
MEGATRON = "tests/strategies/test_megatron.py::test_megatron_fsdp_trains_like_the_reference_on_gpus"
"""2 CUDA ranks, dp 2, no TP or AC (skipped on CPU, with the reason); compares the losses of 2 SGD steps."""
NEW = "tests/sidecar/test_combination_parity.py::test_combination_matches_reference"
COMPILED = "tests/sidecar/test_combination_parity.py::test_compiled_combination_matches_reference"
PP_NEW = "tests/pipeline/test_combination_parity.py::test_pipeline_combination_matches_reference"
F8_2 = "tests/float8/test_parity.py::test_float8_parity_on_two_ranks"
"""2 ranks, float8 (emulated): dp_shard 2 (tensorwise, rowwise, float8 all-gather), tp 2, tp 2 + selective AC."""
F8_4 = "tests/float8/test_parity.py::test_float8_parity_on_four_ranks"
"""4 ranks, float8 (emulated): dp_shard 2 x tp 2, HSDP 2 x 2 + full AC."""
F8_COMPILED = "tests/float8/test_compile.py::test_compiled_float8_layers_with_full_ac_match_eager_float8"
"""2 ranks, float8 (emulated): dp_shard 2 + full AC + per-layer compile against the same model eager."""


def _(*items: str) -> frozenset[str]:
    return frozenset(items)


BUILT_BY: dict[frozenset[str], str] = {
    # FSDP2 / HSDP, tensor and sequence parallel
    _("dp_shard", "fsdp2"): DENSE,
    _("dp_replicate", "dp_shard"): DENSE,
    _("dp_replicate", "fsdp2"): DENSE,
    _("tp", "fsdp2"): DENSE,
    _("tp", "dp_shard"): DENSE,
    _("sp", "tp"): DENSE,
    _("sp", "fsdp2"): DENSE,
    _("sp", "dp_shard"): DENSE,
    _("dp_replicate", "tp"): f"{NEW}[hsdp_tp_sp]",
    _("dp_replicate", "sp"): f"{NEW}[hsdp_tp_sp]",
    # activation checkpointing
    _("ac_full", "fsdp2"): DENSE,
    _("ac_full", "dp_shard"): DENSE,
    _("ac_full", "tp"): DENSE,
    _("ac_full", "dp_replicate"): f"{NEW}[hsdp_ac_full]",
    _("ac_full", "sp"): f"{NEW}[tp_sp_ac_full]",
    _("ac_selective", "fsdp2"): f"{NEW}[hsdp_ac_selective]",
    _("ac_selective", "dp_shard"): f"{NEW}[hsdp_ac_selective]",
    _("ac_selective", "dp_replicate"): f"{NEW}[hsdp_ac_selective]",
    _("ac_selective", "tp"): f"{NEW}[tp_ac_selective]",
    _("ac_selective", "sp"): f"{NEW}[tp_sp_ac_selective]",
    # context parallel
    _("cp", "fsdp2"): CP,
    _("cp", "dp_shard"): CP,
    _("cp", "tp"): CP,
    _("cp", "sp"): CP,
    _("ac_full", "cp"): CP,
    _("ac_selective", "cp"): f"{NEW}[cp_ac_selective]",
    _("cp", "dp_replicate"): f"{NEW}[hsdp_cp]",
    # expert parallel
    _("ep", "fsdp2"): EP,
    _("ep", "dp_shard"): EP,
    _("ep", "tp"): EP,
    _("ac_full", "ep"): EP_AC,
    _("ac_selective", "ep"): f"{NEW}[ep_ac_selective]",
    _("dp_replicate", "ep"): f"{NEW}[hsdp_ep]",
    _("cp", "ep"): f"{NEW}[cp_ep]",
    _("ep", "sp"): f"{NEW}[ep_sp]",
    # per-layer compile (tools/test runs compile_tp_sp_ac_selective; the other compiled cases are marked
    # slow, for tools/slow_tests: inductor's build time)
    _("compile", "fsdp2"): f"{COMPILED}[compile_tp_sp_ac_selective]",
    _("compile", "dp_shard"): f"{COMPILED}[compile_tp_sp_ac_selective]",
    _("compile", "tp"): f"{COMPILED}[compile_tp_sp_ac_selective]",
    _("compile", "sp"): f"{COMPILED}[compile_tp_sp_ac_selective]",
    _("ac_selective", "compile"): f"{COMPILED}[compile_tp_sp_ac_selective]",
    _("ac_full", "compile"): f"{COMPILED}[compile_hsdp_ac_full]",
    _("compile", "dp_replicate"): f"{COMPILED}[compile_hsdp_ac_full]",
    _("compile", "cp"): f"{COMPILED}[compile_cp]",
    _("compile", "ep"): f"{COMPILED}[compile_ep]",
    # pipeline parallel
    _("fsdp2", "pp"): PP,
    _("dp_shard", "pp"): PP,
    _("pp", "tp"): PP,
    _("ac_full", "pp"): f"{PP_NEW}[pp_ac_full]",
    _("ac_selective", "pp"): f"{PP_NEW}[pp_ac_selective]",
    _("ep", "pp"): f"{PP_NEW}[pp_ep]",
    _("compile", "pp"): f"{PP_NEW}[pp_compile]",
    _("dp_replicate", "pp"): f"{PP_NEW}[pp_hsdp]",
    _("cp", "pp"): f"{PP_NEW}[pp_cp]",
    _("pp", "sp"): f"{PP_NEW}[pp_sp]",
    _("ac_full", "ep", "pp"): f"{PP_NEW}[pp_ep_ac_full]",
    _("ac_selective", "ep", "pp"): f"{PP_NEW}[pp_ep_ac_selective]",
    # DDP
    _("ddp", "dp_shard"): f"{DDP}[4-False]",
    _("ac_full", "ddp"): f"{DDP}[2-full]",
    _("ac_selective", "ddp"): f"{DDP}[4-selective]",
    # float8 (torchao, emulated on CPU)
    _("float8", "fsdp2"): F8_2,
    _("dp_shard", "float8"): F8_2,
    _("float8", "tp"): F8_2,
    _("ac_selective", "float8"): F8_2,
    _("dp_replicate", "float8"): F8_4,
    _("ac_full", "float8"): F8_4,
    _("compile", "float8"): F8_COMPILED,
    # Megatron-FSDP (CUDA only: these skip on CPU with the reason)
    _("dp_shard", "megatron_fsdp"): MEGATRON,
}
"""Each built entry and the parity test (pytest node id) that exercises it."""


def entries() -> list[frozenset[str]]:
    """What the table must answer for: every pair, and every triple a rule or a parity test names."""
    triples = [rule.items for rule in COMBINATION_RULES if len(rule.items) == 3]
    triples += [items for items in BUILT_BY if len(items) == 3]
    return [*table_pairs(), *dict.fromkeys(triples)]


def _label(items: Iterable[str]) -> str:
    return " x ".join(sorted(items))


_CONFIGS = {"fsdp2": FSDP2Config, "ddp": DDPConfig, "megatron_fsdp": MegatronFSDPConfig}


def request_for(items: frozenset[str]) -> CombinationRequest:
    """The request of a job asking for ``items``: each axis of size 2 (sp, async TP on tp 2), FSDP2 by default.

    Built by ``combination_request`` from real configs and sizes; an item the configs cannot state
    (DDP has no ``sequence_parallel``, neither DDP nor Megatron-FSDP an ``enable_compile``, Megatron-FSDP
    refuses ``sequence_parallel=True`` itself) is added under its own name.
    """
    strategy = next((s for s in STRATEGIES if s in items), "fsdp2")
    options: dict[str, Any] = {}
    if strategy == "fsdp2":
        options = {
            "sequence_parallel": bool(items & {"sp", "async_tp"}),  # async TP needs sequence parallel
            "enable_async_tensor_parallel": "async_tp" in items,
            "enable_compile": "compile" in items,
            "float8": _float8(items),
        }
    two = {axis: 2 if axis in items else 1 for axis in ("dp_replicate", "cp", "tp", "ep", "pp")}
    if items & {"sp", "async_tp"}:
        two["tp"] = 2
    # FSDP2 refuses pure replication: HSDP shards over 2 ranks as well.
    shard = 2 if "dp_shard" in items or (strategy == "fsdp2" and "dp_replicate" in items) else 1
    sizes = ParallelismSizes(
        dp_size=two["dp_replicate"] * shard,
        dp_replicate_size=two["dp_replicate"],
        tp_size=two["tp"],
        cp_size=two["cp"],
        ep_size=two["ep"],
        pp_size=two["pp"],
    )
    ac = next((item[len("ac_") :] for item in ("ac_full", "ac_selective") if item in items), False)
    features = items & {"moe", "multimodal"}
    request = combination_request(
        _CONFIGS[strategy](**options), sizes, activation_checkpointing=ac, features=sorted(features)
    )
    missing = items - request.items
    return CombinationRequest(request.items | missing, request.values | {item: item for item in missing})


def _float8(items: frozenset[str]) -> Float8Config | None:
    if "float8_rowwise" in items:
        return Float8Config(scaling="rowwise")
    return Float8Config() if "float8" in items else None


def _fired(request: CombinationRequest) -> CombinationRule:
    return next(rule for rule in COMBINATION_RULES if rule.items <= request.items)


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized()  # the table is answered before any process group exists


def test_requests_hold_what_they_ask_for() -> None:
    """The requests below are real ones: each holds its entry, and adds only what the entry implies."""
    for items in [*entries(), *(rule.items for rule in COMBINATION_RULES)]:
        extra = request_for(items).items - items
        assert extra <= {"fsdp2", "dp_shard", "tp", "sp", "float8"}, (_label(items), extra)


@pytest.mark.parametrize("items", entries(), ids=_label)
def test_every_entry_is_built_or_refused(items: frozenset[str]) -> None:
    refusal = refusal_of(request_for(items))
    built = BUILT_BY.get(items)
    assert not (refusal and built), f"{_label(items)} is refused ({refusal!r}) and listed as built by {built}"
    assert refusal or built, f"{_label(items)} is neither refused by the table nor covered by a parity test"


def test_built_by_lists_only_table_entries() -> None:
    stale = set(BUILT_BY) - set(entries())
    assert not stale, f"BUILT_BY lists what the table does not hold: {sorted(map(_label, stale))}"


# -- the named parity tests exist ------------------------------------------------------------------


def _literal(node: ast.expr, module: ast.Module) -> list[Any] | None:
    """The parameter values of a parametrize call's argvalues, when they can be read statically.

    Literals; ``NAME`` or ``list(NAME)`` for a module-level dict (its constant keys) or list/tuple.
    """
    try:
        return list(ast.literal_eval(node))
    except ValueError:
        pass
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "list":
        node = node.args[0]
    if not isinstance(node, ast.Name):
        return None
    for stmt in module.body:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == node.id for t in targets):
            if isinstance(value, ast.Dict) and all(isinstance(k, ast.Constant) for k in value.keys):
                return [k.value for k in value.keys]  # type: ignore[union-attr]
            return None if isinstance(value, ast.Name) else _literal(value, module)
    return None


def _param_id(value: Any) -> str:
    """pytest's default id of one parameter set: scalars as ``str``, tuples joined by ``-``."""
    if isinstance(value, tuple):
        return "-".join(_param_id(v) for v in value)
    return str(value)


def _ids(decorator: ast.Call, module: ast.Module) -> list[str] | None:
    """The ids one ``pytest.mark.parametrize`` decorator gives, or None if they cannot be read."""
    ids = next((kw.value for kw in decorator.keywords if kw.arg == "ids"), None)
    if ids is not None:
        values = _literal(ids, module)
        return [str(v) for v in values] if values is not None else None
    values = _literal(decorator.args[1], module) if len(decorator.args) > 1 else None
    return [_param_id(v) for v in values] if values is not None else None


def _parametrize_ids(fn: ast.FunctionDef, module: ast.Module) -> list[str] | None:
    """Every id of a parametrized test (stacked decorators: the innermost first), None if unreadable."""
    per_decorator = []
    for decorator in reversed(fn.decorator_list):
        if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("mark.parametrize"):
            ids = _ids(decorator, module)
            if ids is None:
                return None
            per_decorator.append(ids)
    return ["-".join(parts) for parts in itertools.product(*per_decorator)] if per_decorator else []


@pytest.mark.parametrize("node_id", sorted(set(BUILT_BY.values())))
def test_each_named_parity_test_exists(node_id: str) -> None:
    path, _, name = node_id.partition("::")
    function, _, param = name.partition("[")
    file = ROOT / path
    assert file.is_file(), f"{node_id}: no file {path}"
    module = ast.parse(file.read_text(), filename=str(file))
    fn = next((f for f in module.body if isinstance(f, ast.FunctionDef) and f.name == function), None)
    assert fn is not None, f"{node_id}: {path} has no test function {function}"
    ids = _parametrize_ids(fn, module)
    if param:
        assert ids != [], f"{node_id}: {function} is not parametrized"
        assert ids is None or param[:-1] in ids, f"{node_id}: no parameter id {param[:-1]!r} in {ids}"


# -- every refusal is one line naming the settings and a fix ---------------------------------------


@pytest.mark.parametrize("rule", COMBINATION_RULES, ids=lambda rule: _label(rule.items))
def test_each_refusal_is_one_line_naming_the_settings_and_a_fix(rule: CombinationRule) -> None:
    request = request_for(rule.items)
    message = refusal_of(request)
    assert message is not None, f"a request holding {_label(rule.items)} is not refused"
    fired = _fired(request)
    assert "\n" not in message and message.strip() == message, message
    assert all(request.describe(item) in message for item in fired.items), (message, request.values)
    fix = message.rpartition(";")[2]
    assert any(verb in fix.split() for verb in ("set", "use", "turn")), f"no fix in {message!r}"


# -- the table in docs/support.md is this one ------------------------------------------------------

_DOC_BEGIN = "<!-- combination table: generated by tests/mesh/test_combination_table.py -->"
_DOC_END = "<!-- end of the combination table -->"


def render_table() -> str:
    """Every entry as a markdown row: built (the parity test that covers it) or refused (the reason)."""
    rows = ["| combination | status | covered by, or why not |", "| --- | --- | --- |"]
    for items in sorted(entries(), key=_label):
        request = request_for(items)
        if refusal_of(request) is not None:
            rule = _fired(request)
            rows.append(f"| {_label(items)} | refused | {rule.reason}; {rule.fix} |")
        else:
            test = BUILT_BY.get(items, "none: test_every_entry_is_built_or_refused fails")
            rows.append(f"| {_label(items)} | parity | `{test}` |")
    return "\n".join(rows)


def test_the_docs_hold_the_generated_table() -> None:
    """``PLAIT_WRITE_DOCS=1`` rewrites the block in docs/support.md after a change to the table."""
    import os

    doc = ROOT / "docs/support.md"
    text = doc.read_text()
    assert _DOC_BEGIN in text and _DOC_END in text, f"{doc} lacks the generated block's markers"
    head, _, rest = text.partition(_DOC_BEGIN)
    _, _, tail = rest.partition(_DOC_END)
    wanted = f"{head}{_DOC_BEGIN}\n{render_table()}\n{_DOC_END}{tail}"
    if os.environ.get("PLAIT_WRITE_DOCS") == "1":
        doc.write_text(wanted)
    assert text == wanted, "docs/support.md's combination table is stale: rerun with PLAIT_WRITE_DOCS=1"
