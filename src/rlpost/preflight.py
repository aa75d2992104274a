"""The checks of a config against the world, run in `rlpost.checks.CHECKS`' order before Ray starts: the model
directory, the optimizer and scheduler classes and their arguments, the device a bf16 run would land on, the local
CPUs and the output directories. A failure is a ConfigError (key, value, rule), never a traceback from a worker
minutes later.

torch is imported inside the checks that need it (optimizer signatures, `cuda.is_available`).
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlpost.config.errors import ConfigError, did_you_mean
from rlpost.config.layout import model_dir_key, read_hf_config
from rlpost.config.model_families import ARCHITECTURES, architecture_of, check_converted, check_tp_plan
from rlpost.config.schema.cluster import ClusterConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.megatron import MegatronPolicyConfig, check_megatron_experts
from rlpost.config.schema.policy import (
    DTensorPolicyConfig,
    PytorchOptimizerConfig,
    SinglePytorchSchedulerConfig,
    parse_scheduler,
)
from rlpost.config.schema.supervised_master import SupervisedMasterConfig
from rlpost.runtime.build import resolve
from rlpost.runtime.cuda_driver import usable_device

AnyMaster = MasterConfig | SupervisedMasterConfig
"""The master config of any algorithm."""

# Files that make a local HF tokenizer loadable (any one of them).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
WEIGHT_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.bin")
# Optimizer arguments that depend on the device; the CPU dry build leaves them out for a GPU run.
DEVICE_KWARGS = frozenset({"fused", "foreach", "capturable"})


def run_device(master: AnyMaster) -> str:
    """'cuda' or 'cpu', decided as the driver's `resolve_device` decides it (no Ray, no CUDA context)."""
    if master.cluster.device != "auto":
        return master.cluster.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_cuda_device(master: AnyMaster) -> None:
    """cluster.device=cuda needs a GPU torch can use; cluster.device=auto beside a GPU torch cannot use (a driver
    too old for torch's CUDA build, a CPU torch) would quietly train on CPU: both refused, naming the driver and
    torch's build (rlpost.runtime.cuda_driver)."""
    usable_device(master.cluster.device)


# ---- model directory --------------------------------------------------------------------------


