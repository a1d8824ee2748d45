"""A step's metrics under verl's names (reward/, response_length/, actor/, critic/, kl/, rollout/, sync/, timing/,
perf/, memory/), reduced over ranks where they are per-rank (sync bytes, memory)."""

from __future__ import annotations

import resource
import statistics

import torch
import torch.distributed as dist

from megarl.logging.plot import first_and_last

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
"""Dense bf16 peak FLOP/s per GPU by device-name fragment (no entry: no perf/mfu)."""


def _peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def rank_values(sync) -> tuple[dict[str, float], dict[str, float]]:
    """This rank's share of the step's per-rank metrics: what sums over ranks (sync bytes) and what is the largest
    over ranks (sync time, peak memory)."""
    memory = {"memory/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}
    if torch.cuda.is_available():
        memory["memory/peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1024**3
    sums = {"sync/bytes_sent": float(sync.bytes_sent), "sync/bytes_cross_node": float(sync.bytes_cross_node)}
    return sums, {"sync/seconds": sync.seconds, **memory}


def reduce_ranks(comm, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float]:
    """Collective: ``sums`` summed and ``maxes`` maximised over the default group (``comm`` None) or over ``comm``'s
    ranks (every pool; a key only some ranks have, such as ``pool/<name>/*``, is reduced over those)."""
    if comm is None:
        keys_s, keys_m = sorted(sums), sorted(maxes)
        s = torch.tensor([sums[k] for k in keys_s], dtype=torch.float64)
        m = torch.tensor([maxes[k] for k in keys_m], dtype=torch.float64)
        dist.all_reduce(s)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        return {**dict(zip(keys_s, s.tolist())), **dict(zip(keys_m, m.tolist()))}
    out: dict[str, float] = {}
    for rank_sums, rank_maxes in comm.all_gather_object((sums, maxes)):
        for k, v in rank_sums.items():
            out[k] = out.get(k, 0.0) + v
        for k, v in rank_maxes.items():
            out[k] = max(out.get(k, v), v)
    return out


def _model_metrics(prefix: str, update: dict[str, float]) -> dict[str, float]:
    """ppo_updates' keys -> logged names: grad_norm / lr get the model's prefix, ``max/`` is dropped."""
    out = {}
    for k, v in update.items():
        k = k.removeprefix("max/")
        out[f"{prefix}/{k}" if "/" not in k else k] = v
    return out


def _cat(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([r.double() for r in rows])


def lag_metrics(batch, learned, version: int) -> dict[str, float]:
    """One-step-off: per token, lag = the trainer's weight version when it trains (``version``) minus the version
    that generated the token; the log-prob mismatch (|pi_old - pi_rollout|) of the tokens of lag 0 and of lag > 0."""
    lags = torch.tensor([version - v for s in batch.samples for v, m in zip(s.weight_versions, s.model_mask) if m],
                        dtype=torch.float64)  # the model's tokens (an episode's observations have no log-prob)
    m = {"async/lag_mean": float(lags.mean()), "async/lag_max": float(lags.max())}
    if learned.old_logp is not None:
        diff = (_cat(learned.old_logp) - _cat(learned.rollout_logp)).abs()
        for name, tokens in (("lag0", lags == 0), ("lag1plus", lags > 0)):
            if tokens.any():
                m[f"async/logprob_mismatch_{name}"] = float(diff[tokens].mean())
    return m


def step_metrics(job, batch, learned, *, timer, version: int) -> dict[str, float]:
    """The step's metrics on the actor's ranks, but the per-rank ones (``rank_values``, reduced by the caller);
    ``version``: the actor's weight version before the step's update."""
    cfg, seqs = job.cfg, learned.seqs
    lengths = [len(s.token_ids) for s in batch.samples]
    scores = batch.scores
    m = {
        "reward/mean": statistics.fmean(scores),
        "reward/std": statistics.pstdev(scores),
        "reward/errors": float(batch.errors),
        "reward/timeouts": float(batch.timeouts),
        "response_length/mean": statistics.fmean(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/clip_ratio": sum(s.finish_reason == "length" for s in batch.samples) / len(lengths),
        "rollout/tokens_per_s": batch.generated_tokens / batch.generate_seconds if batch.generate_seconds else 0.0,
        "rollout/weight_version_min": float(min(s.weight_version for s in batch.samples)),
        "rollout/weight_version_max": float(max(max(s.weight_versions) for s in batch.samples)),
        "data/epoch": float(job.sampler.epoch),
    }
    m.update({f"reward/{k}": statistics.fmean(v) for k, v in batch.extra.items()})
    m.update(env_metrics(batch.samples))
    if batch.rm_scores:  # reward/mean is w_function x fn_mean + w_model x rm_mean
        m["reward/rm_mean"] = statistics.fmean(batch.rm_scores)
        m["reward/rm_std"] = statistics.pstdev(batch.rm_scores)
        m["reward/fn_mean"] = statistics.fmean(batch.fn_scores)
    if cfg.algorithm.overlong.enable:
        m["reward/overlong_penalty_mean"] = statistics.fmean(r - s for r, s in zip(batch.rewards, scores))
    if cfg.algorithm.dynamic_sampling.enable:
        m["dynamic_sampling/gen_rounds"] = float(batch.rounds)
        m["dynamic_sampling/dropped_groups"] = float(batch.dropped_groups)
    if job.cfg.async_training.overlapped:
        m.update(lag_metrics(batch, learned, version))
    m.update(_model_metrics("actor", learned.actor))
    m.update(_model_metrics("critic", learned.critic))
    m.update(learned.kl)
    if cfg.actor.kl_loss_coef > 0:  # the KL loss's coefficient; kl/coef is the in-reward one
        m["actor/kl_coef"] = cfg.actor.kl_loss_coef
    if learned.old_logp is not None:
        diff = (_cat(learned.old_logp) - _cat(learned.rollout_logp)).abs()
        m["rollout/logprob_mismatch_mean"] = float(diff.mean())
        m["rollout/logprob_mismatch_max"] = float(diff.max())
    if learned.values is not None:
        v, r = _cat(learned.values), _cat(learned.returns)
        m["critic/values_mean"] = float(v.mean())
        m["critic/returns_mean"] = float(r.mean())
        m["critic/explained_var"] = float(1 - (r - v).var() / r.var().clamp(min=1e-8))
    m.update(timer.metrics())
    step_seconds = timer.seconds["step"]
    tokens = sum(len(s.tokens) for s in seqs)
    m["perf/tokens_per_s"] = tokens / step_seconds
    m["perf/padding_frac"] = learned.packed.padding_frac  # padded positions / computed, over the step's passes
    m["perf/micro_batches"] = float(learned.packed.micro_batches)
    peak = _peak_flops()
    if peak and job.models is not None and job.models.actor is not None:  # the actor's pool (it logs)
        params = sum(p.numel() for p in job.models.actor.parameters()) * job.layout.tp * job.layout.pp
        m["perf/mfu"] = 6 * params * tokens * cfg.actor.ppo_epochs / (step_seconds * peak * job.layout.world_size)
    return m


ENV_COUNTS = ("tool_calls", "tool_errors", "errors", "timeouts", "truncated", "restarted_on_resume")
"""``env/`` metrics that count over the step's episodes; the others are means per episode."""


def env_metrics(samples, prefix: str = "env/") -> dict[str, float]:
    """Episodes (``Sample.env``): ``env/turns_mean``, ``env/turns_max``, the counts (``ENV_COUNTS``) and the mean per
    episode of the rest (tokens, step seconds, the environment's own info fields)."""
    rows = [s.env for s in samples if s.env is not None]
    if not rows:
        return {}
    turns = [r["turns"] for r in rows]
    m = {f"{prefix}turns_mean": statistics.fmean(turns), f"{prefix}turns_max": max(turns)}
    for key in sorted(set().union(*rows) - {"turns"}):
        values = [r.get(key, 0.0) for r in rows]
        m[f"{prefix}{key}"] = float(sum(values)) if key in ENV_COUNTS else statistics.fmean(values)
    return m


def validation_metrics(result, samples) -> dict[str, float]:
    return {
        "val/reward/mean": statistics.fmean(result.scores),
        "val/reward/errors": float(result.errors),
        "val/reward/timeouts": float(result.timeouts),
        "val/response_length/mean": statistics.fmean(len(s.token_ids) for s in samples),
        **env_metrics(samples, "val/env/"),
    }


def summary_lines(history: list[dict]) -> list[str]:
    """The end-of-run summary: reward over the first and last 10 steps (half the run when shorter), time, and
    validation (from the starting weights' at step 0, when it ran, to the last)."""
    steps = [h for h in history if h["step"] > 0]  # step 0: the validation before training, no update
    rewards = [h["reward/mean"] for h in steps]
    span, first, last = first_and_last(rewards)  # a 10-step run: its first 5 and its last 5
    seconds = sum(h["timing/step"] for h in steps)
    lines = [
        f"{len(steps)} steps in {seconds:.1f}s ({seconds / len(steps):.2f}s/step)",
        f"reward/mean: first {span} {first:.3f} -> last {span} {last:.3f} ({last - first:+.3f})",
    ]
    val = [h for h in history if "val/reward/mean" in h]
    if val and val[0]["step"] == 0 and len(val) > 1:
        (before, after), last = (v["val/reward/mean"] for v in (val[0], val[-1])), val[-1]["step"]
        lines.append(f"val/reward/mean: step 0 {before:.3f} -> step {last} {after:.3f} ({after - before:+.3f})")
    elif "val/reward/mean" in history[-1]:
        lines.append(f"val/reward/mean (last): {history[-1]['val/reward/mean']:.3f}")
    return lines
