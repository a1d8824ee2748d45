"""How the parity tests compare logged metrics: a continuous metric (a loss, a mean) within a relative float
tolerance; a fraction of tokens (a clip fraction, a masked fraction) within one token's share. Float noise that puts
one token on the other side of a clip moves such a fraction by a whole token (seen: ``critic/vf_clipfrac`` 13/96 vs
12/96 on a fresh machine), which no relative tolerance describes."""

TOKEN_FRACTIONS = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac", "rollout/is_masked_frac")


def far_apart(a: dict, b: dict, keys, *, rtol: float, floor: float, token_share: float) -> dict:
    """``{key: (a, b)}`` for the metrics among ``keys`` further apart than their tolerance: ``rtol`` relative to
    ``max(|a|, floor)``, or for a token fraction ``token_share`` (one token's share of it: 1 / the tokens of the
    smallest mini-batch it is averaged over, / the number of mini-batches)."""
    far = {}
    for k in keys:
        tol = token_share * (1 + 1e-6) if k.endswith(TOKEN_FRACTIONS) else rtol * max(abs(a[k]), floor)
        if abs(a[k] - b[k]) > tol:
            far[k] = (a[k], b[k])
    return far


def token_share(lengths: list[int], mini_batch: int) -> float:
    """One token's share of a token fraction averaged over mini-batches of ``mini_batch`` sequences of ``lengths``
    response tokens (the smallest mini-batch's token is the largest step)."""
    batches = [lengths[i : i + mini_batch] for i in range(0, len(lengths), mini_batch)]
    return 1.0 / (len(batches) * min(sum(b) for b in batches))


def bf16_ulp(w) -> float:
    """The spacing of bf16 numbers at the tensor's largest magnitude (8 significant bits)."""
    import torch

    return 2.0 ** (torch.frexp(w.float().abs().max()).exponent.item() - 8)
