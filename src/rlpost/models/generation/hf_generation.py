"""HFGeneration: transformers `generate` in Ray actors (one per cluster worker, data parallel).

A fallback and reference engine with the same contract as VllmGeneration (see interfaces.py), driven
through RayWorkerGroup: a batch is cut into contiguous shards, one per worker; each worker generates
its shard in batches of `generation_batch_size` (prompts left-padded for `generate`, results
re-aligned to the contract's right-padded layout).

Logprobs follow vLLM's `processed_logprobs` convention (what VllmGeneration asks vLLM for): the
logprob of each sampled token under the distribution it was sampled from, i.e. log_softmax of
`generate`'s `output_scores`, which are the logits after the temperature / top-k / top-p warpers
(tokens cut by top-k/top-p are -inf, so the rest is renormalised). Greedy = log_softmax of the raw
logits (no warpers), like vLLM's greedy processed logprobs. vLLM's default `raw_logprobs` would
instead ignore the temperature; the trainer divides logits by the temperature, so processed is the
convention that makes token_mult_prob_error ≈ 1.

Stops: exactly `stop_token_ids` (None -> [eos]) and `stop_strings` (transformers' StopStringCriteria,
which matches on the token tail, so a stop string may straddle the prompt/generation boundary, where
vLLM only looks at generated text). The model's own generation_config defaults (eos, top_k=50, ...)
are neutralised so only the rlpost config applies. A recorder criterion notes the step at which
each row stopped, so generation lengths never depend on guessing where padding starts.

Refit: `update_weights` copies tensors into the model (`load_state_dict`); the engine-side fingerprint
is read back from the model's own parameters for the names sent (HF keeps checkpoint layout), and
the driver compares it with the sent tensors cast to the engine's precision.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, cast

import ray
import torch

from rlpost.config.schema.generation import GenerationConfig, HFGenerationConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.bucket_layout import PerDeviceBuckets, is_per_device
from rlpost.distributed.virtual_cluster import RayVirtualCluster
from rlpost.distributed.worker_groups import ALIVE_TIMEOUT_S, ParallelDims, RayWorkerGroup
from rlpost.models.fingerprint import FingerprintBuilder, check_fingerprints, fingerprint_of_digests, weight_fingerprint
from rlpost.models.generation.interfaces import GenerationInterface, StateDictInfo
from rlpost.models.generation.outputs import (
    EngineInfo,
    GeneratedBatch,
    GeneratedSample,
    assemble_outputs,
    contiguous_splits,
    row_stop_strings,
    unpack_prompts,
)
from rlpost.models.generation.sleep_state import SleepState
from rlpost.models.generation.vllm_extension import FAULT_ENV, check_against_info
from rlpost.runtime.gc_heap import import_frozen

if TYPE_CHECKING:
    from transformers import StopStringCriteria

    from rlpost.distributed.bucket_layout import RefitBucket
    from rlpost.distributed.collective import StatelessGroup

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFSamplingSpec(TypedDict):
    """The sampling settings of one generate call, as the HF workers get them."""

    greedy: bool
    temperature: float
    top_p: float
    top_k: int
    """0: off."""
    max_new_tokens: int
    stop_token_ids: list[int]
    stop_strings: list[str]


def hf_sampling_spec(cfg: GenerationConfig, greedy: bool, eos_token_id: int | None) -> HFSamplingSpec:
    """The per-call sampling settings sent to the HF workers (plain data)."""
    stop_ids = list(cfg.stop_token_ids) if cfg.stop_token_ids is not None else [eos_token_id]
    return {
        "greedy": bool(greedy),
        "temperature": float(cfg.temperature),
        "top_p": float(cfg.top_p),
        "top_k": int(cfg.top_k) if cfg.top_k is not None and cfg.top_k > 0 else 0,
        "max_new_tokens": int(cfg.max_new_tokens),
        "stop_token_ids": [int(t) for t in stop_ids if t is not None],
        "stop_strings": list(cfg.stop_strings) if cfg.stop_strings else [],
    }


def _stop_recorder(prompt_width: int, batch: int, stop_ids: list[int], string_criteria: StopStringCriteria | None
                   ) -> Any:
    from transformers import StoppingCriteria

    class _StopRecorder(StoppingCriteria):
        """Marks a row done at its first stop token / stop string and remembers how many tokens it had."""

        def __init__(self) -> None:
            self.lengths: list[int | None] = [None] * batch
            self._ids = torch.tensor(stop_ids, dtype=torch.long)

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
            n = input_ids.shape[1] - prompt_width
            hit = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            if len(stop_ids):
                hit |= torch.isin(input_ids[:, -1], self._ids.to(input_ids.device))
            if string_criteria is not None:
                hit |= string_criteria(input_ids, scores).to(hit.device)
            for i in torch.nonzero(hit).flatten().tolist():
                if self.lengths[i] is None:
                    self.lengths[i] = n
            return torch.tensor([x is not None for x in self.lengths], dtype=torch.bool, device=input_ids.device)

    return _StopRecorder()


class HFGenerationWorker:
    """One transformers model in a Ray actor."""

    def __init__(
        self, model_path: str, precision: str = "float32", batch_size: int = 32, seed: int = 0,
        hf_overrides: dict[str, object] | None = None,
    ) -> None:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        import_frozen("transformers.models.auto.modeling_auto")  # its objects frozen (rlpost.runtime.gc_heap)
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = _DTYPES[precision]
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = AutoConfig.from_pretrained(model_path, **(hf_overrides or {}))  # policy.hf_config_overrides
        model: Any = AutoModelForCausalLM.from_pretrained(
            model_path, config=config, dtype=self.dtype, use_safetensors=True
        )
        self.model = model.to(self.device).eval()
        gc = self.model.generation_config
        gc.eos_token_id = None  # stops come only from the rlpost config
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.refit_info: dict[str, tuple[tuple[int, ...], str]] | None = None
        self.group: StatelessGroup | None = None
        self.rank = int(os.environ.get("RANK", "0"))
        self.sleep_state = SleepState()  # rlpost.models.generation.sleep_state: the same rules on every device
        torch.manual_seed(seed + self.rank)

    def info(self) -> EngineInfo:
        """Tokenizer ids and placement."""
        return {"eos_token_id": self.tokenizer.eos_token_id, "pad_token_id": self.pad_id, "pid": os.getpid()}

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], spec: HFSamplingSpec) -> list[GeneratedSample]:
        from transformers import GenerationConfig, StoppingCriteriaList, StopStringCriteria

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding for generate
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        strings = StopStringCriteria(self.tokenizer, spec["stop_strings"]) if spec["stop_strings"] else None
        recorder = _stop_recorder(width, len(prompts), spec["stop_token_ids"], strings)
        sample = not spec["greedy"]
        gen_cfg = GenerationConfig(
            max_new_tokens=spec["max_new_tokens"],
            do_sample=sample,
            temperature=spec["temperature"] if sample else 1.0,
            top_p=spec["top_p"] if sample else 1.0,
            top_k=spec["top_k"] if sample else 0,
            eos_token_id=spec["stop_token_ids"] or None,
            pad_token_id=self.pad_id,
            output_scores=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        res = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            generation_config=gen_cfg,
            stopping_criteria=StoppingCriteriaList([recorder]),
        )
        new = res.sequences[:, width:].cpu()
        lps = torch.zeros(new.shape, dtype=torch.float32)
        for t, scores in enumerate(res.scores):  # one [B, V] at a time, never the whole [B, T, V]
            lps[:, t] = scores.float().log_softmax(-1).gather(-1, new[:, t : t + 1].to(scores.device))[:, 0].cpu()
        out = []
        for i in range(len(prompts)):
            n = recorder.lengths[i]
            stopped = n is not None
            n = n if stopped else new.shape[1]
            out.append(GeneratedSample(new[i, :n].tolist(), lps[i, :n].tolist(), truncated=not stopped))
        return out

    def generate(
        self, prompts: list[list[int]], spec: HFSamplingSpec, seed: int | None = None,
        stops: list[list[str]] | None = None,
    ) -> GeneratedBatch:
        """One sample per prompt, in order (packed); `seed` reseeds the sampler first (reproducible shards); `stops[i]`
        adds stop strings for prompt i (rows with the same stops are generated together)."""
        self.sleep_state.require_awake(f"HF engine rank {self.rank}")
        if seed is not None:
            torch.manual_seed(seed)
        groups: dict[tuple[str, ...], list[int]] = {}
        for i in range(len(prompts)):
            groups.setdefault(tuple(stops[i]) if stops else (), []).append(i)
        out: list[GeneratedSample | None] = [None] * len(prompts)
        for extra, idx in groups.items():
            group_spec: HFSamplingSpec = {**spec, "stop_strings": [*spec["stop_strings"], *extra]} if extra else spec
            for s in range(0, len(idx), self.batch_size):
                part = idx[s : s + self.batch_size]
                for i, sample in zip(part, self._generate_batch([prompts[i] for i in part], group_spec), strict=True):
                    out[i] = sample
        return GeneratedBatch.of(x for x in out if x is not None)

    # ------------------------------------------------------------------ sleep and wake
    def state(self) -> str:
        """The engine's sleep state in words (rlpost.models.generation.sleep_state)."""
        return self.sleep_state.name

    def sleep(self) -> bool:
        """Release the device for training: on a GPU the model moves to host memory; on a CPU only the state
        changes (there is no KV cache to drop between calls)."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.sleep_state.slept()
        return True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the `tags` parts (None: all); the weights come back to the device on a GPU."""
        parts = self.sleep_state.to_wake(tags)
        if "weights" in parts and self.device.type == "cuda":
            self.model.to(self.device)
        self.sleep_state.woke(parts)
        return True

    # ------------------------------------------------------------------ refit
    def prepare_refit_info(self, info: dict[str, tuple[tuple[int, ...], str]] | None) -> None:
        """Expected (shape, dtype) per parameter of later refits."""
        self.refit_info = info

    def update_weights(self, named: list[tuple[str, torch.Tensor]], corrupt: str | None = None) -> str:
        """load_state_dict the tensors; returns the fingerprint read back from the model's parameters."""
        named = list(named)
        check_against_info(named, self.refit_info)
        corrupt = corrupt or os.environ.get(FAULT_ENV) or None
        sd = {n: (t.detach().clone().add_(1.0) if n == corrupt else t) for n, t in named}
        result = self.model.load_state_dict(sd, strict=False)
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        missing = [m for m in result.missing_keys if not (tied and m == "lm_head.weight")]
        if result.unexpected_keys or missing:
            raise ValueError(f"refit: unexpected {result.unexpected_keys[:5]}, missing {missing[:5]}")
        own = self.model.state_dict()
        return weight_fingerprint((n, own[n]) for n in sd)

    def load_bucket(self, box: RefitBucket, corrupt: str | None = None) -> dict[str, str]:
        """Load one refit bucket (`box`: a shared-memory descriptor, or [ref] in the object store); per-tensor
        digests."""
        from rlpost.distributed.shm_buckets import read_bucket

        named = read_bucket(box)
        check_against_info(named, self.refit_info, partial=True)
        corrupt = corrupt or os.environ.get(FAULT_ENV) or None
        sd = {n: (t.detach().clone().add_(1.0) if n == corrupt else t) for n, t in named}
        result = self.model.load_state_dict(sd, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"refit: unexpected {result.unexpected_keys[:5]}")
        own = self.model.state_dict()
        fp = FingerprintBuilder()
        for n in sd:
            fp.add(n, own[n])
        return fp.digests()

    def init_collective(self, host: str, port: int, rank_offset: int, world_size: int, timeout_s: float) -> int:
        """Join the trainer's refit group as rank rank_offset + RANK."""
        from rlpost.distributed.collective import StatelessGroup

        rank = rank_offset + int(os.environ.get("RANK", "0"))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.group = StatelessGroup(host, port, rank, world_size, backend=backend, timeout_s=timeout_s)
        return rank

    def update_weights_from_collective(self, corrupt: str | None = None) -> str:
        """Receive the trainer's broadcast and load it."""
        if self.group is None:
            raise RuntimeError("init_collective was not called")
        return self.update_weights(self.group.broadcast_tensors(None, src=0), corrupt)

    def shutdown(self) -> bool:
        """Leave the refit group."""
        if self.group is not None:
            self.group.close()
            self.group = None
        return True


