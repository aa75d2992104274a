"""Derived numbers of a config: worker placement, parallel layout and batch arithmetic.

Torch-free. `to_master_config` computes the layout once, as the last check of a config (its errors are
config errors); `layout_of(cfg)` hands that same result to `rlpost plan` and the run's setup.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from rlpost.config.algorithms import whole_batch_reason
from rlpost.config.errors import ConfigError
from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.megatron import check_expert_parallel
from rlpost.config.schema.supervised_master import SupervisedMasterConfig

_CACHE_ATTR = "_rlpost_layout"


@dataclass(frozen=True)
class Layout:
    """Where training and generation run and how the batch is cut."""

    colocated: bool
    train_nodes: int
    train_workers_per_node: int
    gen_nodes: int
    gen_workers_per_node: int
    dp: int
    tp: int
    pp: int
    cp: int
    gen_tp: int
    gen_replicas: int
    prompts_per_step: int
    completions_per_step: int
    optimizer_steps_per_grpo_step: int
    micro_batches_per_optimizer_step: int
    overlap_chunk: int = 0
    """Synchronous GRPO with generation and training overlapped: completions per chunk (whole groups, a whole
    number of micro-batches per data-parallel rank); 0 = not overlapped (`overlap_reason` says why)."""
    overlap_reason: str = ""
    """Why generation and training are not overlapped ("" when they are)."""
    refit: str = "ipc"
    """The refit transport (`refit_transport`): "ipc", "object_store" or "collective"."""

    @property
    def train_world(self) -> int:
        return self.train_nodes * self.train_workers_per_node

    @property
    def gen_world(self) -> int:
        return self.gen_nodes * self.gen_workers_per_node


def _placement(cfg: MasterConfig) -> tuple[int, int, int, int]:
    """(train_nodes, train_per_node, gen_nodes, gen_per_node)."""
    cl = cfg.cluster
    gen = cfg.generation
    if gen.colocated.enabled:
        return cl.num_nodes, cl.gpus_per_node, cl.num_nodes, cl.gpus_per_node
    res = gen.colocated.resources
    key = "policy.generation.colocated.resources"
    if cl.num_nodes == 1:
        g = res.gpus_per_node
        if g is None or g <= 0 or g >= cl.gpus_per_node:
            raise ConfigError(
                f"{key}.gpus_per_node",
                g,
                f"on one node, generation needs 1..{cl.gpus_per_node - 1} of cluster.gpus_per_node="
                f"{cl.gpus_per_node} workers, leaving the rest to training",
            )
        return 1, cl.gpus_per_node - g, 1, g
    n = res.num_nodes
    if n is None or n <= 0 or n >= cl.num_nodes:
        raise ConfigError(
            f"{key}.num_nodes",
            n,
            f"on {cl.num_nodes} nodes, generation needs 1..{cl.num_nodes - 1} whole nodes",
        )
    return cl.num_nodes - n, cl.gpus_per_node, n, cl.gpus_per_node


def model_dir_key(cfg: MasterConfig | SupervisedMasterConfig) -> str:
    """The key a user sets to choose the model directory: `model.path`, or `policy.model_name` if overridden."""
    return "model.path" if cfg.policy.model_name == cfg.model.path else "policy.model_name"


def read_hf_config(model_dir: str, key: str) -> dict[str, Any] | None:
    """The model's config.json as a dict; None if there is none; ConfigError (naming `key`) if it is unreadable."""
    path = os.path.join(str(model_dir), "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise ConfigError(key, model_dir, f"{path}: not valid JSON at {where} ({exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, model_dir, f"{path}: cannot be read ({exc})") from None
    if not isinstance(hf, dict):
        raise ConfigError(key, model_dir, f"{path}: expected a JSON object, got {type(hf).__name__}")
    return hf


def attention_heads(cfg: MasterConfig) -> tuple[int | None, int | None]:
    """(attention heads, key/value heads) of the model, from the tiny spec or a local config.json; None if unknown."""
    if cfg.model.tiny is not None:
        return cfg.model.tiny.num_attention_heads, cfg.model.tiny.num_key_value_heads
    hf = read_hf_config(str(cfg.policy.model_name), model_dir_key(cfg))
    if hf is None:
        return None, None
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads", heads)
    return (heads if isinstance(heads, int) else None), (kv if isinstance(kv, int) else None)


def layout_of(cfg: MasterConfig) -> Layout:
    """The layout of `cfg`, computed on first use and kept on the config object (the config is not
    changed after loading)."""
    lay = cfg.__dict__.get(_CACHE_ATTR)
    if lay is None:
        lay = compute_layout(cfg)
        cfg.__dict__[_CACHE_ATTR] = lay
    return lay


def compute_layout(cfg: MasterConfig) -> Layout:
    """Derive the layout, raising ConfigError on any inconsistent number."""
    tn, tpn, gn, gpn = _placement(cfg)
    train_world = tn * tpn
    sizes = cfg.policy.parallel_sizes()
    tp, pp, cp = sizes["tp"], sizes["pp"], sizes["cp"]
    backend_key = cfg.policy.tp_key()
    model_parallel = tp * pp * cp
    if train_world % model_parallel != 0:
        raise ConfigError(
            backend_key,
            tp,
            f"DP x TP x PP x CP must equal the {train_world} training workers; "
            f"TP*PP*CP={model_parallel} does not divide {train_world}",
        )
    dp = train_world // model_parallel
    check_expert_parallel(sizes, dp, train_world)
    heads, kv_heads = attention_heads(cfg)
    if heads is not None and heads % tp != 0:
        raise ConfigError(backend_key, tp, f"tensor-parallel size must divide the model's {heads} attention heads")
    if kv_heads is not None and kv_heads % tp != 0:
        raise ConfigError(
            backend_key, tp, f"tensor-parallel size must divide the model's {kv_heads} key/value heads"
        )

    gen_tp, engine_tp, engine_tp_key = cfg.generation.model_parallel()
    gen_world = gn * gpn
    if gen_world % gen_tp != 0:
        raise ConfigError(engine_tp_key, engine_tp,
                          f"TP*PP of the engine ({gen_tp}) must divide the {gen_world} generation workers")
    if kv_heads is not None and kv_heads % engine_tp != 0:
        raise ConfigError(engine_tp_key, engine_tp, f"must divide the model's {kv_heads} key/value heads")

    g = cfg.grpo
    p = cfg.policy
    completions = g.num_prompts_per_step * g.num_generations_per_prompt
    gbs = p.train_global_batch_size
    if completions % gbs != 0:
        raise ConfigError(
            "policy.train_global_batch_size",
            gbs,
            f"the rollout batch (grpo.num_prompts_per_step x num_generations_per_prompt = {completions}) "
            "must be a multiple of it",
        )
    if gbs % (p.train_micro_batch_size * dp) != 0:
        raise ConfigError(
            "policy.train_global_batch_size",
            gbs,
            f"must be divisible by train_micro_batch_size x data-parallel size "
            f"({p.train_micro_batch_size} x {dp} = {p.train_micro_batch_size * dp})",
        )
    chunk, reason = overlap_chunk(cfg, dp)
    if cfg.grpo.overlap_generation_and_training and not chunk:
        raise ConfigError("grpo.overlap_generation_and_training", True, f"does not apply: {reason}",
                          "grpo.overlap_generation_and_training=null (on wherever it applies)")
    return Layout(
        colocated=cfg.generation.colocated.enabled,
        train_nodes=tn,
        train_workers_per_node=tpn,
        gen_nodes=gn,
        gen_workers_per_node=gpn,
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        gen_tp=gen_tp,
        gen_replicas=gen_world // gen_tp,
        prompts_per_step=g.num_prompts_per_step,
        completions_per_step=completions,
        optimizer_steps_per_grpo_step=completions // gbs,
        micro_batches_per_optimizer_step=gbs // (p.train_micro_batch_size * dp),
        overlap_chunk=chunk,
        overlap_reason=reason,
        refit=refit_transport(cfg.generation.colocated.enabled, tn),
    )


REFIT_TRANSPORTS = {
    "ipc": "each policy rank writes each bucket into a buffer on its own device and the engine worker beside it "
           "opens it by handle",
    "object_store": "rank 0's buckets through Ray's object store (policy and engines span several nodes)",
    "collective": "a broadcast from the policy's rank 0 over the refit group (gloo on CPU, NCCL on GPU)",
}
"""The three refit transports, by name: how the trained weights reach the engines (rlpost.algorithms.refit)."""

IPC_BUFFERS = {
    "cuda": "CUDA IPC per GPU: each engine reads the policy rank on its own GPU",
    "cpu": "shared memory, one buffer per colocated pair",
}
"""The buffers of the "ipc" refit on each device."""


def refit_transport(colocated: bool, train_nodes: int) -> str:
    """The refit transport of a layout: colocated engines on one node read the IPC buffer of the policy rank on their
    own device ("ipc"), across nodes the object store ("object_store"); engines on their own workers receive a
    broadcast ("collective")."""
    if not colocated:
        return "collective"
    return "ipc" if train_nodes == 1 else "object_store"


def cuda_ipc_refit(device: str) -> bool:
    """Whether a colocated refit on one node goes over CUDA IPC (rlpost.distributed.cuda_ipc_buckets): on GPUs each
    engine worker shares its GPU with a policy rank, and reads the buckets that rank wrote on it."""
    return device == "cuda"


def overlap_chunk(cfg: MasterConfig, dp: int) -> tuple[int, str]:
    """(completions per chunk, "") when synchronous GRPO trains on the step's first groups while the engine
    generates the rest (rlpost.algorithms.overlap), else (0, why not).

    Exact only when the whole rollout batch is one optimizer step whose inputs are known per group: no
    prev-logprobs or reference pass over the whole batch first, no dynamic sampling choosing groups after the
    fact, a loss whose normalisation the workers can apply after accumulating (ClippedPGLossFn), and an engine on
    its own workers (a colocated one takes turns with the policy on the shared device)."""
    g, p = cfg.grpo, cfg.policy
    completions = g.num_prompts_per_step * g.num_generations_per_prompt
    per_rank = p.train_micro_batch_size * dp
    chunk = math.lcm(g.num_generations_per_prompt, per_rank)
    loss = cfg.loss_fn
    why = None
    if g.overlap_generation_and_training is False:
        why = "grpo.overlap_generation_and_training=false"
    elif g.async_grpo.enabled:
        why = "async GRPO overlaps whole batches instead (grpo.async_grpo.enabled=true)"
    elif (whole := whole_batch_reason(cfg)) is not None:
        why = whole
    elif cfg.generation.colocated.enabled:
        why = ("the engine is colocated: it and the policy take turns on the shared workers "
               "(policy.generation.colocated.enabled=false gives the engine workers of its own)")
    elif (megatron := getattr(p, "megatron_cfg", None)) is not None and \
            megatron.distributed_data_parallel_config.overlap_grad_reduce:
        why = ("Megatron's overlapped gradient reduce starts inside each part's last micro-batch; a batch trained in "
               "parts reduces once at its end (policy.megatron_cfg.distributed_data_parallel_config."
               "overlap_grad_reduce=false)")
    elif not isinstance(loss, ClippedPGLossConfig):
        why = "the loss is not ClippedPGLossFn"
    elif completions != p.train_global_batch_size:
        why = (f"the rollout batch ({completions}) is {completions // p.train_global_batch_size} optimizer steps "
               "(policy.train_global_batch_size); overlap needs exactly one")
    elif prev_logprobs_pass(cfg) == "computed":
        why = "the prev-logprobs pass runs over the whole batch first"
    elif loss.reference_policy_kl_penalty != 0:
        why = "the reference-logprobs pass (loss_fn.reference_policy_kl_penalty > 0) runs over the whole batch first"
    elif g.use_dynamic_sampling:
        why = "dynamic sampling picks the batch's groups after generating them"
    elif completions % chunk or completions // chunk < 2:
        why = (f"the batch ({completions}) is not two or more chunks of whole groups and whole micro-batches per "
               f"data-parallel rank (lcm({g.num_generations_per_prompt}, {per_rank}) = {chunk})")
    return (0, why) if why else (chunk, "")


LOGITS_CHUNK_BYTES = 256 * 2**20
"""The fp32 logits one chunk of tokens may take when policy.logprob_chunk_size is unset: 1,365 tokens at SmolLM2's
49k vocabulary, 441 at Qwen2.5's 152k, a whole micro-batch of the tiny model's 384 (one chunk: the logits are kept
for the backward, as the unchunked path does, instead of computed again)."""


LONG_SEQUENCE_TOKENS = 4096
"""policy.max_total_sequence_length from which a CPU policy worker maps its large buffers on their own
(rlpost.runtime.host_malloc: at 4k tokens one layer's hidden states are 9 MiB at SmolLM2's width, and a step lasts
minutes on a CPU, so page faults cost nothing that shows)."""


def maps_large_buffers(max_sequence_tokens: int) -> bool:
    """Whether a policy whose sequences reach `max_sequence_tokens` maps its large buffers on their own, so that
    what a backward frees leaves the process rather than staying in glibc's heap."""
    return max_sequence_tokens >= LONG_SEQUENCE_TOKENS


def chunk_tokens(chunk_size: int | None, vocab_rows: int) -> int:
    """Tokens per chunk: `chunk_size` when set, else as many as LOGITS_CHUNK_BYTES of fp32 logits hold."""
    return chunk_size if chunk_size else max(1, LOGITS_CHUNK_BYTES // (4 * vocab_rows))


def fsdp_needed(dp_size: int, tp_size: int, precision: str, cpu_offload: bool) -> bool:
    """Whether a DTensor policy wraps its model in FSDP2. With one rank in fp32 and no CPU offload FSDP2 would
    all-gather and reduce-scatter a single shard, copying every parameter and gradient per micro-batch for
    nothing, so the model trains unwrapped, as torchtitan does (FSDP only when dp_shard > 1). Mixed precision (fp32
    master weights, bf16 compute) and CPU offload are FSDP2 policies, so they keep it."""
    return dp_size * tp_size > 1 or precision != "float32" or cpu_offload


def fsdp_wrapping(cfg: MasterConfig | SupervisedMasterConfig, world: int) -> str | None:
    """What `rlpost plan` says about FSDP2 for a DTensor policy on `world` workers (None for other backends)."""
    d = getattr(cfg.policy, "dtensor_cfg", None)
    if d is None:
        return None
    tp = d.tensor_parallel_size
    if fsdp_needed(world // tp, tp, cfg.policy.precision, d.cpu_offload):
        return "FSDP2"
    return "one fp32 rank: trained unwrapped, no FSDP2"


def prev_logprobs_pass(cfg: MasterConfig) -> str:
    """Why the prev-logprobs forward pass runs or is skipped: 'computed', 'on-policy', 'one-step async' or 'forced'.

    The prev logprobs are the trainer's own, taken with its weights right before training (NeMo RL recomputes them
    so, synchronous or async). With one optimizer step per rollout batch the weights that compute the training pass
    are those very weights, so rho = exp(lp - sg(lp)) exactly (NeMo RL's force_on_policy_ratio). That holds for async
    GRPO too: a batch generated by older weights differs from the trainer's in the importance-sampling weights
    exp(lp_old - lp_gen), which take lp_old = sg(lp) then, not in the ratio.
    """
    loss = cfg.loss_fn
    if not isinstance(loss, ClippedPGLossConfig):  # a loss without a ratio (NLL)
        return "not needed"
    if loss.force_on_policy_ratio:
        return "forced"
    g = cfg.grpo
    if g.num_prompts_per_step * g.num_generations_per_prompt == cfg.policy.train_global_batch_size:
        return "one-step async" if g.async_grpo.enabled else "on-policy"
    return "computed"
