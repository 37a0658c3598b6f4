"""Deterministic batches shared by the built-in families."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from conformance.families import Batch


def make_batch(vocab_size: int, seq_len: int, batch_size: int, seed: int = 0) -> Batch:
    """Return a deterministic, padded batch of ``batch_size`` rows of ``seq_len`` tokens.

    Tokens are drawn from ``[1, vocab_size)`` by ``numpy.random.default_rng(seed)``. Row
    ``i`` ends in ``min(i, seq_len - 1)`` padding tokens (token 0, segment id 0), so
    padding is exercised from the second row on. Positions count from 0 in every row;
    targets are the tokens shifted left by one, with 0 after the last token.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab_size, size=(batch_size, seq_len), dtype=np.int32)
    segment_ids = np.ones((batch_size, seq_len), dtype=np.int32)
    for row in range(1, batch_size):
        pad = min(row, seq_len - 1)
        tokens[row, seq_len - pad :] = 0
        segment_ids[row, seq_len - pad :] = 0
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len))
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    return Batch(
        tokens=jnp.asarray(tokens, dtype=jnp.int32),
        positions=jnp.asarray(positions, dtype=jnp.int32),
        segment_ids=jnp.asarray(segment_ids, dtype=jnp.int32),
        targets=jnp.asarray(targets, dtype=jnp.int32),
    )
