"""Which rows of a trainer's batch are which sequence: what the engine's kernels need to see each one alone.

An engine computes each sequence unpadded, at positions 0, 1, ..., with its tokens back to back (vLLM's flattened
batch). A trainer hands its model a padded ``(batch, tokens)`` batch (left- or right-padded, or several sequences
packed into one row) and says which is which through the attention mask and ``position_ids``. ``sequences`` reads
that back: every sequence's batch row, first column and length, from the mask HF built for the forward (4-D bool
or additive, 2-D, or None for an unpadded batch), and checks that each one is plain causal attention from position
0, so that the engine's kernel, called on the packed rows, computes what the engine computed for that sequence.

Anything else (a sliding window, a custom mask, positions that do not start at 0, e.g. a left-padded batch without
``position_ids``) raises an error that names the fix, rather than computing something the engine never did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roundalign.errors import UserError

POSITIONS_FIX = (
    "pass position_ids that restart at 0 for every sequence, e.g. position_ids = (attention_mask.cumsum(-1) - 1)"
    ".clamp(min=0), as verl and the roundalign integrations do"
)


@dataclass(frozen=True)
class Sequences:
    """Sequence ``j`` is columns ``starts[j] : starts[j] + lengths[j]`` of batch row ``rows[j]``."""

    rows: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    width: int  # the batch's tokens per row

    def flat_index(self) -> torch.Tensor:
        """Indices into the ``(batch * width)`` flattened rows: every sequence's tokens, back to back."""
        return torch.cat(
            [
                torch.arange(n, dtype=torch.long) + (b * self.width + s)
                for b, s, n in zip(self.rows, self.starts, self.lengths, strict=True)
            ]
        )

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, width, ...)`` -> the sequences' rows back to back, ``(tokens, ...)``, contiguous."""
        flat = x.reshape(-1, *x.shape[2:])
        if len(self.lengths) == x.shape[0] and all(n == self.width for n in self.lengths):
            return flat.contiguous()  # an unpadded batch: nothing to gather
        return flat[self.flat_index()]

    def unpack(self, packed: torch.Tensor, batch: int) -> torch.Tensor:
        """The inverse of ``pack``: zeros where no sequence is (padding)."""
        out = packed.new_zeros(batch * self.width, *packed.shape[1:])
        out[self.flat_index()] = packed
        return out.view(batch, self.width, *packed.shape[1:])


def _from_2d(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """A ``(batch, tokens)`` padding mask: one sequence per row, its tokens contiguous."""
    out = []
    for b, row in enumerate(mask.bool().tolist()):
        cols = [i for i, on in enumerate(row) if on]
        if not cols:
            continue
        if cols[-1] - cols[0] + 1 != len(cols):
            raise UserError(
                f"batch row {b}'s attention mask has padding between its tokens; the engine kernels need each "
                "row's tokens contiguous (left or right padding)"
            )
        out.append((b, cols[0], len(cols)))
    return out


def _from_4d(allowed: torch.Tensor) -> list[tuple[int, int, int]]:
    """``allowed[b, i, j]``: query ``i`` of row ``b`` attends key ``j``. Every row that attends itself and nothing
    after itself is a token; its keys must be exactly ``start .. i``, and the tokens with one start one sequence."""
    batch, n, _ = allowed.shape
    idx = torch.arange(n)
    causal = idx[None, :] <= idx[:, None]
    # A padding row attends nothing, or (the NaN guard some HF versions add) every key, the future included.
    real = allowed[:, idx, idx] & ~(allowed & ~causal).any(-1)
    start = allowed.int().argmax(-1)  # the first key each row attends
    expected = (idx[None, None, :] >= start[..., None]) & causal
    bad = real & (allowed != expected).any(-1)
    out = []
    for b in range(batch):
        cols, starts = real[b].nonzero()[:, 0].tolist(), start[b].tolist()
        previous = None
        for c in cols:
            if starts[c] == c:  # a sequence's first token attends itself only
                out.append([b, c, 1])
            elif previous == c - 1 and out and out[-1][0] == b and starts[c] == out[-1][1]:
                out[-1][2] += 1  # the next token of the same sequence
            else:
                bad[b, c] = True
            previous = c
    if bad.any():
        b, i = (int(t) for t in bad.nonzero()[0])
        raise UserError(
            f"the attention mask of batch row {b}, token {i} is not causal attention over one contiguous sequence "
            "(a sliding window or a custom mask?); the engine kernels compute plain causal attention only: use "
            "attention='hf' for this model"
        )
    return [tuple(x) for x in out]


def sequences(attention_mask, position_ids, batch: int, width: int) -> Sequences:
    """The sequences of a ``(batch, width)`` forward, from HF's attention mask and ``position_ids``."""
    if attention_mask is None:
        found = [(b, 0, width) for b in range(batch)]
    elif attention_mask.dim() == 2:
        found = _from_2d(attention_mask)
    elif attention_mask.dim() == 4:
        m = attention_mask[:, 0]
        if m.shape[-2] != width or m.shape[-1] != width:
            raise UserError(
                f"the attention mask covers {m.shape[-2]} queries x {m.shape[-1]} keys for {width} tokens: the "
                "engine kernels compute whole sequences (training and scoring), not steps over a KV cache"
            )
        allowed = m if m.dtype == torch.bool else m == 0  # additive masks: 0 where attended
        found = _from_4d(allowed.expand(batch, width, width).cpu())
    else:
        raise UserError(f"cannot read sequences from a {attention_mask.dim()}-D attention mask")
    if not found:
        raise UserError("the batch holds no tokens (every attention mask entry is 0)")
    rows, starts, lengths = (tuple(x) for x in zip(*found, strict=True))
    seqs = Sequences(rows, starts, lengths, width)
    _check_positions(seqs, position_ids)
    return seqs


def _check_positions(seqs: Sequences, position_ids) -> None:
    if position_ids is None:  # HF's default: 0 .. width - 1 in every row
        late = [(b, s) for b, s in zip(seqs.rows, seqs.starts, strict=True) if s != 0]
        if late:
            b, s = late[0]
            raise UserError(
                f"batch row {b}'s sequence starts at column {s} but no position_ids were passed, so its positions "
                f"start at {s}, not 0 as in the engine; {POSITIONS_FIX}"
            )
        return
    pos = position_ids.cpu()
    for b, s, n in zip(seqs.rows, seqs.starts, seqs.lengths, strict=True):
        got = pos[b if pos.shape[0] > 1 else 0, s : s + n]
        if not torch.equal(got, torch.arange(n, dtype=got.dtype)):
            raise UserError(
                f"batch row {b}'s sequence (columns {s}..{s + n - 1}) has positions {got[:4].tolist()}... where the "
                f"engine uses 0, 1, 2, ...; {POSITIONS_FIX}"
            )
