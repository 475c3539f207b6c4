"""Stochastic rounding's noise: a counter-based stream (Threefry-2x32-20), so any element's noise is computable alone.

Each exported tensor has a 64-bit ``key`` (``tensor_seed(seed, name)``) and counts its exports in ``step``. The noise
of element ``g`` (its index in the whole tensor's flat order) at one export is a pure function of
``(key, step, g)``: Threefry-2x32 with 20 rounds (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
1, 2, 3", SC'11, the generator JAX uses by default) encrypts a 64-bit counter under the key. Because nothing is
sequential:

- a shard of a tensor (an FSDP rank's slab starting at element ``offset``) draws exactly the noise the whole tensor
  gives those elements, with no skipping ahead (``export_bf16(..., offset=)``, ``integrations.verl``);
- the CPU kernels (``_native.c``) compute it in parallel and vectorised, fused with the rounding, in one pass.

Layout. Counter ``(c0, c1)``: ``c1 = 4 * step + stream``, stream 0 the rounding noise and streams 1 to 3 fp16's
extra draws for values below its smallest subnormal; ``c0`` the block index. Block ``c0`` gives two 32-bit words
``x0, x1``.

- bf16 (16 bits per element): element ``g`` takes block ``8 * (g >> 5) + (g & 7)``, part ``(g >> 3) & 3`` of
  ``(x0 & 0xFFFF, x0 >> 16, x1 & 0xFFFF, x1 >> 16)``: 32 consecutive elements share 8 consecutive blocks, a layout
  that vectorises without shuffles.
- fp16 (up to 23 bits per element): element ``g``'s 32-bit word is bf16's 16-bit part in its low half and ``x1``
  of block ``g`` in stream 3 in its high half; its low ``d`` bits are the noise. ``d <= 16`` for ``|x| >= 2^-17``,
  so only values below that (rare in weights) need the high half, and the kernels compute it only for them.
- fp16's values below ``2^-24`` draw an exact Bernoulli from five 32-bit words: element ``g`` takes block ``g`` of
  streams 1, 2 and 3, words ``(x0, x1)`` of stream 1, ``(x0, x1)`` of stream 2 and ``x0`` of stream 3, in order
  (stream 3's ``x1`` is the high half above; a value uses one or the other, never both).

The functions here are the stream in torch ops (int64 holding unsigned 32-bit values, masked after every add and
shift, so no operation overflows); they run on any device, and are what the compiled kernels are tested against.
"""

from __future__ import annotations

import torch

MASK = 0xFFFFFFFF
_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = 0x1BD11BDA  # Threefry's key-schedule constant
MAX_STEP = (1 << 30) - 1  # c1 = 4 * step + stream must fit 32 bits
MAX_BLOCKS = 1 << 32  # c0 is 32 bits: 2^34 elements per tensor in bf16, 2^32 in fp16 (its tiny draws: block g)
MAX_ELEMENTS = {"bf16": 1 << 34, "fp16": 1 << 32}


def split_key(key: int) -> tuple[int, int]:
    """A 64-bit key as Threefry's two 32-bit key words (low, high)."""
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 1 << 64:
        raise ValueError(f"a stochastic-rounding key is an int in [0, 2**64), got {key!r}")
    return key & MASK, key >> 32


def counter_hi(step: int, stream: int) -> int:
    if not 0 <= step <= MAX_STEP:
        raise ValueError(
            f"stochastic export step {step} is outside [0, 2**30): a tensor's noise stream counts its exports, and "
            "2**30 exports of one tensor are more than any run makes; start a new Exporter (a new seed)"
        )
    return 4 * step + stream


