"""The resharding engine: a layout of every tensor on both sides (``layout``), a pure ``plan``, a bucketed transfer
``executor`` over torch.distributed, the ``transport`` into the rollout engine and the verified ``sync``."""