class HFGeneration(GenerationInterface):
    """transformers `generate` engines, one per cluster worker."""

    def __init__(
        self,
        cfg: HFGenerationConfig,
        cluster: RayVirtualCluster,
        model_path: str | None = None,
        timeout_s: float = 900.0,
        seed: int = 0,
        hf_overrides: Mapping[str, object] | None = None,
    ) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.model_path = model_path or cfg.model_name
        if not self.model_path:
            raise ValueError("HFGeneration needs model_path or cfg.model_name")
        self._refit_info: dict[str, tuple[tuple[int, ...], str]] | None = None
        self.sleep_state = SleepState()  # the engines' state as this side last set it (they start awake)
        self.group = RayWorkerGroup(
            cluster,
            HFGenerationWorker,
            self.model_path,
            cfg.precision,
            cfg.generation_batch_size,
            seed,
            dict(hf_overrides or {}),
            dims=ParallelDims(dp=cluster.world_size),
            name_prefix="hf-generation",
            timeout_s=timeout_s,
        )
        info: EngineInfo = self.group.run_rank0("info")
        self.eos_token_id: int | None = info["eos_token_id"]
        self.pad_token_id: int = int(info["pad_token_id"])

    def set_call_timeout(self, timeout_s: float) -> None:
        self.group.timeout_s = timeout_s

    def pause_for_refit(self, recompute_kv_cache: bool = False) -> None:
        raise RuntimeError("the HF engine cannot take weights mid-generation (in-flight weight updates need vLLM's "
                           "async engine)")

    def resume_after_refit(self) -> None:
        raise RuntimeError("the HF engine has no paused requests to resume")

    def check_alive(self) -> None:
        self.group.check_alive("info", ALIVE_TIMEOUT_S)

    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict:
        """Generate for every row of `data` (contract in rlpost.models.generation.interfaces)."""
        prompts = unpack_prompts(data)
        spec = hf_sampling_spec(self.cfg, greedy, self.eos_token_id)
        splits = contiguous_splits(len(prompts), self.group.dims.dp)
        shards = [prompts[a:b] for a, b in splits]
        stops = row_stop_strings(data)
        seeds = [int(x) for x in data["seeds"]] if "seeds" in data else None
        per_shard = [{"seed": seeds[a] if seeds and a < len(seeds) else None, "stops": stops[a:b] if stops else None}
                     for a, b in splits]
        parts = self.group.run_sharded("generate", shards, spec, shard_kwargs=per_shard)
        return assemble_outputs(data["input_ids"], data["input_lengths"], parts, self.pad_token_id)

    @property
    def asleep(self) -> bool:
        return not self.sleep_state.awake

    def prepare_for_generation(self, tags: list[str] | None = None, **kwargs: object) -> bool:
        """Wake the `tags` parts of every engine (None: all) that are asleep (rlpost.models.generation.sleep_state);
        nothing to do when they are awake."""
        parts = self.sleep_state.to_wake(tags)
        if parts:
            self.group.run_all("wake_up", parts)
            self.sleep_state.woke(parts)
        return True

    def finish_generation(self, **kwargs: object) -> bool:
        """Put a colocated engine to sleep (its model to host memory on a GPU, the state alone on a CPU)."""
        if self.cfg.colocated.enabled and not self.sleep_state.asleep:
            self.group.run_all("sleep")
            self.sleep_state.slept()
        return True

    def state(self) -> list[str]:
        """Each engine's sleep state in words, as the engine itself holds it."""
        return cast(list[str], self.group.run_all("state"))

    def prepare_refit_info(self, state_dict_info: StateDictInfo) -> None:
        """Every later refit must carry exactly these names, shapes and dtypes."""
        info = {n: (tuple(int(d) for d in s), str(dt)) for n, (s, dt) in state_dict_info.items()}
        self._refit_info = info
        self.group.run_all("prepare_refit_info", info)

    def _expected(self, items: list[tuple[str, torch.Tensor]]) -> str:
        dt = _DTYPES[self.cfg.precision]
        return weight_fingerprint((n, t.to(dt) if t.is_floating_point() else t) for n, t in items)

    def _check(self, fps: list[str], expected: str | None) -> str:
        return check_fingerprints(fps, expected, who="worker")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Load new weights into every worker; returns the checked fingerprint (in the engine's precision)."""
        items = [(n, t.detach().to("cpu").contiguous()) for n, t in named_tensors]
        corrupt = os.environ.get(FAULT_ENV) or None
        fps = self.group.run_all("update_weights", ray.put(items), corrupt)
        return self._check(fps, self._expected(items))

    def update_weights_from_buckets(self, buckets: Iterable[object]) -> str:
        """Every worker loads each bucket where the policy wrote it (the IPC buffer of the policy rank on its device,
        or the object store); the checked fingerprint."""
        corrupt = os.environ.get(FAULT_ENV) or None
        digests: list[dict[str, str]] = [{} for _ in range(self.group.world_size)]
        for box in buckets:  # per-device buckets: worker r reads the one policy rank r wrote on its device
            parts = (self.group.run_sharded("load_bucket", cast(PerDeviceBuckets, box)["per_rank"], corrupt)
                     if is_per_device(box)
                     else self.group.run_all("load_bucket", box, corrupt))
            for r, part in enumerate(parts):
                digests[r].update(part)
        fps = []
        for d in digests:
            missing = sorted(set(self._refit_info or {}) - set(d))
            if missing:
                raise RuntimeError(f"refit did not carry {missing[:5]} (prepare_refit_info announced them)")
            fps.append(fingerprint_of_digests(d))
        return self._check(fps, None)

    def init_collective_async(
        self, master_addr: str, master_port: int, rank_offset: int, world_size: int, timeout_s: float = 300.0
    ) -> list[ray.ObjectRef[object]]:
        """Start joining the refit group; wait with `self.group.get(futures)`."""
        return [
            w.init_collective.remote(master_addr, master_port, rank_offset, world_size, timeout_s)
            for w in self.group.workers
        ]

    def init_collective(self, master_addr: str, master_port: int, rank_offset: int, world_size: int) -> None:
        """Join the refit group; the trainer's rank 0 must join concurrently."""
        self.group.get(self.init_collective_async(master_addr, master_port, rank_offset, world_size))

    @property
    def engine_world_size(self) -> int:
        """Processes that join the refit group."""
        return self.group.world_size

    def wait_collective_init(self, futures: list[ray.ObjectRef[object]]) -> None:
        self.group.get(futures)

    def update_weights_from_collective_async(self) -> list[ray.ObjectRef[str]]:
        """Start receiving a broadcast; finish with `wait_collective_update(futures)`."""
        return [w.update_weights_from_collective.remote() for w in self.group.workers]

    def wait_collective_update(self, futures: list[ray.ObjectRef[str]], expected: str | None = None) -> str:
        """Wait for a collective refit; workers must agree (and match `expected`, the sender's, if given)."""
        return self._check(self.group.get(futures), expected)

    def update_weights_from_collective(self) -> str:
        """Receive the broadcast (sent concurrently by the trainer) and load it; workers must agree."""
        return self.wait_collective_update(self.update_weights_from_collective_async())

    def shutdown(self, graceful: bool = True) -> None:
        """Kill the workers, asking them to release first when `graceful` (idempotent)."""
        if getattr(self, "group", None) is not None and self.group.workers:
            self.group.shutdown(graceful_method="shutdown" if graceful else None, timeout_s=10.0)
