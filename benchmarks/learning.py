"""Does a change slow learning? One recipe trained at two git commits for N seeds each, validated the same way.

Each commit runs in a git worktree of this repository on this venv (``PYTHONPATH`` = the worktree, as a user would
compare two versions), with ``megarl train`` on the recipe: its training data and validation prompts written once to
JSONL files by this checkout (a ``builtin:`` dataset of this version reads the same for both), checkpoints every
``--val-every`` steps, no in-run validation. Every checkpoint is then exported to HF by its own commit's converter and
validated by *this* checkout: transformers' greedy decoding of the recipe's validation prompts, scored by the recipe's
reward function of this checkout. Both commits are therefore judged by one rule (an older reward that pays for a
restated question, or another validation temperature, would otherwise make the curves incomparable).

Printed per commit: the mean +- std over seeds of the validation reward at each validation step, of the training
reward, and of the first 5 steps' gradient norms; then the last validation step's difference with Welch's t-test
(p from Student's t, via mpmath) and an exact permutation test over the seeds.

    python benchmarks/learning.py --commits e3c066e HEAD        # configs/demo_real.yaml, 20 steps, 3 seeds
    python benchmarks/learning.py --commits A B --steps 10 --val-every 5 --seeds 2 --json out.json

Time on 2 CPU cores (2026-11-29): 10 steps of demo_real took 330-410 s at fb69ed6 and 426-472 s at e3c066e, each
export and validation ~45 s; 3 seeds x 2 commits x 10 steps: 47 minutes. Commits before the one-pass log-probs hold
~8 GB per rank on SmolLM2 at demo_real's 4,096-token micro-batches, and e3c066e's checkpoint writer forks at every
save: on a 24 GiB machine give both commits ``--set actor.max_tokens_per_micro_batch=1024`` (the loss normalisation
is global: the split does not change the gradient) and some swap.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import typing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRAD_STEPS = 5  # the first steps' gradient norms are compared (before the runs' batches diverge much)
TRAIN_STEPS = 5  # the training reward is the mean of the last steps' (one step's 64 samples are noisy)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def worktree(sha: str, root: str) -> str:
    """A detached worktree of ``sha`` under ``root`` (reused when it is there)."""
    path = os.path.join(root, "worktrees", sha[:12])
    if not os.path.isdir(path):
        git("worktree", "add", "--detach", "--force", path, sha)
    return path


# ---- the recipe as each commit reads it -------------------------------------------------------------------------


def schema_paths() -> dict[str, bool]:
    """Every dotted field path of this checkout's ``MegarlConfig`` -> whether it is a nested config (run in a
    commit's worktree by ``known_paths``)."""
    from megarl.config.schema import MegarlConfig

    out: dict[str, bool] = {}

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            nested = dataclasses.is_dataclass(hints.get(f.name))
            out[prefix + f.name] = nested
            if nested:
                walk(hints[f.name], prefix + f.name + ".")

    walk(MegarlConfig, "")
    return out


def known_paths(wt: str) -> dict[str, bool]:
    code = f"import json, sys; sys.path.insert(0, {REPO + '/benchmarks'!r}); import learning; " \
           "print(json.dumps(learning.schema_paths()))"  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=wt, env=_env(wt), check=True, capture_output=True,
                          text=True)  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def for_commit(flat: dict, paths: dict[str, bool]) -> tuple[dict, list[str]]:
    """The recipe's keys this commit's schema has (a key below a plain-typed field, e.g. a dict, is kept), and the
    dropped ones."""

    def known(path: str) -> bool:
        parts = path.split(".")
        return any(paths.get(".".join(parts[:i])) is False for i in range(1, len(parts) + 1))

    kept = {k: v for k, v in flat.items() if known(k)}
    return kept, sorted(set(flat) - set(kept))


