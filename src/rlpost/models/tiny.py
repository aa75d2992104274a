"""A deterministic tiny model + tokenizer, built locally (no downloads) and cached on disk.

- Tokenizer: byte-level BPE trained with `tokenizers` on a small in-code corpus, with Qwen2's
  pre-tokenizer split regex so `AutoTokenizer` (Qwen2Tokenizer) and PreTrainedTokenizerFast agree
  (a char-level WordLevel tokenizer gets silently rewritten by Qwen2Tokenizer and loses spaces).
- Model: random-init, of the family `architecture` names (Qwen2 by default), with head_dim >= 32 so vLLM-CPU serves it; the embedding has
  `vocab_size` rows padded to a multiple of 64 (the BPE's merges run out on its small corpus, so a large vocabulary,
  Qwen2.5's 151,936, is mostly rows no token reaches, as a real model's padded vocabulary is).
- Cache: built in a temporary directory and renamed into place, so concurrent builds are safe.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from rlpost.config.schema.model import TINY_MARKER, TinyModelConfig, tiny_build_matches, tiny_spec

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    """Deterministic training text for the BPE: the synthetic tasks' phrasing plus plain words."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines = []
    for i, c in enumerate(letters):
        nxt = letters[(i + 1) % 26]
        lines.append(f"Next letter after {c}? {nxt}")
        lines.append(f"What letter comes after {c}? The answer is {nxt}.")
    for d in range(10):
        lines.append(f"Copy the digit {d}: {d}")
        for e in range(10):
            lines.append(f"What is {d} + {e} mod 10? {(d + e) % 10}")
    lines += [
        "The quick brown fox jumps over the lazy dog.",
        "Solve the problem and put the final answer in \\boxed{}.",
        "user assistant system question answer problem solution letter digit number",
        "Hello, world! 123 456 7890 + - * / = ( ) [ ] { }",
    ]
    return lines * 4


def build_tokenizer(vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


class TinyTargetError(ValueError):
    """The tiny builder was pointed at a directory that is not its own; nothing was written."""


def _check_replaceable(out: Path) -> None:
    """Refuse to replace anything but an earlier tiny build or an empty directory."""
    if not out.is_dir():
        raise TinyTargetError(f"{out}: exists and is not a directory; the tiny builder will not replace it")
    if (out / TINY_MARKER).is_file() or not any(out.iterdir()):
        return
    raise TinyTargetError(f"{out}: holds files that are not a tiny-model build; the tiny builder will not touch it")


def build_tiny_model(cfg: TinyModelConfig, out_dir: str | os.PathLike[str]) -> Path:
    """Build the tokenizer and model described by `cfg` into `out_dir`.

    `out_dir` must not exist, be empty, or hold an earlier tiny build (replaced atomically);
    anything else raises TinyTargetError before a byte is written.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    if out.exists():
        _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok = build_tokenizer(cfg.vocab_size)
        vocab = ((max(len(tok), cfg.vocab_size) + 63) // 64) * 64  # the tokenizer's merges may stop short of it
        common = dict(
            vocab_size=vocab,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        hf_cfg = AutoConfig.for_model(cfg.architecture, **common, **cfg.family_fields())
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
        gen = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():  # small init keeps the untrained policy near-uniform
            for name, p in sorted(model.named_parameters()):
                if p.dim() >= 2:  # a router's wider: its experts' choice is not left to rounding
                    p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.02, generator=gen)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # the console is rlpost's (plan, one progress bar, summary)
        try:
            model.save_pretrained(tmp, safe_serialization=True)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        tok.save_pretrained(tmp)
        (tmp / TINY_MARKER).write_text(json.dumps(tiny_spec(cfg), indent=1))
        old = None
        if out.exists():  # only ever an earlier tiny build or an empty directory (see _check_replaceable)
            _check_replaceable(out)
            old = out.parent / f".{out.name}.old.{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_tiny_model(cfg: TinyModelConfig, path: str | os.PathLike[str]) -> Path:
    """Return `path`, building the tiny model there first unless a complete build is present. The build runs in a
    child process, so the caller (a run's driver) never holds the model: its allocator would keep the pages of a
    build's fp32 weights for the rest of the run (2 GiB for a model of Qwen2.5-0.5B's shape)."""
    p = Path(path)
    if tiny_build_matches(p, cfg):
        return p
    if p.exists():
        _check_replaceable(p)
    argv = [sys.executable, "-m", "rlpost.models.tiny", json.dumps(asdict(cfg)), str(p)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if proc.returncode != 0:
        raise RuntimeError(f"building the tiny model at {p} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return p


if __name__ == "__main__":  # ensure_tiny_model's child: python -m rlpost.models.tiny <TinyModelConfig as JSON> <dir>
    build_tiny_model(TinyModelConfig(**json.loads(sys.argv[1])), sys.argv[2])
