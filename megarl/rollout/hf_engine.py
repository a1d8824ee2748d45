"""The HF ``generate`` rollout engine: the fallback where vLLM is not installed.

Every rank is its own engine (rollout TP = 1). The transformers model is built once, on the rank's device; a weight
sync writes the full HF tensors into it through the resharding engine (``hf_layout``); ``sleep`` frees its
parameters' memory (the storages shrink to nothing, so no second copy of the weights is kept while the actor trains)
and the next sync grows them back and overwrites every one. A step's prompts are generated as one batch, left-padded.

Sampling is HF's greedy search over Gumbel-perturbed logits (``SeededSampling``): argmax(logits / T + g) with g a
hash of (the sample's seed, the step, the token id) is a sample of softmax(logits / T), and each sample depends on its
own seed only, whatever else is in the batch (torch's generator would be shared by the whole batch). Top-k / top-p
truncate the scores first, by vLLM's rule (``megarl.algos.sampling``), and the log-probabilities are those of the
softmax over the kept tokens of logits / temperature: the quantity the trainer recomputes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megarl.algos.sampling import truncate
from megarl.backend.offload import distinct_storages
from megarl.config.schema import RolloutConfig, SamplingConfig
from megarl.models.builder import DTYPES
from megarl.models.spec import ModelSpec
from megarl.reshard.layout import SideLayout, hf_layout
from megarl.reshard.plan import plan
from megarl.reshard.sync import SyncReport, run_sync, split_by_layer
from megarl.rollout.protocol import EngineUnhealthyError, RolloutStats, Sample, check_requests

_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def hub_targets(model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Where each tensor of the hub layout (the sync's HF names) lives in a transformers model: its parameter, or for
    fused experts (Qwen3-MoE in memory: ``mlp.experts.gate_up_proj`` [E, 2I, H] = per expert [gate; up], and
    ``down_proj`` [E, H, I]; ``modeling_qwen3_moe.py``) expert j's rows of them, a view that writes through."""
    out = {}
    for name, param in model.named_parameters():
        fused = _FUSED_EXPERTS.match(name)
        if fused is None:
            out[name] = param
            continue
        prefix, kind, width = fused[1], fused[2], spec.moe_ffn_hidden_size
        for j in range(param.shape[0]):
            if kind == "gate_up_proj":
                out[f"{prefix}.{j}.gate_proj.weight"] = param[j, :width]
                out[f"{prefix}.{j}.up_proj.weight"] = param[j, width:]
            else:
                out[f"{prefix}.{j}.down_proj.weight"] = param[j]
    return out


class _HFModelWrite:
    """Data path: executor -> full HF tensors of one layer on this rank -> copied into the transformers model."""

    name = "hf_model_write"

    def __init__(self, params: dict[str, torch.Tensor], dtype: torch.dtype):
        self.params, self.dtype = params, dtype
        """Hub name -> the tensor (a parameter or a view of one) it is copied into (``hub_targets``)."""

    @torch.no_grad()
    def load(self, layers: Iterable[dict[str, torch.Tensor]]) -> None:
        written = set()
        for tensors in layers:
            for name, value in tensors.items():
                self.params[name].copy_(value)
                written.add(name)
        missing = sorted(set(self.params) - written)
        if missing:  # a parameter the sync does not cover would keep whatever its regrown memory held
            raise RuntimeError(f"the weight sync wrote no tensor into {missing[:3]} of the HF engine's model")


_M1, _M2 = -0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15  # splitmix64's multipliers as signed int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (multiplications wrap mod 2^64; shifts made logical)."""
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        x = x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))
        if mult is not None:
            x = x * mult
    return x


def gumbel_noise(keys: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] standard Gumbel noise, a pure function of (each row's key, the step, the token id)."""
    tokens = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = _mix(_mix(keys[:, None] + step * 0x2545F491) + tokens[None, :] * 0x9E3779B9)
    u = (((x >> 40) & 0xFFFFFF).float() + 0.5) / 2.0**24  # in (0, 1)
    return -torch.log(-torch.log(u))


def _picked(logp_NV: torch.Tensor, scores_NV: torch.Tensor) -> torch.Tensor:
    """[N] the log-probabilities of the tokens HF's greedy search picks from ``scores`` (their argmax)."""
    return logp_NV.gather(-1, scores_NV.argmax(-1, keepdim=True)).squeeze(-1)


class SeededSampling:
    """A logits processor for HF's greedy search that makes it sample: row r's scores become
    truncate(logits / T) + Gumbel noise keyed by ``keys[r]`` (its sample's seed) and the step. ``logprobs``: per
    step, [rows] log p of the token drawn under the softmax it was drawn from (one value per row, not the
    vocabulary's: HF keeps no logits)."""

    def __init__(self, keys: torch.Tensor, prompt_width: int, sampling: SamplingConfig):
        self.keys, self.width, self.sampling = keys, prompt_width, sampling
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        z = truncate(scores.float() / s.temperature, s.top_k, s.top_p)
        perturbed = z + gumbel_noise(self.keys, input_ids.shape[1] - self.width, z.shape[-1])
        self.logprobs.append(_picked(torch.log_softmax(z, -1), perturbed))
        return perturbed


class GreedyLogprobs:
    """Greedy decoding (HF's own argmax of the logits): per step, [rows] log p of the picked token under the raw
    softmax (greedy drew from no distribution of its own)."""

    def __init__(self):
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.logprobs.append(_picked(torch.log_softmax(scores.float(), -1), scores))
        return scores


class _Stopping:
    """A ``StoppingCriteria``: every row is done once ``should_stop()`` holds (a run being stopped)."""

    def __init__(self, should_stop):
        self.should_stop = should_stop

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), bool(self.should_stop()), dtype=torch.bool, device=input_ids.device)


