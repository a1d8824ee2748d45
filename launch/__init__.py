"""Templates filled by `megarl launch` (sbatch.sh.tmpl, clusters/*.env); the logic is in megarl/launch/."""
