"""The defaults that follow the run's device (rlpost.config.device_defaults): bf16 and CUDA graphs on CUDA, fp32 and
eager on CPU, a value the user sets always winning, and `rlpost plan` saying which."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpost.cli import main
from rlpost.config.device_defaults import auto_device, gpu_visible
from rlpost.config.errors import ConfigError
from rlpost.config.load import load_master_config
from rlpost.plan import STARTUP_COLOCATED, plan_rows

SPLIT = ["cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
         "policy.generation.colocated.resources.gpus_per_node=1"]


def _dtypes(*overrides: str) -> tuple[str, str, bool | None]:
    """(policy precision, engine precision, vLLM enforce_eager or None for the HF engine) of a config."""
    _, cfg = load_master_config(list(overrides))
    g = cfg.policy.generation
    assert g is not None
    v = getattr(g, "vllm_cfg", None)
    return cfg.policy.precision, g.weight_dtype(), (v.enforce_eager if v is not None else None)


def test_cuda_defaults_to_bf16_and_cuda_graphs_cpu_to_fp32_and_eager() -> None:
    assert _dtypes("cluster.device=cuda") == ("bfloat16", "bfloat16", False)
    assert _dtypes("cluster.device=cpu") == ("float32", "float32", True)
    assert _dtypes("cluster.device=cuda", "generation=hf") == ("bfloat16", "bfloat16", None)
    _, meg = load_master_config(["cluster.device=cuda", "policy=megatron"])
    assert meg.policy.megatron_cfg.pipeline_dtype == "bfloat16"  # type: ignore[attr-defined]


def test_a_value_the_user_sets_wins() -> None:
    assert _dtypes("cluster.device=cuda", "policy.precision=float32") == ("float32", "float32", False)
    assert _dtypes("cluster.device=cuda", "policy.generation.vllm_cfg.enforce_eager=true")[2] is True
    assert _dtypes("cluster.device=cuda", "policy.generation.vllm_cfg.precision=float32")[:2] == ("bfloat16",
                                                                                                "float32")
    assert _dtypes("cluster.device=cpu", "policy.precision=bfloat16")[:2] == ("bfloat16", "bfloat16")
    _, exp = load_master_config(["experiment=qwen2_5_1_5b_math", "data.train_data_path=t.jsonl"])
    assert exp.policy.precision == "bfloat16"  # the experiment sets it (and CUDA graphs) itself
    _, sft = load_master_config(["algo=sft", "cluster.device=cuda"])  # no engine: the trainer's precision alone
    assert sft.policy.precision == "bfloat16" and sft.policy.generation is None


def test_auto_follows_what_this_machine_has() -> None:
    from rlpost.config.schema.cluster import ClusterConfig
    from rlpost.distributed.virtual_cluster import resolve_device

    expected = "bfloat16" if auto_device() == "cuda" else "float32"
    assert _dtypes()[0] == expected
    assert auto_device() == resolve_device(ClusterConfig(device="auto"))  # the driver's torch-based answer agrees


def test_a_gpu_is_visible_through_its_device_node_unless_cuda_visible_devices_hides_it(tmp_path: Path) -> None:
    assert not gpu_visible({}, tmp_path)
    (tmp_path / "nvidiactl").touch()  # the control node alone is no GPU
    assert not gpu_visible({}, tmp_path)
    (tmp_path / "nvidia0").touch()
    assert gpu_visible({}, tmp_path) and gpu_visible({"CUDA_VISIBLE_DEVICES": "0"}, tmp_path)
    assert not gpu_visible({"CUDA_VISIBLE_DEVICES": ""}, tmp_path)
    assert not gpu_visible({"CUDA_VISIBLE_DEVICES": "-1"}, tmp_path)
    assert not gpu_visible({}, tmp_path / "missing")


def test_a_bad_precision_exits_2_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_master_config(["policy.precision=bf16"])
    assert err.value.key == "policy.precision" and "'auto'" in err.value.rule
    assert main(["plan", "policy.precision=bf16"]) == 2
    assert "policy.precision='bf16'" in capsys.readouterr().err


def test_the_plan_shows_precision_start_up_order_and_refit_per_device() -> None:
    cuda = dict(plan_rows(load_master_config(["cluster.device=cuda", "cluster.gpus_per_node=2",
                                              "policy.train_micro_batch_size=8"])[1]))
    assert cuda["precision"] == "trainer bfloat16, engine bfloat16"
    assert cuda["engine execution"].startswith("CUDA graphs")
    assert cuda["start-up"] == STARTUP_COLOCATED == "engine first, asleep, then the policy"
    assert cuda["refit"].endswith("(CUDA IPC per GPU: each engine reads the policy rank on its own GPU)")
    cpu = dict(plan_rows(load_master_config(["cluster.device=cpu"])[1]))
    assert cpu["precision"] == "trainer float32, engine float32"
    assert cpu["engine execution"].startswith("eager")
    assert cpu["start-up"] == STARTUP_COLOCATED
    assert cpu["refit"].endswith("(shared memory, one buffer per colocated pair)")
    split = dict(plan_rows(load_master_config(["cluster.device=cuda", *SPLIT])[1]))
    assert "start-up" not in split and split["refit"].startswith("collective: ")
    assert dict(plan_rows(load_master_config(["algo=sft", "cluster.device=cuda"])[1]))["precision"] == "bfloat16"


def test_rlpost_plan_on_cuda_runs_on_a_machine_without_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "cluster.device=cuda"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "trainer bfloat16, engine bfloat16" in out and "engine first, asleep, then the policy" in out
    assert "CUDA IPC per GPU" in out
