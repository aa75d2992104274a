"""Models: policy workers, rollout engines, model builders."""
