"""Unknown config keys are refused (exit 2, the key named, a 'did you mean' hint) whichever way they
come: `+key=...` on the command line, an experiment file, or a YAML option. Only the places meant to
be open (Dict[str, Any] fields such as optimizer kwargs) accept new keys."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rlpost.cli import main
from rlpost.config.errors import ConfigError
from rlpost.config.load import check_unknown_keys, compose_config, conf_dir, load_master_config


@pytest.fixture
def no_train(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`rlpost train` must stop at pre-flight: a regression must not start a job."""
    import rlpost.train

    def _boom() -> None:
        raise AssertionError("rlpost train got past pre-flight")

    monkeypatch.setattr(rlpost.train, "main", _boom)
    monkeypatch.chdir(tmp_path)


# (overrides, key named in the message, hint or rule words that must appear)
PLUS_KEYS = [
    (["+policy.nonexistent_key=1"], "policy.nonexistent_key", "unknown config key"),
    (["+grpo.max_num_stepz=3"], "grpo.max_num_stepz", "did you mean 'max_num_steps'?"),
    (["+loss_fn.ratio_clip=0.2"], "loss_fn.ratio_clip", "unknown config key"),
    (["loss=nll", "+loss_fn.ratio_clip_min=0.1"], "loss_fn.ratio_clip_min", "unknown config key"),
    (["generation=hf", "+policy.generation.vllm_cfg.x=1"], "policy.generation.vllm_cfg", "unknown config key"),
    (
        ["+policy.generation.vllm_cfg.tensor_paralel_size=2"],
        "policy.generation.vllm_cfg.tensor_paralel_size",
        "did you mean 'tensor_parallel_size'?",
    ),
    (["+policy.dtensor_cfg.cpu_ofload=true"], "policy.dtensor_cfg.cpu_ofload", "did you mean 'cpu_offload'?"),
    (["+env.synthetic.format_rewrd=0.2"], "env.synthetic.format_rewrd", "did you mean 'format_reward'?"),
    (["+foo=1"], "foo", "unknown config key"),
    (["+policy.sequence_packing.enabld=true"], "policy.sequence_packing.enabld", "did you mean 'enabled'?"),
]


@pytest.mark.parametrize("overrides,key,words", PLUS_KEYS, ids=[" ".join(o) for o, _, _ in PLUS_KEYS])
def test_plan_refuses_added_unknown_key(overrides, key, words, capsys) -> None:
    assert main(["plan", *overrides]) == 2
    err = capsys.readouterr().err
    assert key in err, err
    assert words in err, err
    assert "Traceback" not in err


def test_train_refuses_added_unknown_key(no_train, capsys) -> None:
    assert main(["train", "+policy.nonexistent_key=1"]) == 2
    assert "policy.nonexistent_key" in capsys.readouterr().err


