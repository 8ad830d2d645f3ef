"""benchmarks/attention.py's short-problem sweep: which variant it reports fastest, on hand-set timings (the
kernels themselves are timed on a GPU only)."""

from types import SimpleNamespace

from helpers import benchmark_module


def test_sweep_short_reports_per_problem_and_phase_the_fastest_variant_against_the_defaults(monkeypatch):
    attention = benchmark_module("attention")
    current = {}
    # a forward configuration twice as fast forward, a dk/dv configuration 1.25x forward+backward, the separate dq
    # kernel slower; everything else as fast as the defaults
    fast_forward, fast_dkdv = (64, 64, 4, 2, 128), (32, 64, 4, 3)

    def timed(name, position, causal, length, head_dim, forward_backward, divisor):
        if not forward_backward:
            return {"ms": 0.5 if current.get("forward") == fast_forward else 1.0}
        if "deterministic" in current:
            return {"ms": 2.0}
        return {"ms": 0.8 if current.get("dkdv") == fast_dkdv else 1.0}

    monkeypatch.setattr(attention, "warm_caches", lambda tasks, jobs: {})
    monkeypatch.setattr(attention, "correctness", lambda *arguments: {"output": 1e-3})
    monkeypatch.setattr(attention, "_apply_overrides", lambda overrides: current.clear() or current.update(overrides))
    monkeypatch.setattr(attention, "timed", timed)
    results = attention.sweep_short(SimpleNamespace(jobs=1))
    summary = results["summary"]
    assert len(summary) == 2 * len(attention.SHORT_PROBLEMS)
    for entry in summary:
        if entry["phase"] == "forward":
            assert entry["best"] == ["forward", fast_forward] and entry["speedup"] == 2.0
        else:
            assert entry["best"] == ["dkdv", fast_dkdv] and entry["speedup"] == 1.25
    # a dk/dv or dq variant is timed forward+backward only, a forward one forward only
    for row in results["sweep_short"]:
        timed_phases = {phase for phase in ("forward", "forward_backward") if phase in row}
        expected = {"default": {"forward", "forward_backward"}, "forward": {"forward"}}
        assert timed_phases == expected.get(row["variant"], {"forward_backward"})


def test_the_bias_free_tables_time_fa4_beside_triton_and_cudnn_and_report_its_ratios():
    attention = benchmark_module("attention")
    bias_free = [table for table in attention.TABLES if table[1] == "none"]
    assert {table[0] for table in bias_free} == {"cross_d64", "cross_d128", "none_d64"}
    assert all({"fa4", "fat5", "sdpa_cudnn_no_bias"} <= set(table[3]) for table in bias_free)
    assert "fa4" in attention.GRAPHED

    def row(name, tflops):
        phase = {"tflops": tflops, "graph_tflops": tflops}
        return {"implementation": name, "causal": False, "length": 1024, "forward": phase, "forward_backward": phase}

    rows = [row("sdpa_cudnn_no_bias", 400.0), row("fat5", 300.0), row("fa4", 450.0)]
    summary = {entry["implementation"]: entry for entry in attention._ratios("none_d64", rows)}
    assert set(summary) == {"fat5", "fa4"}
    assert summary["fa4"]["fwd+bwd / cuDNN"] == 1.125 and summary["fa4"]["fwd+bwd / FAT5 Triton"] == 1.5
    assert summary["fa4"]["fwd+bwd / FAT5 Triton, graphs"] == 1.5 and summary["fat5"]["fwd+bwd / cuDNN"] == 0.75
