"""Packing several UL2 examples per row, and length-aware batching to a token budget.

A packed row holds examples back to back in the encoder (``segment_ids`` 1..n) and their targets back to back in
the decoder (``decoder_segment_ids``, segment ``s`` of the decoder belongs to segment ``s`` of the encoder). Rows
are filled first-fit-decreasing under two budgets, encoder and decoder tokens. Batches are then cut from rows
sorted by decoder fill, so rows of a batch need about the same decoder width: with a token budget per batch
(``tokens_per_batch``) the number of rows follows from that width.

Because :meth:`fat5.trainer.ul2.UL2Objective.plan` fixes every output length before any token is read, packing
is planned on exact lengths: :class:`UL2PackedBatchSampler` plans an epoch of a map-style dataset (long documents
cut into pieces that fill a row) and yields batches of :class:`PlannedExample`; :class:`PlannedDataset` turns them
into token slices and :class:`~fat5.trainer.collator.UL2DataCollator` writes the rows. Everything is a
deterministic function of ``(seed, epoch)``, so resuming at batch ``k`` replays the same data.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from .ul2 import UL2Objective, UL2Plan


class PlannedExample(NamedTuple):
    """One planned example: a slice of source ``source`` with its denoiser, counts and place in a batch.

    ``batch_rows`` and ``target_width`` are the shape of its batch when batches come in fixed shapes (see
    :class:`ShapeBuckets`): the collator then pads the batch to that many rows, the encoder to ``max_input_length``
    and the decoder to ``target_width``; 0 where the shape follows the batch's content."""

    source: int
    start: int
    length: int
    denoiser: int
    num_noise: int
    num_spans: int
    row: int
    rng_key: tuple[int, ...]
    batch_rows: int = 0
    target_width: int = 0


