"""Rows {problem, expected_answer, env_name} from the synthetic tasks or local JSONL / parquet files.

Files are read locally through `datasets` (no hub access). A JSONL line that is not a JSON object,
or a row without the input / output keys, is reported with its file and line (row for parquet).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from rlpost.config.schema.data import DataConfig


class DataError(ValueError):
    """A bad data file or row; the message names the file and line."""


def _check_row(row: Any, cfg: DataConfig, where: str) -> Dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in (cfg.input_key, cfg.output_key):
        if key not in row:
            raise DataError(f"{where}: missing key {key!r} (data.input_key / data.output_key)")
        if not isinstance(row[key], (str, int, float)):
            raise DataError(f"{where}: {key!r} must be a string or number, got {type(row[key]).__name__}")
    return {"problem": str(row[cfg.input_key]), "expected_answer": str(row[cfg.output_key])}


def read_jsonl(path: str, cfg: DataConfig) -> List[Dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{path}: no such file")
    rows = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            rows.append(_check_row(obj, cfg, f"{path}:{lineno}"))
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def read_parquet(path: str, cfg: DataConfig) -> List[Dict[str, Any]]:
    from datasets import load_dataset

    if not Path(path).is_file():
        raise DataError(f"{path}: no such file")
    ds = load_dataset("parquet", data_files=str(path), split="train")
    return [_check_row(row, cfg, f"{path}: row {i}") for i, row in enumerate(ds)]


def load_rows(cfg: DataConfig, split: str) -> List[Dict[str, Any]]:
    """Training (split='train') or validation rows, each tagged with cfg.env_name."""
    if cfg.dataset_name == "synthetic":
        from rlpost.environments.synthetic import make_rows

        s = cfg.synthetic
        rows = make_rows(s.task, s.num_train if split == "train" else s.num_val, s.seed + (0 if split == "train" else 1))
    else:
        reader = read_jsonl if cfg.dataset_name == "jsonl" else read_parquet
        if split == "train":
            assert cfg.train_data_path is not None
            rows = reader(cfg.train_data_path, cfg)
        else:
            rows = [r for p in cfg.val_data_paths for r in reader(p, cfg)]
    for r in rows:
        r["env_name"] = cfg.env_name
    return rows


def as_dataset(rows: List[Dict[str, Any]]) -> Any:
    """The rows as a `datasets.Dataset` (for users who want its tooling)."""
    from datasets import Dataset

    return Dataset.from_list(rows)
