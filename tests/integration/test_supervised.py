"""SFT, DPO and reward-model training end to end through the installed `rlpost train algo=...`: each learns on
its tiny generated default, DTensor and Megatron agree on SFT, resume after kill -9 continues the same run,
and the exports load with transformers."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest

from tests.fault_table import Record
from tests.integration.cli_runs import AC, RESUMED_SKIPS, RLPOST, env, kill_9_after_checkpoint, metrics, train

pytestmark = pytest.mark.slow


def validations(run: Path) -> list[dict]:
    return [m for m in metrics(run) if "validation/loss" in m]


def _hf(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step}" / "policy" / "weights" / "hf"


def test_sft_memorises_a_mapping_and_the_export_reproduces_it(cache: Path, tmp_path: Path) -> None:
    """16 random keys -> two-digit values: after training, greedy decoding from the HF export (transformers,
    outside rlpost) answers every key exactly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlpost.config.schema.supervised import SFTDataConfig, SupervisedTaskConfig
    from rlpost.data.supervised_rows import load_supervised_rows

    run = tmp_path / "memorise"
    task = ["data.synthetic.task=memorise", "data.synthetic.num_train=16", "data.synthetic.num_val=16"]
    train(run, cache, "algo=sft", *task, "sft.max_num_epochs=1000", "sft.max_num_steps=120", "sft.val_period=60",
          "sft.val_global_batch_size=16", "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16",
          "policy.optimizer.kwargs.lr=5e-3", "checkpointing.save_period=120")
    assert validations(run)[-1]["validation/token_accuracy"] == 1.0
    model = AutoModelForCausalLM.from_pretrained(_hf(run, 120))
    tok = AutoTokenizer.from_pretrained(_hf(run, 120))
    rows = load_supervised_rows(SFTDataConfig(synthetic=SupervisedTaskConfig(task="memorise", num_train=16)), "train")
    for row in rows:
        prompt, answer = row["messages"][0]["content"], row["messages"][1]["content"]
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == answer, prompt


