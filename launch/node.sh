#!/usr/bin/env bash
# One node of a megarl SLURM job (srun starts it once per node): runs the torchrun command given as arguments and
# turns SIGUSR1 or SIGTERM into a SIGUSR1 to the training ranks (torchrun's children), which finish the step, save,
# write STOPPED and exit 0. torchrun's agent must not get them: it dies of SIGUSR1, and on SIGTERM it kills its
# workers after a short grace period, too short for a save. srun delivers a signal to every process of the job step,
# so torchrun starts with SIGUSR1 ignored (SIG_IGN survives exec; the ranks install their own handler).
set -u
(trap '' USR1; exec "$@") &
agent=$!
stop_ranks() {
  echo "[megarl] node ${SLURM_NODEID:-?} ($(hostname -s)): SIG$1 -> SIGUSR1 to the ranks of torchrun $agent"
  pkill -USR1 -P "$agent" || true
}
trap 'stop_ranks USR1' USR1
trap 'stop_ranks TERM' TERM
while kill -0 "$agent" 2>/dev/null; do wait "$agent"; done  # a trapped signal ends `wait` early: wait again
wait "$agent"  # torchrun's exit status
