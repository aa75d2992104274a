"""`rlpost plan`: the derived numbers of a config, printed without starting Ray or loading a model."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from rlpost.config.algorithms import rollout_plan_rows
from rlpost.config.device_defaults import run_device
from rlpost.config.layout import (
    IPC_BUFFERS,
    REFIT_TRANSPORTS,
    Layout,
    chunk_tokens,
    fsdp_wrapping,
    layout_of,
    prev_logprobs_pass,
)
from rlpost.config.lora_params import describe as describe_parameters
from rlpost.config.lora_params import is_megatron, model_shape, parameter_counts
from rlpost.config.model_counts import is_moe, num_experts
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.policy import PolicyConfig
from rlpost.config.schema.supervised_master import SupervisedMasterConfig
from rlpost.memory_plan import memory_json, memory_rows

_PREV_PASS = {
    "on-policy": "skipped: one optimizer step per rollout batch, so the ratio is exactly 1",
    "forced": "skipped: loss_fn.force_on_policy_ratio=true (ratio taken as 1)",
    "computed": "computed: several optimizer steps per rollout batch",
    "one-step async": "skipped: one optimizer step per batch, so the ratio is exactly 1 (the batch's older "
                      "generating weights enter through the importance-sampling weights)",
    "not needed": "not needed by this loss",
}


_WHAT = {
    "sft": "supervised fine-tuning: token-level NLL on the assistant tokens only",
    "dpo": "DPO: preference pairs, implicit reward beta * (log pi - log pi_ref) summed over the response",
    "rm": "reward model: a one-label sequence classifier trained with the Bradley-Terry loss on pairs",
}


def supervised_plan_rows(cfg: SupervisedMasterConfig) -> list[tuple[str, str]]:
    """(label, value) rows of an SFT / DPO / RM run."""
    p, loop, d = cfg.policy, cfg.loop, cfg.rows
    rows = p.train_global_batch_size // (2 if cfg.pairs else 1)
    unit = "pairs (chosen and rejected side by side)" if cfg.pairs else "rows"
    source = (f"generated ({d.synthetic.task}, {d.synthetic.num_train} train / {d.synthetic.num_val} val)"
              if d.dataset_name == "synthetic" else f"{d.dataset_name}: {d.train_data_path}")
    lora_key, lora = p.lora_settings("policy")
    reference = ("none" if cfg.algo != "dpo" else
                 "computed once per batch (and per validation batch): the base model, adapters switched off"
                 if lora.enabled else
                 "computed once per batch (and per validation batch) by the policy with its starting weights")
    return [
        ("algorithm", _WHAT[cfg.algo]),
        ("model", str(p.model_name)),
        ("policy backend", p._target_.rsplit(".", 1)[-1]),
        ("parameters", describe_parameters(model_shape(cfg), lora, is_megatron(lora_key), _frozen_routers(cfg))),
        ("loss", cfg.loss_fn._target_.rsplit(".", 1)[-1]),
        ("device", _device(cfg.cluster.device)),
        ("precision", p.precision),
        ("data", source),
        ("rows per step", f"{rows} {unit} = global batch {p.train_global_batch_size} sequences"),
        ("training layout", f"DP={cfg.dp} ({cfg.cluster.num_nodes * cfg.cluster.gpus_per_node} workers), "
                            f"micro-batch {p.train_micro_batch_size}"),
        ("reference policy", reference),
        ("long sequences", _long_sequences(cfg)),
        ("batching", _batching(p)),
        ("steps", f"max {loop.max_num_steps} steps / {loop.max_num_epochs} epoch(s); " + (
            f"validate every {loop.val_period} ({loop.val_global_batch_size} sequences a batch)" if loop.val_period
            else "no validation during training")),
    ]


def _batching(p: PolicyConfig) -> str:
    """How the policy cuts its micro-batches."""
    if p.sequence_packing.enabled:
        return f"sequence packing ({p.sequence_packing.train_mb_tokens:,} tokens per training micro-batch)"
    d = p.dynamic_batching
    if d.enabled:
        return (f"dynamic: micro-batches of at most {d.train_mb_tokens:,} tokens (training) / "
                f"{d.logprob_mb_tokens:,} (logprobs), longest rows first")
    return f"fixed micro-batches of {p.train_micro_batch_size} rows"


def _micro_batches(p: PolicyConfig, fixed: int) -> str:
    """The GRPO plan's micro-batch row: `fixed` micro-batches of train_micro_batch_size rows per DP rank, or, with
    dynamic batching, at most that many (each holds at least as many rows as a fixed one)."""
    if p.dynamic_batching.enabled:
        return (f"at most {fixed} per DP rank: dynamic batching, up to {p.dynamic_batching.train_mb_tokens:,} tokens "
                "each, the longest rows first")
    if p.sequence_packing.enabled:
        return f"packed to {p.sequence_packing.train_mb_tokens:,} tokens each (sequence packing)"
    return f"{fixed} per DP rank (micro-batch {p.train_micro_batch_size})"


def plan_rows(cfg: MasterConfig | SupervisedMasterConfig) -> list[tuple[str, str]]:
    """(label, value) rows describing what one run will do."""
    if isinstance(cfg, SupervisedMasterConfig):
        return supervised_plan_rows(cfg)
    lay: Layout = layout_of(cfg)
    p, g = cfg.policy, cfg.grpo
    backend = p._target_.rsplit(".", 1)[-1]
    engine = cfg.generation._target_.rsplit(".", 1)[-1]
    placement = (
        f"colocated: policy and engine share {lay.train_world} worker slot(s) on {lay.train_nodes} node(s)"
        if lay.colocated
        else (
            f"split: training on {lay.train_nodes} node(s) x {lay.train_workers_per_node}, "
            f"generation on {lay.gen_nodes} node(s) x {lay.gen_workers_per_node}"
        )
    )
    return [
        ("model", str(p.model_name)),
        ("policy backend", backend),
        ("parameters", describe_parameters(model_shape(cfg), p.lora_settings("policy")[1],
                                           is_megatron(p.lora_settings("policy")[0]), _frozen_routers(cfg))),
        ("rollout engine", engine),
        ("loss", cfg.loss_fn._target_.rsplit(".", 1)[-1]),
        *rollout_plan_rows(cfg, lay.train_world),
        ("device", _device(cfg.cluster.device)),
        ("precision", _precision(cfg)),
        *([("engine execution", mode)] if (mode := _execution(cfg)) else []),
        ("prompts per step", str(lay.prompts_per_step)),
        ("completions per step", f"{lay.completions_per_step} ({g.num_prompts_per_step} x {g.num_generations_per_prompt})"),
        ("optimizer steps per GRPO step", f"{lay.optimizer_steps_per_grpo_step} (global batch {p.train_global_batch_size})"),
        ("micro-batches per optimizer step", _micro_batches(p, lay.micro_batches_per_optimizer_step)),
        ("training layout", f"DP={lay.dp} TP={lay.tp} PP={lay.pp} CP={lay.cp}{_experts(cfg)} ({lay.train_world} workers)"
                            + (f"; {fsdp}" if (fsdp := fsdp_wrapping(cfg, lay.train_world)) else "")),
        ("long sequences", _long_sequences(cfg)),
        ("engine layout", f"{lay.gen_replicas} replica(s) x TP*PP={lay.gen_tp} ({lay.gen_world} workers)"),
        ("placement", placement),
        *([("start-up", STARTUP_COLOCATED)] if lay.colocated else []),
        *([("nodes", _nodes(lay))] if max(lay.train_nodes, lay.gen_nodes) > 1 else []),
        ("refit", _refit(cfg, lay)),
        ("prev-logprobs pass", _PREV_PASS[prev_logprobs_pass(cfg)]),
        ("rollouts", _rollouts(cfg)),
        ("generation and training", _overlap(cfg)),
        ("reproducible", _reproducible(cfg)),
        ("steps", f"max {g.max_num_steps} steps / {g.max_num_epochs} epoch(s); validate every {g.val_period}"),
    ]


def _long_sequences(cfg: MasterConfig | SupervisedMasterConfig) -> str:
    """How the training step bounds a long sequence's memory: the output layer in chunks, activation checkpointing,
    context parallelism."""
    p = cfg.policy
    backend = getattr(p, "dtensor_cfg", None) or getattr(p, "megatron_cfg", None)
    checkpointing = "on" if getattr(backend, "activation_checkpointing", False) else "off"
    vocab = (model_shape(cfg) or {}).get("vocab_size")
    if getattr(backend, "sequence_parallel", False):
        head = "the output layer makes the whole logits (sequence parallelism)"
    elif isinstance(vocab, int):
        rows = -(-vocab // p.parallel_sizes()["tp"])
        head = (f"the output layer read in chunks of up to {chunk_tokens(p.logprob_chunk_size, rows):,} tokens "
                "(policy.logprob_chunk_size), never the whole tokens x vocabulary logits")
    else:
        head = "the output layer read in chunks of policy.logprob_chunk_size tokens"
    cp = p.parallel_sizes()["cp"]
    split = f"; each sequence split over {cp} context-parallel ranks" if cp > 1 else ""
    return f"{head}; activation checkpointing {checkpointing}{split}"


STARTUP_COLOCATED = "engine first, asleep, then the policy"
"""The start-up order of a colocated engine and policy (rlpost.algorithms.grpo_setup)."""


def _device(device: str) -> str:
    """The device as configured; `auto` with what it picks on this machine (rlpost.config.device_defaults)."""
    return f"auto ({run_device(device)} on this machine)" if device == "auto" else device


def _precision(cfg: MasterConfig) -> str:
    """The trainer's and the engine's dtype (`policy.precision`, which the engine follows unless set apart)."""
    return f"trainer {cfg.policy.precision}, engine {cfg.generation.weight_dtype()}"


def _execution(cfg: MasterConfig) -> str | None:
    """vLLM's execution mode (`vllm_cfg.enforce_eager`); None for an engine without the choice."""
    eager = getattr(getattr(cfg.generation, "vllm_cfg", None), "enforce_eager", None)
    if eager is None:
        return None
    return "eager (vllm_cfg.enforce_eager=true)" if eager else "CUDA graphs (vllm_cfg.enforce_eager=false)"


