"""UL2 denoisers: T5 span-corruption semantics, statistics over 20k examples, exact reconstruction, edge cases."""

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fat5.trainer.ul2 import (
    Denoiser,
    UL2Mixture,
    UL2Objective,
    gather_slices,
    random_spans_noise_mask,
    sorted_random_subsets,
)

VOCAB = 5000
NUM_SENTINELS = 256
SENTINELS = np.arange(VOCAB - 1, VOCAB - 1 - NUM_SENTINELS, -1)  # <extra_id_0> is the highest id, as in T5
PREFIXES = {"[R]": 3, "[S]": 4, "[X]": 5}
EOS = 1


def make_objective(mixture=None, **kwargs):
    return UL2Objective(mixture, sentinel_ids=SENTINELS, prefix_ids=PREFIXES, eos_id=EOS, **kwargs)


def reconstruct(inputs, targets, prefix_id):
    """Independent inverse of span corruption: put each target span back in place of its sentinel."""
    inputs, targets = list(inputs), list(targets)
    assert inputs[0] == prefix_id and inputs[-1] == EOS and targets[-1] == EOS
    inputs, targets = inputs[1:-1], targets[:-1]
    sentinel_index = {int(s): i for i, s in enumerate(SENTINELS)}
    in_sentinels = [sentinel_index[t] for t in inputs if t in sentinel_index]
    tg_sentinels = [sentinel_index[t] for t in targets if t in sentinel_index]
    assert in_sentinels == list(range(len(in_sentinels))), "input sentinels out of order"
    assert tg_sentinels == in_sentinels, "target sentinels do not match the input ones"
    if not in_sentinels:  # prefix LM: the target continues the input
        return inputs + targets, 1 if targets else 0
    spans, current = [], None
    for t in targets:
        if t in sentinel_index:
            current = []
            spans.append(current)
        else:
            assert current is not None, "target does not start with a sentinel"
            current.append(t)
    assert all(spans), "empty noise span"
    out = []
    for t in inputs:
        out.extend(spans[sentinel_index[t]] if t in sentinel_index else [t])
    return out, len(spans)


@pytest.fixture(scope="module")
def twenty_thousand():
    objective = make_objective(max_input_length=1024)
    rng = np.random.default_rng(1234)
    sources = [rng.integers(6, VOCAB - NUM_SENTINELS, size=1022) for _ in range(20_000)]
    corrupted, plan = objective(sources, rng)
    return objective, sources, corrupted, plan


def test_mode_frequencies_match_proportions(twenty_thousand):
    objective, _, corrupted, _ = twenty_thousand
    proportions = np.array(objective.mixture.proportions)
    frequencies = np.bincount(corrupted.denoiser, minlength=len(proportions)) / len(corrupted)
    assert np.abs(frequencies - proportions).max() <= 0.01, frequencies
    # The mode token written in the inputs agrees with the denoiser drawn.
    first_tokens = corrupted.inputs[corrupted.input_offsets[:-1]]
    by_prefix = Counter(first_tokens.tolist())
    expected = Counter()
    for d, p in zip(objective.mixture.denoisers, proportions):
        expected[PREFIXES[d.prefix]] += p
    for token, p in expected.items():
        assert abs(by_prefix[token] / len(corrupted) - p) <= 0.01


def test_noise_density_and_span_length_per_denoiser(twenty_thousand):
    objective, _, corrupted, _ = twenty_thousand
    is_sentinel_in = np.isin(corrupted.inputs, SENTINELS)
    is_sentinel_tg = np.isin(corrupted.targets, SENTINELS)
    n = len(corrupted)
    input_example = np.repeat(np.arange(n), np.diff(corrupted.input_offsets))
    target_example = np.repeat(np.arange(n), np.diff(corrupted.target_offsets))
    spans = np.bincount(input_example[is_sentinel_in], minlength=n)
    # Measured from the outputs: noise = target tokens that are neither sentinel nor EOS.
    noise = np.diff(corrupted.target_offsets) - 1 - np.bincount(target_example[is_sentinel_tg], minlength=n)
    source_length = 1022
    for index, denoiser in enumerate(objective.mixture.denoisers):
        rows = corrupted.denoiser == index
        density = (noise[rows] / source_length).mean()
        assert density == pytest.approx(denoiser.mean_noise_density, rel=0.05), denoiser.name
        if denoiser.kind == "span":
            mean_span = noise[rows].sum() / spans[rows].sum()
            assert mean_span == pytest.approx(denoiser.mean_span_length, rel=0.05), denoiser.name
        else:
            assert spans[rows].sum() == 0 and (noise[rows] >= 1).all()


def test_inputs_and_targets_reconstruct_the_source(twenty_thousand):
    objective, sources, corrupted, plan = twenty_thousand
    prefix_of = [PREFIXES[d.prefix] for d in objective.mixture.denoisers]
    for i in range(len(corrupted)):
        inputs, targets = corrupted.example(i)
        restored, num_spans = reconstruct(inputs, targets, prefix_of[corrupted.denoiser[i]])
        assert restored == sources[i][: plan.length[i]].tolist()
        assert num_spans == plan.num_spans[i]


