"""Independent test-only reference for OSOL's advantage correction ("One Step, One Lead", Lin et al., arXiv 2609.06469).

Written from the specification of ``roundalign.rl.osol`` (never from the module, which this file does not import), in
plain Python loops over floats (float64) and lists; no torch in the arithmetic. Tensor inputs are handed over as
lists of the values they hold (float32 values are exact float64 values), and values the module returns as float32
tensors are rounded here to float32 with ``f32`` where later arithmetic reads them (the profile ``q`` feeds kappa).

- ``h(seed, k)``: the first 8 bytes, little endian, of sha256("roundalign.osol/focus/{seed}/{k}").
- ``focus_domain``: "cycle" f_k = (o + k - 1) % n with o = h(seed, 0) % n; "random" f_1 = h(seed, 1) % n and, for
  k >= 2, j = h(seed, k) % (n - 1), f_k = j if j < f_{k-1} else j + 1.
- ``rebound_profile``: candidates C = {u_i < 0}, n = |C|; n == 1 -> -p_hi; n >= 2 -> rank r (ascending u, ties the
  mean of the ranks they span), q = -(p_hi - (p_hi - p_lo) * r / (n - 1)); 0 off C.
- ``corrected_advantages``: E = mask & focus, row-major; q over E (drift / none / random = drift[perm]); kappa = tau *
  std_E(base) / std_E(q) (population std, float64; 0 when E is empty or either std is 0; 0 for "none");
  advantages clip(base + kappa q) on E, clip(base) on other valid tokens, 0 at padding.
"""

from __future__ import annotations

import hashlib
import math
import struct


def f32(x: float) -> float:
    """Round a float64 to the nearest float32 (ties to even), returned as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def h(seed: int, k: int) -> int:
    return int.from_bytes(hashlib.sha256(f"roundalign.osol/focus/{seed}/{k}".encode()).digest()[:8], "little")


def focus_sequence(n: int, seed: int, steps: int, schedule: str = "random") -> list[int]:
    """Focus domains of steps 1..steps."""
    out: list[int] = []
    if schedule == "cycle":
        o = h(seed, 0) % n
        for k in range(1, steps + 1):
            out.append((o + k - 1) % n)
        return out
    assert schedule == "random", schedule
    prev = -1
    for k in range(1, steps + 1):
        if k == 1:
            f = h(seed, 1) % n
        else:
            j = h(seed, k) % (n - 1)
            f = j if j < prev else j + 1
        out.append(f)
        prev = f
    return out


def focus_domain(n: int, seed: int, step: int, schedule: str = "random") -> int:
    return focus_sequence(n, seed, step, schedule)[step - 1]


def rebound_profile(u: list[float], p_lo: float = 0.1, p_hi: float = 1.0) -> list[float]:
    """The rebound profile in float64 (the exact formula, before any rounding to float32)."""
    cand = [i for i in range(len(u)) if u[i] < 0]
    n = len(cand)
    q = [0.0] * len(u)
    if n == 0:
        return q
    if n == 1:
        q[cand[0]] = -p_hi
        return q
    order = sorted(cand, key=lambda i: u[i])
    rank: dict[int, float] = {}
    pos = 0
    while pos < n:
        end = pos
        while end + 1 < n and u[order[end + 1]] == u[order[pos]]:
            end += 1
        mean_rank = (pos + end) / 2.0  # mean of the ranks pos..end
        for t in range(pos, end + 1):
            rank[order[t]] = mean_rank
        pos = end + 1
    for i in cand:
        q[i] = -(p_hi - (p_hi - p_lo) * rank[i] / (n - 1))
    return q


def pop_std(x: list[float]) -> float:
    """Population standard deviation (ddof = 0) in float64."""
    if not x:
        return 0.0
    m = math.fsum(x) / len(x)
    return math.sqrt(math.fsum((v - m) * (v - m) for v in x) / len(x))


def clip(x: float, c: float) -> float:
    return min(max(x, -c), c)


def corrected_advantages(
    base: list[list[float]],
    mask: list[list[bool]],
    focus: list[bool],
    u: list[list[float]],
    *,
    tau: float = 0.03,
    clip_at: float = 3.0,
    p_lo: float = 0.1,
    p_hi: float = 1.0,
    residual: str = "drift",
    perm: list[int] | None = None,
) -> dict:
    """Expected OsolResult fields; ``perm`` is the permutation of E used by residual "random" (q = drift[perm])."""
    rows, cols = len(base), len(base[0]) if base else 0
    e_idx = [(b, t) for b in range(rows) for t in range(cols) if mask[b][t] and focus[b]]
    u_e = [u[b][t] for b, t in e_idx]
    base_e = [base[b][t] for b, t in e_idx]
    drift = [f32(v) for v in rebound_profile(u_e, p_lo, p_hi)]  # the module's profile is float32
    if residual == "drift":
        q_e = drift
    elif residual == "none":
        q_e = [0.0] * len(e_idx)
    elif residual == "random":
        assert perm is not None and sorted(perm) == list(range(len(e_idx)))
        q_e = [drift[perm[i]] for i in range(len(e_idx))]
    else:
        raise AssertionError(residual)
    kappa = 0.0
    if residual != "none" and e_idx:
        sb, sq = pop_std(base_e), pop_std(q_e)
        if sb != 0.0 and sq != 0.0:
            kappa = tau * sb / sq
    adv = [[0.0] * cols for _ in range(rows)]
    q_full = [[0.0] * cols for _ in range(rows)]
    for b in range(rows):
        for t in range(cols):
            if mask[b][t]:
                adv[b][t] = clip(base[b][t], clip_at)
    for (b, t), qv in zip(e_idx, q_e, strict=True):
        q_full[b][t] = qv
        adv[b][t] = clip(base[b][t] + kappa * qv, clip_at)
    res_abs = math.fsum(abs(kappa * qv) for qv in q_e)
    den = math.fsum(abs(v) for v in base_e) + res_abs
    return {
        "advantages": adv,
        "q": q_full,
        "kappa": kappa,
        "candidates": sum(1 for v in u_e if v < 0),
        "focus_tokens": len(e_idx),
        "residual_share": res_abs / den if den != 0.0 else 0.0,
    }


def base_advantages(grpo: list[float], domains: list[int], focus: int, w_focus: float, w_other: float) -> list[float]:
    return [g * (w_focus if d == focus else w_other) for g, d in zip(grpo, domains, strict=True)]


def footprint_vs_mismatch(u: list[float], d: list[float], p_lo: float = 0.1, p_hi: float = 1.0) -> dict:
    """``u - d`` is taken in float32, as the module subtracts two float32 tensors."""
    cand = [i for i in range(len(u)) if u[i] < 0]
    below = sum(1 for i in cand if abs(u[i]) <= abs(d[i])) / len(cand) if cand else 0.0
    shifted = [f32(a - b) for a, b in zip(u, d, strict=True)]
    qa, qb = rebound_profile(u, p_lo, p_hi), rebound_profile(shifted, p_lo, p_hi)
    changed = sum(1 for a, b in zip(qa, qb, strict=True) if a != b)
    return {"below_mismatch": below, "rank_change": changed / len(u) if u else 0.0}


def backtracking(u: list[float], v: list[float]) -> dict:
    uu = math.fsum(a * a for a in u)
    uv = math.fsum(a * b for a, b in zip(u, v, strict=True))
    return {
        "ratio": None if uu == 0.0 else -uv / uu,
        "token_frac": sum(1 for a, b in zip(u, v, strict=True) if a * b < 0) / len(u) if u else 0.0,
    }
