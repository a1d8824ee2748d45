"""HF <-> megarl checkpoint conversion and logit verification (the logic behind checkpoints_tools/)."""