def load_recipe(path: str, overrides: list[str]) -> dict:
    """The recipe (relative to the repository) with ``KEY=VALUE`` overrides (YAML values) and an absolute model
    path (checked: the benchmarks never fetch)."""
    import yaml

    sys.path.insert(0, REPO)
    recipe = yaml.safe_load(open(os.path.join(REPO, path)))
    for kv in overrides:
        k, _, v = kv.partition("=")
        recipe = unflatten({**flatten(recipe), k: yaml.safe_load(v)})
    model = recipe["model"]["path"] = os.path.abspath(os.path.join(REPO, recipe["model"]["path"]))
    if not os.path.isfile(os.path.join(model, "config.json")):
        sys.exit(f"no model at {model}: run `megarl fetch-model smollm2-135m-instruct --out {model}` first")
    return recipe


# ---- data and validation, by this checkout ------------------------------------------------------------------------


def write_data(recipe: dict, out: str) -> tuple[str, str]:
    """The recipe's training records and its validation prompts (the first ``data.val_batch_size``) as JSONL."""
    from megarl.data.dataset import read_records

    d = recipe["data"]
    train = [r for f in d["train_files"] for r in read_records(f, "train")]
    val = [r for f in d.get("val_files") or d["train_files"] for r in read_records(f, "val")]
    val = val[: d.get("val_batch_size") or len(val)]
    paths = os.path.join(out, "train.jsonl"), os.path.join(out, "val.jsonl")
    for path, records in zip(paths, (train, val)):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return paths


def recipe_prompts(recipe: dict, path: str, tokenizer, split: str) -> list:
    """The prompts of a JSONL file as the recipe's data section renders them (this checkout's chat rendering)."""
    from megarl.data.dataset import PromptDataset

    d = recipe["data"]
    ds = PromptDataset.from_files([path], split=split, tokenizer=tokenizer, prompt_key=d["prompt_key"],
                                  answer_key=d["answer_key"], max_prompt_length=d["max_prompt_length"],
                                  on_overlong="drop")  # fmt: skip
    return [ds[i] for i in range(len(ds))]


def recipe_rewards(recipe: dict, prompts: list, responses: list[str]) -> list[float]:
    """This checkout's ``reward.function`` of the recipe on one response per prompt."""
    from megarl.rewards import load_reward_fn

    fn = load_reward_fn(recipe["reward"]["function"])
    scores = fn([p.prompt_text for p in prompts], responses, [p.ground_truth for p in prompts],
                [p.extras for p in prompts])  # fmt: skip
    return [float(x) for x in scores]


def validate(hf_dir: str, recipe: dict, val_path: str, max_new_tokens: int) -> float:
    """Mean reward of transformers' greedy decoding of the validation prompts (this checkout's reward and chat
    rendering)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompts = recipe_prompts(recipe, val_path, tok, "val")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    responses = []
    for start in range(0, len(prompts), 64):
        batch = [p.prompt_ids for p in prompts[start : start + 64]]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad)  # fmt: skip
        responses += tok.batch_decode(out[:, width:], skip_special_tokens=True)
    scores = recipe_rewards(recipe, prompts, responses)
    return sum(scores) / len(scores)


# ---- one run ----------------------------------------------------------------------------------------------------


def _env(wt: str) -> dict:
    env = {**os.environ, "PYTHONPATH": wt, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    env.pop("WORLD_SIZE", None)
    return env


def run_one(wt: str, flat: dict, out: str, log) -> list[dict]:
    """``megarl train`` at the worktree on the pruned recipe; its metrics rows."""
    import yaml

    os.makedirs(out, exist_ok=True)
    cfg = os.path.join(out, "recipe.yaml")
    with open(cfg, "w") as f:
        yaml.safe_dump(unflatten(flat), f, sort_keys=False)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", cfg], cwd=wt, env=_env(wt),
                          capture_output=True, text=True)  # fmt: skip
    with open(os.path.join(out, "train.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"megarl train at {wt} failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    log(f"  trained in {time.time() - t0:.0f}s")
    return [json.loads(line) for line in open(os.path.join(flat["trainer.output_dir"], "metrics.jsonl"))]


def validate_checkpoints(wt: str, run_dir: str, steps: list[int], recipe: dict, val_path: str, new_tokens: int,
                         log) -> dict[int, float]:  # fmt: skip
    """Each saved step exported by the commit's own converter (``latest`` pointed at it), validated here."""
    ckpt, hf = os.path.join(run_dir, "checkpoints"), os.path.join(run_dir, "hf")
    out = {}
    for step in steps:
        with open(os.path.join(ckpt, "latest"), "w") as f:
            f.write(f"iter_{step:07d}")
        proc = subprocess.run([sys.executable, "-m", "megarl.cli", "convert", "megatron-to-hf", "--ckpt", ckpt, "--out",
                               hf, "--overwrite"], cwd=wt, env=_env(wt), capture_output=True, text=True)  # fmt: skip
        if proc.returncode:
            raise RuntimeError(f"the export of step {step} at {wt} failed: {proc.stderr[-3000:]}")
        out[step] = validate(hf, recipe, val_path, new_tokens)
        log(f"  step {step}: val reward {out[step]:.3f}")
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(ckpt, ignore_errors=True)  # ~1.6 GB per save at 135M (weights + Adam)
    return out


