"""A rank started by hand, as under torchrun: ``python by_hand.py refit|plain HOST:PORT`` makes the default gloo
group itself (``init_method=tcp://...``), all-reduces its rank + 1 and closes the group (left open, a rank whose peer
exited first could abort in gloo's teardown at exit: exit -6 after its result, seen once in CI). With ``refit`` it
imports refit first (which pins gloo to ``REFIT_BIND_ADDRESS``'s interface); with ``plain`` it does not. Prints
``REFIT-RESULT <sum>`` or ``FAIL <error>`` (exit 3)."""

import os
import sys
from datetime import timedelta

if sys.argv[1] == "refit":
    import refit  # noqa: F401

import torch
import torch.distributed as dist

rank = int(os.environ["REFIT_RANK"])
try:
    dist.init_process_group(
        "gloo", init_method=f"tcp://{sys.argv[2]}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    dist.barrier()  # neither rank leaves while the other still uses the group: then both close it
    dist.destroy_process_group()
    print("REFIT-RESULT", int(x.item()), flush=True)
except RuntimeError as e:
    print("FAIL", " ".join(str(e).split())[:400], flush=True)
    sys.exit(3)
