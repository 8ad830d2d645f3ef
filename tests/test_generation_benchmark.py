"""benchmarks/generation.py's tiny mode, run as a user runs it (`fat5 bench generation --tiny`): the grid and the long
input in two calls, then `--merge` of their files; the merged file holds every row, and the ids agree with
transformers' T5."""

import json

import pytest

from fat5.cli import main

IMPLEMENTATIONS = ["fat5", "transformers-static", "transformers-dynamic"]
# positive whatever the host's noise (a decoding step is the timed call's wall less the time to first token: on a busy
# CPU with 4 new tokens the difference can fall below zero, so that one is only required to be there)
TIMINGS = ["tokens_per_second", "ms_per_step", "time_to_first_token_ms", "first_call_s"]


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        assert main(["bench", "generation", "--tiny", "--bandwidth-tb-s", "0.05",
                     "--out", str(folder / "grid.json")]) == 0
        assert main(["bench", "generation", "--tiny", "--long", "--long-transformers", "--no-exactness",
                     "--count-kernels", "--out", str(folder / "long.json")]) == 0
    assert main(["bench", "generation", "--merge", str(folder / "grid.json"), str(folder / "long.json"),
                 "--out", str(folder / "merged.json")]) == 0
    return folder / "merged.json", json.loads((folder / "merged.json").read_text())


def test_every_grid_row_is_measured_and_fat5_decodes_transformers_ids(tiny_result):
    _, document = tiny_result
    grid = document["results"]["grid"]
    shapes = {(row["batch"], row["input_length"]) for row in grid}
    assert len(shapes) > 1
    assert sorted((row["implementation"], row["batch"], row["input_length"]) for row in grid) == sorted(
        (name, batch, length) for name in IMPLEMENTATIONS for batch, length in shapes)
    for row in grid:
        assert "error" not in row, row
        assert all(row[timing] > 0 for timing in TIMINGS) and isinstance(row["decode_ms_per_step"], float), row
        assert row["run"] == 0
    # a tiny fp32 model on the CPU has no near ties for rounding to flip: transformers' ids are the truth
    for row in grid:
        if row["implementation"] != "transformers-static":
            assert row["ids_compared_with"] == "transformers-static"
            assert (row["equal_token_fraction"], row["first_divergent_step"]) == (1.0, None), row
    exactness = document["results"]["fp32_exactness"]
    assert exactness["ids_equal"] and exactness["max_logit_difference"] < 1e-4


def test_each_row_says_its_bandwidth_floor(tiny_result):
    """The grid ran with a given bandwidth: every row has its floor, the time its bytes take at that pace; the long
    input's run had none (a CPU measures no bandwidth), so its rows say their bytes only."""
    _, document = tiny_result
    for row in document["results"]["grid"]:
        assert row["floor_ms"] == pytest.approx(row["step_mb"] * 1e6 / 0.05e12 * 1e3, rel=1e-2), row
        if row["decode_ms_per_step"] > 0:
            assert row["floor_fraction"] == pytest.approx(row["floor_ms"] / row["decode_ms_per_step"], rel=1e-2)
    for row in document["results"]["long"]:
        assert row["step_mb"] > 0 and row["floor_ms"] is None and row["floor_fraction"] is None, row
        assert row["kernels_per_step"] is None, row  # --count-kernels counts on a GPU only
    assert [run["copy_bandwidth_tb_s"] for run in document["runs"]] == [None, None]


def test_the_printed_tables_show_each_table_its_own_columns(tiny_result, capsys):
    """A merged file's tables: the grid, the ratios, the long input's rows with the grid's columns (its speed and
    floor), not the ratios' names."""
    from helpers import benchmark_module

    _, document = tiny_result
    benchmark_module("generation").print_tables(document["results"])
    headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| implementation")]
    assert len(headers) == 2 and headers[0] == headers[1]
    assert "tokens_per_second" in headers[1] and "floor_fraction" in headers[1]
    assert "kernels_per_step" in headers[1]  # the long run counted them


@pytest.mark.parametrize("feed_forward_proj", ["gated-gelu", "relu"])
def test_step_bytes_count_what_transformers_t5_reads_in_a_step(feed_forward_proj):
    """The bytes are counted from the config; the truth is transformers' T5 itself: its decoder's parameters but the
    embedding table (a step reads one row per sequence) and cross-attention's key and value projections (applied
    once, before the steps), its output layer (read whole at every step, tied to the embedding or not), and the
    caches a step reads, counted by hand."""
    from helpers import benchmark_module
    from transformers import T5Config, T5ForConditionalGeneration

    generation = benchmark_module("generation")
    config = T5Config(d_model=48, d_kv=8, num_heads=3, d_ff=80, num_layers=2, num_decoder_layers=3, vocab_size=300,
                      feed_forward_proj=feed_forward_proj, tie_word_embeddings=False)
    t5 = T5ForConditionalGeneration(config)
    decoder = {name: parameter.numel() for name, parameter in t5.decoder.named_parameters()
               if not name.startswith("embed_tokens")
               and not name.endswith(("EncDecAttention.k.weight", "EncDecAttention.v.weight"))}
    assert len(decoder) == 3 * (4 + 2 + 3 + (3 if feed_forward_proj == "gated-gelu" else 2)) + 1 + 1  # + table, norm
    batch, input_length, new_tokens = 5, 70, 9
    embedding_rows = batch * 48
    # steps 1..8 read positions 0..t of the self-attention cache: 2..9 positions, 5.5 on average
    caches = batch * 3 * 2 * (3 * 8) * (input_length + 5.5)
    expected = 2 * (sum(decoder.values()) + t5.lm_head.weight.numel() + embedding_rows + caches)
    assert generation.decode_step_bytes(config, batch, input_length, new_tokens, element_bytes=2) == expected


