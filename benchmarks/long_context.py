"""Long sequences on the DTensor policy: one SFT training step, then one logprob pass, on one row of T tokens, the output
layer read in chunks (rlpost.ops.chunked_head.HeadLogits) against the whole [T, V] logits, with and without activation
checkpointing, on one rank or split over `--cp` context-parallel ranks; the worker's peak memory and time.

    make smollm2 && .venv/bin/python -m benchmarks.long_context --tokens 1024 2048 4096 8192
    .venv/bin/python -m benchmarks.long_context --tokens 1024 4096 --heads chunked --ac on
    .venv/bin/python -m benchmarks.long_context --tokens 4096 --heads chunked --ac on --cp 1 2   # context parallelism
    .venv/bin/python -m benchmarks.long_context --tokens 256 512 model=tiny      # the tiny model, a quick look

Each (tokens, head, checkpointing, cp) runs in child processes of its own, one per rank, each holding one real
DTensorPolicyWorker (gloo, one torch thread, as a run's worker): a rank's memory is its process's RSS, sampled every
50 ms, its peak during the step beside its level before it (the model, its gradients and the optimizer state); a row
reports the largest rank. "whole" is the loss asking for real logits (a loss without `chunked_logits`): the [T, V]
logits and their gradient.
Extra arguments are Hydra overrides (default: model=smollm2_135m). Results: results/bench_long_context.json, the
latest run per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from benchmarks.harness import RESULTS_DIR, host, now, run_key, save_latest

RESULTS = RESULTS_DIR / "bench_long_context.json"
GIB = 2**30


class _PeakRSS:
    """This process's peak RSS between entering and leaving, sampled every `sample_s`."""

    def __init__(self, sample_s: float = 0.05) -> None:
        import psutil

        self._proc, self.sample_s = psutil.Process(), sample_s
        self.start = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.sample_s):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> _PeakRSS:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=2)
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _child(tokens: int, head: str, ac: bool, cp: int, overrides: list[str]) -> dict[str, Any]:
    """One worker (rank RANK of `cp`), one row of `tokens` tokens: two training steps, then a logprob pass. Runs in
    its own process."""
    import torch

    from rlpost.config.load import load_master_config
    from rlpost.config.schema.policy import DTensorPolicyConfig
    from rlpost.distributed.batched_data_dict import BatchedDataDict
    from rlpost.distributed.ports import free_port
    from rlpost.losses.clipped_pg import NLLLoss
    from rlpost.models.policy.dtensor_policy_worker import DTensorPolicyWorker
    from rlpost.models.tiny import ensure_tiny_model
    from rlpost.ops.logprobs import next_token_logprobs

    os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    os.environ.update(WORLD_SIZE=str(cp), MASTER_ADDR="127.0.0.1", RLPOST_DEVICE="cpu")
    _, cfg = load_master_config(["algo=sft", f"cluster.gpus_per_node={cp}", "cluster.device=cpu",
                                 f"policy.dtensor_cfg.context_parallel_size={cp}",
                                 f"policy.max_total_sequence_length={tokens}", "policy.train_global_batch_size=1",
                                 "policy.train_micro_batch_size=1", "policy.logprob_batch_size=1",
                                 f"policy.dtensor_cfg.activation_checkpointing={str(ac).lower()}", *overrides])
    if cfg.model.tiny is not None:
        ensure_tiny_model(cfg.model.tiny, cfg.model.path)
    assert isinstance(cfg.policy, DTensorPolicyConfig), "benchmarks.long_context measures the DTensor policy"
    worker = DTensorPolicyWorker(cfg.policy, init_reference_model=False)
    vocab = int(worker.model.config.vocab_size)  # type: ignore[union-attr,arg-type]
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([tokens]), token_mask=torch.ones(1, tokens),
                           sample_mask=torch.ones(1))

    class WholeLogits(NLLLoss):
        chunked_logits = False  # the model's own lm_head: the whole [T, V] logits, and their gradient

    loss = NLLLoss() if head == "chunked" else WholeLogits()
    out: dict[str, Any] = {"tokens": tokens, "head": head, "activation_checkpointing": ac, "cp": cp, "vocab": vocab}
    worker.train(data, loss)  # the first step builds the optimizer state: measured on the second
    with _PeakRSS() as mem:
        t0 = time.perf_counter()
        result = worker.train(data, loss)
        out["train_s"] = time.perf_counter() - t0
    out["train_peak_gib"], out["train_added_gib"] = mem.peak / GIB, (mem.peak - mem.start) / GIB
    with _PeakRSS() as mem:  # after the training steps, as in a run (the prev-logprobs pass of the next step)
        t0 = time.perf_counter()
        if head == "chunked":
            worker.get_logprobs(data)
        else:
            with torch.no_grad():
                next_token_logprobs(worker._forward_logits(data)[0], ids)
        out["logprob_s"] = time.perf_counter() - t0
    out["logprob_peak_gib"], out["logprob_added_gib"] = mem.peak / GIB, (mem.peak - mem.start) / GIB
    out["loss"] = float(result["loss"])
    out["tokens_per_s"] = tokens / out["train_s"]
    return out


def _run_child(tokens: int, head: str, ac: bool, cp: int, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    """The `cp` ranks of one configuration, each in its own process; the row of the rank with the largest peak."""
    from rlpost.distributed.ports import free_port

    argv = [sys.executable, "-m", "benchmarks.long_context", "--child", str(tokens), head, "on" if ac else "off",
            str(cp), *overrides]
    port = str(free_port("127.0.0.1"))
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "MASTER_PORT": port})
             for rank in range(cp)]
    rows = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{stderr[-3000:]}")
        rows.append(json.loads(lines[-1]))
    result: dict[str, Any] = max(rows, key=lambda r: r["train_peak_gib"])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--heads", nargs="+", choices=["chunked", "whole"], default=["chunked", "whole"])
    p.add_argument("--ac", nargs="+", choices=["on", "off"], default=["on", "off"])
    p.add_argument("--cp", type=int, nargs="+", default=[1], help="context-parallel ranks splitting the row")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="bound on one child")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--child", nargs=4, metavar=("TOKENS", "HEAD", "AC", "CP"), help=argparse.SUPPRESS)
    args, overrides = p.parse_known_args(argv)
    overrides = overrides or ["model=smollm2_135m"]
    if args.child:
        tokens, head, ac, cp = args.child
        print(json.dumps(_child(int(tokens), head, ac == "on", int(cp), overrides)), flush=True)
        return 0
    args.overrides = overrides
    rows = []
    for tokens in args.tokens:
        for ac in args.ac:
            for head in args.heads:
                for cp in args.cp:
                    r = _run_child(tokens, head, ac == "on", cp, overrides, args.timeout_s)
                    rows.append(r)
                    print(f"{tokens:6d} tokens  {head:7s}  checkpointing {ac:3s}  cp {cp}  train {r['train_s']:7.1f}s "
                          f"peak {r['train_peak_gib']:.2f} GiB (+{r['train_added_gib']:.2f})  logprobs "
                          f"{r['logprob_s']:6.1f}s peak {r['logprob_peak_gib']:.2f} GiB (+{r['logprob_added_gib']:.2f})",
                          flush=True)
    save_latest(args.out, run_key(args), {"at": now(), "host": host(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
