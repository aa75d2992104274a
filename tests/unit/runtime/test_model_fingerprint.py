"""The resume check's model fingerprint tells models apart without reading every weight byte."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest

from rlpost.runtime.checkpointing import model_fingerprint


def _model(d: Path, weights: bytes) -> Path:
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen2"}')
    (d / "model.safetensors").write_bytes(weights)
    return d


def test_fingerprint_tells_models_apart_and_reads_a_bounded_sample(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    size = 32 << 20
    base = bytes(size)
    a = _model(tmp_path / "a", base)
    fp = model_fingerprint(str(a))
    assert model_fingerprint(str(a)) == fp
    mid = bytearray(base)
    mid[size // 2 : size // 2 + 4] = b"\x01\x02\x03\x04"  # inside the middle sampled block
    assert model_fingerprint(str(_model(tmp_path / "b", bytes(mid)))) != fp
    assert model_fingerprint(str(_model(tmp_path / "c", base + b"\x00"))) != fp  # another size
    c = _model(tmp_path / "d", base)
    (c / "config.json").write_text('{"model_type": "llama"}')
    assert model_fingerprint(str(c)) != fp

    read = [0]
    real_open = builtins.open

    def counting_open(*args: Any, **kwargs: Any) -> Any:
        f = real_open(*args, **kwargs)
        real_read = f.read

        def read_(n: int = -1) -> Any:
            out = real_read(n)
            read[0] += len(out)
            return out

        f.read = read_  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(builtins, "open", counting_open)
    model_fingerprint(str(a))
    assert read[0] <= 17 * (1 << 16) + 4096 < size // 10