def test_dpo_learns_the_preference_with_a_finite_kl_in_a_learning_rate_sweep(cache: Path, tmp_path: Path) -> None:
    """`rlpost train -m algo=dpo` over two learning rates (DPO's reference pass in each job): at the default rate,
    1e-3, the preference is learned with a finite KL; the other job trains on its own rate."""
    out = subprocess.run(
        [RLPOST, "train", "-m", "algo=dpo", "policy.optimizer.kwargs.lr=1e-3,3e-4", "dpo.max_num_steps=30",
         "checkpointing=disabled", AC, f"hydra.sweep.dir={tmp_path}"],
        env=env(cache), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    val = validations(tmp_path / "0")
    assert val[0]["validation/accuracy"] == 0.0 and val[0]["validation/kl_to_reference"] == pytest.approx(0.0)
    assert val[-1]["validation/accuracy"] > 0.9, val
    assert val[-1]["validation/reward_margin"] > 0
    assert all(0 <= m["validation/kl_to_reference"] < 10 for m in val), val
    other = validations(tmp_path / "1")
    assert len(other) == len(val) and other[-1]["validation/loss"] != val[-1]["validation/loss"]


def test_reward_model_ranks_pairs_and_serves_as_a_grpo_environment(cache: Path, tmp_path: Path) -> None:
    """algo=rm: pairwise accuracy above 0.9; the HF export, loaded with AutoModelForSequenceClassification, scores
    the chosen answers of held-out pairs above the rejected ones on its own; and GRPO with env=reward_model
    raises the reward model's score."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlpost.config.schema.supervised import PreferenceDataConfig
    from rlpost.data.supervised_rows import load_supervised_rows

    run = tmp_path / "rm"
    train(run, cache, "algo=rm", "checkpointing.save_period=1000", AC)
    assert validations(run)[-1]["validation/accuracy"] > 0.9
    hf = _hf(run, 120)
    model = AutoModelForSequenceClassification.from_pretrained(hf).eval()
    tok = AutoTokenizer.from_pretrained(hf)
    assert model.config.num_labels == 1 and model.config.architectures == ["Qwen2ForSequenceClassification"]
    pairs = load_supervised_rows(PreferenceDataConfig(), "val")
    right = 0
    with torch.no_grad():
        for p in pairs:
            text = p["prompt"][0]["content"]
            score = [float(model(torch.tensor([tok(text + r, add_special_tokens=False)["input_ids"]
                                               + [tok.eos_token_id]])).logits[0, 0]) for r in (p["chosen"], p["rejected"])]
            right += score[0] > score[1]
    assert right / len(pairs) > 0.9

    # The trained reward model as GRPO's environment: GRPO raises its score.
    grpo = tmp_path / "grpo_with_rm"
    train(grpo, cache, "env=reward_model", "data.env_name=reward_model", f"env.reward_model.model_path={hf}",
          "grpo.max_num_steps=40", "grpo.val_period=0", "checkpointing=disabled")
    rewards = [m["train/reward"] for m in metrics(grpo)]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 1.0, rewards


def test_a_directory_that_is_not_a_reward_model_is_refused(cache: Path, tmp_path: Path) -> None:
    from tests.integration.cli_runs import RLPOST

    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    out = subprocess.run([RLPOST, "train", f"hydra.run.dir={tmp_path / 'run'}", "env=reward_model",
                          "data.env_name=reward_model", f"env.reward_model.model_path={causal}"],
                         env=env(cache), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "env.reward_model.model_path" in out.stderr and "not a reward model" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_diverged_sft_run_exits_3_and_keeps_the_last_good_checkpoint(cache: Path, tmp_path: Path) -> None:
    """lr=1e30 leaves finite but huge weights after step 1 (saved: it is still finite) and breaks step 2: the
    shared health check (GRPO's check_finite) stops the run with exit 3 and one line naming the lr, before the
    broken step is saved."""
    run = tmp_path / "diverged"
    out = subprocess.run([RLPOST, "train", f"hydra.run.dir={run}", "algo=sft", "sft.max_num_steps=4",
                          "sft.val_period=0", "checkpointing.metric_name=train:loss", "checkpointing.save_period=1",
                          "policy.optimizer.kwargs.lr=1e30"],
                         env=env(cache), capture_output=True, text=True, timeout=300)
    assert out.returncode == 3, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("rlpost: error: ") and "not finite" in last and "lr=1e+30" in last, last
    assert "its checkpoints up to step_1 are kept" in last, last
    assert "Traceback" not in out.stderr
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_1"]
    assert "Traceback" in (run / "train.log").read_text()


def test_dtensor_and_megatron_give_the_same_sft_loss_curve(cache: Path, tmp_path: Path) -> None:
    """Same data, weights and Adam settings (no clipping: Megatron on CPU has none): per-step training losses and
    the validation losses agree to 1e-4."""
    common = ["algo=sft", "sft.max_num_steps=6", "sft.val_period=3", "checkpointing=disabled",
              "policy.max_grad_norm=null", "data.shuffle=false"]
    curves = {}
    for backend in ("dtensor", "megatron"):
        run = tmp_path / backend
        train(run, cache, f"policy={backend}", *common)
        curves[backend] = {(m["step"], k): v for m in metrics(run) for k, v in m.items()
                           if k in ("train/loss", "validation/loss")}
    assert len(curves["dtensor"]) == 6 + 3
    for key, value in curves["dtensor"].items():
        assert curves["megatron"][key] == pytest.approx(value, abs=1e-4), key


@pytest.mark.faults
def test_sft_learns_and_a_resume_after_kill_9_matches_the_straight_run(cache: Path, tmp_path: Path,
                                                                       fault: Record) -> None:
    """The default `rlpost train algo=sft` (copy_digit) with a reduced budget: the loss on held-out rows falls and
    greedy decoding of the held-out answers becomes right. The same command killed with -9 after a checkpoint and
    run again resumes and logs what the straight run did."""
    steps = 20
    common = ["algo=sft", f"sft.max_num_steps={steps}", "sft.val_period=10", "checkpointing.save_period=2", AC]
    straight = tmp_path / "straight"
    out = train(straight, cache, *common)
    val = validations(straight)
    assert [m["step"] for m in val] == [0, 10, 20]
    assert val[-1]["validation/loss"] < 0.5 * val[0]["validation/loss"], val
    assert val[-1]["validation/token_accuracy"] >= 0.9, val
    assert f"done: {steps} SFT steps" in out.stderr

    resumed = tmp_path / "resumed"
    kill_9_after_checkpoint(resumed, cache, *common)
    out = train(resumed, cache, *common)
    found = re.search(r"resuming from step (\d+)", out.stderr)
    assert found is not None and 2 <= int(found.group(1)) < steps, out.stderr[-2000:]
    a = {m["step"]: m for m in metrics(straight)}
    b = {m["step"]: m for m in metrics(resumed)}
    fault("kill -9 of an SFT run, then the same command", out.returncode, out.stdout + out.stderr,
          data_lost=sorted(b) != list(range(0, steps + 1)))
    assert sorted(a) == sorted(b) == list(range(0, steps + 1))
    for step in range(int(found.group(1)) + 1, steps + 1):
        for k, v in a[step].items():
            if not k.startswith(RESUMED_SKIPS):
                assert b[step][k] == pytest.approx(v, abs=1e-6), (step, k)
    again = train(resumed, cache, *common)  # complete: answered before anything starts
    assert f"run already complete: {steps} steps, sft.max_num_steps={steps}" in again.stderr
    assert "rlpost plan" in again.stdout + again.stderr and "SFT steps" not in again.stderr


def test_sft_packing_dynamic_batching_and_two_workers_train_the_same_steps(cache: Path, tmp_path: Path) -> None:
    """Sequence packing and dynamic batching cut the micro-batches differently; the globally normalised loss
    and the update are the same as with fixed micro-batches. Two workers at TP=2 (the vocabulary-parallel token
    accuracy) train the same steps as one. The runs train LoRA adapters (SFT accepts them)."""
    rows = {}
    for name, extra in (("fixed", ["policy.dynamic_batching.enabled=false"]),
                        ("packing", ["policy.sequence_packing.enabled=true"]),
                        ("dynamic", []),  # SFT's default
                        ("tp2", ["cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2"])):
        run = tmp_path / name
        train(run, cache, "algo=sft", "sft.max_num_steps=3", "sft.val_period=0", "sft.val_at_start=false",
              "checkpointing=disabled", "policy.dtensor_cfg.lora_cfg.enabled=true", *extra)
        rows[name] = metrics(run)
    losses = {name: [m["train/loss"] for m in r] for name, r in rows.items()}
    assert len(losses["fixed"]) == 3
    for name in ("packing", "dynamic"):
        assert losses[name] == pytest.approx(losses["fixed"], abs=1e-5), name
    for a, b in zip(rows["dynamic"], rows["tp2"], strict=True):
        for k in ("train/loss", "train/grad_norm", "train/token_accuracy"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-5), (a["step"], k)


@pytest.mark.parametrize("algo,layout", [
    # each data-parallel rank gets whole pairs (RM's batches are the same); LoRA adapters, the reference the base
    # (SFT's two workers: test_sft_packing_dynamic_batching_and_two_workers_train_the_same_steps)
    ("dpo", ["cluster.gpus_per_node=2"]),
])
def test_two_workers_train_the_same_steps_as_one(algo: str, layout: list[str], cache: Path, tmp_path: Path) -> None:
    lora = ["policy.dtensor_cfg.lora_cfg.enabled=true"] if algo == "dpo" else []
    common = [f"algo={algo}", f"{algo}.max_num_steps=3", f"{algo}.val_period=3", f"{algo}.val_at_start=false",
              "checkpointing=disabled", *lora]
    runs = {}
    for name, extra in (("one", []), ("two", layout)):
        runs[name] = tmp_path / name
        train(runs[name], cache, *common, *extra)
    keys = ("train/loss", "train/grad_norm", "validation/loss", "train/accuracy", "train/token_accuracy")
    one, two = metrics(runs["one"]), metrics(runs["two"])
    assert len(one) == len(two) == 3
    if lora:  # B starts at zero: the first step's policy is its reference (the adapters-off base), so the loss is ln 2
        assert one[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    for a, b in zip(one, two, strict=True):
        for k in keys:
            if k in a:  # relative too: a grad norm of 8.4 summed over DP ranks in another order moves by ~1e-6 of it
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-5), (a["step"], k)
