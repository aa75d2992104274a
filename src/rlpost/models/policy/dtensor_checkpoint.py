"""Checkpoints of a DTensor policy: torch.distributed.checkpoint (DCP) for the sharded model and
optimizer, a small torch file for the scheduler, and a consolidated HF safetensors export that
`AutoModelForCausalLM.from_pretrained` loads.

Layout under `weights_path`:  dcp/ (model shards), hf/ (config.json, model.safetensors, tokenizer);
under `optimizer_path`:        dcp/ (optimizer shards), scheduler.pt.
Loading never runs code from the checkpoint: DCP, safetensors, and torch.load(weights_only=True).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:
    from rlpost.models.policy.dtensor_worker_base import DTensorWorkerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")


def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Collective over all ranks: rank 0 gets full fp32 CPU tensors under HF names, others {}."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save(worker: DTensorWorkerBase, weights_path: str, optimizer_path: Optional[str], hf_export: bool = True) -> None:
    """Collective: every rank writes its shards; rank 0 writes the scheduler and the HF export."""
    wp = Path(weights_path)
    dcp.save({"model": get_model_state_dict(worker.model)}, checkpoint_id=str(wp / "dcp"))
    if optimizer_path and worker.optimizer is not None:
        op = Path(optimizer_path)
        dcp.save({"optim": get_optimizer_state_dict(worker.model, worker.optimizer)}, checkpoint_id=str(op / "dcp"))
        if worker.rank == 0 and worker.scheduler is not None:
            torch.save({"scheduler": worker.scheduler.state_dict()}, op / "scheduler.pt")
    if hf_export:
        full = full_state_dict(worker.model)
        if worker.rank == 0:
            export_hf(worker.model, full, worker.cfg.model_name, wp / "hf")
    dist.barrier()


def export_hf(model: nn.Module, full: Dict[str, torch.Tensor], source_dir: str, out_dir: Path) -> None:
    """Write config.json, model.safetensors (tied lm_head dropped) and the tokenizer files of `source_dir`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {k: v.detach().contiguous() for k, v in full.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        src = Path(source_dir) / name
        if src.is_file():
            shutil.copy2(src, out_dir / name)


def load(worker: DTensorWorkerBase, weights_path: str, optimizer_path: Optional[str]) -> None:
    """Collective: restore model shards (and optimizer + scheduler when given) written by `save`."""
    wp = Path(weights_path)
    model_sd = {"model": get_model_state_dict(worker.model)}
    dcp.load(model_sd, checkpoint_id=str(wp / "dcp"))
    set_model_state_dict(worker.model, model_sd["model"])
    if optimizer_path and worker.optimizer is not None and (Path(optimizer_path) / "dcp").exists():
        op = Path(optimizer_path)
        optim_sd = {"optim": get_optimizer_state_dict(worker.model, worker.optimizer)}
        dcp.load(optim_sd, checkpoint_id=str(op / "dcp"))
        set_optimizer_state_dict(worker.model, worker.optimizer, optim_sd["optim"])
        sched = op / "scheduler.pt"
        if worker.scheduler is not None and sched.is_file():
            worker.scheduler.load_state_dict(torch.load(sched, weights_only=True)["scheduler"])
