"""RlpostWorkerExtension: refit methods mixed into every vLLM worker (`worker_extension_cls`).

vLLM builds its worker class with this class as an extra base, so these methods run inside the
process that owns the model (in the Ray actor itself with the in-process engine, in the engine-core
process with AsyncLLM, in each TP worker with a multi-GPU engine) and are reached through
`collective_rpc("<method>", args=...)`. This module must stay importable without Ray.

Every engine, on every device, loads through one path: vLLM's in-place `reload_weights(weights_iterator=...)`.
`model.load_weights` after start-up fails on CPU because the CPU kernels repack the linear weights. For the same reason
the engine's own parameters can't be read back in checkpoint form (they are fused, e.g. qkv_proj,
and repacked, showing shape (0,) on CPU), so the engine-side fingerprint is computed on the tensors
exactly as they stream into `load_weights` (after any test fault was applied): what the engine
actually consumed, not a copy of what was sent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from rlpost.models.fingerprint import FingerprintBuilder

if TYPE_CHECKING:
    from rlpost.distributed.bucket_layout import CudaIpcBucket
    from rlpost.distributed.collective import StatelessGroup

FAULT_ENV = "RLPOST_FAULT_CORRUPT_REFIT"
"""Test-only: name of a parameter to corrupt (add 1.0) inside the engine before it is loaded."""

RefitInfo = dict[str, tuple[tuple[int, ...], str]]
"""name -> (shape, dtype string), as prepared by prepare_refit_info."""

RpcRecord = tuple[str, list[int], str, bytes]
"""One tensor as pack_for_rpc sends it: (name, shape, dtype, raw bytes)."""

RELOAD_NOISE = {
    "vllm.model_executor.model_loader.reload.layerwise": "%s: Failed to load weights",
    "vllm.model_executor.model_loader.reload.inplace": "Following weights were not loaded from checkpoint: %s",
}
"""vLLM's reload_weights warnings, by logger, that a refit bucket sets off for every layer it does not carry (and
the rotary embedding, which has no weights, for every load). rlpost checks what a refit delivers itself: the names
against prepare_refit_info, and the engine's digests of what it consumed against the policy's export."""


class _DropMessage(logging.Filter):
    def __init__(self, msg: str) -> None:
        super().__init__()
        self.msg = msg

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.msg


@contextlib.contextmanager
def quiet_reload() -> Iterator[None]:
    """Within: vLLM's RELOAD_NOISE is dropped at its loggers, every other record kept."""
    pairs = [(logging.getLogger(name), _DropMessage(msg)) for name, msg in RELOAD_NOISE.items()]
    for log, drop in pairs:
        log.addFilter(drop)
    try:
        yield
    finally:
        for log, drop in pairs:
            log.removeFilter(drop)


