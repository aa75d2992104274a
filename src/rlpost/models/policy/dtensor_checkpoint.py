"""Checkpoints of a DTensor policy, pickle-free: tensors in safetensors, everything else in JSON, plus a
consolidated HF safetensors export that `AutoModelForCausalLM.from_pretrained` loads.

Layout under `weights_path`:   checkpoint.json (format, tied-parameter aliases), model/ (sharded model tensors),
                               hf/ (config.json, model.safetensors, tokenizer files);
                               with LoRA, model/ holds the adapters only, adapter/ is a PEFT adapter directory
                               and hf/ (lora_cfg.export_merged) the merged model;
under `optimizer_path`:        optimizer.json (param groups and the shape of the state, with tensor references),
                               optim/ (sharded optimizer tensors), scheduler.json (LR scheduler state).

model/ and optim/ are written by torch.distributed.checkpoint (DCP) with its HuggingFace storage writer: each rank
writes `shard-<rank+1>-model-00001-of-00001.safetensors` holding its local shards under their global names, with
their offsets in the safetensors header, so a checkpoint restores into another DP x TP layout too. They are read
back with DCP's HuggingFace storage reader, which takes the tensor metadata from those headers (never DCP's pickled
`.metadata`). Loading runs no pickle and no torch.load: only `safetensors` and `json`. Files the layout does not
name (`.metadata`, `*.pt`, `*.bin`, ...) are never opened. A checkpoint of the older DCP format (a `dcp/` folder)
is refused with a CheckpointError; resume from a newer checkpoint or start from its `hf/` export.

The storage helpers here (`save_tensors`, `load_tensors`, `read_tensor_metadata`, `encode_state`,
`decode_state`, `refuse_legacy`) are shared with `megatron_checkpoint`.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from rlpost.config.schema.lora import LoRAConfig
from rlpost.models.dtensor import lora
from rlpost.models.expert_weights import to_checkpoint_layout
from rlpost.models.policy.hf_loading import TOKENIZER_FILES
from rlpost.runtime.checkpointing import CheckpointError, checkpoint_errors, read_json


class TrainState(Protocol):
    """What save/load touch: the (FSDP2 / DTensor) model, its optimizer and lr scheduler (a worker has them)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None


FORMAT = "rlpost-dtensor-safetensors/1"
INFO_FILE = "checkpoint.json"
MODEL_DIR = "model"
OPTIM_DIR = "optim"
OPTIM_FILE = "optimizer.json"
SCHEDULER_FILE = "scheduler.json"
LEGACY_DIR = "dcp"
SUFFIX = ".safetensors"

# JSON markers of `encode_state`: a tensor reference, a tuple, and a dict whose keys are not all plain strings.
_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"
_MARKERS = (_TENSOR, _TUPLE, _ITEMS)
Json = Any


# ---- pickle-free storage (shared with megatron_checkpoint) -------------------------------------------------------
def refuse_legacy(path: Path) -> None:
    """Raise CheckpointError when `path` holds a checkpoint of the old DCP format (pickled `.metadata`)."""
    if (path / LEGACY_DIR).exists():
        raise CheckpointError(
            f"{path} holds a checkpoint in the old DCP format ({LEGACY_DIR}/.metadata is a pickle), which rlpost no "
            "longer loads because unpickling can run code; resume from a checkpoint written by this version, or start "
            "from its HF export (policy.model_name=<checkpoint>/policy/weights/hf)"
        )


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if isinstance(t, DTensor) else t
    return t if local.is_contiguous() else t.contiguous()


