"""run_checks: what a run would hit after Ray starts is refused before, naming the key or file:line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlpost.checks import run_checks
from rlpost.command_checks import preflight
from rlpost.config.errors import ConfigError
from rlpost.config.load import load_master_config
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.metric_names import DYNAMIC_SAMPLING_METRICS, LOSS_METRICS, TRAIN_STEP_METRICS
from rlpost.data.datasets import DataError


def master(*overrides: str) -> MasterConfig:
    return load_master_config(list(overrides))[1]


def refused(m: MasterConfig, run_dir: Path | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        run_checks(m, run_dir)
    return e.value


def jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"problem": f"{i}+1", "expected_answer": i + 1}) + "\n" for i in range(n)))
    return path


def math_data(train: Path, *extra: str) -> MasterConfig:
    return master("data=math_jsonl", "env=math", f"data.train_data_path={train}", "grpo.val_period=0",
                  "checkpointing.metric_name=train:reward", *extra)


def model_dir(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 2}))
    (path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")  # a safetensors file of no tensors
    (path / "tokenizer.json").write_text("{}")
    return path


def test_default_config_passes(tmp_path: Path) -> None:
    run_checks(master(), tmp_path)


def test_local_model_dir_passes(tmp_path: Path) -> None:
    run_checks(master("model.tiny=null", f"model.path={model_dir(tmp_path / 'm')}"), tmp_path)


# ---- data ---------------------------------------------------------------------------------------


def test_dataset_smaller_than_one_step(tmp_path: Path) -> None:
    train = jsonl(tmp_path / "t.jsonl", 10)
    err = refused(math_data(train))  # grpo.num_prompts_per_step=16
    assert err.key == "grpo.num_prompts_per_step" and err.value == 16
    assert "one GRPO step takes 16 prompts but the training set has only 10 rows" in err.rule
    assert str(train) in err.rule


def test_dynamic_sampling_batch_counts(tmp_path: Path) -> None:
    train = jsonl(tmp_path / "t.jsonl", 20)
    run_checks(math_data(train), tmp_path)  # 16 <= 20
    err = refused(math_data(train, "grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=1.5"))
    assert err.key == "grpo.num_prompts_per_step"
    assert "takes 24 prompts (16 x grpo.batch_multiplier=1.5, dynamic sampling)" in err.rule and "only 20 rows" in err.rule


def test_synthetic_dataset_smaller_than_one_step() -> None:
    err = refused(master("data.synthetic.num_train=8"))
    assert err.key == "grpo.num_prompts_per_step" and "(data.synthetic.num_train)" in err.rule


def test_bad_train_and_val_rows_are_data_errors(tmp_path: Path) -> None:
    train = jsonl(tmp_path / "t.jsonl", 20)
    with train.open("a") as f:
        f.write('{"problem": "", "expected_answer": "1"}\n')
    with pytest.raises(DataError, match=f"{train}:21: 'problem' is empty"):
        run_checks(math_data(train))
    good, val = jsonl(tmp_path / "good.jsonl", 20), tmp_path / "v.jsonl"
    val.write_text('{"problem": "a", "expected_answer": NaN}\n')
    with pytest.raises(DataError, match=f"{val}:1: 'expected_answer' is nan"):
        run_checks(math_data(good, "grpo.val_period=5", f"data.val_data_paths=[{val}]"))


def test_prompt_file_without_placeholder(tmp_path: Path) -> None:
    tpl = tmp_path / "p.txt"
    tpl.write_text("Solve: {problem}")
    err = refused(master(f"data.prompt_file={tpl}"))
    assert err.key == "data.prompt_file" and "not a valid template (KeyError" in err.rule
    tpl.write_text("Solve it.")
    assert "has no '{}'" in refused(master(f"data.prompt_file={tpl}")).rule
    assert refused(master(f"data.prompt_file={tmp_path / 'nope.txt'}")).rule == "no such file"


# ---- optimizer and scheduler --------------------------------------------------------------------


def test_unknown_optimizer_kwarg_with_hint() -> None:
    err = refused(master("+policy.optimizer.kwargs.weight_decy=0.1"))
    assert err.key == "policy.optimizer.kwargs.weight_decy" and err.value == 0.1
    assert err.rule == "is not an argument of torch.optim.AdamW"
    assert err.hint is not None and err.hint.startswith("did you mean 'weight_decay'?") and "betas" in err.hint


def test_kwargs_of_the_old_optimizer_are_refused_for_a_new_one() -> None:
    err = refused(master("policy.optimizer.name=torch.optim.SGD"))
    assert err.key == "policy.optimizer.kwargs.betas" and "torch.optim.SGD" in err.rule and "momentum" in str(err.hint)


def test_non_importable_optimizer_class() -> None:
    err = refused(master("policy.optimizer.name=torch.optim.AdamWW"))
    assert err.key == "policy.optimizer.name" and "has no attribute 'AdamWW'" in err.rule
    assert err.hint == "did you mean 'torch.optim.AdamW'?"
    err = refused(master("policy.optimizer.name=torch.optim.nosuchmodule.Adam"))
    assert err.key == "policy.optimizer.name" and "cannot be imported" in err.rule


def test_optimizer_outside_the_allow_list_is_not_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    m = master()
    assert m.policy.optimizer is not None
    m.policy.optimizer.name = "os.system"
    monkeypatch.setattr("importlib.import_module", lambda name: pytest.fail(f"imported {name}"))
    err = refused(m)
    assert err.key == "policy.optimizer.name" and "allow-list" in err.rule


def test_optimizer_value_rejected_by_its_constructor() -> None:
    err = refused(master("policy.optimizer.kwargs.betas=[0.9,1.5]"))
    assert err.key == "policy.optimizer.kwargs" and "rejected by torch.optim.AdamW" in err.rule and "beta" in err.rule


def test_the_dry_build_checks_as_torch_does_without_importing_dynamo() -> None:
    """The pre-flight's optimizer is built with torch.optim's undecorated add_param_group: the same checks, and no
    torch._dynamo import (1 s of the driver's start) in a fresh process."""
    import subprocess
    import sys

    from rlpost.models.policy.optim import _without_dynamo_wrapper

    dry = _without_dynamo_wrapper(torch.optim.AdamW)
    assert dry is not torch.optim.AdamW and issubclass(dry, torch.optim.AdamW) and dry.__name__ == "AdamW"
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="more than one parameter group"):  # add_param_group's own check still runs
        dry([{"params": [p]}, {"params": [p]}], lr=1e-3)

    class OwnGroups(torch.optim.SGD):
        def add_param_group(self, param_group: dict[str, Any]) -> None:
            super().add_param_group(param_group)

    assert _without_dynamo_wrapper(OwnGroups) is OwnGroups  # a class's own add_param_group is left alone
    code = ("import sys; from rlpost.config.load import load_master_config; from rlpost.preflight import "
            "check_optimizer; check_optimizer(load_master_config([])[1]); "
            "print('torch._dynamo' in sys.modules, 'torch.optim' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]  # the optimizer was built, dynamo never imported


def test_scheduler_arguments() -> None:
    err = refused(master("policy.scheduler=[{name:torch.optim.lr_scheduler.StepLR}]"))
    assert err.key == "policy.scheduler[0].kwargs.step_size" and "required argument" in err.rule
    err = refused(master("policy.scheduler=[{name:torch.optim.lr_scheduler.LinearLR,kwargs:{total_iter:5}}]"))
    assert err.key == "policy.scheduler[0].kwargs.total_iter" and str(err.hint).startswith("did you mean 'total_iters'?")


# ---- device, metric, directories ----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["dtensor", "megatron"])
def test_bf16_on_cpu(policy: str) -> None:
    err = refused(master(f"policy={policy}", "cluster.device=cpu", "policy.precision=bfloat16"))
    assert err.key == "policy.precision" and err.value == "bfloat16"
    assert "training needs a GPU; this run is on CPU (cluster.device=cpu)" in err.rule


def test_megatron_gpu_only_option_on_cpu() -> None:
    err = refused(master("policy=megatron", "cluster.device=cpu", "policy.megatron_cfg.optimizer.use_distributed_optimizer=true"))
    assert err.key == "policy.megatron_cfg.optimizer.use_distributed_optimizer" and "GPU-only" in err.rule


def test_metric_name_no_step_logs() -> None:
    """A schema rule (beside checkpointing.metric_name): refused when the config is composed, so by `rlpost plan`."""
    def rejected(*overrides: str) -> ConfigError:
        with pytest.raises(ConfigError) as e:
            master(*overrides)
        return e.value

    err = rejected("checkpointing.metric_name=val:acc")
    assert err.key == "checkpointing.metric_name" and "no training step logs this metric" in err.rule
    assert "val:accuracy, val:avg_length, val:reward, train:reward" in err.rule
    assert err.hint == "did you mean 'val:accuracy'?"
    run_checks(master("checkpointing.metric_name=train:kl_penalty"))
    run_checks(master("checkpointing.metric_name=train:nonsense", "checkpointing.enabled=false"))


def test_metric_names_match_what_a_step_logs() -> None:
    """The lists in config.schema.metric_names follow grpo._step_metrics, rollouts.score and the built-in losses."""
    from rlpost.algorithms.grpo import _step_metrics
    from rlpost.algorithms.rollouts import score
    from rlpost.config.schema.loss import ClippedPGLossConfig
    from rlpost.distributed.batched_data_dict import BatchedDataDict
    from rlpost.environments.interfaces import EnvironmentReturn
    from rlpost.losses.clipped_pg import ClippedPGLossFn, NLLLoss
    from rlpost.models.policy.interfaces import TrainResult

    b, s, v = 2, 4, 5
    lp = torch.log_softmax(torch.zeros(b, s), -1)
    data = BatchedDataDict(
        input_ids=torch.zeros(b, s, dtype=torch.long), token_mask=torch.ones(b, s), sample_mask=torch.ones(b),
        advantages=torch.ones(b, s), prev_logprobs=lp, generation_logprobs=lp, reference_policy_logprobs=lp,
    )
    n = torch.tensor(float(b * (s - 1)))
    for loss_fn, target in ((ClippedPGLossFn(ClippedPGLossConfig()), "ClippedPGLossFn"), (NLLLoss(), "NLLLoss")):
        _, loss_metrics = loss_fn(torch.zeros(b, s, v), data, torch.tensor(float(b)), n)
        assert set(loss_metrics) == set(LOSS_METRICS[f"rlpost.losses.clipped_pg.{target}"]), target

    env = SimpleNamespace(step=lambda responses, rows: EnvironmentReturn(rewards=[1.0] * len(rows)), cfg=None)
    rewards, reward_metrics = score(["a", "b"], [{"env_name": "e"}, {"env_name": "e"}], {"e": env})
    batch = SimpleNamespace(
        gen={"generation_lengths": torch.ones(b), "truncated": torch.zeros(b)}, input_lengths=torch.ones(b),
        rows=[{}, {}], rewards=rewards, metrics=reward_metrics, group_ids=torch.zeros(b, dtype=torch.long),
    )
    results = TrainResult(loss=1.0, grad_norm=1.0, lr=1.0, params_finite=True, all_mb_metrics={},
                          metrics={"loss": 1.0})
    sampler = SimpleNamespace(discarded=0, gen_batches=1)
    td = {"token_mask": torch.ones(b, s), "sample_mask": torch.ones(b), "input_lengths": torch.ones(b)}
    logged: list[Any] = list(_step_metrics(batch, td, torch.ones(b), results, sampler))  # type: ignore[arg-type]
    expected = {"train/reward"} | {f"train/{k}" for k in TRAIN_STEP_METRICS + DYNAMIC_SAMPLING_METRICS}
    assert set(logged) | {"train/reward"} == expected


def test_checkpoint_dir_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "ckpt"
    f.write_text("")
    err = refused(master(f"checkpointing.checkpoint_dir={f}"), tmp_path)
    assert err.key == "checkpointing.checkpoint_dir" and err.rule == "exists and is not a directory"


def test_default_dirs_under_the_run_dir(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").write_text("")
    err = refused(master(), tmp_path)
    assert (err.key, err.value) == ("checkpointing.checkpoint_dir", str(tmp_path / "checkpoints"))
    blocker = tmp_path / "logs"
    blocker.write_text("")
    err = refused(master("checkpointing=disabled", f"logger.log_dir={blocker}/run1"), tmp_path)
    assert err.key == "logger.log_dir" and err.rule == f"cannot be created: {blocker} is a file"


def test_a_directory_that_cannot_be_made_is_refused_even_where_os_access_says_yes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    # root passes every os.access check; a read-only file system (or /proc) refuses the directory itself. The model
    # is built already, so model.cache_dir (checked first when it is not) stays out of it.
    import errno
    import tempfile

    def read_only(*args: Any, **kwargs: Any) -> str:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    model = f"model.path={tiny_model_dir}"
    err = refused(master(model, f"checkpointing.checkpoint_dir={tmp_path / 'a' / 'b'}"))
    assert err.key == "checkpointing.checkpoint_dir"
    assert err.rule == f"cannot be created: {tmp_path} is not writable (Read-only file system)"
    err = refused(master(model, f"checkpointing.checkpoint_dir={tmp_path}"))
    assert err.rule == "is not writable (Read-only file system)"


def test_the_writable_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    run_checks(master(f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"), tmp_path / "run")
    assert list(tmp_path.iterdir()) == []


# ---- CPUs of a local Ray cluster ----------------------------------------------------------------


def test_what_the_workers_reserve_must_fit_the_local_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    err = refused(master("cluster.worker_num_cpus=100"))
    assert (err.key, err.value) == ("cluster.worker_num_cpus", 100.0)
    assert "reserves 200 CPUs (colocated training + engine workers: 1 x 200)" in err.rule
    assert "the local Ray cluster has 2 (os.cpu_count()" in err.rule
    err = refused(master("algo=sft", "cluster.gpus_per_node=16", "policy.train_global_batch_size=32",
                         "policy.train_micro_batch_size=2"))
    assert err.key == "cluster.gpus_per_node" and "reserves 4 CPUs (training workers: 16 x 0.25)" in err.rule
    run_checks(master("cluster.worker_num_cpus=100", "cluster.num_cpus=200"))  # Ray advertises what it is told
    run_checks(master("cluster=ray", "cluster.address=127.0.0.1:1", "cluster.gpus_per_node=1",
                            "cluster.worker_num_cpus=100"))  # another machine's cluster: Ray places it


def test_a_local_cluster_is_one_node() -> None:
    err = refused(master("cluster.num_nodes=2"))
    assert err.key == "cluster.num_nodes" and "one node" in err.rule


def test_the_object_store_minimum_is_rays() -> None:
    from ray._private.ray_constants import OBJECT_STORE_MINIMUM_MEMORY_BYTES

    from rlpost.config.schema.cluster import RAY_MIN_OBJECT_STORE_MB

    assert RAY_MIN_OBJECT_STORE_MB * 2**20 == OBJECT_STORE_MINIMUM_MEMORY_BYTES


# ---- model directory ----------------------------------------------------------------------------


def test_garbage_config_json_names_the_file(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m")
    m = master("model.tiny=null", f"model.path={d}")
    (d / "config.json").write_text("{not json")
    err = refused(m)
    assert err.key == "model.path" and f"{d}/config.json: not valid JSON at line 1 column 2" in err.rule
    (d / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    assert f"{d}/config.json: no 'model_type'" in refused(m).rule


@pytest.mark.parametrize(
    ("remove", "rule"),
    [(None, "is an empty directory"), ("config.json", "has no config.json"),
     ("model.safetensors", "has no weights"), ("tokenizer.json", "has no tokenizer files")],
)
def test_incomplete_model_dir(tmp_path: Path, remove: str | None, rule: str) -> None:
    d = model_dir(tmp_path / "m")
    m = master("model.tiny=null", f"model.path={d}")
    for f in list(d.iterdir()) if remove is None else [d / remove]:
        f.unlink()
    err = refused(m)
    assert err.key == "model.path" and err.value == str(d) and err.rule.startswith(rule), str(err)


def test_under_the_tiny_model_what_the_policy_loads_is_still_checked(tmp_path: Path) -> None:
    # model=tiny builds model.path on first use; a policy.model_name or a tokenizer elsewhere is what is loaded
    err = refused(master(f"policy.model_name={tmp_path}"))
    assert (err.key, err.value) == ("policy.model_name", str(tmp_path)) and err.rule.startswith("is an empty directory")
    err = refused(master(f"policy.tokenizer.name={tmp_path / 'absent'}"))
    assert err.key == "policy.tokenizer.name" and err.rule.startswith("no such directory")
    err = refused(master(f"policy.tokenizer.name={model_dir(tmp_path / 'm') / 'tokenizer.json'}"))
    assert err.key == "policy.tokenizer.name" and err.rule.startswith("is not a directory")


@pytest.mark.parametrize(("template", "rule"), [
    ("/nonexistent.jinja", "no such template file"),
    ("templates/chat.j2", "is neither a *.jinja file nor a Jinja template"),
])
@pytest.mark.parametrize("algo", ["grpo", "sft"])
def test_a_chat_template_that_is_no_file_and_no_template_is_refused_under_any_model(
    template: str, rule: str, algo: str
) -> None:
    err = refused(master(f"algo={algo}", f"policy.tokenizer.chat_template={template}"))
    assert err.key == "policy.tokenizer.chat_template" and err.rule.startswith(rule), str(err)


def test_missing_model_dir(tmp_path: Path) -> None:
    err = refused(master("model.tiny=null", f"model.path={tmp_path / 'absent'}"))
    assert err.key == "model.path" and err.rule.startswith("no such directory")
    assert err.hint is None


def test_a_missing_prepared_model_names_the_command_that_builds_it(tmp_path: Path) -> None:
    err = refused(master("model=smollm2_135m", f"model.cache_dir={tmp_path}"))
    assert err.key == "model.path" and err.value == str(tmp_path / "smollm2-135m-instruct")
    assert err.rule.startswith("no such directory") and err.hint == "build it with `make smollm2`"


def test_tp_must_divide_the_vocabulary(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m")
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 2,
                                                "num_key_value_heads": 2, "vocab_size": 385}))
    overrides = ("model.tiny=null", f"model.path={d}", "cluster.gpus_per_node=2",
                 "policy.dtensor_cfg.tensor_parallel_size=2")
    err = refused(master(*overrides), tmp_path)
    assert err.key == "policy.dtensor_cfg.tensor_parallel_size" and "vocab_size (385" in err.rule
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 2,
                                                "num_key_value_heads": 2, "vocab_size": 384}))
    run_checks(master(*overrides), tmp_path)


def _tiny_copy(tiny_model_dir: Path, dest: Path) -> Path:
    shutil.copytree(tiny_model_dir, dest)
    return dest


@pytest.mark.parametrize(
    ("template", "rule"),
    [("missing.jinja", "no such template file"),
     ("{% for m in messages %}{{ m['content'] | no_such_filter }}{% endfor %}", "fails to render a prompt"),
     ("{% for m in messages %}{{ m['content'] }", "fails to render a prompt")],
    ids=["missing_file", "unknown_filter", "syntax"],
)
def test_a_chat_template_that_cannot_render_is_named(tiny_model_dir: Path, tmp_path: Path, template: str,
                                                     rule: str) -> None:
    d = _tiny_copy(tiny_model_dir, tmp_path / "m")
    path = tmp_path / "template.jinja"
    if template != "missing.jinja":
        path.write_text(template)
    err = refused(master("model.tiny=null", f"model.path={d}", f"policy.tokenizer.chat_template={path}"))
    assert err.key == "policy.tokenizer.chat_template" and err.rule.startswith(rule), str(err)


def test_default_template_needs_one_in_the_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = _tiny_copy(tiny_model_dir, tmp_path / "m")
    good = ("model.tiny=null", f"model.path={d}", "policy.tokenizer.chat_template=default")
    run_checks(master(*good), tmp_path / "run")  # the tiny tokenizer ships chat_template.jinja
    (d / "chat_template.jinja").unlink()
    err = refused(master(*good))
    assert err.key == "policy.tokenizer.chat_template" and "has no chat template of its own" in err.rule


def test_an_answer_math_verify_cannot_parse_is_named_by_file_and_line(tmp_path: Path) -> None:
    train = jsonl(tmp_path / "train.jsonl", 40)
    run_checks(math_data(train), tmp_path / "run")
    lines = train.read_text().splitlines()
    lines[6] = json.dumps({"problem": "what?", "expected_answer": "???"})
    train.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(train))}:7: expected_answer='\?\?\?': math-verify cannot parse"):
        run_checks(math_data(train), tmp_path / "run")


