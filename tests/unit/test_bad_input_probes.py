"""Bad input on the command line: `rlpost train` exits with status 2 and one `rlpost:` line naming the key (or
file:line), before anything starts, and never prints a traceback.

Each probe runs the `rlpost` CLI in a child process. Hydra's run is replaced by an exit with status 99, so a probe
that got past the pre-flight stops there instead of starting Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fault_table import Record

pytestmark = pytest.mark.faults

STOP_BEFORE_START = (
    "import sys, rlpost.train as t; t.main = lambda: sys.exit(99); "
    "from rlpost.cli import main; sys.exit(main(sys.argv[1:]))"
)
"""`rlpost <argv>` with Hydra's run (and so Ray) replaced by exit status 99."""


def rlpost(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `rlpost *argv` in a child process in `cwd`, stopping where Hydra would start the run."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-c", STOP_BEFORE_START, *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=full_env)


def error_lines(stderr: str) -> list[str]:
    """The `rlpost: ... error ...` lines of stderr."""
    return [line for line in stderr.splitlines() if line.startswith("rlpost:") and "error" in line]


def assert_refused(out: subprocess.CompletedProcess[str], named: str, words: str = "", status: int = 2,
                   fault: Record | None = None) -> str:
    """Exit `status`, exactly one `rlpost:` error line naming `named` (and holding `words`), no traceback (recorded
    as a probe of the fault table by `fault`)."""
    if fault is not None:
        fault(named, out.returncode, out.stdout + out.stderr)
    lines = error_lines(out.stderr)
    assert out.returncode == status, (out.returncode, out.stderr[-3000:])
    assert len(lines) == 1, out.stderr
    assert named in lines[0], lines[0]
    assert words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return lines[0]


# (overrides, what the error line names, words of the rule)
PROBES: list[tuple[list[str], str, str]] = [
    (["hydra.run.dir=/proc/x"], "hydra.run.dir='/proc/x'", "cannot be created"),
    (["hydra.run.dir="], "hydra.run.dir=''", "working directory"),
    (["checkpointing.checkpoint_dir=/proc/nope"], "checkpointing.checkpoint_dir='/proc/nope'", "cannot be created"),
    (["policy.model_name=/etc"], "policy.model_name='/etc'", "has no config.json"),
    (["policy.tokenizer.name=/nonexistent"], "policy.tokenizer.name='/nonexistent'", "no such directory"),
    (["policy.tokenizer.chat_template=/nonexistent.jinja"], "policy.tokenizer.chat_template='/nonexistent.jinja'",
     "no such template file"),
    (["cluster.object_store_memory_mb=1"], "cluster.object_store_memory_mb=1", "must be >= 75"),
    (["cluster.worker_num_cpus=100"], "cluster.worker_num_cpus=100.0", "the local Ray cluster has"),
    (["policy._target_=rlpost.cli.main"], "policy._target_='rlpost.cli.main'", "names a policy worker class"),
    (["policy.optimizer.kwargs.lr=inf"], "policy.optimizer.kwargs.lr=inf", "must be a finite number"),
    (["grpo.max_num_stepz=5"], "grpo.max_num_stepz='5'", "unknown config key"),
    (["policy.max_total_sequence_length=${nope}"], "policy.max_total_sequence_length='${nope}'",
     "interpolation ${nope} does not resolve"),
    # each of these failed only after start-up (exit 1 or 3)
    (["grpo.seed=99999999999999999999"], "grpo.seed=99999999999999999999", "[0, 2**32 - 1]"),
    (["policy.generation.vllm_cfg.seed=-1"], "policy.generation.vllm_cfg.seed=-1", "[0, 2**32 - 1]"),
    (["cluster.object_store_memory_mb=99999999"], "cluster.object_store_memory_mb=99999999", "at most half"),
    (["model.cache_dir=/proc/cache"], "model.cache_dir='/proc/cache'", "cannot be created"),
    (["policy.max_total_sequence_length=4096"], "policy.max_total_sequence_length=4096", "model's positions"),
    (["model.tiny.max_position_embeddings=8"], "policy.max_total_sequence_length=64", "max_position_embeddings=8"),
    (["policy.generation.stop_token_ids=[999999]"], "policy.generation.stop_token_ids=[999999]", "vocabulary"),
    (["policy.generation.vllm_cfg.max_model_len=4"], "policy.generation.vllm_cfg.max_model_len=4", "shorter than"),
    (["policy.generation.vllm_cfg.kv_cache_space_gb=10000"], "cluster.skip_memory_check=False", "memory plan"),
    (["policy.generation.model_name=/etc"], "policy.generation.model_name='/etc'", "the engine serves the policy's"),
    (["env.synthetic.task=add_mod10"], "env.synthetic.task='add_mod10'", "data.synthetic.task=copy_digit"),
    (["cluster.min_call_timeout_s=5000"], "cluster.min_call_timeout_s=5000.0", "cluster.call_timeout_s"),
    (["algo=ppo", "critic.model_name=/nonexistent"], "critic.model_name='/nonexistent'", "no such directory"),
    (["+policy.generation.vllm_kwargs.max_num_seq=4"], "policy.generation.vllm_kwargs.max_num_seq=4",
     "did you mean 'max_num_seqs'?"),
    # OmegaConf's "Unexpected type for root" (exit 2 naming no key)
    (["distillation.topk_logits_k=8"], "distillation.topk_logits_k='8'", "add the block first: distillation=teacher"),
    # each of these wrote into a directory shared with other files
    (["hydra.run.dir=/"], "hydra.run.dir='/'", "the file system's root"),
    (["hydra.run.dir=."], "hydra.run.dir='.'", "the working directory"),
    (["checkpointing.checkpoint_dir=/"], "checkpointing.checkpoint_dir='/'", "the file system's root"),
]


