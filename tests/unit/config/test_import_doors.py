"""No config value is a way to import or run code outside the allow-list (issue #11 §1).

Each door is tried through `rlpost plan` and the `rlpost train` pre-flight (in-process, with the
Hydra app stubbed out): exit 2, the key named on stderr, and the canaries untouched: os.system is
never called and `rlpost_canary_pkg` (which writes a file when imported or called) is never imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlpost.cli import main
from rlpost.command_checks import _hydra_node, check_hydra_node
from rlpost.config.errors import ConfigError
from rlpost.config.load import compose_config, conf_dir, load_master_config
from rlpost.runtime.build import _locate, _proven_in_source, check_target, resolve, verify_targets

CANARY = "rlpost_canary_pkg"


@pytest.fixture()
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A package that leaves a file when imported or called, os.system recorded, the Hydra app stubbed."""
    hits = tmp_path / "hits"
    pkg = tmp_path / "site" / CANARY
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(hits / 'imported')!r}).parent.mkdir(exist_ok=True)\n"
        f"Path({str(hits / 'imported')!r}).touch()\n"
        f"def boom(*a, **k):\n    Path({str(hits / 'called')!r}).touch()\n"
        "class Thing:\n    def __init__(self, *a, **k):\n        boom()\n"
    )
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.delitem(sys.modules, CANARY, raising=False)
    calls: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a, **k: calls.append(("os.system", a)) or 0)
    import rlpost.train

    monkeypatch.setattr(rlpost.train, "main", lambda *a, **k: calls.append(("train", a)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return {"hits": hits, "calls": calls}


def refused(canary: dict[str, Any], capsys: pytest.CaptureFixture[str], argv: list[str], key: str) -> str:
    """Run the CLI: exit 2, `key` on stderr, nothing imported, called or started."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert key in err, err
    assert "Traceback" not in err
    assert canary["calls"] == []
    assert CANARY not in sys.modules
    assert not canary["hits"].exists()
    return err


# ---- attribute traversal -------------------------------------------------------------------------

TRAVERSALS = [
    ("loss_fn._target_", "rlpost.runtime.checkpointing.os.system"),  # a module attribute of an rlpost module
    ("loss_fn._target_", "rlpost.runtime.checkpointing.json.loads"),
    ("loss_fn._target_", "rlpost.runtime.checkpointing.Path"),  # a foreign class imported into rlpost
    ("policy._target_", "rlpost.runtime.checkpointing.shutil.rmtree"),
    ("policy.optimizer.name", "torch.optim.lr_scheduler.warnings.warn"),
    ("policy.optimizer.name", "torch.optim.lr_scheduler.Tensor"),
    ("policy.dtensor_cfg.custom_parallel_plan", "rlpost.runtime.checkpointing.os.system"),
]


@pytest.mark.parametrize("cmd", ["plan", "train"])
@pytest.mark.parametrize("key,target", TRAVERSALS)
def test_attribute_traversal_is_refused(
    cmd: str, key: str, target: str, canary: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(canary, capsys, [cmd, f"{key}={target}"], key)
    assert target in err


def test_scheduler_name_reexport_is_refused(canary: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(canary, capsys, ["plan", "policy.scheduler=[{name:torch.optim.lr_scheduler.partial}]"],
                  "policy.scheduler[0].name")
    assert "functools.partial" in err


@pytest.mark.parametrize("cmd", ["plan", "train"])
def test_target_inside_a_plain_dict_is_checked(
    cmd: str, canary: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    refused(canary, capsys, [cmd, "+policy.optimizer.kwargs.foo={_target_:os.system}"], "policy.optimizer.kwargs.foo._target_")
    refused(canary, capsys, [cmd, f"+policy.hf_config_overrides.x={{_target_:{CANARY}.boom}}"],
            "policy.hf_config_overrides.x._target_")


# ---- Hydra's own imports -------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["plan", "train"])
@pytest.mark.parametrize("target", ["os.system", "rlpost.runtime.checkpointing.os.system", f"{CANARY}.boom"])
def test_hydra_callback_is_refused(
    cmd: str, target: str, canary: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    refused(canary, capsys, [cmd, f"+hydra.callbacks.evil._target_={target}"], "hydra.callbacks.evil._target_")


def test_rlpost_callback_cannot_be_repointed(canary: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    refused(canary, capsys, ["train", "hydra.callbacks.sweep_summary._target_=os.system"],
            "hydra.callbacks.sweep_summary._target_")


def test_hydra_callback_in_multirun_job_is_refused(canary: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    refused(canary, capsys, ["train", "-m", "grpo.max_num_steps=1,2", f"+hydra.callbacks.e._target_={CANARY}.Thing"],
            "hydra.callbacks.e._target_")


def _conf_with_experiment(tmp_path: Path, body: str) -> Path:
    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    (conf / "experiment" / "evil.yaml").write_text("# @package _global_\n" + body)
    return conf


@pytest.mark.parametrize(
    "body,key",
    [
        (f"hydra:\n  callbacks:\n    evil:\n      _target_: {CANARY}.Thing\n", "hydra.callbacks.evil._target_"),
        (f"hydra:\n  job_logging:\n    formatters:\n      x:\n        (): {CANARY}.Thing\n",
         "hydra.job_logging.formatters.x.()"),
        (f"hydra:\n  job_logging:\n    handlers:\n      console:\n        stream: ext://{CANARY}.boom\n",
         "hydra.job_logging.handlers.console.stream"),
    ],
)
@pytest.mark.parametrize("cmd", ["plan", "train"])
def test_experiment_file_cannot_set_hydra_imports(
    cmd: str, body: str, key: str, tmp_path: Path, canary: dict[str, Any], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RLPOST_CONF_DIR", str(_conf_with_experiment(tmp_path, body)))
    refused(canary, capsys, [cmd, "experiment=evil"], key)


@pytest.mark.parametrize(
    "override,key",
    [
        (f"hydra.launcher._target_={CANARY}.Thing", "hydra.launcher._target_"),
        (f"hydra.sweeper._target_={CANARY}.Thing", "hydra.sweeper._target_"),
        (f"hydra.job_logging.handlers.console.class={CANARY}.Thing", "hydra.job_logging.handlers.console.class"),
        (f"hydra.hydra_logging.handlers.console.class={CANARY}.Thing", "hydra.hydra_logging.handlers.console.class"),
        (f"hydra.searchpath=[pkg://{CANARY}]", "hydra.searchpath"),
    ],
)
@pytest.mark.parametrize("cmd", ["plan", "train"])
def test_hydra_import_paths_are_refused(
    cmd: str, override: str, key: str, canary: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    refused(canary, capsys, [cmd, override], key)


@pytest.mark.parametrize("flag", [["--experimental-rerun", "x.pickle"], ["--config-name=evil"], ["-cd", "/tmp"]])
def test_flags_that_bypass_preflight_are_refused(
    flag: list[str], canary: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    refused(canary, capsys, ["train", *flag], flag[0].split("=")[0])


def test_hydra_defaults_pass() -> None:
    for overrides in ([], ["hydra/job_logging=stdout"], ["hydra/hydra_logging=disabled"], ["hydra/launcher=basic"]):
        check_hydra_node(_hydra_node(compose_config(overrides, with_hydra=True)))


# ---- vllm_kwargs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,value,owner",
    [
        ("worker_cls", "evil.Worker", "rlpost itself"),
        ("worker_extension_cls", f"{CANARY}.Thing", "rlpost itself"),
        ("trust_remote_code", "true", "policy.trust_remote_code"),
        ("model", "/tmp/other", "policy.model_name"),
        ("tokenizer", "/tmp/other", "policy.tokenizer.name"),
        ("load_format", "dummy", "policy.generation.vllm_cfg.load_format"),
        ("hf_overrides", "{auto_map:{}}", "policy.hf_config_overrides"),
    ],
)
def test_vllm_kwargs_cannot_override_rlpost_engine_arguments(
    name: str, value: str, owner: str, canary: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(canary, capsys, ["plan", f"+policy.generation.vllm_kwargs.{name}={value}"],
                  f"policy.generation.vllm_kwargs.{name}")
    assert owner in err


def test_vllm_kwargs_import_path_strings_pass_the_allow_list(
    canary: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    key = "policy.generation.vllm_kwargs.compilation_config.inductor_passes.p"
    refused(canary, capsys, ["train", f"+policy.generation.vllm_kwargs.compilation_config={{inductor_passes:{{p:{CANARY}.boom}}}}"], key)
    refused(canary, capsys, ["plan", "+policy.generation.vllm_kwargs.logits_processors=[rlpost.runtime.checkpointing.os.system]"],
            "policy.generation.vllm_kwargs.logits_processors[0]")


def test_vllm_kwargs_plain_values_pass() -> None:
    _, m = load_master_config(["+policy.generation.vllm_kwargs.max_num_seqs=8",
                               "+policy.generation.vllm_kwargs.kv_cache_dtype=auto"])
    verify_targets(m)


# ---- the rules themselves --------------------------------------------------------------------------

GOOD = [
    "torch.optim.AdamW",
    "torch.optim.Adafactor",
    "torch.optim.lr_scheduler.ConstantLR",
    "rlpost.losses.clipped_pg.ClippedPGLossFn",
    "rlpost.runtime.build.ConfigError",  # re-exported inside rlpost: allowed
    "rlpost.environments.synthetic.SyntheticEnvironment",
]


@pytest.mark.parametrize("target", GOOD)
def test_good_targets_resolve_and_are_proven_from_source(target: str) -> None:
    assert _proven_in_source(target)
    obj = resolve(target)
    assert obj.__qualname__ == target.rsplit(".", 1)[1]


@pytest.mark.parametrize(
    "target,rule",
    [
        ("torch.optim.lr_scheduler", "names a module"),
        ("rlpost.runtime.build.ConfigError.__init__", "dunder"),
        ("rlpost..build", "dotted Python name"),
        ("rlpost.runtime.build.import", "dotted Python name"),
        ("rlpost.runtime.checkpointing.Path", "defined outside"),
        ("torch.optim.lr_scheduler.Tensor", "defined outside"),
        ("rlpost.nosuch.Thing", "cannot be imported"),
        ("os.system", "allow-list"),
    ],
)
def test_bad_targets_are_refused_by_resolve(target: str, rule: str) -> None:
    assert not _proven_in_source(target) if target.startswith(("rlpost.", "torch.optim.")) else True
    with pytest.raises(ConfigError, match=rule):
        _locate(target, "k")


def test_string_check_imports_nothing() -> None:
    with pytest.raises(ConfigError, match="allow-list"):
        check_target("k", f"{CANARY}.boom")
    assert CANARY not in sys.modules


def test_verifying_every_default_target_imports_nothing_heavy() -> None:
    code = (
        "import sys; from rlpost.runtime.build import verify_targets; from rlpost.config.load import load_master_config;"
        "verify_targets(load_master_config(['policy.scheduler=[{name:torch.optim.lr_scheduler.ConstantLR}]'])[1]);"
        "print(sorted(m for m in ('torch', 'ray', 'vllm', 'megatron', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize(
    "override, key",
    [
        ("+policy.dtensor_cfg.env_vars.PYTHONPATH=/tmp/evil", "policy.dtensor_cfg.env_vars.PYTHONPATH"),
        ("+policy.dtensor_cfg.env_vars.LD_PRELOAD=/tmp/evil.so", "policy.dtensor_cfg.env_vars.LD_PRELOAD"),
        ("+hydra.job.env_set.PYTHONSTARTUP=/tmp/evil.py", "hydra.job.env_set.PYTHONSTARTUP"),
    ],
)
def test_env_vars_that_load_code_are_refused(override: str, key: str, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import rlpost.train
    from rlpost.cli import main

    monkeypatch.setattr(rlpost.train, "main", lambda: pytest.fail("a job started"))
    assert main(["plan" if override.startswith("+policy") else "train", override]) == 2
    err = capsys.readouterr().err
    assert key in err and "load code" in err


def test_megatron_env_vars_are_checked_too(capsys: pytest.CaptureFixture[str]) -> None:
    from rlpost.cli import main

    assert main(["plan", "policy=megatron", "+policy.megatron_cfg.env_vars.PYTHONPATH=/x"]) == 2
    assert "policy.megatron_cfg.env_vars.PYTHONPATH" in capsys.readouterr().err
