"""What does a reward function pay at two git commits? One batch of sampled responses scored by each.

The batch is sampled once by this checkout (``gradient_across_commits.make_batch``: the recipe's first training
prompts, ``rollout.sampling.n`` samples each from transformers, seeded); each commit's ``reward.function`` then scores
the same texts in its worktree. Printed: each commit's mean reward, the responses they score differently and a few
of them. A learning curve measured with its own commit's reward is only comparable where the two agree.

    python benchmarks/reward_across_commits.py --commits e3c066e HEAD \\
        --set 'data.train_files=[builtin:dm_math/arithmetic__add_or_sub]' data.train_batch_size=32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradient_across_commits as grads  # noqa: E402  (this folder's)
import learning  # noqa: E402

SCORE = """import json, sys
from megarl.rewards import load_reward_fn
b = json.load(open(sys.argv[2]))
print(json.dumps(load_reward_fn(sys.argv[1])(b["prompts"], b["texts"], b["ground_truths"], b["extras"])))"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commits", nargs=2, required=True, metavar=("A", "B"))
    ap.add_argument("--recipe", default="configs/demo_real.yaml")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default=os.path.join(learning.REPO, ".cache", "learning"))
    args = ap.parse_args()
    recipe = learning.load_recipe(args.recipe, args.set)
    os.makedirs(args.work, exist_ok=True)
    train_path, _ = learning.write_data(recipe, args.work)
    batch_path = os.path.join(args.work, "reward_batch.json")
    batch = grads.make_batch(recipe, train_path, batch_path, args.seed)
    scores = {}
    for c in args.commits:
        wt = learning.worktree(learning.git("rev-parse", c), args.work)
        out = subprocess.run([sys.executable, "-c", SCORE, recipe["reward"]["function"], batch_path], cwd=wt,
                             env=learning._env(wt), check=True, capture_output=True, text=True).stdout  # fmt: skip
        scores[c] = json.loads(out.strip().splitlines()[-1])
    a, b = (scores[c] for c in args.commits)
    differ = [i for i in range(len(a)) if a[i] != b[i]]
    print(f"{len(a)} responses ({recipe['data']['train_files']}, {recipe['rollout']['sampling']['n']} per prompt)")
    n = recipe["rollout"]["sampling"]["n"]
    for c in args.commits:
        x = scores[c]
        spread = sum(len(set(x[g : g + n])) > 1 for g in range(0, len(x), n))  # GRPO learns from these groups only
        print(f"  {c[:12]:<12} mean reward {sum(x) / len(x):.3f} ({sum(v > 0 for v in x)} paid); groups whose "
              f"rewards differ (non-zero advantages): {spread} of {len(x) // n}")  # fmt: skip
    print(f"  scored differently: {len(differ)}")
    for i in differ[:6]:
        print(f"    {batch['texts'][i]!r} (answer {batch['ground_truths'][i]}): {a[i]} -> {b[i]}")


if __name__ == "__main__":
    main()
