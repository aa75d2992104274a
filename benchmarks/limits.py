"""The limits a GRPO step is measured against, on the same model and the same batch, in one process:

- bare generation: rlpost's engine class (vLLM or HF) driven in-process, no Ray, same prompts and
  sampling settings as one GRPO step;
- bare training: plain torch forward + backward + AdamW on the generated batch, the same
  micro-batch size, one process;
- bare alternating: the two above in turn in that one process (generation, training, generation, ...), each
  timed pair a step of a single-process trainer: above their sum by what each phase loses to the other's use of
  the caches;
- bare load: the same engine, in-process, loading the model's weights in place the way a refit does (vLLM's
  reload_weights), the part of a refit no transport can avoid;
- memcpy: copying the model's bytes once (the floor for moving a refit's bytes).

Used by benchmarks.grpo and benchmarks.refit; `measure_limits(cfg)` returns seconds and GB/s. Generation and
training are timed several times: `bare_*_s` is the best run (the strict floor), `bare_*_median_s` the median (what
the run's median step is compared with: a shared host's speed drifts within minutes, and a best run is a lucky
one).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _threads() -> None:
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))


def step_prompts(cfg: Any) -> list[list[int]]:
    """The token ids of one GRPO step's prompts (num_prompts_per_step x num_generations_per_prompt)."""
    from rlpost.data.datasets import load_rows
    from rlpost.data.prompts import PromptProcessor, load_tokenizer

    tok = load_tokenizer(cfg.policy.tokenizer, cfg.policy.trust_remote_code)
    proc = PromptProcessor(cfg.data, tok, cfg.policy.tokenizer.chat_template_kwargs)
    rows = load_rows(cfg.data, "train")[: cfg.grpo.num_prompts_per_step]
    ids = [list(proc(r)["prompt_ids"]) for r in rows]
    return [p for p in ids for _ in range(cfg.grpo.num_generations_per_prompt)]


def _model_weights(cfg: Any) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    path = str(cfg.policy.model_name)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return [item for f in files for item in load_file(os.path.join(path, f)).items()]


def run_device(cfg: Any) -> str:
    """'cuda' or 'cpu': the device `cfg`'s run computes on (cluster.device, resolved as a run resolves it)."""
    from rlpost.distributed.virtual_cluster import resolve_device

    return resolve_device(cfg.cluster)


def _engine_worker(cfg: Any) -> tuple[Any, Any, Any]:
    """rlpost's engine worker class for `cfg` in this process (on the run's device, with the engine arguments a run
    gives it there), its sampling spec, and the seeds argument."""
    gen = cfg.policy.generation
    model = str(cfg.policy.model_name)
    if "Vllm" in gen._target_:
        from torch import _dynamo

        import rlpost.models.generation.vllm_generation as vg
        from rlpost.models.generation.vllm_worker import VllmEngineWorker

        on_gpu = run_device(cfg) == "cuda"
        os.environ.update(vg.engine_env(gen.vllm_cfg, on_gpu))
        _dynamo.config.disable = os.environ.get("TORCHDYNAMO_DISABLE") == "1"  # torch read the variable at import
        worker: Any = VllmEngineWorker(model, vg.engine_kwargs(gen, 0, on_gpu, model_path=model))
        return worker, vg.sampling_spec(gen, False, worker.tokenizer.eos_token_id), None
    from rlpost.models.generation import hf_generation as hg

    worker = hg.HFGenerationWorker(model, gen.precision, gen.generation_batch_size)
    return worker, hg.hf_sampling_spec(gen, False, worker.tokenizer.eos_token_id), 0  # one seed per call


def _bare_loads(cfg: Any, worker: Any, repeats: int) -> dict[str, float]:
    """`bare_load_s`: the best wall time of `worker` loading the model's weights in place (its `update_weights`,
    the engine's one loading path, as a refit uses it)."""
    weights, best = _model_weights(cfg), float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        worker.update_weights(weights)
        best = min(best, time.perf_counter() - t0)
    return {"bare_load_s": best}


def bare_loads(cfg: Any, repeats: int = 3) -> dict[str, float]:
    """`_bare_loads` on a fresh engine in this process (benchmarks.refit)."""
    worker, _, _ = _engine_worker(cfg)
    try:
        return _bare_loads(cfg, worker, repeats)
    finally:
        if hasattr(worker, "shutdown"):
            worker.shutdown()