def round_up(value: int, multiple: int | None) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (unchanged for None or 1)."""
    if not multiple or multiple <= 1:
        return int(value)
    return int(-(-int(value) // multiple) * multiple)


def pack_rows(
    input_lengths: Sequence[int] | np.ndarray,
    target_lengths: Sequence[int] | np.ndarray,
    max_input_length: int,
    max_target_length: int | None = None,
) -> tuple[np.ndarray, int]:
    """Assign examples to rows, first-fit decreasing on input length, with both budgets respected.

    Returns ``(row_of_example, num_rows)``. An example longer than a budget raises ValueError.
    """
    inputs = np.asarray(input_lengths, dtype=np.int64)
    targets = np.asarray(target_lengths, dtype=np.int64)
    if inputs.shape != targets.shape or inputs.ndim != 1:
        raise ValueError("input_lengths and target_lengths must be 1-D and of equal length")
    max_target = np.iinfo(np.int64).max if max_target_length is None else int(max_target_length)
    if len(inputs) and (inputs.max() > max_input_length or targets.max() > max_target):
        raise ValueError(
            f"an example ({inputs.max()} input / {targets.max()} target tokens) exceeds the row budget "
            f"({max_input_length} / {max_target_length})"
        )
    row_of = np.empty(len(inputs), dtype=np.int64)
    order = np.argsort(-inputs, kind="stable")
    smallest = int(inputs.min()) if len(inputs) else 0
    free_input = np.empty(len(inputs), dtype=np.int64)
    free_target = np.empty(len(inputs), dtype=np.int64)
    open_rows = np.empty(len(inputs), dtype=np.int64)  # ids of rows that can still take the smallest example
    num_open = num_rows = 0
    for i in order.tolist():
        need_in, need_tg = inputs[i], targets[i]
        candidates = open_rows[:num_open]
        fits = (free_input[candidates] >= need_in) & (free_target[candidates] >= need_tg)
        slot = int(fits.argmax()) if num_open else 0
        if num_open and fits[slot]:
            row = int(candidates[slot])
            free_input[row] -= need_in
            free_target[row] -= need_tg
            if free_input[row] < smallest:
                open_rows[slot : num_open - 1] = open_rows[slot + 1 : num_open]
                num_open -= 1
        else:
            row = num_rows
            num_rows += 1
            free_input[row] = max_input_length - need_in
            free_target[row] = max_target - need_tg
            if free_input[row] >= smallest:
                open_rows[num_open] = row
                num_open += 1
        row_of[i] = row
    return row_of, num_rows


def batch_rows(
    row_target_fill: np.ndarray,
    *,
    rows_per_batch: int | None = None,
    tokens_per_batch: int | None = None,
    input_width: int = 0,
    group_by_length: bool = True,
    pad_to_multiple_of: int | None = 8,
    rng: np.random.Generator | None = None,
) -> list[np.ndarray]:
    """Cut rows into batches: ``rows_per_batch`` rows each, or as many as fit ``tokens_per_batch``.

    The token budget counts every position of the batch, encoder (``input_width`` per row) and decoder (the
    batch's widest decoder fill, rounded up). With ``group_by_length`` rows are sorted by decoder fill first,
    so a batch needs little decoder padding; the batches come out in random order when ``rng`` is given.
    """
    if (rows_per_batch is None) == (tokens_per_batch is None):
        raise ValueError("give exactly one of rows_per_batch and tokens_per_batch")
    fill = np.asarray(row_target_fill, dtype=np.int64)
    if group_by_length:
        order = np.argsort(fill, kind="stable")
    elif rng is not None:
        order = rng.permutation(len(fill))
    else:
        order = np.arange(len(fill))
    batches = []
    if rows_per_batch is not None:
        if rows_per_batch < 1:
            raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
        batches = [order[i : i + rows_per_batch] for i in range(0, len(order), rows_per_batch)]
    else:
        start = 0
        widest = 0
        for position, row in enumerate(order.tolist()):
            widest_with_row = max(widest, round_up(fill[row], pad_to_multiple_of))
            if position > start and (position - start + 1) * (input_width + widest_with_row) > tokens_per_batch:
                batches.append(order[start:position])
                start, widest_with_row = position, round_up(fill[row], pad_to_multiple_of)
            widest = widest_with_row
        if start < len(order):
            batches.append(order[start:])
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def padding_stats(batch: Mapping) -> dict[str, float]:
    """Padding of a collated batch (packed or padded), as fractions of the positions, and token counts.

    Keys: ``input_tokens``, ``target_tokens`` (real tokens), ``input_padding``, ``target_padding`` and
    ``padding_fraction`` (encoder and decoder positions together).
    """
    if "segment_ids" in batch:
        input_real = batch["segment_ids"] != 0
        target_real = batch["decoder_segment_ids"] != 0
    else:
        input_real = batch["attention_mask"] != 0
        target_real = batch["labels"] != -100
    input_tokens = int(input_real.sum())
    target_tokens = int(target_real.sum())
    input_positions = int(np.prod(tuple(input_real.shape)))
    target_positions = int(np.prod(tuple(target_real.shape)))
    return {
        "input_tokens": input_tokens,
        "target_tokens": target_tokens,
        "input_padding": 1.0 - input_tokens / max(input_positions, 1),
        "target_padding": 1.0 - target_tokens / max(target_positions, 1),
        "padding_fraction": 1.0 - (input_tokens + target_tokens) / max(input_positions + target_positions, 1),
    }


class ShapeBuckets(NamedTuple):
    """The fixed shapes of packed batches: rows of ``input_width`` encoder tokens and, for bucket ``b``,
    ``rows[b]`` rows of ``target_widths[b]`` decoder tokens (widths ascending).

    A compiled step (CUDA graphs, or regional compilation) is then captured once per shape and replayed, where
    batches whose shapes follow their content would recompile or re-record at nearly every step."""

    input_width: int
    target_widths: tuple[int, ...]
    rows: tuple[int, ...]

    @classmethod
    def for_budget(cls, input_width: int, target_widths, tokens_per_batch: int | None = None,
                   rows_per_batch: int | None = None) -> ShapeBuckets:
        """Buckets of ``rows_per_batch`` rows each, or of as many rows as ``tokens_per_batch`` positions (encoder
        and decoder) hold at each width."""
        if (rows_per_batch is None) == (tokens_per_batch is None):
            raise ValueError("give exactly one of rows_per_batch and tokens_per_batch")
        widths = tuple(sorted({int(width) for width in target_widths}))
        if not widths or widths[0] < 1:
            raise ValueError(f"the decoder widths of the shape buckets must be >= 1, got {list(target_widths)}")
        if rows_per_batch is not None:
            rows = (int(rows_per_batch),) * len(widths)
        else:
            rows = tuple(max(1, int(tokens_per_batch) // (input_width + width)) for width in widths)
        return cls(int(input_width), widths, rows)

    def shapes(self) -> list[tuple[int, int, int]]:
        """``(rows, encoder width, decoder width)`` of each bucket."""
        return [(rows, self.input_width, width) for rows, width in zip(self.rows, self.target_widths)]


def choose_target_widths(target_fill: np.ndarray, count: int, max_width: int, multiple: int = 8,
                         rows_at_width=None, batchings: int = 1) -> list[int]:
    """The ``count`` decoder widths, multiples of ``multiple`` below ``max_width`` or ``max_width`` rounded up to a
    multiple of 8, that leave the fewest padding positions when each row (of ``target_fill`` decoder tokens) takes
    the narrowest width that holds it.

    With ``rows_at_width`` (a width's rows per batch), the rows a batch cut moves up also count: batches are cut
    from rows sorted by fill (:func:`bucket_batches`), so each of the ``batchings`` cuts (pools) leaves, on average,
    ``(rows - 1) / 2`` rows of a narrower width's last batch to the next width, each paying the difference.

    The widest is always ``max_width`` rounded up to a multiple of 8, so that any row a packer makes fits one."""
    if count < 1:
        raise ValueError(f"the number of shape buckets must be >= 1, got {count}")
    fill = np.sort(np.asarray(target_fill, dtype=np.int64))
    widest = round_up(max_width, 8)
    candidates = np.append(np.arange(multiple, widest, multiple), widest)
    # rows at most each candidate wide, and their tokens
    rows_upto = np.searchsorted(fill, candidates, side="right")
    tokens_upto = np.concatenate([[0], np.cumsum(fill)])[rows_upto]
    rows_upto, tokens_upto = np.concatenate([[0], rows_upto]), np.concatenate([[0], tokens_upto])
    widths_from = np.concatenate([[0], candidates])
    carried = np.zeros(len(widths_from))
    if rows_at_width is not None:
        carried[1:] = [batchings * (rows_at_width(int(width)) - 1) / 2 for width in candidates]
    num = len(candidates)
    # best[k][j]: least padding of the rows up to candidate j with k widths, the widest being candidate j
    best = np.full((count + 1, num + 1), np.inf)
    choice = np.zeros((count + 1, num + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, count + 1):
        for j in range(1, num + 1):
            previous = np.arange(j)
            padding = (candidates[j - 1] * (rows_upto[j] - rows_upto[previous])
                       - (tokens_upto[j] - tokens_upto[previous])
                       + carried[previous] * (candidates[j - 1] - widths_from[previous]))
            costs = best[k - 1, previous] + padding
            choice[k, j] = int(np.argmin(costs))
            best[k, j] = costs[choice[k, j]]
    k = int(np.argmin(best[1:, num])) + 1  # fewer widths when more would not cut the padding
    widths, j = [], num
    while j > 0 and k > 0:
        widths.append(int(candidates[j - 1]))
        j, k = choice[k, j], k - 1
    return sorted(widths)


def bucket_batches(
    row_target_fill: np.ndarray, buckets: ShapeBuckets, drop_last: bool = False,
    rng: np.random.Generator | None = None,
) -> list[tuple[np.ndarray, int]]:
    """Cut rows into batches of the buckets' shapes: ``(rows, bucket index)`` for each.

    Rows are taken in order of decoder fill; each batch takes the narrowest bucket whose width holds all of its
    rows, so only the last batch can have fewer rows than its bucket (the collator pads it with empty rows, or
    ``drop_last`` drops it). The batches come out in random order when ``rng`` is given."""
    fill = np.asarray(row_target_fill, dtype=np.int64)
    if len(fill) and fill.max() > buckets.target_widths[-1]:
        raise ValueError(f"a row fills {fill.max()} decoder positions, more than the widest bucket "
                         f"({buckets.target_widths[-1]})")
    order = np.argsort(fill, kind="stable")
    batches, start = [], 0
    while start < len(order):
        # the first bucket whose rows, filled from here, all fit its width (the widest holds every row)
        index = next(index for index, (width, rows) in enumerate(zip(buckets.target_widths, buckets.rows))
                     if fill[order[min(start + rows, len(order)) - 1]] <= width)
        rows = buckets.rows[index]
        end = min(start + rows, len(order))
        if end - start == rows or not drop_last:
            batches.append((order[start:end], index))
        start = end
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def plan_packed_batches(
    objective: UL2Objective,
    lengths: np.ndarray,
    rng: np.random.Generator,
    *,
    rows_per_batch: int | None = None,
    tokens_per_batch: int | None = None,
    group_by_length: bool = True,
    pad_to_multiple_of: int | None = 8,
    split_long: bool = True,
    buckets: ShapeBuckets | None = None,
    drop_last: bool = False,
) -> tuple[UL2Plan, list[tuple[np.ndarray, np.ndarray, tuple[int, int] | None]]]:
    """Plan examples for sources of ``lengths`` tokens, pack them into rows and the rows into batches.

    Returns the plan and, for each batch, ``(example_indices, row_within_batch, shape)`` into that plan; ``shape``
    is the ``(rows, decoder width)`` of the batch's bucket with ``buckets`` (see :func:`bucket_batches`), else None.
    """
    plan, row_of, num_rows = _packed_rows(objective, lengths, rng, split_long)
    target_fill = np.bincount(row_of, weights=plan.target_length, minlength=num_rows).astype(np.int64)
    if buckets is not None:
        cut = bucket_batches(target_fill, buckets, drop_last=drop_last, rng=rng)
        batches = [rows for rows, _ in cut]
        shapes = [(buckets.rows[index], buckets.target_widths[index]) for _, index in cut]
    else:
        batches = batch_rows(
            target_fill,
            rows_per_batch=rows_per_batch,
            tokens_per_batch=tokens_per_batch,
            input_width=objective.max_input_length,
            group_by_length=group_by_length,
            pad_to_multiple_of=pad_to_multiple_of,
            rng=rng,
        )
        shapes = [None] * len(batches)
    examples_by_row = np.argsort(row_of, kind="stable")
    row_starts = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=num_rows))])
    result = []
    for rows, shape in zip(batches, shapes):
        members = [examples_by_row[row_starts[r] : row_starts[r + 1]] for r in rows.tolist()]
        indices = np.concatenate(members)
        within = np.repeat(np.arange(len(rows)), [len(m) for m in members])
        result.append((indices, within, shape))
    return plan, result


def _packed_rows(objective: UL2Objective, lengths: np.ndarray, rng: np.random.Generator, split_long: bool = True):
    """The plan of sources of ``lengths`` tokens, the row of each planned example, and the number of rows."""
    max_target = objective.max_target_length or objective.max_input_length
    plan = objective.plan(lengths, rng, split_long=split_long)
    row_of, num_rows = pack_rows(plan.input_length, plan.target_length, objective.max_input_length, max_target)
    return plan, row_of, num_rows


def shape_buckets_for(
    objective: UL2Objective,
    lengths: np.ndarray,
    count_or_widths,
    *,
    tokens_per_batch: int | None = None,
    rows_per_batch: int | None = None,
    seed: int = 0,
    multiple: int = 8,
    pool_size: int | None = None,
) -> ShapeBuckets:
    """Shape buckets for packed UL2 rows: ``count_or_widths`` decoder widths given, or that many chosen from the
    decoder fill of the rows that the mixture makes of sources of ``lengths`` tokens (one planning, seeded), counting
    the rows that cutting each pool of ``pool_size`` sources (all of them if None) into batches moves up a width
    (see :func:`choose_target_widths`)."""
    max_target = objective.max_target_length or objective.max_input_length
    if isinstance(count_or_widths, (int, np.integer)) and not isinstance(count_or_widths, bool):
        plan, row_of, num_rows = _packed_rows(objective, np.asarray(lengths, dtype=np.int64),
                                              np.random.default_rng([seed, 1 << 20]))
        fill = np.bincount(row_of, weights=plan.target_length, minlength=num_rows)
        pools = -(-len(lengths) // pool_size) if pool_size else 1

        def rows_at_width(width: int) -> int:
            return ShapeBuckets.for_budget(objective.max_input_length, [width], tokens_per_batch=tokens_per_batch,
                                           rows_per_batch=rows_per_batch).rows[0]

        widths = choose_target_widths(fill, int(count_or_widths), max_target, multiple, rows_at_width, pools)
    else:
        widths = [int(width) for width in count_or_widths]
        if max(widths) < max_target:
            raise ValueError(f"the widest shape bucket ({max(widths)}) must hold max_target_length ({max_target})")
    return ShapeBuckets.for_budget(objective.max_input_length, widths, tokens_per_batch=tokens_per_batch,
                                   rows_per_batch=rows_per_batch)


class UL2PackedBatchSampler:
    """Batch sampler for a map-style dataset of token sequences: yields lists of :class:`PlannedExample`.

    Use it with :class:`PlannedDataset` and a packed :class:`~fat5.trainer.collator.UL2DataCollator`::

        sampler = UL2PackedBatchSampler(dataset["length"], collator.objective, tokens_per_batch=65536)
        loader = DataLoader(PlannedDataset(dataset), batch_sampler=sampler, collate_fn=collator)

    Each epoch, sources are shuffled (seed, epoch) and taken ``pool_size`` at a time; each pool is planned
    (long sources cut into pieces), packed into rows and cut into batches (see :func:`plan_packed_batches`).
    Call :meth:`set_epoch` before each epoch; the batches of an epoch are the same on every call.

    ``shape_buckets``: batches in a few fixed shapes (:class:`ShapeBuckets`): that many decoder widths chosen from
    the mixture's rows on these sources (an int), or the widths (a list), rows per batch following the budget;
    ``buckets`` then holds them. With ``drop_last``, a pool's last batch is dropped when it has fewer rows than its
    shape (else the collator pads it with empty rows).

    ``shape_group`` (with shape buckets): the epoch's batches come in groups of that many consecutive batches of one
    shape, the groups in random order (see :func:`group_by_shape`). Under ``n`` processes accelerate gives process
    ``r`` batches ``r, r + n, ...``: with groups of ``n`` (times the gradient accumulation steps) every process
    trains a batch of the same shape at every step, so that no compiled step waits on a peer capturing a new shape.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        objective: UL2Objective,
        *,
        rows_per_batch: int | None = None,
        tokens_per_batch: int | None = None,
        pool_size: int = 4096,
        group_by_length: bool = True,
        shuffle: bool = True,
        split_long: bool = True,
        drop_last: bool = False,
        pad_to_multiple_of: int | None = 8,
        seed: int = 0,
        shape_buckets: int | Sequence[int] | None = None,
        shape_group: int = 1,
    ):
        if (rows_per_batch is None) == (tokens_per_batch is None):
            raise ValueError("give exactly one of rows_per_batch and tokens_per_batch")
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        if shape_group < 1 or (shape_group > 1 and shape_buckets is None):
            raise ValueError(f"shape_group must be >= 1, and 1 without shape_buckets, got {shape_group}")
        self.buckets = None
        if shape_buckets is not None:
            self.buckets = shape_buckets_for(objective, lengths, shape_buckets, tokens_per_batch=tokens_per_batch,
                                             rows_per_batch=rows_per_batch, seed=seed, pool_size=pool_size)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.objective = objective
        self.rows_per_batch = rows_per_batch
        self.tokens_per_batch = tokens_per_batch
        self.pool_size = pool_size
        self.group_by_length = group_by_length
        self.shuffle = shuffle
        self.split_long = split_long
        self.drop_last = drop_last
        self.pad_to_multiple_of = pad_to_multiple_of
        self.seed = seed
        self.shape_group = shape_group
        self.epoch = 0
        self._cache: tuple[int, list[list[PlannedExample]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose batches the next iteration yields."""
        self.epoch = int(epoch)

    def batches(self, epoch: int | None = None) -> list[list[PlannedExample]]:
        """All batches of an epoch (planned once, then cached)."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.lengths)) if self.shuffle else np.arange(len(self.lengths))
        batches: list[list[PlannedExample]] = []
        for pool_start in range(0, len(order), self.pool_size):
            sources = order[pool_start : pool_start + self.pool_size]
            plan, pool_batches = plan_packed_batches(
                self.objective,
                self.lengths[sources],
                rng,
                rows_per_batch=self.rows_per_batch,
                tokens_per_batch=self.tokens_per_batch,
                group_by_length=self.group_by_length,
                pad_to_multiple_of=self.pad_to_multiple_of,
                split_long=self.split_long,
                buckets=self.buckets,
                drop_last=self.drop_last,
            )
            if self.drop_last and self.rows_per_batch is not None and self.buckets is None:
                pool_batches = [b for b in pool_batches if b[1].max(initial=-1) + 1 == self.rows_per_batch]
            columns = (sources[plan.source], plan.start, plan.length, plan.denoiser, plan.num_noise, plan.num_spans)
            columns = [c.tolist() for c in columns]
            for indices, rows, shape in pool_batches:
                key = (self.seed, epoch, len(batches))
                shape_rows, target_width = shape or (0, 0)
                batches.append(
                    [
                        PlannedExample(*(c[i] for c in columns), row=r, rng_key=key, batch_rows=shape_rows,
                                       target_width=target_width)
                        for i, r in zip(indices.tolist(), rows.tolist())
                    ]
                )
        if self.shape_group > 1:
            batches = group_by_shape(batches, self.shape_group, np.random.default_rng([self.seed, epoch, 1 << 21]))
        self._cache = (epoch, batches)
        return batches

    def __iter__(self) -> Iterator[list[PlannedExample]]:
        yield from self.batches()

    def __len__(self) -> int:
        return len(self.batches())


def group_by_shape(batches: list[list[PlannedExample]], group: int,
                   rng: np.random.Generator) -> list[list[PlannedExample]]:
    """``batches`` (each of one bucket shape) reordered into groups of ``group`` consecutive batches of one shape,
    the groups in ``rng``'s order. The batches of a shape are taken in their order; the fewer than ``group`` left of
    each shape are dropped (at most ``group - 1`` batches a shape an epoch)."""
    by_shape: dict[tuple[int, int], list[list[PlannedExample]]] = {}
    for batch in batches:
        by_shape.setdefault((batch[0].batch_rows, batch[0].target_width), []).append(batch)
    groups = [same[start : start + group] for same in by_shape.values()
              for start in range(0, len(same) - group + 1, group)]
    return [batch for index in rng.permutation(len(groups)) for batch in groups[index]]


class PlannedDataset:
    """Wraps a map-style dataset of token sequences so that indexing it with a :class:`PlannedExample` gives
    ``{"input_ids": the planned slice, "ul2_plan": the plan}``; an int index gives the item unchanged."""

    def __init__(self, dataset, input_key: str = "input_ids"):
        self.dataset = dataset
        self.input_key = input_key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item):
        if not isinstance(item, PlannedExample):
            return self.dataset[item]
        record = self.dataset[item.source]
        tokens = record[self.input_key] if isinstance(record, Mapping) else record
        tokens = np.asarray(tokens)[item.start : item.start + item.length]
        return {self.input_key: tokens, "ul2_plan": item}


def packed_stream(
    sources: Iterable,
    collator,
    *,
    rows_per_batch: int | None = None,
    tokens_per_batch: int | None = None,
    pool_size: int = 4096,
    group_by_length: bool = True,
    seed: int = 0,
    input_key: str = "input_ids",
    shape_buckets: int | Sequence[int] | None = None,
) -> Iterator[dict]:
    """Packed batches from a stream of token sequences (lists, arrays or dicts with ``input_key``).

    Reads ``pool_size`` sources at a time, plans and packs them like :class:`UL2PackedBatchSampler`, and yields
    collated batches. Deterministic for a given stream and ``seed``. ``shape_buckets`` as for the sampler (a count
    of widths is chosen from the first pool).
    """
    iterator = iter(sources)
    objective = collator.objective
    buckets = None
    for pool_index in itertools.count():
        pool = [
            np.asarray(s[input_key] if isinstance(s, Mapping) else s, dtype=np.int64)
            for s in itertools.islice(iterator, pool_size)
        ]
        if not pool:
            return
        rng = np.random.default_rng([seed, pool_index])
        lengths = np.array([len(s) for s in pool], dtype=np.int64)
        if shape_buckets is not None and buckets is None:
            buckets = shape_buckets_for(objective, lengths, shape_buckets, tokens_per_batch=tokens_per_batch,
                                        rows_per_batch=rows_per_batch, seed=seed)
        plan, batches = plan_packed_batches(
            objective,
            lengths,
            rng,
            rows_per_batch=rows_per_batch,
            tokens_per_batch=tokens_per_batch,
            group_by_length=group_by_length,
            pad_to_multiple_of=collator.pad_to_multiple_of,
            buckets=buckets,
        )
        for batch_index, (indices, rows, shape) in enumerate(batches):
            sub_plan = plan.select(indices)
            batch_rng = np.random.default_rng([seed, pool_index, batch_index])
            yield collator.collate_plan(pool, sub_plan, rows, batch_rng, shape=shape)


class PackedStreamDataset(IterableDataset):
    """A torch ``IterableDataset`` of packed batches from a stream of token sequences (see :func:`packed_stream`).

    Load it with ``DataLoader(dataset, batch_size=None, num_workers=N)``: the batches are already collated. In a
    worker, a `datasets` ``IterableDataset`` source shards itself across workers; any other iterable is split by
    taking every N-th sequence. Each worker draws with its own seed.
    """

    def __init__(self, sources: Iterable, collator, **stream_kwargs):
        self.sources = sources
        self.collator = collator
        self.stream_kwargs = stream_kwargs

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        sources = self.sources
        kwargs = dict(self.stream_kwargs)
        if info is not None:
            if not _shards_itself(sources):
                sources = itertools.islice(sources, info.id, None, info.num_workers)
            kwargs["seed"] = kwargs.get("seed", 0) * 1_000_003 + info.id + 1
        return packed_stream(sources, self.collator, **kwargs)


def _shards_itself(sources) -> bool:
    """True for a `datasets` IterableDataset, which splits its shards among DataLoader workers by itself."""
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(sources, datasets.IterableDataset)