def save_tensors(tensors: Mapping[str, torch.Tensor], directory: Path) -> None:
    """Collective: every rank writes its shards of `tensors` (plain tensors or DTensors, the same keys on every rank
    that holds them) to `directory` as safetensors; replicated tensors are written once."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    if _is_rank0():
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob(f"*{SUFFIX}"):  # a previous save with more ranks must not leave shards behind
            old.unlink()
    _barrier()
    flat = {k: _contiguous(v.detach()) for k, v in tensors.items()}
    dcp.save(flat, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))


_Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes) of a chunk


def _overlap(a: _Box, b: _Box) -> bool:
    """Whether two non-empty chunks share an element."""
    if not math.prod(a[1]) or not math.prod(b[1]):
        return False
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1], strict=True))


def read_tensor_metadata(directory: Path) -> dict[str, TensorStorageMetadata]:
    """Global size, dtype and chunks of every tensor in the safetensors shards of `directory`, read from their
    headers only. Raises CheckpointError for a file that is not safetensors, or a tensor whose chunks overlap or do
    not cover it."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if not directory.is_dir():
        raise CheckpointError(f"cannot load checkpoint {directory}: no such directory")
    try:
        meta = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - a planted or damaged file: safetensors, JSON or key errors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"cannot load checkpoint {directory}: not a safetensors shard set ({first})") from exc
    out: dict[str, TensorStorageMetadata] = {}
    for key, md in meta.items():
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"cannot load checkpoint {directory}: entry {key!r} is not a tensor")
        boxes: list[_Box] = [(list(c.offsets), list(c.sizes)) for c in md.chunks]
        covered = sum(math.prod(s) for _, s in boxes)
        overlap = any(_overlap(boxes[i], boxes[j]) for i in range(len(boxes)) for j in range(i))
        if overlap or covered != math.prod(md.size):
            raise CheckpointError(
                f"cannot load checkpoint {directory}: the shards of {key!r} cover {covered} of "
                f"{math.prod(md.size)} elements{' and overlap' if overlap else ''} (a shard file missing or extra)"
            )
        out[key] = md
    return out


