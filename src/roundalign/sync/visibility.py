"""Update visibility: how much of the trainer's fp32 master updates reach the served low-precision copy.

``UpdateTracker.update(master, served)`` is called once per weight sync with the master state_dict and the copy the
engine received, and returns (all tensors together; every key always present, ``None`` where undefined):

- ``sync/visible_fraction``: the fraction of served elements whose bits changed since the previous call, the
  PULSE / HF delta-sync measurement.
- ``sync/update_transfer``: ``<s_t - s_{t-1}, m_t - m_{t-1}> / ||m_t - m_{t-1}||^2``, the share of this step's
  master update that reached the served copy: about 0 when RNE absorbs the updates, 1 in expectation under SR or
  error feedback. ``None`` at the first call and when the master did not change.
- ``sync/relative_drift``: ``||s_t - m_t|| / ||m_t||``; ``None`` when the master is all zeros.
- ``sync/lag_steps``: the ``k`` for which the served copy is closest to ``m_{t-k}`` (L2, over a fixed seeded sample
  of element positions; ties go to the smallest ``k``), among the last ``lag_window`` masters.
- ``sync/lag_saturated``: 1.0 when that ``k`` is the oldest master kept and the window is full (the true lag may be
  larger), else 0.0.

Sums run in float64 over float64 copies of the fp32 / bf16 values, so the differences are exact (see below for
the one exception, fp32 values 2^29 apart). Memory: the
tracker keeps the previous call's master (fp32) and served copy, plus a ``lag_window x sample_size`` fp32 ring of
sampled masters (64 MiB at the defaults). docs/sync.md explains each definition and what to expect under each mode.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

KEYS = (
    "sync/visible_fraction", "sync/update_transfer", "sync/relative_drift", "sync/lag_steps", "sync/lag_saturated",
)  # fmt: skip
_CHUNK = 1 << 22  # elements per float64 pass: bounds the temporaries (32 MiB each) whatever the tensor size
_STATE_FORMAT = 1
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bitwise comparison by item size


def _chunks(*tensors: torch.Tensor):
    """Matching flat chunks of same-shape tensors."""
    flats = [t.reshape(-1) for t in tensors]
    for start in range(0, flats[0].numel(), _CHUNK):
        yield [f[start : start + _CHUNK] for f in flats]


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class UpdateTracker:
    """Update visibility between an fp32 master and its served low-precision copy, step by step."""

    def __init__(self, lag_window: int = 256, sample_size: int = 65536, seed: int = 0) -> None:
        self.lag_window = _check_positive_int(lag_window, "lag_window")
        self.sample_size = _check_positive_int(sample_size, "sample_size")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.seed = seed
        self.calls = 0
        self._shapes: dict[str, tuple[int, ...]] | None = None  # sorted by name; fixed by the first call
        self._positions: dict[str, torch.Tensor] = {}  # name -> flat indices sampled in that tensor (int64, sorted)
        self._ring: torch.Tensor | None = None  # (lag_window, k) fp32 sampled masters; row (calls - 1) % W is newest
        self._prev_master: dict[str, torch.Tensor] = {}
        self._prev_served: dict[str, torch.Tensor] = {}

    # -- input checks and the sample ------------------------------------------------------------------------------

    def _check(self, master: Mapping[str, torch.Tensor], served: Mapping[str, torch.Tensor]) -> None:
        for what, d in (("master", master), ("served", served)):
            if not isinstance(d, Mapping):
                raise TypeError(f"{what} must be a dict of name -> tensor, got {type(d).__name__}")
        if set(master) != set(served):
            diff = sorted(set(master) ^ set(served))
            raise ValueError(f"master and served must hold the same tensor names; they differ in {diff[:5]}")
        for name, m in master.items():
            s = served[name]
            if not isinstance(m, torch.Tensor) or not isinstance(s, torch.Tensor):
                raise TypeError(f"master[{name!r}] and served[{name!r}] must be tensors")
            if m.dtype != torch.float32:
                raise TypeError(f"master[{name!r}] is {m.dtype}; pass the fp32 master (the trainer's float32 weights)")
            if not s.is_floating_point():
                raise TypeError(f"served[{name!r}] is {s.dtype}; pass the served floating-point copy")
            if s.shape != m.shape:
                raise ValueError(f"served[{name!r}] has shape {tuple(s.shape)} but master has {tuple(m.shape)}")
        if self._shapes is not None and {n: tuple(t.shape) for n, t in master.items()} != self._shapes:
            raise ValueError(
                "UpdateTracker.update got different tensor names or shapes than its first call; visibility compares "
                "each step with the previous one, so track one model with one tracker (make a new UpdateTracker)"
            )
        if self._prev_served and any(served[n].dtype != p.dtype for n, p in self._prev_served.items()):
            raise ValueError("served dtypes changed since the previous call; bitwise visibility needs one served dtype")

    def _sample(self) -> None:
        """Fix the sampled positions once: ``k`` distinct flat indices over all tensors (sorted names), seeded."""
        sizes = [torch.Size(s).numel() for s in self._shapes.values()]
        total = sum(sizes)
        k = min(self.sample_size, total)
        g = torch.Generator().manual_seed(self.seed)
        if total <= 4 * k:
            picked = torch.randperm(total, generator=g)[:k]
        else:  # without a randperm of the whole model (4 GB of indices at 0.5B parameters): draw, dedupe, repeat
            picked = torch.empty(0, dtype=torch.int64)
            while picked.numel() < k:
                draw = torch.randint(0, total, (2 * k,), generator=g)
                picked = torch.cat([picked, draw])
                _, first = _unique_first(picked)
                picked = picked[first]
            picked = picked[:k]
        picked, _ = picked.sort()
        start = 0
        for (name, _), size in zip(self._shapes.items(), sizes, strict=True):
            inside = picked[(picked >= start) & (picked < start + size)]
            self._positions[name] = inside - start
            start += size
        self._ring = torch.zeros(self.lag_window, k, dtype=torch.float32)

    def _sampled(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The sampled elements as one float64 vector (sorted names, then position)."""
        parts = [tensors[n].detach().reshape(-1)[self._positions[n].to(tensors[n].device)] for n in self._shapes]
        return torch.cat([p.double().cpu() for p in parts])

    # -- the step -------------------------------------------------------------------------------------------------

    def update(self, master: Mapping[str, torch.Tensor], served: Mapping[str, torch.Tensor]) -> dict[str, float | None]:
        """Record one sync (``master`` fp32, ``served`` its exported copy, same names) and return the metrics."""
        self._check(master, served)
        if self._shapes is None:
            self._shapes = {n: tuple(master[n].shape) for n in sorted(master)}
            self._sample()
        first = self.calls == 0
        changed = total = 0
        dot = step_sq = drift_sq = master_sq = 0.0
        # Two float64 scratch rows reused for every chunk: the passes below allocate nothing model-sized.
        width = min(_CHUNK, max(torch.Size(shape).numel() for shape in self._shapes.values()))
        scratch: dict[torch.device, torch.Tensor] = {}
        for name in self._shapes:
            m, s = master[name].detach(), served[name].detach()
            total += m.numel()
            if m.device not in scratch:
                scratch[m.device] = torch.empty(2, width, dtype=torch.float64, device=m.device)
            prev = () if first else (self._prev_master[name], self._prev_served[name])
            view = _INT_VIEW[s.element_size()]
            for mc, sc, *pc in _chunks(m, s, *prev):
                a, b = scratch[m.device][0, : mc.numel()], scratch[m.device][1, : mc.numel()]
                a.copy_(mc)  # m in float64
                master_sq += float(torch.dot(a, a))
                b.copy_(sc).sub_(a)  # s - m, exact (s is within a few ulps of m for any export of it)
                drift_sq += float(torch.dot(b, b))
                if pc:
                    pmc, psc = pc
                    changed += int(torch.count_nonzero(sc.view(view) != psc.view(view)))
                    # Differences of fp32 values in float64: exact unless they are more than 2^29 apart in
                    # magnitude (then rounded at 2^-53 relative, far below what these ratios resolve).
                    a.sub_(pmc)  # m_t - m_{t-1}
                    b.copy_(sc).sub_(psc)  # s_t - s_{t-1}, exact
                    dot += float(torch.dot(b, a))
                    step_sq += float(torch.dot(a, a))
        lag, saturated = self._lag(master, served)
        # Into the previous call's buffers when there are some: no 1.5x-model-size allocation churn per call.
        for prev, current in ((self._prev_master, master), (self._prev_served, served)):
            for n in self._shapes:
                if n in prev:
                    prev[n].copy_(current[n].detach())
                else:
                    prev[n] = current[n].detach().clone()
        self.calls += 1
        return {
            "sync/visible_fraction": None if first else changed / total,
            "sync/update_transfer": None if first or step_sq == 0.0 else dot / step_sq,
            "sync/relative_drift": None if master_sq == 0.0 else (drift_sq / master_sq) ** 0.5,
            "sync/lag_steps": lag,
            "sync/lag_saturated": saturated,
        }

    def _lag(self, master, served) -> tuple[float, float]:
        window = self.lag_window
        newest = self.calls % window
        self._ring[newest] = self._sampled(master).float()  # exact: the values are fp32
        available = min(self.calls + 1, window)
        s = self._sampled(served)
        # Squared L2 per ring row (same argmin as L2), on the filled rows in place: no gather of the whole window.
        per_row = (self._ring[:available].double() - s).square_().sum(dim=1)
        # Reorder to k = 0 .. available-1 (m_{t-k} sits in row newest - k), so that argmin's first-index rule
        # breaks ties towards the smallest k.
        rows = (newest - torch.arange(available)) % window
        k = int(torch.argmin(per_row[rows]))
        saturated = 1.0 if k == available - 1 and available == window else 0.0
        return float(k), saturated

    # -- checkpointing --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to continue bitwise: settings, sample, ring buffer, previous master and served (copies)."""
        return {
            "format": _STATE_FORMAT, "lag_window": self.lag_window, "sample_size": self.sample_size,
            "seed": self.seed, "calls": self.calls,
            "shapes": None if self._shapes is None else {n: list(s) for n, s in self._shapes.items()},
            "positions": {n: p.clone() for n, p in self._positions.items()},
            "ring": None if self._ring is None else self._ring.clone(),
            "prev_master": {n: t.clone() for n, t in self._prev_master.items()},
            "prev_served": {n: t.clone() for n, t in self._prev_served.items()},
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s output; lag_window, sample_size and seed must be this tracker's."""
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise ValueError("not an UpdateTracker.state_dict() of this roundalign version (no known 'format')")
        mine = {"lag_window": self.lag_window, "sample_size": self.sample_size, "seed": self.seed}
        differ = [f"{k}={state.get(k)!r} (this tracker: {v!r})" for k, v in mine.items() if state.get(k) != v]
        if differ:
            raise ValueError(f"state_dict is from a differently configured UpdateTracker: {', '.join(differ)}")
        shapes = state["shapes"]
        self._shapes = None if shapes is None else {n: tuple(s) for n, s in shapes.items()}
        self._positions = {n: p.clone() for n, p in state["positions"].items()}
        self._ring = None if state["ring"] is None else state["ring"].clone()
        self._prev_master = {n: t.clone() for n, t in state["prev_master"].items()}
        self._prev_served = {n: t.clone() for n, t in state["prev_served"].items()}
        self.calls = int(state["calls"])


def _unique_first(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique values, index of each value's first occurrence in x), keeping x's draw order stable."""
    values, inverse = torch.unique(x, return_inverse=True)
    first = torch.full((values.numel(),), x.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(x.numel()), reduce="amin")
    return values, first.sort().values
