"""The CLI end to end, as subprocesses on real gloo ranks: train, resume, fault restart, bad recipes, plan."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import plait.train.quiet_logs  # noqa: F401 - as entry() does before main(): torchao's import notice
from plait.testing import run_on_ranks
from plait.train.cli import main
from tests.train._ranks import run_killing_a_rank

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=128",
    "model.arch.num_hidden_layers=2",
    "data.seq_len=32",
    "data.micro_batch_size=2",
    "data.max_bytes=100000",
    "train.val_batches=1",
]
# Two ranks, FSDP2 sharding parameters and optimizer state; a checkpoint every 4 steps of 20.
STEPS, EVERY = 20, 4
RESUMABLE = [*SMALL, "parallel.tp_size=1", "train.val_every=0", f"train.steps={STEPS}"]
RESUMABLE += [f"checkpoint.every={EVERY}"]


def _sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def _run(args: list[str], *, timeout: float = 400, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=timeout
    )


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_default_recipe_trains_on_four_self_launched_ranks(tmp_path: Path):
    run_dir = tmp_path / "default"
    overrides = [
        f"out_dir={run_dir}",
        "train.steps=5",
        "optim.warmup_steps=2",
        "checkpoint.every=2",
        "checkpoint.keep=1",
    ]
    proc = _run(["-m", "plait.train", *_sets(overrides)])
    _ok(proc)
    assert "dp_shard=2 x cp=1 x tp=2" in proc.stdout and "sp=on ac=full" in proc.stdout
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, 6))
    assert losses[5] < losses[1] - 0.3, losses
    assert re.search(
        r"step +5/5 \| loss [\d.]+ \| lr [\d.e+-]+ \| grad_norm [\d.]+ \| [\d,]+ ms \| tok/s [\d,]+ \| "
        r"tok/s/dev [\d,]+ \| TFLOPs/dev (<0\.01|[\d.]+) \| MFU n/a \| mem",
        proc.stdout,
    )
    assert "val_loss" in proc.stdout
    # no torch log lines (`W1207 12:00:00.000 ...`): torchao's import printed two in every run
    assert not re.findall(r"^[WE]\d{4} .*", proc.stdout + proc.stderr, re.M), proc.stderr[-3000:]
    assert (run_dir / "export" / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000005"]  # the final step


def _uninterrupted(run_dir: str) -> None:
    """The recipe's whole job on this rank: the trainer the CLI's ranks run, without a launch."""
    import torch.distributed as dist

    from plait.mesh import init_distributed
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe
    from plait.train.trainer import Trainer

    recipe = load_recipe(None, [*RESUMABLE, f"out_dir={run_dir}"])
    Trainer(recipe, check_recipe(recipe, dist.get_world_size()), init_distributed()).fit()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of :data:`RESUMABLE` on 2 ranks (its last two checkpoints kept).

    On the harness's ranks (a launch of its own would add ~15 s of start-up): the same trainer on
    2 gloo ranks, so the CLI's resumed run must match it bit for bit.
    """
    run_dir = tmp_path_factory.mktemp("baseline")
    run_on_ranks(_uninterrupted, 2, str(run_dir))
    return run_dir


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = (
        load_file(a / "export" / "model-00001-of-00001.safetensors"),
        load_file(b / "export" / "model-00001-of-00001.safetensors"),
    )
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.mark.slow  # torchrun's restart of both ranks: tools/slow_tests (the kill -9 rerun stays in CI)
def test_a_killed_rank_restarts_from_the_last_complete_checkpoint_and_matches_the_uninterrupted_run(
    baseline: Path, tmp_path: Path
):
    run_dir = tmp_path / "fault"
    ckpts = run_dir / "checkpoints"
    # shards written, manifest.json never written: skipped at start and restart
    half = ckpts / f"step_{STEPS - 1:08d}"
    shutil.copytree(baseline / "checkpoints" / f"step_{STEPS:08d}", half)
    (half / "manifest.json").unlink()
    (ckpts / f".tmp-step_{STEPS:08d}").mkdir()
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    args = [sys.executable, *torchrun, "-m", "plait.train", *_sets([*RESUMABLE, f"out_dir={run_dir}"])]
    # SIGKILL to rank 1 from outside once step EVERY + 1 is logged: after the first complete checkpoint.
    proc = run_killing_a_rank(args, cwd=REPO, env=_env(), run_dir=run_dir, step=EVERY + 1)
    _ok(proc)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("run_start") == 2 and kinds.count("resume") == 1, kinds
    after = kinds.index("resume")
    resumed_at = records[after]["step"]
    assert f"[resume] step={resumed_at}" in proc.stdout and proc.stdout.count("[resume]") == 1
    first = [r["step"] for r in records[:after] if r["kind"] == "train"]
    assert first == list(range(1, len(first) + 1)) and EVERY < len(first) < STEPS, first  # then killed
    saved = [r["step"] for r in records[:after] if r["kind"] == "checkpoint"]
    # the newest complete checkpoint (the kill may fall between its rename and its line in the log)
    assert resumed_at in (saved[-1], saved[-1] + EVERY) and resumed_at <= first[-1], (saved, resumed_at)
    rest = list(range(resumed_at + 1, STEPS + 1))
    assert [r["step"] for r in records[after:] if r["kind"] == "train"] == rest
    base = _losses(baseline)
    resumed = {r["step"]: r["loss"] for r in records[after:] if r["kind"] == "train"}
    assert resumed == {s: base[s] for s in rest}
    _same_weights(baseline, run_dir)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.stepz=3", r"unknown recipe key 'train\.stepz' \(did you mean 'train\.steps'\?\)"),
        ("train.steps=many", r"train\.steps must be int, got 'many' \(str\)"),
        ("parallel.tp_size=3", r"world_size 4 is not divisible by pp\*cp\*tp = 1\*1\*3"),
    ],
)
def test_bad_recipe_is_one_line_and_writes_nothing(override: str, message: str, tmp_path: Path, capsys):
    run_dir = tmp_path / "never"
    assert main(_sets([override, f"out_dir={run_dir}"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plait-train: error: "), err
    assert re.search(message, err[0])
    assert not run_dir.exists()


def test_plan_llama3_8b_on_1024_ranks(capsys: pytest.CaptureFixture[str]):
    assert main(["plan", "--world-size", "1024", "--set", "model.preset=llama3-8b"]) == 0
    out = capsys.readouterr().out
    total = 8_030_261_248  # Llama-3-8B, untied embeddings
    assert f"parameters: {total:,} total" in out
    per_rank = int(re.search(r"parameters per rank: ([\d,]+)", out).group(1).replace(",", ""))
    assert total / 1024 <= per_rank <= total / 1024 * 1.002
    assert "dp_shard=512 x cp=1 x tp=2" in out
    assert "FSDP units: 35" in out  # root, embed_tokens, 32 layers, [final norm, lm_head]
    assert (
        "model.layers.*  x32" in out and "  model.embed_tokens\n" in out and "  model.norm+lm_head\n" in out
    )
    assert re.search(r"model\.layers\.\*\.self_attn\.q_proj\.weight: dp_shard:[^|\n]*, tp:S\(0\)\n", out)
    assert re.search(r"optimizer \(AdamW exp_avg \+ exp_avg_sq\): [\d,]+ x float32", out)
    assert re.search(r"fsdp_all_gather: [\d.]+ GiB", out) and "tp_activations" in out
    assert float(re.search(r"planned in ([\d.]+) s", out).group(1)) < 60


@pytest.mark.slow  # inductor builds the layers: tools/slow_tests (library compile stays in CI)
def test_compile_trains_and_the_summary_names_device_backend_and_compiled_layers(tmp_path: Path):
    run_dir = tmp_path / "compiled"
    overrides = [*SMALL, "model.arch.num_hidden_layers=1", "parallel.tp_size=1", "parallel.compile=true"]
    # Without activation checkpointing inductor builds a third fewer kernels (~15 s of a cold C++ build);
    # compile with checkpointing is tests/sidecar/test_compile.py's parity case.
    overrides += ["parallel.activation_checkpointing=false"]
    overrides += ["train.steps=2", "train.val_every=0", "checkpoint.every=0", "checkpoint.export=false"]
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "plait.train"]
    proc = _run([*args, *_sets([*overrides, f"out_dir={run_dir}"])], timeout=480)  # inductor's C++ build
    _ok(proc)
    assert "device cpu | backend gloo | compile on (1 layer compiled)" in proc.stdout
    losses = _losses(run_dir)
    assert sorted(losses) == [1, 2] and all(0 < v < 10 for v in losses.values()), losses


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plait-train: error: "), err
    return err[0]


BAD_VOCAB = ["--recipe", "hf_llama", "--set", "model.hf_config.vocab_size=100"]


@pytest.mark.parametrize("command", [["validate", "--world-size", "4"], ["plan", "--world-size", "4"], []])
def test_a_too_small_hf_vocabulary_is_one_line_from_validate_plan_and_train(command: list[str], capsys):
    line = _one_line_error([*command, *BAD_VOCAB], capsys)
    assert "model vocab_size 100 is smaller than the vocabulary of tokenizer 'bytes' (257 ids)" in line
    assert "set model.hf_config.vocab_size >= 257" in line


@pytest.mark.slow  # torchrun's start-up: tools/slow_tests (the local launcher's ranks refuse it in tools/test)
def test_a_bad_recipe_fails_on_every_torchrun_rank_without_hanging(tmp_path: Path):
    """A too-small HF vocabulary (the check shared with a wrong mesh or a bad key) under torchrun."""
    run_dir = tmp_path / "never"
    # A launcher pid inherited from elsewhere (pid 1: never a torchrun rank's parent) is ignored.
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "plait.train",
                 *BAD_VOCAB, "--set", f"out_dir={run_dir}"], PLAIT_LAUNCHER_PID="1")  # fmt: skip
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("plait-train: error: ")]
    assert len(lines) == 2 and all("model vocab_size 100" in line for line in lines), proc.stderr[-3000:]
    assert not run_dir.exists()


