"""Helpers of the megatron tests: tiny HF checkpoints, plain-PyTorch references, and the spawned worker.

The worker runs in a fresh process (torch.multiprocessing spawn, gloo over tcp://127.0.0.1) so that neither the
CPU compatibility layer nor megatron's global parallel state ever touches the pytest process. It writes its
results with torch.save to <out_dir>/rank<r>.pt; the test process does all the asserting.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp

SEQ = 12
TEMPERATURE = 0.7


def qwen2_config(tied: bool) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        max_position_embeddings=256,
        rope_theta=5000.0,
    )


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=100,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=16384,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


def qwen3_config() -> Any:
    """Qwen3: per-head q/k RMSNorm, no q/k/v bias, a head_dim apart from hidden_size / heads."""
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       intermediate_size=96, vocab_size=112, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       max_position_embeddings=256, rope_theta=1000000.0)


def mistral_config() -> Any:
    from transformers import MistralConfig

    return MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, intermediate_size=128, vocab_size=120, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, max_position_embeddings=256, rope_theta=10000.0,
                         sliding_window=None)


def phi3_config() -> Any:
    """Phi-3: q/k/v fused in qkv_proj and gate/up in gate_up_proj."""
    from transformers import Phi3Config

    return Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, vocab_size=104, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def olmo2_config() -> Any:
    """OLMo 2: norms after attention and the MLP (none before), q/k norms over the whole projection."""
    from transformers import Olmo2Config

    return Olmo2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=96, vocab_size=116, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       max_position_embeddings=256, rope_theta=500000.0, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)


def qwen3_moe_config() -> Any:
    """Qwen3-MoE: four experts, two per token, renormalised; Qwen3's attention."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=True, vocab_size=112, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, max_position_embeddings=256, router_aux_loss_coef=0.0)


def mixtral_config() -> Any:
    """Mixtral: four experts (block_sparse_moe, w1/w3/w2), two per token; Mistral's attention."""
    from transformers import MixtralConfig

    return MixtralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, intermediate_size=80, num_local_experts=4, num_experts_per_tok=2,
                         vocab_size=120, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=256,
                         sliding_window=None, router_aux_loss_coef=0.0)


def gemma2_config() -> Any:
    """Gemma 2: caps small enough to bend the scores and logits, a window shorter than the rows on its sliding
    layers (the first of each pair), a query scale apart from the head size. No pad token: transformers' embedding
    would freeze its row (`padding_idx`), where megatron's trains every row."""
    from transformers import Gemma2Config

    return Gemma2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=96, vocab_size=124, rms_norm_eps=1e-6, max_position_embeddings=256,
                        query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                        sliding_window=4, rope_theta=10000.0, pad_token_id=None, bos_token_id=1, eos_token_id=2)


def gemma3_config() -> Any:
    """Gemma 3: per-head q/k norms, a window of 5 on the first layer with its local RoPE base, and the second layer's
    global base with linear scaling."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=96, vocab_size=108, rms_norm_eps=1e-6,
                            max_position_embeddings=256, query_pre_attn_scalar=32, sliding_window=5,
                            layer_types=["sliding_attention", "full_attention"],
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                                "factor": 2.0}},
                            pad_token_id=None, bos_token_id=1, eos_token_id=2)


MODEL_CONFIGS: dict[str, Callable[[], Any]] = {
    "qwen2_tied": lambda: qwen2_config(True),
    "qwen2_untied": lambda: qwen2_config(False),
    "llama": llama_config,
    "qwen3": qwen3_config,
    "mistral": mistral_config,
    "phi3": phi3_config,
    "olmo2": olmo2_config,
    "qwen3_moe": qwen3_moe_config,
    "mixtral": mixtral_config,
    "gemma2": gemma2_config,
    "gemma3": gemma3_config,
}


def make_hf_model(name: str, seed: int = 0) -> Any:
    """Random-init HF model; biases and norm weights are randomised too (HF inits them to 0 / 1)."""
    from transformers import AutoModelForCausalLM

    from rlpost.config.model_families import attention_implementation

    torch.manual_seed(seed)
    config = MODEL_CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation=attention_implementation(config))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(0.2 * torch.randn_like(p))
            if pname.endswith("gate.weight"):  # a router drawn wide, so rounding does not decide the experts
                p.normal_(0.0, 0.5)
    return model.eval()


def checkpoint_state(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights under its checkpoint's names (a mixture of experts: one matrix per expert), as a
    conversion reads and an export writes them."""
    from rlpost.models.expert_weights import to_checkpoint_layout

    return to_checkpoint_layout(model.config, model.state_dict())


