"""Every command the documentation shows runs: the `rlpost ...` lines of the ```bash blocks of README.md and
docs/*.md, the `rlpost ...` commands quoted in their prose, and the header line (`# rlpost ...`) that opens every
option of conf/ (plus the commands quoted in the YAML comments).

Each is checked in-process the way `rlpost plan` checks it (`rlpost train X` -> `rlpost plan X`): the whole config
is composed and validated and the plan printed, without Ray or a model. A `-m` sweep plans its first job, `--cfg job`
and `--help` plan their overrides. `rlpost eval` commands plan too (`eval.*` is part of GRPO's config) and must
compose GRPO's config, which `rlpost eval` requires. The commands that name data files (`/path/train.jsonl`
placeholders) also pass `rlpost train`'s pre-flight, which reads the data, with small files of the right kind in
their place.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlpost import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONF = ROOT / "conf"

NOT_COMMANDS = {"rlpost train [overrides]", "rlpost plan [overrides]", "rlpost eval [overrides]", "rlpost launch",
                "rlpost report"}
"""Quoted in prose as the syntax of a command, not as a command (as is any line ending in `[overrides]`)."""


@dataclass(frozen=True)
class Command:
    where: str
    """file:line of the command."""
    text: str
    """The command as written (continuations joined, trailing comment dropped)."""


def _is_syntax(text: str) -> bool:
    """The syntax of a command, or a command named in prose (`rlpost launch slurm`: no run after it)."""
    return text in NOT_COMMANDS or text.endswith("[overrides]") or (text.startswith("rlpost launch")
                                                                    and " -- " not in text)


def _command(where: str, text: str) -> Command:
    text = re.sub(r"(^|\s)#.*$", "", text).strip()  # a trailing `# comment`
    text = text.split(" | ", 1)[0]  # what the output is piped into
    return Command(where, " ".join(text.split()))


def _shell_vars(lines: list[str]) -> dict[str, str]:
    """NAME="..." assignments of a bash block (docs/benchmarks.md's override sets), expanded in order."""
    out: dict[str, str] = {}
    for line in lines:
        m = re.match(r'([A-Z_]+)="([^"]*)"', line)
        if m:
            out[m.group(1)] = _expand(m.group(2), out)
    return out


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$([A-Z_]+)", lambda m: env[m.group(1)], text)


def _bash_blocks(path: Path) -> list[tuple[int, list[str]]]:
    """(first line number, lines with `\\` continuations joined) of each ```bash block."""
    blocks: list[tuple[int, list[str]]] = []
    block: list[str] | None = None
    pending = ""
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            if block is None and line.strip() == "```bash":
                block = []
                blocks.append((i + 1, block))
            else:
                block = None
            continue
        if block is None:
            continue
        joined = pending + line.strip()
        if joined.endswith("\\"):
            pending = joined[:-1] + " "
            block.append("")  # keep the line numbers
            continue
        pending = ""
        block.append(joined)
    return blocks


def markdown_commands(path: Path) -> list[Command]:
    rel = path.relative_to(ROOT)
    blocks = _bash_blocks(path)
    env = _shell_vars([line for _, b in blocks for line in b])
    out = []
    for start, block in blocks:
        for offset, line in enumerate(block):
            m = re.match(r"(?:make \S+ && )?(rlpost\b.*)", line)
            if m and not _is_syntax(_command("", m.group(1)).text):
                out.append(_command(f"{rel}:{start + offset}", m.group(1)))
    in_block = False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            in_block = not in_block
        if not in_block:
            out += [_command(f"{rel}:{i}", _expand(q, env)) for q in re.findall(r"`(rlpost [^`]*)`", line)
                    if not _is_syntax(q)]
    return out


def yaml_commands(path: Path) -> list[Command]:
    """The `# rlpost ...` header (its `(or: ...)` alternative a command of its own) and the quoted commands of
    every comment."""
    rel = path.relative_to(ROOT)
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"# (?:make \S+ && )?(rlpost .*)", line)
        if m:
            head, _, alt = m.group(1).partition("(or: ")
            out.append(_command(f"{rel}:{i}", head))
            if alt:
                out.append(_command(f"{rel}:{i}", "rlpost train " + alt.rstrip().removesuffix(")")))
        if "#" in line:
            comment = line[line.index("#"):]
            out += [_command(f"{rel}:{i}", q) for q in re.findall(r"`(rlpost [^`]*)`", comment)]
    return out


