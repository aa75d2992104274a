"""Compose a config, turn it into a typed MasterConfig, and turn every failure into a ConfigError.

`compose_config` is the in-process path (Hydra's Compose API, used by `rlpost plan`, the CLI's
pre-flight check and tests). `to_master_config` is shared with the @hydra.main task.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, DictKeyType, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue, OmegaConfBaseException

from rlpost.config.device_defaults import resolve_device_defaults
from rlpost.config.errors import ConfigError, did_you_mean
from rlpost.config.layout import layout_of
from rlpost.config.removed_keys import removed_rule
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.root import RootConfig, narrow
from rlpost.config.schema.supervised_master import SupervisedMasterConfig
from rlpost.config.store import register_configs

CONFIG_NAME = "config"
KEY_HINT_CUTOFF = 0.5
"""How close a mistyped key or option must be to a real one to be suggested (difflib's ratio)."""


def conf_dir() -> str:
    """The directory holding config.yaml: $RLPOST_CONF_DIR, the package's bundled copy, or the repo's conf/."""
    env = os.environ.get("RLPOST_CONF_DIR")
    if env:
        return str(Path(env).resolve())
    here = Path(__file__).resolve().parent.parent
    for cand in (here / "conf", here.parent.parent / "conf"):
        if (cand / f"{CONFIG_NAME}.yaml").is_file():
            return str(cand)
    raise FileNotFoundError("rlpost: cannot find conf/config.yaml (set RLPOST_CONF_DIR)")


def group_options(group: str) -> list[str]:
    """Option names of a config group in conf/ (e.g. 'policy' -> ['dtensor', 'dtensor_v2', 'megatron'])."""
    d = Path(conf_dir()) / group
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def groups() -> list[str]:
    """Config groups in conf/."""
    return sorted(p.name for p in Path(conf_dir()).iterdir() if p.is_dir())


def _schema_fields(node: object) -> list[str] | None:
    """Field names of the dataclass schema typing `node`; None for an open (untyped) mapping."""
    t = OmegaConf.get_type(node) if isinstance(node, DictConfig) else node
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        return [f.name for f in dataclasses.fields(t)]
    return None


def _err_candidates(err: BaseException) -> list[str]:
    """Sibling keys of the key an OmegaConf error names: its schema's fields, else its parent's keys."""
    fields = _schema_fields(getattr(err, "object_type", None))
    if fields is not None:
        return fields
    parent = getattr(err, "parent_node", None)
    if isinstance(parent, DictConfig):
        try:
            return [str(k) for k in parent.keys()]
        except Exception:  # noqa: BLE001 - a hint is best effort
            return []
    return []


def _raw(node: DictConfig, key: DictKeyType) -> object:
    """The value under `key` as written (no interpolation resolved), for error messages."""
    try:
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)):
            return OmegaConf.to_container(child, resolve=False)
        return child._value() if child is not None else None
    except Exception:  # noqa: BLE001 - the value only decorates the message
        return None


def check_unknown_keys(node: object, path: str = "") -> None:
    """Refuse every key the schema does not have, however it got in (`+key=...`, an experiment file,
    a YAML option). A mapping typed by a dataclass admits only that dataclass's fields (a polymorphic
    block is checked against the option's own schema, the node's object type); untyped mappings
    (free-form mapping fields such as optimizer kwargs, vllm_kwargs, env_vars) stay open, and typed
    values inside them (env entries) are checked in turn."""
    if isinstance(node, DictConfig):
        if node._is_none() or node._is_missing() or node._is_interpolation():
            return
        fields = _schema_fields(node)
        for key in list(node.keys()):
            name = str(key)
            full = f"{path}.{name}" if path else name
            if fields is not None and key not in fields:
                if (rule := removed_rule(full)) is not None:
                    raise ConfigError(full, _raw(node, key), rule)
                raise ConfigError(full, _raw(node, key), "unknown config key",
                                  did_you_mean(str(key), fields, KEY_HINT_CUTOFF))
            check_unknown_keys(node._get_node(key), full)
    elif isinstance(node, ListConfig):
        if node._is_none() or node._is_missing() or node._is_interpolation():
            return
        for i in range(len(node)):
            check_unknown_keys(node._get_node(i), f"{path}[{i}]")


