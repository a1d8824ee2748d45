"""The rollout engines as the actor's pool sees them when they live on their own pool (``placement.pools``).

A weight sync is one collective over both pools: this side runs the sending half of the same plans
(``SyncPlans``) that the engines' ranks run in ``VLLMEngine.update_weights``, through the same executor (buckets,
hash verification). Generation happens on the rollout pool; the loop shares its batch with this pool.
"""

from __future__ import annotations

from megarl.config.schema import LoraConfig, RolloutConfig
from megarl.models.builder import DTYPES
from megarl.reshard.sync import SyncPlans, SyncReport, run_sync, sends_base
from megarl.rollout.vllm_engine import DEFAULT_TRANSPORT


class RemoteEngine:
    """The engines of the rollout pool, from a rank that only sends them weights."""

    def __init__(self, cfg: RolloutConfig, plans: SyncPlans, *, tp: int, dtype: str, comm, lora: LoraConfig | None):
        self.cfg, self.plans, self.tp, self.comm, self.lora = cfg, plans, tp, comm, lora
        self.dtype = DTYPES[dtype]
        self.transport = DEFAULT_TRANSPORT if cfg.transport == "auto" else cfg.transport
        self.weight_version: int | None = None
        self.base_loaded = False

    @property
    def adapter_slots(self) -> bool:
        return self.plans.adapters is not None

    def update_weights(
        self, src_tensors, version: int, *, transport: str | None = None, resend_base: bool = False, on_send=None
    ) -> SyncReport:
        """Collective over the launch: send this rank's pieces of ``version`` (the engines' ranks receive them)."""
        name = transport or self.transport
        self.weight_version = None
        parts = [self.plans.base(name)] if sends_base(self.adapter_slots, self.base_loaded, resend_base) else []
        parts += [self.plans.adapters] if self.adapter_slots else []
        reports = [
            run_sync(sub_plans, src_tensors, None, bucket_bytes=self.cfg.bucket_mb * 1024**2, verify=self.cfg.verify,
                     compare_full=self.cfg.verify_full, on_send=on_send, comm=self.comm, dtype=self.dtype)
            for sub_plans in parts
        ]  # fmt: skip
        self.base_loaded = True
        self.weight_version = version
        return sum(reports[1:], reports[0])

    def sleep(self) -> None:
        """Nothing to free: the engines use another pool's devices."""

    def wake(self) -> None:
        """Nothing to wake here (the engines' ranks wake their own)."""
