"""`rlpost plan`: the derived numbers of a config, printed without starting Ray or loading a model."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from rlpost.config.layout import Layout, layout_of, prev_logprobs_pass
from rlpost.config.schema.master import MasterConfig

_PREV_PASS = {
    "on-policy": "skipped: one optimizer step per rollout batch, so the ratio is exactly 1",
    "forced": "skipped: loss_fn.force_on_policy_ratio=true (ratio taken as 1)",
    "computed": "computed: several optimizer steps per rollout batch",
    "not needed": "not needed by this loss",
}


def plan_rows(cfg: MasterConfig) -> list[tuple[str, str]]:
    """(label, value) rows describing what one run will do."""
    lay: Layout = layout_of(cfg)
    p, g = cfg.policy, cfg.grpo
    backend = p._target_.rsplit(".", 1)[-1]
    engine = p.generation._target_.rsplit(".", 1)[-1]
    placement = (
        f"colocated: policy and engine share {lay.train_world} worker slot(s) on {lay.train_nodes} node(s)"
        if lay.colocated
        else (
            f"split: training on {lay.train_nodes} node(s) x {lay.train_workers_per_node}, "
            f"generation on {lay.gen_nodes} node(s) x {lay.gen_workers_per_node}"
        )
    )
    mbs = p.train_micro_batch_size
    return [
        ("model", str(p.model_name)),
        ("policy backend", backend),
        ("rollout engine", engine),
        ("loss", cfg.loss_fn._target_.rsplit(".", 1)[-1]),
        ("device", cfg.cluster.device),
        ("prompts per step", str(lay.prompts_per_step)),
        ("completions per step", f"{lay.completions_per_step} ({g.num_prompts_per_step} x {g.num_generations_per_prompt})"),
        ("optimizer steps per GRPO step", f"{lay.optimizer_steps_per_grpo_step} (global batch {p.train_global_batch_size})"),
        (
            "micro-batches per optimizer step",
            f"{lay.micro_batches_per_optimizer_step} per DP rank (micro-batch {mbs})",
        ),
        ("training layout", f"DP={lay.dp} TP={lay.tp} PP={lay.pp} CP={lay.cp} ({lay.train_world} workers)"),
        ("engine layout", f"{lay.gen_replicas} replica(s) x TP*PP={lay.gen_tp} ({lay.gen_world} workers)"),
        ("placement", placement),
        ("prev-logprobs pass", _PREV_PASS[prev_logprobs_pass(cfg)]),
        ("rollouts", _rollouts(cfg)),
        ("steps", f"max {g.max_num_steps} steps / {g.max_num_epochs} epoch(s); validate every {g.val_period}"),
    ]


def print_plan(cfg: MasterConfig, console: Console | None = None) -> None:
    """Render the plan as a table."""
    table = Table(title="rlpost plan", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for label, value in plan_rows(cfg):
        table.add_row(label, value)
    (console or Console()).print(table)


def _rollouts(cfg: MasterConfig) -> str:
    """Single-turn, or multi-turn with its driver (rlpost.algorithms.multi_turn)."""
    turns = cfg.grpo.max_rollout_turns
    if turns == 1:
        return "single-turn"
    how = ("one coroutine per episode (vLLM async engine)" if cfg.policy.generation.async_rollouts()
           else "turns in lock-step, one batched generate per turn")
    return (f"multi-turn: up to {turns} model turns per episode within {cfg.policy.max_total_sequence_length} "
            f"tokens; {how}; environment tokens masked out of the loss")
