"""`rlpost eval`: score a model directory or a checkpoint's HF export on a data set with the
generation engine and the environments of the config: accuracy (share of samples with reward 1),
pass@k (share of prompts with at least one such sample among k = eval.num_samples) and mean
generated length, printed and written as JSON.

Prompts go in validation's batches (grpo.val_batch_size) with validation's seeds for the checkpoint's step, so
`rlpost eval eval.checkpoint=…/step_N` (eval.num_samples=1, eval.max_prompts=grpo.max_val_samples) scores
exactly what the run's validation at step N scored, from the HF export alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from rlpost.config.errors import ConfigError
from rlpost.config.schema.lora import ADAPTER_CONFIG
from rlpost.config.schema.master import MasterConfig
from rlpost.models.generation.interfaces import GenerationInterface


def weights_dir(cfg: MasterConfig) -> str:
    """The directory to evaluate: eval.checkpoint's HF export (policy/weights/hf) or LoRA adapter
    (policy/weights/adapter, merged into its base by `evaluate`), else policy.model_name."""
    if cfg.eval.checkpoint is None:
        if cfg.model.tiny is not None:  # built on first use, inside model.cache_dir only
            from rlpost.models.tiny import ensure_tiny_model

            ensure_tiny_model(cfg.model.tiny, cfg.model.path)
        return str(cfg.policy.model_name)
    weights = Path(cfg.eval.checkpoint).expanduser() / "policy" / "weights"
    hf, adapter = weights / "hf", weights / "adapter"
    if (hf / "config.json").is_file():
        return str(hf)
    if (adapter / ADAPTER_CONFIG).is_file():
        return str(adapter)
    raise ConfigError("eval.checkpoint", cfg.eval.checkpoint,
                      f"has no HF export at {hf} and no LoRA adapter at {adapter} (a checkpoint step_N saved with "
                      "checkpointing.save_consolidated=true)")


def checkpoint_step(cfg: MasterConfig) -> int:
    """The training step of eval.checkpoint (…/step_N), 0 for a model directory: sampling uses the seeds the
    run's validation used at that step, so eval.num_samples=1 reproduces it (step 0 = the base model)."""
    if cfg.eval.checkpoint is None:
        return 0
    name = Path(cfg.eval.checkpoint).expanduser().resolve().name
    return int(name.split("_", 1)[1]) if name.startswith("step_") and name[5:].isdigit() else 0


def default_output() -> Path:
    return Path("outputs") / "eval" / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S") / "eval.json"


def summarize(rewards: torch.Tensor, lengths: torch.Tensor, k: int) -> dict[str, float]:
    """rewards/lengths [P * k], prompt-major: accuracy, pass@k, mean length."""
    correct = (rewards == 1.0).float().view(-1, k)
    return {
        "accuracy": float(correct.mean()),
        f"pass@{k}": float(correct.max(dim=1).values.mean()),
        "mean_reward": float(rewards.mean()),
        "mean_length": float(lengths.float().mean()),
        "num_prompts": float(correct.shape[0]),
        "num_samples": float(correct.numel()),
    }


def evaluate(cfg: MasterConfig) -> dict[str, Any]:
    """Generate k samples per prompt, score them, return the report (and write it as JSON)."""
    import ray

    from rlpost.algorithms.collect import validation_seeds
    from rlpost.algorithms.grpo_setup import close_all
    from rlpost.algorithms.multi_turn import run_rollouts, turn_settings
    from rlpost.config.layout import layout_of
    from rlpost.data.prompts import PromptProcessor, load_prompt_rows, load_tokenizer, prompt_room
    from rlpost.distributed.virtual_cluster import RayVirtualCluster, init_ray, resolve_device
    from rlpost.runtime.build import build
    from rlpost.runtime.run_log import capture_driver_output

    model = weights_dir(cfg)
    out = Path(cfg.eval.output) if cfg.eval.output else default_output()
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")  # third-party output (engine, Ray, a LoRA merge) goes here, not to the console
    logging.getLogger().addHandler(logging.FileHandler(log))
    capture_driver_output(log)
    if (Path(model) / ADAPTER_CONFIG).is_file():
        from rlpost.models.dtensor.lora import merge_peft_dir

        model = str(merge_peft_dir(Path(model), out.parent / "merged_model"))
    tok_cfg = dataclasses.replace(cfg.policy.tokenizer, name=model) if cfg.eval.checkpoint else cfg.policy.tokenizer
    tokenizer = load_tokenizer(tok_cfg, cfg.policy.trust_remote_code)
    processor = PromptProcessor(cfg.data, tokenizer, cfg.policy.tokenizer.chat_template_kwargs, room=prompt_room(cfg))
    rows = load_prompt_rows(cfg.data, processor, cfg.eval.split)[0][: cfg.eval.max_prompts]
    k = cfg.eval.num_samples
    prompts = [p for p in processor.batch(rows) for _ in range(k)]
    envs = {name: build(env_cfg, key=f"env.{name}._target_") for name, env_cfg in cfg.env.items()}
    engine: GenerationInterface | None = None
    cluster = None
    t0 = time.perf_counter()
    try:
        init_ray(cfg.cluster)
        use_gpus = resolve_device(cfg.cluster) == "cuda"
        cluster = RayVirtualCluster("rlpost_eval", layout_of(cfg).gen_tp, 1, use_gpus,
                                    cfg.cluster.worker_num_cpus, 1, cfg.cluster.placement_timeout_s)
        gen_cfg = dataclasses.replace(cfg.generation, model_name=model)
        engine = build(gen_cfg, cluster, model_path=model, timeout_s=cfg.cluster.call_timeout_s,
                       key="policy.generation._target_")
        rewards: list[torch.Tensor] = []
        lengths: list[torch.Tensor] = []
        responses: list[str] = []
        step = checkpoint_step(cfg)
        for start in range(0, len(rows), cfg.grpo.val_batch_size):  # validate()'s batches and seeds
            part = prompts[start * k : (start + cfg.grpo.val_batch_size) * k]
            n = len(part) // k
            per_repeat = [validation_seeds(cfg.grpo.seed, step, start, n, repeat=j) for j in range(k)]
            seeds = [per_repeat[j][i] for i in range(n) for j in range(k)]
            batch = run_rollouts(part, torch.arange(len(part)) // k, engine, tokenizer, envs,
                                 turn_settings(cfg, greedy=cfg.eval.greedy), cfg.generation.async_rollouts(),
                                 seeds=seeds)
            rewards.append(batch.rewards)
            lengths.append(batch.gen["generation_lengths"])
            responses += batch.responses
    finally:
        close_all([*[x.shutdown for x in (engine, cluster) if x is not None], *[e.shutdown for e in envs.values()]])
        if ray.is_initialized():
            ray.shutdown()
    all_rewards = torch.cat(rewards)
    report: dict[str, Any] = {
        "model": model,
        "data": cfg.data.dataset_name if cfg.data.dataset_name != "synthetic" else f"synthetic:{cfg.data.synthetic.task}",
        "split": cfg.eval.split,
        "k": k,
        "greedy": cfg.eval.greedy,
        "step": step,
        **summarize(all_rewards, torch.cat(lengths), k),
        "wall_s": round(time.perf_counter() - t0, 2),
        "samples": [{"prompt": r["problem"], "response": responses[i * k], "reward": float(all_rewards[i * k])}
                    for i, r in enumerate(rows[:5])],
    }
    out.write_text(json.dumps(report, indent=1))
    report["output"] = str(out)
    return report
