"""Greedy generation through any decoder: padded prompts, a prefill, decode steps.

:func:`generate` drives any :class:`~conformance.runtime.decoding.Decoder` through the
same loop (a multi-token prefill then one token per row, or token by token for a family
that decodes so), so a difference between the backends can only come from the models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from conformance.contract import Batch, Family
from conformance.core.distributed import host_array
from conformance.core.seams import seam
from conformance.core.trees import Flat
from conformance.runtime.decoding import (
    CacheShardings,
    DecodeError,
    Decoder,
    by_token,
)


def prompt_batch(family: Family, config: Any, rows: int, steps: int) -> tuple[Batch, np.ndarray]:
    """Right-padded prompts of different lengths, and each row's length.

    Prompts are half the family's :meth:`~Family.sequence_length` wide; row ``i`` holds
    ``width - i`` real tokens of the family's batch, so every row differs (padding slots
    hold token 0 with segment id 0). Raises :class:`DecodeError` unless every row has a
    token and room for ``steps`` more (one more when logits predict the current token:
    the last token is chosen at the position after the last step).
    """
    length = family.sequence_length(config)
    width = length // 2
    needed = steps + (family.logits_predict == "current")
    if rows > width or width + needed > length:
        raise DecodeError(
            f"{family.name}: sequence length {length} leaves no room for {rows} "
            f"prompts of different lengths followed by {steps} decode steps"
        )
    lengths = width - np.arange(rows, dtype=np.int32)
    source = family.batch(config, rows)
    real = np.arange(width)[None, :] < lengths[:, None]
    tokens = np.where(real, host_array(source.tokens)[:, :width], 0)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (rows, width))
    prompt = Batch(
        tokens=jnp.asarray(tokens, jnp.int32),
        positions=jnp.asarray(positions),
        segment_ids=jnp.asarray(real, jnp.int32),
        targets=jnp.zeros((rows, width), jnp.int32),
    )
    return prompt, lengths


def prompt_only(logits: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Prefill-shaped logits with every padding position zeroed: padding is not compared."""
    width = logits.shape[1]
    real = np.arange(width)[None, :] < lengths[:, None]
    return np.where(real[:, :, None], logits, 0)


def step_batch(tokens: np.ndarray, positions: np.ndarray) -> Batch:
    """One decode call's batch: a real token per row, ``[rows, 1]``, at ``positions``."""
    ones = np.ones(tokens.shape, np.int32)
    return Batch(
        tokens=jnp.asarray(tokens, jnp.int32),
        positions=jnp.asarray(positions, jnp.int32),
        segment_ids=jnp.asarray(ones),
        targets=jnp.zeros(tokens.shape, jnp.int32),
    )


def decode_positions(lengths: np.ndarray, step: int) -> np.ndarray:
    """Positions ``[rows, 1]`` of decode step ``step``: each row's length plus ``step``."""
    return (lengths + step).astype(np.int32)[:, None]


@dataclasses.dataclass(frozen=True)
class Generation:
    """What one backend produced: logits at every stage and the greedy tokens."""

    prompt: Batch
    lengths: np.ndarray
    """Real tokens per prompt row, ``[rows]``."""
    prefill_logits: np.ndarray
    """``[rows, prompt width, vocab]``; rows are only meaningful below ``lengths``."""
    step_logits: np.ndarray
    """``[steps, rows, vocab]``: decode step ``t`` ran at position ``lengths + t``."""
    tokens: np.ndarray
    """``[rows, steps + 1]`` tokens at positions ``lengths + k``, greedy or forced (what
    was fed back): for next-token logits the first chosen at prefill, then one per step."""
    caches: tuple[Flat, ...]
    """The cache after prefill, then after each decode step, as host arrays (token by
    token: after the call at the prompt's last position, then after each later call)."""
    predicts: str = "next"
    """What the logits predict (:attr:`~conformance.contract.Family.logits_predict`)."""

    def chosen_from(self, index: int, row: int) -> np.ndarray:
        """The logits ``row``'s greedy token ``index`` was chosen from."""
        position = int(self.lengths[row]) + index - (self.predicts == "next")
        if position < self.prefill_logits.shape[1] and position < self.lengths[row]:
            return self.prefill_logits[row, position]
        return self.step_logits[position - int(self.lengths[row]), row]

    def sequence(self, seq_len: int) -> Batch:
        """The prompts followed by the tokens fed to decode, padded to ``seq_len``."""
        rows, steps = self.step_logits.shape[1], self.step_logits.shape[0]
        tokens = np.zeros((rows, seq_len), np.int32)
        prompt = host_array(self.prompt.tokens)
        for row, length in enumerate(self.lengths):
            tokens[row, :length] = prompt[row, :length]
            tokens[row, length : length + steps] = self.tokens[row, :steps]
        real = np.arange(seq_len)[None, :] < (self.lengths + steps)[:, None]
        targets = tokens.copy()
        if self.predicts == "next":
            targets[:, :-1], targets[:, -1] = tokens[:, 1:], 0
        return Batch(
            tokens=jnp.asarray(tokens),
            positions=jnp.asarray(np.broadcast_to(np.arange(seq_len, dtype=np.int32), real.shape)),
            segment_ids=jnp.asarray(real, jnp.int32),
            targets=jnp.asarray(targets),
        )


