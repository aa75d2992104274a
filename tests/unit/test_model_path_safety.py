"""`model.path` never deletes or overwrites a user's directory (issue: data loss under model=tiny)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpost.cli import main
from rlpost.config.schema.model import TinyModelConfig
from rlpost.models.tiny import TinyTargetError, build_tiny_model, ensure_tiny_model


def _precious(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "notes.txt").write_text("three years of work")
    return d


def _intact(d: Path) -> bool:
    return (d / "notes.txt").read_text() == "three years of work" and sorted(p.name for p in d.iterdir()) == [
        "notes.txt"
    ]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    c = tmp_path / "cache"
    monkeypatch.setenv("RLPOST_CACHE_DIR", str(c))
    return c


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["model=tiny"],
        ["model.tiny.hidden_size=128", "model.tiny.num_attention_heads=4"],
        ["model=local"],
        ["model=qwen2_5_1_5b"],
        ["model.tiny=null"],
    ],
)
def test_a_user_directory_survives_every_model_option(
    tmp_path: Path, cache: Path, extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    user = _precious(tmp_path / "my_project")
    rc = main(["train", f"model.path={user}", f"hydra.run.dir={tmp_path / 'run'}", *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "model.path" in err and str(user) in err
    assert "Traceback" not in err
    assert _intact(user)
    assert not (tmp_path / "run").exists()  # refused before anything was started or written


def test_a_real_model_under_model_tiny_says_which_option_to_use(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = tmp_path / "SmolLM2"
    real.mkdir()
    (real / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (real / "model.safetensors").write_bytes(b"weights")
    assert main(["train", f"model.path={real}"]) == 2
    err = capsys.readouterr().err
    assert "holds a model" in err and f"model=local model.path={real}" in err
    assert (real / "model.safetensors").read_bytes() == b"weights"


def test_a_missing_path_outside_the_cache_is_refused_not_created(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "new_dir"
    assert main(["plan", f"model.path={target}"]) == 2
    assert "model.cache_dir" in capsys.readouterr().err
    assert not target.exists()


def test_a_path_inside_the_cache_is_accepted(tmp_path: Path, cache: Path) -> None:
    assert main(["plan", f"model.path={cache / 'mine'}"]) == 0


def test_the_builder_refuses_a_foreign_directory(tmp_path: Path) -> None:
    user = _precious(tmp_path / "data")
    with pytest.raises(TinyTargetError, match="not a tiny-model build"):
        build_tiny_model(TinyModelConfig(), user)
    assert _intact(user)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(TinyTargetError, match="not a directory"):
        ensure_tiny_model(TinyModelConfig(), a_file)
    assert a_file.read_text() == "x"


def test_the_builder_replaces_only_its_own_stale_build(tmp_path: Path) -> None:
    out = ensure_tiny_model(TinyModelConfig(seed=1), tmp_path / "tiny")
    assert json.loads((out / "rlpost_tiny.json").read_text())["seed"] == 1
    # A different spec at the same place: an earlier tiny build, so it may be replaced.
    out2 = ensure_tiny_model(TinyModelConfig(seed=2), tmp_path / "tiny")
    assert json.loads((out2 / "rlpost_tiny.json").read_text())["seed"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no leftovers
