"""The job's lifecycle on real local ranks: a failure on one rank, SIGTERM, a killed launcher, imports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from plait.train.checkpoint import verify_checkpoint
from tests.train._ranks import alive, children, cmdline, descendants, train_steps

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "launch.nproc_per_node=2",
    "parallel.tp_size=1",
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=128",
    "model.arch.num_hidden_layers=2",
    "data.seq_len=32",
    "data.micro_batch_size=2",
    "data.max_bytes=100000",
    "train.val_batches=1",
    "train.val_every=0",
]
LONG = [*SMALL, "train.steps=100000", "checkpoint.every=100000", "checkpoint.export=false"]


def _command(overrides: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "plait.train", *extra, *[a for o in overrides for a in ("--set", o)]]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _start(overrides: list[str], cwd: Path = REPO) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _command(overrides), cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_step(run_dir: Path, proc: subprocess.Popen[str], step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(train_steps(run_dir)) < step:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.2)


def test_an_error_on_one_rank_is_its_line_on_every_rank_and_never_restarted(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # Only rank 0 writes the metrics file, so only rank 0 meets the error; rank 1 learns it from rank 0.
    proc = subprocess.run(
        _command([*SMALL, f"out_dir={blocker}/run", "launch.max_restarts=2"]),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("plait-train: error: ")]
    assert len(lines) == 2, proc.stderr[-3000:]
    assert all(f"{blocker}/run" in line and ": Not a directory;" in line for line in lines), lines
    assert lines[0].split(" (on rank 0)")[0] == lines[1].split(" (on rank 0)")[0]
    assert sum(line.endswith("(on rank 0)") for line in lines) == 1
    assert "a user error is not retried; 0 restart(s) made" in proc.stderr
    assert "Traceback" not in proc.stderr and "restart 1" not in proc.stderr


def test_sigterm_saves_a_complete_checkpoint_at_the_current_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start([*LONG, f"out_dir={run_dir}"])
    try:
        _wait_for_step(run_dir, proc, 2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + 15, err[-3000:]
    last = train_steps(run_dir)[-1]
    lines = [line for line in err.splitlines() if line.startswith("plait-train: stopped by SIGTERM at step")]
    assert lines == [lines[0]] * 2 and f"at step {last} of 100000; checkpoint" in lines[0], err[-3000:]
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == [f"step_{last:08d}"], ckpts
    manifest, problem = verify_checkpoint(ckpts[0])
    assert problem is None and manifest["step"] == last
    assert "Traceback" not in err


def test_a_killed_launcher_leaves_no_rank_alive(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start([*LONG, f"out_dir={run_dir}"])
    ranks: list[int] = []
    try:
        _wait_for_step(run_dir, proc, 1)
        ranks = descendants(proc.pid)
        servers = [pid for pid in children(proc.pid) if b"multiprocessing.forkserver" in cmdline(pid)]
        assert len(servers) == 1 and len(children(servers[0])) == 2, "2 ranks forked from one server"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in ranks), (
            "a rank or the launcher's rank server outlived it by 10 s"
        )
    finally:
        proc.kill()
        for pid in filter(alive, ranks):
            os.kill(pid, signal.SIGKILL)


def test_the_working_directory_is_never_importable(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "localplan.py").write_text(f"open({str(marker)!r}, 'w').close()\nplan = {{}}\n")
    args = _command(
        [*SMALL, "parallel.tp_size=2", "parallel.options.tp_plan=localplan:plan"], "plan", "--world-size", "2"
    )
    proc = subprocess.run(
        [*args, "--allow-imports"], cwd=tmp_path, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "No module named 'localplan'" in proc.stderr
    assert not marker.exists()
