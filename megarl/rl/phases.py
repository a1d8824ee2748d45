"""The phases of a step as one object: the only place that moves memory between generation and training, and that
pushes the actor's weights into the engine (``megarl plan`` models each phase)."""

from __future__ import annotations

from megarl.reshard.sync import SyncReport, push_actor


class Phases:
    """Colocated (``shared``): ``train()`` puts the engine to sleep (CUDA: vLLM frees its weights and KV cache; HF:
    its model is freed; vLLM on CPU: a logged no-op) and brings the offloaded training state back; ``rollout()``
    sends the state the ``offload.*`` flags name to host memory, syncs the weights if the engine lacks this version
    (the sync wakes the engine's weights) and wakes the engine. A step starts and ends in the rollout phase.

    With a rollout pool nothing shares devices: the engine stays awake, nothing is offloaded; only the weights
    cross (every rank takes part in the sync: the actor's send, the engines' receive)."""

    def __init__(self, engine, offloader, actor, *, shared: bool):
        """``actor``: this rank's actor model (None on a pool without it)."""
        self.engine, self.offloader, self.actor, self.shared = engine, offloader, actor, shared

    def offload(self) -> None:
        """Training state out (the flagged parts): before generation and before a sync."""
        if self.shared:
            self.offloader.offload()

    def train(self) -> None:
        if self.shared:
            self.engine.sleep()
            self.offloader.reload()

    def rollout(self, version: int) -> SyncReport | None:
        """Back to generation, the engine holding the actor's weights as ``version`` (the sync's report; None when
        it already held them)."""
        self.offload()
        report = None
        if self.engine.weight_version != version:
            report = push_actor(self.engine, self.actor, version)
        if self.shared:
            self.engine.wake()
        return report