def documented_commands() -> list[Command]:
    return [c for p in DOCS for c in markdown_commands(p)] + [
        c for p in sorted(CONF.rglob("*.yaml")) for c in yaml_commands(p)]


COMMANDS = documented_commands()
UNIQUE: dict[str, list[str]] = {}
for _c in COMMANDS:
    UNIQUE.setdefault(_c.text, []).append(_c.where)


def plan_overrides(argv: list[str]) -> list[str] | None:
    """The overrides `rlpost plan` checks for a command; None for a command that composes no config."""
    assert argv[0] == "rlpost", argv
    if len(argv) == 1 or argv[1].startswith("-"):
        return None  # rlpost --version / --help
    sub, rest = argv[1], argv[2:]
    assert sub in ("train", "plan", "eval", "launch", "report"), f"unknown subcommand {sub!r}"
    if sub in ("launch", "report"):
        return None  # checked by its own --dry-run / its argument parser (test_a_documented_command_plans)
    if sub != "train":
        return rest
    flags, overrides, multirun = cli.split_hydra_argv(rest)
    if multirun:
        jobs = cli._expand_sweeps(overrides)
        assert len(jobs) > 1, f"a -m sweep of one job: {argv}"
        return jobs[0]
    return overrides


def test_the_documentation_is_found() -> None:
    texts = {c.text for c in COMMANDS}
    assert len(COMMANDS) > 80, len(COMMANDS)
    # one of each kind: a bash block, a continued line, a header, its alternative, a quoted one, a $VAR one
    assert "rlpost train algo=dpo data=preference_jsonl data.train_data_path=pairs.jsonl " \
           "loss_fn.reference_policy_kl_penalty=0.1" in texts
    assert any(t.startswith("rlpost train grpo.async_grpo.enabled=true") and t.endswith("gpus_per_node=1")
               for t in texts)
    assert "rlpost train data=calc env=calculator grpo.max_rollout_turns=3" in texts
    assert "rlpost train algo=sft data=sft_jsonl data.train_data_path=/path/train.jsonl" in texts
    assert any(t.startswith("rlpost train grpo.async_grpo.enabled=true") and "$" not in t and
               "in_flight_weight_updates=true" in t for t in texts)


@pytest.mark.parametrize("path", sorted(CONF.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONF)))
def test_every_option_opens_with_its_command(path: Path) -> None:
    lines = [line for line in path.read_text().splitlines() if not line.startswith("# @package")]
    assert re.match(r"# (make \S+ && )?rlpost ", lines[0]), f"{path}: the first comment line is not a command"


