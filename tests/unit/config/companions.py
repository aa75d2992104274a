"""Config options that need a companion override to form a valid job (shared by the compose and target tests)."""

from __future__ import annotations

COMPANIONS: dict[tuple[str, str], list[str]] = {
    ("data", "math_jsonl"): ["env=math", "data.train_data_path=/tmp/train.jsonl"],
    ("env", "math"): ["data=math_jsonl", "data.train_data_path=/tmp/train.jsonl"],
    ("experiment", "qwen2_5_1_5b_math"): ["data.train_data_path=/tmp/train.jsonl"],
    ("cluster", "ray"): ["policy.train_micro_batch_size=8"],
    ("model", "local"): ["model.path=/models/any"],
    ("data", "arith"): ["env=math"],
    ("data", "calc"): ["env=calculator"],
    ("env", "calculator"): ["data=calc"],
    ("data", "lookup"): ["env=lookup"],
    ("env", "lookup"): ["data=lookup"],
    ("data", "guess_game"): ["env=guess_game"],
    ("env", "guess_game"): ["data=guess_game"],
    ("env", "reward_model"): ["data.env_name=reward_model", "env.reward_model.model_path=/tmp/rm"],
    ("data", "sft_synthetic"): ["algo=sft"],
    ("data", "sft_jsonl"): ["algo=sft", "data.train_data_path=/tmp/train.jsonl", "data.val_data_paths=[/tmp/v.jsonl]"],
    ("data", "preference_synthetic"): ["algo=dpo"],
    ("data", "preference_jsonl"): ["algo=dpo", "data.train_data_path=/tmp/pairs.jsonl",
                                   "data.val_data_paths=[/tmp/v.jsonl]"],
    ("loss", "nll"): ["algo=sft"],
    ("loss", "dpo"): ["algo=dpo"],
    ("loss", "preference"): ["algo=rm"],
    ("algo", "distillation"): ["distillation.teacher.model_path=/tmp/teacher"],
    ("loss", "distillation"): ["distillation=teacher", "distillation.teacher.model_path=/tmp/teacher"],
    ("distillation", "teacher"): ["distillation.teacher.model_path=/tmp/teacher", "loss_fn.distillation_kl_coef=0.1"],
    ("experiment", "smollm2_arith_distill_cpu"): ["distillation.teacher.model_path=/tmp/teacher"],
}