def threefry2x32(key: int, c0: torch.Tensor, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32-20 of counters ``(c0, c1)`` (``c0`` an int64 tensor of values in [0, 2^32)) under ``key``."""
    k0, k1 = split_key(key)
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0 = (c0 + k0) & MASK
    x1 = torch.full_like(c0, (c1 + k1) & MASK)
    for r in range(20):
        x0 = (x0 + x1) & MASK
        rot = _ROTATIONS[r % 8]
        x1 = ((x1 << rot) & MASK) | (x1 >> (32 - rot))  # rotate left; x1 < 2^32, so x1 << rot < 2^63
        x1 = x1 ^ x0
        if r % 4 == 3:
            i = r // 4 + 1
            x0 = (x0 + ks[i % 3]) & MASK
            x1 = (x1 + ks[(i + 1) % 3] + i) & MASK
    return x0, x1


def tiny_draws(key: int, step: int, elements: torch.Tensor) -> torch.Tensor:
    """fp16's five Bernoulli words of each element index in ``elements`` (int64), shape ``(n, 5)``, as int64."""
    words = []
    for stream in (1, 2, 3):
        x0, x1 = threefry2x32(key, elements, counter_hi(step, stream))
        words += [x0, x1]
    return torch.stack(words[:5], dim=1)


def bf16_noise(key: int, step: int, first: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16-bit noise of elements ``first .. first + n - 1`` (int64), one Threefry block per 4 elements: each group
    of 32 elements takes 8 consecutive blocks, whose 4 parts, lane by lane, are the group's elements in order."""
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    g0, g1 = first // 32, (first + n - 1) // 32  # the groups the range touches
    if 8 * (g1 + 1) > MAX_BLOCKS:
        raise ValueError(f"tensor too large for one stochastic-rounding stream ({first + n} elements)")
    blocks = torch.arange(8 * g0, 8 * (g1 + 1), dtype=torch.int64, device=device)
    x0, x1 = threefry2x32(key, blocks, counter_hi(step, 0))
    x0, x1 = x0.view(-1, 1, 8), x1.view(-1, 1, 8)
    words = torch.cat([x0 & 0xFFFF, x0 >> 16, x1 & 0xFFFF, x1 >> 16], dim=1)  # (groups, part, lane): element order
    start = first - 32 * g0
    return words.reshape(-1)[start : start + n]


def bf16_noise_at(key: int, step: int, elements: torch.Tensor) -> torch.Tensor:
    """The 16-bit noise of the element indices in ``elements`` (int64), one Threefry block per element."""
    blocks = 8 * (elements >> 5) + (elements & 7)
    x0, x1 = threefry2x32(key, blocks, counter_hi(step, 0))
    part = (elements >> 3) & 3
    word = torch.where(part >= 2, x1, x0)
    return torch.where((part & 1) == 1, word >> 16, word & 0xFFFF)


def fp16_words(key: int, step: int, elements: torch.Tensor) -> torch.Tensor:
    """fp16's whole 32-bit noise words of the element indices in ``elements`` (int64 in [0, 2^32)): bf16's part in
    the low half, ``x1`` of block ``g`` in stream 3 in the high half."""
    _, high = threefry2x32(key, elements, counter_hi(step, 3))
    return bf16_noise_at(key, step, elements) | (high << 16)


def bernoulli_dyadic(y: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """One exact Bernoulli(y) draw per element of fp32 ``y`` in (0, 1), however many bits y's fraction has.

    ``y = M * 2^(E - 24)`` with a 24-bit integer ``M`` (frexp), ``E <= 0``. ``Bernoulli(M / 2^24)`` and
    ``Bernoulli(2^E)`` (``-E`` fair coin flips all coming up 0) are independent, and their AND has probability
    ``y`` exactly. ``-E <= 124`` for fp32 inputs, so four 31-bit words cover the flips. ``draws`` holds five uniform
    32-bit words per element (int64, shape ``(n, 5)``): the low 24 bits of the first, the low 31 of the others.
    """
    mantissa, exponent = torch.frexp(y)
    m = (mantissa * 16777216.0).to(torch.int64)  # exact: mantissa has 24 significant bits
    accept = (draws[:, 0] & 0xFFFFFF) < m
    flips = (-exponent).to(torch.int64)  # zero bits still required
    for j in range(1, 5):
        take = flips.clamp(max=31)
        word = draws[:, j] & 0x7FFFFFFF
        accept &= (word >> (31 - take)) == 0  # the top `take` bits of the word are all zero
        flips = flips - take
    return accept
