"""One saved GRPO batch, one update at two git commits: their gradients compared tensor by tensor.

The batch is made once by this checkout from the recipe (``configs/demo_real.yaml`` by default): its first
``data.train_batch_size`` training prompts, ``rollout.sampling.n`` samples each from transformers (seeded, the
recipe's temperature and length), the engine log-probs of the sampled tokens, and the rewards of this checkout's reward
function. Each commit then runs its own trainer's ``learn`` on that batch (advantages, the actor's loss and one
optimizer step, the recipe's layout: DP=2 for demo_real) in a worktree on this venv (``benchmarks/learning.py``'s),
with gradient clipping off so that the gradient read back is the raw one. Printed: each commit's pg_loss and gradient
norm, the two gradients' cosine and norm ratio, the tensors that differ most, and the weights after the step.

    python benchmarks/gradient_across_commits.py --commits e3c066e HEAD
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import learning  # noqa: E402  (this folder's: worktrees, the recipe per commit, data)

REPO = learning.REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_batch(recipe: dict, train_path: str, out: str, seed: int) -> dict:
    """Samples (prompt ids, response ids incl. EOS, their log-probs under the sampler), their texts, ground truths and
    rewards, by this checkout."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s = recipe["rollout"]["sampling"]
    path = recipe["model"]["path"]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = learning.recipe_prompts(recipe, train_path, tok, "train")[: recipe["data"]["train_batch_size"]]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    samples = []
    for pi, p in enumerate(prompts):
        ids = torch.tensor([p.prompt_ids] * s["n"])
        with torch.inference_mode():
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                               temperature=s["temperature"], max_new_tokens=s["max_new_tokens"], output_scores=True,
                               return_dict_in_generate=True, pad_token_id=tok.eos_token_id)  # fmt: skip
        new = g.sequences[:, ids.shape[1] :]
        logp = torch.stack([torch.log_softmax(sc.float(), -1) for sc in g.scores], 1)  # [n, T, V], T-scaled
        for si in range(s["n"]):
            toks = new[si].tolist()
            stopped = tok.eos_token_id in toks
            end = toks.index(tok.eos_token_id) + 1 if stopped else len(toks)
            samples.append({"prompt_index": pi, "sample_index": si, "prompt_ids": p.prompt_ids,
                            "token_ids": toks[:end], "finish_reason": "stop" if stopped else "length",
                            "logprobs": [logp[si, t, toks[t]].item() for t in range(end)]})  # fmt: skip
    texts = [tok.decode(x["token_ids"], skip_special_tokens=True) for x in samples]
    of = [prompts[x["prompt_index"]] for x in samples]
    batch = {"samples": samples, "rewards": learning.recipe_rewards(recipe, of, texts), "texts": texts,
             "prompts": [p.prompt_text for p in of], "ground_truths": [p.ground_truth for p in of],
             "extras": [p.extras for p in of]}  # fmt: skip
    with open(out, "w") as f:
        json.dump(batch, f)
    return batch


# ---- the worker: one commit's ``learn`` on the batch (runs with that commit's megarl on the path) ----------------


TRAINER_HOMES = {
    "build_rl_models": ("megarl.backend.models", "megarl.trainer.models"),
    "model_source": ("megarl.models.source", "megarl.training.init_weights"),
    "Collected": ("megarl.rl.collect", "megarl.trainer.collect"),
    "make_roles": ("megarl.rl.roles", "megarl.trainer.roles"),
    "learn": ("megarl.rl.step", "megarl.trainer.loop"),
    "PhaseTimer": ("megarl.rl.timer", "megarl.trainer.timer"),
}
"""Where the trainer's pieces live: after the package recut (27 Nov 2026), and before it (e3c066e's layout). The
worker runs against another commit's megarl, so it looks them up by name rather than importing this checkout's."""


def _imports() -> list:
    """The pieces from the modules of the megarl on the path (by file: the editable install of this checkout would
    answer for a module an older commit does not have)."""
    root = os.path.dirname(importlib.import_module("megarl").__file__)
    found = []
    for name, homes in TRAINER_HOMES.items():
        here = [h for h in homes if os.path.isfile(os.path.join(root, *h.split(".")[1:]) + ".py")]
        if not here:
            raise ImportError(f"{name} is in none of {homes} at this commit: add its module to TRAINER_HOMES")
        found.append(getattr(importlib.import_module(here[0]), name))
    return found


def worker(recipe_path: str, batch_path: str, out: str) -> None:
    import torch.distributed as dist

    from megarl.algos import kl_controller
    from megarl.config.loader import load_config
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.adapter import tensor_maps, to_hf
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.rollout.protocol import Sample

    build_rl_models, model_source, Collected, make_roles, learn, PhaseTimer = _imports()
    cfg = load_config(recipe_path, ["actor.optim.clip_grad=0"])
    spec = spec_from_hf_config(read_hf_config(cfg.model.path))
    par = cfg.actor.parallel
    layout = ParallelLayout(tp=par.tp, pp=par.pp, dp=par.dp)
    init_distributed(layout, seed=cfg.trainer.seed)
    models = build_rl_models(cfg, spec, layout, model_source(cfg.model.path), dist.get_rank())
    saved = json.load(open(batch_path))
    batch = Collected()
    for s in saved["samples"]:
        batch.samples.append(Sample(s["prompt_index"], s["sample_index"], s["prompt_ids"], s["token_ids"],
                                    s["logprobs"], s["finish_reason"], [0] * len(s["token_ids"])))  # fmt: skip
    batch.rewards = batch.scores = list(saved["rewards"])
    learned = learn(cfg, make_roles(cfg, spec, models), batch, kl_ctrl=kl_controller("fixed", 0.0, 0.1, 1000),
                    skip_old_logprob=True, timer=PhaseTimer())  # fmt: skip
    grads = {n: p.main_grad.detach().clone() for n, p in models.actor.module.named_parameters()}
    weights = {n: p.detach().clone() for n, p in models.actor.module.named_parameters()}
    as_hf = {"grads": {}, "weights": {}}
    for tmap in tensor_maps(spec):
        if tmap.megatron in grads:
            as_hf["grads"].update(zip(tmap.hf, to_hf(tmap, grads[tmap.megatron], spec)))
            as_hf["weights"].update(zip(tmap.hf, to_hf(tmap, weights[tmap.megatron], spec)))
    if dist.get_rank() == 0:
        torch.save({**as_hf, "metrics": learned.actor, "advantages": [a.tolist() for a in learned.advantages]}, out)
    dist.barrier()
    dist.destroy_process_group()


