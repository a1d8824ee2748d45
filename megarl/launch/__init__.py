"""Multi-node launchers: ``megarl launch torchrun`` (one command per node) and ``megarl launch slurm`` (an sbatch
script). The templates they fill live in the top-level ``launch/`` folder."""
