"""VllmEngineWorker: one vLLM engine (one data-parallel replica) inside a Ray actor.

Sync mode holds a `vllm.LLM`; with VLLM_ENABLE_V1_MULTIPROCESSING=0 its engine core and model run in
this very process (load in seconds on CPU, and refit tensors are handed to the model by reference).
Async mode holds a `vllm.v1.engine.async_llm.AsyncLLM` (its engine core is always a separate process)
driven by a private asyncio loop on a background thread, one coroutine per prompt; the actor's
methods stay synchronous, so Ray needs no async-actor handling. Refit goes through the
RlpostWorkerExtension methods (`collective_rpc`); to reach a separate engine-core process the tensors
travel as raw bytes (vLLM's RPC can't carry arbitrary tensors).

Returned samples are plain lists (token ids, logprobs, truncated flag); the driver assembles batches.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, Concatenate, NotRequired, ParamSpec, TypedDict, TypeVar, cast

import torch

from rlpost.models.generation.outputs import EngineInfo, GeneratedBatch, GeneratedSample
from rlpost.models.generation.sleep_state import SleepState
from rlpost.models.generation.vllm_extension import RlpostWorkerExtension
from rlpost.models.generation.vllm_lora import (
    ADAPTER_ID,
    ADAPTER_NAME,
    engine_lora_kwargs,
    remove_stage,
    stage_dir,
    sweep_orphans,
)
from rlpost.runtime.gc_heap import import_frozen, paused_gc, raise_young_threshold

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import CompletionOutput

    from rlpost.distributed.bucket_layout import RefitBucket

_T = TypeVar("_T")
_P = ParamSpec("_P")
_R = TypeVar("_R")

EXTENSION_CLS = "rlpost.models.generation.vllm_extension.RlpostWorkerExtension"


class SamplingSpec(TypedDict):
    """vLLM SamplingParams keyword arguments of one generate call (plain data, built on the driver)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    stop: list[str] | None
    logprobs: int
    detokenize: bool
    seed: NotRequired[int]


def _to_sample(completion: CompletionOutput) -> GeneratedSample:
    """A vLLM CompletionOutput (with logprobs=0) as a GeneratedSample."""
    ids = [int(t) for t in completion.token_ids]
    lps: list[float] = []
    if ids:
        if completion.logprobs is None:
            raise RuntimeError("vLLM returned no logprobs; SamplingParams.logprobs must be 0")
        lps = [float(pos[tok].logprob)  # type: ignore[index]  # logprobs=0: every position has the sampled token's
               for pos, tok in zip(completion.logprobs, ids, strict=True)]
    return GeneratedSample(token_ids=ids, logprobs=lps, truncated=completion.finish_reason == "length")


MAX_FAN_OUT = 16384
"""vLLM's default VLLM_MAX_N_SEQUENCES: the most samples one request may ask for."""


def fan_out_runs(
    prompts: list[list[int]], seeds: list[int] | None, stops: list[list[str]] | None, greedy: bool
) -> list[tuple[int, int]]:
    """The requests a generate call sends: [a, b) runs of rows that one vLLM request with n = b - a reproduces.

    A run is rows with the same prompt and the same stop strings whose seeds count up by one: vLLM gives the i-th
    of a request's n samples the seed `seed + i` (`ParentRequest`), so the run's samples are the very tokens the
    rows would get one request each, while the prompt is rendered, checked and admitted once (GRPO's groups: a
    prompt repeated num_generations_per_prompt times with consecutive seeds, `sample_seeds`). Without seeds rows
    of one prompt merge too (their samples are independent draws either way). Greedy requests stay one per row
    (vLLM refuses n > 1 there)."""
    runs: list[tuple[int, int]] = []
    a = 0
    for i in range(1, len(prompts) + 1):
        if (
            i < len(prompts)
            and not greedy
            and i - a < MAX_FAN_OUT
            and prompts[i] == prompts[a]
            and (seeds is None or seeds[i] == seeds[a] + (i - a))
            and (stops is None or stops[i] == stops[a])
        ):
            continue
        runs.append((a, i))
        a = i
    return runs


def _in_order(completions: list[CompletionOutput]) -> list[CompletionOutput]:
    """A request's n samples by their index (sample i has the seed `seed + i`)."""
    return sorted(completions, key=lambda c: c.index)


