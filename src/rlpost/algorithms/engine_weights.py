"""Which policy version the rollout engine serves, and the refits that bring it up to date.

Training bumps the policy's version; `sync` refits (timed as the step's "refit") when the engine's is older.
Colocated on the CPU, once each training call also writes the export of the weights it produced
(Policy.train_and_stage_export), the refit only has the engines load it, and needs nothing from the driver:

- with vLLM, the engines are told to load it as the training call is sent (`Policy.on_stage_submitted`,
  `load_staged_async`): Ray hands them rank 0's result the moment it exists, so they load while that result travels
  back to the driver and the driver books the step;
- otherwise `policy_updated` starts the refit on a background thread as soon as training returns.

Either way `sync` then waits for what is left of it (the step's "refit"; the load itself is `refit_background`) and
raises what it raised (a FingerprintMismatch included). The driver makes no other call on the engines in between:
everything that generates calls `sync` first.

With the engine hosted in the policy's worker process (`policy.generation.colocated.same_process`), the training call
itself ends with the engine loading its update (`train_and_load_engine`): `policy_updated` checks the two
fingerprints it returns, and nothing is left for `sync` to wait for.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rlpost.algorithms.grpo_setup import GRPOComponents, generation_dtype
from rlpost.algorithms.refit import refit_policy_generation
from rlpost.models.fingerprint import check_fingerprints
from rlpost.runtime.timer import Timer


class EngineWeights:
    """The engine's weights version against the policy's, and the refits between them."""

    def __init__(self, components: GRPOComponents, timer: Timer) -> None:
        self.components, self.timer = components, timer
        self.dtype = generation_dtype(components.cfg)
        self.policy_version, self.engine_version = 0, -1  # the engine starts with the checkpoint's weights, unchecked
        self._background: threading.Thread | None = None
        self._outcome: tuple[float, BaseException | None] = (0.0, None)
        self._sent: list[Any] | None = None  # the engines' loads sent with the training call in flight
        self._chained: tuple[list[Any], str, int] | None = None  # those loads, the export's fingerprint, its version
        policy, generation = components.policy, components.generation
        self.hosted = bool(getattr(generation, "hosted", False))
        self._hosted_load_s: float | None = None  # the hosted engine's load in the last training call, until synced
        if self.hosted:
            policy.engine_load = (self.dtype, lambda: generation.refit_fault(0))  # type: ignore[attr-defined]
        elif (components.colocated and hasattr(generation, "load_staged_async")
              and hasattr(policy, "on_stage_submitted")):
            policy.on_stage_submitted = self._send_load

    def _send_load(self, train_result: Any) -> None:
        self._sent = self.components.generation.load_staged_async(train_result)  # type: ignore[attr-defined]

    def policy_updated(self) -> None:
        """The policy took an optimizer step: the engine is behind (and, when the export is staged, is catching up
        already or starts now)."""
        self.policy_version += 1
        if self.hosted:
            loaded = self.components.policy.take_engine_load()  # type: ignore[attr-defined]
            if loaded is not None:
                check_fingerprints([str(loaded["fingerprint"])], str(loaded["expected"]), who="replica")
                self.engine_version, self._hosted_load_s = self.policy_version, float(loaded["seconds"])
            return
        sent, self._sent = self._sent, None
        policy = self.components.policy
        if sent is not None:
            staged = policy.take_staged_export()  # type: ignore[attr-defined]
            if staged is not None:
                self._chained = (sent, str(staged["fingerprint"]), self.policy_version)
                return
            # the call staged nothing (the export outgrew one bucket): the engines' loads return at once, unused
        if self.components.colocated and getattr(policy, "export_staged", False):
            self._start_background()

    def load_sent(self) -> bool:
        """Whether the engines were told to load the policy's last update with the training call that made it (and
        will, since each runs its calls in order, before anything sent to them now)."""
        if self.hosted:
            return self.engine_version == self.policy_version and self._hosted_load_s is not None
        return self._chained is not None and self._chained[2] == self.policy_version

    def refit(self) -> float:
        """Refit now (after any refit in flight ended); the seconds it took."""
        self._settle()
        took = self._refit_engine()
        self.engine_version = self.policy_version
        return took

    def _refit_engine(self) -> float:
        """One refit of the engine from the policy (checked); the seconds it took."""
        c = self.components
        return refit_policy_generation(c.policy, c.generation, c.colocated, self.dtype, c.cfg.policy.refit_buffer_size_gb)

    def sync(self) -> None:
        """Bring the engine to the policy's version before it generates."""
        if self._hosted_load_s is not None:  # loaded by the training call: nothing waited for
            self.timer.times["refit"], self.timer.times["refit_background"] = 0.0, self._hosted_load_s
            self._hosted_load_s = None
        if self._background is not None or self._chained is not None:
            with self.timer.time("refit"):
                took = self._settle()
            self.timer.times["refit_background"] = took
        if self.engine_version != self.policy_version:
            with self.timer.time("refit"):
                self.refit()

    def finish(self) -> None:
        """Wait for a refit in flight (the end of a run)."""
        self._settle()

    def _settle(self) -> float:
        """Wait for the refit in flight, if any; the seconds its load took (raising what it raised)."""
        return self._join_background() + self._join_chained()

    def _join_chained(self) -> float:
        chained, self._chained = self._chained, None
        if chained is None:
            return 0.0
        futures, fingerprint, version = chained
        took = self.components.generation.wait_staged(futures, fingerprint)  # type: ignore[attr-defined]
        if took is None:
            raise RuntimeError("the engines found no staged export in the training call that staged one")
        self.engine_version = version
        return took

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
