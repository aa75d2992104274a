"""Checkpoints of a Megatron policy, pickle-free: this rank's tensors in safetensors shards, the rest in JSON, plus an
HF export.

Layout under `weights_path`:   model/ (model shards), megatron_layout.json, hf/ (config.json, model.safetensors and
                               the tokenizer files of policy.model_name; `from_pretrained` loads it). With LoRA
                               (`megatron_cfg.peft`) model/ holds the adapters alone, adapter/ is a PEFT adapter
                               directory, and hf/ (the merged model) is written only with `peft.export_merged`;
under `optimizer_path`:        optim/ (optimizer state shards), scheduler.json (megatron OptimizerParamScheduler state).

Keys. Every rank saves its own shard under a layout tag, `tp{t}-pp{p}/<megatron parameter name>` for the model and
`tp{t}-pp{p}/c{chained optimizer}/p{parameter index}/<state name>` for the optimizer (`-ep{e}` is added under expert
parallelism, whose ranks hold different experts; `-dp{d}` for the distributed optimizer, whose state differs per
data-parallel rank). Data-parallel replicas hold the
same keys with the same values, and the save planner of torch.distributed.checkpoint (DCP) writes each of them once.
The optimizer entries are the torch-level state of megatron's optimizer (exp_avg, exp_avg_sq, step,
momentum_buffer, ...), plus its parameters when they are not the model's own (fp32 main params of the
mixed-precision optimizer), plus a numeric `step` kept in a param group (fused Adam). The shards are written with
DCP's HuggingFace storage writer (`shard-*.safetensors`, see `dtensor_checkpoint.save_tensors`) and read back with
its reader, which takes shapes and dtypes from the safetensors headers: loading allocates the destination tensors
from them, so the restored state is bit-identical and a resumed run continues exactly like the original.

Why not megatron dist-checkpointing: megatron-core 0.16.1's torch_dist save path calls `torch.cuda.synchronize()`
unconditionally (FileSystemWriterAsync.preload_tensors), so it cannot run on CPU, and it reads pickled metadata.
The price: no resharding. A checkpoint restores only into the same TP x PP layout (megatron_layout.json is checked
and a mismatch raises a clear error); to change layout, start from hf/.
Loading never runs code from the checkpoint: no pickle, no torch.load; JSON and safetensors only. A checkpoint of
the older DCP format (a `dcp/` folder, pickled `.metadata`) is refused with a CheckpointError.

Also here: the full-HF-weights gather shared by the HF export and refit.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from rlpost.config.schema.megatron import MegatronPolicyConfig
from rlpost.models.policy.dtensor_checkpoint import (
    MODEL_DIR,
    OPTIM_DIR,
    load_tensors,
    read_tensor_metadata,
    refuse_legacy,
    save_tensors,
)
from rlpost.models.policy.hf_loading import TOKENIZER_FILES
from rlpost.runtime.checkpointing import CheckpointError, checkpoint_errors, read_json

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from transformers import PretrainedConfig

    from rlpost.models.megatron.train_step import MegatronTrainState


class MegatronState(Protocol):
    """What save/load touch on a Megatron worker: its config, rank and data-parallel size, the model (DDP-wrapped
    `model`, bare `gpt`), the HF config it converts to, the training state (optimizer, scheduler), and its two
    weight views."""

    cfg: MegatronPolicyConfig
    rank: int
    dp_size: int
    model: torch.nn.Module
    hf_config: PretrainedConfig
    train_state: MegatronTrainState | None

    @property
    def gpt(self) -> torch.nn.Module: ...

    def local_state(self) -> dict[str, torch.Tensor]: ...

    def gather_full_weights(self, dtype: torch.dtype, every_rank: bool = False, tied_head: bool = True
                            ) -> dict[str, torch.Tensor]: ...


FORMAT = "rlpost-megatron-safetensors/1"
LAYOUT_FILE = "megatron_layout.json"
SCHEDULER_FILE = "scheduler.json"


def _layout(worker: MegatronState) -> dict[str, object]:
    m = worker.cfg.megatron_cfg
    assert m is not None
    return {
        "format": FORMAT,
        "tensor_model_parallel_size": m.tensor_model_parallel_size,
        "pipeline_model_parallel_size": m.pipeline_model_parallel_size,
        "num_layers_in_first_pipeline_stage": m.num_layers_in_first_pipeline_stage,
        "num_layers_in_last_pipeline_stage": m.num_layers_in_last_pipeline_stage,
        "data_parallel_size": worker.dp_size,
        "expert_model_parallel_size": m.expert_model_parallel_size,
        "use_distributed_optimizer": bool(m.optimizer.use_distributed_optimizer),
        "lora": bool(m.peft.enabled),
    }


def _saved_state(worker: MegatronState) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of the model: this rank's shard, or with LoRA its adapters and the modules it trains in
    full alone (the base is the HF checkpoint at policy.model_name)."""
    from rlpost.models.megatron.lora import is_adapter, is_saved_param

    local = worker.local_state()
    m = worker.cfg.megatron_cfg
    if m is None or not m.peft.enabled:
        return local
    tied = bool(worker.hf_config.tie_word_embeddings)
    return {k: v for k, v in local.items() if is_adapter(k) or is_saved_param(k, m.peft, tied)}


