"""Rollout throughput: rlpost's engines next to the bare engines they wrap, on one fixed workload.

Workload: the tiny model (perturbed, seeded weights), N prompts x M new tokens, sampling at T=0.8,
no stop token (stop_token_ids=[]), so every sample is exactly M tokens. Each engine gets one warm-up
call, then the best of `--repeats` timed calls is reported as generated tokens per second.

- vllm_rlpost:  VllmGeneration (1 replica, Ray actor, in-process vLLM engine), fp32
- vllm_bare:    vllm.LLM in this process, same engine settings, fp32
- hf_rlpost:    HFGeneration (1 worker, Ray actor), fp32, generation_batch_size = N
- hf_bare:      transformers generate in this process, fp32, one batch of N
Every process uses one compute thread, so the difference between rlpost and bare is the wrapper's
overhead: Ray dispatch, object transfer, sharding and output assembly.

Also measured: refit latency (update_weights, object-store path) and token_mult_prob_error
(mean exp|lp_engine - lp_ref|, lp_ref = log_softmax(logits / T) of a plain fp32 HF model with the
same weights) for the rlpost vLLM engine in fp32 and in bf16.

    .venv/bin/python -m benchmarks.generation [--prompts 64 --new-tokens 32]

Results go to results/bench_generation.json, the latest run per configuration.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import RESULTS_DIR, Row, now, run_key, save_latest

if TYPE_CHECKING:
    import torch

RESULTS = RESULTS_DIR / "bench_generation.json"
TEMPERATURE = 0.8

ENVIRONMENT = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_LOGGING_LEVEL": "WARNING", "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
"""Defaults set before torch and vLLM load (in `main`: importing this module changes nothing): one compute thread,
the engine in this process."""


def perturbed_weights(model: Any, seed: int = 1, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise on every matrix (tied weights stay tied)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in params.values():
        if p.dim() >= 2:
            p.add_(torch.randn(p.shape, generator=g) * scale)
    tied = params["model.embed_tokens.weight"]
    return {n: (params[n] if n in params else tied).clone() for n in model.state_dict()}


def make_batch(n: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """n prompts of 8..16 random tokens (ids 3..vocab-1), right-padded with 0."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 17, (n,), generator=g)
    ids = torch.zeros((n, int(lens.max())), dtype=torch.long)
    for i, ln in enumerate(lens.tolist()):
        ids[i, :ln] = torch.randint(3, vocab, (ln,), generator=g)
    return {"input_ids": ids, "input_lengths": lens}


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    fn()  # warm-up
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def mult_prob_error(ref_model: Any, weights: dict[str, torch.Tensor], out: Any, batch: dict[str, torch.Tensor]
                    ) -> float:
    """mean exp|lp_engine - lp_ref| over all generated tokens."""
    import torch

    ref_model.load_state_dict(weights)
    errs = []
    with torch.no_grad():
        for i in range(out["output_ids"].shape[0]):
            n_in, n = int(batch["input_lengths"][i]), int(out["unpadded_sequence_lengths"][i])
            seq = out["output_ids"][i, :n]
            lp = (ref_model(seq[None]).logits[0].float() / TEMPERATURE).log_softmax(-1)
            ref = lp[n_in - 1 : n - 1].gather(-1, seq[n_in:n, None])[:, 0]
            errs.append(torch.exp((out["logprobs"][i, n_in:n] - ref).abs()))
    return float(torch.cat(errs).mean())


