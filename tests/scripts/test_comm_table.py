"""scripts/benchmarks/comm_table.py's qgZ-option measurement on 2 emulated nodes x 2: what each option keeps between
steps and
sends, read from the engine's own state and meters (a change in either must not break the benchmark silently)."""

from __future__ import annotations


def test_qgz_option_rows_report_residual_memory_and_equal_cross_node_bytes():
    from scripts.benchmarks import comm_table

    from hf_zeropp.testing.spawn import run_distributed

    names = ["ZeRO++", "+ error feedback", "+ Hadamard + 8-bit intra + bit allocation"]
    configs = {name: comm_table.QGZ_OPTION_CONFIGS[name] for name in names}
    rows = run_distributed(comm_table._measure_options, 4, configs, 1, node_size=2)[0]  # one launch, every row
    plain, feedback, allocated = (rows[name] for name in names)
    # the residual: one 8-bit code per partial-sum element and a 4-byte scale per 256 (numel / node_size each)
    params = plain["params"]
    assert params / 2 < feedback["residual_bytes"] < params / 2 * 1.1
    assert plain["residual_bytes"] == allocated["residual_bytes"] == 0
    assert feedback["inter"] == plain["inter"] == allocated["inter"] > 0
    assert allocated["intra"] > plain["intra"]  # its first hop sends 8 bits
    assert all(row["step_s"] > 0 for row in (plain, feedback, allocated))
