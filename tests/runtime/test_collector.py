"""Python's garbage collector during training: what is alive before the first step and after it is frozen, so
later full collections walk only what the steps made; the run leaves nothing frozen behind. By default only GPU
runs freeze."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from tests.runtime.configs import tiny_config
from tigon.runtime.collector import QuietCollector
from tigon.runtime.trainer import train

CPU = torch.device("cpu")


def test_a_full_collection_after_the_freeze_walks_only_new_objects():
    alive = [[i] for i in range(300_000)]  # a loaded model's worth of tracked objects
    gc.collect()
    started = time.perf_counter()
    gc.collect()
    walking_everything = time.perf_counter() - started
    collector = QuietCollector(True, CPU)
    collector.start()
    assert gc.get_freeze_count() >= len(alive)
    collector.step_done()
    started = time.perf_counter()
    gc.collect()
    walking_new = time.perf_counter() - started
    collector.close()
    assert gc.get_freeze_count() == 0
    assert walking_new < walking_everything / 10, (walking_new, walking_everything)


def test_frozen_cycles_are_collected_once_the_collector_closes():
    class Node:
        pass

    collector = QuietCollector(True, CPU)
    collector.start()
    a, b = Node(), Node()
    a.other, b.other = b, a
    gc.freeze()  # as the freeze after the first step would: the cycle is alive then
    first = weakref.ref(a)
    del a, b
    gc.collect()
    assert first() is not None  # frozen: the collection skipped it
    collector.close()
    gc.collect()
    assert first() is None


@pytest.mark.parametrize("trainer", ["torch", "hf", "lightning"])
@pytest.mark.parametrize("freeze", [True, False, None])
def test_each_trainer_freezes_before_and_after_the_first_step_and_unfreezes_at_the_end(
    tmp_path, trainer, freeze, monkeypatch
):
    if trainer == "lightning":
        pytest.importorskip("lightning")
    frozen_counts = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (real_freeze(), frozen_counts.append(gc.get_freeze_count())))
    config = tiny_config(
        tmp_path, trainer=trainer, training={"max_steps": 3, "freeze_gc": freeze}, kernels={"enabled": False}
    )
    result = train(config)
    assert len(result.losses) == 3
    if freeze:  # None: only on GPUs
        assert len(frozen_counts) == 2 and 0 < frozen_counts[0] <= frozen_counts[1], frozen_counts
    else:
        assert frozen_counts == []
    assert gc.get_freeze_count() == 0
