"""Runs inside each spawned rank (DP=2: an HF engine per rank): the engine's batching, seeding and sleep."""

from __future__ import annotations

import torch

from megarl.config.schema import RolloutConfig, SamplingConfig


def run_hf_engine(hf_dir: str, engine_dir: str, moe: tuple[str, str] | None = None) -> dict:
    """``moe``: also a Qwen3-MoE's (HF dir, engine dir), synced from Megatron at DP=2 (``moe_logits``)."""
    from megarl.backend.logprobs import token_logprobs
    from megarl.convert.hf_to_megatron import load_hf_into_chunk
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.builder import build_model_chunk
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.reshard.layout import megatron_layout
    from megarl.reshard.sync import actor_tensors
    from megarl.rollout.hf_engine import HFEngine

    layout = ParallelLayout(dp=2)
    init_distributed(layout, seed=3)
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    chunk = build_model_chunk(spec, layout, init_weights=False)
    load_hf_into_chunk(chunk, hf_dir, spec, layout, torch.distributed.get_rank(), progress=False)
    engine = HFEngine(RolloutConfig(max_model_len=256, bucket_mb=1), engine_dir, spec, megatron_layout(spec, layout, 2))
    engine.update_weights(actor_tensors(chunk), 0)
    model, calls = engine.model, []
    generate = model.generate
    model.generate = lambda *a, **k: calls.append(len(a[0])) or generate(*a, **k)
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(3, 259, (n,), generator=gen)] for n in (5, 17, 9, 30)]
    seeds = [11, 22, 33, 44]
    sampling = SamplingConfig(n=3, temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=12)

    def run(indices):
        samples, _ = engine.generate([prompts[i] for i in indices], list(indices), [seeds[i] for i in indices],
                                     sampling)  # fmt: skip
        return {(s.prompt_index, s.sample_index): (s.token_ids, s.logprobs) for s in samples}

    together = run([0, 1, 2, 3])
    one_call = list(calls)
    trainer = {}  # the trainer's recomputation of the engine's log-probs, under the sampler's truncation or not
    for key, (ids, engine_logp) in together.items():
        seq = torch.tensor([prompts[key[0]] + ids])
        for name, k, p in (("truncated", sampling.top_k, sampling.top_p), ("full", 0, 1.0)):
            logp = token_logprobs(chunk, seq, temperature=sampling.temperature, true_vocab=spec.vocab_size,
                                  top_k=k, top_p=p)[0, len(prompts[key[0]]) - 1 :]  # fmt: skip
            diff = (logp - torch.tensor(engine_logp)).abs().max().item()
            trainer[name] = max(trainer.get(name, 0.0), diff)
    alone = {}
    for i in (3, 1, 0, 2):
        alone.update(run([i]))
    pairs = run([2, 0])
    greedy = SamplingConfig(n=1, temperature=0, top_k=50, max_new_tokens=12)  # top_k: ignored when greedy
    argmax, seed_free = True, True
    first, _ = engine.generate(prompts, [0, 1, 2, 3], seeds, greedy)
    other, _ = engine.generate(prompts[::-1], [3, 2, 1, 0], [s + 1 for s in seeds], greedy)
    for s in first:
        seq = torch.tensor([prompts[s.prompt_index] + s.token_ids])
        with torch.no_grad():
            logits = engine.model(seq).logits[0, len(prompts[s.prompt_index]) - 1 : -1]
        argmax &= logits.argmax(-1).tolist() == s.token_ids
        seed_free &= next(o.token_ids for o in other if o.prompt_index == s.prompt_index) == s.token_ids
    engine.sleep()
    moe_diff = _moe_logits(*moe, layout) if moe else None
    asleep = engine.resident_bytes()
    engine.update_weights(actor_tensors(chunk), 1)
    again = run([0, 1, 2, 3])
    tokens = lambda d: {k: v[0] for k, v in d.items()}  # noqa: E731
    worst = lambda a, b: max(max((abs(x - y) for x, y in zip(a[k][1], b[k][1])), default=0.0) for k in a)  # noqa: E731
    return {
        "calls": one_call,
        "trainer_vs_engine_logprob": trainer,
        "rows": 4 * 3,
        "same_tokens_alone": tokens(together) == tokens(alone),
        "same_tokens_pairs": all(tokens(together)[k] == v for k, v in tokens(pairs).items()),
        "logprob_diff_alone": worst(together, alone),
        "distinct_samples": len({tuple(v[0]) for v in together.values()}),
        "asleep_bytes": asleep,
        "awake_bytes": engine.resident_bytes(),
        "model_kept": engine.model is model,
        "same_after_sleep": tokens(again) == tokens(together),
        "greedy_is_argmax": argmax and len(first) == 4,
        "greedy_seed_and_batch_free": seed_free,
        "moe_logits": moe_diff,
    }


def _moe_logits(hf_dir: str, engine_dir: str, layout) -> float:
    """A Qwen3-MoE's HF engine (transformers' fused experts) after a sync from Megatron: the largest difference of
    its logits from transformers' own model loaded from ``hf_dir`` (fp32), on a 64-token sequence."""
    from transformers import AutoModelForCausalLM

    from megarl.convert.hf_to_megatron import load_hf_into_chunk
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.builder import build_model_chunk
    from megarl.reshard.layout import megatron_layout
    from megarl.reshard.sync import actor_tensors
    from megarl.rollout.hf_engine import HFEngine

    spec = spec_from_hf_config(read_hf_config(hf_dir))
    chunk = build_model_chunk(spec, layout, init_weights=False)
    load_hf_into_chunk(chunk, hf_dir, spec, layout, torch.distributed.get_rank(), progress=False)
    engine = HFEngine(RolloutConfig(max_model_len=256, bucket_mb=1), engine_dir, spec, megatron_layout(spec, layout, 2))
    engine.update_weights(actor_tensors(chunk), 0)
    seq = torch.randint(3, 259, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(seq).logits
        return (engine.model(seq).logits - want).abs().max().item()
