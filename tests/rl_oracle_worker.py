"""The single-rank RL oracle (run as ``python -m tests.rl_oracle_worker HF_DIR OUT``; one process serves every case).

On one fixed batch, megarl's actor (and critic) gradient after its real update path (``ppo_updates`` with the
trainer's loss functions, two micro-batches; ``learn`` for rejection) is compared with an oracle: the HF model's
logits (transformers, the same weights) and the objective written out from the formulas in plain torch, one
sequence at a time, with no megarl code. The inputs are built so that every branch is taken: old log-probs put
tokens in each clip region, the engine's log-probs make some TIS weights truncate, the reference differs from the
policy (in one case 20x above it on every fourth token), advantages have both signs, responses have unequal lengths.
The truncated-sampling case draws its responses from the HF model under top-k / top-p, with vLLM's own kept set.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from functools import partial

import torch

B_PROMPT = [3, 5, 4, 6, 3, 7]
B_RESPONSE = [2, 7, 4, 9, 1, 5]
TEMPERATURE = 0.8
NORM_LEN = 16
CLIP_LOW, CLIP_HIGH, CLIP_C, IS_CAP = 0.2, 0.28, 3.0, 2.0
BASE = [
    "actor.optim.optimizer=sgd",
    "actor.optim.lr=0.01",
    "actor.optim.clip_grad=0",
    "critic.optim.optimizer=sgd",
    "critic.optim.lr=0.01",
    "critic.optim.clip_grad=0",
    "rollout.sampling.n=2",
    f"rollout.sampling.temperature={TEMPERATURE}",
    "data.train_batch_size=3",
    "actor.global_batch_size=6",
    "actor.micro_batch_size=2",
    "critic.micro_batch_size=2",
    f"actor.loss_agg_norm_len={NORM_LEN}",
    f"actor.clip_ratio_low={CLIP_LOW}",
    f"actor.clip_ratio_high={CLIP_HIGH}",
    f"actor.clip_ratio_c={CLIP_C}",
    f"algorithm.rollout_is_cap={IS_CAP}",
]
K3_LOGGED_MAX = 10.0
"""The trainer logs k3's value clamped at 10 (verl); the objective differentiated is the formula's, unclamped."""
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ---- the oracle: HF logits and the formulas, one sequence at a time ------------------------------------------------


def hf_response_logits(hf, seq: list[int], prompt_len: int) -> torch.Tensor:
    """Logits / T at the positions that predict the response tokens [R, V] (differentiable)."""
    logits = hf(torch.tensor([seq])).logits[0].float()
    return logits[prompt_len - 1 : len(seq) - 1] / TEMPERATURE


def token_logp(logits_RV: torch.Tensor, targets: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits_RV, -1)[torch.arange(len(targets)), torch.tensor(targets)]


def vllm_kept(logits_RV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[R, V] True where vLLM's sampler (its PyTorch top-k / top-p, the installed vllm) keeps the token."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    rows = logits_RV.shape[0]
    k = torch.full((rows,), top_k) if top_k else None
    p = torch.full((rows,), top_p) if top_p < 1 else None
    return torch.isfinite(apply_top_k_top_p_pytorch(logits_RV.detach().clone(), k, p, allow_cpu_sync=True))


def sampler_logp(logits_RV: torch.Tensor, targets: list[int], case: dict) -> torch.Tensor:
    """log p(target) under the case's sampler: log_softmax over vLLM's kept tokens (all without truncation)."""
    if case["top_k"] or case["top_p"] < 1:
        logits_RV = logits_RV.masked_fill(~vllm_kept(logits_RV, case["top_k"], case["top_p"]), float("-inf"))
    return token_logp(logits_RV, targets)


def token_entropy(logits_RV: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits_RV, -1)
    return -(p * torch.log_softmax(logits_RV, -1)).sum(-1)


def agg(per_seq: list[torch.Tensor], mode: str) -> torch.Tensor:
    """The formulas: token-mean = sum of all tokens / all tokens; seq-mean-token-sum = mean over sequences of their
    sums; seq-mean-token-mean = mean over sequences of their means; seq-mean-token-sum-norm = mean over sequences of
    their sums / NORM_LEN (Dr. GRPO)."""
    n = len(per_seq)
    if mode == "token-mean":
        return sum(x.sum() for x in per_seq) / sum(len(x) for x in per_seq)
    if mode == "seq-mean-token-sum":
        return sum(x.sum() for x in per_seq) / n
    if mode == "seq-mean-token-mean":
        return sum(x.mean() for x in per_seq) / n
    if mode == "seq-mean-token-sum-norm":
        return sum(x.sum() for x in per_seq) / (n * NORM_LEN)
    raise ValueError(mode)


def kl(logp: torch.Tensor, ref: torch.Tensor, old: torch.Tensor, kind: str, k3_max: float | None = None):
    """k2 = (log(pi/ref))^2 / 2; k3 = ref/pi - log(ref/pi) - 1 (Schulman); k3_is = k3 x pi / pi_old (pi_old: the
    sampling policy, a constant). ``k3_max``: k3 clamped there (what a trainer may log; never differentiated)."""
    if kind == "k2":
        return 0.5 * (logp - ref) ** 2
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    k3 = k3 if k3_max is None else k3.clamp(max=k3_max)
    return k3 * torch.exp(logp - old) if kind == "k3_is" else k3


def ppo_token_loss(logp, old, adv) -> tuple[torch.Tensor, dict]:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), and for A < 0 at most -A c (dual clip)."""
    r = torch.exp(logp - old)
    loss = torch.maximum(-adv * r, -adv * r.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    loss = torch.where(adv < 0, torch.minimum(loss, -adv * CLIP_C), loss)
    rd = r.detach()
    regions = {
        "high": ((adv > 0) & (rd > 1 + CLIP_HIGH)).sum().item(),
        "low": ((adv < 0) & (rd < 1 - CLIP_LOW)).sum().item(),
        "dual": ((adv < 0) & (rd > CLIP_C)).sum().item(),
    }
    return loss, regions


def gspo_seq_loss(logp, old, adv_scalar) -> torch.Tensor:
    """GSPO (Zheng et al. 2025): s = (pi(y|x) / pi_old(y|x))^(1/|y|), loss = max(-A s, -A clip(s, 1-eps, 1+eps))."""
    s = torch.exp((logp - old).mean())
    return torch.maximum(-adv_scalar * s, -adv_scalar * s.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))