def check_model_dir(master: AnyMaster) -> None:
    """A local HF model directory: config.json with a model_type, weights and tokenizer files.

    Under `model.tiny`, model.path is built on first use: the checks skip it, not a policy.model_name or a
    policy.tokenizer.name pointing elsewhere.
    """
    key = model_dir_key(master)
    path = str(master.policy.model_name)
    built_later = master.model.tiny is not None and path == master.model.path
    if not built_later:
        _check_model_files(key, path, master.model.prepare)
    elif not Path(path).expanduser().is_dir():  # built on first use, inside model.cache_dir
        check_writable_dir("model.cache_dir", Path(master.model.cache_dir).expanduser())
    tok = str(master.policy.tokenizer.name)
    if master.model.tiny is not None and tok == master.model.path:
        return
    tok_key = key if tok == path else "policy.tokenizer.name"
    t = Path(tok).expanduser()
    if not t.is_dir():
        what = "is not a directory" if t.exists() else "no such directory"
        raise ConfigError(tok_key, tok, f"{what}; the tokenizer is loaded from a local directory")
    if not any((t / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(tok_key, tok, f"has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")


def _check_model_files(key: str, path: str, prepare: str | None) -> None:
    """config.json with a model_type and weights in the directory `path` (named by `key`)."""
    d = Path(path).expanduser()
    expected = "a local HF model directory (config.json, *.safetensors weights, tokenizer files)"
    if not d.exists():
        hint = f"build it with `{prepare}`" if prepare else None
        raise ConfigError(key, path, f"no such directory; expected {expected}", hint)
    if not d.is_dir():
        raise ConfigError(key, path, f"is a file; expected {expected}")
    if not any(d.iterdir()):
        raise ConfigError(key, path, f"is an empty directory; expected {expected}")
    hf = read_hf_config(str(d), key)
    if hf is None:
        raise ConfigError(key, path, f"has no config.json; expected {expected}")
    if not isinstance(hf.get("model_type"), str) or not hf["model_type"]:
        raise ConfigError(key, path, f"{d / 'config.json'}: no 'model_type'; is this a transformers config.json?")
    if not any(any(d.glob(p)) for p in WEIGHT_PATTERNS):
        raise ConfigError(key, path, f"has no weights ({' / '.join(WEIGHT_PATTERNS)})")
    for f in sorted(d.glob("*.safetensors")):
        if why := safetensors_fault(f):
            raise ConfigError(key, path, f"{f.name} is not a safetensors file: {why}",
                              "the file is damaged or incomplete: copy or download it again")


def safetensors_fault(path: Path) -> str | None:
    """Why `path` is no safetensors file (its 8-byte header length, then that many bytes of a JSON object), else
    None; reads the header only."""
    import json
    import struct

    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than the 8-byte header length"
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 2**20):
                return f"its header claims {n:,} bytes of a {size:,}-byte file"
            header = json.loads(f.read(n))
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    except (ValueError, UnicodeDecodeError):
        return "its header is not JSON"
    return None if isinstance(header, dict) else "its header is not a JSON object"


def check_hf_config_overrides(master: AnyMaster) -> None:
    """Every policy.hf_config_overrides key must be a field of the model's HF config. The trainer, the HF engine
    and vLLM (`hf_overrides`) all apply the same dict; transformers would silently drop an unknown key (e.g.
    `rope_theta`, which transformers 5 keeps inside `rope_parameters`) while vLLM sets it, so the engine and
    the trainer could run different models."""
    overrides = master.policy.hf_config_overrides
    if not overrides:
        return
    if master.model.tiny is not None:
        model_type, fields = master.model.tiny.architecture, set()
    else:
        hf = read_hf_config(str(master.policy.model_name), model_dir_key(master)) or {}
        model_type, fields = str(hf.get("model_type", "")), set(hf)
    try:
        from transformers import AutoConfig

        fields |= set(vars(AutoConfig.for_model(model_type)))
    except (ImportError, ValueError, KeyError):
        pass  # a model type transformers does not know (remote code): its config.json fields only
    for key, value in overrides.items():
        if key not in fields:
            hint = did_you_mean(key, sorted(f for f in fields if not f.startswith("_")))
            raise ConfigError(f"policy.hf_config_overrides.{key}", value,
                              f"is not a field of the {model_type or 'model'} config ({master.policy.model_name}); "
                              "transformers would ignore it while vLLM would set it", hint)


def check_model_limits(master: AnyMaster) -> None:
    """What the model's config.json bounds (or the tiny model's spec, before it is built): sequences within its
    positions, for the trainer and the engine, and stop tokens within its vocabulary."""
    from rlpost.config.lora_params import model_shape

    hf = model_shape(master)
    if hf is None:
        return
    p = master.policy
    tiny = master.model.tiny if p.model_name == master.model.path else None
    positions = tiny.max_position_embeddings if tiny is not None else hf.get("max_position_embeddings")
    where = (f"model.tiny.max_position_embeddings={positions}" if tiny is not None
             else f"max_position_embeddings={positions} in its config.json")
    if isinstance(positions, int) and p.max_total_sequence_length > positions:
        raise ConfigError("policy.max_total_sequence_length", p.max_total_sequence_length,
                          f"is longer than the model's positions ({where})",
                          f"at most {positions}, or a model with more positions")
    gen = p.generation
    v = getattr(gen, "vllm_cfg", None)
    if v is not None and v.max_model_len is not None:
        if isinstance(positions, int) and v.max_model_len > positions:
            raise ConfigError("policy.generation.vllm_cfg.max_model_len", v.max_model_len,
                              f"is longer than the model's positions ({where})")
        if v.max_model_len < p.max_total_sequence_length:
            raise ConfigError("policy.generation.vllm_cfg.max_model_len", v.max_model_len,
                              "is shorter than the sequences the run generates and trains on "
                              f"(policy.max_total_sequence_length={p.max_total_sequence_length})",
                              "leave it null: it follows policy.max_total_sequence_length")
    _check_pipeline_stages(master, hf)
    if isinstance(p, MegatronPolicyConfig):
        check_converted(hf, "policy.megatron_cfg.converter_type", p.megatron_cfg.converter_type)
        m = p.megatron_cfg
        check_megatron_experts(hf, "policy.megatron_cfg", m.tensor_model_parallel_size, m.sequence_parallel,
                               m.expert_model_parallel_size, m.context_parallel_size)
        arch = architecture_of(hf, m.converter_type)
        if m.context_parallel_size > 1 and arch in (ARCHITECTURES["gemma2"], ARCHITECTURES["gemma3_text"]):
            raise ConfigError("policy.megatron_cfg.context_parallel_size", m.context_parallel_size,
                              f"Gemma's attention on Megatron (soft-capped scores, sliding windows, RoPE per layer) "
                              f"reads whole sequences; this model is {arch}",
                              "set policy.megatron_cfg.context_parallel_size=1")
    elif isinstance(p, DTensorPolicyConfig) and not p._target_.endswith("V2") and not p.dtensor_cfg.custom_parallel_plan:
        check_tp_plan(hf, "policy.dtensor_cfg.tensor_parallel_size", p.dtensor_cfg.tensor_parallel_size)
    vocab = hf.get("vocab_size")
    stops = list(getattr(gen, "stop_token_ids", None) or [])
    if isinstance(vocab, int) and (bad := [t for t in stops if not 0 <= t < vocab]):
        raise ConfigError("policy.generation.stop_token_ids", stops,
                          f"token {bad[0]} is outside the model's vocabulary (ids 0..{vocab - 1})")


def _check_pipeline_stages(master: AnyMaster, hf: Mapping[str, Any]) -> None:
    """Megatron's pipeline stages split the model's layers: each stage at least one, the first and last stage's
    sizes within the layers, the rest even over the middle stages."""
    m = getattr(master.policy, "megatron_cfg", None)
    layers = hf.get("num_hidden_layers")
    if m is None or not isinstance(layers, int):
        return
    pp, first, last = m.pipeline_model_parallel_size, m.num_layers_in_first_pipeline_stage, \
        m.num_layers_in_last_pipeline_stage
    key = "policy.megatron_cfg.pipeline_model_parallel_size"
    if pp > layers:
        raise ConfigError(key, pp, f"more pipeline stages than the model's {layers} layers")
    for name, value in (("first", first), ("last", last)):
        if value is not None and not 1 <= value <= layers - (pp - 1):
            raise ConfigError(f"policy.megatron_cfg.num_layers_in_{name}_pipeline_stage", value,
                              f"must leave each of the other {pp - 1} stages a layer of the model's {layers} "
                              f"(1..{layers - (pp - 1)})")
    if first is None and last is None:
        if layers % pp:
            raise ConfigError(key, pp, f"must divide the model's {layers} layers (or set "
                              "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage)")
        return
    middle, rest = pp - (first is not None) - (last is not None), layers - (first or 0) - (last or 0)
    if (middle == 0 and rest != 0) or (middle > 0 and (rest < middle or rest % middle)):
        raise ConfigError("policy.megatron_cfg.num_layers_in_first_pipeline_stage" if first is not None else
                          "policy.megatron_cfg.num_layers_in_last_pipeline_stage", first if first is not None else last,
                          f"leaves {rest} of the model's {layers} layers for {middle} other stage(s): they must split "
                          "evenly, one or more each")


def check_vocab_shards(master: AnyMaster) -> None:
    """DTensor TP shards the vocabulary in equal slices (vocab-parallel logprobs): TP must divide it.

    Megatron pads its vocabulary itself (make_vocab_size_divisible_by), so only DTensor is checked.
    A tiny model's vocabulary is padded to a multiple of 64 when it is built.
    """
    p = master.policy
    tp = p.parallel_sizes()["tp"]
    if p.pads_vocab or tp == 1 or master.model.tiny is not None:
        return
    key = model_dir_key(master)
    hf = read_hf_config(str(p.model_name), key) or {}
    vocab = hf.get("vocab_size")
    if isinstance(vocab, int) and vocab % tp != 0:
        raise ConfigError(
            p.tp_key(), tp,
            f"must divide the model's vocab_size ({vocab}, {p.model_name}/config.json): the vocabulary is "
            "sharded in equal slices over the TP ranks", hint="pick a TP size that divides it, or policy=megatron",
        )


# ---- optimizer and scheduler ------------------------------------------------------------------


def _check_kwargs(cls: Callable[..., object], name: str, kwargs: Mapping[str, object], key: str,
                  passed_by_rlpost: str) -> None:
    """Every key of `kwargs` is an argument of `cls`, and none of its required arguments is missing."""
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return  # no signature to check against
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != passed_by_rlpost]
    names = [p.name for p in named]
    for k, v in kwargs.items():
        if k == passed_by_rlpost:
            raise ConfigError(f"{key}.{k}", v, f"is passed by rlpost, not set in the config ({name})")
        if k not in names:
            hint = did_you_mean(k, names)
            hint = f"{hint + ' ' if hint else ''}{name} takes: {', '.join(names)}"
            raise ConfigError(f"{key}.{k}", v, f"is not an argument of {name}", hint)
    for p in named:
        if p.default is inspect.Parameter.empty and p.name not in kwargs:
            raise ConfigError(f"{key}.{p.name}", None, f"is a required argument of {name}")


