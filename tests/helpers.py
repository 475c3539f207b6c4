"""Generic test helpers: bit-exact comparison with a readable failure report, and bf16 value generators.

Nothing here knows about roundalign; the references live in ``tests/formulas.py``.
"""

from __future__ import annotations

import torch

_INT_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor, as a same-width signed integer tensor (NaN payloads untouched)."""
    return t.contiguous().view(_INT_VIEW[t.dtype])


def canonical_bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns with every NaN (any sign or payload) replaced by one canonical NaN; -0.0 stays distinct."""
    canon = torch.full_like(t, float("nan"))
    return bits(torch.where(torch.isnan(t), canon, t))


def ordered(t: torch.Tensor) -> torch.Tensor:
    """Map floats to int64 so that adjacent representable values differ by 1 (for ULP distances).

    Sign-magnitude bit patterns become a monotone integer line: +0 and -0 both map to 0.
    """
    width = torch.finfo(t.dtype).bits
    b = bits(t).to(torch.int64)
    if width < 64:
        b = b & ((1 << width) - 1)  # reinterpret as unsigned
    sign = (b >> (width - 1)) & 1 if width < 64 else (b < 0).to(torch.int64)
    mag = b & ((1 << (width - 1)) - 1)
    return torch.where(sign.bool(), -mag, mag)


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|ordered(a) - ordered(b)|: how many representable values apart (meaningless where either is NaN)."""
    return (ordered(a) - ordered(b)).abs()


def mismatch_report(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor, limit: int = 8) -> str:
    idx = mask.nonzero()
    lines = [f"{idx.shape[0]} of {mask.numel()} element(s) differ; first {min(limit, idx.shape[0])}:"]
    a_flat, e_flat = actual.reshape(-1), expected.reshape(-1)
    flat = mask.reshape(-1).nonzero().flatten()[:limit]
    ulps = ulp_diff(actual, expected).reshape(-1)
    ab, eb = bits(actual).reshape(-1), bits(expected).reshape(-1)
    width = torch.finfo(actual.dtype).bits // 4
    for pos, i in zip(idx[:limit].tolist(), flat.tolist(), strict=True):
        a, e = a_flat[i].item(), e_flat[i].item()
        ha = f"{int(ab[i]) & ((1 << (4 * width)) - 1):0{width}x}"
        he = f"{int(eb[i]) & ((1 << (4 * width)) - 1):0{width}x}"
        lines.append(f"  at {tuple(pos)}: actual {a!r} (0x{ha}) expected {e!r} (0x{he}) ulp diff {int(ulps[i])}")
    return "\n".join(lines)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Assert two float tensors are identical bit for bit.

    dtype and shape must match; NaN positions must match (payloads are not compared); everywhere else the bit
    patterns must be equal, so +0.0 vs -0.0 is a mismatch. The failure message gives the number of mismatches,
    the first few indices with both values, their bit patterns and the ULP distance.
    """
    prefix = f"{what}: " if what else ""
    assert actual.dtype == expected.dtype, f"{prefix}dtype {actual.dtype} != expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{prefix}shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    if not torch.equal(nan_a, nan_e):
        raise AssertionError(prefix + "NaN positions differ\n" + mismatch_report(actual, expected, nan_a != nan_e))
    differ = canonical_bits(actual) != canonical_bits(expected)
    if differ.any():
        raise AssertionError(prefix + "not bitwise equal\n" + mismatch_report(actual, expected, differ))


def assert_not_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """The converse, for tests that show a comparison is sensitive (two rules must differ somewhere)."""
    same = (
        actual.dtype == expected.dtype
        and actual.shape == expected.shape
        and torch.equal(canonical_bits(actual.detach().cpu()), canonical_bits(expected.detach().cpu()))
    )
    assert not same, f"{what}: expected a difference somewhere, got identical tensors"


# ---------------------------------------------------------------------------------------------- value generators


