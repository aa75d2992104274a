"""Which policy version the rollout engine serves, and the refits that bring it up to date.

Training bumps the policy's version; `sync` refits (timed as the step's "refit") when the engine's is older.
Colocated on the CPU, once the training call has already written the export (Policy.train_and_stage_export),
the refit only has the engines load it, and it needs nothing from the driver or the policy: `policy_updated`
starts it at once on a background thread, so the engines load while the driver books the step (metrics,
validation bookkeeping, the checkpoint, the next prompts). `sync` then waits for what is left of it (the step's
"refit"; its whole length is `refit_background`), and raises what it raised (a FingerprintMismatch included).
The driver makes no other call on the engines in between: everything that generates calls `sync` first.
"""

from __future__ import annotations

import threading
import time

from rlpost.algorithms.grpo_setup import GRPOComponents, generation_dtype
from rlpost.algorithms.refit import refit_policy_generation
from rlpost.runtime.timer import Timer


class EngineWeights:
    """The engine's weights version against the policy's, and the refits between them."""

    def __init__(self, components: GRPOComponents, timer: Timer) -> None:
        self.components, self.timer = components, timer
        self.dtype = generation_dtype(components.cfg)
        self.policy_version, self.engine_version = 0, -1  # the engine starts with the checkpoint's weights, unchecked
        self._background: threading.Thread | None = None
        self._outcome: tuple[float, BaseException | None] = (0.0, None)

    def policy_updated(self) -> None:
        """The policy took an optimizer step: the engine is behind (and, when the export is staged, starts
        catching up now)."""
        self.policy_version += 1
        if self.components.colocated and getattr(self.components.policy, "export_staged", False):
            self._start_background()

    def refit(self) -> float:
        """Refit now (after any background one ended); the seconds it took."""
        self._join_background()
        took = self._refit_engine()
        self.engine_version = self.policy_version
        return took

    def _refit_engine(self) -> float:
        """One refit of the engine from the policy (checked); the seconds it took."""
        c = self.components
        return refit_policy_generation(c.policy, c.generation, c.colocated, self.dtype, c.cfg.policy.refit_buffer_size_gb)

    def sync(self) -> None:
        """Bring the engine to the policy's version before it generates."""
        if self._background is not None:
            with self.timer.time("refit"):
                took = self._join_background()
            self.timer.times["refit_background"] = took
        if self.engine_version != self.policy_version:
            with self.timer.time("refit"):
                self.refit()

    def finish(self) -> None:
        """Wait for a background refit (the end of a run)."""
        self._join_background()

    def _start_background(self) -> None:
        self._join_background()
        version = self.policy_version

        def run() -> None:
            t0 = time.perf_counter()
            try:
                self._outcome = (self._refit_engine(), None)
                self.engine_version = version
            except BaseException as exc:  # noqa: BLE001 - raised again by the main thread in _join_background
                self._outcome = (time.perf_counter() - t0, exc)

        self._background = threading.Thread(target=run, name="rlpost-refit", daemon=True)
        self._background.start()

    def _join_background(self) -> float:
        """Wait for the background refit, if any; its seconds (raising what it raised)."""
        thread, self._background = self._background, None
        if thread is None:
            return 0.0
        thread.join()
        took, error = self._outcome
        self._outcome = (0.0, None)
        if error is not None:
            raise error
        return took
