"""The actor loss's log-probs over the whole vocabulary: megarl's against the plain log_softmax + gather, one run.

``megarl.algos.vocab_parallel_logprobs`` (one vocabulary slice, as at TP=1) with and without the entropy metric the
actor loss asks for, and ``torch.log_softmax(z, -1).gather(...)`` (what ``benchmarks/train_step.py``'s transformers
step computes), forward and backward on the same fp32 logits [micro, length, vocab] and targets. Each side in turn
(round robin) on logits just written, as after the output layer, with the caches flushed before each call (a 64 MB
write): medians of ``--reps`` calls, in ms.

    python benchmarks/logprobs.py              # CPU: the train_step benchmark's micro-batch, 2 x 256 x 8192
    python benchmarks/logprobs.py              # CUDA: the 1.2B's, 2 x 2048 x 32000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--length", type=int, default=2048 if cuda else 256)
    parser.add_argument("--vocab", type=int, default=32000 if cuda else 8192)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from megarl.algos import vocab_parallel_logprobs
    from megarl.compat.host_memory import keep_freed_memory

    torch.set_num_threads(args.threads)
    keep_freed_memory()
    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.micro, args.length, args.vocab, generator=gen) * 3).to(device).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.micro, args.length), generator=gen).to(device)
    grad = torch.randn(args.micro, args.length, generator=gen).to(device)
    flush = torch.empty(16 * 2**20, device=device)

    def megarl(with_entropy: bool):
        logp, _ = vocab_parallel_logprobs(logits, targets, with_entropy=with_entropy)
        return logp

    def plain():
        return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    sides = {"megarl (entropy metric)": lambda: megarl(True), "megarl": lambda: megarl(False), "log_softmax": plain}
    times = {(name, part): [] for name in sides for part in ("forward", "backward")}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for rep in range(args.reps + 5):
        for name, forward in sides.items():
            logits.grad = None
            flush.fill_(1.0)
            logits.data.mul_(1.0)  # just written, as the output layer's logits are
            sync()
            t0 = time.perf_counter()
            logp = forward()
            sync()
            t1 = time.perf_counter()
            logp.backward(grad)
            sync()
            if rep >= 5:
                times[name, "forward"].append(t1 - t0)
                times[name, "backward"].append(time.perf_counter() - t1)
    where = torch.cuda.get_device_name() if cuda else f"CPU ({args.threads} threads)"
    print(f"log-probs of fp32 logits [{args.micro}, {args.length}, {args.vocab}] on {where}; median of {args.reps}, ms")
    print(f"{'':<26}{'forward':>9}{'backward':>10}{'both':>9}{'vs log_softmax':>16}")
    base = sum(statistics.median(times["log_softmax", p]) for p in ("forward", "backward"))
    for name in sides:
        fwd, bwd = (statistics.median(times[name, p]) * 1e3 for p in ("forward", "backward"))
        print(f"{name:<26}{fwd:>9.3f}{bwd:>10.3f}{fwd + bwd:>9.3f}{(fwd + bwd) / (base * 1e3):>15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