def _key_candidates(cfg: DictConfig | None, full_key: str) -> list[str]:
    if cfg is None or "." not in full_key:
        return [str(k) for k in cfg.keys()] if cfg is not None else []
    parent = full_key.rsplit(".", 1)[0]
    node = OmegaConf.select(cfg, parent, throw_on_missing=False)
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def _typed(overrides: list[str] | None, key: str) -> str | None:
    """The value the command line gave `key` (the last `key=value`, `+key=value` or `++key=value`), as typed;
    None when it gave none."""
    for o in reversed(overrides or []):
        k, eq, v = o.partition("=")
        if eq and k.lstrip("+~") == key:
            return v
    return None


def _interpolations(raw: str) -> list[str]:
    """The `${...}` parts of `raw` (nested braces kept whole)."""
    found, i = [], raw.find("${")
    while i >= 0:
        depth, j = 0, i + 1
        while j < len(raw):
            depth += {"{": 1, "}": -1}.get(raw[j], 0)
            if depth == 0:
                break
            j += 1
        found.append(raw[i: j + 1])
        i = raw.find("${", j + 1)
    return found


def _unresolved(node: Any, path: str = "") -> list[tuple[str, object]]:
    """(dotted key, value as written) of every interpolation under `node` that does not resolve."""
    out: list[tuple[str, object]] = []
    items: Iterable[tuple[Any, str]] = []
    if isinstance(node, DictConfig) and not (node._is_none() or node._is_missing() or node._is_interpolation()):
        items = [(k, f"{path}.{str(k)}" if path else str(k)) for k in node.keys()]
    elif isinstance(node, ListConfig) and not (node._is_none() or node._is_missing() or node._is_interpolation()):
        items = [(i, f"{path}[{i}]") for i in range(len(node))]
    for k, full in items:
        child = node._get_node(k)
        if child is None:
            continue
        if child._is_interpolation():
            try:
                child._dereference_node()
            except Exception:  # noqa: BLE001 - any failure to resolve is what is looked for
                out.append((full, _raw(node, k)))
        else:
            out.extend(_unresolved(child, full))
    return out


def _interpolation_error(err: BaseException, cfg: DictConfig | None) -> ConfigError:
    """One line for an interpolation that does not resolve, naming the key whose own text holds it (not a key that
    merely refers to that key, as vLLM's max_model_len refers to policy.max_total_sequence_length)."""
    reason = (getattr(err, "msg", None) or str(err)).strip().split("\n")[0]
    reason = reason.replace("KeyError raised while resolving interpolation: ", "")
    broken = _unresolved(cfg) if cfg is not None else []
    keys = [k for k, _ in broken]
    own = [(k, v) for k, v in broken
           if not any(other != k and f"${{{other}}}" in str(v) for other in keys)]
    if own or broken:
        key, raw = (own or broken)[0]
    else:
        key = getattr(err, "full_key", None) or "?"
        raw = _raw(cfg, key) if cfg is not None and "." not in key else None
    shown = ", ".join(_interpolations(raw)) if isinstance(raw, str) else ""
    return ConfigError(key, raw, f"interpolation {shown or raw} does not resolve: {reason}")


