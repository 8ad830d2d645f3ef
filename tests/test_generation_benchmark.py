"""benchmarks/generation.py's tiny mode, run as a user runs it (`fat5 bench generation --tiny`): the grid, then
`--long --append` into the same file; the result file holds every row and the ids agree with transformers' T5."""

import json

import pytest

from fat5.cli import main

IMPLEMENTATIONS = ["fat5", "transformers-static", "transformers-dynamic"]
TIMINGS = ["tokens_per_second", "ms_per_step", "decode_ms_per_step", "time_to_first_token_ms", "first_call_s"]


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("generation") / "generation.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        assert main(["bench", "generation", "--tiny", "--out", str(out)]) == 0
        assert main(["bench", "generation", "--tiny", "--long", "--long-transformers", "--no-exactness", "--append",
                     "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


def test_every_grid_row_is_measured_and_fat5_decodes_transformers_ids(tiny_result):
    _, document = tiny_result
    grid = document["results"]["grid"]
    shapes = {(row["batch"], row["input_length"]) for row in grid}
    assert len(shapes) > 1
    assert sorted((row["implementation"], row["batch"], row["input_length"]) for row in grid) == sorted(
        (name, batch, length) for name in IMPLEMENTATIONS for batch, length in shapes)
    for row in grid:
        assert "error" not in row, row
        assert all(row[timing] > 0 for timing in TIMINGS), row
        assert row["run"] == 0
    # a tiny fp32 model on the CPU has no near ties for rounding to flip: transformers' ids are the truth
    for row in grid:
        if row["implementation"] != "transformers-static":
            assert row["ids_compared_with"] == "transformers-static"
            assert (row["equal_token_fraction"], row["first_divergent_step"]) == (1.0, None), row
    exactness = document["results"]["fp32_exactness"]
    assert exactness["ids_equal"] and exactness["max_logit_difference"] < 1e-4


def test_ratios_are_fat5_over_transformers_of_the_same_shape(tiny_result):
    _, document = tiny_result
    speed = {(row["implementation"], row["batch"], row["input_length"]): row["tokens_per_second"]
             for row in document["results"]["grid"]}
    ratios = document["results"]["ratios"]
    assert len(ratios) == len(speed) // len(IMPLEMENTATIONS)
    for entry in ratios:
        shape = (entry["batch"], entry["input_length"])
        for peer in ("transformers-static", "transformers-dynamic"):
            assert entry[f"fat5 / {peer}"] == pytest.approx(speed[("fat5", *shape)] / speed[(peer, *shape)], rel=1e-3)


def test_the_long_input_run_is_appended_with_its_own_environment(tiny_result):
    out, document = tiny_result
    long = document["results"]["long"]
    assert [row["implementation"] for row in long] == ["fat5", "transformers-dynamic"]
    assert all(row["batch"] == 1 and row["input_length"] == 64 and row["run"] == 1 for row in long)
    assert all("error" not in row and row["tokens_per_second"] > 0 for row in long)
    assert [("--long" in run["command"]) for run in document["runs"]] == [False, True]
    assert document["results"]["fp32_exactness"] is not None  # the first run's check is kept
    assert out.with_suffix(".png").stat().st_size > 0
