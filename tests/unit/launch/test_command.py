"""`rlpost launch`: the arguments it takes apart, the overrides it gives the job, what it refuses before submitting
anything (exit 2, one line), the batch script it writes and the KubeRay manifest it prints."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from rlpost.config.errors import ConfigError
from rlpost.launch import slurm
from rlpost.launch.command import launch, split_train, train_overrides
from rlpost.launch.kuberay import KubeRayJob
from rlpost.launch.ray_job import RayJob


def test_the_train_args_follow_a_double_dash() -> None:
    assert split_train(["--nodes=2", "--", "train", "a=1"]) == (["--nodes=2"], ["a=1"])
    with pytest.raises(ConfigError, match="needs `-- train"):
        split_train(["--nodes=2", "train"])
    with pytest.raises(ConfigError, match="runs `rlpost train`"):
        split_train(["--", "plan"])


def test_the_scheduler_options_set_the_cluster_shape_and_a_contradiction_is_refused() -> None:
    """One source of truth: sbatch --nodes / --gpus-per-node set cluster.num_nodes / gpus_per_node; the same value
    given again is accepted, another is refused naming both."""
    assert train_overrides(["x=1"], 2, 8) == ["cluster=ray", "x=1", "cluster.num_nodes=2", "cluster.gpus_per_node=8"]
    assert train_overrides(["cluster.gpus_per_node=8", "cluster.num_nodes=2"], 2, 8) == [
        "cluster=ray", "cluster.num_nodes=2", "cluster.gpus_per_node=8"]
    for given, key in (("cluster.num_nodes=4", "cluster.num_nodes"), ("cluster.gpus_per_node=4",
                                                                      "cluster.gpus_per_node")):
        with pytest.raises(ConfigError, match="contradicts") as err:
            train_overrides([given], 2, 8)
        assert err.value.key == key
    assert slurm.gpus_per_node(["--gpus-per-node=a100:8"]) == 8
    assert slurm.gpus_per_node(["--gpus-per-node", "4", "--nodes=2"]) == 4
    assert slurm.gpus_per_node(["--nodes=2"]) is None
    with pytest.raises(ConfigError, match="--gpus-per-node"):
        slurm.gpus_per_node(["--gpus-per-node=0"])
    with pytest.raises(ConfigError, match=">= 1"):
        slurm.node_count(["--nodes=0"])


def test_the_job_joins_the_launched_ray_cluster_on_the_asked_nodes() -> None:
    assert train_overrides(["grpo.max_num_steps=3"], 2) == ["cluster=ray", "grpo.max_num_steps=3",
                                                            "cluster.num_nodes=2"]
    assert train_overrides(["cluster=ray", "x=1", "cluster.num_nodes=2"], None) == ["cluster=ray", "x=1",
                                                                                  "cluster.num_nodes=2"]


@pytest.mark.parametrize("override, key", [
    ("cluster.address=10.0.0.1:6379", "cluster.address"),
    ("hydra.run.dir=/tmp/x", "hydra.run.dir"),
    ("cluster=local", "cluster"),
    ("-m", "-m"),
])
def test_keys_the_launcher_sets_are_refused(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        train_overrides([override], 1)
    assert err.value.key == key


@pytest.mark.parametrize("args, nodes", [([], 1), (["--nodes=3"], 3), (["-N", "2"], 2), (["-N4"], 4),
                                         (["--time=10", "--nodes", "2"], 2)])
def test_the_node_count_comes_from_sbatchs_options(args: list[str], nodes: int) -> None:
    assert slurm.node_count(args) == nodes


def test_a_node_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="fixed number of nodes"):
        slurm.node_count(["--nodes=2-4"])


def _job(**kw: object) -> slurm.SlurmJob:
    base: dict[str, object] = dict(train_args=["cluster=ray", "grpo.max_num_steps=3", "data.prompt='a b'"],
                                   sbatch_args=[], run_dir=Path("/runs/r 1"), max_requeues=2)
    return slurm.SlurmJob(**{**base, **kw})  # type: ignore[arg-type]


def test_the_batch_script_is_filled_and_quoted(tmp_path: Path) -> None:
    text = slurm.render(_job())
    assert "{{" not in text and "#SBATCH --signal=B:TERM@120" in text and "MAX_REQUEUES=2" in text
    assert "RUN_DIR='/runs/r 1'" in text and "--output='/runs/r 1/logs'/slurm-%j.out" in text
    assert "train cluster=ray grpo.max_num_steps=3 'data.prompt='\"'\"'a b'\"'\"''" in text
    assert "#SBATCH --signal" not in slurm.render(_job(sbatch_args=["--signal=B:USR1@60"]))  # theirs, on sbatch's line
    script = tmp_path / "s.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0  # valid bash


def test_bad_input_exits_2_before_anything_is_submitted(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert launch(["slurm", "--run-dir", str(tmp_path / "r"), "--", "train", "grpo.max_num_stepz=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "grpo.max_num_stepz" in err[0] and not (tmp_path / "r").exists()
    assert launch(["pbs", "--", "train"]) == 2
    assert "must be one of" in capsys.readouterr().err


def test_a_dry_run_prints_the_script_and_submits_nothing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert launch(["slurm", "--dry-run", "--run-dir", str(run), "--nodes=2", "--", "train",
                   "grpo.max_num_steps=3", "cluster.gpus_per_node=1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("#!/bin/bash") and "cluster.num_nodes=2" in text and not (run / "logs").exists()


def test_a_ray_job_joins_the_cluster_it_runs_on() -> None:
    job = RayJob("http://h:8265", ["cluster=ray", "grpo.max_num_steps=3"], Path("/runs/a"), Path("/work/data"))
    assert job.entrypoint() == "rlpost train cluster=ray grpo.max_num_steps=3 cluster.address=auto " \
                               "hydra.run.dir=/runs/a"
    env = job.runtime_env()
    assert env["working_dir"] == "/work/data" and ".venv" in env["excludes"]  # type: ignore[operator]


def test_the_kuberay_manifest_runs_the_job_on_head_and_workers(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch(["kuberay", "--image", "reg/rlpost:1", "--pvc", "runs", "--workers", "3", "--gpus", "8",
                   "--name", "exp1", "--", "train", "grpo.max_num_steps=3", "policy.train_micro_batch_size=8"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["kind"] == "RayJob" and doc["metadata"]["name"] == "exp1"
    spec = doc["spec"]
    assert "cluster.num_nodes=4" in spec["entrypoint"] and "cluster.gpus_per_node=8" in spec["entrypoint"]
    assert "hydra.run.dir=/runs/exp1" in spec["entrypoint"]
    workers = spec["rayClusterSpec"]["workerGroupSpecs"][0]
    assert workers["replicas"] == 3
    container = workers["template"]["spec"]["containers"][0]
    assert container["image"] == "reg/rlpost:1" and container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert KubeRayJob("a", "i", [], 0, 1, 0, "1Gi", "p").manifest().count("workerGroupSpecs: []") == 1


@pytest.mark.parametrize("argv", [["slurm", "--help"], ["ray", "-h"], ["kuberay", "--help", "--", "train"],
                                  ["slurm", "--nodes=2", "--help", "--", "train", "a=1"]])
def test_each_launcher_prints_its_usage_on_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert launch(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rlpost launch slurm") and f"rlpost launch {argv[0]}" in out



@pytest.mark.parametrize(("argv", "key"), [
    (["slurm", "--nodes-timeout-s=-5", "--", "train"], "--nodes-timeout-s"),
    (["slurm", "--run-dir=", "--", "train"], "--run-dir"),
    (["ray", "--address", "http://h:8265", "--run-dir", " ", "--", "train"], "--run-dir"),
    (["kuberay", "--image", "i", "--pvc", "p", "--gpus", "-2", "--", "train"], "--gpus"),
    (["kuberay", "--image", "i", "--pvc", "p", "--cpus", "0", "--", "train"], "--cpus"),
    (["kuberay", "--image", "i", "--pvc", "p", "--memory", "lots", "--", "train"], "--memory"),
])
def test_launcher_numbers_and_paths_are_checked_before_anything(argv: list[str], key: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert launch(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlpost: config error: {key}=") and err.count("\n") <= 2, err