@pytest.mark.parametrize(("overrides", "named", "words"), PROBES, ids=[" ".join(p[0])[:60] for p in PROBES])
def test_bad_input_exits_2_before_start(overrides: list[str], named: str, words: str, tmp_path: Path,
                                        fault: Record) -> None:
    assert_refused(rlpost("train", *overrides, cwd=tmp_path), named, words, fault=fault)
    assert not (tmp_path / "outputs").exists()  # Hydra made no run directory


def test_cluster_ray_without_a_running_cluster_says_so_before_any_config_rule(tmp_path: Path, fault: Record) -> None:
    # cluster=ray's gpus_per_node=8 breaks the default job's batch rule; the missing cluster is what to report
    # (exit 3, a run-time failure, as README's table documents)
    out = rlpost("train", "cluster=ray", cwd=tmp_path, env={"RAY_TMPDIR": str(tmp_path), "RAY_ADDRESS": ""})
    line = assert_refused(out, "cluster.address=auto", "no Ray cluster is running", status=3, fault=fault)
    assert line.startswith("rlpost: error: ") and "batch" not in out.stderr


def math_rows(path: Path, n: int, bad: dict[int, str] | None = None) -> Path:
    """A math JSONL file of `n` rows; `bad` replaces lines (1-based) with the text given."""
    lines = [json.dumps({"problem": f"What is {i} + 1?", "expected_answer": str(i + 1)}) for i in range(n)]
    for lineno, text in (bad or {}).items():
        lines[lineno - 1] = text
    path.write_text("\n".join(lines) + "\n")
    return path


MATH = ["data=math_jsonl", "env=math", "grpo.val_period=0", "checkpointing.metric_name=train:reward"]


def test_a_directory_or_a_fifo_as_a_data_file_is_named_for_what_it_is(tmp_path: Path, fault: Record) -> None:
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    for path, what in ((tmp_path, "a directory, not a file"), (fifo, "a named pipe (FIFO), not a file")):
        out = rlpost("train", *MATH, f"data.train_data_path={path}", cwd=tmp_path)
        assert_refused(out, f"{path}: {what}", fault=fault)
    out = rlpost("train", f"data.prompt_file={tmp_path}", cwd=tmp_path)
    assert_refused(out, f"data.prompt_file='{tmp_path}'", "a directory, not a file", fault=fault)


def test_a_duplicate_key_in_a_data_row_is_named_by_file_line_and_key(tmp_path: Path, fault: Record) -> None:
    data = math_rows(tmp_path / "train.jsonl", 40, {3: '{"problem": "1 + 1", "expected_answer": "2", "problem": "3"}'})
    out = rlpost("train", *MATH, f"data.train_data_path={data}", cwd=tmp_path)
    line = assert_refused(out, f"{data}:3:", "key 'problem' appears twice", fault=fault)
    assert line.startswith("rlpost: data error: ")


def test_an_over_length_prompt_under_data_too_long_error_is_named_by_file_and_line(tiny_model_dir: Path,
                                                                                   tmp_path: Path,
                                                                                   fault: Record) -> None:
    long = json.dumps({"problem": "What is " + "1 + " * 40 + "1?", "expected_answer": "41"})
    data = math_rows(tmp_path / "train.jsonl", 40, {5: long})
    out = rlpost("train", *MATH, f"data.train_data_path={data}", "model=local", f"model.path={tiny_model_dir}",
                 "data.max_input_seq_length=32", "data.too_long=error", cwd=tmp_path)
    assert_refused(out, f"{data}:5:", "longer than data.max_input_seq_length=32 tokens", fault=fault)


@pytest.mark.parametrize(("path", "rule"), [
    ("/nonexistent/run", "no such directory"),
    ("/etc", "not a run directory (no metrics.jsonl) nor a sweep directory"),
    ("/etc/hostname", "not a directory"),
])
def test_report_of_a_path_that_is_no_run_exits_2_naming_it(path: str, rule: str, tmp_path: Path,
                                                            fault: Record) -> None:
    out = rlpost("report", path, cwd=tmp_path)
    fault(f"rlpost report {path}", out.returncode, out.stdout + out.stderr)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rlpost report: error: {path}: {rule}"), out.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_report_never_writes_over_a_runs_own_file(tmp_path: Path, fault: Record) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/reward": 0.5}) + "\n")
    out = rlpost("report", str(run), "-o", str(run / "metrics.jsonl"), cwd=tmp_path)
    fault("rlpost report R -o R/metrics.jsonl", out.returncode, out.stdout + out.stderr)
    assert out.returncode == 2 and "would write over a file of the run" in out.stderr, out.stderr
    assert json.loads((run / "metrics.jsonl").read_text())["step"] == 1


@pytest.mark.parametrize("value", ["/proc/eval.json", "."])
def test_eval_refuses_a_report_it_cannot_write_before_scoring(value: str, tmp_path: Path, fault: Record) -> None:
    assert_refused(rlpost("eval", f"eval.output={value}", cwd=tmp_path), f"eval.output='{value}'", fault=fault)