def _span(name: str, first: int, count: int) -> str:
    return f"{name} {first}" if count == 1 else f"{name}s {first}-{first + count - 1}"


def _nodes(lay: Layout) -> str:
    """Which node gets which worker: consecutive ranks share a node (rank r on node r // workers per node), and an
    engine replica sits on the node of its first slot. A split layout reserves its training and generation nodes
    apart (Ray picks the machines; the run's console names them once placed)."""
    replicas = max(lay.gen_workers_per_node // lay.gen_tp, 1)
    ranks = [_span("policy rank", n * lay.train_workers_per_node, lay.train_workers_per_node)
             for n in range(lay.train_nodes)]
    engines = [_span("engine replica", n * replicas, replicas) for n in range(lay.gen_nodes)]
    if lay.colocated:
        return "; ".join(f"node {n}: {r}, {e}" for n, (r, e) in enumerate(zip(ranks, engines, strict=True)))
    return "; ".join([*(f"training node {n}: {r}" for n, r in enumerate(ranks)),
                      *(f"generation node {n}: {e}" for n, e in enumerate(engines))])


def print_plan(cfg: MasterConfig | SupervisedMasterConfig, console: Console | None = None) -> None:
    """Render the plan as a table: what the run will do, then its memory (rlpost.memory_plan)."""
    table = Table(title="rlpost plan", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for label, value in plan_rows(cfg) + memory_rows(cfg):
        table.add_row(label, value)
    (console or Console()).print(table)


def plan_json(cfg: MasterConfig | SupervisedMasterConfig) -> dict[str, object]:
    """The plan as one JSON object (`rlpost plan --json`, a run's plan.json): its rows by label, and `memory`."""
    return {"algo": cfg.algo, "rows": dict(plan_rows(cfg)), "memory": memory_json(cfg)}


def _rollouts(cfg: MasterConfig) -> str:
    """Single-turn, or multi-turn with its driver (rlpost.algorithms.multi_turn)."""
    turns = cfg.grpo.max_rollout_turns
    if turns == 1:
        return "single-turn"
    how = ("one coroutine per episode (vLLM async engine)" if cfg.generation.async_rollouts()
           else "turns in lock-step, one batched generate per turn")
    return (f"multi-turn: up to {turns} model turns per episode within {cfg.policy.max_total_sequence_length} "
            f"tokens; {how}; environment tokens masked out of the loss")


def _frozen_routers(cfg: MasterConfig | SupervisedMasterConfig) -> bool:
    """Whether the policy's MoE routers are frozen (Megatron's freeze_moe_router)."""
    m = getattr(cfg.policy, "megatron_cfg", None)
    return bool(m is not None and m.freeze_moe_router)


def _experts(cfg: MasterConfig) -> str:
    """A mixture of experts' layout: EP and the experts each rank holds of each layer."""
    hf = model_shape(cfg)
    n = num_experts(hf) if hf is not None and is_moe(hf) else 0
    ep = cfg.policy.parallel_sizes().get("ep", 1)
    return f" EP={ep}, {n // ep} of {n} experts per rank" if n else ""


def _refit(cfg: MasterConfig, lay: Layout) -> str:
    """The refit transport by name (rlpost.algorithms.refit), and for "ipc" the buffers on the run's device."""
    row = f"{lay.refit}: {REFIT_TRANSPORTS[lay.refit]}{_lora_refit(cfg)}"
    if lay.refit != "ipc":
        return row
    return f"{row} ({IPC_BUFFERS[run_device(cfg.cluster.device)]})"


def _lora_refit(cfg: MasterConfig) -> str:
    """With LoRA: what a refit moves (`lora_cfg.refit`)."""
    key, lora = cfg.policy.lora_settings("policy")
    if not lora.enabled:
        return ""
    if lora.refit == "merged":
        hint = "" if is_megatron(key) else f" ({key}.refit=adapter moves the adapters alone)"
        return f"; LoRA merged (W + {lora.alpha}/{lora.dim} * B @ A): every weight moves{hint}"
    hf = model_shape(cfg)
    counts = parameter_counts(hf, lora) if hf is not None else None
    size = ""
    if counts is not None:
        size = f" ({counts[0] * (4 if cfg.generation.weight_dtype() == 'float32' else 2) / 2**20:.1f} MiB)"
    return f"; LoRA adapter only{size}: vLLM serves it (enable_lora), replaced in place each version"


def _reproducible(cfg: MasterConfig) -> str:
    """Whether the same command gives the same metrics, and what makes it not."""
    if cfg.grpo.async_grpo.enabled:
        return ("no: which policy version generated each batch depends on timing (async GRPO); "
                "grpo.async_grpo.enabled=false is")
    if run_device(cfg.cluster.device) == "cuda":
        return ("not bit for bit on CUDA: kernels reduce in any order, so two runs of seed "
                f"{cfg.grpo.seed} drift apart in the last bits, then in samples")
    return f"yes: the same command (seed {cfg.grpo.seed}) gives the same metrics.jsonl, timing and resources aside"


def _overlap(cfg: MasterConfig) -> str:
    """Synchronous (overlapped within the step or not: rlpost.algorithms.overlap), or async GRPO with its age limit
    and refit mode (rlpost.algorithms.async_grpo)."""
    a = cfg.grpo.async_grpo
    if not a.enabled:
        lay = layout_of(cfg)
        if not lay.overlap_chunk:
            return f"one after the other (synchronous GRPO): {lay.overlap_reason}"
        return (f"overlapped within the step: the policy trains on each chunk of {lay.overlap_chunk} "
                f"completions while the engine generates the next ({lay.completions_per_step // lay.overlap_chunk} "
                "chunks), one optimizer step on the same weights (synchronous GRPO)")
    refit = ("in flight: requests freeze under the new weights" if a.in_flight_weight_updates
             else "at the engine's next batch boundary, from a copy staged after each update (the trainer does "
                  "not wait)")
    return (f"overlapped (async GRPO): batches at most {a.max_trajectory_age_steps} policy version(s) old; "
            f"refit {refit}")
