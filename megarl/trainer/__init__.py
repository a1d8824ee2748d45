"""Jobs and loops: for now the Megatron smoke run behind `megarl train` (the RL loop lands here later)."""
