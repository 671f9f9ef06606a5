"""`numerics.sqnr_against_terms_db` and `cancellation`, and the fuzz's use of them (no compile)."""

import math

import torch

import fuzz_forms
from numerics import cancellation, sqnr_against_terms_db, sqnr_db


def _sums(signs: torch.Tensor, generator: torch.Generator):
    """(sum of terms, sum with 3% error on each term, sum of |terms|) over the last dim."""
    terms = signs * torch.rand(256, 64, generator=generator, dtype=torch.float64)
    noisy = terms * (1 + 0.03 * torch.randn(terms.shape, generator=generator, dtype=torch.float64))
    return terms.sum(-1), noisy.sum(-1), terms.abs().sum(-1)


def test_a_cancelling_sum_is_judged_by_its_terms_size():
    generator = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (256, 64), generator=generator).double() * 2 - 1
    ref, noisy, magnitude = _sums(signs, generator)
    assert cancellation(ref, magnitude) < 0.3
    against_terms = sqnr_against_terms_db(ref, noisy, magnitude)
    # each term's 3% error, independent: 20 log10(sum|t| / (0.03 ||t||)) ~ 20 log10(sqrt(64) * 0.87 / 0.03)
    assert 42 < against_terms < 50, against_terms
    assert sqnr_db(ref, noisy) < against_terms - 10  # the plain SQNR counts the cancellation as error


def test_a_sum_that_does_not_cancel_is_judged_as_before():
    generator = torch.Generator().manual_seed(1)
    ref, noisy, magnitude = _sums(torch.ones(256, 64, dtype=torch.float64), generator)
    assert cancellation(ref, magnitude) == 1.0
    assert math.isclose(sqnr_against_terms_db(ref, noisy, magnitude), sqnr_db(ref, noisy), rel_tol=1e-9)


def test_nan_and_a_wrong_sum_fail():
    generator = torch.Generator().manual_seed(2)
    signs = torch.randint(0, 2, (256, 64), generator=generator).double() * 2 - 1
    ref, noisy, magnitude = _sums(signs, generator)
    noisy[3] = float("nan")
    assert sqnr_against_terms_db(ref, noisy, magnitude) == -math.inf
    assert sqnr_against_terms_db(ref, ref + magnitude, magnitude) <= 0.0  # off by the terms' size: 0 dB


def test_the_fuzz_judges_only_a_cancelling_auxiliary_output_by_its_terms():
    generator = torch.Generator().manual_seed(3)
    x = 0.1 * torch.randn(64, 24, generator=generator, dtype=torch.float64)  # a batch mean near 0
    case = fuzz_forms.draw_case(121)
    assert case.aux_output
    magnitude = fuzz_forms.terms_magnitudes(case, {"outputs": [x]})["output 1"]
    ref = fuzz_forms.aux_output(x)
    shifted = ref + 0.05 * magnitude.mean()
    assert cancellation(ref, magnitude) < fuzz_forms.CANCELLED
    db, against = fuzz_forms.fp8_sqnr(ref, shifted, magnitude)
    assert against.startswith("against its terms' size") and db > sqnr_db(ref, shifted)
    assert fuzz_forms.fp8_sqnr(ref, shifted, None) == (sqnr_db(ref, shifted), "against the reference")
    positive = x.abs() + 1.0  # nothing cancels: the plain SQNR
    ref, magnitude = fuzz_forms.aux_output(positive), fuzz_forms.aux_output(positive, terms_magnitude=True)
    assert fuzz_forms.fp8_sqnr(ref, ref * 1.01, magnitude)[1] == "against the reference"