def save_hf_model(name: str, directory: str) -> str:
    path = os.path.join(directory, name)
    make_hf_model(name).save_pretrained(path, safe_serialization=True)
    return path


def batch(vocab: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids [rows, SEQ] and their attention mask (row i has SEQ - i tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, SEQ), generator=g)
    lengths = torch.tensor([SEQ - i for i in range(rows)])
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def hf_logprobs(model: Any, ids: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """Reference: log_softmax(logits / T) gathered at the next tokens; [B, S] with position 0 = 0."""
    logits = model(input_ids=ids, attention_mask=mask).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(ids.shape[0], 1), lp], dim=1)


def nll_loss(lp: torch.Tensor, token_mask: torch.Tensor, global_tokens: float) -> torch.Tensor:
    """Token NLL of one micro-batch normalised by the global token count (positions 1.. only)."""
    return -(lp[:, 1:] * token_mask[:, 1:]).sum() / global_tokens


def torch_reference_step(
    name: str, microbatches: list[dict[str, torch.Tensor]], optimizer: str, lr: float, clip: float
) -> tuple[dict[str, torch.Tensor], float, float]:
    """Plain PyTorch on the HF model: (updated state dict, grad norm before clipping, loss)."""
    model = make_hf_model(name).train()
    params = list(model.parameters())
    opt: torch.optim.Optimizer
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=0.0)
    else:
        opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    total = float(sum(mb["attention_mask"][:, 1:].sum() for mb in microbatches))
    loss_sum = 0.0
    for mb in microbatches:
        lp = hf_logprobs(model, mb["input_ids"], mb["attention_mask"], 1.0)
        loss = nll_loss(lp, mb["attention_mask"], total)
        loss.backward()
        loss_sum += float(loss)
    norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")))
    opt.step()
    return {k: v.detach().clone() for k, v in checkpoint_state(model).items()}, norm, loss_sum