def translate_exception(exc: BaseException, cfg: DictConfig | None = None,
                        overrides: list[str] | None = None) -> ConfigError:
    """Turn a Hydra / OmegaConf exception (or one it wraps) into a ConfigError naming key, value and rule. With
    the command line's `overrides`, a key it names is shown with the value typed there."""
    if isinstance(exc, ConfigError):
        return exc
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for err in chain:
        if isinstance(err, ConfigError):
            return err
    text = "\n".join(str(c) for c in chain)
    for err in chain:
        line = getattr(err, "override", None)  # hydra.errors.OverrideParseException
        if isinstance(line, str) and type(err).__name__ == "OverrideParseException":
            name, _, typed = line.partition("=")
            return ConfigError(name.lstrip("+~") or "<overrides>", typed or line,
                               f"cannot be parsed as an override: {str(err).strip().splitlines()[0]}",
                               "quote a value holding special characters: key='...'")

    # Unknown option of a config group.
    m = re.search(r"Could not find '([^']+)/([^'/]+)'", text) or re.search(
        r"Could not load '([^']+)/([^'/]+)'", text
    )
    if m:
        group, opt = m.group(1), m.group(2)
        opts = group_options(group.split("/")[-1]) if "/" in group else group_options(group)
        return ConfigError(group, opt, f"unknown option of group '{group}'; options: {opts}",
                           did_you_mean(opt, opts, KEY_HINT_CUTOFF))
    mm = re.search(r"Missing mandatory value: ([\w.]+)", text)
    if mm:
        return ConfigError(mm.group(1), "???", "a value is required here")
    m = re.search(r"Could not override '([^']+)'", text)
    for err in chain:
        if isinstance(err, InterpolationResolutionError):
            return _interpolation_error(err, cfg)
        if isinstance(err, MissingMandatoryValue):
            key = getattr(err, "full_key", None) or "?"
            return ConfigError(key, "???", "a value is required here")
        if isinstance(err, OmegaConfBaseException):
            key = getattr(err, "full_key", None) or (m.group(1) if m else "?")
            msg = getattr(err, "msg", None) or str(err).split("\n")[0]
            km = re.search(r"Key '([^']+)' (?:not in|is not in)", msg)
            if km and (rule := removed_rule(key)) is not None:
                return ConfigError(key, _typed(overrides, key), rule)
            if km:
                word = key.rsplit(".", 1)[-1]
                hint = did_you_mean(word, _key_candidates(cfg, key), KEY_HINT_CUTOFF) or did_you_mean(
                    word, _err_candidates(err), KEY_HINT_CUTOFF)
                if key.endswith(".enabled") and ("dtensor_cfg" in key or "megatron_cfg" in key):
                    hint = "rlpost picks the backend with policy=dtensor|dtensor_v2|megatron"
                shown, given = _as_typed(overrides, key)
                return ConfigError(shown, given, "unknown config key", hint)
            vm = re.search(r"Value '(.*?)' (?:of type '[^']+' )?could not be converted to (\w+)", msg, re.S)
            if vm:
                return ConfigError(key, vm.group(1), f"must be of type {vm.group(2)}")
            vm = re.search(r"field '([^']+)' is not Optional", msg)
            if vm:
                return ConfigError(key, None, "may not be null")
            value = getattr(err, "value", None)
            return ConfigError(key, _typed(overrides, key) if value is None else value, _plain_rule(msg))
    if m:
        return ConfigError(m.group(1), None, chain[-1].__class__.__name__ + ": " + str(chain[-1]).split("\n")[0])
    first = str(exc).strip().split("\n")
    return ConfigError("<overrides>", None, " ".join(line.strip() for line in first if line.strip())[:500])


_RULES = (
    (re.compile(r"Value '.*' is not a valid bool"), "must be true or false"),
    (re.compile(r"is not a ListConfig, list or tuple"), "must be a list, e.g. [1, 2]"),
    (re.compile(r"is not a DictConfig, dict"), "must be a mapping, e.g. {a: 1}"),
    (re.compile(r"does not support deletion"), "is a key of the schema: it cannot be removed with ~, only set"),
)
"""OmegaConf's messages, in the words of a rule."""


def _plain_rule(msg: str) -> str:
    """An OmegaConf message as one line: its rule in plain words where known, else its first line (never the
    full_key / reference_type / object_type lines it appends)."""
    first = msg.strip().splitlines()[0] if msg.strip() else msg
    return next((rule for pattern, rule in _RULES if pattern.search(first)), first)


def _as_typed(overrides: Sequence[str] | None, key: str) -> tuple[str, str | None]:
    """(key, value) as the command line typed them: `polcy.x=1` for an unknown `polcy`, not `polcy=None`."""
    for o in overrides or []:
        name, sep, value = o.partition("=")
        name = name.lstrip("+~")
        if sep and (name == key or name.startswith(key + ".")):
            return name, value
    return key, _typed(list(overrides) if overrides is not None else None, key)