def test_a_data_glob_matching_nothing_fails_up_front_naming_it(tmp_path: Path, capsys):
    pattern = str(tmp_path / "nowhere" / "*.jsonl")
    line = _one_line_error(
        ["validate", "--set", "data.source=files", "--set", f"data.paths=[{pattern}]"], capsys
    )
    assert f"data.paths entry '{pattern}' matches no file" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        (["train.device=cuda"], "train.device 'cuda'"),
        (["parallel.strategy=megatron_fsdp", "parallel.tp_size=1"], "parallel.strategy 'megatron_fsdp'"),
        (["parallel.options.offload_policy=cpu", "parallel.tp_size=1"], "parallel.options.offload_policy"),
    ],
)
def test_cuda_only_settings_without_gpus_are_one_line_naming_the_setting(
    overrides: list[str], setting: str, tmp_path: Path, capsys
):
    for command in (["validate"], []):  # [] = train: refused before any rank starts
        line = _one_line_error([*command, *_sets([*overrides, f"out_dir={tmp_path}/x"])], capsys)
        assert "no CUDA GPU is available on this machine" in line and setting in line, line
    assert not (tmp_path / "x").exists()


def test_plan_deepseek_v3_on_16384_ranks(capsys: pytest.CaptureFixture[str]):
    """pp 16 x tp 8 x cp 2 x ep 64: every stage's memory, in under a minute on one process."""
    assert main(["plan", "--recipe", "deepseek_v3", "--world-size", "16384"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 671,026,404,352 total" in out  # DeepSeek-V3 without its MTP module
    assert "mesh pp=16 x dp_replicate=1 x dp_shard=64 x cp=2 x tp=8 | moe mesh ep_shard=16 x ep=64" in out
    assert (
        len(re.findall(r"^  stage \d+ \(pp rank \d+\): layers .* params, ~[\d.]+ MiB per rank$", out, re.M))
        == 16
    )
    assert "context parallel: cp=2" in out and "ep_all_to_all" in out and "  cp_attention: " in out
    assert float(re.search(r"planned in ([\d.]+) s", out).group(1)) < 60


def test_plan_the_4d_dense_and_5d_moe_recipes_on_16_ranks(capsys: pytest.CaptureFixture[str]):
    """The tiny multi-axis recipes lay out on 16 ranks (they also run here, on 16 local processes)."""
    assert main(["plan", "--recipe", "dense_4d", "--world-size", "16"]) == 0
    dense = capsys.readouterr().out
    assert "mesh pp=2 x dp_replicate=1 x dp_shard=2 x cp=2 x tp=2" in dense and "sp=on ac=full" in dense
    assert main(["plan", "--recipe", "moe_5d", "--world-size", "16"]) == 0
    moe = capsys.readouterr().out
    assert "mesh pp=2 x dp_replicate=1 x dp_shard=2 x cp=2 x tp=2 | moe mesh ep_shard=4 x ep=2" in moe
    assert "context parallel: cp=2" in moe and "ep_all_to_all" in moe


def test_plan_the_4d_dense_recipe_at_the_llama3_70b_shape(capsys: pytest.CaptureFixture[str]):
    sets = [
        "model.preset=llama3-70b",
        "parallel.pp_size=4",
        "parallel.tp_size=8",
        "parallel.pipeline={schedule: 1f1b, microbatches: 4}",
        "data.seq_len=16384",
        "data.micro_batch_size=4",
    ]
    args = ["plan", "--recipe", "dense_4d", "--world-size", "1024", *(x for s in sets for x in ("--set", s))]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "mesh pp=4 x dp_replicate=1 x dp_shard=16 x cp=2 x tp=8" in out
    assert "parameters: 70,553,706,496 total" in out
    assert len(re.findall(r"^  stage \d+ \(pp rank \d+\): layers .* per rank$", out, re.M)) == 4
    assert float(re.search(r"planned in ([\d.]+) s", out).group(1)) < 60
