"""Bytes that autograd keeps for backward, counted without a GPU: every tensor a forward saves passes through
``torch.autograd.graph.saved_tensors_hooks``. ``SavedBytes`` counts each storage once while any saved tensor still
refers to it (views of one storage are one allocation), leaves parameters out, and keeps the peak, so it sees what is
alive at the worst moment of a whole schedule: 1F1B's micro-batches in flight, a layer recomputed in backward."""

from __future__ import annotations

import torch


class _Held:
    """What the pack hook returns: the tensor, and a release of its storage's count when autograd drops it."""

    __slots__ = ("tensor", "_release")

    def __init__(self, tensor: torch.Tensor, release):
        self.tensor, self._release = tensor, release

    def __del__(self):
        self._release()


class SavedBytes:
    """``with SavedBytes(model.parameters()) as saved: <forward and backward>``; then ``saved.peak`` (bytes) and
    ``saved.live`` (what is still held)."""

    def __init__(self, parameters):
        self.excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self.excluded or nbytes == 0:
            return t.detach()
        if key not in self.refs:
            self.refs[key] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        return _Held(t.detach(), lambda: self._release(key, nbytes))  # detached: a saved output would hold its
        # own grad_fn, a cycle through the graph that nothing frees

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held