def generate(
    decoder: Decoder,
    params: Flat,
    prompt: Batch,
    lengths: np.ndarray,
    steps: int,
    place: Callable[[Batch], Batch] = lambda b: b,
    shardings: CacheShardings | None = None,
    forced: np.ndarray | None = None,
) -> Generation:
    """Prefill ``prompt``, then decode ``steps`` greedy tokens one at a time.

    Every call goes through ``place`` (which shards a batch) and keeps the cache with
    ``shardings``. The token after the prompt is the argmax of the prefill logits at
    each row's last real token; each decode step feeds the previous token at position
    :func:`decode_positions`. With ``forced`` (``[rows, steps + 1]``, another
    generation's :attr:`Generation.tokens`) those tokens are fed instead of the argmax
    (teacher forcing), so two backends decode the same sequences even where rounding
    breaks a near tie differently. A family that decodes token by token is served by
    :func:`_by_token` instead, into the same :class:`Generation`.
    """
    if by_token(decoder.family):
        return _by_token(decoder, params, prompt, lengths, steps, place, shardings, forced)
    rows = len(lengths)
    positions = seam("decode_positions", decode_positions)
    cache = decoder.init_cache(shardings)
    logits, cache = decoder.run("prefill", params, cache, place(prompt), shardings)
    caches = [_on_host(cache)]
    prefill_logits = host_array(logits)
    token = _fed(prefill_logits[np.arange(rows), lengths - 1], forced, 0)
    tokens, step_logits = [token], []
    for step in range(steps):
        batch = step_batch(token[:, None], positions(lengths, step))
        logits, cache = decoder.run("decode", params, cache, place(batch), shardings)
        caches.append(_on_host(cache))
        step_logits.append(host_array(logits)[:, 0])
        token = _fed(step_logits[-1], forced, step + 1)
        tokens.append(token)
    return Generation(
        prompt=prompt,
        lengths=lengths,
        prefill_logits=prefill_logits,
        step_logits=np.stack(step_logits),
        tokens=np.stack(tokens, axis=1),
        caches=tuple(caches),
    )


def _by_token(
    decoder: Decoder,
    params: Flat,
    prompt: Batch,
    lengths: np.ndarray,
    steps: int,
    place: Callable[[Batch], Batch],
    shardings: CacheShardings | None,
    forced: np.ndarray | None,
) -> Generation:
    """:func:`generate` for a family that decodes one token per call, as Flax's examples do.

    Every call feeds one token per row at one position for all rows, from 0 on: a row's
    prompt token while the position is inside its prompt, then its greedy tokens. For
    next-token logits the token fed at position ``p`` is the one at ``p``; for
    current-token logits (the model shifts its inputs) it is the one at ``p - 1``, and 0
    at position 0. The logits at a row's prompt positions are its prefill logits, those
    at ``lengths + t`` its decode step ``t``. ``forced`` tokens replace the greedy ones at
    positions ``lengths + k`` for ``k <= steps``; later ones are never compared.
    """
    rows, width = prompt.tokens.shape
    ahead = int(decoder.family.logits_predict == "next")
    calls = width + steps + 1 - ahead
    sequence = np.zeros((rows, calls + 1), np.int32)
    sequence[:, :width] = host_array(prompt.tokens)
    at = np.zeros((rows, 1), np.int32)
    cache = decoder.init_cache(shardings)
    logits, caches = [], []
    for position in range(calls):
        fed = position - 1 + ahead
        batch = step_batch(sequence[:, fed : fed + 1] if fed >= 0 else at, at + position)
        out, cache = decoder.run("decode", params, cache, place(batch), shardings)
        logits.append(host_array(out)[:, 0])
        chosen = position + ahead
        generated = chosen >= lengths
        sequence[generated, chosen] = logits[-1][generated].argmax(-1)
        if forced is not None:
            k = chosen - lengths
            taken = generated & (k < forced.shape[1])
            sequence[taken, chosen] = forced[taken, k[taken]]
        if position >= width - 1:
            caches.append(_on_host(cache))
    every = np.stack(logits, axis=1)
    rows_at = np.arange(rows)
    return Generation(
        prompt=prompt,
        lengths=lengths,
        prefill_logits=every[:, :width],
        step_logits=np.stack([every[rows_at, lengths + t] for t in range(steps)]),
        tokens=np.stack([sequence[rows_at, lengths + k] for k in range(steps + 1)], axis=1),
        caches=tuple(caches),
        predicts=decoder.family.logits_predict,
    )


def _fed(logits: np.ndarray, forced: np.ndarray | None, index: int) -> np.ndarray:
    """Token ``index`` of each row: ``forced``'s, or the greedy choice from ``logits``."""
    if forced is not None:
        return np.asarray(forced[:, index], np.int32)
    return logits.argmax(-1).astype(np.int32)


def _on_host(flat: Flat) -> Flat:
    return {path: host_array(value) for path, value in flat.items()}