def to_master_config(cfg: DictConfig, overrides: Sequence[str] | None = None) -> MasterConfig | SupervisedMasterConfig:
    """DictConfig (with or without a `hydra` node) -> the algorithm's validated master config (GRPO's
    MasterConfig, or SFT / DPO / RM's), or ConfigError. `overrides`: the command line's (default: the `hydra`
    node's, else the running Hydra job's), which tell a default of conf/ from what the command asked for
    (`validation_off_note`)."""
    node = cfg.copy()
    if overrides is None:
        given = OmegaConf.select(node, "hydra.overrides.task", default=None)
        overrides = list(given) if given is not None else task_overrides()
    if "hydra" in node:
        with_struct = OmegaConf.is_struct(node)
        OmegaConf.set_struct(node, False)
        node.pop("hydra")
        OmegaConf.set_struct(node, with_struct)
    if validation_off_note(node, overrides):
        _turn_validation_off(node)
    # to_object would keep a key the schema lacks as a stray attribute, and use it or not: refuse it first.
    check_unknown_keys(node)
    check_bool_overrides(node, overrides)
    try:
        resolve_device_defaults(node)  # precision `auto`, enforce_eager None: concrete before anything reads them
        root = OmegaConf.to_object(node)
        assert isinstance(root, RootConfig)
        obj = narrow(root)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a ConfigError
        raise translate_exception(exc, node) from None
    if isinstance(obj, MasterConfig):
        layout_of(obj)  # the layout's rules are the last config check; computed once, reused by setup
    return obj


BOOLEANS = ("true", "false")
"""What a boolean key may be set to on the command line (OmegaConf would read any integer as a boolean)."""


def check_bool_overrides(node: DictConfig, overrides: Sequence[str]) -> None:
    """ConfigError for a command-line value of a boolean key that is not true or false (`grpo.normalize_rewards=2`
    would run as true)."""
    from omegaconf.nodes import BooleanNode

    for o in overrides:
        key, sep, value = o.partition("=")
        key = key.lstrip("+")
        if not sep or key.startswith(("~", "hydra.")) or "." not in key:
            continue
        try:
            target = OmegaConf.select(node, key.rsplit(".", 1)[0], default=None)
            child = target._get_node(key.rsplit(".", 1)[1]) if isinstance(target, DictConfig) else None
        except Exception:  # noqa: BLE001 - a key the schema checks name elsewhere
            continue
        if isinstance(child, BooleanNode) and value.strip().lower() not in (*BOOLEANS, "null"):
            raise ConfigError(key, value, "must be true or false")


