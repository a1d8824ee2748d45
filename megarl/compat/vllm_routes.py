"""vLLM's V1 model runner (the CPU build's) records no routed experts: hooks that make it report them to a
``megarl.rollout.routes.RouteRecorder``.

- every MoE layer's router hands the logical top-k ids it routed to (before any EPLB mapping) to its
  ``capture_fn`` (``fused_moe/router/base_router.py``, ``BaseRouter._select_experts``; the hook vLLM's own
  capturer binds on Model Runner V2);
- the runner's ``execute_model`` is wrapped to report, after each step's forward, the batch's layout: the requests
  in the order their tokens were laid out (``input_batch.req_ids``), each one's scheduled tokens and the positions
  computed before them (``input_batch.num_computed_tokens_cpu``, what ``_prepare_inputs`` builds positions from).

In-process workers only (``distributed_executor_backend="external_launcher"``, as megarl runs vLLM)."""

from __future__ import annotations

import functools


def bind_route_capture(llm, recorder) -> list[int]:
    """Hook the engine's routers and model runner (this rank's worker); the MoE layers' ids, in order."""

    def bind(worker) -> list[int]:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = worker.model_runner
        layers = []
        for module in runner.get_model().modules():
            if isinstance(module, MoERunner):
                if not isinstance(module.router, BaseRouter):
                    raise ValueError(f"routed experts cannot be recorded from vLLM's {type(module.router).__name__}")
                module.router.set_capture_fn(functools.partial(recorder.capture, module.layer_id))
                layers.append(module.layer_id)
        execute = runner.execute_model

        @functools.wraps(execute)
        def execute_model(scheduler_output, *args, **kwargs):
            result = execute(scheduler_output, *args, **kwargs)
            batch = runner.input_batch
            ids = list(batch.req_ids[: batch.num_reqs])
            scheduled = [scheduler_output.num_scheduled_tokens.get(i, 0) for i in ids]
            recorder.step(ids, scheduled, batch.num_computed_tokens_cpu[: batch.num_reqs].tolist())
            return result

        runner.execute_model = execute_model
        return sorted(layers)

    return llm.collective_rpc(bind)[0]


def reroute(llm, percent: int) -> list[int]:
    """A test's disagreement (``MEGARL_FAULT=reroute@P``): the last MoE layer's router (of this rank's worker)
    replaces the last of its top-k experts by the one ranked k + 1 for the tokens whose first router logit, in
    thousandths, is below ``percent`` modulo 100 (a fixed ~``percent``% of its tokens, the same on every rank of the
    engine), the routing weights those experts' (renormalised over them when the router renormalises). The last
    layer only: no router after it reads what the changed experts compute, so every other (position, layer) pair
    is routed as without the fault. Returns the counts it keeps, [rerouted pairs, routed pairs of every layer]."""
    counts = [0, 0]

    def bind(worker) -> None:
        import torch
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runners = [m for m in worker.model_runner.get_model().modules() if isinstance(m, MoERunner)]
        router = max(runners, key=lambda m: m.layer_id).router
        compute, k, renormalize = router._compute_routing, router.top_k, getattr(router, "renormalize", True)

        def rerouted(hidden_states, router_logits, indices_type, **kwargs):
            weights, ids = compute(hidden_states, router_logits, indices_type, **kwargs)
            logits = router_logits.float()
            pick = (logits[:, 0] * 1000).floor().long() % 100 < percent
            ranked = logits.topk(k + 1, dim=-1).indices
            chosen = torch.cat([ranked[:, : k - 1], ranked[:, k:]], dim=-1)
            scores = logits.gather(1, chosen)
            new = torch.softmax(scores, -1) if renormalize else (scores - logits.logsumexp(-1, keepdim=True)).exp()
            counts[0] += int(pick.sum())
            counts[1] += pick.numel() * len(runners)
            pick = pick.unsqueeze(1)
            return (torch.where(pick, new, weights.float()).to(weights.dtype),
                    torch.where(pick, chosen, ids).to(ids.dtype))  # fmt: skip

        router._compute_routing = rerouted

    llm.collective_rpc(bind)
    return counts
