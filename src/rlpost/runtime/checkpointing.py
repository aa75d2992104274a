"""Checkpoint manager: atomic step_N directories, keep-top-k, resume from the latest, fingerprints.

A checkpoint is written into `tmp_step_N/` and renamed to `step_N/` only when complete
(`training_info.json`, then `manifest.json` are written last), so a kill during a write leaves the
previous checkpoint usable; leftover `tmp_*` directories are removed on the next start. `keep_top_k`
keeps the best verified checkpoints by `metric_name` ('val:x' / 'train:x'; ties go to the newer) and
always the latest.

`manifest.json` records the size and sha256 of every other file of the checkpoint. Resume
(`latest_verified`) checks the newest checkpoint against it; one that fails (a missing, truncated or
altered file, or no readable manifest) is renamed to `corrupt_step_N` (never deleted), a one-line
warning names it, and the next newest that verifies is used instead.

Each checkpoint records the fingerprints of the model it started from and of the config; resuming
with a different one is refused unless `checkpointing.force_resume=true`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rlpost.config.schema.checkpoint import CheckpointingConfig
from rlpost.runtime import console

# Config keys that may change between a run and its resume.
RESUMABLE_KEYS = ("grpo.max_num_steps", "grpo.max_num_epochs", "sft.max_num_steps", "sft.max_num_epochs",
                  "dpo.max_num_steps", "dpo.max_num_epochs", "rm.max_num_steps", "rm.max_num_epochs", "checkpointing",
                  "logger", "cluster.address", "cluster.placement_timeout_s", "cluster.call_timeout_s",
                  "cluster.min_call_timeout_s", "cluster.skip_memory_check", "hydra")


MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
HASH = "sha256"
BLOCK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message is one line naming its path."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint was written by another model or config."""


# A file's stat signature (inode, size, mtime, ctime) -> its hash; lets `_prune` skip re-hashing
# files this process wrote or already checked and that have not changed since.
_StatKey = tuple[int, int, int, int]


def _stat_key(st: os.stat_result) -> _StatKey:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_hash(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.new(HASH)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    """Relative POSIX paths of the regular files under `root` (recursive, sorted), manifest excluded."""
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel != MANIFEST and full.is_file() and not full.is_symlink():
                out.append(rel)
    return sorted(out)


def write_manifest(ckpt: Path, cache: dict[_StatKey, str] | None = None) -> dict[str, object]:
    """Write `manifest.json` (size and sha256 of every other file under `ckpt`); returns it."""
    files: dict[str, dict[str, int | str]] = {}
    for rel in _files(ckpt):
        st = (ckpt / rel).stat()
        digest = file_hash(ckpt / rel)
        files[rel] = {"size": st.st_size, HASH: digest}
        if cache is not None:
            cache[_stat_key(st)] = digest
    manifest: dict[str, object] = {"version": MANIFEST_VERSION, "hash": HASH, "files": files}
    tmp = ckpt / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, ckpt / MANIFEST)
    return manifest