def task_overrides() -> list[str]:
    """The overrides of the running Hydra job ([] outside one)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # no Hydra job is running
        return []


def _supervised_algo(cfg: DictConfig) -> str | None:
    """The algorithm of a job that trains on rows (SFT, DPO, RM), else None."""
    from rlpost.config.algorithms import ALGORITHMS

    algo = ALGORITHMS.get(str(cfg.get("algo")))
    return algo.name if algo is not None and not algo.rollout else None


def validation_off_note(cfg: DictConfig, overrides: Sequence[str]) -> str | None:
    """The warning of an SFT / DPO / RM job on local files without validation files, whose validation (every
    `val_period` steps, `val_at_start`, a 'val:' checkpoint metric) comes from conf/'s defaults only: there is
    nothing to validate on, so validation goes off and checkpoints are ranked by train:loss (`to_master_config`).
    None for any other job. Validation the command line asks for (`sft.val_period=5`, `sft.val_at_start=true`,
    `checkpointing.metric_name=val:loss`) stays on, and the config check refuses it, naming data.val_data_paths."""
    try:
        algo = _supervised_algo(cfg)
        if algo is None or cfg.data.get("dataset_name") == "synthetic" or cfg.data.get("val_data_paths"):
            return None
        loop, metric = cfg[algo], str(OmegaConf.select(cfg, "checkpointing.metric_name", default=None))
        asks = {f"{algo}.val_period": bool(loop.get("val_period")), f"{algo}.val_at_start": bool(loop.get("val_at_start")),
                "checkpointing.metric_name": metric.startswith("val:")}
    except Exception:  # noqa: BLE001 - a malformed block: the config check names it
        return None
    given = {o.lstrip("+~").partition("=")[0] for o in overrides}
    if not any(asks.values()) or any(asks[k] for k in given & asks.keys()):
        return None
    ranked = " and checkpoints are ranked by train:loss" if asks["checkpointing.metric_name"] else ""
    every = f" every {loop.get('val_period')} steps" if asks[f"{algo}.val_period"] else ""
    return (f"no validation rows (data.val_data_paths is empty): {algo} validation is off{ranked}; "
            f"give data.val_data_paths=[...] to validate{every}")


def _turn_validation_off(cfg: DictConfig) -> None:
    """What validation_off_note announces: val_period=0, val_at_start=false, a 'val:' metric -> train:loss."""
    from omegaconf import flag_override

    algo = _supervised_algo(cfg)
    assert algo is not None
    with flag_override(cfg, "readonly", False):
        cfg[algo].val_period = 0
        cfg[algo].val_at_start = False
        if str(OmegaConf.select(cfg, "checkpointing.metric_name", default=None)).startswith("val:"):
            cfg.checkpointing.metric_name = "train:loss"
            cfg.checkpointing.higher_is_better = False


def compose_config(overrides: list[str] | None = None, config_name: str = CONFIG_NAME,
                   with_hydra: bool = False) -> DictConfig:
    """Compose conf/<config_name>.yaml with `overrides` (Hydra Compose API), with its `hydra` node when
    `with_hydra`; ConfigError on failure."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    overrides = list(overrides or [])
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides, return_hydra_config=with_hydra)
    except Exception as exc:  # noqa: BLE001
        raise (_algorithm_mismatch(overrides) or _unset_block(exc, overrides, config_name)
               or translate_exception(exc, overrides=overrides)) from None


def _unset_block(exc: BaseException, overrides: list[str], config_name: str) -> ConfigError | None:
    """A failed composition caused by a key of a block this run leaves unset (`distillation.topk_logits_k=8`
    without a teacher): OmegaConf cannot set a key under a null node."""
    if "Unexpected type for root: NoneType" not in f"{exc} {exc.__cause__} {exc.__context__}":
        return None
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        block, dot, _ = key.partition(".")
        if not dot:
            continue
        try:
            cfg = compose_config([x for x in overrides if x != o], config_name)
        except ConfigError:
            continue
        if block in cfg and cfg[block] is None:
            options = group_options(block)
            hint = f"add the block first: {block}={'|'.join(options)}" if options else None
            return ConfigError(key, value, f"sets a key of the {block} block, which this run does not have", hint)
    return None


def _algorithm_mismatch(overrides: list[str]) -> ConfigError | None:
    """A failed composition caused by an override that the chosen algorithm has no place for: a key of another
    algorithm's block (`algo=sft grpo.max_num_steps=3`), or a group only rollout algorithms choose (`algo=dpo
    generation=hf`)."""
    from rlpost.config.algorithms import ALGORITHMS, readers

    algo = next((o.split("=", 1)[1] for o in overrides if o.startswith("algo=")), next(iter(ALGORITHMS)))
    if algo not in ALGORITHMS:
        return None
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        first = key.split(".", 1)[0]
        owners = readers("policy.generation" if key.startswith("policy.generation") else first)
        if owners and algo not in owners and first != "algo":
            return ConfigError(key, value, f"algo={algo} has no such {'group' if '.' not in key else 'key'}: it "
                               f"belongs to algo={owners[0]}")
    return None


def load_master_config(overrides: list[str] | None = None) -> tuple[DictConfig, MasterConfig | SupervisedMasterConfig]:
    """Compose and validate: the resolved DictConfig and the typed MasterConfig."""
    cfg = compose_config(overrides)
    return cfg, to_master_config(cfg, list(overrides or []))


def to_yaml(obj: object) -> str:
    """YAML of a MasterConfig or DictConfig, resolved."""
    return OmegaConf.to_yaml(OmegaConf.structured(obj) if not isinstance(obj, DictConfig) else obj, resolve=True)
