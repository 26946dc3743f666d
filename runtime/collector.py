"""Python's garbage collector during training: its full passes kept out of the steps.

A full collection walks every object the process tracks. With a model, its tokenizer, the data and the compiled
kernels loaded that is hundreds of thousands of objects, 0.25-0.5 s on a GPU machine's host, and it comes every
few dozen steps at a moment nobody chose: the step that meets it waits, and on several GPUs every rank waits for
the one collecting. `QuietCollector` collects once before the first step and once after it (the step that compiles
kernels and fills caches), each time freezing what is alive (`gc.freeze`): later passes walk only the objects made
since, a few thousand. Reference counting still frees frozen objects; only their reference cycles wait, until
`close` unfreezes and collects them, so nothing of the run stays frozen for a later run in the same process (a
notebook, a sweep).
"""

from __future__ import annotations

import gc

import torch

FREEZE_AFTER_STEPS = 1  # the first step builds most of what the run keeps (compiled kernels, caches, state)


class QuietCollector:
    """Collects and freezes at `start` and after the first `step_done`; `close` unfreezes (objects that others
    froze too: freezing only speeds collection up, so unfreezing changes nothing but the next pass's time) and
    collects the run's cycles while its process group is still there to tear down what they hold.

    `setting` is `training.freeze_gc`: None freezes when training on a GPU, where a stalled step keeps the GPUs
    waiting; a CPU run gains nothing from it."""

    def __init__(self, setting: bool | None, device: torch.device) -> None:
        self.active = device.type == "cuda" if setting is None else setting
        self.steps = 0

    def start(self) -> None:
        if self.active:
            _collect_and_freeze()

    def step_done(self) -> None:
        self.steps += 1
        if self.active and self.steps == FREEZE_AFTER_STEPS:
            _collect_and_freeze()

    def close(self) -> None:
        if self.active:
            gc.unfreeze()
            gc.collect()
            self.active = False


def _collect_and_freeze() -> None:
    gc.collect()  # garbage frozen now would never be collected
    gc.freeze()