def test_the_issues_floor_of_the_base_shape():
    """The figures the decoding issue counted by hand for the T5 v1.1-base shape in bf16 at 512 input tokens: about
    248 MB of weights and 19 MB of cross-attention cache per sequence, 0.089 / 0.28 / 0.89 ms at batch 1 / 32 / 128
    and 3.0 TB/s. That count leaves out the self-attention cache, which two new tokens make negligible (at 128 new
    tokens it adds 2.4 MB per sequence, 8% at batch 32)."""
    from types import SimpleNamespace

    import torch
    from helpers import benchmark_module

    from fat5 import FAT5Config

    generation = benchmark_module("generation")
    model = SimpleNamespace(config=FAT5Config(**generation.BASE, feed_forward_proj="gated-gelu"), dtype=torch.bfloat16)
    floors = [generation.bandwidth_floor(model, batch, 512, 2, 3.0, decode_ms=1.0)["floor_ms"]
              for batch in (1, 32, 128)]
    assert floors == pytest.approx([0.089, 0.28, 0.89], rel=0.03)
    assert generation.bandwidth_floor(model, 1, 512, 128, None, decode_ms=1.0)["floor_ms"] is None


def test_ratios_are_fat5_over_transformers_of_the_same_shape(tiny_result):
    _, document = tiny_result
    speed = {(row["implementation"], row["batch"], row["input_length"]): row["tokens_per_second"]
             for row in document["results"]["grid"]}
    ratios = document["results"]["ratios"]
    assert len(ratios) == len(speed) // len(IMPLEMENTATIONS)
    for entry in ratios:
        shape = (entry["batch"], entry["input_length"])
        for peer in ("transformers-static", "transformers-dynamic"):
            assert entry[f"fat5 / {peer}"] == pytest.approx(speed[("fat5", *shape)] / speed[(peer, *shape)], abs=1e-3)


def test_the_long_input_run_is_merged_with_its_own_environment(tiny_result):
    out, document = tiny_result
    long = document["results"]["long"]
    assert [row["implementation"] for row in long] == ["fat5", "transformers-dynamic"]
    assert all(row["batch"] == 1 and row["input_length"] == 64 and row["run"] == 1 for row in long)
    assert all("error" not in row and row["tokens_per_second"] > 0 for row in long)
    assert [("--long" in run["command"]) for run in document["runs"]] == [False, True]
    assert document["results"]["fp32_exactness"] is not None  # the grid's check, kept over the long run's none
    assert out.with_suffix(".png").stat().st_size > 0


def test_an_implementation_out_of_memory_is_recorded_and_the_others_measured(monkeypatch):
    """transformers' T5 at 4096 input tokens x batch 128 runs out of memory: the row says so and the grid goes on,
    the others' ids then compared with the next reference."""
    from types import SimpleNamespace

    import torch
    from helpers import benchmark_module

    generation = benchmark_module("generation")
    models = generation.build_models(generation.TINY, "cpu", torch.float32)
    generate = models["transformers"].generate

    def generate_out_of_memory_with_a_static_cache(*inputs, **options):
        if options.get("cache_implementation") == "static":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 GiB")
        return generate(*inputs, **options)

    monkeypatch.setattr(models["transformers"], "generate", generate_out_of_memory_with_a_static_cache)
    args = SimpleNamespace(new_tokens=3, keep_compiled=False, count_kernels=False)
    rows = generation.measure_shape(models, generation.DEFAULT_IMPLEMENTATIONS, 2, 16, args, "cpu", print)
    by_name = {row["implementation"]: row for row in rows}
    assert by_name["transformers-static"]["error"] == "OOM"
    assert "tokens_per_second" not in by_name["transformers-static"]
    assert by_name["transformers-dynamic"]["tokens_per_second"] > 0
    assert by_name["fat5"]["ids_compared_with"] == "transformers-dynamic"
    assert by_name["fat5"]["equal_token_fraction"] == 1.0


def test_each_fat5_implementation_gets_its_ratios_in_one_entry_per_shape():
    """Two FAT5 implementations measured beside a transformers one in the same run: one entry per (batch, input),
    holding each FAT5 row's tokens/s over the peer's; a peer measured in another run gives no ratio."""
    from helpers import benchmark_module

    rows = [{"implementation": name, "batch": 2, "input_length": 16, "tokens_per_second": speed, "run": run}
            for name, speed, run in (("fat5", 300.0, 0), ("fat5-static", 150.0, 0), ("transformers-dynamic", 100.0, 0),
                                     ("transformers-static", 50.0, 1))]
    assert benchmark_module("generation").tokens_per_second_ratios(rows) == [
        {"batch": 2, "input_length": 16, "fat5 / transformers-dynamic": 3.0,
         "fat5-static / transformers-dynamic": 1.5}]
