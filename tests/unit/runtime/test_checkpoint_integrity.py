"""Checkpoint manifests: a truncated or altered file in the newest checkpoint is detected on resume,
moved aside (never deleted) with one warning line, and the previous checkpoint is used; keep_top_k
never keeps a corrupt one; a resume drops the metrics rows the interrupted run wrote after it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpost.config.schema.checkpoint import CheckpointingConfig
from rlpost.config.schema.logger import LoggerConfig
from rlpost.runtime.checkpointing import (
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatch,
    read_json,
    verify,
)
from rlpost.runtime.metrics_logger import MetricsLogger

FILES = {
    "policy/weights/dcp/__0_0.distcp": 3000,
    "policy/weights/dcp/.metadata": 200,
    "policy/weights/hf/model.safetensors": 5000,
    "policy/weights/hf/config.json": 50,
    "policy/optimizer/dcp/__0_0.distcp": 4000,
    "policy/optimizer/scheduler.pt": 300,
    "train_dataloader.json": 40,
    "rng_state.json": 60,
}
# Every file of a checkpoint, including the two finalize writes.
ALL_FILES = sorted([*FILES, "training_info.json", "fingerprint.json"])


def save(m: CheckpointManager, step: int, acc: float = 0.5) -> Path:
    tmp = m.begin(step)
    for rel, size in FILES.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(bytes((step * 7 + i) % 251 for i in range(size)))
    return m.finalize(tmp, step, {"total_steps": step, "val:accuracy": acc}, "fp", {"a": 1})


def manager(tmp_path: Path, **kw: object) -> CheckpointManager:
    return CheckpointManager(CheckpointingConfig(**kw), tmp_path)  # type: ignore[arg-type]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("rlpost: warning:")]


def test_manifest_lists_every_file_with_size_and_hash(tmp_path: Path) -> None:
    ck = save(manager(tmp_path), 1)
    manifest = json.loads((ck / MANIFEST).read_text())
    assert manifest["hash"] == "sha256"
    assert sorted(manifest["files"]) == ALL_FILES
    entry = manifest["files"]["policy/weights/hf/model.safetensors"]
    assert entry["size"] == 5000 and len(entry["sha256"]) == 64
    assert verify(ck) is None
    (ck / "extra.txt").write_text("not in the manifest")  # unmanifested files are ignored
    assert verify(ck) is None


@pytest.mark.parametrize("damage", [truncate, flip], ids=["truncated", "byte-flipped"])
@pytest.mark.parametrize("rel", ALL_FILES)
def test_corrupt_latest_falls_back_to_previous(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               rel: str, damage: object) -> None:
    m = manager(tmp_path, keep_top_k=None)
    save(m, 1)
    bad = save(m, 2)
    damage(bad / rel)  # type: ignore[operator]
    capsys.readouterr()

    m2 = manager(tmp_path, keep_top_k=None)  # the re-run
    assert m2.latest_verified() == tmp_path / "checkpoints" / "step_1"
    moved = tmp_path / "checkpoints" / "corrupt_step_2"
    assert not bad.exists() and (moved / rel).is_file()  # moved aside, not deleted
    assert m2.steps() == [1] and m2.latest() == tmp_path / "checkpoints" / "step_1"
    lines = warnings(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert str(bad) in lines[0] and rel in lines[0] and str(moved) in lines[0] and "resuming from step_1" in lines[0]
    if damage is truncate:
        assert "bytes, manifest says" in lines[0]


def test_missing_file_or_manifest_is_unverifiable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = manager(tmp_path, keep_top_k=None)
    save(m, 1)
    save(m, 2)
    save(m, 3)
    (tmp_path / "checkpoints" / "step_3" / "policy/optimizer/scheduler.pt").unlink()
    (tmp_path / "checkpoints" / "step_2" / MANIFEST).write_text("{garbled")
    capsys.readouterr()
    assert m.latest_verified() == tmp_path / "checkpoints" / "step_1"
    lines = warnings(capsys.readouterr().err)
    assert len(lines) == 2
    assert "scheduler.pt: missing" in lines[0] and f"{MANIFEST} is unreadable" in lines[1]
    assert (tmp_path / "checkpoints" / "corrupt_step_3").is_dir() and (tmp_path / "checkpoints" / "corrupt_step_2").is_dir()


def test_existing_corrupt_dir_gets_a_suffix_and_none_left_means_fresh_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = manager(tmp_path, keep_top_k=None)
    save(m, 1)
    (tmp_path / "checkpoints" / "corrupt_step_1").mkdir()
    truncate(tmp_path / "checkpoints" / "step_1" / "policy/weights/hf/model.safetensors")
    assert m.latest_verified() is None
    assert (tmp_path / "checkpoints" / "corrupt_step_1.1" / "training_info.json").is_file()
    assert "starting from step 0" in capsys.readouterr().err
    assert m.steps() == [] and m.latest() is None


def test_keep_top_k_never_keeps_a_corrupt_best(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = manager(tmp_path, keep_top_k=1, metric_name="val:accuracy")
    save(m, 1, acc=0.9)  # the best, corrupted below
    save(m, 2, acc=0.5)
    truncate(tmp_path / "checkpoints" / "step_1" / "policy/optimizer/dcp/__0_0.distcp")
    m = manager(tmp_path, keep_top_k=1, metric_name="val:accuracy")
    save(m, 3, acc=0.1)
    assert m.steps() == [2, 3]  # the best that verifies, plus the latest
    assert (tmp_path / "checkpoints" / "corrupt_step_1").is_dir()
    assert "step_1 is corrupt" in capsys.readouterr().err
    assert m.latest_verified() == tmp_path / "checkpoints" / "step_3"


def test_keep_top_k_checks_hashes_not_only_sizes(tmp_path: Path) -> None:
    m = manager(tmp_path, keep_top_k=1, metric_name="val:accuracy")
    save(m, 1, acc=0.9)
    save(m, 2, acc=0.5)
    flip(tmp_path / "checkpoints" / "step_1" / "policy/weights/hf/model.safetensors")
    m = manager(tmp_path, keep_top_k=1, metric_name="val:accuracy")
    save(m, 3, acc=0.1)
    assert m.steps() == [2, 3]


def test_unreadable_checkpoint_json_is_a_checkpoint_error(tmp_path: Path) -> None:
    bad = tmp_path / "rng_state.json"
    bad.write_text('{"python": [3, [1, 2')
    with pytest.raises(CheckpointError, match=r"rng_state\.json") as info:
        read_json(bad)
    assert "\n" not in str(info.value)
    assert issubclass(CheckpointMismatch, CheckpointError)


def rows(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_metrics_truncate_after_keeps_one_row_per_step(tmp_path: Path) -> None:
    cfg = LoggerConfig()
    log = MetricsLogger(cfg, tmp_path)
    log.log({"validation/accuracy": 0.1}, 0)
    for step in (1, 2, 3):
        log.log({"train/reward": float(step)}, step)
    log.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "train/rew')  # the killed run's partial last line

    log = MetricsLogger(cfg, tmp_path)  # resume from the step-2 checkpoint
    assert log.truncate_after(2) == 2  # step 3 and the partial line
    log.log({"train/reward": 30.0}, 3)
    log.close()
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert rows(tmp_path / "metrics.jsonl")[-1]["train/reward"] == 30.0
    assert not list(tmp_path.glob("*.tmp"))
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


class _FilePolicy:
    """What write_checkpoint needs of a policy: its save (here one small file per path)."""

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None, hf_export: bool = True) -> None:
        for p in (weights_path, optimizer_path):
            Path(p).mkdir(parents=True)  # type: ignore[arg-type]
            (Path(p) / "part.json").write_text("{}")  # type: ignore[arg-type]


def test_a_run_killed_between_checkpoint_and_metrics_line_gets_the_line_back(tmp_path: Path) -> None:
    """The checkpoint of step 2 holds step 2's row; a run killed before writing that row to metrics.jsonl resumes
    with it restored (once, in order), and a run that did write it keeps its own."""
    from rlpost.algorithms.checkpoint_io import saved_metrics_row, write_checkpoint
    from rlpost.config.schema.grpo import GRPOSaveState

    m = CheckpointManager(CheckpointingConfig(enabled=True, checkpoint_dir=str(tmp_path / "ck")), tmp_path)
    cfg = LoggerConfig()
    log = MetricsLogger(cfg, tmp_path)
    log.log({"train/reward": 1.0}, 1)
    state = GRPOSaveState(total_steps=2)
    write_checkpoint(m, _FilePolicy(), 2, state, {"epoch": 0, "index": 2}, {}, "fp", False,
                     {"train/reward": 2.0, "timing/train/generation": 0.5, "note": "not a scalar"})
    log.close()  # killed here: step 2's line never written

    last = m.latest_verified()
    assert last is not None and last.name == "step_2"
    assert saved_metrics_row(last) == {"train/reward": 2.0, "timing/train/generation": 0.5}
    log = MetricsLogger(cfg, tmp_path)
    log.truncate_after(2)
    assert log.restore_row(2, saved_metrics_row(last))
    assert not log.restore_row(2, saved_metrics_row(last))  # there now: not twice
    log.log({"train/reward": 3.0}, 3)
    log.close()
    assert [(r["step"], r["train/reward"]) for r in rows(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    (last / "metrics_row.json").unlink()  # a checkpoint from before rows were kept
    assert saved_metrics_row(last) is None


def test_worker_load_failure_is_recognised_through_the_exception_chain() -> None:
    from rlpost.algorithms.grpo_setup import _checkpoint_load_failure

    remote = RuntimeError(
        "The actor died because of an error raised in its creation task, ray::policy-0\n"
        '  File "/x/rlpost/models/policy/dtensor_checkpoint.py", line 80, in load\n'
        "    dcp.load(optim_sd, checkpoint_id=str(op / 'dcp'))\n"
        "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory. "
        "This is an internal miniz error.\n"
    )
    wrapped = RuntimeError("policy rank 0 died: The actor died because of an error raised in its creation task")
    wrapped.__context__ = remote  # as WorkerGroupError is raised while handling Ray's ActorDiedError
    assert _checkpoint_load_failure(wrapped) == (
        "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory.")
    assert _checkpoint_load_failure(RuntimeError("policy rank 0 died: out of memory")) is None
