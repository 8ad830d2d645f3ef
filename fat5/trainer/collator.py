"""UL2DataCollator: token sequences in, FAT5 model batches out (padded or packed).

Padded batch (one example per row):
    ``input_ids`` (B, Lenc), ``attention_mask`` (B, Lenc) 1/0, ``decoder_input_ids`` (B, Ldec) = labels shifted
    right with decoder start token ``pad`` (0), ``decoder_attention_mask`` (B, Ldec), ``labels`` (B, Ldec) with
    -100 on padding.
Packed batch (several examples per row, no ``attention_mask``):
    ``input_ids`` (B, Lenc), ``segment_ids`` (B, Lenc) int32, 1..n for the n-th example of the row and 0 on
    padding; ``decoder_input_ids``, ``decoder_segment_ids`` (B, Ldec) the same way, decoder segment ``s`` holding
    the targets of encoder segment ``s``, shifted right per segment (each starts with the decoder start token);
    ``labels`` (B, Ldec) with -100 on padding. With ``return_layout`` (the default) also the layout that the model
    would otherwise derive on the device, reading it back to the host: ``cu_seqlens`` (S + 1,) int32, the offsets
    of the segments in the row-major tokens, each row cut into its examples then its padding tail (when the
    encoder's or the decoder's row has one), then empty segments up to a capacity S; ``segment_position_ids``
    (B, Lenc), each token's position in its segment; ``decoder_cu_seqlens`` and ``decoder_segment_position_ids`` the
    same for the decoder, segment for segment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .packing import PlannedExample, pack_rows, round_up
from .ul2 import CorruptedBatch, UL2Mixture, UL2Objective, UL2Plan, gather_slices, load_ul2_config

LABEL_PAD = -100


class UL2DataCollator:
    """Apply the UL2 mixture of denoisers to token sequences and collate the results into a model batch.

    Args:
        tokenizer: gives sentinels (``<extra_id_i>``), mode prefixes, EOS and pad ids (or pass ``objective``).
        objective: a ready :class:`~fat5.trainer.ul2.UL2Objective` (then ``mixture`` and the lengths come from it).
        mixture: the denoisers (a :class:`~fat5.trainer.ul2.UL2Mixture`, a config dict or a YAML path, whose
            ``placement`` and ``span_count_rounding`` are used unless given here); default: the FAT5 recipe.
        max_input_length: encoder tokens per example (padded) or per row (packed).
        max_target_length: decoder tokens per example; None: no limit when padded, ``max_input_length`` per row
            when packed.
        packed: emit packed rows with segment ids instead of one padded example per row.
        pad_to_multiple_of: round the emitted widths up to this multiple.
        pad_to_max_length: emit widths ``max_input_length`` / ``max_target_length`` whatever the batch holds.
        seed: seed of the collator's own generator, used for examples that come without a plan (mixed with the
            DataLoader worker id, so workers draw different examples).
        placement, span_count_rounding: see :mod:`fat5.trainer.ul2` (default ``"uniform"``, ``"stochastic"``).
        input_key: the key of the token sequence in each feature.
        return_tensors: ``"pt"`` (torch tensors) or ``"np"``.
        return_layout: packed batches also carry their layout (``cu_seqlens``, ``segment_position_ids`` and the
            decoder's), so that the model reads nothing back from the device to build it.

    Features are dicts with ``input_ids`` (a token sequence without special tokens; one trailing EOS is dropped)
    or bare sequences. Features made by :class:`~fat5.trainer.packing.PlannedDataset` carry their plan
    (``ul2_plan``): the collator then follows it, rows and random draws included, so batches are reproducible.
    """

    def __init__(
        self,
        tokenizer=None,
        *,
        objective: UL2Objective | None = None,
        mixture: UL2Mixture | Mapping | str | None = None,
        max_input_length: int = 512,
        max_target_length: int | None = None,
        packed: bool = False,
        pad_to_multiple_of: int | None = 8,
        pad_to_max_length: bool = False,
        seed: int = 0,
        placement: str | None = None,
        span_count_rounding: str | None = None,
        input_key: str = "input_ids",
        pad_token_id: int | None = None,
        return_tensors: str = "pt",
        return_layout: bool = True,
    ):
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}")
        if objective is None:
            if tokenizer is None:
                raise ValueError("UL2DataCollator needs a tokenizer or a UL2Objective")
            options = {}
            if isinstance(mixture, str):
                options = load_ul2_config(mixture)
                mixture = UL2Mixture.from_config(options)
            elif isinstance(mixture, Mapping):
                options = mixture
                mixture = UL2Mixture.from_config(mixture)
            placement = placement or options.get("placement", "uniform")
            span_count_rounding = span_count_rounding or options.get("span_count_rounding", "stochastic")
            if packed and max_target_length is None:
                max_target_length = max_input_length
            objective = UL2Objective.from_tokenizer(
                tokenizer,
                mixture,
                max_input_length=max_input_length,
                max_target_length=max_target_length,
                placement=placement,
                span_count_rounding=span_count_rounding,
            )
        if pad_token_id is None:
            pad_token_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        self.objective = objective
        self.packed = packed
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_to_max_length = pad_to_max_length
        self.pad_token_id = int(pad_token_id)
        self.decoder_start_token_id = self.pad_token_id
        self.seed = seed
        self.input_key = input_key
        self.return_tensors = return_tensors
        self.return_layout = return_layout
        self._rng: np.random.Generator | None = None
        self._rng_worker: int | None = None

    @property
    def max_input_length(self) -> int:
        return self.objective.max_input_length

    @property
    def max_target_length(self) -> int | None:
        return self.objective.max_target_length

    def _generator(self) -> np.random.Generator:
        """The collator's own generator, one stream per DataLoader worker."""
        try:
            from torch.utils.data import get_worker_info

            info = get_worker_info()
        except ImportError:
            info = None
        worker = -1 if info is None else info.id
        if self._rng is None or self._rng_worker != worker:
            self._rng = np.random.default_rng([self.seed, worker + 1])
            self._rng_worker = worker
        return self._rng

    def _sequence(self, feature) -> np.ndarray:
        tokens = feature[self.input_key] if isinstance(feature, Mapping) else feature
        if hasattr(tokens, "numpy"):
            tokens = tokens.numpy()
        return np.asarray(tokens, dtype=np.int64).reshape(-1)

    def __call__(self, features: Sequence) -> dict:
        """Collate a list of features (see the class doc) into a batch."""
        if len(features) == 0:
            raise ValueError("UL2DataCollator got an empty list of features")
        sequences = [self._sequence(f) for f in features]
        plans = [f.get("ul2_plan") if isinstance(f, Mapping) else None for f in features]
        if all(isinstance(p, PlannedExample) for p in plans):
            return self._collate_planned(sequences, plans)
        if any(p is not None for p in plans):
            raise ValueError("either every feature or none carries a 'ul2_plan'")
        eos = self.objective.eos_id
        sequences = [s[:-1] if len(s) and s[-1] == eos else s for s in sequences]
        rng = self._generator()
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        plan = self.objective.plan(lengths, rng)
        rows = None
        if self.packed:
            rows, _ = pack_rows(
                plan.input_length,
                plan.target_length,
                self.max_input_length,
                self.max_target_length or self.max_input_length,
            )
        return self.collate_plan(sequences, plan, rows, rng)

    def _collate_planned(self, sequences: list[np.ndarray], plans: list[PlannedExample]) -> dict:
        keys = {p.rng_key for p in plans}
        if len(keys) != 1:
            raise ValueError("the planned features of one batch must come from one batch of the sampler")
        plan = UL2Plan(
            source=np.arange(len(plans), dtype=np.int64),
            start=np.zeros(len(plans), dtype=np.int64),
            length=np.array([p.length for p in plans], dtype=np.int64),
            denoiser=np.array([p.denoiser for p in plans], dtype=np.int64),
            num_noise=np.array([p.num_noise for p in plans], dtype=np.int64),
            num_spans=np.array([p.num_spans for p in plans], dtype=np.int64),
        )
        for sequence, p in zip(sequences, plans):
            if len(sequence) != p.length:
                raise ValueError(f"a planned feature has {len(sequence)} tokens, its plan says {p.length}")
        plan.input_length = np.empty(len(plan), dtype=np.int64)
        plan.target_length = np.empty(len(plan), dtype=np.int64)
        for index in np.unique(plan.denoiser):
            chosen = plan.denoiser == index
            plan.input_length[chosen], plan.target_length[chosen] = self.objective.output_lengths(
                index, plan.length[chosen], plan.num_noise[chosen], plan.num_spans[chosen]
            )
        rows = np.array([p.row for p in plans], dtype=np.int64) if self.packed else None
        shapes = {(p.batch_rows, p.target_width) for p in plans}
        if len(shapes) != 1:
            raise ValueError("the planned features of one batch must share one batch shape")
        shape = next(iter(shapes))
        return self.collate_plan(sequences, plan, rows, np.random.default_rng(list(next(iter(keys)))),
                                 shape=shape if shape[0] else None)

    def collate_plan(
        self,
        sequences: Sequence[np.ndarray],
        plan: UL2Plan,
        rows: np.ndarray | None,
        rng: np.random.Generator,
        shape: tuple[int, int] | None = None,
    ) -> dict:
        """Realize ``plan`` on ``sequences`` (indexed by ``plan.source``) and lay it out: one example per row
        when padded, or in ``rows`` (row index of each example; examples of a row in plan order) when packed.

        ``shape``: ``(rows, decoder width)`` of a packed batch of fixed shape (the encoder's width is then
        ``max_input_length``, and the segment capacity a power of two per row, at least 4), padded with empty rows
        as needed; None lets the content set the widths."""
        corrupted = self.objective.realize(gather_slices(sequences, plan), plan, rng)
        if self.packed:
            if rows is None:
                raise ValueError("a packed collator needs the row of each example")
            return self._packed_batch(corrupted, np.asarray(rows, dtype=np.int64), shape)
        return self._padded_batch(corrupted)

    def _width(self, fill: int, limit: int | None) -> int:
        if self.pad_to_max_length and limit is not None:
            return max(limit, fill)
        width = round_up(max(fill, 1), self.pad_to_multiple_of)
        return min(width, limit) if limit is not None and fill <= limit else width

    def _layout(self, offsets: np.ndarray, rows: np.ndarray, num_rows: int, limit: int | None):
        """Row, column and segment number of every token when example ``i`` goes to row ``rows[i]``."""
        lengths = np.diff(offsets)
        order = np.lexsort((np.arange(len(rows)), rows))
        sorted_rows = rows[order]
        row_fill = np.bincount(rows, weights=lengths, minlength=num_rows).astype(np.int64)
        row_start = np.cumsum(row_fill) - row_fill
        # Column where each example starts: tokens of the examples placed before it in its row.
        before = np.cumsum(lengths[order]) - lengths[order] - row_start[sorted_rows]
        column_start = np.empty(len(rows), dtype=np.int64)
        column_start[order] = before
        first_of_row = np.searchsorted(sorted_rows, sorted_rows, side="left")
        segment = np.empty(len(rows), dtype=np.int64)
        segment[order] = np.arange(len(rows)) - first_of_row + 1
        token_row = np.repeat(rows, lengths)
        token_column = np.arange(offsets[-1]) - np.repeat(offsets[:-1] - column_start, lengths)
        width = self._width(int(row_fill.max(initial=0)), limit)
        return token_row, token_column, np.repeat(segment, lengths), column_start, width

    def _decoder_inputs(self, labels: np.ndarray, segment_starts: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Labels shifted right by one; every segment starts with the decoder start token."""
        decoder_input_ids = np.full(labels.shape, self.pad_token_id, dtype=np.int64)
        shifted = labels[:, :-1]
        decoder_input_ids[:, 1:] = np.where(shifted == LABEL_PAD, self.pad_token_id, shifted)
        decoder_input_ids[segment_starts] = self.decoder_start_token_id
        return decoder_input_ids

    def _packed_batch(self, corrupted: CorruptedBatch, rows: np.ndarray, shape: tuple[int, int] | None) -> dict:
        num_rows = int(rows.max(initial=-1)) + 1
        if shape is not None:
            if shape[0] < num_rows:
                raise ValueError(f"a batch planned for {shape[0]} rows fills {num_rows}")
            num_rows = shape[0]
        in_row, in_col, in_seg, in_start, in_width = self._layout(
            corrupted.input_offsets, rows, num_rows, self.max_input_length
        )
        tg_row, tg_col, tg_seg, tg_start, tg_width = self._layout(
            corrupted.target_offsets, rows, num_rows, self.max_target_length
        )
        if shape is not None:
            fills = (in_width, tg_width)
            in_width, tg_width = self.max_input_length, shape[1]
            if fills[0] > in_width or fills[1] > tg_width:
                raise ValueError(f"a batch planned for widths {(in_width, tg_width)} needs {fills}")
        input_ids = np.full((num_rows, in_width), self.pad_token_id, dtype=np.int64)
        segment_ids = np.zeros((num_rows, in_width), dtype=np.int32)
        input_ids[in_row, in_col] = corrupted.inputs
        segment_ids[in_row, in_col] = in_seg
        labels = np.full((num_rows, tg_width), LABEL_PAD, dtype=np.int64)
        decoder_segment_ids = np.zeros((num_rows, tg_width), dtype=np.int32)
        labels[tg_row, tg_col] = corrupted.targets
        decoder_segment_ids[tg_row, tg_col] = tg_seg
        batch = {
            "input_ids": input_ids,
            "segment_ids": segment_ids,
            "decoder_input_ids": self._decoder_inputs(labels, (rows, tg_start)),
            "decoder_segment_ids": decoder_segment_ids,
            "labels": labels,
        }
        if self.return_layout:
            batch.update(packed_layout(
                rows, np.diff(corrupted.input_offsets), np.diff(corrupted.target_offsets), num_rows,
                (in_width, tg_width), (in_start, tg_start), fixed_capacity=shape is not None,
            ))
        return self._to_tensors(batch)

    def _padded_batch(self, corrupted: CorruptedBatch) -> dict:
        n = len(corrupted)
        input_lengths = np.diff(corrupted.input_offsets)
        target_lengths = np.diff(corrupted.target_offsets)
        in_width = self._width(int(input_lengths.max(initial=0)), self.max_input_length)
        tg_width = self._width(int(target_lengths.max(initial=0)), self.max_target_length)
        attention_mask = (np.arange(in_width) < input_lengths[:, None]).astype(np.int64)
        decoder_attention_mask = (np.arange(tg_width) < target_lengths[:, None]).astype(np.int64)
        input_ids = np.full((n, in_width), self.pad_token_id, dtype=np.int64)
        input_ids[attention_mask.astype(bool)] = corrupted.inputs
        labels = np.full((n, tg_width), LABEL_PAD, dtype=np.int64)
        labels[decoder_attention_mask.astype(bool)] = corrupted.targets
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "decoder_input_ids": self._decoder_inputs(labels, (np.arange(n), np.zeros(n, dtype=np.int64))),
            "decoder_attention_mask": decoder_attention_mask,
            "labels": labels,
        }
        return self._to_tensors(batch)

    def _to_tensors(self, batch: dict) -> dict:
        if self.return_tensors == "np":
            return batch
        import torch

        return {key: torch.from_numpy(value) for key, value in batch.items()}


def packed_layout(
    rows: np.ndarray,
    input_lengths: np.ndarray,
    target_lengths: np.ndarray,
    num_rows: int,
    widths: tuple[int, int],
    column_starts: tuple[np.ndarray, np.ndarray],
    fixed_capacity: bool = False,
) -> dict:
    """The varlen layout of packed rows, encoder and decoder, as :class:`UL2DataCollator` describes it.

    Example ``i`` sits in row ``rows[i]`` at encoder column ``column_starts[0][i]`` (``input_lengths[i]`` tokens)
    and decoder column ``column_starts[1][i]``; rows are ``widths`` wide. Each row gives one segment per example, in
    column order, then one for its padding tail unless neither stack's row has one (the pair would be empty on both
    sides). With ``fixed_capacity`` the segments are padded with empty ones to ``num_rows`` times a power of two (at
    least 4), so that batches of one shape nearly always have one ``cu_seqlens`` length.
    """
    rows = np.asarray(rows, dtype=np.int64)
    lengths = (np.asarray(input_lengths, dtype=np.int64), np.asarray(target_lengths, dtype=np.int64))
    fills = [np.bincount(rows, weights=length, minlength=num_rows).astype(np.int64) for length in lengths]
    tails = [width - fill for width, fill in zip(widths, fills)]
    has_tail = (tails[0] > 0) | (tails[1] > 0)
    examples = np.lexsort((column_starts[0], rows))
    # the segments in token order: by row, a row's examples by column, then its tail
    segment_rows = np.concatenate([rows[examples], np.flatnonzero(has_tail)])
    is_tail = np.repeat([0, 1], [len(examples), int(has_tail.sum())])
    segment_order = np.lexsort((is_tail, segment_rows))
    num_segments = len(segment_order)
    capacity = num_segments
    if fixed_capacity:
        per_row = -(-num_segments // max(num_rows, 1))
        capacity = max(4, 1 << (per_row - 1).bit_length()) * num_rows
    layout = {}
    for stack, length, fill, tail, width, starts in zip(("", "decoder_"), lengths, fills, tails, widths, column_starts):
        segment_lengths = np.concatenate([length[examples], tail[has_tail]])[segment_order]
        cu_seqlens = np.full(capacity + 1, num_rows * width, dtype=np.int32)
        cu_seqlens[0] = 0
        cu_seqlens[1 : num_segments + 1] = np.cumsum(segment_lengths)
        # each token's position in its segment: counted from its row's tail, then, for example tokens, from the
        # example's first column
        positions = np.arange(width)[None, :] - fill[:, None]
        token_start = np.repeat(starts, length)
        token_column = token_start + np.arange(length.sum()) - np.repeat(np.cumsum(length) - length, length)
        positions[np.repeat(rows, length), token_column] = token_column - token_start
        layout[f"{stack}cu_seqlens"] = cu_seqlens
        layout[f"{stack}segment_position_ids"] = positions
    return layout