class HFEngine:
    tp = 1  # every rank is its own engine
    adapter_slots = False  # a plain transformers model: LoRA adapters arrive merged into the weights

    def __init__(
        self, cfg: RolloutConfig, engine_dir: str, spec: ModelSpec, src_layout: SideLayout, *, dtype="float32"
    ):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.cfg, self.spec, self.dtype = cfg, spec, DTYPES[dtype]
        self.hf_config = AutoConfig.from_pretrained(engine_dir)
        tok = AutoTokenizer.from_pretrained(engine_dir)
        self.eos = tok.eos_token_id
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos
        world = dist.get_world_size()
        self.sub_plans = split_by_layer(plan(src_layout, hf_layout(spec, list(range(world)), src_layout.gpus_per_node)))
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        with torch.device(self.device):  # built once, where it runs (no host copy first); the first sync fills it
            self.model = AutoModelForCausalLM.from_config(self.hf_config, dtype=self.dtype).eval()
        self.storages = distinct_storages(self.model.parameters())  # a tied lm_head shares the embedding's
        self.sizes = [st.nbytes() for st in self.storages]
        self.asleep = False
        self.weight_version: int | None = None
        self.should_stop = None
        """A callable polled after every generated token: True ends the generation there (the rollout is then
        dropped); None: never."""
        self.max_model_len = cfg.max_model_len or spec.max_position_embeddings

    @property
    def healthy(self) -> bool:
        return self.weight_version is not None and not self.asleep

    def update_weights(
        self, src_tensors: dict[str, torch.Tensor], version: int, *, resend_base: bool = True, on_send=None
    ) -> SyncReport:
        """Collective: write the actor's weights into this rank's model (verified; every sync is whole,
        ``resend_base`` changes nothing). An asleep model gets its memory back first."""
        self.weight_version = None
        if self.asleep:
            for storage, size in zip(self.storages, self.sizes):
                storage.resize_(size)
            self.asleep = False
        report = run_sync(
            self.sub_plans,
            src_tensors,
            _HFModelWrite(hub_targets(self.model, self.spec), self.dtype),
            bucket_bytes=self.cfg.bucket_mb * 1024**2,
            verify=self.cfg.verify,
            compare_full=self.cfg.verify_full,
            on_send=on_send,
        )
        self.weight_version = version
        return report

    def sleep(self) -> None:
        """Free the parameters' memory: the actor keeps the only copy of the weights while it trains."""
        for storage in self.storages:
            storage.resize_(0)
        self.asleep = True
        self.weight_version = None

    def resident_bytes(self) -> int:
        """Bytes of the model's parameters in memory now (0 asleep)."""
        return sum(st.nbytes() for st in self.storages)

    def wake(self) -> None:
        pass

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], prompt_indices: list[int], seeds: list[int], sampling: SamplingConfig,
        on_group=None,
    ) -> tuple[list[Sample], RolloutStats]:  # fmt: skip
        """``sampling.n`` samples per prompt, all prompts as one left-padded batch (``on_group(samples)`` per prompt
        once the batch is done). Sample j of a prompt is keyed by its seed + j, as vLLM seeds it."""
        from transformers import GenerationConfig

        if not self.healthy:
            raise EngineUnhealthyError("the HF engine holds no verified weights; run update_weights first")
        check_requests(prompts, sampling.max_new_tokens, self.max_model_len)
        if not prompts:
            return [], RolloutStats(0.0, 0)
        n, stops, start = sampling.n, [self.eos, *sampling.stop_token_ids], time.perf_counter()
        width = max(len(p) for p in prompts)
        rows = [p for p in prompts for _ in range(n)]
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=self.device)
        keys = _mix(torch.tensor([seed + j for seed in seeds for j in range(n)], device=self.device))
        config = GenerationConfig(do_sample=False, max_new_tokens=sampling.max_new_tokens, eos_token_id=stops,
                                  pad_token_id=self.pad, return_dict_in_generate=True)  # fmt: skip
        picker = GreedyLogprobs() if sampling.greedy else SeededSampling(keys, width, sampling)
        out = self.model.generate(ids, attention_mask=mask, generation_config=config, logits_processor=[picker],
                                  stopping_criteria=[_Stopping(self.should_stop)] if self.should_stop else None)
        new = out.sequences[:, width:]
        logprobs = torch.stack(picker.logprobs, 1)  # [rows, steps]
        samples = []
        for i, (idx, prompt) in enumerate(zip(prompt_indices, prompts)):
            for j in range(n):
                row = i * n + j
                ids_j = new[row].tolist()
                end = next((k + 1 for k, t in enumerate(ids_j) if t in stops), len(ids_j))
                ids_j = ids_j[:end]
                lps = logprobs[row, : len(ids_j)].tolist()
                reason = "stop" if ids_j and ids_j[-1] in stops else "length"
                samples.append(Sample(idx, j, list(prompt), ids_j, lps, reason, [self.weight_version] * len(ids_j)))
            if on_group is not None:
                on_group(samples[-n:])
        seconds = time.perf_counter() - start
        return samples, RolloutStats(seconds, sum(len(s.token_ids) for s in samples))
