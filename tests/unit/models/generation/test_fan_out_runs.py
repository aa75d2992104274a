"""Which rows of a generate call go to vLLM as one request for n samples (`fan_out_runs`)."""

from __future__ import annotations

from rlpost.models.generation.vllm_worker import fan_out_runs


def test_a_grpo_batch_is_one_request_per_group() -> None:
    prompts = [[1, 2]] * 4 + [[3]] * 4
    assert fan_out_runs(prompts, list(range(100, 108)), None, False) == [(0, 4), (4, 8)]


def test_a_run_ends_where_the_prompt_the_seed_step_or_the_stops_change() -> None:
    prompts = [[1], [1], [1], [2], [2], [2], [2]]
    seeds = [5, 6, 8, 9, 10, 11, 12]  # 6 -> 8 skips a seed
    stops = [[], [], [], ["x"], ["x"], ["y"], ["y"]]
    assert fan_out_runs(prompts, seeds, stops, False) == [(0, 2), (2, 3), (3, 5), (5, 7)]
    # the same prompt again after another one is a new request
    assert fan_out_runs([[1], [2], [1]], [0, 1, 2], None, False) == [(0, 1), (1, 2), (2, 3)]


def test_unseeded_rows_of_one_prompt_merge_and_greedy_rows_never_do() -> None:
    prompts = [[7, 7]] * 3
    assert fan_out_runs(prompts, None, None, False) == [(0, 3)]
    assert fan_out_runs(prompts, [0, 1, 2], None, True) == [(0, 1), (1, 2), (2, 3)]
    assert fan_out_runs([], None, None, False) == []
