"""The pre-flight's data checks: prompt and chat-template files, and every training / validation row read once
(a bad row is named by file and line) before anything starts. `rlpost.checks.CHECKS` runs them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlpost.config.errors import ConfigError
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.supervised_master import SupervisedMasterConfig
from rlpost.data.datasets import DataError, load_rows, not_a_file
from rlpost.data.rows import PromptRow
from rlpost.runtime.build import resolve

if TYPE_CHECKING:
    from rlpost.data.prompts import PromptProcessor


def check_prompt_files(master: MasterConfig) -> None:
    """data.prompt_file is a readable template with one '{}'; data.system_prompt_file exists."""
    d = master.data
    for key, value in (("data.prompt_file", d.prompt_file), ("data.system_prompt_file", d.system_prompt_file)):
        if value and (why := not_a_file(value)) is not None:
            raise ConfigError(key, value, why)
    if d.prompt_file:
        try:
            template = Path(d.prompt_file).read_text(encoding="utf-8")
            filled = template.format("\x00")
        except (UnicodeDecodeError, KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                "data.prompt_file", d.prompt_file,
                f"not a valid template ({type(exc).__name__}: {exc})",
                "one '{}' marks the problem; write other braces as '{{' and '}}'",
            ) from None
        if "\x00" not in filled:
            raise ConfigError("data.prompt_file", d.prompt_file, "has no '{}' where the problem goes")


def prompts_per_step(master: MasterConfig) -> int:
    """Rows one GRPO step takes from the dataloader (grpo_setup's batch size)."""
    g = master.grpo
    return int(g.num_prompts_per_step * (g.batch_multiplier if g.use_dynamic_sampling else 1))


def check_answers(master: MasterConfig, rows: list[PromptRow]) -> None:
    """Every expected answer is one the data's environment can match; the first that is not is named by
    file and line."""
    env_cls = resolve(master.env[master.data.env_name]._target_, key=f"env.{master.data.env_name}._target_")
    for row in rows:
        why = env_cls.answer_problem(row["expected_answer"])
        if why is not None:
            raise DataError(f"{row['source']}: {master.data.output_key}={row['expected_answer']!r}: {why}")


def check_chat_template_value(master: MasterConfig | SupervisedMasterConfig) -> None:
    """policy.tokenizer.chat_template names an existing *.jinja file, or is 'default', null or a Jinja template."""
    key, ct = "policy.tokenizer.chat_template", master.policy.tokenizer.chat_template
    if ct is None or ct == "default":
        return
    if ct.endswith(".jinja"):
        if not Path(ct).is_file():
            raise ConfigError(key, ct, "no such template file" if not Path(ct).exists() else "is not a file")
    elif "{{" not in ct and "{%" not in ct:
        raise ConfigError(key, ct, "is neither a *.jinja file nor a Jinja template (no {{ }} or {% %}): every "
                          "prompt would be this text", "'default' (the tokenizer's own), null (raw prompts), a "
                          "*.jinja path, or a template")


def check_chat_template(master: MasterConfig) -> None:
    """The chat template renders a prompt, as the run will: a missing *.jinja file, a tokenizer without a
    template of its own under 'default', and a template that fails to render are named before anything starts.
    The rendering is skipped for the tiny model's own tokenizer (built on first use)."""
    tok_cfg = master.policy.tokenizer
    key, ct = "policy.tokenizer.chat_template", tok_cfg.chat_template
    check_chat_template_value(master)
    if ct is None or (master.model.tiny is not None and tok_cfg.name == master.model.path):
        return
    from rlpost.data.prompts import PromptProcessor, load_tokenizer, prompt_room

    tokenizer = load_tokenizer(tok_cfg, master.policy.trust_remote_code)
    if ct == "default" and not tokenizer.chat_template:
        raise ConfigError(key, ct, f"the tokenizer at {tok_cfg.name} has no chat template of its own",
                          "use policy.tokenizer.chat_template=null for raw prompts, or give a template")
    processor = PromptProcessor(master.data, tokenizer, tok_cfg.chat_template_kwargs, room=prompt_room(master))
    try:
        processor({"problem": "1 + 1", "expected_answer": "2"})
    except Exception as exc:  # noqa: BLE001 - jinja's and transformers' errors, named with the key
        shown = ct if len(ct) <= 60 else ct[:57] + "..."
        raise ConfigError(key, shown, f"fails to render a prompt ({type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})") from None


def check_data(master: MasterConfig) -> None:
    """Read the train (and validation) files once: bad rows raise DataError; too few rows for one step
    raise ConfigError naming grpo.num_prompts_per_step. Under data.too_long=drop|error, with the tokenizer on disk,
    the prompts' lengths too: 'error' names the first over-length row, 'drop' counts what is left."""
    d, g = master.data, master.grpo
    need = prompts_per_step(master)
    with_val = g.val_period > 0 or g.val_at_start
    splits: dict[str, list[PromptRow]] = {}
    if d.dataset_name == "synthetic":
        have, source = d.synthetic.num_train, "data.synthetic.num_train"
    else:
        splits["train"] = load_rows(d, "train", with_source=True)
        have, source = len(splits["train"]), f"data.train_data_path={d.train_data_path}"
        if with_val:
            splits["val"] = load_rows(d, "val", with_source=True)
        check_answers(master, [r for rows in splits.values() for r in rows])
    dropped = 0
    processor = prompt_processor(master) if d.too_long != "truncate" else None
    if processor is not None:
        from rlpost.data.prompts import apply_too_long, row_source

        for split in ("train", "val") if with_val else ("train",):
            rows = splits[split] if split in splits else load_rows(d, split)  # synthetic: generated here
            where = [str(r["source"]) if "source" in r else row_source(d, split, i) for i, r in enumerate(rows)]
            kept, over = apply_too_long(rows, processor, split, where.__getitem__)
            if split == "train":
                have, dropped = len(kept), over
    if have < need:
        how = ""
        if need != g.num_prompts_per_step:
            how = f" ({g.num_prompts_per_step} x grpo.batch_multiplier={g.batch_multiplier}, dynamic sampling)"
        left = f" left after data.too_long=drop leaves out {dropped} over-length prompts" if dropped else ""
        raise ConfigError(
            "grpo.num_prompts_per_step",
            g.num_prompts_per_step,
            f"one GRPO step takes {need} prompts{how} but the training set has only {have} rows{left} ({source})",
            "lower grpo.num_prompts_per_step or use a larger training set",
        )


def prompt_processor(master: MasterConfig) -> PromptProcessor | None:
    """The run's PromptProcessor, when its tokenizer is on disk now (a tiny model's is built on first use); None
    otherwise (the setup then applies data.too_long, before Ray starts)."""
    from rlpost.config.schema.model import tiny_build_matches
    from rlpost.data.prompts import PromptProcessor, load_tokenizer, prompt_room

    tok, m = master.policy.tokenizer, master.model
    if m.tiny is not None and tok.name == m.path and not tiny_build_matches(m.path, m.tiny):
        return None
    return PromptProcessor(master.data, load_tokenizer(tok, master.policy.trust_remote_code), tok.chat_template_kwargs,
                           room=prompt_room(master))


def check_supervised_data(master: SupervisedMasterConfig) -> None:
    """SFT / DPO / RM rows: every file read and every row checked (DataError naming file and line); the
    tokenization (and its skip-and-count rule) runs at setup, where the tokenizer is loaded."""
    from rlpost.data.supervised_rows import load_supervised_rows

    d = master.rows
    if d.dataset_name == "synthetic":
        return
    rows = load_supervised_rows(d, "train")
    need = master.policy.train_global_batch_size // (2 if master.pairs else 1)
    if len(rows) < need:
        raise ConfigError("policy.train_global_batch_size", master.policy.train_global_batch_size,
                          f"one step takes {need} rows but data.train_data_path={d.train_data_path} has {len(rows)}")
    if master.loop.val_period > 0 or master.loop.val_at_start:
        load_supervised_rows(d, "val")