def test_train_refuses_misspelled_optimizer_kwarg(no_train, capsys) -> None:
    # kwargs is an open mapping; pre-flight checks it against the optimizer's signature.
    assert main(["train", "+policy.optimizer.kwargs.learnig_rate=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "policy.optimizer.kwargs.learnig_rate" in err
    assert "lr" in err


def test_misspelled_existing_kwarg_without_plus_has_hint(capsys) -> None:
    assert main(["plan", "policy.optimizer.kwargs.weight_decy=0.1"]) == 2
    err = capsys.readouterr().err
    assert "policy.optimizer.kwargs.weight_decy" in err
    assert "did you mean 'weight_decay'?" in err


def test_error_carries_value_and_hint() -> None:
    with pytest.raises(ConfigError) as ei:
        load_master_config(["+grpo.max_num_stepz=3"])
    assert ei.value.key == "grpo.max_num_stepz"
    assert ei.value.value == 3
    assert ei.value.rule == "unknown config key"
    assert ei.value.hint == "did you mean 'max_num_steps'?"


@pytest.mark.parametrize(
    "overrides",
    [
        ["+policy.optimizer.kwargs.amsgrad=true"],
        ["+policy.generation.vllm_kwargs.swap_space=1"],
        ["+policy.dtensor_cfg.env_vars.FOO=bar"],
        ["+policy.hf_config_overrides.rope_theta=10000.0"],
        ["policy=megatron", "+policy.megatron_cfg.extra.foo=1", "+policy.megatron_cfg.env_vars.FOO=bar"],
    ],
    ids=lambda o: " ".join(o),
)
def test_open_places_stay_open(overrides) -> None:
    load_master_config(overrides)


def test_unknown_key_inside_open_mapping_entry_is_checked() -> None:
    # env is Dict[str, EnvConfig]: the mapping is open, each entry is typed.
    cfg = compose_config([])
    from omegaconf import OmegaConf, open_dict

    with open_dict(cfg):
        OmegaConf.update(cfg, "env.synthetic.timeout_z", 3.0, force_add=True)
    with pytest.raises(ConfigError) as ei:
        check_unknown_keys(cfg)
    assert ei.value.key == "env.synthetic.timeout_z"
    assert ei.value.hint == "did you mean 'timeout_s'?"


@pytest.fixture
def conf_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    monkeypatch.setenv("RLPOST_CONF_DIR", str(conf))
    return conf


def test_open_places_in_experiment_file_stay_open(conf_copy: Path) -> None:
    (conf_copy / "experiment" / "open.yaml").write_text(
        "# @package _global_\npolicy:\n  tokenizer:\n    chat_template_kwargs:\n      enable_thinking: false\n"
        "  optimizer:\n    kwargs:\n      amsgrad: true\n  dtensor_cfg:\n    env_vars:\n      FOO: bar\n"
    )
    _, master = load_master_config(["experiment=open"])
    assert master.policy.tokenizer.chat_template_kwargs == {"enable_thinking": False}
    assert master.policy.optimizer.kwargs["amsgrad"] is True


def test_experiment_file_with_typo_is_refused(conf_copy: Path, capsys) -> None:
    (conf_copy / "experiment" / "typo.yaml").write_text("# @package _global_\ngrpo:\n  max_num_stepz: 3\n")
    assert main(["plan", "experiment=typo"]) == 2
    err = capsys.readouterr().err
    assert "grpo.max_num_stepz" in err
    assert "did you mean 'max_num_steps'?" in err


def test_experiment_file_with_nested_typo_is_refused(conf_copy: Path, capsys) -> None:
    (conf_copy / "experiment" / "typo.yaml").write_text(
        "# @package _global_\npolicy:\n  dtensor_cfg:\n    activation_checkpointng: true\n"
    )
    assert main(["plan", "experiment=typo"]) == 2
    err = capsys.readouterr().err
    assert "policy.dtensor_cfg.activation_checkpointng" in err
    assert "did you mean 'activation_checkpointing'?" in err


def test_loss_option_with_typo_is_refused(conf_copy: Path, capsys) -> None:
    (conf_copy / "loss" / "typo.yaml").write_text(
        "# @package loss_fn\ndefaults:\n  - /schema/loss/clipped_pg@_here_\n  - _self_\nratio_clip_mn: 0.2\n"
    )
    assert main(["plan", "loss=typo"]) == 2
    err = capsys.readouterr().err
    assert "loss_fn.ratio_clip_mn" in err
    assert "did you mean 'ratio_clip_min'?" in err


def test_generation_option_checked_against_its_own_schema(conf_copy: Path, capsys) -> None:
    (conf_copy / "generation" / "typo.yaml").write_text(
        "# @package policy.generation\ndefaults:\n  - /schema/generation/hf@_here_\n  - _self_\n"
        "backend: hf\n_target_: rlpost.models.generation.hf_generation.HFGeneration\nvllm_cfg:\n  async_engine: true\n"
    )
    assert main(["plan", "generation=typo"]) == 2
    err = capsys.readouterr().err
    assert "policy.generation.vllm_cfg" in err
    assert "unknown config key" in err


def test_policy_option_with_typo_is_refused(conf_copy: Path, capsys) -> None:
    text = (conf_copy / "policy" / "dtensor.yaml").read_text()
    (conf_copy / "policy" / "typo.yaml").write_text(text.replace("cpu_offload:", "cpu_ofload:"))
    assert main(["plan", "policy=typo"]) == 2
    err = capsys.readouterr().err
    assert "policy.dtensor_cfg.cpu_ofload" in err
    assert "did you mean 'cpu_offload'?" in err


def test_every_bundled_option_has_only_known_keys() -> None:
    from rlpost.config.load import group_options, groups

    for group in groups():
        for opt in group_options(group):
            check_unknown_keys(compose_config([f"{group}={opt}"]))
