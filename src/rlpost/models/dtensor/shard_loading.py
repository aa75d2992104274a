"""A policy rank's model built without the whole model in its memory: each rank holds at most its shard of the
weights plus one full tensor of the checkpoint (one bucket) at a time.

1. `build_hf_model_on_meta` (rlpost.models.policy.hf_loading): the module tree with its parameters on the meta
   device; buffers (rotary frequencies, which no checkpoint holds) computed on the CPU.
2. `initial_values`: full CPU values of the parameters the checkpoint lacks, made as loading the model whole makes
   them: a reward or value model's new head by HF's own `_init_weights`, and LoRA adapters by replaying peft's
   initialisation from the same RNG state (the adapters equal those peft adds to a loaded model).
3. The caller parallelises the meta model (TP plan, FSDP2), then `materialize` allocates each rank's local shards on
   the device and puts back the buffers and tied weights that allocation replaced.
4. `load_local_shards`: the checkpoint's safetensors read one tensor at a time with plain file reads (a mapped file's
   pages would count in the rank's resident memory); each rank copies only its own slice of each
   (`distribute_tensor(..., src_data_rank=None)` slices locally, with no communication).
"""

from __future__ import annotations

import copy
import json
import math
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from rlpost.config.schema.lora import LoRAConfig
from rlpost.config.schema.policy import PolicyConfig

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")
"""Name parts that activation checkpointing and torch.compile add to a module's parameter names."""

IGNORED_UNEXPECTED = ("rotary_emb.inv_freq",)
"""Checkpoint keys of buffers that models compute themselves (older exports saved them)."""


def checkpoint_name(name: str) -> str:
    """The checkpoint key of a parameter of the parallelised (and LoRA-adapted) model."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.replace(".base_layer.", ".")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (one, or the shards of an index)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"policy.model_name={str(model_dir)!r}: no *.safetensors file in the directory")
    return files


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
"""safetensors dtype names and their torch dtypes."""


def _header(f: BinaryIO) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and where its data starts."""
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def checkpoint_keys(files: list[Path]) -> set[str]:
    """Every tensor name in the checkpoint (read from the headers only)."""
    keys: set[str] = set()
    for path in files:
        with path.open("rb") as f:
            keys.update(_header(f)[0])
    return keys