# ---- statistics -------------------------------------------------------------------------------------------------


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def pm(xs: list[float]) -> str:
    m, s = mean_std(xs)
    return f"{m:.3f} +- {s:.3f}"


def welch(a: list[float], b: list[float]) -> dict:
    """Welch's two-sided t-test of mean(b) != mean(a): t (of b - a), degrees of freedom, p (Student's t via the
    regularised incomplete beta function: p = I_{df/(df+t^2)}(df/2, 1/2)); all NaN where it is undefined (fewer
    than 2 seeds a side, or no spread on either side)."""
    import mpmath

    (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
    va, vb = sa**2 / len(a), sb**2 / len(b)
    if min(len(a), len(b)) < 2 or va + vb == 0:
        return {"t": math.nan, "df": math.nan, "p": math.nan}
    t = (mb - ma) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    p = float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))
    return {"t": t, "df": df, "p": p}


def permutation_p(a: list[float], b: list[float]) -> float:
    """Exact two-sided permutation test of the difference of means (every split of the pooled values)."""
    pooled, n = a + b, len(a)
    observed = abs(statistics.fmean(a) - statistics.fmean(b))
    splits = list(itertools.combinations(range(len(pooled)), n))
    hits = 0
    for idx in splits:
        x = [pooled[i] for i in idx]
        y = [pooled[i] for i in range(len(pooled)) if i not in idx]
        hits += abs(statistics.fmean(x) - statistics.fmean(y)) >= observed - 1e-12
    return hits / len(splits)