def pack_for_rpc(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[RpcRecord]:
    """(name, shape, dtype, raw bytes) records: what an RPC to a separate engine-core process can carry."""
    out = []
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        out.append((name, list(t.shape), str(t.dtype), t.reshape(-1).view(torch.uint8).numpy().tobytes()))
    return out


def unpack_rpc(records: Iterable[RpcRecord]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of pack_for_rpc."""
    out = []
    for name, shape, dtype, raw in records:
        dt = getattr(torch, str(dtype).removeprefix("torch."))
        buf = bytearray(raw)
        flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        out.append((name, flat.view(dt).reshape(shape)))
    return out


def check_against_info(named: list[tuple[str, torch.Tensor]], info: RefitInfo | None, partial: bool = False) -> None:
    """Raise ValueError if the tensors don't match the prepared refit info (names, shapes, dtypes).

    `partial`: one bucket of a refit, so names may be missing (the caller checks completeness)."""
    if not info:
        return
    got = {n: (tuple(t.shape), str(t.dtype)) for n, t in named}
    missing = [] if partial else sorted(set(info) - set(got))
    extra = sorted(set(got) - set(info))
    wrong = sorted(n for n in set(got) & set(info) if tuple(info[n][0]) != got[n][0] or info[n][1] != got[n][1])
    if missing or extra or wrong:
        detail = "; ".join(
            part
            for part in (
                f"missing {missing[:5]}" if missing else "",
                f"unexpected {extra[:5]}" if extra else "",
                ", ".join(f"{n}: expected {info[n]}, got {got[n]}" for n in wrong[:5]),
            )
            if part
        )
        raise ValueError(f"refit tensors don't match prepare_refit_info: {detail}")


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def repack_cpu_experts(model: torch.nn.Module, layers: set[str]) -> None:
    """Put the reloaded mixture-of-experts weights of `layers` (prefixes such as `model.layers.3`) back into the
    CPU kernel's packed layout.

    vLLM's in-place reload of an unquantized FusedMoE layer copies the new weights into the kernel's tensors but,
    once the layer's kernel exists, skips the CPU experts' own `process_weights_after_loading` (their padding and
    prepacking); the CPU kernel then reads unpacked weights. The GPU kernels have no such step. This runs it."""
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        layer = _LAYER.match(name)
        if (experts is not None and layer and layer[1] in layers and hasattr(module, "w13_weight")
                and type(experts).__name__.endswith("CPUUnquantizedExperts")):
            experts.process_weights_after_loading(module)


class RlpostWorkerExtension:
    """Methods added to vLLM's Worker (self is the worker: self.model_runner, self.rank, self.reload_weights)."""

    _rlpost_refit_info: RefitInfo | None = None
    _rlpost_group: StatelessGroup | None = None
    _rlpost_adapter: dict[str, torch.Tensor] | None = None
    """A LoRA adapter refit (rlpost.models.generation.vllm_lora): the tensors received so far, kept until
    `rlpost_stage_adapter` writes them for vLLM; None when refits carry the model's weights."""

    # ------------------------------------------------------------------ loading
    def rlpost_set_refit_info(self, info: RefitInfo | None) -> None:
        """Remember the (name -> shape, dtype) every later refit must match."""
        from rlpost.models.generation.vllm_lora import is_adapter_refit

        self._rlpost_refit_info = dict(info) if info else None
        self._rlpost_adapter = {} if info and is_adapter_refit(info) else None

    def _rlpost_tied(self) -> bool:
        hf_cfg = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        return bool(getattr(hf_cfg, "tie_word_embeddings", False))

    def _rlpost_repack_completed_layers(self, model: torch.nn.Module, names: set[str]) -> None:
        """Count each layer's experts' matrices as buckets bring them; once a layer's last has arrived (vLLM has
        then reloaded it whole), repack it (repack_cpu_experts)."""
        if self.model_runner.device.type != "cpu":  # type: ignore[attr-defined]
            return
        from rlpost.models.expert_weights import num_experts

        whole = 3 * num_experts(self.model_runner.model_config.hf_config)  # type: ignore[attr-defined]
        seen = self.__dict__.setdefault("_rlpost_experts_seen", {})
        done = set()
        for n in names:
            layer = _LAYER.match(n)
            if layer and ".experts." in n:
                seen[layer[1]] = seen.get(layer[1], 0) + 1
                if seen[layer[1]] == whole:
                    done.add(layer[1])
                    del seen[layer[1]]
        repack_cpu_experts(model, done)

    def rlpost_load(self, named: list[tuple[str, torch.Tensor]], corrupt: str | None = None) -> str:
        """Load `named` (HF names, full tensors) in place; returns the fingerprint of what was consumed."""
        return self._rlpost_load(named, corrupt, partial=False).hexdigest()

    def rlpost_load_bucket(self, named: list[tuple[str, torch.Tensor]], corrupt: str | None = None) -> dict[str, str]:
        """Load one refit bucket (whole layers) in place; per-tensor digests of what was consumed."""
        return self._rlpost_load(named, corrupt, partial=True).digests()

    def rlpost_load_bucket_ipc(self, descs: list[CudaIpcBucket], corrupt: str | None = None) -> dict[str, str]:
        """rlpost_load_bucket from the policy's device buffer on this worker's GPU (of `descs`, the CUDA IPC
        descriptors of the policy ranks on the replica's GPUs, the one on this worker's GPU:
        rlpost.distributed.cuda_ipc_buckets); the views are dropped once the copies out of them are done."""
        from rlpost.distributed.cuda_ipc_buckets import on_this_gpu, read_cuda_ipc_bucket

        digests = self.rlpost_load_bucket(read_cuda_ipc_bucket(on_this_gpu(descs)), corrupt)
        torch.cuda.current_stream().synchronize()  # the copies out of the buffer are done before rank 0 reuses it
        return digests

    def rlpost_load_bucket_packed(self, records: list[RpcRecord], corrupt: str | None = None) -> dict[str, str]:
        """rlpost_load_bucket for tensors sent as pack_for_rpc records (engine core in another process)."""
        return self.rlpost_load_bucket(unpack_rpc(records), corrupt)

    def _rlpost_load(self, named: list[tuple[str, torch.Tensor]], corrupt: str | None, partial: bool) -> FingerprintBuilder:
        named = list(named)
        check_against_info(named, self._rlpost_refit_info, partial=partial)
        corrupt = corrupt or os.environ.get(FAULT_ENV) or None
        if self._rlpost_adapter is not None:  # kept (copied out of the sender's buffer) for rlpost_stage_adapter
            fp = FingerprintBuilder()
            for name, t in named:
                t = t.detach().clone().add_(1.0) if name == corrupt else t.detach().clone()
                fp.add(name, t)
                self._rlpost_adapter[name] = t
            return fp
        names = {n for n, _ in named}
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        # The policy sends a tied head as the embedding alone. vLLM needs lm_head.weight in the stream, or it keeps
        # a stale head (its CPU kernels pack the head apart), so the head is derived here, loaded and not counted in
        # the fingerprint; Gemma's vLLM model has no head apart from its embedding, so there it is not loaded.
        headless = self._rlpost_tied() and not hasattr(model, "lm_head")
        derived = set()
        if self._rlpost_tied() and "lm_head.weight" not in names and "model.embed_tokens.weight" in names:
            named.append(("lm_head.weight", dict(named)["model.embed_tokens.weight"]))
            derived.add("lm_head.weight")
        fp = FingerprintBuilder()
        if corrupt:
            named = [(n, t.detach().clone().add_(1.0) if n == corrupt else t) for n, t in named]
        pulled: set[str] = set()

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in named:
                pulled.add(name)
                if name not in derived:
                    fp.add(name, t)
                if not (headless and name == "lm_head.weight"):
                    yield name, t

        with quiet_reload():  # a bucket leaves most layers alone: vLLM would warn for each (RELOAD_NOISE)
            self.reload_weights(weights_iterator=stream())  # type: ignore[attr-defined]
        if any(".experts." in n for n in names):
            self._rlpost_repack_completed_layers(model, names)
        if pulled != {n for n, _ in named}:
            raise RuntimeError(f"vLLM did not consume {sorted({n for n, _ in named} - pulled)[:5]}")
        return fp

    def rlpost_stage_adapter(self, out_dir: str, adapter_config: dict[str, object]) -> bool:
        """After an adapter refit's last tensor: write the adapter where vLLM loads it from (the replica's first
        worker writes; the others hold the same tensors) and drop the copies. False when nothing new arrived."""
        from pathlib import Path

        from rlpost.models.peft_adapter import write_adapter

        if not self._rlpost_adapter:
            return False
        missing = sorted(set(self._rlpost_refit_info or {}) - set(self._rlpost_adapter))
        if missing:
            raise ValueError(f"adapter refit incomplete: missing {missing[:5]}")
        if int(getattr(self, "rank", 0)) == 0:
            write_adapter(self._rlpost_adapter, adapter_config, Path(out_dir))
        self._rlpost_adapter = {}
        return True

    def rlpost_load_packed(self, records: list[RpcRecord], corrupt: str | None = None) -> str:
        """rlpost_load for tensors sent as pack_for_rpc records (engine core in another process)."""
        return self.rlpost_load(unpack_rpc(records), corrupt)

    # ------------------------------------------------------------------ collective
    def rlpost_init_collective(
        self, host: str, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> int:
        """Join the trainer's refit group with rank rank_offset + this worker's rank; returns that rank."""
        from rlpost.distributed.collective import StatelessGroup

        rank = rank_offset + int(getattr(self, "rank", 0))
        self._rlpost_group = StatelessGroup(host, port, rank, world_size, backend=backend, timeout_s=timeout_s)
        return rank

    def rlpost_update_from_collective(self, corrupt: str | None = None) -> str:
        """Receive the trainer's broadcast (src rank 0) and load it; returns the fingerprint."""
        if self._rlpost_group is None:
            raise RuntimeError("init_collective was not called on this engine")
        named = self._rlpost_group.broadcast_tensors(None, src=0)
        return self.rlpost_load(named, corrupt)

    def rlpost_close_collective(self) -> None:
        """Leave the refit group."""
        if self._rlpost_group is not None:
            self._rlpost_group.close()
            self._rlpost_group = None
