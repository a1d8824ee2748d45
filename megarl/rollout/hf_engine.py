"""The HF ``generate`` rollout engine: the fallback where vLLM is not installed.

Every rank is its own engine (rollout TP = 1). For a rollout the resharding engine materialises the full HF tensors on
every rank (``hf_layout``) straight into a transformers model; ``sleep`` frees that model, so no second copy of the
weights is kept while the actor trains. Log-probabilities are those of softmax(logits / temperature), the quantity
the trainer recomputes; top-k / top-p truncation, if configured, is ignored by them (said once in the log).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megarl.config.schema import RolloutConfig, SamplingConfig
from megarl.models.builder import DTYPES
from megarl.models.spec import ModelSpec
from megarl.reshard.layout import SideLayout, hf_layout
from megarl.reshard.plan import plan
from megarl.reshard.sync import SyncReport, run_sync, split_by_layer
from megarl.rollout.protocol import EngineUnhealthyError, RolloutStats, Sample, check_requests, note_truncation

log = logging.getLogger("megarl.rollout")


class _HFModelWrite:
    """Data path: executor -> full HF tensors of one layer on this rank -> copied into the transformers model."""

    name = "hf_model_write"

    def __init__(self, params: dict[str, torch.nn.Parameter], dtype: torch.dtype):
        self.params, self.dtype = params, dtype

    @torch.no_grad()
    def load(self, layers: Iterable[dict[str, torch.Tensor]]) -> None:
        for tensors in layers:
            for name, value in tensors.items():
                self.params[name].copy_(value)


class HFEngine:
    tp = 1  # every rank is its own engine
    adapter_slots = False  # a plain transformers model: LoRA adapters arrive merged into the weights

    def __init__(
        self, cfg: RolloutConfig, engine_dir: str, spec: ModelSpec, src_layout: SideLayout, *, dtype="float32"
    ):
        from transformers import AutoConfig, AutoTokenizer

        self.cfg, self.spec, self.dtype = cfg, spec, DTYPES[dtype]
        self.hf_config = AutoConfig.from_pretrained(engine_dir)
        tok = AutoTokenizer.from_pretrained(engine_dir)
        self.eos = tok.eos_token_id
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos
        world = dist.get_world_size()
        self.sub_plans = split_by_layer(plan(src_layout, hf_layout(spec, list(range(world)), src_layout.gpus_per_node)))
        self.model = None
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.weight_version: int | None = None
        self._said_truncation = [False]
        self.max_model_len = cfg.max_model_len or spec.max_position_embeddings

    @property
    def healthy(self) -> bool:
        return self.weight_version is not None and self.model is not None

    def update_weights(
        self, src_tensors: dict[str, torch.Tensor], version: int, *, resend_base: bool = True, on_send=None
    ) -> SyncReport:
        """Collective: materialise the HF model on this rank from the actor's shards (verified; every sync is whole,
        ``resend_base`` changes nothing)."""
        from transformers import AutoModelForCausalLM

        self.weight_version = None
        if self.model is None:
            self.model = AutoModelForCausalLM.from_config(self.hf_config, dtype=self.dtype).to(self.device).eval()
        params = dict(self.model.named_parameters())
        report = run_sync(
            self.sub_plans,
            src_tensors,
            _HFModelWrite(params, self.dtype),
            bucket_bytes=self.cfg.bucket_mb * 1024**2,
            verify=self.cfg.verify,
            compare_full=self.cfg.verify_full,
            on_send=on_send,
        )
        self.weight_version = version
        return report

    def sleep(self) -> None:
        """Free the model: the actor keeps the only copy of the weights while it trains."""
        self.model = None
        self.weight_version = None

    def wake(self) -> None:
        pass

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], prompt_indices: list[int], seeds: list[int], sampling: SamplingConfig,
        on_group=None,
    ) -> tuple[list[Sample], RolloutStats]:  # fmt: skip
        """``sampling.n`` samples per prompt, one prompt at a time (``on_group(samples)`` after each)."""
        if not self.healthy:
            raise EngineUnhealthyError("the HF engine holds no verified weights; run update_weights first")
        note_truncation(sampling, log, self._said_truncation)
        check_requests(prompts, sampling.max_new_tokens, self.max_model_len)
        stops = [self.eos, *sampling.stop_token_ids]
        samples, start = [], time.perf_counter()
        for idx, prompt, seed in zip(prompt_indices, prompts, seeds):
            with torch.random.fork_rng(devices=[self.device] if torch.cuda.is_available() else []):
                torch.manual_seed(seed)
                out = self.model.generate(
                    torch.tensor([prompt], device=self.device),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=self.device),
                    do_sample=True,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k or None,
                    max_new_tokens=sampling.max_new_tokens,
                    num_return_sequences=sampling.n,
                    eos_token_id=stops,
                    pad_token_id=self.pad,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            new = out.sequences[:, len(prompt) :]
            logprobs = torch.stack([torch.log_softmax(lg.float() / sampling.temperature, -1) for lg in out.logits], 1)
            for j in range(sampling.n):
                ids = new[j].tolist()
                end = next((k + 1 for k, t in enumerate(ids) if t in stops), len(ids))
                ids = ids[:end]
                lps = [float(logprobs[j, k, t]) for k, t in enumerate(ids)]
                reason = "stop" if ids and ids[-1] in stops else "length"
                samples.append(Sample(idx, j, list(prompt), ids, lps, reason, [self.weight_version] * len(ids)))
            if on_group is not None:
                on_group(samples[-sampling.n :])
        seconds = time.perf_counter() - start
        return samples, RolloutStats(seconds, sum(len(s.token_ids) for s in samples))