def read_tensors(files: list[Path], wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors named in `wanted`, one at a time, each read into fresh memory with plain file reads
    (not mapped: the file's pages never count in the process's resident memory), in file order."""
    for path in files:
        with path.open("rb") as f:
            header, start = _header(f)
            for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                if key not in wanted:
                    continue
                if info["dtype"] not in SAFETENSORS_DTYPES:
                    raise ValueError(f"{path}: tensor {key} has dtype {info['dtype']}, which rlpost does not load")
                begin, end = info["data_offsets"]
                raw = torch.empty(end - begin, dtype=torch.uint8)
                f.seek(start + begin)
                if f.readinto(raw.numpy().data) != end - begin:
                    raise ValueError(f"{path}: tensor {key} is truncated")
                yield key, raw.view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])


# ---- 2. values the checkpoint does not hold --------------------------------------------------------------------
def head_initial_values(model: nn.Module, heads: tuple[str, ...], keys: set[str]) -> dict[str, torch.Tensor]:
    """HF's initialisation of each top-level module in `heads` that the checkpoint lacks (a reward or value model's
    `score` on a causal LM's body), on a CPU copy of the module: {parameter name: full value}."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_children():
        if name not in heads or any(k.startswith(f"{name}.") for k in keys):
            continue
        stand_in = copy.deepcopy(module).to_empty(device="cpu")
        model._init_weights(stand_in)  # type: ignore[operator]
        out.update({f"{name}.{k}": v.detach() for k, v in stand_in.named_parameters()})
    return out


def inject_lora_on_meta(model: nn.Module, cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """Add LoRA adapters to a meta model (rlpost.models.dtensor.lora.inject) and return their initial full values:
    peft's initialisation replayed on the CPU generator from its state now, leaving it where peft leaves it. Per
    adapted layer, in peft's order: nn.Linear's own init of A and of B (kaiming uniform), then
    `reset_lora_parameters` (A kaiming uniform again, B zeros)."""
    from peft.tuners.lora import LoraLayer

    from rlpost.models.dtensor import lora

    with torch.device("meta"):
        lora.inject(model, cfg)
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        a_w = module.lora_A[lora.ADAPTER].get_parameter("weight")
        b_w = module.lora_B[lora.ADAPTER].get_parameter("weight")
        a = torch.empty(a_w.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        b = torch.empty(b_w.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(b, a=math.sqrt(5))
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        b.zero_()
        out[f"{name}.lora_A.{lora.ADAPTER}.weight"] = a.to(a_w.dtype)
        out[f"{name}.lora_B.{lora.ADAPTER}.weight"] = b.to(b_w.dtype)
    return out


# ---- 3. allocation ---------------------------------------------------------------------------------------------
def _tied(model: nn.Module) -> list[tuple[str, str]]:
    """(alias, first name) for each parameter reachable under a second name (tied embeddings)."""
    first: dict[int, str] = {}
    out: list[tuple[str, str]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return out


def materialize(model: nn.Module, device: torch.device, buffer_device: torch.device | None = None) -> None:
    """Allocate the (parallelised) meta model's local shards on `device` (the CPU under FSDP2's CPU offload),
    uninitialised; the buffers computed at construction go back, on `buffer_device` (default `device`: where the
    forward runs), and so do the tied weights."""
    buffers = {n: b.detach().to("cpu", copy=True) for n, b in model.named_buffers() if not b.is_meta}
    tied = _tied(model)
    model.to_empty(device=device)
    for alias, name in tied:
        parent, _, leaf = alias.rpartition(".")
        target = model.get_parameter(name)
        if model.get_parameter(alias) is not target:
            setattr(model.get_submodule(parent), leaf, target)
    for n, value in buffers.items():
        parent, _, leaf = n.rpartition(".")
        module = model.get_submodule(parent)
        module._buffers[leaf] = value.to(buffer_device or device)  # keeps the buffer's persistence


# ---- 4. loading ------------------------------------------------------------------------------------------------
def _persistent_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (a tied one once) and persistent buffers: what a checkpoint holds."""
    yield from model.named_parameters()
    for mod_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


@torch.no_grad()
def copy_local(target: torch.Tensor, full: torch.Tensor, key: str) -> None:
    """Copy this rank's part of `full` (the whole tensor `key`) into `target`, a DTensor or a plain tensor."""
    if tuple(target.shape) != tuple(full.shape):
        raise ValueError(f"checkpoint tensor {key}: shape {tuple(full.shape)}, the model's is {tuple(target.shape)}")
    if isinstance(target, DTensor):
        piece = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(piece.to_local())
    else:
        target.copy_(full)


def load_local_shards(model: nn.Module, model_dir: Path, initial: dict[str, torch.Tensor]) -> None:
    """Fill a materialised model from the safetensors checkpoint in `model_dir`, one tensor at a time, each rank its own
    slice; the parameters in `initial` (full values) from there. ValueError naming the keys when the checkpoint and
    the model do not match (a checkpoint key under a top-level module the model lacks, such as a causal LM's lm_head
    under a classifier, is not used)."""
    from rlpost.models.expert_weights import ExpertAssembler, layout_of, num_experts

    files = safetensors_files(model_dir)
    layout = layout_of(getattr(model, "config", None))
    experts = ExpertAssembler(layout, num_experts(model.config)) if layout is not None else None
    as_model = {k: experts.target(k) if experts else k for k in checkpoint_keys(files)}  # fused experts' names
    keys = set(as_model.values())
    targets = {checkpoint_name(n): t for n, t in _persistent_tensors(model)}
    aliases = {checkpoint_name(a) for a, _ in _tied(model)}
    top = {name for name, _ in model.named_children()}
    missing = sorted(k for k in targets if k not in keys and k not in initial)
    unexpected = sorted(k for k in keys - targets.keys() - aliases
                        if k.split(".", 1)[0] in top and not k.endswith(IGNORED_UNEXPECTED))
    if missing or unexpected:
        raise ValueError(f"policy.model_name={str(model_dir)!r}: the checkpoint does not fit {type(model).__name__}: "
                         f"missing {len(missing)} {missing[:4]}, unexpected {len(unexpected)} {unexpected[:4]}")
    for key, full in read_tensors(files, {k for k, t in as_model.items() if t in targets}):
        done = experts.add(key, full) if experts else (key, full)
        if done is not None:
            copy_local(targets[done[0]], done[1], done[0])
        del full, done  # one full tensor at a time (a layer's fused experts)
    if experts is not None and experts.incomplete():
        raise ValueError(f"policy.model_name={str(model_dir)!r}: the checkpoint lacks experts of "
                         f"{experts.incomplete()[:4]}")
    for key, value in initial.items():
        copy_local(targets[key], value, key)


def build_sharded(cfg: PolicyConfig, lora_cfg: LoRAConfig | None, device: torch.device,
                  parallelize: Callable[[nn.Module], nn.Module], params_on_cpu: bool = False) -> nn.Module:
    """The policy's HF model (fp32 master weights), adapted with LoRA when `lora_cfg` is given, parallelised by
    `parallelize` on the meta device, then each rank's shards allocated on `device` (on the CPU with
    `params_on_cpu`: FSDP2's CPU offload keeps the sharded parameters there) and loaded from policy.model_name."""
    from rlpost.models.policy.hf_loading import NEW_HEADS, build_hf_model_on_meta, has_new_head

    model_dir = Path(cfg.model_name)
    model = build_hf_model_on_meta(cfg, torch.float32)
    initial: dict[str, torch.Tensor] = {}
    if has_new_head(cfg):
        initial.update(head_initial_values(model, NEW_HEADS, checkpoint_keys(safetensors_files(model_dir))))
    if lora_cfg is not None:
        initial.update(inject_lora_on_meta(model, lora_cfg))
    model = parallelize(model)
    materialize(model, torch.device("cpu") if params_on_cpu else device, buffer_device=device)
    load_local_shards(model, model_dir, initial)
    return model
