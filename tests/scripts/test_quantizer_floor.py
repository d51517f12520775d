"""scripts/experiments/quantizer_floor.py against closed forms and published values of Gaussian quantization theory."""

from __future__ import annotations

import math

import pytest

from scripts.experiments import quantizer_floor


def test_lloyd_max_matches_the_closed_form_and_max_1960():
    # two levels: cells (-inf, 0), (0, inf) with centroids -+sqrt(2/pi), so MSE = 1 - 2/pi
    assert quantizer_floor.lloyd_max_mse(2) == pytest.approx(1 - 2 / math.pi, rel=1e-9)
    # J. Max, "Quantizing for minimum distortion" (1960), Table I: 16 levels, MSE 0.009497 (to his table's precision)
    assert quantizer_floor.lloyd_max_mse(16) == pytest.approx(0.009497, rel=1e-3)


def test_entropy_coding_sits_1_53_db_above_shannon_at_high_rate():
    # uniform cells with ideal entropy coding lose pi*e/6 (1.53 dB) in MSE to the rate-distortion bound 2^-2R
    for bits in (6.0, 8.0):
        assert quantizer_floor.entropy_coded_mse(bits) / 2.0 ** (-2 * bits) == pytest.approx(math.pi * math.e / 6,
                                                                                              rel=2e-3)
    entropy, mse = quantizer_floor.entropy_coded_uniform(1e-2)
    assert mse == pytest.approx(1e-4 / 12, rel=1e-3)  # fine cells: the step^2 / 12 of uniform rounding noise
    assert entropy == pytest.approx(0.5 * math.log2(2 * math.pi * math.e) - math.log2(1e-2), rel=1e-4)


def test_our_int4_format_on_gaussian_values_sits_between_the_floors():
    rows = {name.split(" (")[0]: (bits, error) for name, bits, error in quantizer_floor.floor_rows(4.125)}
    ours_bits, ours = rows["hf_zeropp INT4 absmax, block 256"]
    assert ours_bits == 4.125
    # absmax of 256 Gaussians is ~2.9 sigma: step 2.9/7, rounding noise step/sqrt(12) ~ 0.12 of sigma
    assert 0.11 < ours < 0.14
    assert rows["hf_zeropp INT4 absmax, block 64"][1] < ours  # a tighter scale per block, at 4.5 bits
    assert rows["best 16-level codebook"][1] == pytest.approx(math.sqrt(0.009497), rel=1e-3)
    shannon = rows["Shannon bound at 4.125 bits"][1]
    assert shannon == pytest.approx(2 ** -4.125)
    assert shannon < rows["uniform cells + ideal entropy coder at 4.125 bits"][1] < rows["best 16-level codebook"][1]