def _tag(worker: MegatronState, with_dp: bool = False) -> str:
    from megatron.core import parallel_state as ps

    tag = f"tp{ps.get_tensor_model_parallel_rank()}-pp{ps.get_pipeline_model_parallel_rank()}"
    if ps.get_expert_model_parallel_world_size() > 1:  # each expert-parallel rank holds its own experts
        tag += f"-ep{ps.get_expert_model_parallel_rank()}"
    return f"{tag}-dp{ps.get_data_parallel_rank()}" if with_dp else tag


def torch_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (chained) optimizer, in chain order."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in chained]


def optimizer_state_tensors(optimizer: MegatronOptimizer) -> Iterator[tuple[dict[str, object], str, torch.Tensor]]:
    """(state dict, name, tensor) of every non-scalar optimizer state tensor (exp_avg, momentum_buffer, ...)."""
    for topt in torch_optimizers(optimizer):
        for state in topt.state.values():
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield state, name, value


def move_optimizer_state(optimizer: MegatronOptimizer, device: torch.device | str) -> None:
    """Move the optimizer state tensors (not the 0-d steps) to device: GPU memory phases."""
    for state, name, value in list(optimizer_state_tensors(optimizer)):
        state[name] = value.to(device, non_blocking=True)


def _optimizer_tensors(worker: MegatronState, tag: str) -> dict[str, torch.Tensor]:
    assert worker.train_state is not None
    model_params = {id(p) for p in worker.gpt.parameters()}
    out: dict[str, torch.Tensor] = {}
    for c, topt in enumerate(torch_optimizers(worker.train_state.optimizer)):
        for j, group in enumerate(topt.param_groups):
            if isinstance(group.get("step"), (int, float, torch.Tensor)):
                out[f"{tag}/c{c}/g{j}/step"] = torch.as_tensor(group["step"], dtype=torch.float64).clone()
        params = [p for g in topt.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            key = f"{tag}/c{c}/p{i}"
            if id(p) not in model_params:
                out[f"{key}/param"] = p.detach()
            for name, value in topt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{key}/{name}"] = value.detach()
                elif value is not None:
                    raise TypeError(f"optimizer state {name!r} of type {type(value).__name__} cannot be checkpointed")
    return out


def _restore_optimizer(worker: MegatronState, tag: str, loaded: dict[str, torch.Tensor]) -> None:
    assert worker.train_state is not None
    for c, topt in enumerate(torch_optimizers(worker.train_state.optimizer)):
        for j, group in enumerate(topt.param_groups):
            step = loaded.get(f"{tag}/c{c}/g{j}/step")
            if step is not None:
                old: Any = group.get("step")
                group["step"] = step.to(old.dtype) if isinstance(old, torch.Tensor) else type(old)(step.item())
        params = [p for g in topt.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            prefix = f"{tag}/c{c}/p{i}/"
            state: dict[str, torch.Tensor] = {}
            for key, t in loaded.items():
                if not key.startswith(prefix):
                    continue
                name = key[len(prefix):]
                if name == "param":
                    with torch.no_grad():
                        p.copy_(t.to(p.device))
                else:  # a 0-d `step` stays where torch keeps it (CPU unless capturable/fused)
                    state[name] = t if t.dim() == 0 else t.to(p.device)
            if state:
                topt.state[p] = state


def _load_own_keys(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Collective: every key of the shards at `path` that starts with prefix, freshly allocated and loaded."""
    meta = read_tensor_metadata(path)
    dest = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items() if k.startswith(prefix)}
    load_tensors(dest, path, meta)
    return dest


def gather_hf_weights(worker: MegatronState, dtype: torch.dtype, every_rank: bool = False, tied_head: bool = True
                      ) -> dict[str, torch.Tensor]:
    """Collective over TP x PP of DP replica 0 (other replicas return at once; under expert parallelism the replicas
    of the expert-parallel group join in, as they hold the other experts): global rank 0 gets every weight as a full
    HF-named CPU tensor cast to dtype (a tied lm_head included unless `tied_head` is false), the other ranks {}.
    `every_rank`: every replica gathers over its own TP x PP groups and every rank keeps the tensors on its device."""
    from megatron.core import parallel_state as ps

    from rlpost.models.megatron.export import export_hf_weights

    m = worker.cfg.megatron_cfg
    assert m is not None
    out: dict[str, torch.Tensor] = {}
    ep = ps.get_expert_model_parallel_world_size()
    if ps.get_data_parallel_rank() != 0 and not every_rank and ep == 1:
        return out
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
    for name, t in export_hf_weights(worker.model, worker.hf_config, tp_group, pp_group, dtype=dtype,
                                     converter_type=m.converter_type, ep_group=ep_group,
                                     include_tied_lm_head=tied_head):
        if every_rank:
            out[name] = t.detach().clone()
        elif worker.rank == 0:
            out[name] = t.detach().to("cpu", copy=True)
    return out


def gather_peft_adapters(worker: MegatronState, dtype: torch.dtype, every_rank: bool = False
                         ) -> dict[str, torch.Tensor]:
    """With LoRA: collective over TP x PP of DP replica 0; global rank 0 (`every_rank`: every rank of every
    replica) gets the adapters under PEFT's HF names, cast to dtype (rlpost.models.megatron.lora_peft.peft_state),
    the other ranks {}."""
    from megatron.core import parallel_state as ps

    from rlpost.models.megatron.convert import hf_model_dims
    from rlpost.models.megatron.lora_peft import peft_state
    from rlpost.models.peft_adapter import PEFT_PREFIX

    m = worker.cfg.megatron_cfg
    assert m is not None
    if ps.get_data_parallel_rank() != 0 and not every_rank:
        return {}
    dims = hf_model_dims(worker.hf_config, m.converter_type)
    named = peft_state(worker.model, dims, ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group())
    if m.peft.modules_to_save:  # the modules trained in full, gathered and unpadded as the HF export has them
        full = worker.gather_full_weights(torch.float32)  # rank 0's; a tied head under its own name too
        names = ("embed_tokens", "lm_head") if worker.hf_config.tie_word_embeddings else m.peft.modules_to_save
        wanted = [{"embed_tokens": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}[n] for n in names]
        named.update({f"{PEFT_PREFIX}{k}": full[k].clone() for k in wanted if k in full})
    return {k: v.to(dtype) for k, v in named.items()} if worker.rank == 0 or every_rank else {}


def save(worker: MegatronState, weights_path: str, optimizer_path: str | None, hf_export: bool) -> None:
    """Collective over all ranks: DCP model (and optimizer) shards, the scheduler, and the HF export on rank 0."""
    wp = Path(weights_path)
    tag = _tag(worker)
    model_sd = {f"{tag}/{k}": v.detach() for k, v in _saved_state(worker).items()}
    save_tensors(model_sd, wp / MODEL_DIR)
    if worker.rank == 0:
        (wp / LAYOUT_FILE).write_text(json.dumps(_layout(worker), indent=2))
    state = worker.train_state
    if optimizer_path and state is not None:
        op = Path(optimizer_path)
        with_dp = bool(worker.cfg.megatron_cfg and worker.cfg.megatron_cfg.optimizer.use_distributed_optimizer)
        save_tensors(_optimizer_tensors(worker, _tag(worker, with_dp)), op / OPTIM_DIR)
        if worker.rank == 0:
            (op / SCHEDULER_FILE).write_text(json.dumps(state.scheduler.state_dict(), indent=2))
    m = worker.cfg.megatron_cfg
    lora = m.peft if m is not None and m.peft.enabled else None
    if hf_export and lora is not None:  # a PEFT adapter directory; the merged model only when asked for
        from rlpost.config.lora_params import MEGATRON_HF_NAMES
        from rlpost.models.peft_adapter import write_adapter

        adapters = gather_peft_adapters(worker, torch.float32)
        if worker.rank == 0:
            write_adapter(adapters, lora.adapter_config(worker.cfg.model_name, MEGATRON_HF_NAMES), wp / "adapter")
    if hf_export and (lora is None or lora.export_merged):
        full = worker.gather_full_weights(torch.float32)
        if worker.rank == 0:
            export_hf(worker.hf_config, full, worker.cfg.model_name, wp / "hf")
    dist.barrier()


def export_hf(hf_config: PretrainedConfig, full: dict[str, torch.Tensor], source_dir: str, out_dir: Path) -> None:
    """Write config.json, model.safetensors (a tied lm_head dropped) and the tokenizer files of `source_dir`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    tensors = {k: v.detach().contiguous() for k, v in full.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        src = Path(source_dir) / name
        if src.is_file():
            shutil.copy2(src, out_dir / name)


def _check_layout(worker: MegatronState, weights_path: Path) -> None:
    path = weights_path / LAYOUT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{weights_path}: no {LAYOUT_FILE}; not a Megatron policy checkpoint")
    saved = read_json(path)
    if not isinstance(saved, dict):
        raise CheckpointError(f"cannot load checkpoint file {path}: not a JSON object")
    mine = _layout(worker)
    keys = ["format", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"]
    if saved.get("expert_model_parallel_size", 1) != mine["expert_model_parallel_size"]:
        keys.append("expert_model_parallel_size")
    if saved.get("use_distributed_optimizer") or mine["use_distributed_optimizer"]:
        keys += ["data_parallel_size", "use_distributed_optimizer"]
    diff = {k: (saved.get(k), mine[k]) for k in keys if saved.get(k) != mine[k]}
    if bool(saved.get("lora", False)) != mine["lora"]:
        raise ValueError(f"{weights_path} holds {'LoRA adapters' if saved.get('lora') else 'a full model'}, and "
                         f"this run trains {'LoRA adapters' if mine['lora'] else 'the full model'} "
                         "(policy.megatron_cfg.peft.enabled)")
    if diff:
        found = ", ".join(f"{k}: saved {a}, now {b}" for k, (a, b) in diff.items())
        raise ValueError(
            f"{weights_path} was saved with another parallel layout ({found}); Megatron checkpoints restore only "
            "into the same layout (start from the HF export under hf/ instead)"
        )


def load(worker: MegatronState, weights_path: str, optimizer_path: str | None) -> None:
    """Collective: restore the model shards (and optimizer + scheduler when given) written by `save`."""
    wp = Path(weights_path)
    refuse_legacy(wp)
    _check_layout(worker, wp)
    tag = _tag(worker)
    loaded = _load_own_keys(wp / MODEL_DIR, f"{tag}/")
    local = _saved_state(worker)
    missing = sorted(k for k in local if f"{tag}/{k}" not in loaded)
    if missing:
        raise ValueError(f"{wp}: checkpoint has no {missing[:4]} for {tag}")
    with torch.no_grad():
        for k, v in local.items():
            v.copy_(loaded[f"{tag}/{k}"].to(v.device))
    state = worker.train_state
    op = Path(optimizer_path) if optimizer_path else None
    if op is not None and state is not None:
        refuse_legacy(op)
    if op is not None and state is not None and (op / OPTIM_DIR).is_dir():
        with_dp = bool(worker.cfg.megatron_cfg and worker.cfg.megatron_cfg.optimizer.use_distributed_optimizer)
        otag = _tag(worker, with_dp)
        _restore_optimizer(worker, otag, _load_own_keys(op / OPTIM_DIR, f"{otag}/"))
        sched = op / SCHEDULER_FILE
        if sched.is_file():
            with checkpoint_errors(sched):
                state.scheduler.load_state_dict(read_json(sched))
    dist.barrier()