def test_no_example_exceeds_the_length_limits(twenty_thousand):
    _, sources, corrupted, plan = twenty_thousand
    assert np.diff(corrupted.input_offsets).max() <= 1024
    assert (np.diff(corrupted.input_offsets) == plan.input_length).all()
    assert (np.diff(corrupted.target_offsets) == plan.target_length).all()
    # With a target limit too: sources are cut so that every example fits both limits, and still reconstructs.
    limited = make_objective(max_input_length=512, max_target_length=128)
    rng = np.random.default_rng(7)
    corrupted, plan = limited(sources[:3000], rng)
    assert np.diff(corrupted.input_offsets).max() <= 512
    assert np.diff(corrupted.target_offsets).max() <= 128
    prefix_of = [PREFIXES[d.prefix] for d in limited.mixture.denoisers]
    for i in range(0, 3000, 7):
        restored, _ = reconstruct(*corrupted.example(i), prefix_of[corrupted.denoiser[i]])
        assert restored == sources[i][: plan.length[i]].tolist()


def enumerate_masks(length, num_noise, num_spans, t5_placement):
    """Every mask of `length` with `num_noise` noise tokens in exactly `num_spans` runs (T5: first token kept,
    last token noise)."""
    masks = []
    for noise_positions in itertools.combinations(range(length), num_noise):
        mask = np.zeros(length, dtype=bool)
        mask[list(noise_positions)] = True
        runs = int(mask[0]) + int(np.sum(mask[1:] & ~mask[:-1]))
        if runs != num_spans:
            continue
        if t5_placement and (mask[0] or not mask[-1]):
            continue
        masks.append(tuple(mask.tolist()))
    return masks


@pytest.mark.parametrize("placement", ["t5", "uniform"])
def test_noise_mask_is_uniform_over_valid_masks(placement):
    # length 9, r = 1/3, mu = 1.5: T5 gives 3 noise tokens in round(3 / 1.5) = 2 spans.
    length, r, mu = 9, 1 / 3, 1.5
    valid = enumerate_masks(length, 3, 2, placement == "t5")
    rng = np.random.default_rng(0)
    draws = 20_000
    counts = Counter(
        tuple(random_spans_noise_mask(length, r, mu, rng, placement=placement).tolist()) for _ in range(draws)
    )
    assert set(counts) == set(valid), "a mask outside T5's constraints, or a valid mask never drawn"
    expected = draws / len(valid)
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    # 99.9% quantile of chi-square with len(valid) - 1 degrees of freedom is well below 2 * dof + 40.
    assert chi2 < 2 * (len(valid) - 1) + 40, chi2


def test_t5_counts_and_placement():
    rng = np.random.default_rng(3)
    for length in [2, 3, 10, 31, 100, 570]:
        for r, mu in [(0.15, 3.0), (0.5, 3.0), (0.15, 64.0)]:
            mask = random_spans_noise_mask(length, r, mu, rng)
            expected_noise = min(max(int(np.rint(length * r)), 1), length - 1)
            expected_spans = max(int(np.rint(expected_noise / mu)), 1)
            assert mask.sum() == expected_noise
            assert int(mask[0]) + int(np.sum(mask[1:] & ~mask[:-1])) == expected_spans
            assert not mask[0] and mask[-1]
    assert random_spans_noise_mask(1, 0.15, 3.0, rng).tolist() == [False]
    assert random_spans_noise_mask(0, 0.15, 3.0, rng).shape == (0,)


def test_short_sources_and_edge_cases():
    objective = make_objective(max_input_length=64)
    rng = np.random.default_rng(5)
    prefix_of = [PREFIXES[d.prefix] for d in objective.mixture.denoisers]
    for index, denoiser in enumerate(objective.mixture.denoisers):
        for length in range(40):
            source = rng.integers(6, 100, size=length)
            forced = np.array([index])
            plan = objective.plan(np.array([length]), rng, denoiser=forced)
            corrupted = objective.realize(gather_slices([source], plan), plan, rng)
            inputs, targets = corrupted.example(0)
            restored, num_spans = reconstruct(inputs, targets, prefix_of[index])
            assert restored == source.tolist()
            if length < 2:
                assert num_spans == 0 and targets.tolist() == [EOS]
            elif denoiser.kind == "span":
                assert num_spans >= 1 and plan.num_noise[0] <= length - 1
            else:
                # S-denoiser: inputs are a prefix of the source, targets its continuation, no sentinel.
                cut = len(inputs) - 2
                assert 1 <= cut <= length - 1
                assert targets[:-1].tolist() == source[cut:].tolist()