def report(results: dict, commits: list[str], val_steps: list[int]) -> str:
    lines = []
    head = f"{'commit':<14}{'seeds':>6}" + "".join(f"{'val@' + str(s):>15}" for s in val_steps)
    head += f"{'train reward':>15}{'grad_norm 1-' + str(GRAD_STEPS):>16}"  # train reward: the last TRAIN_STEPS
    lines.append(head)
    for c in commits:
        runs = results[c]["runs"]
        row = f"{c[:12]:<14}{len(runs):>6}"
        for s in val_steps:
            row += f"{pm([r['val'][str(s)] for r in runs]):>15}"
        row += f"{pm([r['train_reward'] for r in runs]):>15}"
        row += f"{pm([statistics.fmean(r['grad_norm']) for r in runs]):>16}"
        lines.append(row)
    last = str(val_steps[-1])
    a, b = ([r["val"][last] for r in results[c]["runs"]] for c in commits)
    w = welch(a, b)
    lines.append(
        f"last validation (step {last}): {commits[0][:12]} {statistics.fmean(a):.3f} vs {commits[1][:12]} "
        f"{statistics.fmean(b):.3f} (difference {statistics.fmean(b) - statistics.fmean(a):+.3f}); Welch t = "
        f"{w['t']:.2f}, df = {w['df']:.1f}, p = {w['p']:.3f}; exact permutation p = {permutation_p(a, b):.3f}"
    )
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commits", nargs=2, required=True, metavar=("A", "B"), help="two revisions, e.g. e3c066e HEAD")
    ap.add_argument("--recipe", default="configs/demo_real.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--val-every", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3, help="trainer.seed = 1 .. N (data order and sampling)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides for both commits")
    ap.add_argument("--work", default=os.path.join(REPO, ".cache", "learning"), help="worktrees, data and runs")
    ap.add_argument("--json", default=None, help="write every run's numbers here")
    ap.add_argument("--report", default=None, metavar="JSON", help="only print the table of a run's --json file")
    args = ap.parse_args()
    if args.report:
        results = json.load(open(args.report))
        steps = sorted(int(s) for s in results[args.commits[0]]["runs"][0]["val"])
        print(report(results, args.commits, steps))
        return
    recipe = load_recipe(args.recipe, args.set)
    model = recipe["model"]["path"]
    os.makedirs(args.work, exist_ok=True)
    train_path, val_path = write_data(recipe, args.work)
    new_tokens = (recipe["rollout"].get("val_sampling") or {}).get("max_new_tokens") or \
        recipe["rollout"]["sampling"]["max_new_tokens"]  # fmt: skip
    val_steps = list(range(0, args.steps + 1, args.val_every))

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.time()
    step0 = validate(model, recipe, val_path, new_tokens)
    log(f"step 0 (the recipe's model, {time.time() - t0:.0f}s): val reward {step0:.3f}")
    flat = flatten(recipe)
    flat = {k: v for k, v in flat.items() if not k.startswith("rollout.val_sampling.")}
    flat.update({"model.path": model, "data.train_files": [train_path], "data.val_files": [],
                 "trainer.total_steps": args.steps, "trainer.val_every": 0, "trainer.save_every": args.val_every,
                 "trainer.keep_last": 0, "trainer.resume": "never", "trainer.overwrite": True,
                 "logging.wandb.mode": "disabled", "logging.progress_bar": False})  # fmt: skip
    shas = [git("rev-parse", c) for c in args.commits]
    results = {c: {"sha": sha, "runs": []} for c, sha in zip(args.commits, shas)}
    schemas = {sha: known_paths(worktree(sha, args.work)) for sha in shas}
    for seed in range(1, args.seeds + 1):  # seeds outermost: a drift of the machine's speed hits both commits
        for c, sha in zip(args.commits, shas):
            wt = worktree(sha, args.work)
            run_dir = os.path.join(args.work, "runs", sha[:12], f"seed{seed}")
            kept, dropped = for_commit({**flat, "trainer.seed": seed, "trainer.output_dir": run_dir}, schemas[sha])
            log(f"{c} ({sha[:12]}) seed {seed}" + (f"; keys it does not know, dropped: {dropped}" if dropped else ""))
            rows = run_one(wt, kept, run_dir, log)
            val = validate_checkpoints(wt, run_dir, val_steps[1:], recipe, val_path, new_tokens, log)
            results[c]["runs"].append({
                "seed": seed,
                "val": {"0": step0, **{str(s): v for s, v in val.items()}},
                "train_reward": statistics.fmean(r["reward/mean"] for r in rows[-TRAIN_STEPS:]),
                "grad_norm": [r["actor/grad_norm"] for r in rows[:GRAD_STEPS]],
                "rows": [{k: r.get(k) for k in ("step", "reward/mean", "actor/grad_norm", "actor/pg_loss")}
                         for r in rows],  # fmt: skip
            })
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    print(f"\n{args.recipe}, {args.steps} steps, validation every {args.val_every} (greedy, this checkout's reward), "
          f"{args.seeds} seeds, {time.time() - t0:.0f}s")  # fmt: skip
    print(report(results, args.commits, val_steps))


if __name__ == "__main__":
    main()
