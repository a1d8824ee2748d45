"""torch.distributed's default store, which torch keeps private: the stop requests of a colocated run are posted on
it (``megarl.trainer.preemption``); with pools the launch's own store is used (``megarl.parallel.pools``)."""

from __future__ import annotations

import torch.distributed as dist


def default_store() -> dist.Store:
    """The store the default process group rendezvoused on (only after ``init_process_group``)."""
    return dist.distributed_c10d._get_default_store()
