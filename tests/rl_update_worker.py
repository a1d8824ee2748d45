"""Runs inside every spawned rank: one full RL update (the trainer's ``learn``) on fixed rollout samples, at several
layouts and micro-batch splits, reporting the metrics and the full (TP/PP-merged) actor and critic weights after it.

The reference cases are the single-rank computation: TP=PP=1 and every DP replica processes the whole batch (the
update's DP share is patched to "everything"), so the DP mean of identical gradients is the single-rank gradient.
"""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import torch
import torch.distributed as dist

from megarl.algos import kl_controller
from megarl.backend import update
from megarl.backend.models import build_rl_models
from megarl.config.loader import load_config
from megarl.models import read_hf_config, spec_from_hf_config
from megarl.models.source import model_source
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout
from megarl.rl.collect import Collected
from megarl.rl.roles import make_roles
from megarl.rl.step import learn
from megarl.rl.timer import PhaseTimer
from megarl.rollout.protocol import Sample
from tests.metric_tolerance import token_share
from tests.parity_worker import _gather_full

ALGOS = {
    # PPO: critic + GAE, KL loss to the reference, two mini-batches (old log-probs computed), seq-mean-token-mean.
    # lr 0.25: at 2.0 the first step moves the policy so far from the reference that the second mini-batch's KL terms
    # meet the loss's kinks (the ratio's clip, k3's clamp), where fp32 noise between layouts grew to 3e-5 of the grad
    # norm (2e-8 at 0.5); at 0.5 the multi-turn batch's KL value (ratio x k3 after a step of ppo_kl 1.85) differed
    # between TP=2 and one rank by 7.6e-6 to 1.1e-5 of itself, at 0.25 by 2.5e-6
    "ppo": [
        "actor.optim.lr=0.25",
        "algorithm.adv_estimator=gae",
        "algorithm.gamma=0.95",
        "algorithm.lam=0.9",
        "actor.kl_loss_coef=0.1",
        "actor.loss_agg_mode=seq-mean-token-mean",
        "actor.global_batch_size=4",
        "critic.optim.optimizer=sgd",
        "critic.optim.lr=0.5",
        "critic.optim.clip_grad=0",
    ],
    # GRPO: token-mean, entropy bonus, one mini-batch (old log-probs skipped: the loss's own forward)
    "grpo": ["algorithm.adv_estimator=grpo", "actor.entropy_coeff=0.01", "actor.global_batch_size=8"],
    # LoRA (rank 4, every target, from a random non-zero adapter: init_from is added by the test) with a KL loss
    # against the base (the actor with its adapters off), two mini-batches
    "grpo_lora": ["algorithm.adv_estimator=grpo", "actor.kl_loss_coef=0.1", "actor.entropy_coeff=0.01",
                  "actor.global_batch_size=4", "actor.lora.rank=4", "actor.lora.alpha=8"],  # fmt: skip
    # GSPO (PPO's clip range: GSPO's own 3e-4 would clip nearly every sequence after the first mini-batch) with
    # truncated importance sampling against the engine's log-probs, two mini-batches, a top-k / top-p sampler (the
    # trainer's log-probs over its kept tokens: under TP, gathered per sequence to rank the vocabulary)
    "gspo_tis": ["algorithm.adv_estimator=grpo", "actor.policy_loss=gspo", "algorithm.rollout_is=token_truncate",
                 "algorithm.rollout_is_cap=1.5", "actor.global_batch_size=4", "actor.clip_ratio_low=0.2",
                 "actor.clip_ratio_high=0.2", "rollout.sampling.top_k=20", "rollout.sampling.top_p=0.9"],  # fmt: skip
}
SPLITS = {"mbs2": ["actor.micro_batch_size=2", "critic.micro_batch_size=2"],
          "mbs1": ["actor.micro_batch_size=1", "critic.micro_batch_size=1"],
          "pack": ["actor.max_tokens_per_micro_batch=40", "critic.max_tokens_per_micro_batch=30"],
          "one": ["actor.micro_batch_size=64", "critic.micro_batch_size=64"]}  # fmt: skip