def bf16_from_bits(b: torch.Tensor) -> torch.Tensor:
    """bf16 tensor with the given 16-bit patterns (int tensor; only the low 16 bits are used)."""
    b = b.to(torch.int32) & 0xFFFF
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def all_bf16() -> torch.Tensor:
    """Every one of the 65536 bf16 bit patterns, in bit order."""
    return bf16_from_bits(torch.arange(0x10000, dtype=torch.int32))


def tie_prone_bf16(shape, gen: torch.Generator, exp_range=(-3, 3)) -> torch.Tensor:
    """bf16 values with short significands (few set bits), so that their products and sums often land exactly
    halfway between two bf16 neighbours once computed in fp32."""
    mantissas = torch.tensor([0, 1, 2, 3, 64, 65, 96, 97, 127, 32, 33, 16, 17], dtype=torch.int32)
    n = int(torch.Size(shape).numel())
    m = mantissas[torch.randint(len(mantissas), (n,), generator=gen)]
    e = torch.randint(exp_range[0], exp_range[1] + 1, (n,), generator=gen, dtype=torch.int32) + 127
    s = torch.randint(2, (n,), generator=gen, dtype=torch.int32)
    return bf16_from_bits((s << 15) | (e << 7) | m).reshape(shape)


def special_bf16() -> torch.Tensor:
    """Edge values: signed zeros, smallest/largest subnormals, smallest normal, max finite, +-inf, NaN, ~1e38."""
    patterns = [
        0x0000,
        0x8000,  # +0, -0
        0x0001,
        0x8001,
        0x007F,
        0x807F,  # subnormals
        0x0080,
        0x8080,  # smallest normals
        0x7F7F,
        0xFF7F,  # max finite (3.39e38)
        0x7E96,
        0xFE96,  # ~1e38
        0x7F80,
        0xFF80,  # +-inf
        0x7FC0,
        0xFFC1,  # NaNs
        0x3F80,
        0xBF80,
        0x3FC0,
        0x3C01,  # 1, -1, 1.5, a small odd value
    ]
    return bf16_from_bits(torch.tensor(patterns, dtype=torch.int32))


def sprinkle(x: torch.Tensor, gen: torch.Generator, fraction: float = 0.05) -> torch.Tensor:
    """Copy of ``x`` with a random ``fraction`` of its elements replaced by ``special_bf16()`` values."""
    specials = special_bf16().to(x.dtype)
    flat = x.clone().reshape(-1)
    n = max(1, int(flat.numel() * fraction))
    where = torch.randperm(flat.numel(), generator=gen)[:n]
    flat[where] = specials[torch.randint(len(specials), (n,), generator=gen)]
    return flat.reshape(x.shape)


def count_fp32_ties(t32: torch.Tensor) -> int:
    """How many fp32 values lie exactly halfway between two bf16 neighbours (low 16 bits == 0x8000, finite)."""
    low = bits(t32.float()) & 0xFFFF
    return int(((low == 0x8000) & torch.isfinite(t32)).sum())


def rounding_profiles() -> list[str]:
    """The built-in profiles that run HF's kernels: every profile but the ``-kernels`` ones, which need vLLM's ops
    (tested against the real engine in tests/test_real_vllm_kernels.py)."""
    import roundalign

    return [p for p in roundalign.list_profiles() if not roundalign.get_profile(p).uses_engine_kernels]


def spread_rows(n: int, seed: int, rows: int = 6, dtype=torch.float32) -> torch.Tensor:
    """Rows for checking a summation order: exponents spread over 2^-6..2^6 within a row (sums of values of one scale
    are often exact in fp32 whatever the order, and would hide an order's error), scales from 1e-2 to 1e2 across rows,
    and special values in the last row only (n > 4), so that the others stay finite and compare as sums."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-6, 7, (rows, n), generator=g).float())
    x = (torch.randn(rows, n, generator=g) * spread * torch.logspace(-2, 2, rows).unsqueeze(1)).to(dtype)
    if n > 4:
        x[-1] = sprinkle(x[-1:], g, 0.05)[0]
    return x
