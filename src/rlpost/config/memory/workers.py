"""What one worker holds in each phase of a step: named items in bytes, on its device and in host memory.

Phases: `forward` (the end of the largest micro-batch's forward: every activation kept, the output layer's logits),
`training` (its backward), `optimizer step` (the update), `logprobs` (a scoring pass) and `generation` (the engine
awake). The formulas, per rank:

- weights, gradients and optimizer state from the parameter counts (rlpost.config.memory.shape) and their sharding:
  FSDP2 over DP x CP and TP on the DTensor workers (a single fp32 rank keeps whole copies); TP x PP on Megatron, whose
  distributed optimizer also shards its state over DP and whose bf16 run keeps fp32 main parameters in the optimizer;
- activations per micro-batch from its tokens: `ModelShape.saved_per_token` for each layer, or with activation
  checkpointing each layer's input, and in the backward one layer recomputed; plus one layer's gradients in the
  backward;
- the optimizer step: the gradients and states, and its temporaries: torch's single-tensor AdamW (rlpost sets
  foreach and fused off, as NeMo RL does) makes two of each parameter's size in turn (the second moment's root,
  divided by its bias correction), so two of the largest trained tensor (fp32, sharded);
- the output layer's working set: a chunk of tokens x the vocabulary in fp32, never the whole [tokens, vocabulary]
  (rlpost.ops.chunked_head; soft-capped logits, Gemma 2's, are made whole): in the forward the logits and logsumexp's temporary; in the backward the recomputed
  logits, turned into their gradient in place, and the layer's fp32 weight gradient [vocabulary, hidden];
- the engine: its weights, its KV cache (CPU: `kv_cache_space_gb` or the size vLLM would be given; GPU: what is left
  of `gpu_memory_utilization` x the device), and CUDA graphs' pool unless eager; on CPU also the output layer's
  packed copy: vLLM's CPU matmul packs each linear layer's weight for oneDNN and frees the original, but keeps the
  output layer's, which the embedding reads too; and the pages of its sampler's warm-up over max_num_seqs rows of
  the vocabulary;
- the process itself: `RUNTIME` (the interpreter, torch, transformers, Ray; on a GPU the CUDA context);
- on CPU, the allocator's retention: glibc keeps the pages a pass frees (its arenas are returned only from their
  top), and a training step's activations, freed in the backward in an order other than they were made, are not
  all reused by the next micro-batch's. A step's resident set then holds its transient working set about twice,
  less the freed gradients' pages, which the next step reuses (the DTensor workers free them after each step;
  Megatron keeps them in its buffers). A worker of sequences from LONG_SEQUENCE_TOKENS on maps its large buffers on
  their own (rlpost.runtime.host_malloc), which leave the process when freed. A GPU's caching allocator reuses its
  blocks, and the GPU figure is what torch holds allocated, so there this item is nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rlpost.config.layout import chunk_tokens, fsdp_needed, maps_large_buffers
from rlpost.config.lora_params import saved_tables
from rlpost.config.memory.shape import BYTES, ModelShape
from rlpost.config.schema.megatron import MegatronPolicyConfig
from rlpost.config.schema.policy import DTensorConfig, DTensorPolicyConfig, PolicyConfig

GIB = 2**30
RUNTIME = {("cpu", "policy"): 0.39 * GIB, ("cpu", "engine"): 0.74 * GIB, ("cpu", "driver"): 0.42 * GIB,
           ("cuda", "policy"): 0.5 * GIB, ("cuda", "engine"): 0.5 * GIB, ("cuda", "driver"): 0.0}
"""Memory of a worker process before it holds anything of the model: on CPU the resident set of the default job's
workers less their model's items (Python, torch, transformers and Ray's core worker; vLLM besides in the engine), and
the driver's across the memory benchmark's jobs (0.39 GiB under Megatron to 0.48 with SmolLM2's tokenizer); on a GPU
the CUDA context and the allocator's first blocks."""
MEGATRON_IMPORT = 0.075 * GIB
"""What megatron-core's modules add to a policy process's runtime."""
CUDA_GRAPHS = 0.5 * GIB
"""vLLM's CUDA-graph pool when it captures graphs (enforce_eager=false): a few hundred MiB for models up to 8B."""
OPTIMIZER_STATES = {"torch.optim.AdamW": 2, "torch.optim.Adam": 2, "torch.optim.SGD": 1, "adam": 2, "sgd": 1}
"""fp32 states per trained parameter (Adam's two moments, SGD's momentum); an optimizer not listed counts 2."""


@dataclass
class Usage:
    """A worker's memory in one phase, bytes by item."""

    device: dict[str, float] = field(default_factory=dict)
    """On the worker's device (on a CPU run, its host memory)."""
    host: dict[str, float] = field(default_factory=dict)
    """Host memory besides (offloaded or CPU-kept state on a GPU run)."""


@dataclass
class Worker:
    """One worker group's ranks (all alike) and what each holds per phase."""

    group: str
    """policy, engine, critic, teacher or driver."""
    ranks: int
    """Workers of the group (each estimated alike)."""
    device: str
    """cpu or cuda."""
    phases: dict[str, Usage]
    """Phase -> usage."""
    shares_device_with: str | None = None
    """The group whose workers sit on the same devices (a colocated engine: the policy)."""


def _tokens(p: PolicyConfig, training: bool) -> int:
    """The most tokens one micro-batch holds (rows x padded length)."""
    if p.sequence_packing.enabled:
        return p.sequence_packing.train_mb_tokens if training else p.sequence_packing.logprob_mb_tokens
    if p.dynamic_batching.enabled:
        return p.dynamic_batching.tokens(training)
    rows = p.train_micro_batch_size if training else p.logprob_batch_size
    return rows * p.max_total_sequence_length


def _optimizer_states(p: PolicyConfig) -> int:
    name = p.megatron_cfg.optimizer.optimizer if isinstance(p, MegatronPolicyConfig) else p.optimizer.name
    return OPTIMIZER_STATES.get(name, 2)


def _activations(shape: ModelShape, tokens: int, tp: int, act_bytes: int, checkpointing: bool) -> dict[str, float]:
    """What the forward keeps for the backward (every layer's saved tensors, or with checkpointing each layer's
    input) and, in the backward, the layer recomputed (checkpointing) and one layer's gradients."""
    layer = shape.saved_per_token(tp) * tokens * act_bytes
    kept = shape.layers * (shape.hidden * tokens * act_bytes if checkpointing else layer)
    out: dict[str, float] = {"activations": kept + 2 * shape.hidden * tokens * act_bytes, "backward working set": layer}
    if checkpointing:
        out["recomputed layer"] = layer
    return out


def _head(shape: ModelShape, tokens: int, chunk: int | None, tp: int, copies: int) -> float:
    """The output layer's fp32 working set: `copies` [chunk, vocabulary / TP] tensors (soft-capped logits: every
    token's at once)."""
    rows = tokens if shape.softcapped_logits else min(tokens, chunk_tokens(chunk, shape.vocab // tp))
    return copies * rows * (shape.vocab // tp) * 4


def policy_worker(p: PolicyConfig, shape: ModelShape, device: str, world: int, *, group: str = "policy",
                  trains: bool = True, reference: bool = False, colocated_engine: bool = False,
                  lora: bool | None = None) -> Worker:
    """A policy-like group (the policy, PPO's critic, a teacher) on `world` workers of `device`; `lora`: whether it
    trains adapters (default: the block's LoRA setting)."""
    sizes = p.parallel_sizes()
    tp, pp, cp = sizes["tp"], sizes["pp"], sizes["cp"]
    dp = max(world // (tp * pp * cp), 1)
    lora = p.lora_settings("policy")[1].enabled if lora is None else lora
    compute = BYTES.get(p.precision, 4)
    if not isinstance(p, MegatronPolicyConfig):
        d = p.dtensor_cfg if isinstance(p, DTensorPolicyConfig) else DTensorConfig()
        fsdp = fsdp_needed(dp * cp, tp, p.precision, d.cpu_offload)
        shard = dp * cp * tp if fsdp else tp
        checkpointing = d.activation_checkpointing
        weights = 4 * shape.params / shard
        trained = {"gradients": 4 * shape.trainable / shard,
                   "optimizer state": 4 * _optimizer_states(p) * shape.trainable / shard}
        if fsdp and dp * cp > 1:  # FSDP2 gathers a layer ahead of the one computing, in the compute dtype
            trained["gathered layers"] = 2 * compute * shape.layer_params / tp
        offloaded = d.cpu_offload and device == "cuda"
    else:
        megatron = p.megatron_cfg
        shard = tp * pp
        checkpointing = megatron.activation_checkpointing
        distributed = megatron.optimizer.use_distributed_optimizer
        if distributed is None:
            distributed = device == "cuda" and dp > 1
        opt_shard = shard * (dp if distributed else 1)
        weights = compute * shape.params / shard
        trained = {"gradients": 4 * shape.trainable / shard,
                   "optimizer state": 4 * _optimizer_states(p) * shape.trainable / opt_shard}
        if compute != 4:
            trained["fp32 main weights"] = 4 * shape.trainable / opt_shard
        offloaded = megatron.optimizer.optimizer_cpu_offload and device == "cuda"
    runtime = RUNTIME[(device, "policy")] + (MEGATRON_IMPORT if isinstance(p, MegatronPolicyConfig) else 0.0)
    layers_here = shape.layers / pp
    per_stage = dataclasses.replace(shape, layers=max(int(round(layers_here)), 1))
    train_tokens, lp_tokens = _tokens(p, True) // cp, _tokens(p, False) // cp
    resident = {"weights": weights, "runtime": runtime}
    settings = p.lora_settings("policy")[1]
    if lora and group == "policy" and settings.refit == "merged" and device == "cpu":
        # the refit's merged weights (W + s B @ A: new tensors for every adapted layer), whole on the exporting rank;
        # on CPU the allocator keeps their pages from one refit to the next
        resident["merged refit copy"] = 4 * shape.layers * shape.layer_params
    host: dict[str, float] = {}
    if reference and not lora:
        host["reference weights"] = 4 * shape.params / shard
    elif reference and lora and (tables := saved_tables(settings, shape.tied)):  # modules_to_save's base values
        host["reference weights"] = 4 * tables * shape.vocab * shape.hidden / shard
    phases: dict[str, Usage] = {}
    if trains:
        dev = dict(resident)
        if offloaded:
            host.update({k: v for k, v in trained.items() if k != "gathered layers"})
            dev.update({k: v for k, v in trained.items() if k == "gathered layers"})
        else:
            dev.update(trained)
        acts = _activations(per_stage, train_tokens, tp, compute, checkpointing)
        fwd = {**dev, "activations": acts["activations"],
               "output layer chunk": _head(shape, train_tokens, p.logprob_chunk_size, tp, 2)}
        dev.update(acts)
        dev["output layer chunk"] = _head(shape, train_tokens, p.logprob_chunk_size, tp, 1)
        dev["output layer gradient"] = 4 * shape.vocab // tp * shape.hidden
        transient = sum(acts.values()) + dev["output layer chunk"] + dev["output layer gradient"]
        kept = device == "cpu" and not maps_large_buffers(p.max_total_sequence_length)
        if kept:
            freed = 0.0 if isinstance(p, MegatronPolicyConfig) else trained["gradients"]
            fwd["allocator retention"] = dev["allocator retention"] = max(transient - freed, 0.0)
        phases["forward"] = Usage(fwd, dict(host))
        phases["training"] = Usage(dev, dict(host))
        if not offloaded:  # the update: every state and gradient, and the step's temporaries of the largest tensor
            step = {**resident, **{k: v for k, v in trained.items() if k != "gathered layers"},
                    "optimizer step temporaries": 2 * 4 * shape.largest_trained / shard}
            if kept:  # the backward's pages, freed but kept, few reused by the step's
                step["allocator retention"] = transient
            phases["optimizer step"] = Usage(step, dict(host))
    scoring = dict(resident)
    if trains and not offloaded:
        scoring.update({k: v for k, v in trained.items() if k != "gathered layers"})
    scoring["scoring activations"] = 2 * (shape.hidden + shape.intermediate // tp) * lp_tokens * compute
    scoring["output layer chunk"] = _head(shape, lp_tokens, p.logprob_chunk_size, tp, 2)
    phases["logprobs"] = Usage(scoring, dict(host))
    if colocated_engine:
        if device == "cuda":  # offloaded to host memory while the engine generates (rlpost.models.policy.memory_phases)
            moved = {k: v for k, v in scoring.items() if k not in ("runtime", "scoring activations",
                                                                      "output layer chunk")}
            phases["generation"] = Usage({"runtime": runtime}, {**host, **moved})
        else:
            phases["generation"] = Usage({k: v for k, v in scoring.items() if k not in ("scoring activations",
                                                                                   "output layer chunk")}, dict(host))
    return Worker(group, world, device, phases)


SAMPLER_COPIES = 3
"""fp32 [sequences, vocabulary] tensors of vLLM's sampler warm-up (logits, probabilities, log-probabilities) whose
pages a CPU engine keeps: measured on SmolLM2, 256 sequences against 32 left 0.11 GiB more."""


def engine_worker(shape: ModelShape, precision: str, tp: int, workers: int, device: str, *, device_bytes: float | None,
                  utilization: float, kv_cache_bytes: float, eager: bool, colocated: bool,
                  max_num_seqs: int = 256) -> Worker:
    """A vLLM engine's workers: awake in generation; asleep while a colocated policy trains (on a GPU its weights in
    host memory and its KV cache freed; on the CPU, where nothing moves, as when awake)."""
    runtime = RUNTIME[(device, "engine")]
    weights = BYTES.get(precision, 4) * shape.params / tp
    awake = {"weights": weights, "runtime": runtime}
    if device == "cuda":
        budget = utilization * device_bytes if device_bytes else weights + kv_cache_bytes
        awake["KV cache and activations"] = max(budget - weights, 0.0)
        if not eager:
            awake["CUDA graphs"] = CUDA_GRAPHS
    else:
        awake["KV cache"] = kv_cache_bytes
        awake["packed output layer"] = BYTES.get(precision, 4) * shape.vocab * shape.hidden / tp
        awake["sampler warm-up"] = SAMPLER_COPIES * 4 * max_num_seqs * shape.vocab
    phases = {"generation": Usage(dict(awake))}
    if colocated:
        asleep = Usage({"runtime": runtime}, {"weights": weights}) if device == "cuda" else Usage(dict(awake))
        phases["forward"] = phases["training"] = phases["optimizer step"] = phases["logprobs"] = asleep
    return Worker("engine", workers, device, phases, shares_device_with="policy" if colocated else None)


def driver_worker() -> Worker:
    """The driver process (it holds no model: batches and metrics only)."""
    usage = Usage({"runtime": RUNTIME[("cpu", "driver")]})
    return Worker("driver", 1, "cpu", {"training": usage, "generation": usage})
