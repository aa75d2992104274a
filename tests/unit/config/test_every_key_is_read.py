"""No config key is accepted and ignored (issue #11 §4).

Every leaf field of every schema dataclass must be read somewhere in src/rlpost outside
config/schema/: an attribute access `.name`, a string constant 'name' (getattr, dict keys; docstrings do
not count) or a `${...name}` interpolation in conf/ that copies it into another key.
The check is by field name, so it can miss a field whose name another class reads; it catches the
common case: a new key that nothing reads.

A field that is read nowhere is allowed only in the lists below, each with the reason, and each
entry is verified: REFUSED entries must make config validation fail naming the key for a
non-default value, so they can never be set and ignored.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import rlpost
import rlpost.config.schema as schema_pkg
from rlpost.config.errors import ConfigError
from rlpost.config.load import conf_dir, load_master_config

SRC = Path(rlpost.__file__).parent
SCHEMA_DIR = Path(schema_pkg.__file__).parent

# (class, field) -> (override with a non-default value, key the refusal must name). The field has no reader
# because only its default is accepted: validation refuses every other value (see each schema's check()).
REFUSED: dict[tuple[str, str], tuple[list[str], str]] = {
    # torch_save would write pickles; rlpost writes safetensors only.
    ("CheckpointingConfig", "model_save_format"): (
        ["checkpointing.model_save_format=torch_save"], "checkpointing.model_save_format"),
    # SwanLab is not bundled: only false is accepted (W&B and MLflow are: rlpost.runtime.trackers).
    ("LoggerConfig", "swanlab_enabled"): (["logger.swanlab_enabled=true"], "logger.swanlab_enabled"),
    # One verifier implementation: the math environment accepts only its defaults.
    ("MathEnvConfig", "verifier_type"): (["env=math", "data=math_jsonl", "data.train_data_path=x.jsonl",
                                          "env.math.verifier_type=code"], "env.math.verifier_type"),
    ("MathEnvConfig", "math_verify_impl"): (["env=math", "data=math_jsonl", "data.train_data_path=x.jsonl",
                                             "env.math.math_verify_impl=dapo_math_verify"], "env.math.math_verify_impl"),
    # Megatron: lazy fp32 logits are not implemented (logits reach the logprob pass in fp32).
    ("MegatronConfig", "defer_fp32_logits"): (
        ["policy=megatron", "policy.megatron_cfg.defer_fp32_logits=true"], "policy.megatron_cfg.defer_fp32_logits"),
    # Megatron: each expert is split over the tensor-parallel group (MegatronConfig.check refuses another size).
    ("MegatronConfig", "expert_tensor_parallel_size"): (
        ["policy=megatron", "policy.megatron_cfg.expert_tensor_parallel_size=2"],
        "policy.megatron_cfg.expert_tensor_parallel_size"),
    # Reward-model mode is refused (policy.reward_model_cfg.enabled); only the default type is accepted.
    ("RewardModelConfig", "reward_model_type"): (
        ["policy.reward_model_cfg.reward_model_type=other"], "policy.reward_model_cfg.reward_model_type"),
}

# (class, field) -> why nothing needs to read it. Keep this short.
UNREAD_OK: dict[tuple[str, str], str] = {}


def _schema_fields() -> Iterator[tuple[type, dataclasses.Field]]:
    """Every field a schema dataclass declares itself (inherited ones belong to the parent)."""
    for info in pkgutil.iter_modules(schema_pkg.__path__):
        module = importlib.import_module(f"{schema_pkg.__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                own = obj.__dict__.get("__annotations__", {})
                for f in dataclasses.fields(obj):
                    if f.name in own:
                        yield obj, f


def _is_container(f: dataclasses.Field, schema_classes: set[str]) -> bool:
    """A field holding another schema dataclass (possibly None): its own leaves are checked instead."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
    if dataclasses.is_dataclass(default):
        return True
    words = set(re.findall(r"\w+", str(f.type)))  # e.g. Optional[DTensorConfig]
    return bool(words & schema_classes) and not words & {"Dict", "List"}


def _reads() -> set[str]:
    """Names read outside the schemas: attribute accesses and string constants in src/rlpost (not
    config/schema/), and the last part of every `${a.b.name}` interpolation in conf/."""
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        if SCHEMA_DIR in path.parents:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                names.add(node.value)  # getattr(x, "name"), d["name"]
    for yaml in Path(conf_dir()).rglob("*.yaml"):
        names.update(re.findall(r"\$\{[\w.]*?\.?(\w+)\}", yaml.read_text(encoding="utf-8")))
    return names


def test_every_schema_leaf_is_read_outside_its_schema() -> None:
    reads = _reads()
    classes = {cls.__name__ for cls, _ in _schema_fields()}
    unread = sorted(
        f"{cls.__name__}.{f.name}"
        for cls, f in _schema_fields()
        if not _is_container(f, classes)
        and f.name not in reads
        and (cls.__name__, f.name) not in REFUSED
        and (cls.__name__, f.name) not in UNREAD_OK
    )
    assert not unread, (
        "config keys that pass validation but that no code reads (implement them, or refuse non-default "
        f"values in the schema's check() and list them in REFUSED): {unread}"
    )


def test_allow_lists_name_real_fields_that_are_still_unread() -> None:
    fields = {(cls.__name__, f.name) for cls, f in _schema_fields()}
    reads = _reads()
    for entry in [*REFUSED, *UNREAD_OK]:
        assert entry in fields, f"{entry} is not a schema field"
        assert entry[1] not in reads or entry in REFUSED, f"{entry} is read now: drop it from UNREAD_OK"


@pytest.mark.parametrize("entry", sorted(REFUSED), ids=lambda e: ".".join(e))
def test_refused_keys_are_refused(entry: tuple[str, str]) -> None:
    overrides, key = REFUSED[entry]
    with pytest.raises(ConfigError) as err:
        load_master_config(overrides)
    assert err.value.key == key, err.value
