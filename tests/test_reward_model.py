"""Reward models: megarl's scalar-head Megatron model, converted from HF ``*ForSequenceClassification`` checkpoints
with one label, scores sequences exactly as transformers does (the logit at the last token that is not the pad
token), at TP=2 and at TP=1 x DP=2, for Llama, Qwen2 (q/k/v bias) and Mistral, with pad = eos and with a distinct
pad; a checkpoint with two labels is refused in one line."""

import re

import pytest
import torch

from megarl.models import read_hf_config, spec_from_hf_config
from megarl.models.family import UnsupportedModelError
from megarl.models.tiny import make_tiny_hf_model
from megarl.parallel.spawn import run_on_ranks
from megarl.rewards.model import score_position
from tests.reward_model_worker import run_reward_models

EOS, PAD = 2, 0
FAMILIES = ("llama", "qwen2", "mistral")


def _sequences() -> list[list[int]]:
    """Prompt + response ids: ending in EOS, ending without it (truncated), right-padded with PAD after EOS, and one
    with an EOS in the middle; lengths 9 to 40."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i, n in enumerate((9, 17, 23, 31, 40, 12)):
        ids = [int(x) for x in torch.randint(3, 259, (n,), generator=g)]
        if i % 3 == 0:
            ids[-1] = EOS
        if i == 3:
            ids[-4:] = [EOS, PAD, PAD, PAD]
        if i == 4:
            ids[10] = EOS
        out.append(ids)
    return out


def test_the_scored_position_is_the_last_token_that_is_not_pad():
    assert score_position([5, 6, 7, 2], pad_token_id=2) == 2  # pad = eos: the token before the final EOS
    assert score_position([5, 6, 2, 0, 0], pad_token_id=0) == 2  # a distinct pad: the EOS itself
    assert score_position([5, 2, 6, 7], pad_token_id=2) == 3
    assert score_position([5, 6], pad_token_id=None) == 1 and score_position([0, 0], pad_token_id=0) == 0


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm")
    models = {f"{fam}_{pad}": make_tiny_hf_model(str(tmp / f"{fam}_{pad}"), fam, seed=7, init_std=0.08, num_labels=1,
                                                 pad_token_id=EOS if pad == "pad_eos" else PAD)
              for fam in FAMILIES for pad in ("pad_eos", "pad_distinct")}  # fmt: skip
    out = tmp / "out"
    out.mkdir()
    run_on_ranks(run_reward_models, 2, models, _sequences(), str(out))
    return models, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pad", ["pad_eos", "pad_distinct"])
@pytest.mark.parametrize("layout", ["tp2", "tp1_dp2"])
def test_scores_equal_transformers_sequence_classification(scored, family, pad, layout):
    from transformers import AutoModelForSequenceClassification

    models, ranks, _ = scored
    name = f"{family}_{pad}"
    hf = AutoModelForSequenceClassification.from_pretrained(models[name], dtype=torch.float32).eval()
    with torch.no_grad():
        want = [float(hf(torch.tensor([s])).logits[0, 0]) for s in _sequences()]
    for r in ranks:  # every rank holds every score
        got = r[(layout, name)]
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
    assert max(want) - min(want) > 1e-2  # the scores differ by sequence: a wrong position would show


@pytest.mark.parametrize("family", FAMILIES)
def test_a_classification_checkpoint_round_trips_bitwise(scored, family):
    """HF -> megarl (TP=2) -> HF: every tensor (the score head included) bitwise, the same class and one label."""
    from megarl.convert.hf_io import HFWeights

    models, _, out = scored
    name = f"{family}_pad_distinct"
    src, back = HFWeights(models[name]), HFWeights(str(out / f"{name}-hf"))
    assert src.names == back.names and "score.weight" in src.names and "lm_head.weight" not in src.names
    for tensor in sorted(src.names):
        a, b = src.get(tensor), back.get(tensor)
        assert a.dtype == b.dtype and torch.equal(a, b), tensor
    verified = torch.load(out / "verified.pt", weights_only=False)[name]  # `megarl convert verify`'s check at TP=2
    assert verified["passed"] and verified["max_abs_diff"] <= 1e-5, verified
    cfg, cfg_back = read_hf_config(models[name]), read_hf_config(str(out / f"{name}-hf"))
    assert cfg_back["architectures"] == cfg["architectures"] and cfg_back["id2label"] == cfg["id2label"]
    assert spec_from_hf_config(cfg_back).score_head


@pytest.mark.parametrize("family", FAMILIES)
def test_the_planner_counts_the_reward_models_parameters_exactly(scored, family):
    """``megarl plan``'s reward model parameters per rank (its score head without bias) are the built model's."""
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner.memory import model_params

    models, ranks, _ = scored
    spec = spec_from_hf_config(read_hf_config(models[f"{family}_pad_eos"]))
    for name, layout in (("tp2", ParallelLayout(tp=2)), ("tp1_dp2", ParallelLayout(dp=2))):
        planned = model_params(spec, layout)
        for rank, r in enumerate(ranks):
            assert sum(p.numel for p in planned[rank]) == r[("params", name, f"{family}_pad_eos")], (name, rank)


def test_a_reward_model_with_two_labels_is_refused_in_one_line(tmp_path):
    d = make_tiny_hf_model(str(tmp_path / "two"), "llama", num_labels=2)
    with pytest.raises(UnsupportedModelError, match="with 2 labels: a reward model has one") as e:
        spec_from_hf_config(read_hf_config(d))
    assert "\n" not in str(e.value)


RL = ["trainer.total_steps=3", "trainer.val_every=3", "trainer.save_every=0", "logging.wandb.mode=disabled",
      "logging.progress_bar=false", "data.train_batch_size=4", "actor.global_batch_size=32",
      "rollout.sampling.max_new_tokens=6", "reward.combine.function=0.5", "reward.combine.model=0.5"]  # fmt: skip
RM_POOL = ["reward.model.parallel.tp=1", "placement.pools.train.ranks=0-1", "placement.pools.train.roles=[actor]",
           "placement.pools.rm.ranks=2", "placement.pools.rm.roles=[reward_model]",
           "placement.pools.rollout.ranks=3-4", "placement.pools.rollout.roles=[rollout]"]  # fmt: skip


def _train(hf_dir, rm_dir, out, extra=()):
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/tiny_grpo.yaml", f"model.path={hf_dir}",
           f"trainer.output_dir={out}", f"reward.model.path={rm_dir}", *RL, *extra]  # fmt: skip
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=repo, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert rows[0]["step"] == 0 and "val/reward/mean" in rows[0]  # trainer.val_before_train: the starting weights
    return rows[1:]


@pytest.fixture(scope="module")
def rl_runs(scored, tiny_llama_dir, tmp_path_factory):
    """GRPO with a Llama reward model (the actor's byte tokenizer) combined 0.5/0.5 with the toy reward, 3 steps:
    colocated (TP=2, the reward model at the actor's layout) and on its own 1-rank pool at TP=1 (5 ranks)."""
    tmp = tmp_path_factory.mktemp("rm-rl")
    rm = scored[0]["llama_pad_eos"]
    return {"colocated": _train(tiny_llama_dir, rm, tmp / "colocated"),
            "pooled": _train(tiny_llama_dir, rm, tmp / "pooled", RM_POOL), "tmp": tmp}  # fmt: skip


@pytest.mark.parametrize("where", ["colocated", "pooled"])
def test_an_rl_run_with_a_reward_model_logs_its_scores_and_trains_on_the_weighted_sum(rl_runs, where):
    rows = rl_runs[where]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {"reward/rm_mean", "reward/rm_std", "reward/fn_mean"} <= r.keys()
        assert abs(r["reward/mean"] - (0.5 * r["reward/fn_mean"] + 0.5 * r["reward/rm_mean"])) <= 1e-12
        assert r["reward/rm_std"] > 0  # the model's scores vary by sample
    assert "val/reward/mean" in rows[-1]


def test_the_reward_model_pool_scores_as_the_colocated_one(rl_runs):
    """The same samples; the reward model at TP=1 on its own pool gives the colocated TP=2 scores (fp32, 1e-5)."""
    import json

    for a, b in zip(rl_runs["colocated"], rl_runs["pooled"], strict=True):
        assert a["reward/fn_mean"] == b["reward/fn_mean"] and a["response_length/mean"] == b["response_length/mean"]
        assert abs(a["reward/rm_mean"] - b["reward/rm_mean"]) <= 1e-5
    ranks = json.loads((rl_runs["tmp"] / "pooled" / "placement.json").read_text())
    want = [("train", ["actor"])] * 2 + [("rm", ["reward_model"])] + [("rollout", [])] * 2
    assert [(r["pool"], r["megatron_models"]) for r in ranks] == want


def test_reward_model_mistakes_are_refused_before_launch(scored, tiny_llama_dir, tmp_path):
    from megarl.config import load_config, validate
    from megarl.config.loader import ConfigError

    two = make_tiny_hf_model(str(tmp_path / "two"), "llama", num_labels=2)
    other_vocab = make_tiny_hf_model(str(tmp_path / "v"), "llama", num_labels=1, vocab_size=384)
    base = ["model.path=" + tiny_llama_dir]
    for extra, message in [
        ([f"reward.model.path={two}"], "reward.model.path: LlamaForSequenceClassification with 2 labels"),
        ([f"reward.model.path={tiny_llama_dir}"], "is not a *ForSequenceClassification checkpoint"),
        ([f"reward.model.path={other_vocab}"], "its vocabulary (384 tokens) is not the actor's"),
        ([f"reward.model.path={scored[0]['llama_pad_eos']}", "reward.model.parallel.tp=1"],
         "reward.model.parallel differs from actor.parallel"),
        (["reward.combine.model=1.0"], "reward.combine: weighs the model, but reward.model is not set"),
        (["reward.combine.function=.inf"], "reward.combine: the function's weight must be finite"),
        (["reward.timeout_s=-5"], "reward.timeout_s: must be > 0"),
        (["reward.stop_on_error_fraction=7.0"], "reward.stop_on_error_fraction: must be in (0, 1]"),
        ([f"model.path={scored[0]['llama_pad_eos']}"], "is a reward model (*ForSequenceClassification); the actor"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)) as e:
            validate(load_config("configs/tiny_grpo.yaml", base + extra), world_size=2)
        assert "\n" not in str(e.value)
