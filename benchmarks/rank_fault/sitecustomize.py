"""A fault on one rank, for seeing how a multi-process run ends when one of its processes fails or hangs mid-run.

    PYTHONPATH=benchmarks/rank_fault:$PYTHONPATH FAULT_RANK=1 FAULT_AT_STEP=3 torchrun ... -m tigon.runtime train CONFIG

Python imports this module at start-up when its folder is on PYTHONPATH. In the process whose RANK is FAULT_RANK,
AdamW's step raises a RuntimeError on its FAULT_AT_STEP-th call (FAULT_KIND=raise, the default), or stops there
for good without a word (FAULT_KIND=hang: a rank stuck in I/O or a deadlock), while the other ranks go on into the
next step's collectives. FAULT_RANK=any picks every process started with these variables (one node's, where
the ranks are dealt by an elastic rendezvous). FAULT_WORLD_SIZE=N limits the fault to a job of N processes
(WORLD_SIZE), so that an elastic job's workers restarted at another size run on. Without FAULT_AT_STEP it does
nothing.
"""

import os
import time

world_size = os.environ.get("FAULT_WORLD_SIZE")
this_size = world_size is None or world_size == os.environ.get("WORLD_SIZE")
if (
    os.environ.get("FAULT_AT_STEP")
    and os.environ.get("FAULT_RANK", "1") in (os.environ.get("RANK"), "any")
    and this_size
):
    import torch.optim

    fault_at = int(os.environ["FAULT_AT_STEP"])
    hang = os.environ.get("FAULT_KIND", "raise") == "hang"
    adamw_step = torch.optim.AdamW.step
    calls = [0]

    def step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == fault_at:
            while hang:
                time.sleep(60)
            raise RuntimeError(f"injected fault on rank {os.environ['RANK']} at optimizer step {fault_at}")
        return adamw_step(self, *args, **kwargs)

    torch.optim.AdamW.step = step
