"""A vLLM engine hosted inside the policy's worker process (`policy.generation.colocated.same_process`).

Colocated on one CPU worker slot, the engine and the policy take turns anyway; in one process they also share
what two processes would each pay for: the refit is the engine loading the policy's freshly trained weights by
reference at the end of the training call (no shared-memory copy, no second Ray call, no Ray hop before the
load), one Python heap and one set of imports (torch, transformers) instead of two, and no process switch between
the phases. verl runs its rollout engine beside the trainer in each worker for the same reasons.

Worker side, `EngineHostMixin` (mixed into the DTensor policy worker's class by the run's setup, which is the one
layer that may know both: `Policy(host_mixin=...)`; workers and engines never import each other): `host_engine` builds a
`VllmEngineWorker` in this process; `engine_call` runs one of its methods; `train_and_load_engine` trains and
then loads the update into the engine, checked by fingerprint (sender's and engine's, compared by the driver).
The hosting actor runs every call on its main thread, one at a time, in the order the driver sent them (Policy
gives it no thread pool): a generation sent after a training call runs after that call's load, with its weights,
and no engine call ever meets a half-loaded model. (Run on a Ray thread pool, each phase took 10-20% longer on the
tiny model, and calls could overtake each other.)

Driver side, `HostedEngine`: stands in for an engine actor handle in VllmGeneration (`handle.method.remote(...)`
becomes `engine_call` on the hosting actor), so every engine code path is the one a separate engine actor runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

STREAMING = frozenset({"generate_chunks"})
"""Engine methods that are generators (Ray streaming calls): forwarded through `engine_stream`."""

NAMED = {"generate": "hosted_generate"}
"""Engine methods forwarded through a method of their own, so a run's timeline (`logger.ray_timeline`) names them."""


class EngineHostMixin:
    """Worker side: one vLLM engine replica in this process, beside the policy rank."""

    _hosted: Any = None
    _hosted_error: BaseException | None = None

    def host_engine(self, model_path: str, engine_kwargs: dict[str, Any], replica: int, device: str) -> bool:
        """Build the engine in this process (its vLLM import with the collector paused, as in its own actor). A
        failure is kept and raised by every later engine call, naming what failed."""
        from rlpost.models.generation.vllm_worker import VllmEngineWorker

        try:
            self._hosted = VllmEngineWorker(model_path, engine_kwargs, False, replica, device)
        except BaseException as exc:
            self._hosted_error = exc
            raise
        return True

    def _engine(self) -> Any:
        if self._hosted is None:
            why = f"it failed to start: {self._hosted_error!r}" if self._hosted_error is not None else \
                "host_engine was not called, or the engine was shut down"
            raise RuntimeError(f"this worker hosts no engine: {why}")
        return self._hosted

    def engine_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One call of the hosted engine's `method` (VllmEngineWorker)."""
        return getattr(self._engine(), method)(*args, **kwargs)

    def hosted_generate(self, *args: Any, **kwargs: Any) -> Any:
        """The hosted engine's `generate` (VllmEngineWorker.generate)."""
        return self.engine_call("generate", *args, **kwargs)

    def engine_stream(self, method: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """A generator method of the hosted engine (a Ray streaming call)."""
        yield from getattr(self._engine(), method)(*args, **kwargs)

    def train_and_load_engine(self, data: Any, loss_fn: Any, gbs: int | None, eval_mode: bool, dtype: str,
                              corrupt: str | None = None) -> dict[str, Any]:
        """`train`, then the hosted engine loads the update by reference (cast to `dtype`) in the same call: the
        result carries "engine_load" {"fingerprint": what the engine loaded, "expected": what the policy exported,
        "seconds"} for the driver to check. `corrupt`: the test-only fault hook (RLPOST_FAULT_CORRUPT_REFIT)."""
        result: dict[str, Any] = self.train(data, loss_fn, gbs, eval_mode)  # type: ignore[attr-defined]
        if eval_mode:
            return result
        t0 = time.perf_counter()
        self.prepare_weights_for_export(dtype)  # type: ignore[attr-defined]
        try:
            expected = self.export_fingerprint()  # type: ignore[attr-defined]
            loaded = self.engine_call("update_weights", self._export, corrupt)  # type: ignore[attr-defined]
        finally:
            self.clear_export()  # type: ignore[attr-defined]
        result["engine_load"] = {"fingerprint": loaded, "expected": expected, "seconds": time.perf_counter() - t0}
        return result

    def shutdown(self) -> bool:
        """Stop the hosted engine, then the policy rank (its own `shutdown`)."""
        if self._hosted is not None:
            engine, self._hosted = self._hosted, None
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort: the rank's own shutdown still runs
                pass
        return bool(super().shutdown())  # type: ignore[misc]


class _HostedMethod:
    def __init__(self, actor: Any, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self.name in NAMED:
            return getattr(self.actor, NAMED[self.name]).remote(*args, **kwargs)
        via = "engine_stream" if self.name in STREAMING else "engine_call"
        return getattr(self.actor, via).remote(self.name, *args, **kwargs)


class HostedEngine:
    """Driver side: the handle of an engine hosted in a policy worker's actor, used as an engine actor's handle
    (`handle.generate.remote(...)`). Killing it is a no-op: the actor is the policy's (ray.kill refuses it)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> _HostedMethod:
        if name.startswith("__"):
            raise AttributeError(name)
        return _HostedMethod(self.actor, name)
