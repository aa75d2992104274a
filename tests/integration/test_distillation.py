"""On-policy distillation end to end through the installed `rlpost train`: a tiny teacher trained here by GRPO
(its checkpoint), the student distilled from it with `algo=distillation`, GRPO with the KL-to-teacher term, and a
teacher of another vocabulary refused before anything starts. The teacher is the default job: it learns the task,
and its console is rlpost's own."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.cli_runs import AC, RLPOST, env, metrics, train

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Teacher:
    """The default GRPO job, 80 steps: its run directory, console and last checkpoint."""

    run: Path
    out: subprocess.CompletedProcess[str]

    @property
    def checkpoint(self) -> Path:
        return self.run / "checkpoints" / "step_80"

    @property
    def accuracy(self) -> float:
        return [m["validation/accuracy"] for m in metrics(self.run) if "validation/accuracy" in m][-1]


@pytest.fixture(scope="module")
def teacher(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Teacher:
    run = tmp_path_factory.mktemp("teacher") / "run"
    out = train(run, cache, "checkpointing.metric_name=null", "checkpointing.keep_top_k=1",
                "checkpointing.save_period=80")
    return Teacher(run, out)


def test_the_default_job_learns_and_its_console_is_rlposts_own(teacher: Teacher) -> None:
    rewards = [m["train/reward"] for m in metrics(teacher.run) if "train/reward" in m]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1 and last > first + 0.5, rewards
    assert teacher.accuracy >= 0.8
    # The console holds the plan, one progress bar, rlpost's own lines and the summary; vLLM, Ray,
    # transformers and C-library output (tcmalloc, NUMA, Triton) went to train.log.
    console = [line for line in (teacher.out.stdout + teacher.out.stderr).splitlines() if line.strip()]
    ours = re.compile(r"^(\s*rlpost plan\s*|[┌│├└].*|GRPO .*|done: .*|  (metrics|tensorboard|checkpoints|report): .*"
                      r"|rlpost: .*)$")
    assert [line for line in console if not ours.match(line)] == []
    log = (teacher.run / "train.log").read_text()
    # the engine's vLLM lines (their "[file.py:line]" prefix) come from its own actor beside the policy's worker
    assert "actor_name:VllmEngineWorker" in log and re.search(r"WARNING \d\d-\d\d [\d:]+ \[\w+\.py:\d+\]", log)


def test_the_student_learns_the_task_from_the_teacher(teacher: Teacher, cache: Path, tmp_path: Path) -> None:
    checkpoint, teacher_accuracy = teacher.checkpoint, teacher.accuracy
    run = tmp_path / "student"
    train(run, cache, "algo=distillation", f"distillation.teacher.model_path={checkpoint}", "checkpointing=disabled",
          AC)
    lines = metrics(run)
    kl = [m["train/kl_to_teacher"] for m in lines]
    assert sum(kl[-5:]) / 5 < 0.1 * sum(kl[:5]) / 5, kl
    assert all(0.9 < m["train/teacher_topk_mass"] <= 1.0 + 1e-6 for m in lines)
    assert lines[-1]["train/student_topk_mass"] > lines[0]["train/student_topk_mass"]
    student_accuracy = [m["validation/accuracy"] for m in lines if "validation/accuracy" in m][-1]
    assert student_accuracy >= 0.9 * teacher_accuracy, (student_accuracy, teacher_accuracy)


def test_grpo_with_the_teacher_kl_on_a_teacher_of_its_own(teacher: Teacher, cache: Path, tmp_path: Path) -> None:
    checkpoint = teacher.checkpoint
    run = tmp_path / "grpo"
    train(run, cache, "distillation=teacher", f"distillation.teacher.model_path={checkpoint}",
          "loss_fn.distillation_kl_coef=0.1", "distillation.teacher.colocated=false", "distillation.topk_logits_k=null",
          "grpo.max_num_steps=3", "grpo.val_period=0", "checkpointing=disabled")
    lines = metrics(run)
    # the whole vocabulary: the teacher's mass on it is 1, and the student's KL to it is positive
    assert all(m["train/teacher_topk_mass"] == pytest.approx(1.0, abs=1e-4) for m in lines)
    assert all(m["train/kl_to_teacher"] > 0 and "timing/train/teacher_logprobs" in m for m in lines)


def test_a_teacher_with_another_vocabulary_exits_2_naming_both(teacher: Teacher, cache: Path, tmp_path: Path
                                                               ) -> None:
    checkpoint = teacher.checkpoint
    other = tmp_path / "other_teacher"
    shutil.copytree(checkpoint / "policy" / "weights" / "hf", other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab["renamed_" + first] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    out = subprocess.run([RLPOST, "train", "algo=distillation", f"distillation.teacher.model_path={other}",
                          f"hydra.run.dir={tmp_path / 'run'}"], env=env(cache), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    line = [ln for ln in out.stderr.splitlines() if ln.startswith("rlpost: ")][0]
    assert f"distillation.teacher.model_path='{other}'" in line and "differs from the student's" in line, line
    assert "cross-tokenizer" in line and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()  # refused after the plan: the directory made for it is gone
