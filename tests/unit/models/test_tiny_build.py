"""The tiny model's build: the vocabulary it is asked for, and built in a child process so a run's driver never
holds the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys
import torch, transformers  # imported before the baseline: the driver has them already
from rlpost.config.schema.model import TinyModelConfig
from rlpost.models.tiny import ensure_tiny_model

def hwm():
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))

before = hwm()
ensure_tiny_model(TinyModelConfig(hidden_size=256, intermediate_size=512, vocab_size=65536), sys.argv[1])
print(json.dumps({"growth": hwm() - before}))
"""


def test_the_build_runs_apart_and_has_the_vocabulary_asked_for(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out)], capture_output=True, text=True, timeout=300,
                          check=True)
    growth = json.loads(proc.stdout.strip().splitlines()[-1])["growth"]
    hf = json.loads((out / "config.json").read_text())
    # 65,536 rows although the BPE's corpus runs out of merges near 400 tokens
    assert hf["vocab_size"] == 65536
    weights = (out / "model.safetensors").stat().st_size
    assert weights > 65536 * 256 * 4  # the embedding alone, in fp32
    # the caller's peak resident set did not take the model's weights: the build ran in a child process
    assert growth < weights / 4, (growth, weights)