def check_optimizer(master: AnyMaster) -> None:
    """policy.optimizer / policy.scheduler: importable classes, known arguments, values the constructors accept
    (a dry build on one CPU parameter)."""
    p = master.policy
    opt = p.optimizer
    import torch

    cls = resolve(opt.name, "policy.optimizer.name")
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError("policy.optimizer.name", opt.name, "is not a torch.optim.Optimizer class")
    _check_kwargs(cls, opt.name, opt.kwargs, "policy.optimizer.kwargs", "params")
    entries = parse_scheduler("policy.scheduler", p.scheduler)
    for i, e in enumerate(entries):
        if not isinstance(e, SinglePytorchSchedulerConfig):
            continue
        key = f"policy.scheduler[{i}]"
        sched = resolve(e.name, f"{key}.name")
        if not (inspect.isclass(sched) and issubclass(sched, torch.optim.lr_scheduler.LRScheduler)):
            raise ConfigError(f"{key}.name", e.name, "is not a torch.optim.lr_scheduler.LRScheduler class")
        _check_kwargs(sched, e.name, e.kwargs, f"{key}.kwargs", "optimizer")
    device_specific = any(opt.kwargs.get(k) for k in DEVICE_KWARGS)
    _dry_build(opt, p.scheduler, run_device(master) if device_specific else "cpu")


