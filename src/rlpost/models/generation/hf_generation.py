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
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch

from rlpost.config.schema.generation import GenerationConfig, HFGenerationConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.bucket_layout import PerDeviceBuckets, is_per_device
from rlpost.distributed.virtual_cluster import RayVirtualCluster
from rlpost.distributed.worker_groups import ParallelDims, RayWorkerGroup
from rlpost.models.fingerprint import FingerprintBuilder, weight_fingerprint
from rlpost.models.generation.engine_group import EngineGroup
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


class PromptShard(TypedDict):
    """One worker's part of a generate() call."""

    prompts: list[list[int]]
    """Token ids of each prompt, unpadded."""
    seed: int | None
    """Reseed the sampler with this first (the shard's first row's seed); None: leave it."""
    stops: list[list[str]] | None
    """Stop strings per prompt on top of the config's; None: none."""


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

        from rlpost.config.model_families import attention_implementation

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = _DTYPES[precision]
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = AutoConfig.from_pretrained(model_path, **(hf_overrides or {}))  # policy.hf_config_overrides
        model: Any = AutoModelForCausalLM.from_pretrained(
            model_path, config=config, dtype=self.dtype, use_safetensors=True,
            attn_implementation=attention_implementation(config),
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

    def generate(self, shard: PromptShard, spec: HFSamplingSpec) -> GeneratedBatch:
        """One sample per prompt of `shard`, in order (packed); its `seed` reseeds the sampler first (reproducible
        shards); its `stops[i]` adds stop strings for prompt i (rows with the same stops are generated together)."""
        self.sleep_state.require_awake(f"HF engine rank {self.rank}")
        prompts, seed, stops = shard["prompts"], shard["seed"], shard["stops"]
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

    def sleep(self, level: int = 1) -> bool:
        """Release the device for training: on a GPU the model moves to host memory; on a CPU only the state
        changes (there is no KV cache to drop between calls). `level` is vLLM's (one level here)."""
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
        result, own = self._load_state(sd)
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        missing = [m for m in result.missing_keys if not (tied and m == "lm_head.weight")]
        if result.unexpected_keys or missing:
            raise ValueError(f"refit: unexpected {result.unexpected_keys[:5]}, missing {missing[:5]}")
        return weight_fingerprint((n, own[n]) for n in sd)

    def _load_state(self, sd: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
        """load_state_dict of `sd` (a checkpoint's names: a MoE layer's experts one matrix each, fused here as
        transformers holds them); (its result, the model's tensors read back under the checkpoint's names)."""
        from rlpost.models.expert_weights import ExpertAssembler, layout_of, num_experts, to_checkpoint_layout

        layout = layout_of(self.model.config)
        if layout is not None:
            experts = ExpertAssembler(layout, num_experts(self.model.config))
            fused = [experts.add(n, t) for n, t in sd.items()]
            if experts.incomplete():
                raise ValueError(f"refit: a bucket carries part of the experts of {experts.incomplete()[:3]}; "
                                 "raise policy.refit_buffer_size_gb to hold a layer")
            sd = dict(f for f in fused if f is not None)
        result = self.model.load_state_dict(sd, strict=False)
        return result, to_checkpoint_layout(self.model.config, self.model.state_dict())

    def load_bucket(self, box: RefitBucket, corrupt: str | None = None, last: bool = False) -> dict[str, str]:
        """Load one refit bucket (`box`: the descriptor the policy rank on this worker's device wrote, a
        shared-memory descriptor, or [ref] in the object store); per-tensor digests. `last` changes nothing here
        (`end_refit` has nothing to do)."""
        from rlpost.distributed.shm_buckets import read_bucket

        if is_per_device(box):
            box = cast(PerDeviceBuckets, box)["per_rank"][0]
        named = read_bucket(box)
        check_against_info(named, self.refit_info, partial=True)
        corrupt = corrupt or os.environ.get(FAULT_ENV) or None
        sd = {n: (t.detach().clone().add_(1.0) if n == corrupt else t) for n, t in named}
        result, own = self._load_state(sd)
        if result.unexpected_keys:
            raise ValueError(f"refit: unexpected {result.unexpected_keys[:5]}")
        fp = FingerprintBuilder()
        for n in sd:
            fp.add(n, own[n])
        return fp.digests()

    def init_collective(self, host: str, port: int, rank_offset: int, world_size: int, timeout_s: float) -> int:
        """Join the trainer's refit group as rank `rank_offset` (the driver's offset for this worker)."""
        from rlpost.distributed.collective import StatelessGroup

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.group = StatelessGroup(host, port, rank_offset, world_size, backend=backend, timeout_s=timeout_s)
        return rank_offset

    def update_weights_from_collective(self, corrupt: str | None = None) -> str:
        """Receive the trainer's broadcast and load it."""
        if self.group is None:
            raise RuntimeError("init_collective was not called")
        return self.update_weights(self.group.broadcast_tensors(None, src=0), corrupt)

    def end_refit(self) -> bool:
        """After a refit's last bucket: nothing to drop (no prefix cache)."""
        return True

    def shutdown(self) -> bool:
        """Leave the refit group."""
        if self.group is not None:
            self.group.close()
            self.group = None
        return True


class HFGeneration(EngineGroup):
    """transformers `generate` engines, one per cluster worker (sleep and refit: EngineGroup's)."""

    cfg: HFGenerationConfig
    group: RayWorkerGroup

    def __init__(
        self,
        cfg: HFGenerationConfig,
        cluster: RayVirtualCluster,
        model_path: str | None = None,
        timeout_s: float = 900.0,
        seed: int = 0,
        hf_overrides: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.cluster = cluster
        self.model_path = model_path or cfg.model_name
        if not self.model_path:
            raise ValueError("HFGeneration needs model_path or cfg.model_name")
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
        info = self.group.run_rank0(HFGenerationWorker.info)
        self.eos_token_id: int | None = info["eos_token_id"]
        self.pad_token_id: int = int(info["pad_token_id"])

    def pause_for_refit(self, recompute_kv_cache: bool = False) -> None:
        raise RuntimeError("the HF engine cannot take weights mid-generation (in-flight weight updates need vLLM's "
                           "async engine)")

    def resume_after_refit(self) -> None:
        raise RuntimeError("the HF engine has no paused requests to resume")

    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict:
        """Generate for every row of `data` (contract in rlpost.models.generation.interfaces)."""
        prompts = unpack_prompts(data)
        spec = hf_sampling_spec(self.cfg, greedy, self.eos_token_id)
        stops = row_stop_strings(data)
        seeds = [int(x) for x in data["seeds"]] if "seeds" in data else None
        shards = [PromptShard(prompts=prompts[a:b], seed=seeds[a] if seeds and a < len(seeds) else None,
                              stops=stops[a:b] if stops else None)
                  for a, b in contiguous_splits(len(prompts), self.group.dims.dp)]
        parts = self.group.run_sharded(HFGenerationWorker.generate, shards, spec)
        return assemble_outputs(data["input_ids"], data["input_lengths"], parts, self.pad_token_id)

    def expected_fingerprint(self, items: list[tuple[str, torch.Tensor]]) -> str:
        """Of the tensors in the engine's precision (each worker holds its model in it)."""
        dt = _DTYPES[self.cfg.precision]
        return weight_fingerprint((n, t.to(dt) if t.is_floating_point() else t) for n, t in items)

    def shutdown(self, graceful: bool = True) -> None:
        """Kill the workers, asking them to release first when `graceful` (idempotent)."""
        if getattr(self, "group", None) is not None and self.group.workers:
            self.group.shutdown(graceful_method=HFGenerationWorker.shutdown if graceful else None, timeout_s=10.0)