# ---- the comparison -------------------------------------------------------------------------------------------


def compare(a: dict, b: dict, names: tuple[str, str]) -> str:
    ga, gb = a["grads"], b["grads"]
    common = sorted(set(ga) & set(gb))
    flat_a = torch.cat([ga[n].flatten().double() for n in common])
    flat_b = torch.cat([gb[n].flatten().double() for n in common])
    lines = [f"{'':<16}{names[0][:12]:>14}{names[1][:12]:>14}"]
    for key in ("actor/pg_loss", "actor/grad_norm", "pg_loss", "grad_norm"):
        if key in a["metrics"] and key in b["metrics"]:
            lines.append(f"{key:<16}{a['metrics'][key]:>14.6g}{b['metrics'][key]:>14.6g}")
    lines.append(f"{'|g| (read)':<16}{flat_a.norm().item():>14.6g}{flat_b.norm().item():>14.6g}")
    adv_a = torch.tensor([x for s in a["advantages"] for x in s[:1]])
    adv_b = torch.tensor([x for s in b["advantages"] for x in s[:1]])
    lines.append(f"advantages: max |difference| {(adv_a - adv_b).abs().max().item():.2e}")
    cos = (flat_a @ flat_b / (flat_a.norm() * flat_b.norm())).item()
    lines.append(f"gradient: cosine {cos:.6f}, |g_{names[1][:12]}| / |g_{names[0][:12]}| = "
                 f"{(flat_b.norm() / flat_a.norm()).item():.6f}, {len(common)} tensors")  # fmt: skip
    rel = sorted(((gb[n] - ga[n]).norm().item() / max(ga[n].norm().item(), 1e-30), n) for n in common)
    lines.append("largest per-tensor |g_B - g_A| / |g_A|: " + ", ".join(f"{n} {r:.2e}" for r, n in rel[::-1][:4]))
    lines.append("smallest: " + ", ".join(f"{n} {r:.2e}" for r, n in rel[:2]))
    dw = max(((b["weights"][n] - a["weights"][n]).abs().max().item(), n) for n in common)
    lines.append(f"weights after the step: largest |w_B - w_A| {dw[0]:.2e} ({dw[1]})")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commits", nargs=2, required=True, metavar=("A", "B"))
    ap.add_argument("--recipe", default="configs/demo_real.yaml")
    ap.add_argument("--seed", type=int, default=1, help="the sampler's seed for the saved batch")
    ap.add_argument("--work", default=os.path.join(REPO, ".cache", "learning"))
    args = ap.parse_args()
    import yaml

    recipe = learning.load_recipe(args.recipe, [])
    os.makedirs(args.work, exist_ok=True)
    train_path, _ = learning.write_data(recipe, args.work)
    batch_path = os.path.join(args.work, "grad_batch.json")
    batch = make_batch(recipe, train_path, batch_path, args.seed)
    r = batch["rewards"]
    print(f"saved batch: {len(r)} samples, mean reward {sum(r) / len(r):.3f}, "
          f"{sum(len(s['token_ids']) for s in batch['samples'])} response tokens")  # fmt: skip
    flat = learning.flatten(recipe)
    flat = {k: v for k, v in flat.items() if not k.startswith("rollout.val_sampling")}
    flat.update({"data.train_files": [train_path], "data.val_files": [], "logging.wandb.mode": "disabled"})
    outs = {}
    for c in args.commits:
        sha = learning.git("rev-parse", c)
        wt = learning.worktree(sha, args.work)
        kept, dropped = learning.for_commit(flat, learning.known_paths(wt))
        if dropped:
            print(f"{c}: keys it does not know, dropped: {dropped}")
        recipe_path = os.path.join(args.work, f"grad_recipe_{sha[:12]}.yaml")
        with open(recipe_path, "w") as f:
            yaml.safe_dump(learning.unflatten(kept), f)
        out = os.path.join(args.work, f"grad_{sha[:12]}.pt")
        ranks = recipe["actor"]["parallel"]["dp"] * recipe["actor"]["parallel"].get("tp", 1) * \
            recipe["actor"]["parallel"].get("pp", 1)  # fmt: skip
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                        f"--master-port={free_port()}", os.path.abspath(__file__), "--worker", recipe_path,
                        batch_path, out],
                       cwd=wt, env=learning._env(wt), check=True)  # fmt: skip
        outs[c] = torch.load(out, weights_only=False)
    print(compare(outs[args.commits[0]], outs[args.commits[1]], tuple(args.commits)))


if __name__ == "__main__":
    main()