def hf_bf16_error(ref32: Any, ref16: Any, weights: dict[str, torch.Tensor], out: Any, batch: dict[str, torch.Tensor]
                  ) -> float:
    """token_mult_prob_error of a bf16 HF model against the fp32 one, on the tokens in `out`."""
    import torch

    ref32.load_state_dict(weights)
    errs = []
    with torch.no_grad():
        for i in range(out["output_ids"].shape[0]):
            n_in, n = int(batch["input_lengths"][i]), int(out["unpadded_sequence_lengths"][i])
            seq = out["output_ids"][i, :n]
            lps = [(m(seq[None]).logits[0].float() / TEMPERATURE).log_softmax(-1) for m in (ref32, ref16)]
            a, b = (lp[n_in - 1 : n - 1].gather(-1, seq[n_in:n, None])[:, 0] for lp in lps)
            errs.append(torch.exp((a - b).abs()))
    return float(torch.cat(errs).mean())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.generation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    import ray
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from rlpost.config.schema.generation import HFGenerationConfig, VllmConfig
    from rlpost.config.schema.model import TinyModelConfig
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.models.generation.hf_generation import HFGeneration
    from rlpost.models.generation.vllm_generation import VllmGeneration, engine_kwargs, sampling_spec
    from rlpost.models.tiny import ensure_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="rlpost-bench-"))
    atexit.register(shutil.rmtree, tmp, True)
    model_dir = ensure_tiny_model(TinyModelConfig(), tmp / "tiny")
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weights = perturbed_weights(ref)
    weights_dir = tmp / "perturbed"
    ref.load_state_dict(weights)
    ref.save_pretrained(weights_dir)  # the bare engines load the same weights from disk
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model_dir).save_pretrained(weights_dir)
    batch = make_batch(args.prompts, vocab=300)
    tokens = args.prompts * args.new_tokens
    results: dict[str, Any] = {
        "workload": {"prompts": args.prompts, "new_tokens": args.new_tokens, "temperature": TEMPERATURE},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "threads_per_process": 1,
        "engines": {},
    }

    def record(name: str, seconds: float, **extra: Any) -> None:
        results["engines"][name] = {"seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1), **extra}
        print(f"{name:14s} {tokens / seconds:9.1f} tok/s  ({seconds:.3f} s)  {extra or ''}", flush=True)

    # ---- rlpost engines (Ray actors)
    ray.init(
        address="local",  # always a fresh local cluster
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 2**20,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    try:
        for precision in ("float32", "bfloat16"):
            cfg = VllmConfig(max_new_tokens=args.new_tokens, temperature=TEMPERATURE, stop_token_ids=[])
            cfg.vllm_cfg.precision, cfg.vllm_cfg.kv_cache_space_gb, cfg.vllm_cfg.max_model_len = precision, 0.25, 128
            cluster = RayVirtualCluster(f"bench-vllm-{precision}", workers_per_node=1, cpus_per_bundle=0.5)
            eng = VllmGeneration(cfg, cluster, str(model_dir))
            try:
                t = time.perf_counter()
                eng.update_weights(weights.items())
                refit_s = time.perf_counter() - t
                t = time.perf_counter()
                eng.update_weights(weights.items())
                refit_s = min(refit_s, time.perf_counter() - t)
                seconds, out = best_time(functools.partial(eng.generate, batch), args.repeats)
                assert int(out["generation_lengths"].min()) == args.new_tokens
                err = mult_prob_error(ref, weights, out, batch)
                name = "vllm_rlpost" if precision == "float32" else "vllm_rlpost_bf16"
                extra: dict[str, Any] = {"refit_s": round(refit_s, 4), "token_mult_prob_error": round(err, 7)}
                if precision == "bfloat16":
                    # context: the same metric for a plain HF model in bf16 (no vLLM) on the same tokens,
                    # and vLLM bf16 on the unperturbed (near-uniform, small-logit) tiny model
                    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
                    hf16.load_state_dict(weights)
                    extra["hf_bf16_same_tokens"] = round(hf_bf16_error(ref, hf16, weights, out, batch), 7)
                    original = {
                        n: t.clone() for n, t in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()
                    }
                    eng.update_weights(original.items())
                    extra["token_mult_prob_error_unperturbed"] = round(
                        mult_prob_error(ref, original, eng.generate(batch), batch), 7
                    )
                record(name, seconds, **extra)
            finally:
                eng.shutdown()
                cluster.shutdown()
        hcfg = HFGenerationConfig(
            max_new_tokens=args.new_tokens,
            temperature=TEMPERATURE,
            stop_token_ids=[],
            generation_batch_size=args.prompts,
        )
        cluster = RayVirtualCluster("bench-hf", workers_per_node=1, cpus_per_bundle=0.5)
        heng = HFGeneration(hcfg, cluster, str(model_dir))
        try:
            t = time.perf_counter()
            heng.update_weights(weights.items())
            refit_s = time.perf_counter() - t
            seconds, out = best_time(lambda: heng.generate(batch), args.repeats)
            err = mult_prob_error(ref, weights, out, batch)
            record("hf_rlpost", seconds, refit_s=round(refit_s, 4), token_mult_prob_error=round(err, 7))
        finally:
            heng.shutdown()
            cluster.shutdown()
    finally:
        ray.shutdown()

    # ---- bare HF generate, in this process (before vLLM, whose CPU worker pins torch's thread count)
    ref.load_state_dict(weights)
    prompts = [row[: int(n)].tolist() for row, n in zip(batch["input_ids"], batch["input_lengths"], strict=True)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    ref.generation_config.eos_token_id = None

    def hf_bare() -> Any:
        with torch.no_grad():
            return ref.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=TEMPERATURE,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )

    seconds, _ = best_time(hf_bare, args.repeats)
    record("hf_bare", seconds)

    # ---- bare vLLM, in this process, same settings as the rlpost replica
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = VllmConfig(max_new_tokens=args.new_tokens, temperature=TEMPERATURE, stop_token_ids=[])
    cfg.vllm_cfg.kv_cache_space_gb, cfg.vllm_cfg.max_model_len = 0.25, 128
    llm = LLM(model=str(weights_dir), **engine_kwargs(cfg, 0, use_gpus=False))
    params = SamplingParams(**sampling_spec(cfg, greedy=False, eos_token_id=None))
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    seconds, outs = best_time(lambda: llm.generate(token_prompts, params, use_tqdm=False), args.repeats)
    assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
    record("vllm_bare", seconds)

    e = results["engines"]
    results["overhead"] = {
        "vllm_rlpost_vs_bare": round(e["vllm_bare"]["tokens_per_s"] / e["vllm_rlpost"]["tokens_per_s"], 3),
        "hf_rlpost_vs_bare": round(e["hf_bare"]["tokens_per_s"] / e["hf_rlpost"]["tokens_per_s"], 3),
    }
    results["date"] = now()
    print(json.dumps(results["overhead"]))
    save_latest(args.out, run_key(args), results)
    return 0


def table_rows(result: dict[str, Any]) -> list[Row]:
    """The suite's rows for one result: each rlpost engine's tokens/s beside the bare engine it wraps."""
    e = result["engines"]
    return [Row(f"{kind} generation", f"{e[f'{kind}_rlpost']['tokens_per_s']:.0f} tok/s",
                f"{e[f'{kind}_bare']['tokens_per_s']:.0f} tok/s bare {label}",
                e[f"{kind}_rlpost"]["tokens_per_s"] / e[f"{kind}_bare"]["tokens_per_s"])
            for kind, label in (("vllm", "vLLM"), ("hf", "HF generate"))]


if __name__ == "__main__":
    sys.exit(main())