def train_microbatches(vocab: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(2):
        ids, mask = batch(vocab, 2, seed=100 + i)
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


# ------------------------------------------------------------------------------------------ spawned worker


def spawn(fn: Callable[..., None], world_size: int, args: tuple[Any, ...], timeout_s: float = 120.0) -> None:
    """Run fn(rank, *args) in world_size spawned processes; raise on failure or timeout."""
    ctx = mp.start_processes(fn, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"megatron workers did not finish within {timeout_s} s")


def config_namespace(name: str) -> SimpleNamespace:
    """The HF config as plain attributes: the conversion reads attributes only, and the workers skip
    importing transformers (seconds per process)."""
    return SimpleNamespace(**MODEL_CONFIGS[name]().to_dict())


def worker(rank: int, world_size: int, port: int, phases: dict[str, dict[str, Any]], out_dir: str) -> None:
    """One rank: megatron over gloo with the CPU layer; runs each phase's logprob / export / train jobs.

    A phase is {"tp": .., "pp": .., "ep": .. and "cp": .. (1 if absent), "logprobs": [names], "export": [names], "train": {key: (name, optim, lr,
    clip)}} plus the shared "files" (safetensors path per model), "inputs" and "train_batches". With DP > 1 each
    data-parallel rank trains on its own share of the micro-batches.
    """
    torch.set_num_threads(1)
    import sys

    import torch.distributed as dist

    import rlpost.models.megatron
    import rlpost.models.megatron.convert
    import rlpost.models.megatron.cpu_compat
    import rlpost.models.megatron.export
    import rlpost.models.megatron.model
    import rlpost.models.megatron.train_step  # noqa: F401

    lazy = not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules)
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from rlpost.config.schema.megatron import MegatronConfig, MegatronOptimizerConfig, MegatronSchedulerConfig
    from rlpost.models.megatron.cpu_compat import cpu_compat, seed_model_parallel_rng
    from rlpost.models.megatron.export import export_hf_weights
    from rlpost.models.megatron.model import build_gpt_model, forward_logprobs
    from rlpost.models.megatron.train_step import setup_training, train_step

    shared = phases.pop("shared")
    results: dict[str, Any] = {"imports_are_lazy": lazy}
    with cpu_compat():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        for phase, plan in phases.items():
            tp, pp, ep, cp = plan["tp"], plan["pp"], plan.get("ep", 1), plan.get("cp", 1)
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         expert_model_parallel_size=ep, context_parallel_size=cp)
            seed_model_parallel_rng(1234)
            groups = (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group())
            experts = {"ep_group": ps.get_expert_model_parallel_group() if ep > 1 else None}
            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            base = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                        context_parallel_size=cp)

            def build(name: str, cfg: Any, precision: str = "float32") -> Any:
                state = load_file(shared["files"][name])
                return build_gpt_model(config_namespace(name), cfg, precision, hf_state_dict=state)

            out: dict[str, Any] = {"logprobs": {}, "logprobs_bf16": {}, "export": {}, "train": {}, "positions_in": []}
            for name in plan.get("logprobs", []):
                ids, mask = shared["inputs"][name]
                model = build(name, MegatronConfig(**base))
                if model.pre_process:  # how many positions of each sequence this rank's model reads
                    model.embedding.register_forward_pre_hook(
                        lambda _m, args, kwargs, seen=out["positions_in"]:
                        seen.append(int((args[0] if args else kwargs["input_ids"]).shape[1])), with_kwargs=True)
                lp = forward_logprobs(model, ids, mask, TEMPERATURE, micro_batch_size=2)
                out["logprobs"][name] = lp.numpy()
            for name in plan.get("logprobs_bf16", []):
                ids, mask = shared["inputs"][name]
                model = build(name, MegatronConfig(**base), "bfloat16")
                out["logprobs_bf16"][name] = forward_logprobs(model, ids, mask, TEMPERATURE).numpy()
            for name in plan.get("export", []):
                exported = export_hf_weights(build(name, MegatronConfig(**base)), config_namespace(name), *groups,
                                             **experts)
                out["export"][name] = {k: v.clone() for k, v in exported}
            for key, (name, optim, lr, clip) in plan.get("train", {}).items():
                opt_cfg = MegatronOptimizerConfig(
                    optimizer=optim, lr=lr, min_lr=0.0, weight_decay=0.0, sgd_momentum=0.0, clip_grad=clip
                )
                # The scheduler owns weight decay (it overwrites the optimizer's every step): keep it 0 like torch.
                sched = MegatronSchedulerConfig(start_weight_decay=0.0, end_weight_decay=0.0)
                cfg = MegatronConfig(**base, optimizer=opt_cfg, scheduler=sched)
                state = setup_training(build(name, cfg), cfg)
                all_mbs = shared["train_batches"][name]
                total = float(sum(mb["attention_mask"][:, 1:].sum() for mb in all_mbs))
                mine = all_mbs[dp_rank::dp]

                def loss_fn(lp: torch.Tensor, mb: Any, total: float = total) -> tuple[torch.Tensor, dict[str, float]]:
                    loss = nll_loss(lp, mb["attention_mask"], total)
                    return loss, {"nll": float(loss)}

                res = train_step(state, mine, loss_fn, loss_input="logprobs")
                weights = {k: v.clone() for k, v in export_hf_weights(state.model, config_namespace(name), *groups,
                                                                      **experts)}
                out["train"][key] = {
                    "weights": weights,
                    "grad_norm": res.grad_norm,
                    "loss": res.loss,
                    "lr": res.lr,
                    "metrics": res.metrics,
                }
            results[phase] = out
            dist.barrier()
            ps.destroy_model_parallel()
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
