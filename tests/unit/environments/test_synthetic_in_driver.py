"""The synthetic task's exact match scored in the driver (env.synthetic.num_workers=0, the default) and in a
verifier worker give the same rewards; what can't be honoured without a worker is refused."""

from __future__ import annotations

import pytest

from rlpost.config.errors import ConfigError
from rlpost.config.load import load_master_config
from rlpost.config.schema.env import SyntheticEnvConfig
from rlpost.environments.synthetic import SyntheticEnvironment


def test_in_driver_and_in_a_worker_score_alike() -> None:
    responses = ["7", " 7 ", "3", "x", "77", "", "<|im_end|>"]
    metadata = [{"expected_answer": "7"}] * len(responses)
    here = SyntheticEnvironment(SyntheticEnvConfig(task="copy_digit"))
    worker = SyntheticEnvironment(SyntheticEnvConfig(task="copy_digit", num_workers=1))
    try:
        assert here.pool is None and worker.pool is not None
        a, b = here.step(responses, metadata), worker.step(responses, metadata)
    finally:
        here.shutdown()
        worker.shutdown()
    assert a.rewards == b.rewards == [1.0, 1.0, 0.1, 0.0, 0.0, 0.0, 0.0]
    assert (a.timeouts, a.errors) == (b.timeouts, b.errors) == (0, 0)


def test_a_row_that_raises_counts_as_an_error_in_the_driver_too() -> None:
    env = SyntheticEnvironment(SyntheticEnvConfig(task="copy_digit"))
    out = env.step(["7", None], [{"expected_answer": "7"}] * 2)  # type: ignore[list-item]
    assert out.rewards == [1.0, 0.0] and out.errors == 1


def test_the_default_job_scores_in_the_driver() -> None:
    assert load_master_config([])[1].env["synthetic"].num_workers == 0


@pytest.mark.parametrize("override, key", [
    ("env.synthetic.timeout_s=5", "env.synthetic.timeout_s"),
    ("env.synthetic.batch_timeout_s=60", "env.synthetic.batch_timeout_s"),
    ("env.synthetic.num_workers=-1", "env.synthetic.num_workers"),
])
def test_what_needs_a_worker_is_refused_without_one(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_master_config([override])
    assert err.value.key == key


def test_a_timeout_is_accepted_with_a_worker_and_other_environments_still_need_one() -> None:
    cfg = load_master_config(["env.synthetic.num_workers=1", "env.synthetic.timeout_s=5"])[1]
    assert cfg.env["synthetic"].timeout_s == 5
    with pytest.raises(ConfigError) as err:
        load_master_config(["env=lookup", "data=lookup", "env.lookup.num_workers=0"])
    assert err.value.key == "env.lookup.num_workers"