@pytest.mark.parametrize("text", sorted(UNIQUE), ids=lambda t: t[:90])
def test_a_documented_command_plans(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # the run directory checks look at ./outputs
    argv = shlex.split(text)
    overrides = plan_overrides(argv)
    if argv[1:2] == ["launch"] and argv[2] in ("slurm", "ray"):  # the job's pre-flight; nothing submitted
        argv = [*argv[:3], "--dry-run", *argv[3:]]
    if argv[1:2] == ["report"]:  # its directories are a run's: the options parse, the directories are placeholders
        from rlpost.report.command import parse_args

        assert parse_args(argv[2:]).paths, text
        return
    if overrides is None:
        rc = cli.main(argv[1:])
        assert rc == 0, f"{text}\n  (at {', '.join(UNIQUE[text])})\n{capsys.readouterr().err}"
        return
    rc = cli.main(["plan", *overrides])
    err = capsys.readouterr().err
    assert rc == 0, f"{text}\n  (at {', '.join(UNIQUE[text])})\n{err}"
    if argv[1] == "eval":
        from rlpost.config.load import load_master_config
        from rlpost.config.schema.master import MasterConfig

        assert isinstance(load_master_config(overrides)[1], MasterConfig), "rlpost eval scores with GRPO's config"


# ---- commands that name data files: train's pre-flight, which reads them ---------------------------------------

ROWS = {
    "math_jsonl": lambda i: {"problem": f"What is {i} + 1?", "expected_answer": str(i + 1)},
    "sft_jsonl": lambda i: {"prompt": f"Copy the digit {i % 10}", "response": str(i % 10)},
    "preference_jsonl": lambda i: {"prompt": f"Copy the digit {i % 10}", "chosen": str(i % 10),
                                   "rejected": str((i + 1) % 10)},
}
NEEDS_A_REAL_MODEL = {
    "model=local": "model.path names a local HF directory of the user's",
    "experiment=qwen2_5_1_5b_math": "a local Qwen2.5-1.5B checkpoint",
    "model=smollm2_135m": "the SmolLM2 directory `make smollm2` builds",
}
"""Commands that also need a model directory that a test cannot assume: their pre-flight is skipped when it is
absent (their config is still planned above)."""

WITH_DATA_FILES = sorted(t for t in UNIQUE if "data.train_data_path=" in t)


def _with_files(overrides: list[str], tmp: Path) -> list[str]:
    """The overrides with every data path replaced by a small file of the data option's rows."""
    data = next(o.split("=", 1)[1] for o in overrides if o.startswith(("data=", "experiment=")))
    kind = {"qwen2_5_1_5b_math": "math_jsonl"}.get(data, data)
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key in ("data.train_data_path", "data.val_data_paths"):
            split = "train" if key == "data.train_data_path" else "val"
            path = tmp / f"{split}.jsonl"
            path.write_text("".join(json.dumps(ROWS[kind](i)) + "\n" for i in range(64)))
            value = str(path) if split == "train" else f"[{path}]"
        out.append(f"{key}={value}")
    return out


@pytest.mark.parametrize("text", WITH_DATA_FILES, ids=lambda t: t[:90])
def test_a_documented_command_with_data_files_passes_the_preflight(text: str, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from rlpost.config.load import load_master_config

    monkeypatch.chdir(tmp_path)
    overrides = _with_files(plan_overrides(shlex.split(text)) or [], tmp_path)
    model = load_master_config(overrides)[1].model
    if model.tiny is None and not Path(model.path).is_dir():
        reason = next(r for k, r in NEEDS_A_REAL_MODEL.items() if k in text)
        pytest.skip(f"needs {reason}: {model.path} is not here")
    rc = cli.preflight(overrides, False)
    assert rc == 0, f"{text}\n  (at {', '.join(UNIQUE[text])})\n{capsys.readouterr().err}"


def test_supervised_validation_without_validation_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """SFT / DPO on a training file alone: validation (on by default) goes off with one warning, and checkpoints
    are ranked by train:loss; validation asked for on the command line is refused, naming data.val_data_paths."""
    monkeypatch.chdir(tmp_path)
    base = _with_files(["algo=dpo", "data=preference_jsonl", "data.train_data_path=x"], tmp_path)
    assert cli.main(["plan", *base]) == 0
    out = capsys.readouterr()
    assert out.err.count("warning: no validation rows") == 1 and "dpo validation is off" in out.err
    assert "no validation during training" in out.out
    from rlpost.config.load import load_master_config

    _, m = load_master_config(base)
    assert (m.loop.val_period, m.loop.val_at_start, m.checkpointing.metric_name) == (0, False, "train:loss")
    assert cli.preflight(base, False) == 0
    for asked in ("dpo.val_period=5", "dpo.val_at_start=true", "checkpointing.metric_name=val:accuracy"):
        assert cli.main(["plan", *base, asked]) == 2
        assert "data.val_data_paths=[]" in capsys.readouterr().err
    # an explicit 0 or a train: metric asks for no validation: planned, with the warning only for what was on
    assert cli.main(["plan", *base, "dpo.val_period=0", "dpo.val_at_start=false",
                     "checkpointing.metric_name=train:loss"]) == 0
    assert "warning" not in capsys.readouterr().err
