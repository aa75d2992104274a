from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    from rlpost.config.schema.model import TinyModelConfig
    from rlpost.config.schema.policy import TokenizerConfig
    from rlpost.data.prompts import load_tokenizer
    from rlpost.models.tiny import ensure_tiny_model

    path: Path = ensure_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("tok") / "tiny")
    return load_tokenizer(TokenizerConfig(name=str(path), chat_template=None))
