"""UL2 mixture of denoisers: T5 span corruption and the prefix-LM S-denoiser, vectorised over many examples.

Span corruption follows T5's ``random_spans_noise_mask`` (t5/data/preprocessors.py):

* ``num_noise_tokens = round(length * r)``, clipped to ``[1, length - 1]`` (round half to even, like ``tf.round``);
* ``num_noise_spans = round(num_noise_tokens / mu)``, at least 1;
* noise and non-noise tokens are each split into random non-empty spans, all such masks equally likely;
* every noise span becomes one sentinel in the inputs (``<extra_id_0>``, ``<extra_id_1>``, ... in order) and the
  targets are ``<extra_id_j>`` followed by span ``j``, for each span, then EOS.

Two choices differ from T5 by default, both switchable back to T5's exact behaviour:

* ``span_count_rounding="stochastic"`` rounds ``num_noise_tokens / mu`` up with probability equal to its fractional
  part, so the expected span count is ``num_noise_tokens / mu`` and the mean span length is ``mu`` even when the
  span count is small (T5's nearest rounding gives mean span 77 instead of 64 at ``mu=64, r=0.15`` on 1024
  tokens); ``"nearest"`` is T5's.
* ``placement="uniform"`` lets a sequence start or end with either kind of span (every arrangement of the spans
  is equally likely), where T5's ``placement="t5"`` always begins with non-noise and ends with noise, so the
  last tokens of every example are masked.

The span count is capped by ``max_spans`` and by the number of sentinels the tokenizer has.

The S-denoiser is a prefix LM: one trailing span, a target fraction drawn uniformly from
``target_fraction_range`` (mean ``r``), no sentinel: inputs ``[S] prefix EOS``, targets ``continuation EOS``.

Work is split in two steps so that a batch sampler can pack rows on exact lengths before any token is touched:
:meth:`UL2Objective.plan` draws the denoiser and the span counts (that fixes every output length) and
:meth:`UL2Objective.realize` draws the span positions and writes inputs and targets. Everything is numpy on flat
arrays; randomness comes only from the ``numpy.random.Generator`` passed in.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

DENOISER_KINDS = ("span", "prefix_lm")
PLACEMENTS = ("uniform", "t5")
SPAN_COUNT_ROUNDINGS = ("stochastic", "nearest")
DEFAULT_CONFIG_PATH = os.path.join(os.path.dirname(__file__), "configs", "ul2_default.yaml")


@dataclass(frozen=True)
class Denoiser:
    """One UL2 denoiser.

    Args:
        prefix: the mode token put first in the inputs (``"[R]"``, ``"[S]"``, ``"[X]"``).
        noise_density: ``r``, the fraction of tokens masked (``kind="span"``), or the mean target fraction
            (``kind="prefix_lm"``).
        mean_span_length: ``mu``, the mean length of a noise span (``kind="span"`` only).
        max_spans: the most noise spans per example (None: no limit beyond the tokenizer's sentinels).
        kind: ``"span"`` (T5 span corruption) or ``"prefix_lm"`` (the S-denoiser).
        target_fraction_range: for ``"prefix_lm"``, the interval the target fraction is drawn from uniformly;
            default ``(0, 2 r)``.
        name: a label for logs.
    """

    prefix: str
    noise_density: float
    mean_span_length: float = 3.0
    max_spans: int | None = None
    kind: str = "span"
    target_fraction_range: tuple[float, float] | None = None
    name: str = ""

    def __post_init__(self):
        if self.kind not in DENOISER_KINDS:
            raise ValueError(f"denoiser kind must be one of {DENOISER_KINDS}, got {self.kind!r}")
        if self.kind == "span":
            if not 0.0 < self.noise_density < 1.0:
                raise ValueError(
                    f"a span denoiser needs 0 < noise_density < 1, got {self.noise_density} "
                    "(r = 0 means the prefix-LM S-denoiser: use kind='prefix_lm')"
                )
            if not self.mean_span_length >= 1.0:
                raise ValueError(f"mean_span_length must be >= 1, got {self.mean_span_length}")
        else:
            low, high = self.target_range
            if not 0.0 <= low <= high <= 1.0 or high == 0.0:
                raise ValueError(
                    f"a prefix_lm denoiser needs 0 <= low <= high <= 1 and high > 0 for its target fraction, got "
                    f"noise_density={self.noise_density}, target_fraction_range={self.target_fraction_range}"
                )
        if self.max_spans is not None and self.max_spans < 1:
            raise ValueError(f"max_spans must be >= 1 or None, got {self.max_spans}")
        if not self.name:
            label = (
                f"{self.prefix}mu{self.mean_span_length:g}_r{self.noise_density:g}"
                if self.kind == "span"
                else f"{self.prefix}prefix_lm_r{self.mean_noise_density:g}"
            )
            object.__setattr__(self, "name", label)

    @property
    def target_range(self) -> tuple[float, float]:
        """(low, high) of the uniform target fraction of a prefix-LM denoiser."""
        if self.target_fraction_range is not None:
            low, high = self.target_fraction_range
            return float(low), float(high)
        return 0.0, 2.0 * float(self.noise_density)

    @property
    def mean_noise_density(self) -> float:
        """The expected fraction of tokens that go to the targets."""
        if self.kind == "prefix_lm":
            low, high = self.target_range
            return (low + high) / 2.0
        return float(self.noise_density)

    @classmethod
    def from_dict(cls, spec: Mapping) -> Denoiser:
        """Build from a dict in this class's field names, or in the seed's ``{"mu", "r", "max_spans", "prefix"}``.

        A seed-style entry with ``r == 0`` (the seed's S-denoiser) becomes a prefix LM with mean target fraction
        0.25, the UL2 paper's S-denoiser.
        """
        spec = dict(spec)
        spec.pop("proportion", None)
        aliases = {"r": "noise_density", "mu": "mean_span_length"}
        for short, full in aliases.items():
            if short in spec:
                if full in spec:
                    raise ValueError(f"denoiser spec gives both {short!r} and {full!r}: {spec}")
                spec[full] = spec.pop(short)
        unknown = set(spec) - {f.name for f in cls.__dataclass_fields__.values()}
        if unknown:
            raise ValueError(f"unknown denoiser fields {sorted(unknown)} in {spec}")
        if "prefix" not in spec or "noise_density" not in spec:
            raise ValueError(f"a denoiser needs at least 'prefix' and 'r' (noise_density): {spec}")
        if spec.get("kind") is None:
            spec["kind"] = "prefix_lm" if spec["noise_density"] == 0 else "span"
            if spec["kind"] == "prefix_lm":
                spec["noise_density"] = 0.25
        if spec["kind"] == "prefix_lm":
            spec.pop("mean_span_length", None)
            spec.pop("max_spans", None)
        if spec.get("target_fraction_range") is not None:
            spec["target_fraction_range"] = tuple(float(x) for x in spec["target_fraction_range"])
        return cls(**spec)


@dataclass(frozen=True)
class UL2Mixture:
    """A list of denoisers and the probability of drawing each one."""

    denoisers: tuple[Denoiser, ...]
    proportions: tuple[float, ...]

    def __post_init__(self):
        if len(self.denoisers) == 0:
            raise ValueError("a UL2 mixture needs at least one denoiser")
        if len(self.denoisers) != len(self.proportions):
            raise ValueError(
                f"{len(self.denoisers)} denoisers but {len(self.proportions)} proportions; give one per denoiser"
            )
        proportions = np.asarray(self.proportions, dtype=np.float64)
        if (proportions < 0).any() or not math.isclose(proportions.sum(), 1.0, abs_tol=1e-6):
            raise ValueError(f"denoiser proportions must be >= 0 and sum to 1, got {list(self.proportions)}")

    @property
    def prefixes(self) -> list[str]:
        """The distinct mode tokens, in order of first use."""
        return list(dict.fromkeys(d.prefix for d in self.denoisers))

    @classmethod
    def from_config(cls, config: Mapping) -> UL2Mixture:
        """From ``{"denoisers": [...], "proportions": [...]}`` or denoisers that each carry ``proportion``."""
        if "denoisers" not in config:
            raise ValueError("a UL2 config needs a 'denoisers' list")
        entries = list(config["denoisers"])
        proportions = config.get("proportions", config.get("denoiser_proportions"))
        if proportions is None:
            if not all(isinstance(e, Mapping) and "proportion" in e for e in entries):
                raise ValueError("give 'proportions' beside 'denoisers', or a 'proportion' in every denoiser")
            proportions = [e["proportion"] for e in entries]
        denoisers = tuple(e if isinstance(e, Denoiser) else Denoiser.from_dict(e) for e in entries)
        return cls(denoisers, tuple(float(p) for p in proportions))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> UL2Mixture:
        """Read a YAML file holding a UL2 config (top level, or under a ``ul2:`` key)."""
        return cls.from_config(load_ul2_config(path))

    @classmethod
    def default(cls) -> UL2Mixture:
        """The FAT5 recipe: seven denoisers (R, R, S, X, X, X, X) from ``configs/ul2_default.yaml``."""
        return cls.from_yaml(DEFAULT_CONFIG_PATH)


def load_ul2_config(path: str | os.PathLike) -> dict:
    """The UL2 section of a YAML file (top level, or under a ``ul2:`` key): ``denoisers``, ``proportions`` and
    optionally ``placement`` and ``span_count_rounding``."""
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f)
    if isinstance(config, Mapping) and "ul2" in config:
        config = config["ul2"]
    if not isinstance(config, Mapping):
        raise TypeError(f"{path}: expected a mapping with 'denoisers' and 'proportions'")
    return dict(config)


@dataclass
class UL2Plan:
    """What :meth:`UL2Objective.plan` decided for each example; every output length is fixed by it.

    Arrays of one entry per example: ``denoiser`` (index into the mixture), ``start`` and ``length`` (the slice of
    the source sequence the example uses), ``num_noise`` (tokens moved to the targets), ``num_spans`` (noise spans),
    ``input_length`` and ``target_length`` (tokens of the inputs and targets, mode prefix and EOS included) and
    ``source`` (which source sequence the example was cut from).
    """

    source: np.ndarray
    start: np.ndarray
    length: np.ndarray
    denoiser: np.ndarray
    num_noise: np.ndarray
    num_spans: np.ndarray
    input_length: np.ndarray = field(default=None)
    target_length: np.ndarray = field(default=None)

    def __len__(self) -> int:
        return len(self.length)

    def select(self, index) -> UL2Plan:
        """The plan of a subset of the examples (any numpy index)."""
        columns = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return UL2Plan(**{name: None if value is None else value[index] for name, value in columns.items()})


@dataclass
class CorruptedBatch:
    """Inputs and targets of many examples, concatenated: example ``i`` has ``inputs[input_offsets[i]:
    input_offsets[i + 1]]`` and ``targets[target_offsets[i]:target_offsets[i + 1]]``."""

    inputs: np.ndarray
    input_offsets: np.ndarray
    targets: np.ndarray
    target_offsets: np.ndarray
    denoiser: np.ndarray

    def __len__(self) -> int:
        return len(self.denoiser)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of example ``i``."""
        return (
            self.inputs[self.input_offsets[i] : self.input_offsets[i + 1]],
            self.targets[self.target_offsets[i] : self.target_offsets[i + 1]],
        )


def num_noise_tokens(lengths: np.ndarray, noise_density) -> np.ndarray:
    """T5's count: ``round(length * r)`` clipped to ``[1, length - 1]``; 0 for sequences shorter than 2."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = np.rint(lengths * np.asarray(noise_density, dtype=np.float64)).astype(np.int64)
    counts = np.clip(counts, 1, np.maximum(lengths - 1, 1))
    return np.where(lengths >= 2, counts, 0)


def num_noise_spans(
    num_noise: np.ndarray,
    lengths: np.ndarray,
    mean_span_length: float,
    *,
    max_spans: int | None = None,
    placement: str = "uniform",
    rounding: str = "stochastic",
    uniform: np.ndarray | None = None,
) -> np.ndarray:
    """Span count for each example: ``num_noise / mu`` rounded (T5: nearest, at least 1), then capped.

    ``uniform`` are the draws in [0, 1) for stochastic rounding (one per example); with ``uniform=None`` and
    stochastic rounding the count is the upper bound (rounded up), which is what length planning needs.
    Caps: ``max_spans``, the number of noise tokens, and the non-noise tokens that must separate the spans.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if rounding not in SPAN_COUNT_ROUNDINGS:
        raise ValueError(f"span_count_rounding must be one of {SPAN_COUNT_ROUNDINGS}, got {rounding!r}")
    num_noise = np.asarray(num_noise, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    ratio = num_noise / float(mean_span_length)
    if rounding == "nearest":
        spans = np.rint(ratio)
    elif uniform is None:
        spans = np.ceil(ratio)
    else:
        floor = np.floor(ratio)
        spans = floor + (uniform < ratio - floor)
    spans = np.maximum(spans.astype(np.int64), 1)
    if max_spans is not None:
        spans = np.minimum(spans, max_spans)
    # Non-noise runs between spans are non-empty; uniform placement may also use both ends.
    separators = lengths - num_noise + (1 if placement == "uniform" else 0)
    spans = np.minimum(spans, np.minimum(num_noise, separators))
    return np.where(num_noise > 0, spans, 0)


def sorted_random_subsets(population: np.ndarray, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """For each ``i`` a uniformly random subset of ``range(population[i])`` of ``sizes[i]`` elements.

    Returns the subsets concatenated, each in increasing order. Each segment draws one uniform key per element
    and keeps the ``sizes[i]`` smallest (a uniform subset, by symmetry); segments are laid out as rows of a
    matrix, in groups of similar population so that little of the matrix is padding, and sorted row-wise.
    """
    population = np.asarray(population, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    if (sizes > population).any() or (sizes < 0).any():
        raise ValueError("each subset size must be in [0, population]")
    active = np.flatnonzero(sizes > 0)
    if len(active) == 0:
        return np.zeros(0, dtype=np.int64)
    active = active[np.argsort(population[active], kind="stable")]
    segments, values = [], []
    for group in np.array_split(active, -(-len(active) // _SUBSET_ROWS_PER_GROUP)):
        rows, columns = _smallest_keys(population[group], sizes[group], rng)
        segments.append(group[rows])
        values.append(columns)
    segments, values = np.concatenate(segments), np.concatenate(values)
    return values[np.lexsort((values, segments))]


_SUBSET_ROWS_PER_GROUP = 256


def _smallest_keys(population: np.ndarray, sizes: np.ndarray, rng: np.random.Generator):
    """(row, column) of the ``sizes[row]`` smallest of ``population[row]`` uniform keys, for every row."""
    width = int(population.max())
    outside = np.arange(width) >= population[:, None]
    rows_left = np.arange(len(population))
    chosen_rows, chosen_columns = [], []
    while len(rows_left):
        keys = rng.random((len(rows_left), width), dtype=np.float32)
        keys[outside[rows_left]] = 2.0  # past the population: never among the smallest
        threshold = np.sort(keys, axis=1)[np.arange(len(rows_left)), sizes[rows_left] - 1]
        selected = keys <= threshold[:, None]
        # float32 keys can tie at the threshold; such a row selects too many and draws again (rare, and
        # symmetric in the elements, so the accepted subsets stay uniform).
        exact = selected.sum(axis=1) == sizes[rows_left]
        rows, columns = np.nonzero(selected[exact])
        chosen_rows.append(rows_left[exact][rows])
        chosen_columns.append(columns)
        rows_left = rows_left[~exact]
    return np.concatenate(chosen_rows), np.concatenate(chosen_columns).astype(np.int64)


def noise_span_bounds(
    lengths: np.ndarray,
    num_noise: np.ndarray,
    num_spans: np.ndarray,
    rng: np.random.Generator,
    *,
    t5_placement: np.ndarray | bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive) of every noise span, concatenated over examples, in each example's coordinates.

    Noise tokens are split into ``num_spans`` non-empty spans at a uniform random composition; span ``j`` is put
    after ``g_j`` non-noise tokens, with ``g_0 < g_1 < ...`` a uniform random subset of ``0..M`` (``M`` non-noise
    tokens), or with T5's placement a subset of ``1..M-1`` and the last span at the end.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    num_noise = np.asarray(num_noise, dtype=np.int64)
    num_spans = np.asarray(num_spans, dtype=np.int64)
    t5_placement = np.broadcast_to(np.asarray(t5_placement, dtype=bool), lengths.shape)
    num_nonnoise = lengths - num_noise
    total_spans = int(num_spans.sum())
    span_offsets = np.cumsum(num_spans) - num_spans
    has_spans = num_spans > 0
    first_slot = np.zeros(total_spans, dtype=bool)
    first_slot[span_offsets[has_spans]] = True
    last_slot = np.zeros(total_spans, dtype=bool)
    last_slot[(span_offsets + num_spans - 1)[has_spans]] = True

    # Noise before span j (exclusive) and through span j: a random composition of num_noise into num_spans parts.
    cuts = sorted_random_subsets(np.maximum(num_noise - 1, 0), np.maximum(num_spans - 1, 0), rng) + 1
    noise_before = np.empty(total_spans, dtype=np.int64)
    noise_before[first_slot] = 0
    noise_before[~first_slot] = cuts
    noise_through = np.empty(total_spans, dtype=np.int64)
    noise_through[last_slot] = num_noise[has_spans]
    noise_through[~last_slot] = cuts

    # Non-noise tokens before span j.
    population = np.where(t5_placement, np.maximum(num_nonnoise - 1, 0), num_nonnoise + 1)
    drawn = np.where(t5_placement, np.maximum(num_spans - 1, 0), num_spans)
    gaps = sorted_random_subsets(population, drawn, rng)
    span_is_t5 = np.repeat(t5_placement, num_spans)
    fixed_last = last_slot & span_is_t5
    nonnoise_before = np.empty(total_spans, dtype=np.int64)
    nonnoise_before[fixed_last] = np.repeat(num_nonnoise, num_spans)[fixed_last]
    nonnoise_before[~fixed_last] = gaps + span_is_t5[~fixed_last]
    return nonnoise_before + noise_before, nonnoise_before + noise_through


def random_spans_noise_mask(
    length: int,
    noise_density: float,
    mean_noise_span_length: float,
    rng: np.random.Generator,
    *,
    max_spans: int | None = None,
    placement: str = "t5",
    span_count_rounding: str = "nearest",
) -> np.ndarray:
    """Boolean noise mask of one sequence, T5's ``random_spans_noise_mask`` by default (see the module doc)."""
    lengths = np.array([length], dtype=np.int64)
    noise = num_noise_tokens(lengths, noise_density)
    spans = num_noise_spans(
        noise,
        lengths,
        mean_noise_span_length,
        max_spans=max_spans,
        placement=placement,
        rounding=span_count_rounding,
        uniform=rng.random(1),
    )
    starts, ends = noise_span_bounds(lengths, noise, spans, rng, t5_placement=placement == "t5")
    delta = np.bincount(starts, minlength=length + 1) - np.bincount(ends, minlength=length + 1)
    return np.cumsum(delta)[:length] > 0


class UL2Objective:
    """The UL2 denoising objective bound to a vocabulary: plans and writes (inputs, targets) for many examples.

    Args:
        mixture: the denoisers and their proportions (default: the FAT5 recipe).
        sentinel_ids: token ids of ``<extra_id_0>, <extra_id_1>, ...`` in that order.
        prefix_ids: mode token -> id, for every prefix the mixture uses.
        eos_id: the EOS id appended to inputs and targets.
        max_input_length: most input tokens per example (mode prefix and EOS included).
        max_target_length: most target tokens per example (EOS included); None: no limit.
        placement / span_count_rounding: see the module doc (``"t5"`` / ``"nearest"`` is T5 exactly).
        min_length: pieces of a source shorter than this are dropped when long sources are split.
    """

    def __init__(
        self,
        mixture: UL2Mixture | None = None,
        *,
        sentinel_ids: Sequence[int],
        prefix_ids: Mapping[str, int],
        eos_id: int,
        max_input_length: int = 512,
        max_target_length: int | None = None,
        placement: str = "uniform",
        span_count_rounding: str = "stochastic",
        min_length: int = 2,
    ):
        self.mixture = mixture if mixture is not None else UL2Mixture.default()
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if span_count_rounding not in SPAN_COUNT_ROUNDINGS:
            raise ValueError(f"span_count_rounding must be one of {SPAN_COUNT_ROUNDINGS}, got {span_count_rounding!r}")
        self.sentinel_ids = np.asarray(sentinel_ids, dtype=np.int64)
        if self.sentinel_ids.ndim != 1 or len(self.sentinel_ids) == 0:
            raise ValueError("sentinel_ids must be a non-empty 1-D list of token ids (<extra_id_0>, <extra_id_1>, ...)")
        missing = [p for p in self.mixture.prefixes if p not in prefix_ids]
        if missing:
            raise ValueError(f"no token id for the mode prefixes {missing}; give them in prefix_ids")
        if max_input_length < 3:
            raise ValueError(f"max_input_length must be >= 3 (prefix, a token, EOS), got {max_input_length}")
        if max_target_length is not None and max_target_length < 3:
            raise ValueError(f"max_target_length must be >= 3 or None, got {max_target_length}")
        self.prefix_ids = dict(prefix_ids)
        self.eos_id = int(eos_id)
        self.max_input_length = int(max_input_length)
        self.max_target_length = None if max_target_length is None else int(max_target_length)
        self.placement = placement
        self.span_count_rounding = span_count_rounding
        self.min_length = max(int(min_length), 1)
        denoisers = self.mixture.denoisers
        self._proportions = np.asarray(self.mixture.proportions, dtype=np.float64)
        self._is_prefix_lm = np.array([d.kind == "prefix_lm" for d in denoisers])
        self._prefix_token = np.array([self.prefix_ids[d.prefix] for d in denoisers], dtype=np.int64)
        self._max_spans = [
            min(d.max_spans or len(self.sentinel_ids), len(self.sentinel_ids)) if d.kind == "span" else 1
            for d in denoisers
        ]
        # Longest source slice each span denoiser takes so that even the largest span count fits the limits.
        self._span_raw_limit = np.array(
            [self._largest_fitting_length(i) if d.kind == "span" else 0 for i, d in enumerate(denoisers)]
        )

    @classmethod
    def from_tokenizer(cls, tokenizer, mixture: UL2Mixture | None = None, **kwargs) -> UL2Objective:
        """Take sentinels, mode prefixes and EOS from a tokenizer (see :mod:`fat5.trainer.tokenizer`)."""
        from .tokenizer import prefix_token_ids, sentinel_token_ids

        mixture = mixture if mixture is not None else UL2Mixture.default()
        return cls(
            mixture,
            sentinel_ids=sentinel_token_ids(tokenizer),
            prefix_ids=prefix_token_ids(tokenizer, mixture.prefixes),
            eos_id=tokenizer.eos_token_id,
            **kwargs,
        )

    @property
    def max_source_length(self) -> int:
        """The longest slice of a source that any denoiser may take in one example."""
        longest = [
            self._largest_fitting_length(i, np.array([d.target_range[1]]))[0] if d.kind == "prefix_lm" else limit
            for i, (d, limit) in enumerate(zip(self.mixture.denoisers, self._span_raw_limit))
        ]
        return int(max(longest))

    def _lengths_for(self, index: int, lengths: np.ndarray, draws: np.ndarray | None):
        """(num_noise, num_spans) of denoiser ``index`` on sequences of ``lengths``; draws None: largest count."""
        denoiser = self.mixture.denoisers[index]
        if denoiser.kind == "prefix_lm":
            # For a prefix LM the draw is the target fraction itself.
            noise = num_noise_tokens(lengths, draws)
            return noise, (noise > 0).astype(np.int64)
        noise = num_noise_tokens(lengths, denoiser.noise_density)
        spans = num_noise_spans(
            noise,
            lengths,
            denoiser.mean_span_length,
            max_spans=self._max_spans[index],
            placement=self.placement,
            rounding=self.span_count_rounding,
            uniform=draws,
        )
        return noise, spans

    def output_lengths(self, index: int, lengths: np.ndarray, num_noise: np.ndarray, num_spans: np.ndarray):
        """(input_length, target_length) of denoiser ``index``'s examples, prefix and EOS included."""
        sentinels = 0 if self._is_prefix_lm[index] else num_spans
        return lengths - num_noise + sentinels + 2, num_noise + sentinels + 1

    def _fits(self, index: int, lengths: np.ndarray, draws: np.ndarray | None) -> np.ndarray:
        noise, spans = self._lengths_for(index, lengths, draws)
        inputs, targets = self.output_lengths(index, lengths, noise, spans)
        fits = inputs <= self.max_input_length
        if self.max_target_length is not None:
            fits &= targets <= self.max_target_length
        return fits

    def _largest_fitting_length(self, index: int, draws: np.ndarray | None = None, upper=None) -> np.ndarray | int:
        """Largest source length whose example fits the limits (output lengths grow with the source length).

        ``draws`` None: a span denoiser at its largest span count; else a prefix LM at these target fractions.
        """
        # A source of L tokens gives at least about (1 - r) L input tokens: search up to where it surely overflows.
        fraction = self.mixture.denoisers[index].noise_density if draws is None else float(draws.max())
        cap = int(self.max_input_length / max(1.0 - fraction, 1e-3)) + 4
        shape = () if draws is None else draws.shape
        low = np.zeros(shape, dtype=np.int64)  # always fits
        high = np.full(shape, cap, dtype=np.int64) if upper is None else np.asarray(upper, dtype=np.int64) + 1
        while (high - low > 1).any():
            middle = (low + high) // 2
            fits = self._fits(index, np.atleast_1d(middle), None if draws is None else np.atleast_1d(draws))
            fits = fits.reshape(middle.shape)
            low = np.where(fits, middle, low)
            high = np.where(fits, high, middle)
        return int(low) if draws is None else low

    def plan(
        self,
        lengths: Sequence[int] | np.ndarray,
        rng: np.random.Generator,
        *,
        split_long: bool = False,
        denoiser: np.ndarray | None = None,
    ) -> UL2Plan:
        """Choose a denoiser and the noise/span counts for each source sequence of ``lengths`` tokens.

        A source longer than its denoiser allows is truncated (``split_long=False``: one example per source) or
        cut into consecutive examples, each with its own denoiser, that fill the input length
        (``split_long=True``). ``denoiser`` forces the denoiser index of each source (no splitting then).
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or (lengths < 0).any():
            raise ValueError("lengths must be a 1-D array of non-negative token counts")
        if denoiser is not None and split_long:
            raise ValueError("denoiser can only be forced with split_long=False")
        pieces = []
        source = np.arange(len(lengths), dtype=np.int64)
        start = np.zeros(len(lengths), dtype=np.int64)
        while len(source):
            remaining = lengths[source] - start
            chosen = (
                np.asarray(denoiser, dtype=np.int64)
                if denoiser is not None
                else rng.choice(len(self._proportions), size=len(source), p=self._proportions)
            )
            draws = rng.random(len(source))
            taken, noise, spans = self._taken_noise_and_spans(chosen, draws, remaining)
            # An empty source still gives one (empty) example unless sources are being split.
            keep = taken > 0 if split_long else np.ones(len(source), dtype=bool)
            pieces.append((source[keep], start[keep], taken[keep], chosen[keep], noise[keep], spans[keep]))
            if not split_long:
                break
            start = start + taken
            more = (start < lengths[source]) & (taken > 0) & (lengths[source] - start >= self.min_length)
            source, start = source[more], start[more]
        return self._sorted_plan(pieces)

    def _taken_noise_and_spans(
        self, chosen: np.ndarray, draws: np.ndarray, remaining: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each source, under its ``chosen`` denoiser and uniform ``draws``: the source tokens the example takes
        (at most ``remaining``), its noise tokens and its noise spans."""
        noise = np.zeros(len(draws), dtype=np.int64)
        spans = np.zeros(len(draws), dtype=np.int64)
        taken = np.zeros(len(draws), dtype=np.int64)
        for index in np.unique(chosen):
            rows = np.flatnonzero(chosen == index)
            spec = self.mixture.denoisers[index]
            if spec.kind == "prefix_lm":
                low, high = spec.target_range
                fraction = low + (high - low) * draws[rows]
                taken[rows] = self._largest_fitting_length(index, fraction, upper=remaining[rows])
                noise[rows], spans[rows] = self._lengths_for(index, taken[rows], fraction)
            else:
                taken[rows] = np.minimum(remaining[rows], self._span_raw_limit[index])
                noise[rows], spans[rows] = self._lengths_for(index, taken[rows], draws[rows])
        return taken, noise, spans

    def _sorted_plan(self, pieces: list[tuple[np.ndarray, ...]]) -> UL2Plan:
        """The plan of the examples in ``pieces`` (one tuple of columns per round), ordered by source then start,
        with the input and target lengths they pack to."""
        columns = [np.concatenate(column) for column in zip(*pieces)]
        plan = UL2Plan(*columns)
        order = np.lexsort((plan.start, plan.source))
        plan = plan.select(order)
        plan.input_length = np.empty(len(plan), dtype=np.int64)
        plan.target_length = np.empty(len(plan), dtype=np.int64)
        for index in np.unique(plan.denoiser):
            rows = plan.denoiser == index
            plan.input_length[rows], plan.target_length[rows] = self.output_lengths(
                index, plan.length[rows], plan.num_noise[rows], plan.num_spans[rows]
            )
        return plan

    def realize(self, tokens: np.ndarray, plan: UL2Plan, rng: np.random.Generator) -> CorruptedBatch:
        """Write inputs and targets of planned examples whose source tokens are concatenated in ``tokens``.

        ``tokens`` holds, for each example in order, its ``plan.length`` tokens (the planned slice of its source).
        """
        tokens = np.asarray(tokens)
        lengths = plan.length
        total = int(lengths.sum())
        if tokens.shape != (total,):
            raise ValueError(f"tokens must be 1-D with sum(plan.length) = {total} entries, got shape {tokens.shape}")
        if (plan.num_spans > len(self.sentinel_ids)).any():
            raise ValueError(f"an example has more noise spans than the {len(self.sentinel_ids)} sentinels")
        n = len(plan)
        is_prefix_lm = self._is_prefix_lm[plan.denoiser]
        t5_placement = is_prefix_lm | (self.placement == "t5")
        starts, ends = noise_span_bounds(lengths, plan.num_noise, plan.num_spans, rng, t5_placement=t5_placement)
        token_offsets = np.cumsum(lengths) - lengths
        span_example = np.repeat(np.arange(n), plan.num_spans)
        starts += token_offsets[span_example]
        ends += token_offsets[span_example]
        noise = np.cumsum(np.bincount(starts, minlength=total + 1) - np.bincount(ends, minlength=total + 1))[:total] > 0

        # A sentinel replaces each span of a span denoiser: its first noise token becomes the sentinel.
        with_sentinel = ~is_prefix_lm[span_example]
        span_index = np.arange(len(starts)) - np.repeat(np.cumsum(plan.num_spans) - plan.num_spans, plan.num_spans)
        sentinel_at = starts[with_sentinel]
        sentinel_token = self.sentinel_ids[span_index[with_sentinel]]
        example_of_token = np.repeat(np.arange(n), lengths)

        keep = ~noise
        keep[sentinel_at] = True
        input_body = np.where(noise, 0, tokens)
        input_body[sentinel_at] = sentinel_token
        kept = input_body[keep]
        kept_example = example_of_token[keep]
        # Each earlier example adds its prefix and EOS; each example's own prefix comes first.
        inputs = np.empty(len(kept) + 2 * n, dtype=np.int64)
        input_lengths = np.bincount(kept_example, minlength=n) + 2
        input_offsets = np.concatenate([[0], np.cumsum(input_lengths)])
        inputs[np.arange(len(kept)) + 2 * kept_example + 1] = kept
        inputs[input_offsets[:-1]] = self._prefix_token[plan.denoiser]
        inputs[input_offsets[1:] - 1] = self.eos_id

        # Targets: every noise token, preceded by the sentinel where its span starts, then EOS.
        emitted = noise.astype(np.int64)
        emitted[sentinel_at] += 1
        body = np.repeat(tokens, emitted).astype(np.int64)
        body[(np.cumsum(emitted) - emitted)[sentinel_at]] = sentinel_token
        body_example = np.repeat(example_of_token, emitted)
        targets = np.empty(len(body) + n, dtype=np.int64)
        target_lengths = np.bincount(body_example, minlength=n) + 1
        target_offsets = np.concatenate([[0], np.cumsum(target_lengths)])
        targets[np.arange(len(body)) + body_example] = body
        targets[target_offsets[1:] - 1] = self.eos_id
        return CorruptedBatch(inputs, input_offsets, targets, target_offsets, plan.denoiser.copy())

    def __call__(self, sequences: Sequence[Sequence[int]], rng: np.random.Generator) -> tuple[CorruptedBatch, UL2Plan]:
        """Plan and realize one example per sequence (sequences longer than allowed are truncated)."""
        arrays = [np.asarray(s, dtype=np.int64) for s in sequences]
        plan = self.plan(np.array([len(a) for a in arrays], dtype=np.int64), rng)
        tokens = gather_slices(arrays, plan)
        return self.realize(tokens, plan, rng), plan


def gather_slices(arrays: Sequence[np.ndarray], plan: UL2Plan) -> np.ndarray:
    """Concatenate ``arrays[plan.source[i]][plan.start[i]:plan.start[i] + plan.length[i]]`` over the plan."""
    if len(plan) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(
        [arrays[s][b : b + n] for s, b, n in zip(plan.source.tolist(), plan.start.tolist(), plan.length.tolist())]
    )
