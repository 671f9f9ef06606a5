"""The differential fuzz of loka's rewrites against eager (tests/fuzz_forms.py has the generator,
the two loka variants and the floors).

CI runs CI_CASES, four cases of two forms each (the forms of the bugs found so far among them),
about 20 s on 2 cores. FORM_CASES hold every form once, six to a case, spread over both ranks, the
three dtypes and training and inference (widths, biases, norms and activations drawn from the
seed); they take minutes, so they run with LOKA_FUZZ_FORMS=1 or LOKA_FUZZ_CASES set.
`LOKA_FUZZ_CASES=500 python -m pytest -q -n 0 tests/integration/test_fuzz_rewrites.py` adds the
drawn cases of seeds LOKA_FUZZ_START (0) .. +500; `python tests/fuzz_forms.py --start 0 --cases 500`
lists every failure with its case. A failing seed reproduces alone: `python tests/fuzz_forms.py
--start SEED --cases 1`."""

import dataclasses
import itertools
import os

import pytest

import fuzz_forms

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

# (forms, rank, dtype, training)
_CI = (
    (("sibling_no_grad", "bmm_expand_transpose"), 3, "autocast", True),
    (("horizontal", "token_mix"), 3, "fp32", True),
    (("split_cat", "matvec"), 2, "bf16", False),
    (("baddbmm", "fields_flat"), 3, "autocast", False),
)
_EVERY_FORM = (
    (("nn_linear", "f_linear", "matmul_wt", "matmul_transpose", "horizontal", "linear_bn_relu"), 2, "fp32", True),
    (("matmul_w", "einsum", "mm_flat", "addmm_flat", "matvec", "matvec_t"), 2, "fp32", False),
    (("repeated_linear", "tied_weight", "conv1d", "split_cat", "sibling_no_grad", "split_regroup"), 2, "autocast",
     True),
    (("sibling_autocast", "split_no_grad", "bmm_expand", "bmm_expand_transpose", "bmm_expand_permute", "baddbmm"), 3,
     "autocast", False),
    (("matmul_broadcast", "token_mix", "token_mix_permute", "token_mix_siblings", "field_mix", "interaction"), 3,
     "bf16", True),
    (("conv2d", "fields_flat", "unbind_stack", "pair_products", "shared_twice"), 3, "bf16", False),
)


def _cases(groups) -> list:
    return [dataclasses.replace(fuzz_forms.draw_case(seed, forms=forms), rank=rank, dtype=dtype, training=training,
                                input_grad=training)
            for seed, (forms, rank, dtype, training) in enumerate(groups)]


CI_CASES, FORM_CASES = _cases(_CI), _cases(_EVERY_FORM)

_START = int(os.environ.get("LOKA_FUZZ_START", "0"))
_SEEDS = tuple(range(_START, _START + int(os.environ.get("LOKA_FUZZ_CASES", "0"))))


def _assert_passes(case, failures, notes):
    head = {f.name: getattr(case, f.name) for f in dataclasses.fields(case) if f.name != "blocks"}
    assert not failures, "\n".join([str(head), *map(str, case.blocks), *failures, str(notes)])


def _ids(cases) -> list:
    return [",".join(b.form for b in c.blocks) for c in cases]


@pytest.mark.parametrize("case", CI_CASES, ids=_ids(CI_CASES))
def test_rewrites_match_eager(case):
    _assert_passes(case, *fuzz_forms.check_case(case))


@pytest.mark.slow
@pytest.mark.skipif(not (_SEEDS or os.environ.get("LOKA_FUZZ_FORMS") == "1"),
                    reason="minutes on CPU: LOKA_FUZZ_FORMS=1 or LOKA_FUZZ_CASES=N runs it")
@pytest.mark.parametrize("case", FORM_CASES, ids=_ids(FORM_CASES))
def test_every_form_matches_eager(case):
    _assert_passes(case, *fuzz_forms.check_case(case))


@pytest.mark.parametrize("seed", _SEEDS)
def test_drawn_case_matches_eager(seed):
    case = fuzz_forms.draw_case(seed)
    _assert_passes(case, *fuzz_forms.check_case(case))


def test_form_cases_cover_every_form_rank_dtype_and_mode():
    """The generator alone, no compile."""
    assert sorted(b.form for case in FORM_CASES for b in case.blocks) == sorted(fuzz_forms.FORMS)
    assert {case.rank for case in FORM_CASES} == {2, 3}
    assert {(case.dtype, case.training) for case in FORM_CASES} == set(
        itertools.product(("fp32", "autocast", "bf16"), (True, False)))


def test_a_case_is_its_seed():
    """The same seed draws the same case and the same values; another seed another case."""
    model, x = fuzz_forms.build(fuzz_forms.draw_case(3))
    again, y = fuzz_forms.build(fuzz_forms.draw_case(3))
    assert fuzz_forms.draw_case(3) == fuzz_forms.draw_case(3) != fuzz_forms.draw_case(4)
    assert (x == y).all() and x.abs().sum() > 0
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert (p == q).all(), name