SPREAD = ((2, (1, 30)), (5, (12, 35)), (9, (4, 20)), (3, (6, 2)))
"""(prompt length, its two responses' lengths) of each prompt: sequences of 3 to 40 tokens, long and short mixed."""
FRONT_LOADED = ((6, (30, 34)), (4, (29, 36)), (2, (1, 3)), (3, (2, 4)))
"""Every long sequence in the first half of the batch: contiguous DP shares would give one rank nearly all tokens."""
LOPSIDED = ((2, (37, 1)), (2, (2, 3)), (3, (1, 2)), (2, (4, 1)))
"""One sequence as long as the seven others together: token-balanced shares of 1 and 7 sequences."""


def episode_mask(n: int) -> list[int]:
    """A multi-turn response of ``n`` tokens: a model turn, an observation, a model turn, a trailing observation (cut
    at the token limit); responses under 6 tokens are one model turn."""
    if n < 6:
        return [1] * n
    first, observation, trailing = n // 3, n // 4, 2
    return [1] * first + [0] * observation + [1] * (n - first - observation - trailing) + [0] * trailing


def fixed_batch(vocab: int, shape=SPREAD, episodes: bool = False, alter: str | None = None, routes=None
                ) -> Collected:  # fmt: skip
    """4 prompts x 2 samples of the prompt and response lengths ``shape``, with engine-like log-probs and rewards.
    ``episodes``: the responses are multi-turn (``episode_mask``; observation tokens have log-prob 0 and a reward
    per turn). ``alter``: 'obs' or 'model' changes the trailing observation's tokens (targets the loss masks out) or
    the last model token. ``routes`` (MoE layers, k, experts): each sample carries engine routes, k distinct random
    experts per position and layer (not what the model's routers would pick)."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(6)
    out = Collected()
    for p, (prompt_len, response_lens) in enumerate(shape):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for j, n in enumerate(response_lens):
            response = [rng.randrange(3, vocab) for _ in range(n)]
            logprobs = [-rng.uniform(4.0, 7.0) for _ in response]
            sample = Sample(p, j, prompt, response, logprobs, "stop", [0] * len(response))
            if routes is not None:
                layers, k, experts = routes
                rows = [torch.randperm(experts, generator=gen)[:k] for _ in range((prompt_len + n - 1) * layers)]
                sample.routed_experts = torch.stack(rows).view(prompt_len + n - 1, layers, k).to(torch.uint8)
            if episodes:
                mask = episode_mask(n)
                sample.mask, sample.logprobs = mask, [lp if m else 0.0 for lp, m in zip(logprobs, mask)]
                sample.turn_ends = [i for i in range(n) if mask[i] and (i + 1 == n or not mask[i + 1])]
                sample.turn_rewards = [rng.uniform(-0.2, 0.2) for _ in sample.turn_ends]
                if alter is not None and 0 in mask:
                    where = [i for i in range(n) if mask[i] == (alter == "model")][-1]
                    response[where] = 3 + (response[where] - 2) % (vocab - 3)
            out.samples.append(sample)
            out.rewards.append(rng.random())
    out.scores = list(out.rewards)
    return out


def lora_logits(chunk, vocab: int) -> dict:
    """Full-vocabulary logits of a LoRA actor on fixed tokens, with and without its adapters."""
    from megarl.convert.verify import megatron_logits, verification_tokens
    from megarl.lora import adapters_off

    tokens = verification_tokens(vocab, batch=2, seq=16, seed=7)
    with adapters_off(chunk):
        base = megatron_logits(chunk, tokens, vocab)
    return {"tokens": tokens, "adapted": megatron_logits(chunk, tokens, vocab), "base": base}


def run_case(
    hf_dir: str, layout: ParallelLayout, algo: str, split: str, reference: bool = False, extra: tuple = (),
    shape=SPREAD, lockstep: bool = False, episodes: bool = False, alter: str | None = None, hf: str | None = None,
    routes: bool = False,
) -> dict:
    """``hf``: another model than ``hf_dir`` (a Qwen3-MoE); ``routes``: its samples carry engine routes."""
    hf_dir = hf or hf_dir
    overrides = [
        f"model.path={hf_dir}",
        f"actor.parallel.tp={layout.tp}",
        f"actor.parallel.pp={layout.pp}",
        f"actor.parallel.dp={layout.dp}",
        f"actor.parallel.ep={layout.ep}",
        "actor.optim.optimizer=sgd",
        "actor.optim.lr=2.0",
        "actor.optim.clip_grad=0",
        "rollout.sampling.n=2",
        "rollout.sampling.temperature=0.9",
        "data.train_batch_size=4",
        *ALGOS[algo],
        *SPLITS[split],
        *extra,
    ]
    cfg = load_config(None, overrides)
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    init_distributed(layout, seed=1)
    models = build_rl_models(cfg, spec, layout, model_source(hf_dir), dist.get_rank())
    lora = {}
    if cfg.actor.lora is not None:
        named = models.actor.module.named_parameters
        frozen = lambda: {n: p.detach().clone() for n, p in named() if not p.requires_grad}  # noqa: E731
        lora["base_before"] = frozen()
        if layout.tp == 2:
            lora["logits"] = lora_logits(models.actor.module, spec.vocab_size)
    skip = cfg.actor.global_batch_size == 8
    kl = kl_controller("fixed", 0.0, 0.1, 1000)
    everything = mock.patch.object(update, "_dp_coords", lambda: (0, 1)) if reference else contextlib.nullcontext()
    batch = fixed_batch(spec.vocab_size, shape, episodes, alter,
                        (len(spec.routed_layers), spec.moe_top_k, spec.num_experts) if routes else None)  # fmt: skip
    passes, micro_batches = [], update.micro_batches

    def counted(seqs, groups, fields=None):  # each pass's micro-batches on this rank, as their sequences' positions
        passes.append([[len(seqs[i].tokens) - 1 for i in g] for g in groups])
        return micro_batches(seqs, groups, fields)

    in_lockstep = mock.patch.object(update, "_lockstep", lambda: True) if lockstep else contextlib.nullcontext()
    with everything, in_lockstep, mock.patch.object(update, "micro_batches", counted):
        learned = learn(cfg, make_roles(cfg, spec, models), batch, kl_ctrl=kl, skip_old_logprob=skip,
                        timer=PhaseTimer())  # fmt: skip
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, passes)
    if reference:  # every DP replica reported the whole batch's sums: the real DP group summed them dp times
        for metrics in (learned.actor, learned.critic):
            for k in metrics:
                if k not in ("grad_norm", "lr") and not k.startswith(("max/", "moe/")):  # moe/: means, shares
                    metrics[k] /= layout.dp
    lengths = [len(s.token_ids) for s in batch.samples]
    out = {
        "actor": learned.actor,
        "critic": learned.critic,
        "token_share": token_share(lengths, cfg.actor.global_batch_size),  # one token of a token fraction
        "advantages": torch.cat(learned.advantages),
        "forward": {k: torch.cat(v) for k, v in (("old_logp", learned.old_logp), ("ref_logp", learned.ref_logp),
                                                 ("values", learned.values)) if v is not None},  # fmt: skip
        "passes_per_rank": per_rank,
        "packed": learned.packed,
        "weights": _gather_full(models.actor.module, layout, spec, value_head=False),
    }
    if models.critic is not None:
        out["critic_weights"] = _gather_full(models.critic.module, layout, spec, value_head=True)
    if lora:
        from megarl.lora import gather_adapters

        after = frozen()
        out["base_bitwise"] = after.keys() == lora["base_before"].keys() and all(
            torch.equal(v, lora["base_before"][k]) for k, v in after.items()
        )
        out["adapters"] = gather_adapters(models.actor.module, spec, layout)
        out["logits"] = lora.get("logits")
        if layout.tp == 2:  # the updated adapters as a PEFT directory, and the logits they must give
            import tempfile

            from megarl.lora import write_peft_adapter

            out["after_update"] = lora_logits(models.actor.module, spec.vocab_size)
            out["exported"] = tempfile.mkdtemp(prefix="megarl-lora-") if dist.get_rank() == 0 else None
            if dist.get_rank() == 0:
                write_peft_adapter(out["exported"], out["adapters"], cfg.actor.lora, hf_dir)
        out["trainable"] = sum(p.numel() for p in models.actor.parameters() if p.requires_grad)
    if reference and split == "mbs1" and cfg.actor.lora is None:  # the weights before the update
        from megarl.backend.init_weights import load_initial_weights
        from megarl.models.builder import build_model_chunk

        initial = build_model_chunk(spec, layout, init_weights=False, dtype=cfg.model.dtype)
        load_initial_weights(initial, model_source(hf_dir), spec, layout, dist.get_rank())
        out["initial"] = _gather_full(initial, layout, spec, value_head=False)
    return out


def tp_attribute_bug(hf_dir: str) -> dict:
    """megatron-core 0.16: a model built without random init lacks TP attributes; megarl's builder restores them."""
    from megarl.compat.megatron_fixes import restore_tp_attributes
    from megarl.models.builder import build_model_chunk

    spec = spec_from_hf_config(read_hf_config(hf_dir))
    layout = ParallelLayout(tp=dist.get_world_size())
    init_distributed(layout, seed=1)
    with mock.patch("megarl.models.builder.restore_tp_attributes", lambda model: 0):
        raw = build_model_chunk(spec, layout, init_weights=False)
    flags = lambda m: {n: hasattr(p, "tensor_model_parallel") for n, p in m.named_parameters() if "layernorm" not in n}
    before = flags(raw)
    restored = restore_tp_attributes(raw)
    return {"before": before, "after": flags(raw), "restored": restored,
            "builder": flags(build_model_chunk(spec, layout, init_weights=False))}  # fmt: skip


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _adam_state(optimizer) -> list[torch.Tensor]:
    """Adam's moment tensors (not the host-side step counters) of a Megatron optimizer, chained or not."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [v for o in opts for st in o.optimizer.state.values() for k, v in st.items() if k != "step"]


def memory_overrides(hf_dir: str, layout: ParallelLayout, distopt: bool) -> list[str]:
    """PPO with Adam for actor and critic, a KL loss (so a reference), offload on: the planner reads the same."""
    return [f"model.path={hf_dir}", f"actor.parallel.tp={layout.tp}", f"actor.parallel.pp={layout.pp}",
            f"actor.parallel.dp={layout.dp}", f"actor.parallel.ep={layout.ep}", "actor.optim.optimizer=adam",
            "actor.optim.lr=0.01",
            f"actor.optim.use_distributed_optimizer={distopt}", "rollout.sampling.n=2",
            "data.train_batch_size=4", "offload.enable=true", *ALGOS["ppo"], *SPLITS["pack"],
            "critic.optim.optimizer=adam", "critic.optim.lr=0.01",
            f"critic.optim.use_distributed_optimizer={distopt}"]  # fmt: skip


def memory_case(hf_dir: str, layout: ParallelLayout, distopt: bool, hf: str | None = None) -> dict:
    """PPO (actor, critic, reference; Adam) after one real update: the bytes each consumer the planner names has
    allocated; then an offload -> reload round trip (what it freed, whether everything came back bitwise) and the
    next update compared with a second model set that was never offloaded, and one built with recompute."""
    from megarl.backend.offload import Offloader, grad_buffers, optimizer_tensors

    hf_dir = hf or hf_dir
    overrides = memory_overrides(hf_dir, layout, distopt)
    cfg = load_config(None, overrides)
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    init_distributed(layout, seed=1)
    kl = kl_controller("fixed", 0.0, 0.1, 1000)

    def build(c=cfg):
        return build_rl_models(c, spec, layout, model_source(hf_dir), dist.get_rank())

    def step(models):
        learned = learn(cfg, make_roles(cfg, spec, models), fixed_batch(spec.vocab_size), kl_ctrl=kl,
                        skip_old_logprob=False, timer=PhaseTimer())  # fmt: skip
        return {"actor": learned.actor, "critic": learned.critic}

    a = build()
    step(a)
    main_grads = lambda m: [p.main_grad for p in m.parameters()]  # noqa: E731
    measured = {
        "actor params": _storage_bytes(a.actor.parameters()),
        "actor grads": _storage_bytes(main_grads(a.actor)),
        "actor optimizer": _storage_bytes(_adam_state(a.actor_optim)),
        "critic params+grads+optimizer": _storage_bytes(a.critic.parameters())
        + _storage_bytes(main_grads(a.critic))
        + _storage_bytes(_adam_state(a.critic_optim)),
        "reference params": _storage_bytes(a.reference.parameters()),
    }
    everything = lambda m: [*m.actor.parameters(), *grad_buffers(m.actor), *optimizer_tensors(m.actor_optim),  # noqa: E731
                            *m.critic.parameters(), *grad_buffers(m.critic), *optimizer_tensors(m.critic_optim),
                            *m.reference.parameters()]  # fmt: skip
    before = [t.detach().clone() for t in everything(a)]
    from megarl.backend import offload

    pinned, pin_in_place = [], offload.pin_in_place  # what the pinning path locks (on CPU: recorded, not pinned)
    offload.pin_in_place = lambda buf: pinned.append(buf.untyped_storage().nbytes())
    try:
        offloader = Offloader(a, cfg.offload, on_gpu=True)
        freed = offloader.offload()
    finally:
        offload.pin_in_place = pin_in_place
    moved = [t for group in offloader.moved.values() for t in group.storages]
    emptied = all(s.nbytes() == 0 for s in moved)
    actor_params_stay = all(p.untyped_storage().nbytes() > 0 for p in a.actor.parameters())
    offloader.reload()
    bitwise = all(torch.equal(x, y) for x, y in zip(before, everything(a)))
    after_round_trip = step(a)
    b = build()
    step(b)
    never_offloaded = step(b)
    recomputed = None
    if layout.tp == 2 and not distopt:  # once is enough (tests/test_rl_update.py)
        c = build(load_config(None, [*overrides, "model.recompute=true"]))
        step(c)
        recomputed = step(c)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"measured": measured, "freed": freed, "pinned": pinned})
    return {"per_rank": per_rank, "emptied": emptied, "actor_params_stay": actor_params_stay,
            "bitwise": bitwise, "after_round_trip": after_round_trip, "never_offloaded": never_offloaded,
            "recomputed": recomputed}  # fmt: skip


def lora_memory_overrides(hf_dir: str, layout: ParallelLayout, dtype: str = "float32") -> list[str]:
    """GRPO with LoRA (rank 4 on q, v, down), Adam and the distributed optimizer, a KL loss (the reference is the
    base), in ``dtype`` (the adapters are fp32 in every one): the planner reads the same."""
    return [f"model.path={hf_dir}", f"actor.parallel.tp={layout.tp}", f"actor.parallel.pp={layout.pp}",
            f"actor.parallel.dp={layout.dp}", f"actor.parallel.ep={layout.ep}", "actor.optim.optimizer=adam",
            "actor.optim.lr=0.01",
            "actor.optim.use_distributed_optimizer=true", "rollout.sampling.n=2", "data.train_batch_size=4",
            *ALGOS["grpo_lora"], "actor.lora.target_modules=[q_proj,v_proj,down_proj]", *SPLITS["pack"],
            f"model.dtype={dtype}"]  # fmt: skip


def lora_memory_case(hf_dir: str, layout: ParallelLayout, dtype: str = "float32") -> dict:
    """The bytes each planned consumer has allocated after one real LoRA update, per rank."""
    cfg = load_config(None, lora_memory_overrides(hf_dir, layout, dtype))
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    init_distributed(layout, seed=1)
    models = build_rl_models(cfg, spec, layout, model_source(hf_dir), dist.get_rank())
    learn(cfg, make_roles(cfg, spec, models), fixed_batch(spec.vocab_size),
          kl_ctrl=kl_controller("fixed", 0.0, 0.1, 1000), skip_old_logprob=False, timer=PhaseTimer())  # fmt: skip
    trainable = [p for p in models.actor.parameters() if p.requires_grad]
    measured = {
        "actor params": _storage_bytes(models.actor.parameters()),
        "actor grads": _storage_bytes([p.main_grad for p in trainable]),
        "actor optimizer": _storage_bytes(_adam_state(models.actor_optim)),
    }
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"measured": measured, "reference": models.reference is not None})
    return {"per_rank": per_rank}


def run_cases(hf_dir: str, cases: list[tuple[str, dict]]) -> dict:
    kinds = {"distopt": memory_case, "lora_memory": lora_memory_case}
    out = {}
    for name, kwargs in cases:
        kind = next((k for k in kinds if k in kwargs), None)
        out[name] = kinds[kind](hf_dir, **{k: v for k, v in kwargs.items() if k != "lora_memory"}) if kind else (
            run_case(hf_dir, **kwargs))  # fmt: skip
    out["tp_attribute_bug"] = tp_attribute_bug(hf_dir)
    return out
