"""rlpost.config.fields: a field's declared rule refuses what it should with the same line a hand-written check gave,
and every declared rule of the composed defaults holds."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

import pytest

from rlpost.config.errors import ConfigError
from rlpost.config.fields import NON_NEGATIVE, POSITIVE, POSITIVE_OR_NONE, RULE, Block, checked, options, within
from rlpost.config.load import load_master_config


@pytest.mark.parametrize("rule, good, bad, text", [
    (POSITIVE, [1, 0.5], [0, -1, None], "must be > 0"),
    (POSITIVE_OR_NONE, [1, None], [0, -2], "must be > 0"),
    (NON_NEGATIVE, [0, 3], [-1, None], "must be >= 0"),
    (within("[0, 1)"), [0, 0.5], [1, -0.1, 1.5], "must be in [0, 1)"),
    (within("(0, 1]"), [1, 1e-9], [0, 1.01], "must be in (0, 1]"),
    (within("[0, 1]"), [0, 1], [-1e-9, 1 + 1e-9], "must be in [0, 1]"),
    (options("a", "b"), ["a", "b"], ["c", None], "must be one of ['a', 'b']"),
    (options(0, 1, allow_none=True), [0, None], [2], "must be one of [0, 1]"),
])
def test_a_rule_passes_good_values_and_names_bad_ones(rule: object, good: list[object], bad: list[object],
                                                      text: str) -> None:
    for value in good:
        rule("k.x", value)  # type: ignore[operator]
    for value in bad:
        with pytest.raises(ConfigError) as err:
            rule("k.x", value)  # type: ignore[operator]
        assert (err.value.key, err.value.value, err.value.rule) == ("k.x", value, text)


def test_a_block_checks_its_declared_fields_under_its_path() -> None:
    @dataclass
    class Loop(Block):
        steps: int = checked(10, POSITIVE)
        plain: int = -5  # no rule: never checked

    Loop().check("loop")
    with pytest.raises(ConfigError, match=r"loop\.steps=0: must be > 0"):
        Loop(steps=0).check("loop")


@pytest.mark.parametrize("overrides", [[], ["policy=megatron"], ["algo=ppo"], ["algo=sft"], ["algo=dpo"],
                                       ["generation=hf"], ["loss=cispo"]])
def test_every_default_passes_its_declared_rule(overrides: list[str]) -> None:
    _, master = load_master_config(overrides)
    todo: list[tuple[str, object]] = [("", master)]
    checked_fields = 0
    while todo:
        path, node = todo.pop()
        if isinstance(node, dict):
            todo += [(f"{path}.{k}", v) for k, v in node.items()]
        if not is_dataclass(node):
            continue
        for f in fields(node):
            value = getattr(node, f.name)
            if (rule := f.metadata.get(RULE)) is not None:
                rule(f"{path}.{f.name}", value)
                checked_fields += 1
            todo.append((f"{path}.{f.name}", value))
    assert checked_fields > 40
