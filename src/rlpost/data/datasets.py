"""Rows {problem, expected_answer, env_name} from the synthetic tasks or local JSONL / parquet files.

Files are read locally (JSONL line by line, parquet through `datasets`; no hub access). Every bad
input is a DataError naming the file and line (row for parquet): a line that is not UTF-8 or not a
JSON object, an object naming one key twice, a missing, empty, boolean or non-finite text field, and
a file of the other format (a parquet file given as JSONL or the other way round), with the
`data.dataset_name` to use.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from rlpost.config.schema.data import DataConfig
from rlpost.data.rows import PromptRow

PARQUET_MAGIC = b"PAR1"


class DataError(ValueError):
    """A bad data file or row; the message names the file and line."""


def _text_field(value: object, key: str, where: str) -> str:
    """A row's input / output as text: a non-blank string or a finite number (bools and NaN are refused)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: {key!r} must be a string or number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f"{where}: {key!r} is {value!r}; a text field must be a string or a finite number")
    if isinstance(value, str) and not value.strip():
        raise DataError(f"{where}: {key!r} is empty" + (" (whitespace only)" if value else ""))
    return str(value)


def _check_row(row: object, cfg: DataConfig, where: str, with_source: bool = False) -> PromptRow:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in (cfg.input_key, cfg.output_key):
        if key not in row:
            raise DataError(f"{where}: missing key {key!r} (data.input_key / data.output_key)")
    checked: PromptRow = {
        "problem": _text_field(row[cfg.input_key], cfg.input_key, where),
        "expected_answer": _text_field(row[cfg.output_key], cfg.output_key, where),
    }
    if with_source:
        checked["source"] = where
    return checked


def sniff(path: str) -> str | None:
    """What a file that is not JSON text looks like ('a parquet file', 'gzip-compressed', ...); None for text."""
    with open(path, "rb") as f:
        head = f.read(8192)
    if head.startswith(PARQUET_MAGIC):
        return "a parquet file"
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16 text; save it as UTF-8"
    if head.startswith(b"\x1f\x8b"):
        return "gzip-compressed"
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive"
    nul = head.find(b"\x00")
    if nul >= 0:
        return f"binary data: a NUL byte at offset {nul}"
    return None


class _DuplicateKey(ValueError):
    """A JSON object names one key twice (json.loads would silently keep the last)."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: the object as a dict, or _DuplicateKey naming a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def not_a_file(path: str) -> str | None:
    """Why `path` is no regular file to read rows from ('no such file', 'a directory, not a file', ...), or None.
    A FIFO is refused: reading one blocks until a writer comes, and a second pass would find it empty."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    for test, what in _NOT_FILES:
        if test(mode):
            return f"{what}, not a file"
    return None


def jsonl_objects(path: str) -> list[tuple[object, str]]:
    """(parsed JSON value, 'file:line') of every non-blank line of a local JSONL file; DataError on bad input."""
    p = Path(path)
    if (why := not_a_file(path)) is not None:
        raise DataError(f"{path}: {why}")
    kind = sniff(path)
    if kind == "a parquet file":
        raise DataError(f"{path}: this is a parquet file, not JSONL; read it with data.dataset_name=parquet")
    if kind is not None:
        raise DataError(
            f"{path}: not a JSONL text file ({kind}); data.dataset_name=jsonl reads one JSON object per line"
        )
    out = []
    offset = 0
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}, "
                    f"file offset {start + exc.start}); JSONL files must be UTF-8 text"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line, object_pairs_hook=_no_duplicate_keys)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            except _DuplicateKey as exc:
                raise DataError(f"{path}:{lineno}: key {exc.args[0]!r} appears twice in one object (JSON would keep "
                                "only the last)") from None
            except RecursionError:
                raise DataError(f"{path}:{lineno}: nested too deeply to read (a row is an object of strings and "
                                "lists of messages)") from None
            out.append((obj, f"{path}:{lineno}"))
    if not out:
        raise DataError(f"{path}: no rows")
    return out


def parquet_objects(path: str) -> list[tuple[object, str]]:
    """(row, 'file: row i') of every row of a local parquet file (read through `datasets`); DataError on bad input."""
    if (why := not_a_file(path)) is not None:
        raise DataError(f"{path}: {why}")
    with open(path, "rb") as f:
        head = f.read(4096)
    if not head.startswith(PARQUET_MAGIC):
        kind = sniff(path)
        if kind is None and head.lstrip()[:1] in (b"{", b"["):
            raise DataError(
                f"{path}: not a parquet file (it looks like JSONL text); "
                "read it with data.dataset_name=jsonl (e.g. data=math_jsonl)"
            )
        raise DataError(
            f"{path}: not a parquet file ({kind or 'it does not start with the PAR1 magic bytes'}); "
            "data.dataset_name=parquet reads parquet files only"
        )
    from datasets import load_dataset

    try:
        ds = load_dataset("parquet", data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - a truncated or corrupt file: name it, no traceback
        raise DataError(f"{path}: cannot be read as parquet ({type(exc).__name__}: {exc})") from None
    out = [(row, f"{path}: row {i}") for i, row in enumerate(ds)]
    if not out:
        raise DataError(f"{path}: no rows")
    return out


def read_objects(path: str, dataset_name: str) -> list[tuple[object, str]]:
    """Rows of a local file of data.dataset_name 'jsonl' or 'parquet', each with where it came from."""
    return jsonl_objects(path) if dataset_name == "jsonl" else parquet_objects(path)


def read_jsonl(path: str, cfg: DataConfig, with_source: bool = False) -> list[PromptRow]:
    """Prompt rows of a JSONL file, one JSON object per non-blank line."""
    return [_check_row(obj, cfg, where, with_source) for obj, where in jsonl_objects(path)]


def read_parquet(path: str, cfg: DataConfig, with_source: bool = False) -> list[PromptRow]:
    """Prompt rows of a parquet file (read through `datasets`)."""
    return [_check_row(row, cfg, where, with_source) for row, where in parquet_objects(path)]


def load_rows(cfg: DataConfig, split: str, with_source: bool = False) -> list[PromptRow]:
    """Training (split='train') or validation rows, each tagged with cfg.env_name (and, with_source, with
    'source': the file and line it came from)."""
    if cfg.dataset_name == "synthetic":
        from rlpost.data.synthetic_tasks import make_rows

        s = cfg.synthetic
        rows = make_rows(s.task, s.num_train if split == "train" else s.num_val, s.seed + (0 if split == "train" else 1))
    else:
        reader = read_jsonl if cfg.dataset_name == "jsonl" else read_parquet
        if split == "train":
            assert cfg.train_data_path is not None
            rows = reader(cfg.train_data_path, cfg, with_source)
        else:
            rows = [r for p in cfg.val_data_paths for r in reader(p, cfg, with_source)]
    for r in rows:
        r["env_name"] = cfg.env_name
    return rows