# ---- the fixed batch -----------------------------------------------------------------------------------------------


def fixed_sequences(vocab: int):
    gen = torch.Generator().manual_seed(11)
    out = []
    for p, r in zip(B_PROMPT, B_RESPONSE):
        out.append((torch.randint(3, vocab, (p + r,), generator=gen).tolist(), p))
    return out


def truncated_sequences(hf, seqs, top_k: int, top_p: float) -> list[tuple[list[int], int]]:
    """``seqs``' prompts with responses of the same lengths drawn token by token from the HF model under vLLM's
    top-k / top-p at TEMPERATURE (a fixed generator): every response token is in the sampler's kept set."""
    gen = torch.Generator().manual_seed(14)
    out = []
    with torch.no_grad():
        for seq, p in seqs:
            tokens = list(seq[:p])
            for _ in range(len(seq) - p):
                z = hf(torch.tensor([tokens])).logits[0, -1:].float() / TEMPERATURE
                z = z.masked_fill(~vllm_kept(z, top_k, top_p), float("-inf"))
                tokens.append(int(torch.multinomial(torch.softmax(z, -1), 1, generator=gen)))
            out.append((tokens, p))
    return out


def fixed_inputs(cur: list[torch.Tensor], *, per_sequence_adv: bool, far_ref: bool = False) -> dict[str, list]:
    """old / rollout / reference log-probs and advantages around the current log-probs ``cur`` (detached).

    Token k of the batch (in order) gets old = cur + DELTA[k % 6] and a sign of A that alternates every 6 tokens, so
    ratios 1.82 with A > 0 clip high, 0.55 with A < 0 clip low, 4.48 with A < 0 hit the dual clip; every 5th token's
    engine log-prob is 1 below old (TIS weight e > cap). GSPO (``per_sequence_adv``): one A and one shift per
    sequence (sequences 0 and 1 outside the clip range, one each way). ``far_ref``: every 4th token's reference is
    20x its policy probability (log-ratio 3.0, beyond where a clamp of k3 at 10 binds)."""
    gen = torch.Generator().manual_seed(12)
    delta = [-0.6, 0.6, -1.5, 0.05, -0.1, 0.1]
    old, rollout, ref, adv, k = [], [], [], [], 0
    for i, c in enumerate(cur):
        n = len(c)
        ks = torch.arange(k, k + n)
        if per_sequence_adv:
            sign = 1.0 if i % 2 == 0 else -1.0
            shift = {0: -0.5, 1: 0.5}.get(i, 0.03 * (i - 3))
            o = c + shift + 0.02 * torch.randn(n, generator=gen)
            a = torch.full((n,), sign * (0.5 + 0.25 * i))
        else:
            o = c + torch.tensor([delta[int(j) % 6] for j in ks])
            sign = torch.tensor([1.0 if (int(j) // 6) % 2 == 0 else -1.0 for j in ks])
            a = sign * (0.5 + torch.rand(n, generator=gen))
        ro = o - torch.where(ks % 5 == 0, 1.0, 0.05 * torch.randn(n, generator=gen))
        old.append(o)
        rollout.append(ro)
        noise = 0.3 * torch.randn(n, generator=gen)
        ref.append(c + torch.where(ks % 4 == 0, math.log(20), noise) if far_ref else c + noise)
        adv.append(a)
        k += n
    return {"old_logp": old, "rollout_logp": rollout, "ref_logp": ref, "advantages": adv}


def _case(policy="ppo", agg="token-mean", kl=None, kl_coef=0.0, ent=0.0, tis=None, level="sequence", cap=IS_CAP,
          old=True, far_ref=False, top_k=0, top_p=1.0) -> dict:  # fmt: skip
    """One actor case: ``tis`` the rollout_is mode (None: off), ``old`` False: no old log-prob pass (old = current);
    ``far_ref``: ``fixed_inputs``'s; ``top_k`` / ``top_p``: the sampler's truncation (responses drawn under it)."""
    return dict(policy=policy, agg=agg, kl=kl, kl_coef=kl_coef, ent=ent, tis=tis, level=level, cap=cap, old=old,
                far_ref=far_ref, top_k=top_k, top_p=top_p)  # fmt: skip


ACTOR_CASES = {
    # every term at once: PPO (clip-higher, dual clip) + k3 KL loss + entropy bonus + TIS
    "all_terms": _case(kl="k3", kl_coef=0.2, ent=0.05, tis="token_truncate"),
    "gspo": _case(policy="gspo", agg=None),
    "gspo_tis": _case(policy="gspo", agg=None, tis="token_truncate"),
    **{f"kl_{k}": _case(kl=k, kl_coef=0.5) for k in ("k2", "k3_is")},
    **{f"agg_{m}": _case(agg=m, kl="k3", kl_coef=0.1, ent=0.02, tis="token_truncate") for m in AGG_MODES[1:]},
    # the async modes' decoupled objective, lag > 0: pi (this forward) != pi_prox (old) != behaviour (rollout)
    "async_token_truncate": _case(kl="k3_is", kl_coef=0.2, tis="token_truncate"),
    "async_seq_mask": _case(tis="seq_mask", cap=4.0),
    "async_seq_mask_geometric": _case(tis="seq_mask", level="geometric", cap=1.5),
    "no_old_logprob_pass": _case(tis="token_truncate", old=False),
    # a reference far above the policy: k3's gradient where a clamp of its value would bind
    **{f"far_ref_{k}": _case(kl=k, kl_coef=0.5, far_ref=True) for k in ("k3", "k3_is")},
    # the sampler's top-k / top-p with a KL term, an entropy bonus (on the whole softmax) and TIS
    "truncated_kl": _case(kl="k3_is", kl_coef=0.3, ent=0.05, tis="token_truncate", top_k=40, top_p=0.8),
}


def actor_overrides(case: dict) -> list[str]:
    out = [f"actor.policy_loss={case['policy']}", f"actor.entropy_coeff={case['ent']}"]
    if case["tis"]:
        out += [f"algorithm.rollout_is={case['tis']}", f"algorithm.rollout_is_level={case['level']}",
                f"algorithm.rollout_is_cap={case['cap']}"]  # fmt: skip
    if case["agg"]:
        out.append(f"actor.loss_agg_mode={case['agg']}")
    if case["kl"]:
        out += [f"actor.kl_loss_coef={case['kl_coef']}", f"actor.kl_loss_type={case['kl']}"]
    return out + [f"rollout.sampling.top_k={case['top_k']}", f"rollout.sampling.top_p={case['top_p']}"]


def behaviour_weight(old: torch.Tensor, behaviour: torch.Tensor, case: dict) -> torch.Tensor | None:
    """Per token, the weight pi_old / pi_behaviour the objective applies: truncated at the cap per token; or, for
    seq_mask, the sequence's statistic (product of the token ratios, or their geometric mean) when it lies in
    [1/cap, cap]; None when the sequence is rejected (it leaves the objective and its denominators)."""
    ratio = torch.exp(old - behaviour)
    if case["tis"] == "token_truncate":
        return ratio.clamp(max=case["cap"])
    if case["tis"] == "seq_mask":
        r = ratio.prod() if case["level"] == "sequence" else ratio.prod() ** (1 / len(ratio))
        return r.expand_as(ratio) if 1 / case["cap"] <= r <= case["cap"] else None
    return torch.ones_like(ratio)


def gspo_token_terms(logp, old, adv, weight) -> torch.Tensor:
    """GSPO per token: s_t = sg[s] pi_t / sg[pi_t] (value s, the sequence ratio), loss max(-A s_t, -A clip(s_t)),
    each token's term times its behaviour weight; the sequence's term is their mean."""
    s_t = torch.exp((logp - old).mean().detach() + logp - logp.detach())
    return weight * torch.maximum(-adv * s_t, -adv * s_t.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))


def oracle_actor(hf, seqs, inputs, case: dict) -> dict:
    """The objective from the formulas and its gradient on the HF model's parameters."""
    hf.zero_grad()
    pg_terms, kl_terms, kl_logged, ent_terms, regions = [], [], [], [], {"high": 0, "low": 0, "dual": 0}
    accepted = []
    for i, (seq, p) in enumerate(seqs):
        logits = hf_response_logits(hf, seq, p)
        logp = sampler_logp(logits, seq[p:], case)
        old = inputs["old_logp"][i] if case["old"] else logp.detach()
        adv = inputs["advantages"][i]
        weight = behaviour_weight(old, inputs["rollout_logp"][i], case)
        accepted.append(weight is not None)
        if weight is None:
            continue
        if case["policy"] == "gspo" and not case["tis"]:
            pg_terms.append(gspo_seq_loss(logp, old, adv[0]).reshape(1))
        elif case["policy"] == "gspo":
            pg_terms.append(gspo_token_terms(logp, old, adv, weight).mean().reshape(1))
        else:
            loss, r = ppo_token_loss(logp, old, adv)
            pg_terms.append(loss * weight)
            regions = {k: regions[k] + r[k] for k in regions}
        if case["kl"]:  # tokens from the behaviour policy: each weighed by min(pi_old / pi_behaviour, cap) with TIS on
            kl_w = torch.exp(old - inputs["rollout_logp"][i]).clamp(max=case["cap"]) if case["tis"] else 1.0
            kl_terms.append(kl_w * kl(logp, inputs["ref_logp"][i], old, case["kl"]))
            kl_logged.append(kl_w * kl(logp, inputs["ref_logp"][i], old, case["kl"], K3_LOGGED_MAX).detach())
        ent_terms.append(token_entropy(logits))  # of the whole softmax, whatever the sampler truncates
    mode = case["agg"] or "token-mean"
    pg = agg(pg_terms, "seq-mean-token-sum" if case["policy"] == "gspo" else mode)  # GSPO: one term per sequence
    ent = agg(ent_terms, mode)
    total = pg - case["ent"] * ent
    out = {"pg_loss": pg.item(), "entropy": ent.item(), "regions": regions, "accepted": accepted}
    if case["kl"]:
        kl_loss = agg(kl_terms, mode)
        total = total + case["kl_coef"] * kl_loss
        out["kl_loss"] = agg(kl_logged, mode).item()
        out["kl_loss_unclamped"] = kl_loss.item()
    total.backward()
    out["grads"] = {n: p.grad.detach().clone() for n, p in hf.named_parameters()}
    return out


# ---- megarl: the trainer's update path -----------------------------------------------------------------------------


def as_hf(tensors: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    """Megatron-named tensors (one per parameter) under their HF name(s)."""
    from megarl.models.adapter import tensor_maps, to_hf

    out = {}
    for tmap in tensor_maps(spec):
        if tmap.megatron in tensors:
            out.update(zip(tmap.hf, to_hf(tmap, tensors[tmap.megatron], spec)))
    return out


def megatron_grads_as_hf(model, spec) -> dict[str, torch.Tensor]:
    """Each parameter's ``main_grad`` (the gradient of the optimizer step just taken) under its HF name(s)."""
    return as_hf({n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}, spec)


def restore(model, saved: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)


def run(hf_dir: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from megarl.backend.batch import Batching, Sequence
    from megarl.backend.losses import actor_loss
    from megarl.backend.models import build_rl_models
    from megarl.backend.update import ppo_updates
    from megarl.config.loader import load_config
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.source import model_source
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.rl.step import seq_mask_accepted

    spec = spec_from_hf_config(read_hf_config(hf_dir))
    layout = ParallelLayout()
    init_distributed(layout, seed=1)
    base = load_config(None, [f"model.path={hf_dir}", *BASE, "algorithm.adv_estimator=gae"])
    models = build_rl_models(base, spec, layout, model_source(hf_dir), dist.get_rank())
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    seqs = fixed_sequences(spec.vocab_size)
    msg = [Sequence(s, p) for s, p in seqs]
    saved = [p.detach().clone() for p in models.actor.parameters()]
    out = {"actor": {}}
    for name, case in ACTOR_CASES.items():
        truncated = case["top_k"] or case["top_p"] < 1
        case_seqs = truncated_sequences(hf, seqs, case["top_k"], case["top_p"]) if truncated else seqs
        with torch.no_grad():
            cur = [sampler_logp(hf_response_logits(hf, s, p), s[p:], case) for s, p in case_seqs]
        cfg = load_config(None, [f"model.path={hf_dir}", *BASE, *actor_overrides(case)])
        inputs = fixed_inputs(cur, per_sequence_adv=case["policy"] == "gspo", far_ref=case["far_ref"])
        unused = {"ref_logp"} if not case["kl"] else set()
        unused |= {"old_logp"} if not case["old"] else set()
        fields = {k: v for k, v in inputs.items() if k not in unused}
        trained = None
        if case["tis"] == "seq_mask":  # decided before the update, as ``learn`` does
            trained, _ = seq_mask_accepted(inputs["old_logp"], inputs["rollout_logp"], cfg.algorithm)
        metrics = ppo_updates(
            models.actor,
            models.actor_optim,
            [Sequence(s, p) for s, p in case_seqs],
            fields,
            partial(actor_loss, cfg.actor, cfg.algorithm, temperature=TEMPERATURE, true_vocab=spec.vocab_size,
                    top_k=case["top_k"], top_p=case["top_p"]),  # fmt: skip
            Batching(len(msg), 0, 2),
            epochs=1,
            norm_len=NORM_LEN,
            trained=trained,
        )
        out["actor"][name] = {
            "megarl": {"metrics": metrics, "grads": megatron_grads_as_hf(models.actor, spec), "accepted": trained},
            "oracle": oracle_actor(hf, case_seqs, inputs, case),
        }
        restore(models.actor, saved)
    with torch.no_grad():
        cur = [token_logp(hf_response_logits(hf, s, p), s[p:]) for s, p in seqs]
    out["seq_mask"] = seq_mask_case(hf, hf_dir, spec, models, seqs, cur)
    restore(models.actor, saved)
    out["critic"] = critic_case(hf, base, spec, models, seqs, msg)
    out["empty_minibatch"] = empty_minibatch_case(hf_dir, spec, layout, msg, cur)
    out["reference_truncated"] = reference_truncation_case(hf, hf_dir, spec, layout, seqs)
    out["pinned_dp1"] = {dtype: pinned_step(hf_dir, 1, dtype) for dtype in ("float32", "bfloat16")}
    return out


def _tensors(tree) -> list[torch.Tensor]:
    """Every tensor of a (nested) state dict, in a fixed order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    return []


def reference_truncation_case(hf, hf_dir, spec, layout, seqs) -> dict:
    """top_p 0.8, top_k 40 and a KL term, the reference equal to the policy (no update yet): the trainer's actor and
    reference log-probs (``Roles``) of responses drawn under that sampler, and the oracle's (vLLM's kept set on the
    HF logits), and the reference's over the whole vocabulary (what it gave before: KL -log ref(kept) > 0)."""
    from megarl.backend.batch import Sequence
    from megarl.backend.models import build_rl_models
    from megarl.config.loader import load_config
    from megarl.models.source import model_source
    from megarl.rl.roles import make_roles

    case = _case(kl="k3_is", kl_coef=0.1, top_k=40, top_p=0.8)
    cfg = load_config(None, [f"model.path={hf_dir}", *BASE, *actor_overrides(case)])
    models = build_rl_models(cfg, spec, layout, model_source(hf_dir), 0, roles=("actor", "reference"))
    drawn = truncated_sequences(hf, seqs, case["top_k"], case["top_p"])
    roles = make_roles(cfg, spec, models)
    msg = [Sequence(s, p) for s, p in drawn]
    with torch.no_grad():
        oracle = [sampler_logp(hf_response_logits(hf, s, p), s[p:], case) for s, p in drawn]
        whole = [token_logp(hf_response_logits(hf, s, p), s[p:]) for s, p in drawn]
    return {"actor": roles.actor.logprobs(msg), "reference": roles.reference.logprobs(msg), "oracle": oracle,
            "whole_vocabulary": whole}  # fmt: skip


def empty_minibatch_case(hf_dir, spec, layout, msg, cur) -> dict:
    """Adam with weight decay and LR warmup, mini-batches of 3: an update whose first mini-batch has every sequence
    rejected against an update on the second mini-batch alone, each on a fresh copy of the initial weights."""
    from megarl.backend.batch import Batching
    from megarl.backend.losses import actor_loss
    from megarl.backend.models import build_rl_models
    from megarl.backend.update import ppo_updates
    from megarl.config.loader import load_config
    from megarl.models.source import model_source

    cfg = load_config(None, [f"model.path={hf_dir}", *BASE, "actor.optim.optimizer=adam", "actor.optim.lr=0.001",
                             "actor.optim.weight_decay=0.1", "actor.optim.lr_warmup_steps=4",
                             "algorithm.adv_estimator=grpo"])  # fmt: skip
    inputs = fixed_inputs(cur, per_sequence_adv=False)
    fields = {k: inputs[k] for k in ("old_logp", "rollout_logp", "advantages")}
    loss = partial(actor_loss, cfg.actor, cfg.algorithm, temperature=TEMPERATURE, true_vocab=spec.vocab_size)
    runs = {}
    for name, rows, trained in (("skipped", slice(0, 6), [False] * 3 + [True] * 3), ("without", slice(3, 6), None)):
        models = build_rl_models(cfg, spec, layout, model_source(hf_dir), 0, roles=("actor",))
        initial = [p.detach().clone() for p in models.actor.parameters()]
        metrics = ppo_updates(models.actor, models.actor_optim, msg[rows], {k: v[rows] for k, v in fields.items()},
                              loss, Batching(3, 0, 2), epochs=1, norm_len=NORM_LEN, scheduler=models.actor_sched,
                              trained=trained)  # fmt: skip
        runs[name] = {
            "metrics": metrics,
            "moved": any(not torch.equal(p, q) for p, q in zip(models.actor.parameters(), initial)),
            "weights": [p.detach().clone() for p in models.actor.parameters()],
            "optimizer": [t.clone() for t in _tensors(models.actor_optim.state_dict())],
            "sched_steps": models.actor_sched.num_steps,
            "lr": models.actor_optim.param_groups[0]["lr"],
        }
    return runs


def seq_mask_case(hf, hf_dir, spec, models, seqs, cur) -> dict:
    """``learn`` with rollout_is=seq_mask: sequence 1's engine log-probs are 0.5 per token below the trainer's (ratio
    e^3.5 > cap over its 7 tokens: rejected), the others within noise. Oracle: the token-mean policy gradient over
    the accepted sequences only, each weighed by its sequence ratio (the first mini-batch's ratio is 1: the loss is
    -A w per token), with megarl's advantages (checked against hand values by the test)."""
    from megarl.algos import kl_controller
    from megarl.config.loader import load_config
    from megarl.rl.collect import Collected
    from megarl.rl.roles import make_roles
    from megarl.rl.step import learn
    from megarl.rl.timer import PhaseTimer
    from megarl.rollout.protocol import Sample

    cfg = load_config(None, [f"model.path={hf_dir}", *BASE, "algorithm.adv_estimator=grpo",
                             "algorithm.rollout_is=seq_mask"])  # fmt: skip
    batch = Collected()
    rewards = [1.0, 0.0, 0.2, 0.9, 0.5, 0.1]
    for i, ((seq, p), c) in enumerate(zip(seqs, cur)):
        engine_logp = c - (0.5 if i == 1 else 0.01 * (-1) ** i)
        batch.samples.append(Sample(i // 2, i % 2, seq[:p], seq[p:], engine_logp.tolist(), "stop", [0] * len(seq[p:])))
    batch.rewards = batch.scores = rewards
    actor_only = dataclasses.replace(models, critic=None, reference=None)
    learned = learn(cfg, make_roles(cfg, spec, actor_only), batch, kl_ctrl=kl_controller("fixed", 0.0, 0.1, 1000),
                    skip_old_logprob=False, timer=PhaseTimer())  # fmt: skip
    hf.zero_grad()
    log_ratios = [float((c - torch.tensor(s.logprobs)).sum()) for c, s in zip(cur, batch.samples)]
    accepted = [abs(r) <= math.log(IS_CAP) for r in log_ratios]
    terms = []
    for (seq, p), adv, keep, r in zip(seqs, learned.advantages, accepted, log_ratios):
        if keep:  # masked importance sampling: the accepted sequence keeps its weight pi_old(y) / pi_rollout(y)
            logp = token_logp(hf_response_logits(hf, seq, p), seq[p:])
            terms.append(-adv * torch.exp(logp - logp.detach()) * math.exp(r))
    agg(terms, "token-mean").backward()
    return {
        "accepted": accepted,
        "weights": [math.exp(r) for r in log_ratios],
        "advantages": [a.clone() for a in learned.advantages],
        "metrics": learned.actor,
        "megarl": megatron_grads_as_hf(models.actor, spec),
        "oracle": {n: p.grad.detach().clone() for n, p in hf.named_parameters()},
    }


def critic_case(hf, base, spec, models, seqs, msg) -> dict:
    """The critic's clipped value loss: values = the HF model's last hidden state (after the final norm) times the
    critic's head (set to random weights here, so gradients reach the body), in plain torch; old values perturbed so
    that some tokens clip, returns of both signs."""
    from megarl.backend.batch import Batching
    from megarl.backend.losses import critic_loss
    from megarl.backend.update import ppo_updates

    gen = torch.Generator().manual_seed(13)
    head = models.critic.module.output_layer
    with torch.no_grad():
        head.weight.copy_(0.3 * torch.randn(head.weight.shape, generator=gen))
        head.bias.copy_(torch.tensor([0.1]))
    w, b = head.weight.detach().clone().requires_grad_(), head.bias.detach().clone().requires_grad_()
    clip = base.critic.cliprange_value
    hf.zero_grad()
    old, returns, terms, clipped = [], [], [], 0
    for seq, p in seqs:
        h = hf.model(torch.tensor([seq])).last_hidden_state[0, p - 1 : len(seq) - 1].float()
        v = h @ w[0] + b[0]
        n = len(v)
        o = v.detach() + torch.where(torch.arange(n) % 3 == 0, 2.0 * clip, 0.1 * clip * torch.randn(n, generator=gen))
        ret = torch.randn(n, generator=gen)
        vc = o + (v - o).clamp(-clip, clip)
        terms.append(0.5 * torch.maximum((v - ret) ** 2, (vc - ret) ** 2))
        clipped += int(((vc.detach() - ret) ** 2 > (v.detach() - ret) ** 2).sum())
        old.append(o)
        returns.append(ret)
    loss = agg(terms, base.critic.loss_agg_mode)
    loss.backward()
    metrics = ppo_updates(
        models.critic,
        models.critic_optim,
        msg,
        {"old_values": old, "returns": returns},
        partial(critic_loss, base.critic),
        Batching(len(msg), 0, 2),
        epochs=1,
        norm_len=NORM_LEN,
    )
    mine = megatron_grads_as_hf(models.critic, spec)
    mine.pop("lm_head.weight", None)  # the value head is not a vocabulary projection
    oracle = {n: p.grad.detach().clone() for n, p in hf.model.named_parameters()}
    return {
        "megarl": {"metrics": metrics, "grads": mine,
                   "head": (head.weight.main_grad.clone(), head.bias.main_grad.clone())},
        "oracle": {"vf_loss": loss.item(), "clipped": clipped, "grads": {f"model.{n}": g for n, g in oracle.items()},
                   "head": (w.grad.clone(), b.grad.clone())},
    }  # fmt: skip


# ---- the pinned step: one GRPO update with Adam and clipping, the trainer's ``learn`` against the formulas -------

PINNED_REWARDS = [1.0, 0.0, 0.5, 0.2, 0.9, 0.1]
"""The fixed batch's rewards, in 2 groups of 3 samples (``fixed_sequences``: prompts 0 and 1)."""
PINNED_GROUP = 3
PINNED_ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, clip=0.5)
"""Adam as the recipes use it (no weight decay, no warm-up); the gradient's norm (8.56 here) is clipped to 0.5."""


def pinned_overrides(hf_dir: str, dp: int, dtype: str) -> list[str]:
    a = PINNED_ADAM
    return [
        f"model.path={hf_dir}",
        f"model.dtype={dtype}",
        "algorithm.adv_estimator=grpo",
        f"rollout.sampling.n={PINNED_GROUP}",
        f"rollout.sampling.temperature={TEMPERATURE}",
        f"data.train_batch_size={len(PINNED_REWARDS) // PINNED_GROUP}",
        f"actor.global_batch_size={len(PINNED_REWARDS)}",
        "actor.micro_batch_size=2",
        f"actor.parallel.dp={dp}",
        "actor.optim.optimizer=adam",
        f"actor.optim.lr={a['lr']}",
        f"actor.optim.adam_beta1={a['beta1']}",
        f"actor.optim.adam_beta2={a['beta2']}",
        f"actor.optim.adam_eps={a['eps']}",
        f"actor.optim.clip_grad={a['clip']}",
    ]


def pinned_step(hf_dir: str, dp: int, dtype: str = "float32") -> dict:
    """Collective (a process group of ``dp`` ranks at TP=PP=1 exists): in ``model.dtype=dtype``, the trainer's
    ``learn`` (GRPO advantages from the rewards, the clipped PPO loss with old = current, Megatron's clipping and Adam
    step) on the fixed batch; its metrics, advantages, gradient (as Megatron holds it after the step: clipped) and
    weights before and after, by HF name."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from megarl.algos import kl_controller
    from megarl.backend.models import build_rl_models
    from megarl.config.loader import load_config
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.source import model_source
    from megarl.parallel.layout import ParallelLayout
    from megarl.rl.collect import Collected
    from megarl.rl.roles import make_roles
    from megarl.rl.step import learn
    from megarl.rl.timer import PhaseTimer
    from megarl.rollout.protocol import Sample

    cfg = load_config(None, pinned_overrides(hf_dir, dp, dtype))
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    models = build_rl_models(cfg, spec, ParallelLayout(dp=dp), model_source(hf_dir), dist.get_rank(), roles=("actor",))
    params = dict(models.actor.module.named_parameters())
    initial = as_hf({n: p.detach().float().clone() for n, p in params.items()}, spec)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    batch = Collected()
    for i, (seq, p) in enumerate(fixed_sequences(spec.vocab_size)):
        with torch.no_grad():  # the engine's log-probs: the policy's own (on-policy)
            engine = token_logp(hf_response_logits(hf, seq, p), seq[p:]).tolist()
        batch.samples.append(Sample(i // PINNED_GROUP, i % PINNED_GROUP, seq[:p], seq[p:], engine, "stop",
                                    [0] * (len(seq) - p)))  # fmt: skip
    batch.rewards = batch.scores = list(PINNED_REWARDS)
    learned = learn(cfg, make_roles(cfg, spec, models), batch, kl_ctrl=kl_controller("fixed", 0.0, 0.1, 1000),
                    skip_old_logprob=True, timer=PhaseTimer())  # fmt: skip
    return {
        "metrics": learned.actor,
        "advantages": [a.clone() for a in learned.advantages],
        "grads": megatron_grads_as_hf(models.actor, spec),
        "initial": initial,
        "weights": as_hf({n: p.detach().float().clone() for n, p in params.items()}, spec),
    }


def pinned_step_on_ranks(hf_dir: str) -> dict:
    """``pinned_step`` at DP = the world size in fp32 and in bf16 (for ``run_on_ranks``)."""
    import torch.distributed as dist

    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    dp = int(os.environ["WORLD_SIZE"])
    init_distributed(ParallelLayout(dp=dp), seed=1)
    out = {dtype: pinned_step(hf_dir, dp, dtype) for dtype in ("float32", "bfloat16")}
    dist.barrier()
    return out


def grpo_advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO (Shao et al. 2024): (r - mean of its group) / (the group's unbiased std + 1e-6)."""
    out = []
    for g in range(0, len(rewards), group):
        r = torch.tensor(rewards[g : g + group], dtype=torch.float64)
        out += ((r - r.mean()) / (r.std() + 1e-6)).tolist()
    return out


def oracle_pinned_step(hf, seqs) -> dict:
    """The formulas: token-mean of -A_i ratio_t with ratio = pi / sg(pi) = 1 (old = current) over the batch's
    response tokens; its gradient g on the HF parameters; clipped as Megatron does, g * min(1, c / (|g| + 1e-6)) with
    |g| the global norm; one Adam step from m = v = 0 (``steps``, subtracted from the weights): m = (1 - b1) g,
    v = (1 - b2) g^2, step = lr (m / (1 - b1)) / (sqrt(v / (1 - b2)) + eps)."""
    a = PINNED_ADAM
    adv = grpo_advantages(PINNED_REWARDS, PINNED_GROUP)
    hf.zero_grad()
    terms = []
    for (seq, p), A in zip(seqs, adv):
        logp = token_logp(hf_response_logits(hf, seq, p), seq[p:])
        terms.append(-A * torch.exp(logp - logp.detach()))
    loss = agg(terms, "token-mean")
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters()}
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    coeff = min(1.0, a["clip"] / (norm + 1e-6))
    steps = {}
    for n, g in grads.items():
        g = g.double() * coeff
        m, v = (1 - a["beta1"]) * g, (1 - a["beta2"]) * g * g
        steps[n] = a["lr"] * (m / (1 - a["beta1"])) / ((v / (1 - a["beta2"])).sqrt() + a["eps"])
    return {"pg_loss": loss.item(), "grad_norm": norm, "advantages": adv, "steps": steps,
            "clipped_grads": {n: (g.double() * coeff).float() for n, g in grads.items()}}  # fmt: skip


def main() -> None:
    from megarl.parallel.spawn import run_on_ranks

    hf_dir, out_path = sys.argv[1], sys.argv[2]
    torch.save(run_on_ranks(run, 1, hf_dir), out_path)


if __name__ == "__main__":
    main()