def test_span_count_is_capped_by_sentinels_and_max_spans():
    mixture = UL2Mixture((Denoiser("[X]", 0.5, 3.0, max_spans=10),), (1.0,))
    objective = make_objective(mixture, max_input_length=2048)
    rng = np.random.default_rng(0)
    corrupted, plan = objective([rng.integers(6, 100, size=1000)], rng)
    assert plan.num_spans[0] == 10 and np.isin(corrupted.inputs, SENTINELS).sum() == 10
    few = UL2Objective(
        UL2Mixture((Denoiser("[X]", 0.5, 3.0),), (1.0,)),
        sentinel_ids=SENTINELS[:5],
        prefix_ids=PREFIXES,
        eos_id=EOS,
        max_input_length=2048,
    )
    corrupted, plan = few([rng.integers(6, 100, size=1000)], rng)
    assert plan.num_spans[0] == 5
    restored, _ = reconstruct(*corrupted.example(0), 5)
    assert len(restored) == 1000


def test_split_long_sources_covers_them_in_order():
    objective = make_objective(max_input_length=256)
    rng = np.random.default_rng(11)
    lengths = np.array([5000, 3, 700, 256, 0])
    plan = objective.plan(lengths, rng, split_long=True)
    for source, length in enumerate(lengths):
        pieces = plan.source == source
        starts, sizes = plan.start[pieces], plan.length[pieces]
        assert (starts == np.concatenate([[0], np.cumsum(sizes)[:-1]])).all()
        assert length - sizes.sum() < objective.min_length
    assert plan.input_length.max() <= 256
    # Long sources give pieces that fill the inputs (prefix and EOS included) to within a few tokens.
    full = plan.length < lengths[plan.source] - plan.start
    assert (plan.input_length[full] >= 256 - 4).all()


def test_deterministic_under_a_seed():
    objective = make_objective(max_input_length=128)
    sources = [np.arange(6, 6 + n) for n in (10, 50, 126, 300)]
    first, _ = objective(sources, np.random.default_rng(42))
    second, _ = objective(sources, np.random.default_rng(42))
    other, _ = objective(sources, np.random.default_rng(43))
    assert np.array_equal(first.inputs, second.inputs) and np.array_equal(first.targets, second.targets)
    assert not (np.array_equal(first.inputs, other.inputs) and np.array_equal(first.denoiser, other.denoiser))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), min_size=1, max_size=20), st.integers(0, 2**32))
def test_sorted_random_subsets(pairs, seed):
    population = np.array([max(a, b) for a, b in pairs])
    sizes = np.array([min(a, b) for a, b in pairs])
    values = sorted_random_subsets(population, sizes, np.random.default_rng(seed))
    assert len(values) == sizes.sum()
    offset = 0
    for n, s in zip(population, sizes):
        chunk = values[offset : offset + s]
        offset += s
        assert (np.diff(chunk) > 0).all() and (chunk >= 0).all() and (chunk < n).all()


def test_default_mixture_is_the_fat5_recipe():
    mixture = UL2Mixture.default()
    assert mixture.proportions == (0.165, 0.165, 0.34, 0.0825, 0.0825, 0.0825, 0.0825)
    spans = [(d.prefix, d.mean_span_length, d.noise_density) for d in mixture.denoisers if d.kind == "span"]
    assert spans == [
        ("[R]", 3.0, 0.15),
        ("[R]", 8.0, 0.15),
        ("[X]", 3.0, 0.5),
        ("[X]", 8.0, 0.15),
        ("[X]", 64.0, 0.15),
        ("[X]", 64.0, 0.5),
    ]
    s_denoiser = mixture.denoisers[2]
    assert (s_denoiser.prefix, s_denoiser.kind, s_denoiser.mean_noise_density) == ("[S]", "prefix_lm", 0.25)


def test_seed_style_config_and_bad_configs():
    seed_style = {
        "denoisers": [
            {"mu": 3.0, "r": 0.15, "max_spans": 1024, "prefix": "[R]"},
            {"mu": 4.0, "r": 0.0, "max_spans": 1, "prefix": "[S]"},
        ],
        "denoiser_proportions": [0.5, 0.5],
    }
    mixture = UL2Mixture.from_config(seed_style)
    assert mixture.denoisers[1].kind == "prefix_lm" and mixture.denoisers[0].max_spans == 1024
    with pytest.raises(ValueError, match="sum to 1"):
        UL2Mixture.from_config({**seed_style, "denoiser_proportions": [0.5, 0.6]})
    with pytest.raises(ValueError, match="noise_density"):
        Denoiser("[X]", 1.0, 3.0)
    with pytest.raises(ValueError, match="prefix_lm"):
        Denoiser("[X]", 0.0, 3.0, kind="span")
    with pytest.raises(ValueError, match="unknown denoiser fields"):
        Denoiser.from_dict({"prefix": "[R]", "r": 0.15, "sigma": 2})
    with pytest.raises(ValueError, match="mode prefixes"):
        UL2Objective(mixture, sentinel_ids=SENTINELS, prefix_ids={"[R]": 3}, eos_id=EOS)
