"""One node of a megarl SLURM job (srun starts it once per node): ``python -m megarl.launch.node <torchrun command>``
runs torchrun as one node's share of the run (``lifetime.supervise``): SIGUSR1/SIGTERM go to the training ranks, which
stop (``megarl.run.preemption``), save, write STOPPED and exit 0; a rank that dies takes the node's other
processes with it at once; the node's shared memory is removed when the run ends. srun delivers a signal to every
process of the job step, so torchrun starts with SIGUSR1 ignored (it would die of it)."""

from __future__ import annotations

import os
import socket
import sys

from megarl.lifetime import supervise


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m megarl.launch.node <torchrun command ...>", file=sys.stderr)
        return 2
    label = f"node {os.environ.get('SLURM_NODEID', '?')} ({socket.gethostname().split('.')[0]})"
    return supervise(argv, label=label)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
