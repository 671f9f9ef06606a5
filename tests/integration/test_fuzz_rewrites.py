"""The differential fuzz of loka's rewrites against eager (tests/fuzz_forms.py has the generator,
the two loka variants and the floors).

CI runs the seeds in CI_SEEDS, chosen to cover every form between them at both ranks, in fp32
and bf16, training and inference. More: `LOKA_FUZZ_CASES=500 python -m pytest -q -n 0
tests/integration/test_fuzz_rewrites.py` adds seeds LOKA_FUZZ_START (0) .. +500, or
`python tests/fuzz_forms.py --start 0 --cases 500` lists every failure with its case. A failing
seed reproduces alone: `python tests/fuzz_forms.py --start SEED --cases 1`."""

import os

import pytest

import fuzz_forms

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

CI_SEEDS = (7, 8, 11)

_START = int(os.environ.get("LOKA_FUZZ_START", "0"))
_MORE = tuple(range(_START, _START + int(os.environ.get("LOKA_FUZZ_CASES", "0"))))


@pytest.mark.parametrize("seed", CI_SEEDS + tuple(s for s in _MORE if s not in CI_SEEDS))
def test_rewrites_match_eager(seed):
    failures, notes = fuzz_forms.check(seed)
    assert not failures, "\n".join([fuzz_forms.describe(seed), *failures, str(notes)])


def test_ci_seeds_cover_every_form():
    """The CI seeds draw every form, both ranks, every dtype, training and inference (the
    generator alone, no compile)."""
    cases = [fuzz_forms.draw_case(seed) for seed in CI_SEEDS]
    forms = {block.form for case in cases for block in case.blocks}
    assert forms == set(fuzz_forms.FORMS), sorted(set(fuzz_forms.FORMS) - forms)
    assert {case.rank for case in cases} == {2, 3}
    assert {case.dtype for case in cases} == set(fuzz_forms.DTYPES)
    assert {case.training for case in cases} == {True, False}


def test_a_case_is_its_seed():
    """The same seed draws the same case and the same values; another seed another case."""
    model, x = fuzz_forms.build(fuzz_forms.draw_case(3))
    again, y = fuzz_forms.build(fuzz_forms.draw_case(3))
    assert fuzz_forms.draw_case(3) == fuzz_forms.draw_case(3) != fuzz_forms.draw_case(4)
    assert (x == y).all() and x.abs().sum() > 0
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert (p == q).all(), name
