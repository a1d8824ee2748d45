"""What a run must carry from step to step (and what a checkpoint will save): a plain, serialisable object."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TrainerState:
    """The trainer's own state, apart from model and optimizer tensors."""

    step: int = 0
    """Last completed RL step (0: none yet); the engine then holds weight version ``step``."""
    seed: int = 1234
    """trainer.seed: parameter init, data order and sampling seeds derive from it."""
    data: dict = field(default_factory=lambda: {"epoch": 0, "position": 0})
    """The prompt sampler's position (``PromptSampler.state_dict``)."""
    kl_ctrl: dict = field(default_factory=dict)
    """The in-reward KL controller's state (``state_dict``)."""
    wandb_run_id: str | None = None
    """The W&B run to continue on resume."""
    skipped_steps: int = 0
    """RL steps whose update was skipped (non-finite loss or gradients) so far."""
    consecutive_skips: int = 0
    """Skipped RL steps in a row, up to the last one."""
    history: list[dict] = field(default_factory=list)
    """Every logged step's metrics (for metrics.jsonl on resume, the reward curve and the summary)."""
    pending_metrics: dict | None = None
    """Step ``step``'s metrics when the run was stopped during its validation: the resumed run validates that step
    again, then logs them with the validation's."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainerState:
        return cls(**d)