def timed(fn: Callable[[], Any], repeats: int = 3, most: int = 11, budget_s: float = 3.0) -> list[float]:
    """Wall times of `fn()`: `repeats` runs, and more (up to `most`) while they fit in `budget_s`, so a millisecond
    workload gets a median as steady as the run's many steps while a model that takes seconds stays at `repeats`."""
    times: list[float] = []
    while len(times) < repeats or (len(times) < most and sum(times) < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def bare_generation(cfg: Any, prompts: list[list[int]], repeats: int = 3
                    ) -> tuple[list[float], list[list[int]], Callable[[], Any], Any]:
    """Wall times of generating for `prompts` with the engine class in this process (`timed`), the sequences, the
    generation as a function, and the engine worker (for `_bare_loads`, then its shutdown)."""
    worker, spec, seeds = _engine_worker(cfg)
    if seeds is None:
        seeds = list(range(len(prompts)))
    outs: list[Any] = []
    times = timed(lambda: outs.append(worker.generate(prompts, spec, seeds)), repeats)
    sequences = [list(p) + list(o.token_ids) for p, o in zip(prompts, outs[-1].samples(), strict=True)]
    return times, sequences, lambda: worker.generate(prompts, spec, seeds), worker


def bare_training(cfg: Any, sequences: list[list[int]], prompt_lens: list[int], repeats: int = 3
                  ) -> tuple[list[float], Callable[[], None]]:
    """Wall times (`timed`) of one optimizer step (forward + backward + AdamW, micro-batched) on `sequences` (the bare
    engine's: their token count, `bare_training_tokens`, differs a little from a GRPO step's), and the step."""
    from transformers import AutoModelForCausalLM

    _threads()
    device = torch.device(run_device(cfg))
    model = AutoModelForCausalLM.from_pretrained(str(cfg.policy.model_name), dtype=torch.float32)
    model.to(device)  # type: ignore[arg-type]  # transformers' stub types `to` as a no-argument wrapper
    model.train()
    lr = (getattr(cfg.policy.optimizer, "kwargs", None) or {}).get("lr", 1e-5)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False, fused=False)
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width)
    for i, (s, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, p : len(s)] = 1.0
    ids, mask, adv = ids.to(device), mask.to(device), torch.randn(len(sequences), 1, device=device)
    mbs = cfg.policy.train_micro_batch_size
    n_tok = mask[:, 1:].sum()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for a in range(0, len(sequences), mbs):
            logits = model(input_ids=ids[a : a + mbs]).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[a : a + mbs, 1:, None]).squeeze(-1)
            loss = -(adv[a : a + mbs] * lp * mask[a : a + mbs, 1:]).sum() / n_tok
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels finish inside its timing

    return timed(step, repeats), step


def bare_alternating(generate: Callable[[], Any], train: Callable[[], None], repeats: int = 3) -> list[float]:
    """Wall times of one bare generation followed by one bare training step, in turn, in this one process: what a
    single-process trainer pays for a step's two phases, each running after the other has evicted its caches."""
    def pair() -> None:
        generate()
        train()

    return timed(pair, repeats)


def memcpy_gbps(cfg: Any, repeats: int = 5) -> tuple[float, int]:
    """Best GB/s of copying every weight of the model once, and the model's bytes."""
    tensors = [t for _, t in _model_weights(cfg)]
    dst = [torch.empty_like(t) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors, strict=True):
            d.copy_(s)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9, nbytes


def measure_limits(cfg: Any) -> dict[str, float]:
    """Seconds of bare generation, bare training and the bare engine loads for one step's batch, and memcpy GB/s."""
    _threads()
    prompts = step_prompts(cfg)
    gen, sequences, generate, worker = bare_generation(cfg, prompts)
    try:
        train, train_step = bare_training(cfg, sequences, [len(p) for p in prompts])
        both = bare_alternating(generate, train_step)
        loads = _bare_loads(cfg, worker, 3)
    finally:
        if hasattr(worker, "shutdown"):
            worker.shutdown()
    gbps, nbytes = memcpy_gbps(cfg)
    return {"bare_generation_s": min(gen), "bare_training_s": min(train),
            "bare_generation_median_s": statistics.median(gen), "bare_training_median_s": statistics.median(train),
            "bare_alternating_s": min(both), "bare_alternating_median_s": statistics.median(both),
            "bare_repeats": float(min(len(gen), len(train))), **loads, "memcpy_gbps": gbps,
            "model_bytes": nbytes, "bare_training_tokens": sum(len(s) for s in sequences)}