def _dry_build(opt: PytorchOptimizerConfig, scheduler: list[dict[str, Any]], device: str) -> None:
    """Build the optimizer and scheduler as the worker does, on one CPU parameter, to catch bad values."""
    import torch

    from rlpost.models.policy.optim import build_optimizer, build_scheduler

    if device != "cpu":
        opt = replace(opt, kwargs={k: v for k, v in opt.kwargs.items() if k not in DEVICE_KWARGS})
    param = torch.nn.Parameter(torch.zeros(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            optimizer = build_optimizer(opt, [param], dry_run=True)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - any constructor failure is a config error
            raise ConfigError("policy.optimizer.kwargs", dict(opt.kwargs), f"rejected by {opt.name}: {exc}") from None
        try:
            build_scheduler(scheduler, optimizer)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ConfigError("policy.scheduler", scheduler, f"cannot be built: {exc}") from None


# ---- precision on the device ------------------------------------------------------------------


def check_precision(master: AnyMaster, here: bool = True) -> None:
    """bf16 / fp16 training needs a GPU; then the backend's own device checks (GPU-only options on CPU). A job that
    runs elsewhere (`here` false) is judged only on the device its config names."""
    p = master.policy
    if p.precision == "float32" and not p.has_device_checks:
        return  # nothing depends on the device: do not import torch to find it
    if not here and master.cluster.device == "auto":
        return
    device = run_device(master)
    if device == "cpu" and p.precision != "float32":
        raise ConfigError(
            "policy.precision",
            p.precision,
            f"{p.precision} training needs a GPU; this run is on CPU ({_cpu_reason(master)})",
            "use policy.precision=float32 on CPU",
        )
    p.check_device("policy", device)


def _cpu_reason(master: AnyMaster) -> str:
    return "cluster.device=cpu" if master.cluster.device == "cpu" else "cluster.device=auto and no CUDA device"


MOE_CONFIG_KEYS: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json keys that give an HF model's expert count."""


def check_gpu_only_keys(master: AnyMaster) -> None:
    """Keys that act on GPU memory or GPU engines: on a CPU run they would do nothing, so a non-default value is
    refused naming the key. On GPU, vLLM expert parallelism also needs a mixture-of-experts model."""
    p = master.policy
    ep = p.generation.expert_parallel_size() if p.generation is not None else 1
    keys: list[tuple[str, object, str]] = [
        ("logger.monitor_gpus", master.logger.monitor_gpus, "it logs the workers' CUDA memory"),
        ("policy.offload_optimizer_for_logprob", p.offload_optimizer_for_logprob,
         "it moves the optimizer state from the GPU to the CPU during logprob passes"),
    ]
    keys += p.gpu_only_keys("policy")
    if p.generation is not None:
        keys += p.generation.gpu_only_keys("policy.generation")
    if not any(value for _, value, _ in keys):
        return
    if run_device(master) == "cpu":
        for key, value, what in keys:
            if value:
                raise ConfigError(key, value, f"GPU only: {what}; this run is on CPU ({_cpu_reason(master)})",
                                  "leave it at its default on CPU")
    if ep > 1:
        experts = 0 if master.model.tiny is not None else max(
            int((read_hf_config(str(p.model_name), model_dir_key(master)) or {}).get(k) or 0) for k in MOE_CONFIG_KEYS
        )
        if experts <= 1:
            raise ConfigError("policy.generation.vllm_cfg.expert_parallel_size", ep,
                              f"expert parallelism needs a mixture-of-experts model; {p.model_name} has no experts "
                              f"(none of {', '.join(MOE_CONFIG_KEYS)} in its config.json)")


# ---- CPUs of a local Ray cluster --------------------------------------------------------------


def cpu_reservations(master: AnyMaster) -> list[tuple[str, int, float]]:
    """(what, bundles, CPUs each) that the run reserves from Ray: the workers' placement groups (as the setup
    builds them) and a reward model's scoring actor."""
    from rlpost.config.layout import layout_of

    cpus = master.cluster.worker_num_cpus
    if isinstance(master, SupervisedMasterConfig):
        return [("training workers", master.cluster.gpus_per_node * master.cluster.num_nodes, cpus)]
    lay = layout_of(master)
    train = lay.train_workers_per_node * lay.train_nodes
    if master.generation.colocated.enabled:
        out = [("colocated training + engine workers", train, cpus * 2)]
    else:
        out = [("training workers", train, cpus), ("engine workers", lay.gen_workers_per_node * lay.gen_nodes, cpus)]
    env_cpus = getattr(master.env.get(master.data.env_name), "num_cpus", None)
    if isinstance(env_cpus, (int, float)):
        out.append((f"env.{master.data.env_name} actor", 1, float(env_cpus)))
    return out


def check_local_cpus(master: AnyMaster) -> None:
    """A local Ray cluster (cluster.address=null) is this one machine: one node, with cluster.num_cpus CPUs (all
    cores when unset). What the run reserves must fit, or the placement would wait out its timeout."""
    cl = master.cluster
    if cl.address is not None:
        return
    if cl.num_nodes > 1:
        raise ConfigError("cluster.num_nodes", cl.num_nodes, "a local Ray cluster (cluster.address=null) is one node",
                          "join a running multi-node cluster with cluster=ray")
    ram_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    if cl.object_store_memory_mb > ram_mb // 2:
        raise ConfigError("cluster.object_store_memory_mb", cl.object_store_memory_mb,
                          f"a local Ray cluster's object store lives in this machine's RAM ({ram_mb:,} MiB): at most "
                          f"half of it ({ram_mb // 2:,} MiB)")
    have = float(cl.num_cpus) if cl.num_cpus is not None else float(os.cpu_count() or 1)
    source = "cluster.num_cpus" if cl.num_cpus is not None else "os.cpu_count(), as cluster.num_cpus=null gives Ray"
    parts = cpu_reservations(master)
    need = sum(n * c for _, n, c in parts)
    if need <= have + 1e-9:
        return
    shown = ", ".join(f"{what}: {n} x {c:g}" for what, n, c in parts)
    key = "cluster.worker_num_cpus" if cl.worker_num_cpus != ClusterConfig.worker_num_cpus else "cluster.gpus_per_node"
    raise ConfigError(key, getattr(cl, key.split(".")[1]),
                      f"the run reserves {need:g} CPUs ({shown}) but the local Ray cluster has {have:g} ({source})",
                      "lower cluster.worker_num_cpus or cluster.gpus_per_node, or set cluster.num_cpus")


# ---- output directories -----------------------------------------------------------------------


def _mkdir_fails(parent: Path) -> str | None:
    """Why a directory cannot be made in the existing directory `parent` (None when it can). The probe makes and
    removes an empty directory: os.access answers yes to root on /proc and on read-only file systems."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlpost-probe-", dir=parent))
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def check_writable_dir(key: str, path: Path) -> None:
    """`path` is a directory rlpost can write into, or one it can create; ConfigError naming `key` otherwise."""
    if path.exists():
        if not path.is_dir():
            raise ConfigError(key, str(path), "exists and is not a directory")
        why = _mkdir_fails(path) if os.access(path, os.W_OK | os.X_OK) else "permission denied"
        if why:
            raise ConfigError(key, str(path), f"is not writable ({why})")
        return
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(key, str(path), f"cannot be created: {parent} is a file")
    why = _mkdir_fails(parent) if os.access(parent, os.W_OK | os.X_OK) else "permission denied"
    if why:
        raise ConfigError(key, str(path), f"cannot be created: {parent} is not writable ({why})")


def check_eval_output(value: str) -> None:
    """`eval.output` names a file rlpost eval can write (its directory writable or creatable), not a directory."""
    out = Path(value).expanduser()
    if out.is_dir():
        raise ConfigError("eval.output", value, "is a directory; the report is a JSON file",
                          f"e.g. eval.output={out / 'eval.json'}")
    try:
        check_writable_dir("eval.output", out.parent)
    except ConfigError as err:
        raise ConfigError("eval.output", value, f"its directory {err.rule}") from None


def output_dirs(master: AnyMaster, run_dir: Path | None) -> list[tuple[str, Path]]:
    """(key, directory) of every directory the run writes; defaults resolved under `run_dir` when given."""
    out: list[tuple[str, Path]] = []

    def add(key: str, value: str | None, default: Path | None) -> Path | None:
        path = Path(value).expanduser() if value else default
        if path is not None:
            out.append((key, path))
        return path

    ck, lg = master.checkpointing, master.logger
    if ck.enabled:
        add("checkpointing.checkpoint_dir", ck.checkpoint_dir, run_dir / "checkpoints" if run_dir else None)
    log_dir = add("logger.log_dir", lg.log_dir, run_dir)
    if lg.tensorboard_enabled:
        add("logger.tensorboard.log_dir", lg.tensorboard.log_dir, log_dir / "tensorboard" if log_dir else None)
    return out


def check_not_a_shared_dir(key: str, value: str) -> None:
    """ConfigError when `value` names a directory a run must not write its files into: the file system's root, the
    working directory (or one above it) or the home directory."""
    where = Path(value).expanduser().resolve()
    cwd, home = Path.cwd().resolve(), Path(os.path.expanduser("~")).resolve()
    if where == Path(where.anchor) or where == home or cwd.is_relative_to(where):
        what = ("the file system's root" if where == Path(where.anchor) else "the home directory" if where == home
                else "the working directory" if where == cwd else "a directory above the working directory")
        raise ConfigError(key, value, f"is {what}; a run writes its files (metrics, logs, checkpoints) into its "
                          "directory, so it must be one of its own", "name a new directory, e.g. outputs/my-run")


def check_output_dirs(master: AnyMaster, run_dir: Path | None = None) -> None:
    """Checkpoint and log directories are directories (or can be created) and writable, and none is a directory
    shared with other files (/, the working directory, the home directory)."""
    ck = master.checkpointing
    if ck.enabled and ck.checkpoint_dir:
        check_not_a_shared_dir("checkpointing.checkpoint_dir", ck.checkpoint_dir)
    for key, path in output_dirs(master, run_dir):
        check_writable_dir(key, path)