def _read_manifest(ckpt: Path) -> tuple[dict[str, dict[str, object]] | None, str]:
    """(files, "") for a well-formed manifest, else (None, why not)."""
    path = ckpt / MANIFEST
    if not path.is_file():
        return None, f"no {MANIFEST}"
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if data.get("hash") != HASH or not isinstance(files, dict):
            raise ValueError(f"unsupported hash {data.get('hash')!r}")
        for rel, entry in files.items():
            parts = Path(rel).parts
            if Path(rel).is_absolute() or ".." in parts or not parts:
                raise ValueError(f"bad path {rel!r}")
            if not isinstance(entry.get("size"), int) or not isinstance(entry.get(HASH), str):
                raise ValueError(f"bad entry for {rel!r}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"{MANIFEST} is unreadable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return files, ""


def verify(ckpt: Path, cache: dict[_StatKey, str] | None = None) -> str | None:
    """None when every file in the checkpoint's manifest is present with its size and hash, else
    why not (e.g. 'policy/optimizer/dcp/__0_0.distcp: 1234 bytes, manifest says 5678'). Files the
    manifest does not list are ignored. With `cache`, files whose stat signature is known are not
    re-hashed."""
    files, why = _read_manifest(ckpt)
    if files is None:
        return why
    stats: dict[str, os.stat_result] = {}
    for rel, entry in sorted(files.items()):  # cheap checks first: presence and size
        try:
            st = (ckpt / rel).stat()
        except OSError:
            return f"{rel}: missing"
        if st.st_size != entry["size"]:
            return f"{rel}: {st.st_size} bytes, manifest says {entry['size']}"
        stats[rel] = st
    for rel, entry in sorted(files.items()):
        key = _stat_key(stats[rel])
        digest = cache.get(key) if cache is not None else None
        if digest is None:
            try:
                digest = file_hash(ckpt / rel)
            except OSError as exc:
                return f"{rel}: unreadable ({exc.strerror or exc})"
        if digest != entry[HASH]:
            return f"{rel}: {HASH} differs from the manifest"
        if cache is not None:
            cache[key] = digest
    return None


def read_json(path: Path) -> Any:
    """json.loads of a checkpoint file; a missing or garbled file raises CheckpointError."""
    with checkpoint_errors(path):
        return json.loads(path.read_text())


@contextlib.contextmanager
def checkpoint_errors(path: Path) -> Iterator[None]:
    """Turn the errors of reading or applying checkpoint state from `path` into one-line CheckpointErrors."""
    try:
        yield
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        lines = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        raise CheckpointError(f"cannot load checkpoint file {path}: {detail}") from exc


def model_fingerprint(model_dir: str, samples: int = 17, block: int = 1 << 16) -> str:
    """Identity of a local HF model directory for resume checks, without reading every weight byte:
    config.json whole, and per weight file its size plus `samples` evenly spaced 64 KiB blocks.

    (Integrity of checkpoints is the manifest's job; this only tells one model from another.)
    """
    h = hashlib.sha256()
    d = Path(model_dir)
    for name in sorted(os.listdir(d)):
        if name == "config.json":
            h.update(name.encode() + (d / name).read_bytes())
        elif name.endswith(".safetensors"):
            size = (d / name).stat().st_size
            h.update(f"{name}:{size}".encode())
            with open(d / name, "rb") as f:
                for k in range(samples):
                    f.seek(max(0, (size - block) * k // max(samples - 1, 1)))
                    h.update(f.read(block))
    return h.hexdigest()[:16]


def _flatten(d: object, prefix: str = "") -> dict[str, object]:
    if isinstance(d, dict):
        out: dict[str, object] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def config_diff(old: Mapping[str, object], new: Mapping[str, object]) -> list[str]:
    """Keys whose values differ, ignoring RESUMABLE_KEYS."""
    a, b = _flatten(old), _flatten(new)
    keys = sorted(set(a) | set(b))
    return [k for k in keys if a.get(k) != b.get(k) and not any(k == r or k.startswith(r + ".") for r in RESUMABLE_KEYS)]


class CheckpointManager:
    """step_N checkpoints under one directory."""

    def __init__(self, cfg: CheckpointingConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self._hashes: dict[_StatKey, str] = {}
        self.dir = self.directory(cfg, run_dir)
        if cfg.enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            for leftover in self.dir.glob("tmp_step_*"):
                shutil.rmtree(leftover, ignore_errors=True)

    @staticmethod
    def directory(cfg: CheckpointingConfig, run_dir: Path) -> Path:
        """Where the run's step_N checkpoints go: checkpointing.checkpoint_dir, else <run dir>/checkpoints."""
        return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else run_dir / "checkpoints"

    def steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = re.fullmatch(r"step_(\d+)", p.name)
            if m and (p / "training_info.json").is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def incomplete(self) -> list[Path]:
        """step_N directories without training_info.json: a save writes it before the directory takes its name, so
        these were cut short or altered by hand (a resume moves them aside as corrupt)."""
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.iterdir() if re.fullmatch(r"step_\d+", p.name) and p.is_dir()
                      and not (p / "training_info.json").is_file())

    def latest(self) -> Path | None:
        """The newest step_N (unverified); see `latest_verified` for resume."""
        if not self.cfg.enabled:
            return None
        steps = self.steps()
        return self.dir / f"step_{steps[-1]}" if steps else None

    def latest_verified(self) -> Path | None:
        """The newest checkpoint that matches its manifest (every file hashed). Newer ones that do not
        are renamed to corrupt_step_N and named in one warning line each."""
        if not self.cfg.enabled:
            return None
        bad: list[tuple[Path, str, Path]] = [(ckpt, "no training_info.json", self._move_aside(ckpt))
                                             for ckpt in self.incomplete()]
        found: Path | None = None
        for step in reversed(self.steps()):
            ckpt = self.dir / f"step_{step}"
            why = verify(ckpt)
            if why is None:
                found = ckpt
                break
            bad.append((ckpt, why, self._move_aside(ckpt)))
        then = f"resuming from {found.name}" if found is not None else "no verified checkpoint left; starting from step 0"
        for ckpt, why, dest in bad:
            console.warn(f"checkpoint {ckpt} is corrupt ({why}); moved aside to {dest}; {then}")
        return found

    def _move_aside(self, ckpt: Path) -> Path:
        """Rename `ckpt` to corrupt_<name> (corrupt_<name>.1, .2, ... if taken); returns the new path."""
        dest = self.dir / f"corrupt_{ckpt.name}"
        n = 0
        while dest.exists():
            n += 1
            dest = self.dir / f"corrupt_{ckpt.name}.{n}"
        try:
            os.replace(ckpt, dest)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt and could not be moved aside: {exc}") from exc
        return dest

    def check_resume(self, ckpt: Path, model_fp: str, config: Mapping[str, object]) -> None:
        """Raise CheckpointMismatch (unless force_resume) when the model or config differ."""
        saved = json.loads((ckpt / "fingerprint.json").read_text()) if (ckpt / "fingerprint.json").is_file() else {}
        problems = []
        if saved.get("model") not in (None, model_fp):
            problems.append(f"model fingerprint {saved.get('model')} != {model_fp}")
        old_cfg = saved.get("config") or {}
        diff = config_diff(old_cfg, config) if old_cfg else []
        if diff:
            shown = ", ".join(f"{k}: {_flatten(old_cfg).get(k)!r} -> {_flatten(config).get(k)!r}" for k in diff[:8])
            problems.append(f"config differs in {shown}")
        if problems and not self.cfg.force_resume:
            raise CheckpointMismatch(
                f"refusing to resume from {ckpt}: " + "; ".join(problems)
                + ". Use a new run directory, or checkpointing.force_resume=true to resume anyway."
            )

    def begin(self, step: int) -> Path:
        tmp = self.dir / f"tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def finalize(self, tmp: Path, step: int, info: Mapping[str, object], model_fp: str, config: Mapping[str, object]
                 ) -> Path:
        """Write the fingerprints, training_info.json and, last, the manifest; rename into place; prune."""
        (tmp / "fingerprint.json").write_text(json.dumps({"model": model_fp, "config": config}, indent=1, default=str))
        (tmp / "training_info.json").write_text(json.dumps(info, indent=1))
        write_manifest(tmp, self._hashes)
        final = self.dir / f"step_{step}"
        if final.exists():
            old = self.dir / f"old_step_{step}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        self._prune()
        return final

    def _prune(self) -> None:
        """Keep the k best checkpoints that verify, plus the latest; move unverifiable ones aside."""
        k = self.cfg.keep_top_k
        steps = self.steps()
        if k is None or len(steps) <= k:
            return
        latest = steps[-1]
        name = self.cfg.metric_name
        good = []
        for s in steps:
            ckpt = self.dir / f"step_{s}"
            why = verify(ckpt, self._hashes)
            if why is None:
                good.append(s)
            else:
                dest = self._move_aside(ckpt)
                console.warn(f"checkpoint {ckpt} is corrupt ({why}); moved aside to {dest}; not kept by keep_top_k")

        def score(step: int) -> tuple[float, int]:
            try:
                info = json.loads((self.dir / f"step_{step}" / "training_info.json").read_text())
                v = info.get(name) if name else None
                v = float(v) if v is not None else None
            except (OSError, ValueError, TypeError, AttributeError):
                v = None
            if v is None:
                return (float("-inf"), step)
            return ((v if self.cfg.higher_is_better else -v), step)

        ranked = sorted(good, key=score, reverse=True)
        keep = set(ranked[:k]) | ({latest} if latest in good else set())
        for s in good:
            if s not in keep:
                shutil.rmtree(self.dir / f"step_{s}", ignore_errors=True)
