"""A resumable prompt loader: seeded shuffle per epoch, whole batches only (drop_last).

Its state ({epoch, index}) is saved in checkpoints, so a resumed run sees exactly the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import random
from typing import Generic, TypeVar

RowT = TypeVar("RowT")


class PromptLoader(Generic[RowT]):
    """Batches of `batch_size` rows; an epoch ends when fewer than a batch remain."""

    def __init__(self, rows: list[RowT], batch_size: int, shuffle: bool = True, seed: int = 42) -> None:
        if batch_size > len(rows):
            raise ValueError(f"batch size {batch_size} is larger than the {len(rows)} rows of the dataset")
        self.rows = rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._epoch_order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        return len(self.rows) // self.batch_size

    def _order(self) -> list[int]:
        """This epoch's row order (shuffled once per epoch, not once per batch)."""
        if self._epoch_order is None or self._epoch_order[0] != self.epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            self._epoch_order = (self.epoch, order)
        return self._epoch_order[1]

    def epochs_done(self) -> int:
        """Completed passes over the data."""
        return self.epoch + (1 if self.index >= len(self) else 0)

    def next_batch(self) -> list[RowT]:
        """The next batch, starting a new (reshuffled) epoch when the current one is used up."""
        if self.index >= len(self):
            self.epoch += 1
            self.index = 0
        order = self._order()
        i = self.index
        self.index += 1
        return [self.rows[j] for j in order[i * self.batch_size : (i + 1) * self.batch_size]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
