"""Sequence packing: a minibatch's rows cut into micro-batches by a token budget instead of a row
count, and each micro-batch run as one row of concatenated sequences (``trainer.packing``).

A padded micro-batch of ``micro_batch_size`` rows costs ``rows x longest`` tokens of compute; at RL's
long-tailed completion lengths (DAPO: most answers short, a few up to the limit) most of that is
padding. Packed, a micro-batch holds whole sequences whose real tokens sum to at most the budget,
chosen first-fit-decreasing, and runs as one row: positions restart at 0 for each sequence, and
attention stays inside each sequence by the sequences' bounds, no [L, L] mask (``varlen.py``, both
backends, sliding windows and megatron's context parallel included; the dense ``attention_mask`` is the
definition the tests check them against), and Mamba layers convolve and scan each sequence from zeros
(``ssd.py``). Which rows share a micro-batch changes no number: the step weighs each micro-batch by
its share of the loss units.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices of each micro-batch: first-fit-decreasing into bins of at most ``budget`` tokens
    (a row longer than the budget gets a bin of its own). Rows keep their order inside a bin; bins
    come longest-first, as the decreasing pass opens them."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        n = lengths[row]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(row)
                room[b] -= n
                break
        else:
            bins.append([row])
            room.append(budget - n)
    return [sorted(b) for b in bins]


@dataclass(frozen=True)
class Packed:
    """One micro-batch's rows as a single row: ``ids`` and ``positions`` [1, L], ``targets`` [1, L]
    (each position's next token in its own sequence; the last of each sequence predicts nothing and
    gets 0), and where each row's tokens start."""

    ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    starts: list[int]
    lengths: list[int]

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
        """From right-padded rows (``build_batch``'s): each row's real tokens, one after another."""
        lengths = [int(n) for n in attention_mask.sum(dim=1).tolist()]
        seqs = [row[:n] for row, n in zip(input_ids, lengths, strict=True)]
        ids = torch.cat(seqs)[None]
        positions = torch.cat([torch.arange(n, device=ids.device) for n in lengths])[None]
        targets = torch.cat([torch.nn.functional.pad(s[1:], (0, 1)) for s in seqs])[None]
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        return cls(ids, positions, targets, starts, lengths)

    def gather(self, values: torch.Tensor, fill: int = -1) -> torch.Tensor:
        """Per-position values of the right-padded rows ([rows, T, ...]: ``TrainBatch.routes``) laid out
        as the packed row's tokens [1, L, ...]; a padded row's tail gets ``fill``."""
        parts = [row[:n] for row, n in zip(values, self.lengths, strict=True)]
        grow = self.ids.shape[1] - sum(self.lengths)
        if grow:
            parts.append(values.new_full((grow, *values.shape[2:]), fill))
        return torch.cat(parts)[None]

    def loss_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The rows' loss mask ``mask`` [rows, T-1] (at target ``input_ids[:, 1:]``) for the packed row:
        [1, L-1] at target ``ids[:, 1:]``; 0 where that target opens the next sequence (a sequence's
        last position predicts nothing) and over the padding (the MTP loss's mask: trainer/mtp.py)."""
        parts = [
            torch.nn.functional.pad(row[: n - 1], (0, 1)) for row, n in zip(mask, self.lengths, strict=True)
        ]
        grow = self.ids.shape[1] - sum(self.lengths)
        return torch.cat([*parts, mask.new_zeros(grow)])[None, :-1]

    def padded(self, width: int) -> Packed:
        """The row padded to ``width`` tokens (a pipeline schedule passes one shape): the padding is a
        sequence of its own, whose targets count nowhere."""
        grow = width - self.ids.shape[1]
        if grow < 0:
            raise ValueError(f"a packed row of {self.ids.shape[1]} tokens does not fit {width}")
        if grow == 0:
            return self
        pad = torch.nn.functional.pad
        positions = torch.cat([self.positions, torch.arange(grow, device=self.ids.device)[None]], dim=1)
        return Packed(
            pad(self.ids, (0, grow)), positions, pad(self.targets, (0, grow)), self.starts, self.lengths
        )

    def attention_mask(self) -> torch.Tensor:
        """[1, 1, L, L], True where a query may NOT read a key (Megatron's convention): a key of another
        sequence, or a later one. The padding tail is one more sequence. No training path builds it (the
        attention reads the bounds): the reference the tests hold the attention to, and count."""
        starts = (self.positions[0] == 0).long()
        doc = starts.cumsum(0)
        n = doc.shape[0]
        later = torch.ones(n, n, dtype=torch.bool, device=doc.device).triu(1)
        return (later | (doc[:, None] != doc[None, :]))[None, None]

    def index_of(self, mask: torch.Tensor) -> torch.Tensor:
        """Packed positions of the targets ``mask`` ([rows, T-1], the rows' loss mask) marks, in order;
        position 0 where it marks none (a filler micro-batch: ``TrainStep.even``), so the head still runs."""
        where = [
            start + torch.nonzero(row[: n - 1]).flatten()
            for row, start, n in zip(mask, self.starts, self.lengths, strict=True)
        ]
        found = torch.cat(where)
        return (found if found.numel() else torch.zeros(1, dtype=torch.long)).to(self.ids.device)

    def unpack_kept(self, values: torch.Tensor, keep: torch.Tensor, width: int) -> torch.Tensor:
        """``values`` [1, K] computed at the packed positions ``keep`` (``index_of``) back to the
        rows [rows, width], zeros elsewhere."""
        at = torch.zeros_like(self.targets, dtype=values.dtype).index_copy(1, keep, values)
        return self.unpack(at, width)

    def unpack(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """[1, L] per-position values back to right-padded rows [rows, width] (zeros past each row's
        last target), as the unpacked forward returns them."""
        rows = []
        for start, n in zip(self.starts, self.lengths, strict=True):
            row = values[0, start : start + n - 1]  # targets 0 .. n-2: the last token predicts nothing
            rows.append(torch.nn.functional.pad(row, (0, width - row.shape[0])))
        return torch.stack(rows)
