"""Templates filled by `megarl launch` (sbatch.sh.tmpl, node.sh, clusters/*.env); the logic is in megarl/launch/."""
