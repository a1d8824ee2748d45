"""The experts the engine routed each token to (rollout routing replay, "R3"): what a MoE sample carries.

``Sample.routed_experts`` is ``[P + G - 1, MoE layers, k]`` for a sample of P prompt and G generated tokens: for
every position the engine computed (the last generated token is never fed back), the experts of each routed layer,
in the model's layer order (dense layers dropped), as integers of the narrowest unsigned type that holds the expert
count. Position ``i`` is input position ``i`` of the trainer's forward over ``prompt + tokens``.

Two sources, one result:
- CUDA (vLLM's Model Runner V2): ``enable_return_routed_experts``; ``CompletionOutput.routed_experts`` is
  ``[positions, every hidden layer, k]`` (``completion_routes`` keeps the MoE layers).
- The CPU build (V1 runner, no such output): ``RouteRecorder`` on the routers' capture hook and the runner's batch
  layout (``megarl.compat.vllm_routes``). Each position keeps the rows of the step that first computed it: a
  request pre-empted by a weight push and prefilled again (partial rollout) keeps the rows it had, as vLLM emits
  each row once. Prefix caching is off while recording (a cached position is never computed, so it has no row).
"""

from __future__ import annotations

import torch


def routes_dtype(num_experts: int) -> torch.dtype:
    """The narrowest unsigned integer type that holds an expert id (uint8 up to 256 experts, as vLLM's)."""
    return torch.uint8 if num_experts <= 256 else torch.int32


def completion_routes(routed_experts, moe_layers: list[int], num_experts: int) -> torch.Tensor:
    """vLLM's ``CompletionOutput.routed_experts`` ([positions, hidden layers, k], every layer) as a sample's routes:
    the MoE layers' columns (``moe_layers``: their indices among the hidden layers)."""
    rows = torch.as_tensor(routed_experts)
    return rows[:, moe_layers].to(routes_dtype(num_experts)).contiguous()


class RouteRecorder:
    """Per engine request, the routes of every position computed so far, from the engine's routers (CPU).

    ``capture`` runs inside each routed layer's forward with that step's [tokens, k] expert ids; ``step`` runs after
    the step's forward with its batch layout and files the rows under each request's position."""

    def __init__(self, num_experts: int):
        self.dtype = routes_dtype(num_experts)
        self.layers: dict[int, torch.Tensor] = {}
        """Layer id -> the ids the last forward routed its tokens to (a profiling or dummy forward is overwritten
        by the step's own)."""
        self.rows: dict[str, list[torch.Tensor]] = {}
        """The caller's request id -> [positions, MoE layers, k] pieces, in position order."""
        self.count: dict[str, int] = {}
        """The caller's request id -> positions recorded so far."""

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.layers[layer] = topk_ids.detach().to(self.dtype, copy=True)

    def step(self, request_ids: list[str], scheduled: list[int], computed: list[int]) -> None:
        """One engine step's batch, in the order its tokens were laid out: each request's id inside the engine, the
        tokens it had scheduled and the positions computed before them (its first token's position)."""
        total = sum(scheduled)
        if total == 0 or not self.layers:
            return
        step = torch.stack([self.layers[k][:total] for k in sorted(self.layers)], dim=1)  # [tokens, layers, k]
        self.layers = {}
        offset = 0
        for engine_id, n, start in zip(request_ids, scheduled, computed):
            key = external_id(engine_id)
            have = self.count.get(key, 0)
            if start > have:
                raise RuntimeError(f"routes of request {key}: positions {have}..{start - 1} were never computed")
            if start + n > have:  # positions before ``have`` were computed again (a re-prefill): they keep their rows
                self.rows.setdefault(key, []).append(step[offset + have - start : offset + n])
                self.count[key] = start + n
            offset += n

    def take(self, request_id: str, positions: int) -> torch.Tensor:
        """The routes of a finished request (forgotten here): its first ``positions`` rows (``P + G - 1``)."""
        pieces, have = self.rows.pop(request_id, []), self.count.pop(request_id, 0)
        if have < positions:
            raise RuntimeError(f"routes of request {request_id}: {have} positions recorded, {positions} computed")
        return torch.cat(pieces)[:positions]

    def forget(self, request_ids) -> None:
        """Drop aborted requests' routes."""
        for request_id in request_ids:
            self.rows.pop(request_id, None)
            self.count.pop(request_id, None)

    def so_far(self, request_id: str) -> torch.Tensor | None:
        """The rows of a request in flight recorded so far (None: none yet)."""
        pieces = self.rows.get(request_id)
        return torch.cat(pieces)[: self.count[request_id]] if pieces else None

    def seed(self, request_id: str, rows: torch.Tensor) -> None:
        """A request continued after a resume (its prompt + tokens so far submitted again) keeps the rows its first
        computation recorded (``so_far`` before the checkpoint); positions computed again add nothing."""
        self.rows[request_id], self.count[request_id] = [rows.to(self.dtype)], len(rows)


class EngineRoutes:
    """A recording engine's routes per request, from either source: the CPU ``RouteRecorder``, or what vLLM reported
    when a request finished (CUDA). A request continued after a resume keeps its earlier rows (``resume``)."""

    def __init__(self, recorder: RouteRecorder | None, moe_layers: list[int], num_experts: int):
        self.recorder, self.moe_layers, self.num_experts = recorder, moe_layers, num_experts
        self.reported: dict[str, object] = {}
        """CUDA: finished streamed requests' ``routed_experts``, until taken."""
        self.earlier: dict[str, torch.Tensor] = {}
        """CUDA: resumed requests' rows from before the checkpoint."""

    def finished(self, request_id: str, completion) -> None:
        """A streamed request finished (its final ``CompletionOutput``)."""
        if self.recorder is None:
            self.reported[request_id] = completion.routed_experts

    def take(self, request_id: str, positions: int, completion=None) -> torch.Tensor:
        """A finished request's routes, ``[positions, MoE layers, k]`` (``completion``: its output, if at hand)."""
        if self.recorder is not None:
            return self.recorder.take(request_id, positions)
        reported = completion.routed_experts if completion is not None else self.reported.pop(request_id)
        rows = completion_routes(reported, self.moe_layers, self.num_experts)
        earlier = self.earlier.pop(request_id, None)
        if earlier is not None:
            rows = torch.cat([earlier.to(rows.dtype), rows[len(earlier) :]])
        return rows[:positions]

    def so_far(self, request_id: str) -> torch.Tensor | None:
        """A request in flight's rows so far, for a checkpoint (CUDA: vLLM reports them only at the end, so only
        what a resume brought)."""
        return self.recorder.so_far(request_id) if self.recorder is not None else self.earlier.get(request_id)

    def resume(self, request_id: str, rows: torch.Tensor) -> None:
        if self.recorder is not None:
            self.recorder.seed(request_id, rows)
        else:
            self.earlier[request_id] = rows

    def forget(self, request_ids) -> None:
        if self.recorder is not None:
            self.recorder.forget(request_ids)
        for request_id in request_ids:
            self.reported.pop(request_id, None)
            self.earlier.pop(request_id, None)


def external_id(request_id: str) -> str:
    """The caller's id of a request inside the engine: vLLM 0.32 appends '-' and 8 random hex digits to it
    (``InputProcessor.assign_request_id``) and reports the caller's."""
    return request_id.rsplit("-", 1)[0]
