"""The `megarl` command: help, config errors before any process starts, and the demo's training run."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch


def _megarl(*args, cwd=None, timeout=600, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "megarl.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )


def test_help_lists_subcommands():
    out = _megarl("--help")
    assert out.returncode == 0 and "train" in out.stdout and "tiny-model" in out.stdout


def test_config_error_exits_before_launch(tiny_llama_dir):
    out = _megarl("train", "configs/quickstart.yaml", f"model.path={tiny_llama_dir}", "actor.parallel.tp=8")
    assert out.returncode == 2
    assert "actor.parallel.tp=8 does not divide the model's 4 attention heads" in out.stderr
    assert "launching" not in out.stdout


def test_quickstart_runs_rl_steps_at_tp2(tiny_llama_dir, tmp_path):
    """The demo's path: `megarl train` relaunches itself on 2 local ranks and runs GRPO through vLLM."""
    out_dir = tmp_path / "run"
    out = _megarl(
        "train", "configs/quickstart.yaml", f"model.path={tiny_llama_dir}", "trainer.total_steps=2",
        f"trainer.output_dir={out_dir}", "trainer.val_every=2", "data.val_batch_size=4", "logging.wandb.mode=disabled",
        "data.train_batch_size=4", "actor.global_batch_size=32", "rollout.val_sampling.temperature=0",
        "trainer.save_every=2",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "launching 2 local ranks" in out.stdout
    assert re.search(r"\[megarl\] step 1/2 reward [0-9.]+", out.stdout), out.stdout[-2000:]
    assert "reward/mean: first 1 step " in out.stdout  # half the run: the two windows do not overlap
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    # step 0: the starting weights' (greedy) validation, before any update (trainer.val_before_train)
    assert [r["step"] for r in rows] == [0, 1, 2] and "val/reward/mean" in rows[0] and "val/reward/mean" in rows[2]
    assert not [k for k in rows[0] if not k.startswith("val/") and k != "step"] and "reward/mean" in rows[1]
    assert re.search(r"val/reward/mean: step 0 [0-9.]+ -> step 2 [0-9.]+", out.stdout), out.stdout[-2000:]
    for step in (0, 2):  # validation completions kept, and a few shown before and after training
        kept = [json.loads(line) for line in open(out_dir / "samples" / f"val_step_{step:07d}.jsonl")]
        assert len(kept) == 4 and {"prompt", "response", "answer", "score"} <= set(kept[0])
        assert len(re.findall(rf"\[megarl\] step {step} validation: \.\.\.'.*' -> '", out.stdout)) == 3, out.stdout
    assert (out_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "adv_estimator: grpo" in (out_dir / "config.yaml").read_text()
    # the last step exported to an HF folder: transformers' greedy decoding of the validation prompts gives the
    # tokens megarl's last (greedy, vLLM) validation gave
    export = _megarl("convert", "megatron-to-hf", "--ckpt", str(out_dir / "checkpoints"), "--out", str(out_dir / "hf"))
    assert export.returncode == 0, export.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir / "hf", dtype=torch.float32).eval()
    for row in map(json.loads, open(out_dir / "samples" / "val_step_0000002.jsonl")):
        with torch.no_grad():
            out = model.generate(torch.tensor([row["prompt_ids"]]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=model.config.eos_token_id, pad_token_id=model.config.eos_token_id)
        got = out[0, len(row["prompt_ids"]) :].tolist()
        assert got[: len(row["response_ids"])] == row["response_ids"], (row, got)


@pytest.mark.parametrize(
    "override, message",
    [
        ("reward.function=no_such_reward", "reward.function: unknown"),
        ("data.train_files=[/nonexistent/train.jsonl]", "/nonexistent/train.jsonl"),
        ("data.prompt_key=question", "data.prompt_key"),
        ("reward.function=/nonexistent/r.py:fn", "/nonexistent/r.py"),
    ],
)
def test_bad_inputs_fail_before_any_process_starts(tiny_llama_dir, tmp_path, override, message):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "copy 1:", "answer": "1"}\n')
    out = _megarl(
        "train", "configs/quickstart.yaml", f"model.path={tiny_llama_dir}", f"data.train_files=[{data}]", override
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr, out.stderr
    assert "launching" not in out.stdout and "config error" in out.stderr


QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "sliding_window": 131072, "use_sliding_window": False, "hidden_act": "silu",
}  # fmt: skip


def test_qwen_recipe_validates_with_dry_run(tmp_path):
    """The real GPU recipe: its config, Qwen2.5-7B's HF config and GSM8K-shaped Parquet data validate here."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_7B))
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}}] * 256
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{split}.parquet")
    out = _megarl(
        "train", "configs/qwen2.5_7b_grpo_gsm8k.yaml", "--dry-run", f"model.path={model}",
        f"data.train_files=[{tmp_path / 'train.parquet'}]", f"data.val_files=[{tmp_path / 'test.parquet'}]",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "dry run" in out.stdout and "qwen2 28x3584" in out.stdout and "TP=4 PP=1 DP=2" in out.stdout


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_the_qwen3_quickstarts_train(family, tmp_path):
    """`megarl train configs/tiny_grpo_qwen3{,_moe}.yaml` on the model `megarl tiny-model --family F` writes: 3 GRPO
    steps through vLLM (Qwen3 at TP=2; Qwen3-MoE at DP=2 with EP=2, an engine per rank fed both ranks' experts), the
    engine's log-probs the actor's; the MoE run logs its load-balancing loss every step."""
    from megarl.models.tiny import make_tiny_hf_model

    model, out_dir = make_tiny_hf_model(str(tmp_path / "model"), family), tmp_path / "run"
    out = _megarl(
        "train", f"configs/tiny_grpo_{family}.yaml", f"model.path={model}", "trainer.total_steps=3",
        f"trainer.output_dir={out_dir}", "trainer.val_every=0", "logging.wandb.mode=disabled",
        "data.train_batch_size=4", "actor.global_batch_size=32",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"grpo on {family} " in out.stdout
    assert family != "qwen3_moe" or "EP=2" in out.stdout, out.stdout[-3000:]
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    mismatch = [r["rollout/logprob_mismatch_max"] for r in rows]
    assert max(mismatch) <= 1e-4, mismatch
    if family == "qwen3_moe":
        assert all(0.5 < r["moe/aux_loss"] < 4 for r in rows), [r["moe/aux_loss"] for r in rows]


@pytest.fixture(scope="module")
def rerouted(tmp_path_factory):
    """The Qwen3-MoE quickstart (EP=2, an engine per rank), 3 steps with the engine's last routed layer (of 2) off
    its top-k for ~20% of its tokens, ~10% of (token, layer) pairs (``MEGARL_FAULT=reroute@20``), under ``measure``
    and ``rollout``: each run's metric rows, and per step the share of pairs the engines rerouted (their counts per
    generation, summed)."""
    from megarl.models.tiny import make_tiny_hf_model

    tmp = tmp_path_factory.mktemp("reroute")
    model, runs = make_tiny_hf_model(str(tmp / "model"), "qwen3_moe"), {}
    for mode in ("measure", "rollout"):
        out = _megarl(
            "train", "configs/tiny_grpo_qwen3_moe.yaml", f"model.path={model}", "trainer.total_steps=3",
            f"trainer.output_dir={tmp / mode}", "trainer.val_every=0", "logging.wandb.mode=disabled",
            "data.train_batch_size=4", "actor.global_batch_size=32", f"actor.moe_routing_replay={mode}",
            env={"MEGARL_FAULT": "reroute@20"},
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        counts: dict[str, list[tuple[int, int]]] = {}
        for rank, moved, pairs in re.findall(r"rank (\d+) rerouted (\d+) of (\d+) pairs", out.stdout):
            counts.setdefault(rank, []).append((int(moved), int(pairs)))
        shares = [sum(c[0] for c in step) / sum(c[1] for c in step) for step in zip(*counts.values())]
        runs[mode] = ([json.loads(line) for line in open(tmp / mode / "metrics.jsonl")], shares, out.stdout)
    return runs


def test_routing_replay_measures_a_crafted_disagreement_and_replays_it_away(rerouted):
    """Rollout routing replay against an engine whose last routed layer leaves its top-k for ~10% of (position,
    layer) pairs (and computes with those experts; no later router sees the difference). ``measure``:
    ``moe/routing_agreement`` is 1 minus the rerouted share (within 0.005), and the engine's log-probs are far from
    the actor's. ``rollout``: every real pair is routed to the engine's experts (``moe/routing_replayed`` 1) and
    the log-probs agree to 1e-4 (fp32), >= 100x closer."""
    (measure, shares, out), (rollout, rollout_shares, _) = rerouted["measure"], rerouted["rollout"]
    assert "EP=2" in out and [r["step"] for r in measure] == [1, 2, 3] and len(shares) == 3, out[-3000:]
    assert all(0.05 < s < 0.15 for s in shares + rollout_shares), (shares, rollout_shares)
    for rows, step_shares in ((measure, shares), (rollout, rollout_shares)):
        for r, share in zip(rows, step_shares):
            assert abs(r["moe/routing_agreement"] - (1 - share)) <= 0.005, (r["moe/routing_agreement"], share)
    assert all(r["moe/routing_replayed"] == 1.0 for r in rollout) and "moe/routing_replayed" not in measure[0]
    replayed = max(r["rollout/logprob_mismatch_max"] for r in rollout)
    assert replayed <= 1e-4 and min(r["rollout/logprob_mismatch_max"] for r in measure) >= 100 * replayed, (
        [r["rollout/logprob_mismatch_max"] for r in measure], replayed)


@pytest.mark.parametrize("mode", ["async", "bounded"])
def test_async_modes_replay_the_routes_of_the_version_that_generated_each_batch(mode, tmp_path):
    """One-step-off (a rollout pool generating step k + 1's batch with version k - 1 while the actor, EP=2 on its own
    ranks, trains step k) and the bounded stream (max_staleness 2, partial rollout), with routing replay: every step
    routes every real pair to its samples' engine routes. The first batch's were computed with the weights it trains
    (the actor's own routing agrees); one-step-off's later ones with the weights of an update earlier, which the
    updated routers no longer pick everywhere (bounded: how old follows the wall clock)."""
    from megarl.models.tiny import make_tiny_hf_model

    model, out_dir = make_tiny_hf_model(str(tmp_path / "model"), "qwen3_moe"), tmp_path / "run"
    out = _megarl(
        "train", f"configs/tiny_grpo_{mode}.yaml", f"model.path={model}", "actor.parallel.tp=1", "actor.parallel.dp=2",
        "actor.parallel.ep=2", "trainer.total_steps=3", f"trainer.output_dir={out_dir}", "trainer.val_every=0",
        "logging.wandb.mode=disabled", "data.train_batch_size=4", "actor.global_batch_size=32",
        "actor.moe_routing_replay=rollout",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["moe/routing_replayed"] == 1.0 for r in rows), rows
    agreement = [r["moe/routing_agreement"] for r in rows]
    assert agreement[0] >= 0.999 and (mode == "bounded" or max(agreement[1:]) < 0.99), agreement


@pytest.mark.slow
@pytest.mark.parametrize("family, replay", [("qwen3", "off"), ("qwen3_moe", "off"), ("qwen3_moe", "measure"),
                                            ("qwen3_moe", "rollout")])  # fmt: skip
def test_the_qwen3_quickstarts_learn(family, replay, tmp_path):
    """The recipes as shipped (200 steps) on their tiny models, the MoE's also with rollout routing replay measured
    and on: last-10 mean reward >= first-10 + 0.3."""
    from megarl.models.tiny import make_tiny_hf_model

    model, out_dir = make_tiny_hf_model(str(tmp_path / "model"), family), tmp_path / "run"
    out = _megarl("train", f"configs/tiny_grpo_{family}.yaml", f"model.path={model}", f"trainer.output_dir={out_dir}",
                  "logging.wandb.mode=disabled", f"actor.moe_routing_replay={replay}", timeout=1800)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [r for r in (json.loads(line) for line in open(out_dir / "metrics.jsonl")) if r["step"] > 0]
    first, last = (sum(r["reward/mean"] for r in part) / 10 for part in (rows[:10], rows[-10:]))
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    routing = f"; agreement {mean('moe/routing_agreement'):.5f}" if replay != "off" else ""
    print(f"{family} replay={replay}: reward first 10 {first:.3f} -> last 10 {last:.3f}; s/step "
          f"{mean('timing/step'):.2f}; mismatch mean {mean('rollout/logprob_mismatch_mean'):.2e} max "
          f"{max(r['rollout/logprob_mismatch_max'] for r in rows):.2e}{routing}")  # fmt: skip
    assert len(rows) == 200 and last >= first + 0.3