# ---- over-length prompts (data.too_long) ------------------------------------------------------------


def _long_rows(path: Path, n: int, long_lines: tuple[int, ...]) -> Path:
    long = "What is " + "1 + " * 40 + "1?"
    path.write_text("".join(json.dumps({"problem": long if i + 1 in long_lines else f"{i}+1", "expected_answer": "1"})
                            + "\n" for i in range(n)))
    return path


def test_data_too_long_is_applied_by_the_preflight_when_the_tokenizer_is_on_disk(tiny_model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    train = _long_rows(tmp_path / "train.jsonl", 20, (3, 7, 8, 9, 10))
    model = ("model=local", f"model.path={tiny_model_dir}", "data.max_input_seq_length=32")
    run_checks(math_data(train, *model), tmp_path / "run")  # truncate (the default): counted at setup
    with pytest.raises(DataError) as e:
        run_checks(math_data(train, *model, "data.too_long=error"), tmp_path / "run")
    assert str(e.value).startswith(f"{train}:3: the prompt is longer than data.max_input_seq_length=32 tokens")
    assert "(over it: 5 of 20 train prompts; data.too_long=error)" in str(e.value)
    err = refused(math_data(train, *model, "data.too_long=drop"), tmp_path / "run")
    assert err.key == "grpo.num_prompts_per_step"
    assert "only 15 rows left after data.too_long=drop leaves out 5 over-length prompts" in err.rule
    run_checks(math_data(train, *model, "data.too_long=drop", "grpo.num_prompts_per_step=8",
                               "policy.train_global_batch_size=128"), tmp_path / "run")


def test_setup_loads_the_prompts_as_data_too_long_says_with_one_warning(tiny_model_dir: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from rlpost.algorithms.grpo_setup import load_prompts
    from rlpost.data.prompts import PromptProcessor, load_tokenizer

    train = _long_rows(tmp_path / "train.jsonl", 20, (3, 7))
    for policy, kept in (("truncate", 20), ("drop", 18)):
        m = math_data(train, "model=local", f"model.path={tiny_model_dir}", "data.max_input_seq_length=32",
                      f"data.too_long={policy}")
        proc = PromptProcessor(m.data, load_tokenizer(m.policy.tokenizer))
        rows, val = load_prompts(m, proc, 16)
        assert (len(rows), val) == (kept, [])
        what = "each is cut to it and masked out of the loss" if policy == "truncate" else "they are left out"
        warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
        assert warnings == [f"rlpost: warning: 2 training and 0 validation prompts are longer than "
                            f"data.max_input_seq_length=32 tokens; {what} (data.too_long={policy})"]


@pytest.mark.parametrize(("override", "key", "rule"), [
    ("cluster.object_store_memory_mb=99999999", "cluster.object_store_memory_mb", "at most half of it"),
    ("model.cache_dir=/proc/cache", "model.cache_dir", "cannot be created"),
])
def test_what_ray_or_the_model_build_would_fail_on_is_refused_first(override: str, key: str, rule: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Caught before start-up, not by Ray's start (an object store larger than the machine) or by the tiny model's
    build (a cache directory that cannot be made)."""
    assert preflight([override], False) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlpost: config error: {key}=") and rule in err, err


def test_an_eval_report_that_cannot_be_written_is_refused_before_scoring(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from rlpost.checks import EVAL

    for value, rule in (("/proc/eval.json", "its directory is not writable"), (str(tmp_path), "is a directory")):
        assert preflight([f"eval.output={value}"], False, command=EVAL) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"rlpost: config error: eval.output='{value}'") and rule in err, err
    assert preflight([f"eval.output={tmp_path / 'new' / 'eval.json'}"], False, command=EVAL) == 0


def test_a_critic_model_that_is_not_there_is_named_as_the_critics(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for value, rule in (("/nonexistent", "no such directory"), (str(tmp_path), "holds no config.json")):
        assert preflight(["algo=ppo", f"critic.model_name={value}"], False) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"rlpost: config error: critic.model_name='{value}'") and rule in err, err


def test_weights_that_are_no_safetensors_file_are_refused_naming_the_file(tiny_model_dir: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Random bytes as model.safetensors ended as a MemoryError at start-up: the header is read first."""
    from rlpost.preflight import safetensors_fault

    assert safetensors_fault(tiny_model_dir / "model.safetensors") is None
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    assert preflight(["model=local", f"model.path={model}"], False) == 2
    err = capsys.readouterr().err
    assert "model.safetensors is not a safetensors file: its header claims" in err, err
    (model / "model.safetensors").write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00[1] ")
    assert safetensors_fault(model / "model.safetensors") == "its header is not a JSON object"


def test_a_critic_of_another_tokenizer_and_a_top_k_past_the_teachers_vocabulary_are_refused(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "critic"
    shutil.copytree(tiny_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    first = next(iter(tok["model"]["vocab"]))
    tok["model"]["vocab"]["renamed_" + first] = tok["model"]["vocab"].pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    local = ["model=local", f"model.path={tiny_model_dir}"]
    assert preflight([*local, "algo=ppo", f"critic.model_name={tiny_model_dir}"], False) == 0
    assert preflight([*local, "algo=ppo", f"critic.model_name={other}"], False) == 2
    assert "has another tokenizer (384 tokens, the policy's 384, 2 differing)" in capsys.readouterr().err
    teacher = ["algo=distillation", f"distillation.teacher.model_path={tiny_model_dir}"]
    assert preflight([*local, *teacher, "distillation.topk_logits_k=385"], False) == 2
    assert "distillation.topk_logits_k=385: is more than the teacher's vocabulary" in capsys.readouterr().err