def load_tensors(dest: Mapping[str, torch.Tensor], directory: Path,
                 meta: dict[str, TensorStorageMetadata] | None = None) -> None:
    """Collective: fill every tensor of `dest` (plain tensors or DTensors, in place) from the shards in `directory`
    written by `save_tensors`, whatever the saving layout. Every key must be there with the same global shape and
    dtype."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    meta = read_tensor_metadata(directory) if meta is None else meta
    missing = sorted(k for k in dest if k not in meta)
    if missing:
        raise CheckpointError(f"cannot load checkpoint {directory}: no tensor {missing[:4]} ({len(missing)} missing)")
    for key, t in dest.items():
        md = meta[key]
        if tuple(md.size) != tuple(t.shape) or md.properties.dtype != t.dtype:
            raise CheckpointError(
                f"cannot load checkpoint {directory}: {key!r} is {md.properties.dtype} {list(md.size)} there, "
                f"{t.dtype} {list(t.shape)} here"
            )
    if dest:
        dcp.load(dict(dest), storage_reader=HuggingFaceStorageReader(str(directory)))


def encode_state(obj: Any, tensors: dict[str, torch.Tensor], path: tuple[str, ...] = ()) -> Json:
    """A JSON-able copy of a nested state (dicts, lists, tuples, numbers, strings, None) whose tensors are moved
    into `tensors` under '/'-joined paths and replaced by {"__tensor__": path}. Other values raise TypeError."""
    where = "/".join(path) or "<root>"
    if isinstance(obj, torch.Tensor):
        key = "/".join(path)
        if key in tensors:
            raise TypeError(f"state path {key!r} is not unique")
        tensors[key] = obj
        return {_TENSOR: key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [encode_state(v, tensors, (*path, str(i))) for i, v in enumerate(obj)]
        return {_TUPLE: items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k in _MARKERS for k in obj):
            return {k: encode_state(v, tensors, (*path, k)) for k, v in obj.items()}
        for k in obj:
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise TypeError(f"state at {where}: a key of type {type(k).__name__} cannot be stored in JSON")
        return {_ITEMS: [[k, encode_state(v, tensors, (*path, str(k)))] for k, v in obj.items()]}
    raise TypeError(f"state at {where}: a value of type {type(obj).__name__} cannot be stored in a checkpoint "
                    "(tensors, numbers, strings, None, lists, tuples and dicts only)")


def tensor_refs(obj: Json) -> list[str]:
    """The tensor keys an `encode_state` result refers to."""
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            return [obj[_TENSOR]]
        if set(obj) == {_ITEMS}:
            return [r for _, v in obj[_ITEMS] for r in tensor_refs(v)]
        return [r for v in obj.values() for r in tensor_refs(v)]
    if isinstance(obj, list):
        return [r for v in obj for r in tensor_refs(v)]
    return []


def decode_state(obj: Json, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of `encode_state`: tuples and non-string keys restored, tensor references looked up in `tensors`."""
    if isinstance(obj, list):
        return [decode_state(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            return tensors[obj[_TENSOR]]
        if set(obj) == {_TUPLE}:
            return tuple(decode_state(v, tensors) for v in obj[_TUPLE])
        if set(obj) == {_ITEMS}:
            return {k: decode_state(v, tensors) for k, v in obj[_ITEMS]}
        return {k: decode_state(v, tensors) for k, v in obj.items()}
    return obj


def write_json(path: Path, obj: Json) -> None:
    """Write `obj` as JSON (floats round-trip exactly; inf/nan allowed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))


def read_format(path: Path, fmt: str, *required: str) -> dict[str, Any]:
    """The JSON object at `path`; CheckpointError unless it is a dict whose "format" is `fmt` and that has the
    `required` keys."""
    data = read_json(path)
    if not isinstance(data, dict) or data.get("format") != fmt:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"cannot load checkpoint file {path}: format {found!r}, expected {fmt!r}")
    missing = [k for k in required if k not in data]
    if missing:
        raise CheckpointError(f"cannot load checkpoint file {path}: no {missing}")
    return data


# ---- the DTensor policy ------------------------------------------------------------------------------------------
def full_state_dict(model: nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """Collective over all ranks: rank 0 gets full fp32 CPU tensors under HF names, others {}; `every_rank`: every
    rank gets them, on its own device (a colocated refit hands each engine the tensors on its device).

    One process holding a plain CPU model (one fp32 rank, not wrapped): the model's own state dict, detached,
    which is what DCP returns there too (the same tensors, no copies), without DCP's per-tensor machinery on every
    refit."""
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    if alone and all(t.device.type == "cpu" and not isinstance(t, DTensor)
                     for t in [*model.parameters(), *model.buffers()]):
        return {k: v.detach() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Parameter names that are another parameter (tied embeddings) -> the first name of that parameter."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _saved(model_sd: Mapping[str, torch.Tensor], aliases: Mapping[str, str], lora_cfg: LoRAConfig | None
           ) -> dict[str, torch.Tensor]:
    """The model tensors a checkpoint holds: all but tied aliases, or with LoRA what trains (the adapters and the
    modules trained in full, a tied module under either of its names)."""
    def trained(k: str) -> bool:
        return lora_cfg is None or any(lora.is_trained(n, lora_cfg) for n in (k, *(a for a, t in aliases.items()
                                                                                    if t == k)))

    return {k: v for k, v in model_sd.items() if k not in aliases and trained(k)}


def save(worker: TrainState, weights_path: str, optimizer_path: str | None, source_dir: str,
         hf_export: bool = True, lora_cfg: LoRAConfig | None = None) -> None:
    """Collective: every rank writes its model (and optimizer) shards; rank 0 the JSON files and the HF export.
    With `lora_cfg`, the adapters alone, and the PEFT adapter directory as the export."""
    wp = Path(weights_path)
    aliases = tied_aliases(worker.model)
    model_sd = cast(dict[str, torch.Tensor], get_model_state_dict(worker.model))
    save_tensors(_saved(model_sd, aliases, lora_cfg), wp / MODEL_DIR)
    if _is_rank0():
        write_json(wp / INFO_FILE, {"format": FORMAT, "aliases": aliases, "lora": lora_cfg is not None})
    if optimizer_path and worker.optimizer is not None:
        op = Path(optimizer_path)
        tensors: dict[str, torch.Tensor] = {}
        skeleton = encode_state(get_optimizer_state_dict(worker.model, worker.optimizer), tensors)
        sched: Json = None
        if worker.scheduler is not None:
            extra: dict[str, torch.Tensor] = {}
            sched = encode_state(worker.scheduler.state_dict(), extra, ("scheduler",))
            if extra:
                raise TypeError(f"LR scheduler state holds tensors ({sorted(extra)[:3]}); only JSON values are saved")
        save_tensors(tensors, op / OPTIM_DIR)
        if _is_rank0():
            write_json(op / OPTIM_FILE, {"format": FORMAT, "state": skeleton})
            if sched is not None:
                write_json(op / SCHEDULER_FILE, {"format": FORMAT, "state": sched})
    if hf_export:
        full = full_state_dict(worker.model)
        if _is_rank0() and lora_cfg is not None:
            lora.write_peft_dir(lora_cfg, full, source_dir, wp / "adapter", tied=aliases)
            if lora_cfg.export_merged:
                export_hf(worker.model, lora.merged(full, lora.scaling(lora_cfg)), source_dir, wp / "hf")
        elif _is_rank0():
            export_hf(worker.model, full, source_dir, wp / "hf")
    dist.barrier()


def export_hf(model: Any, full: dict[str, torch.Tensor], source_dir: str, out_dir: Path) -> None:
    """Write config.json, model.safetensors (tied lm_head dropped) and the tokenizer files of `source_dir`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    full = to_checkpoint_layout(model.config, full)
    tensors = {k: v.detach().contiguous() for k, v in full.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        src = Path(source_dir) / name
        if src.is_file():
            shutil.copy2(src, out_dir / name)


def load(worker: TrainState, weights_path: str, optimizer_path: str | None, lora_cfg: LoRAConfig | None = None
         ) -> None:
    """Collective: restore the model (and the optimizer + scheduler when given and saved) written by `save`
    (`lora_cfg`: a LoRA checkpoint into a model with the same adapters and modules trained in full)."""
    adapters_only = lora_cfg is not None
    wp = Path(weights_path)
    refuse_legacy(wp)
    info = read_format(wp / INFO_FILE, FORMAT, "aliases")
    aliases = tied_aliases(worker.model)
    if info.get("aliases") != aliases:
        raise CheckpointError(f"cannot load checkpoint {wp}: tied parameters {info.get('aliases')} there, "
                              f"{aliases} in this model")
    if bool(info.get("lora")) != adapters_only:
        there, here = (("LoRA adapters", "a full model") if info.get("lora") else ("a full model", "LoRA adapters"))
        raise CheckpointError(f"cannot load checkpoint {wp}: it holds {there}, and this run trains {here} "
                              "(policy.dtensor_cfg.lora_cfg.enabled)")
    model_sd: dict[str, Any] = get_model_state_dict(worker.model)
    load_tensors(_saved(model_sd, aliases, lora_cfg), wp / MODEL_DIR)
    set_model_state_dict(worker.model, model_sd)  # aliases share the loaded storage
    if not optimizer_path or worker.optimizer is None:
        return
    op = Path(optimizer_path)
    refuse_legacy(op)
    if not (op / OPTIM_FILE).is_file():
        if (op / OPTIM_DIR).exists():
            raise CheckpointError(f"cannot load checkpoint {op}: {OPTIM_DIR}/ is there but {OPTIM_FILE} is not")
        return  # a weights-only checkpoint
    skeleton = read_format(op / OPTIM_FILE, FORMAT, "state")["state"]
    current: dict[str, torch.Tensor] = {}  # the live optimizer's tensors (their DTensor layout) as destinations
    encode_state(get_optimizer_state_dict(worker.model, worker.optimizer), current)
    with checkpoint_errors(op / OPTIM_FILE):
        refs = tensor_refs(skeleton)
        unknown = sorted(set(refs) - set(current))
    if unknown:
        raise CheckpointError(f"cannot load checkpoint {op}: optimizer state {unknown[:4]} does not exist in "
                              f"{type(worker.optimizer).__name__} here (another optimizer?)")
    dest = {k: current[k] for k in refs}
    load_tensors(dest, op / OPTIM_DIR)
    with checkpoint_errors(op / OPTIM_FILE):
        set_optimizer_state_dict(worker.model, worker.optimizer, decode_state(skeleton, dest))
    if worker.scheduler is not None:
        sched = read_format(op / SCHEDULER_FILE, FORMAT, "state")["state"]
        with checkpoint_errors(op / SCHEDULER_FILE):
            worker.scheduler.load_state_dict(decode_state(sched, {}))