class VllmEngineWorker:
    """One engine replica. Built by VllmGeneration with the vLLM engine kwargs it computed."""

    def __init__(
        self,
        model_path: str,
        engine_kwargs: dict[str, Any],
        async_engine: bool = False,
        replica: int = 0,
        device: str = "cpu",
        lora_adapter: dict[str, Any] | None = None,
    ) -> None:
        """`lora_adapter`: the PEFT adapter config of the policy's LoRA when refits carry the adapter alone
        (rlpost.models.generation.vllm_lora); the engine then serves it on every request once the first refit
        delivered it."""
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.replica = replica
        self.async_engine = async_engine
        self.device = device
        # Tensors can be handed to the model by reference only when it lives in this process.
        self._in_process = (
            not async_engine
            and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
            and engine_kwargs.get("distributed_executor_backend", "uni") == "uni"
        )
        self.sleep_state = SleepState()  # rlpost.models.generation.sleep_state: the same rules on every device
        self._req = 0
        self._req_lock = threading.Lock()
        kwargs = {"model": model_path, "worker_extension_cls": EXTENSION_CLS, **engine_kwargs}
        self._lora_adapter = dict(lora_adapter) if lora_adapter else None
        self._lora_request: Any = None  # vllm LoRARequest of the adapter served, after the first adapter refit
        if self._lora_adapter is not None:
            kwargs.update(engine_lora_kwargs(self._lora_adapter))
            sweep_orphans()  # what an engine killed on this node left in /dev/shm
        if "kv_cache_memory_bytes" in kwargs:  # the legacy env var would override the configured size
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if async_engine:
            import_frozen("vllm.engine.arg_utils", "vllm.v1.engine.async_llm")  # rlpost.runtime.gc_heap
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async-loop", daemon=True)
            self._thread.start()

            async def _make() -> AsyncLLM:
                return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

            self.engine: Any = self._run(_make())
            self.tokenizer = self.engine.get_tokenizer()
        else:
            import_frozen("vllm.entrypoints.llm")  # vLLM's import, its objects frozen (rlpost.runtime.gc_heap)
            from vllm import LLM
            # The build with the collector off too: vLLM's engine core collects and freezes its own heap once
            # built (freeze_gc_heap), so what the build dropped is freed there.
            with paused_gc(freeze=False):
                self.engine = LLM(**kwargs)
            self.tokenizer = self.engine.get_tokenizer()
        raise_young_threshold()  # a generation call holds thousands of objects at once (rlpost.runtime.gc_heap)

    # ------------------------------------------------------------------ plumbing
    def _run(self, coro: Coroutine[object, None, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _rpc(self, method: Callable[Concatenate[RlpostWorkerExtension, _P], _R], *args: _P.args,
             **kwargs: _P.kwargs) -> list[_R]:
        """`method` of the worker extension (rlpost.models.generation.vllm_extension) on every worker of the
        replica, by name (vLLM's collective_rpc); one result per worker."""
        assert not kwargs, "collective_rpc passes positional arguments"
        if self.async_engine:
            return self._run(self.engine.collective_rpc(method.__name__, args=args))
        return self.engine.collective_rpc(method.__name__, args=args)

    def info(self) -> EngineInfo:
        """Tokenizer ids and where this replica runs."""
        return {
            "replica": self.replica,
            "pid": os.getpid(),
            "device": self.device,
            "eos_token_id": self.tokenizer.eos_token_id,
            "pad_token_id": self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id,
        }

    # ------------------------------------------------------------------ generation
    def _sampling_params(self, spec: SamplingSpec) -> SamplingParams:
        """One request's SamplingParams. Built fresh for each request and never reused, so vLLM may take it with
        a shallow copy (`skip_clone`, as its own OpenAI server does) instead of deep-copying it per request, a
        cost every request would pay otherwise."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(**spec, output_kind=RequestOutputKind.FINAL_ONLY, skip_clone=True)

    def generate_chunks(self, prompts: list[list[int]], sampling: SamplingSpec, seeds: list[int] | None,
                        stops: list[list[str]] | None, bounds: list[tuple[int, int]]) -> Iterator[GeneratedBatch]:
        """`generate` for rows [a, b) of each (a, b) in `bounds`, one after the other, each chunk yielded (a Ray
        streaming call: the caller gets it while the next one generates)."""
        self.sleep_state.require_awake(self.name)
        for a, b in bounds:
            yield self.generate(prompts[a:b], sampling, seeds[a:b] if seeds is not None else None,
                                stops[a:b] if stops is not None else None)

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingSpec,
        seeds: list[int] | None = None,
        stops: list[list[str]] | None = None,
    ) -> GeneratedBatch:
        """Generate one sample per prompt (token-id lists) with SamplingParams(**sampling); input order kept.

        With `seeds`, prompt i samples with its own seed (reproducible whatever ran before); `stops[i]` adds
        stop strings for prompt i. With the async engine, concurrent calls (the actor is threaded) share it.
        Rows that repeat a prompt with consecutive seeds go as one request for several samples (`fan_out_runs`):
        the same tokens, with the prompt rendered, checked and admitted once per run instead of once per row."""
        self.sleep_state.require_awake(self.name)
        if not prompts:
            return GeneratedBatch()
        runs = fan_out_runs(prompts, seeds, stops, float(sampling.get("temperature", 1.0)) == 0.0)
        per_run = []
        for a, b in runs:
            spec = sampling.copy()
            spec["n"] = b - a
            if seeds is not None:
                spec["seed"] = int(seeds[a])
            if stops is not None and stops[a]:
                spec["stop"] = [*(sampling.get("stop") or []), *stops[a]]
                spec["detokenize"] = True  # vLLM matches stop strings on the detokenized text
            per_run.append(self._sampling_params(spec))
        token_prompts = [{"prompt_token_ids": list(prompts[a])} for a, _ in runs]
        if not self.async_engine:
            outs = self.engine.generate(token_prompts, per_run, use_tqdm=False, lora_request=self._lora_request)
            return GeneratedBatch.of(_to_sample(c) for o in outs for c in _in_order(o.outputs))
        with self._req_lock:  # request ids stay unique across the actor's threads
            base = self._req
            self._req += len(runs)

        async def one(i: int, prompt: dict[str, list[int]]) -> list[GeneratedSample]:
            final = None
            async for out in self.engine.generate(prompt, per_run[i], request_id=f"r{self.replica}-{base + i}",
                                                  lora_request=self._lora_request):
                final = out
            if final is None:
                raise RuntimeError(f"no output for prompt {runs[i][0]}")
            return [_to_sample(c) for c in _in_order(final.outputs)]

        async def all_() -> GeneratedBatch:
            done = await asyncio.gather(*(one(i, p) for i, p in enumerate(token_prompts)))
            return GeneratedBatch.of(s for samples in done for s in samples)

        return self._run(all_())

    # ------------------------------------------------------------------ in-flight weight updates (async engine)
    def pause(self, clear_cache: bool = False) -> bool:
        """Freeze the requests in flight (they resume where they were); with `clear_cache` their KV cache is
        dropped and recomputed on resume with the new weights. Async engine only."""
        if not self.async_engine:
            raise RuntimeError("in-flight weight updates need vllm_cfg.async_engine=true")
        self._run(self.engine.pause_generation(mode="keep", clear_cache=clear_cache))
        return True

    def resume(self) -> bool:
        """Let the frozen requests go on (with whatever weights were loaded meanwhile)."""
        self._run(self.engine.resume_generation())
        return True

    # ------------------------------------------------------------------ sleep and wake
    @property
    def name(self) -> str:
        return f"vLLM replica {self.replica}"

    def state(self) -> str:
        """The engine's sleep state in words (rlpost.models.generation.sleep_state)."""
        return self.sleep_state.name

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the `tags` parts (None: weights and KV cache) that are asleep. On a GPU vLLM's sleep mode brings
        them back to the device; on a CPU only the state changes."""
        parts = self.sleep_state.to_wake(tags)
        if parts and self.device == "cuda":
            if self.async_engine:
                self._run(self.engine.wake_up(parts))
            else:
                self.engine.wake_up(parts)
        self.sleep_state.woke(parts)
        return True

    def sleep(self, level: int = 1) -> bool:
        """Release the device for training: on a GPU, level 1 offloads the weights to host memory and drops the KV
        cache (vLLM's sleep mode); on a CPU only the state changes."""
        if self.sleep_state.asleep:
            return True
        self.reset_prefix_cache()
        if self.device == "cuda":
            if self.async_engine:
                self._run(self.engine.sleep(level))
            else:
                self.engine.sleep(level)
        self.sleep_state.slept()
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes (they hold activations of the old weights)."""
        if self.async_engine:
            return bool(self._run(self.engine.reset_prefix_cache()))
        return bool(self.engine.reset_prefix_cache())

    # ------------------------------------------------------------------ refit
    def prepare_refit_info(self, info: dict[str, tuple[tuple[int, ...], str]] | None) -> None:
        """Store the expected (shape, dtype) per parameter in every engine worker."""
        self._rpc(RlpostWorkerExtension.rlpost_set_refit_info, info)

    def _before_refit(self) -> None:
        self.wake_up(["weights"])

    def _serve_adapter(self) -> None:
        """After an adapter refit: the engine loads the adapter just received in place of the last one."""
        from vllm.lora.request import LoRARequest

        if self._lora_adapter is None:
            return
        out_dir = stage_dir(self.replica)
        if not any(self._rpc(RlpostWorkerExtension.rlpost_stage_adapter, str(out_dir), self._lora_adapter)):
            return
        load = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(out_dir), load_inplace=True)
        added = self._run(self.engine.add_lora(load)) if self.async_engine else self.engine.llm_engine.add_lora(load)
        if not added:
            raise RuntimeError(f"replica {self.replica}: vLLM did not load the LoRA adapter from {out_dir}")
        self._lora_request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(out_dir))  # requests name it, never reload it

    def _after_refit(self, fingerprints: list[str]) -> str:
        self._serve_adapter()
        self.reset_prefix_cache()
        if len(set(fingerprints)) != 1:
            raise RuntimeError(f"replica {self.replica}: its TP/PP workers loaded different weights {fingerprints}")
        return fingerprints[0]

    def update_weights(self, named: list[tuple[str, torch.Tensor]], corrupt: str | None = None) -> str:
        """Load full HF-named tensors in place; returns the fingerprint of what the model consumed."""
        self._before_refit()
        if self._in_process:
            fps = self._rpc(RlpostWorkerExtension.rlpost_load, named, corrupt)
        else:
            from rlpost.models.generation.vllm_extension import pack_for_rpc

            fps = self._rpc(RlpostWorkerExtension.rlpost_load_packed, pack_for_rpc(named), corrupt)
        return self._after_refit(fps)

    def load_bucket(self, box: RefitBucket, corrupt: str | None = None, last: bool = False) -> dict[str, str]:
        """Load one refit bucket (`box`: the descriptors of the policy ranks on this replica's devices, a shared-memory
        or CUDA IPC descriptor, or [ref] in the object store); per-tensor digests. `last`: the refit's final bucket,
        so `end_refit` runs in the same call."""
        from rlpost.distributed.bucket_layout import CudaIpcBucket, PerDeviceBuckets, is_per_device
        from rlpost.distributed.cuda_ipc_buckets import is_cuda_ipc
        from rlpost.distributed.shm_buckets import read_bucket
        from rlpost.models.generation.vllm_extension import pack_for_rpc

        self._before_refit()
        on_devices: list[CudaIpcBucket] | None = None
        if is_per_device(box):  # written by the policy rank on each of this replica's devices
            parts = cast(PerDeviceBuckets, box)["per_rank"]
            if is_cuda_ipc(parts[0]):  # each engine worker opens the buffer on its own GPU: no copy through here
                on_devices = cast(list[CudaIpcBucket], parts)
            else:  # host memory: the replica's one worker reads its slot's segment
                box = parts[0]
        elif is_cuda_ipc(box):
            on_devices = [cast(CudaIpcBucket, box)]
        if on_devices is not None:
            digests = self._rpc(RlpostWorkerExtension.rlpost_load_bucket_ipc, on_devices, corrupt)
        elif self._in_process:
            digests = self._rpc(RlpostWorkerExtension.rlpost_load_bucket, read_bucket(box), corrupt)
        else:
            digests = self._rpc(RlpostWorkerExtension.rlpost_load_bucket_packed, pack_for_rpc(read_bucket(box)), corrupt)
        if any(d != digests[0] for d in digests[1:]):
            raise RuntimeError(f"replica {self.replica}: its TP/PP workers loaded different weights")
        if last:
            self.end_refit()
        return digests[0]

    def end_refit(self) -> bool:
        """After the last bucket: the adapter served (an adapter refit); cached prefixes hold activations of the
        old weights."""
        self._serve_adapter()
        self.reset_prefix_cache()
        return True

    def init_collective(self, host: str, port: int, rank_offset: int, world_size: int, timeout_s: float) -> list[int]:
        """Join the trainer's refit group; returns the ranks taken by this replica's workers."""
        backend = "nccl" if self.device == "cuda" else "gloo"
        return self._rpc(RlpostWorkerExtension.rlpost_init_collective, host, port, rank_offset, world_size, backend, timeout_s)

    def update_weights_from_collective(self, corrupt: str | None = None) -> str:
        """Receive the trainer's broadcast and load it; returns the fingerprint."""
        self._before_refit()
        return self._after_refit(self._rpc(RlpostWorkerExtension.rlpost_update_from_collective, corrupt))

    def shutdown(self) -> bool:
        """Leave the refit group, stop the engine and remove the adapter it served."""
        if self._lora_adapter is not None:
            remove_stage(stage_dir(self.replica))
        try:
            self._rpc(RlpostWorkerExtension.rlpost_close_collective)
        except Exception:  # noqa: BLE001 - best effort
            pass
        if self.async_engine:
            try:
                self.engine.shutdown()
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
        return True
