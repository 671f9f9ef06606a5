"""The output budget (`LokaConfig.max_output_error`): a bound on how far a compiled graph's
outputs move from its high-precision variant's, applied when a probe window closes.

Per-site bounds (`max_probe_error`) judge each GEMM alone; errors then add up through the
model. The output budget measures, per forward GEMM site i, its sensitivity

    s_i = relerr(y_i, y) / delta

y: the probe variant's floating outputs (high-precision GEMMs); y_i: the same call with
`loka.perturb` multiplying site i's output by (1 + delta z), z standard normal, delta =
`kernels.ops.PERTURB_DELTA`; relerr: ||a - b|| / ||b|| over all floating outputs at once.
A site whose FP8 error is e_i (its row relative error, the metric that matches a per-element
relative noise) then moves the output by about s_i e_i, and independent sites add in
quadrature:

    D^2 = sum_i (s_i e_i)^2    over the forward sites going FP8.

While D exceeds the budget the site with the largest s_i e_i is made safer: it takes a finer
scaling the Probe measured with a smaller e_i (rowwise -> 1x128 blockwise) where a provider
runs it, and with none left it stays in high precision.
Backward sites (dgrad, wgrad) do not move the forward's outputs: only their per-site bound
applies. The backend runs the measurements (`budget_window.OutputBudgetWindow`); this module holds
the arithmetic and the record.

The noise floor F: the discrepancy the model's own bf16 arithmetic already has. Predicted
through the same sensitivities from each site's bf16 error b_i (the Probe measures the same
product with bf16 operands and output), F_pred = sqrt(sum_i (s_i b_i)^2) over every forward
site; for an fp32 model too, since it is defined against bf16. Measured, where the graph
allows, as the discrepancy of the graph run eagerly in its own bf16 arithmetic from the same
function in fp32 (`floor_graphs`; this also holds the rounding of norms and activations).
F = the larger. The relative
budget (`max_output_error="relative"`) is k F, k = `noise_floor_multiple`: FP8 adds at most
k F in quadrature.

Binary heads (CTR/CVR logits or probabilities; a binary cross-entropy loss): unbiased logit
noise delta raises the expected log loss L, to second order, by E[p (1 - p) delta^2] / 2,
labels unneeded. Per site, the perturbed run gives that term at delta's noise; at the
site's FP8 error e it scales by (e / delta)^2, and independent sites add. The NE increase
is dL / H(mean p) (NE = L / H(base rate)); its relative increase dL / L, with L estimated by
the mean entropy of the predictions (a calibrated model's expected log loss), or, for a loss
among the outputs, the loss itself, whose second-order change a pair of runs at +z and -z
measures. `max_ne_increase` bounds each head's relative NE increase.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Optional

import torch

from loka_compile import dispatch, probe
from loka_compile.kernels import metrics, ops
from loka_compile.passes.find_sites import module_path


# Output kinds of binary heads (`head_kinds`): a sigmoid's output, a head's logits, a
# binary cross-entropy loss (a 0-d output).
PROBABILITY, LOGIT, LOSS = "probability", "logit", "loss"
# Probabilities are clamped this far from 0 and 1 before taking logits.
_P_EPS = 1e-6


@dataclasses.dataclass
class NoiseFloor:
    """The discrepancy a graph's own bf16 arithmetic has (see the module's docstring)."""

    predicted: float                      # sqrt(sum (s_i b_i)^2) over the forward sites
    measured: Optional[float] = None      # eager bf16 run vs fp32 run of the graph
    why_unmeasured: str = ""              # when measured is None

    @property
    def value(self) -> float:
        return max(self.predicted, self.measured or 0.0)


@dataclasses.dataclass
class BinaryHead:
    """One binary head among a graph's outputs, as the closing call measured it."""

    name: str                   # "output 2 (probability)"
    kind: str                   # PROBABILITY, LOGIT or LOSS
    loss: float                 # L: the loss output, or the predictions' mean entropy (label-free)
    base_entropy: Optional[float] = None  # H(mean p): NE's denominator (None for a loss)
    per_site: dict = dataclasses.field(default_factory=dict)  # site id -> dL at the perturbation's delta

    def relative_increase(self, errors: dict, scale: float = 1.0) -> dict:
        """site id -> predicted relative NE increase dL / L at each site's FP8 error."""
        return {sid: scale * scale * self.per_site[sid] * (e / ops.PERTURB_DELTA) ** 2 / self.loss
                if self.per_site.get(sid, 0.0) > 0 else 0.0 for sid, e in errors.items()}

    def ne_increase(self, relative: float) -> Optional[float]:
        """The increase in NE units, dL / H(mean p), for a relative increase dL / L."""
        return None if self.base_entropy is None else relative * self.loss / self.base_entropy


@dataclasses.dataclass
class OutputBudget:
    """What the output budget measured and decided for one graph (`GraphRecord.output_budget`)."""

    budget: float
    sensitivity: dict           # site id -> s (forward sites the probe variant observed)
    error: dict                 # site id -> e: row relative error (mean) in the scaling it would run
    kept: dict                  # site id -> detail: the sites the budget keeps in high precision
    predicted_before: float     # D over every forward site the per-site verdicts let go FP8
    predicted: float            # D over those the budget leaves in FP8
    predicted_after: Optional[float] = None  # D over the sites the FP8 variant runs in FP8, as compiled
    measured: Optional[float] = None         # relerr(FP8 variant, probe variant) on the closing call
    why_unmeasured: str = ""                 # why `measured` is None, where it was not attempted
    seconds: float = 0.0        # the sensitivity runs' wall time
    runs: int = 0               # forward runs of the probe variant they took
    floor: Optional[NoiseFloor] = None       # the graph's noise floor
    multiple: Optional[float] = None         # k, when the budget is k x the floor (else absolute)
    heads: list = dataclasses.field(default_factory=list)  # BinaryHead, judged by ne_budget
    ne_budget: Optional[float] = None        # max_ne_increase, when binary heads have it
    ne_before: dict = dataclasses.field(default_factory=dict)  # head name -> relative dNE, every safe site FP8
    ne_predicted: dict = dataclasses.field(default_factory=dict)  # head name -> relative dNE, as kept
    ne_after: dict = dataclasses.field(default_factory=dict)     # head name -> relative dNE, as compiled
    judged_outputs: str = "all"              # which outputs D covers: "all", "other than the binary heads", "none"
    finite_fraction: float = 1.0             # of the reference outputs' elements, the finite ones D covers
    deferred_calls: int = 0                  # calls the budget waited for a finite output
    made_safe: dict = dataclasses.field(default_factory=dict)  # site id -> detail: kept in FP8 at a finer scaling
    upgraded: dict = dataclasses.field(default_factory=dict)   # site id -> (scaling, steps): the plan's upgrades
    last_gemms: tuple = ()                   # site ids of the model's last GEMMs (its prediction heads)

    @property
    def below_floor(self) -> bool:
        """An absolute budget below the noise floor: bf16 itself would not meet it."""
        return self.multiple is None and self.floor is not None and self.budget < self.floor.value

    def describe_budget(self) -> str:
        if self.multiple is not None:
            return f"{self.multiple:g} x noise floor {self.floor.value:.3g} = {self.budget:.3g}"
        below = f", below the noise floor {self.floor.value:.3g}" if self.below_floor else ""
        return f"max_output_error {self.budget:g}{below}"


def float_outputs(out) -> list:
    """The floating tensors among a graph's outputs (any nesting), detached copies."""
    return [t.detach().clone() for t, floating in zip(torch.utils._pytree.tree_leaves(out), float_leaf_mask(out))
            if floating]


def float_leaf_mask(out) -> list:
    """Per leaf of a graph's outputs (any nesting): whether it is a floating tensor."""
    return [isinstance(t, torch.Tensor) and t.is_floating_point() for t in torch.utils._pytree.tree_leaves(out)]


def _flat(tensors: list) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors]) if tensors else torch.zeros(0)


def discrepancy(value: list, reference: list, finite: Optional[torch.Tensor] = None) -> float:
    """||value - reference|| / ||reference|| over every tensor of the two lists at once
    (`metrics.rel_error` of their concatenation, fp64); +inf when anything is not finite.
    `finite` (`finite_mask(reference)`): only those elements count (a non-finite value
    where the reference is finite still gives +inf)."""
    if len(value) != len(reference) or any(v.shape != r.shape for v, r in zip(value, reference)):
        raise ValueError("the runs' floating outputs differ in number or shape")
    if not reference:
        raise ValueError("the graph has no floating output")
    ref, val = _flat(reference), _flat(value)
    if finite is not None:
        ref, val = ref[finite], val[finite]
    return metrics.rel_error(ref, val)


def finite_mask(reference: list) -> torch.Tensor:
    """The finite elements of the concatenated outputs (a NaN row of the batch drops out)."""
    return torch.isfinite(_flat(reference))


def check_reference(reference: list, finite: Optional[torch.Tensor] = None) -> None:
    """The high-precision outputs (their `finite` elements) must be finite and not all zero
    for relative errors to mean anything."""
    flat = _flat(reference)
    if finite is not None:
        flat = flat[finite]
    if not bool(torch.isfinite(flat).all()) or flat.numel() == 0:
        raise ValueError("the high-precision outputs are not finite")
    if not bool((flat != 0).any()):
        raise ValueError("the high-precision outputs are all zero")


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    """H(p) in nats, elementwise, fp64."""
    p = p.double().clamp(_P_EPS, 1 - _P_EPS)
    return -(p * p.log() + (1 - p) * (1 - p).log())


def head_logits(kind: str, value: torch.Tensor) -> torch.Tensor:
    """A binary head's logits (fp64, finite rows only)."""
    value = value.detach().double().reshape(-1)
    value = value[torch.isfinite(value)]
    if kind == PROBABILITY:
        return torch.logit(value.clamp(_P_EPS, 1 - _P_EPS))
    return value


def measure_head(name: str, kind: str, reference: torch.Tensor) -> BinaryHead:
    """A head's loss scale and NE denominator from its high-precision output: for a loss,
    the loss; else the predictions' mean entropy and the entropy of their mean."""
    if kind == LOSS:
        loss = float(reference.detach().double().sum())
        if not (math.isfinite(loss) and loss > 0):
            raise ValueError(f"{name}: the loss is {loss}, not a positive finite value")
        return BinaryHead(name=name, kind=kind, loss=loss)
    p = torch.sigmoid(head_logits(kind, reference))
    if p.numel() == 0:
        raise ValueError(f"{name}: no finite prediction")
    return BinaryHead(name=name, kind=kind, loss=float(binary_entropy(p).mean()),
                      base_entropy=float(binary_entropy(p.mean())))


def second_order_loss(kind: str, reference: torch.Tensor, perturbed: torch.Tensor,
                      mirrored: Optional[torch.Tensor] = None) -> float:
    """dL of one perturbed run: E[p (1 - p) dz^2] / 2 over the head's predictions, or for a
    loss (L(+z) + L(-z)) / 2 - L (`mirrored`: the run at -z), clamped at 0."""
    if kind == LOSS:
        ref = float(reference.double().sum())
        return max(0.0, (float(perturbed.double().sum()) + float(mirrored.double().sum())) / 2 - ref)
    ref_value, value = reference.detach().double().reshape(-1), perturbed.detach().double().reshape(-1)
    rows = torch.isfinite(ref_value)
    z0 = head_logits(kind, ref_value[rows])
    z = head_logits(kind, value[rows]) if bool(torch.isfinite(value[rows]).all()) else None
    if z is None:
        return math.inf
    p = torch.sigmoid(z0)
    return float((p * (1 - p) * (z - z0) ** 2).mean() / 2)


def candidate_error(summary: dict, candidate: str) -> Optional[float]:
    """The mean row relative error the Probe measured for `candidate` ("rowwise/e4m3/e4m3")
    at a site, whatever `probe_metric` judges bounds by: row relative error is the metric
    that matches a per-element relative noise (a noise of relative size delta measures
    delta), so s * e is the output's change. None when not measured."""
    cand = summary.get("candidates", {}).get(candidate)
    if cand is None:
        return None
    return float(cand["rel_error"]["mean"])


def predicted(contributions) -> float:
    """sqrt(sum c^2): independent errors add in quadrature (a NaN counts as +inf)."""
    total = 0.0
    for c in contributions:
        if not c <= math.inf:
            return math.inf
        total += c * c
    return math.sqrt(total)


@dataclasses.dataclass
class Weighed:
    """What `keep_within` kept, made safe and predicted."""

    kept: dict                  # site id -> detail
    before: float               # D over every site given
    after: float                # D over those left in FP8
    ne_before: dict = dataclasses.field(default_factory=dict)  # head name -> relative dNE, every site
    ne_after: dict = dataclasses.field(default_factory=dict)   # head name -> relative dNE, those left
    made_safe: dict = dataclasses.field(default_factory=dict)  # site id -> (the finer scaling it takes, detail)
    error: dict = dataclasses.field(default_factory=dict)      # site id -> e as it goes FP8 (a finer scaling's)


def keep_within(sensitivity: dict, error: dict, budget: Optional[float], labels: Optional[dict] = None,
                scale: float = 1.0, heads: tuple = (), ne_budget: Optional[float] = None,
                budget_text: Optional[str] = None, finer: Optional[dict] = None,
                last_gemms: frozenset = frozenset()) -> Weighed:
    """The sites of `error` (those going FP8; `sensitivity` has each) kept in high
    precision until every budget holds: the predicted D within `budget` (None: D is not
    judged) and each binary head's predicted relative NE increase within `ne_budget`.
    Each budget's use is a sum of shares, (s e / budget)^2 or dNE / ne_budget; while one
    exceeds 1, the site with the largest share of the most exceeded one is made safer: it
    takes its next finer scaling (`finer`: site id -> [(scaling, e), ...], each e below the
    one before, the scalings a provider runs), or, with none left, stays in high precision.
    `labels`: site id -> the scaling e was measured in; `scale`: a factor on every
    prediction (`measured_scale`); `budget_text`: how the discrepancy budget is named in
    details; `last_gemms`: the sites that are the model's last GEMMs (its prediction heads),
    which the details name as such."""
    labels = dict(labels or {})
    error = dict(error)
    finer = {sid: list(steps) for sid, steps in (finer or {}).items() if sid in error}
    budget_text = budget_text or (f"max_output_error {budget:g}" if budget else "")

    def contribution_of(sid):
        c = scale * sensitivity[sid] * error[sid]
        return c if c == c else math.inf  # NaN -> inf

    contribution = {sid: contribution_of(sid) for sid in error}
    ne = {head.name: head.relative_increase(error, scale) for head in heads} if ne_budget else {}
    by_name = {head.name: head for head in heads}
    left = set(error)

    def uses() -> dict:
        out = {}
        if budget:
            out["D"] = (predicted(contribution[s] for s in left) / budget) ** 2
        for name, terms in ne.items():
            out[name] = sum(terms[s] for s in left) / ne_budget
        return out

    totals = lambda: {name: sum(terms[s] for s in left) for name, terms in ne.items()}  # noqa: E731
    before, ne_before = predicted(contribution.values()), totals()
    kept, made_safe = {}, {}
    used = uses()
    while left and used and max(used.values()) > 1:
        worst = max(used, key=used.get)
        label = lambda sid: f" ({labels[sid]})" if sid in labels else ""  # noqa: E731
        factor = f" x {scale:.2g} (the prediction's measured shortfall)" if scale != 1.0 else ""
        head = lambda sid: " at the model's last GEMM (its prediction head)" if sid in last_gemms else ""  # noqa: E731
        if worst == "D":
            sid = max(left, key=lambda s: contribution[s])
            d = predicted(contribution[s] for s in left)
            why = (f"output budget: sensitivity {sensitivity[sid]:.3g} x rel. error {error[sid]:.3g}"
                   f"{label(sid)}{factor} = {contribution[sid]:.3g}{head(sid)}, the largest share of a predicted "
                   f"output discrepancy {d:.3g} > {budget_text}")
        else:
            terms = ne[worst]
            sid = max(left, key=lambda s: terms[s])
            total = sum(terms[s] for s in left)
            why = (f"output budget: {worst}: predicted relative NE increase {terms[sid]:.3g} from rel. error "
                   f"{error[sid]:.3g}{label(sid)}{factor}{head(sid)}, the largest share of {total:.3g} > "
                   f"max_ne_increase {ne_budget:g}")
        if finer.get(sid):
            scaling, e = finer[sid].pop(0)
            made_safe[sid] = (scaling, made_safe_detail(why, scaling, error[sid], e))
            error[sid], labels[sid] = e, scaling
            contribution[sid] = contribution_of(sid)
            for name in ne:
                ne[name][sid] = by_name[name].relative_increase({sid: e}, scale)[sid]
        else:
            made_safe.pop(sid, None)
            kept[sid] = why
            left.discard(sid)
        used = uses()
    return Weighed(kept=kept, before=before, after=predicted(contribution[s] for s in left),
                   ne_before=ne_before, ne_after=totals(), made_safe=made_safe,
                   error={sid: error[sid] for sid in left})


def made_safe_detail(why: str, scaling: str, before: float, after: float) -> str:
    """A site's detail when a finer scaling made it safe: why it had to change, and the change."""
    return f"{why}: made safe by {scaling} scaling (rel. error {before:.3g} -> {after:.3g})"


def finer_scalings(summary: dict, scaling: str, e: float, max_error: float, metric: str, runs) -> list:
    """[(scaling, e), ...]: the scalings finer than `scaling` (`probe.SCALING_CHAIN`) that
    the Probe measured at a site within its per-site bound (`max_error` in `metric`), each
    with a mean row relative error below the one before (from `e`), that a provider runs
    (`runs(scaling)`)."""
    if "chosen" not in summary or scaling not in probe.SCALING_CHAIN:
        return []
    steps, rank = [], probe.SCALING_CHAIN.index
    for finer, bound in probe.chain_steps(summary, metric)[1:]:
        if finer not in probe.SCALING_CHAIN or rank(finer) <= rank(scaling):
            continue  # a gradient format's step: forward sites have none
        finer_e = candidate_error(summary, probe.upgrade_candidate_name(finer))
        if finer_e is not None and finer_e < e and bound <= max_error and runs(finer):
            steps.append((finer, finer_e))
            e = finer_e
    return steps


def safer_scalings(summaries: dict, error: dict, scalings: dict, sites: dict, config) -> dict:
    """site id -> `finer_scalings` of each site of `error` (going FP8 at `scalings`'
    scaling), those a provider runs for the site (`sites`: id -> Site) under `config`; none
    for a site without Probe statistics (`summaries`: id -> the Probe's summary)."""
    def runs(site):
        return lambda scaling: site is not None and dispatch.upgrade_runs(site, config, scaling)

    return {sid: finer_scalings(summaries.get(sid, {}), scalings.get(sid, ""), e, config.max_probe_error,
                                config.probe_metric, runs(sites.get(sid)))
            for sid, e in error.items()}


def make_safe_or_keep(sensitivity: dict, error: dict, budget: Optional[float], scalings: dict, summaries: dict,
                      sites: dict, config, labels: Optional[dict] = None, **weighing) -> Weighed:
    """`keep_within` with each site first offered the finer scalings the Probe measured
    within its per-site bound (`safer_scalings`, from the scaling it runs: `scalings`, site
    id -> "rowwise"), so that a site stays in high precision only when none is left. The
    window's close, the refit at the measured scale and `calibrate` all weigh sites so.
    `labels`: how details name the scaling each error was measured in (default `scalings`);
    `weighing`: `keep_within`'s other arguments."""
    finer = safer_scalings(summaries, error, scalings, sites, config)
    return keep_within(sensitivity, error, budget, scalings if labels is None else labels, finer=finer, **weighing)


def upgrade_entry(summary: dict, scaling: str, metric: str) -> tuple:
    """A plan's upgrade verdict to a finer `scaling` the Probe measured at a site:
    (scaling, [its own step, that scaling's step]), which Dispatch reads as an upgrade."""
    steps = probe.chain_steps(summary, metric)
    return scaling, [steps[0], *[step for step in steps[1:] if step[0] == scaling]]


def record_made_safe(budget: OutputBudget, weighed: Weighed, summaries: dict, metric: str) -> None:
    """Into `budget`: each site a finer scaling made safe (`Weighed.made_safe`), its error
    there and its plan entry (`upgrade_entry`)."""
    for sid, (scaling, detail) in weighed.made_safe.items():
        budget.error[sid], budget.made_safe[sid] = weighed.error[sid], detail
        budget.upgraded[sid] = upgrade_entry(summaries[sid], scaling, metric)


def last_gemm_sites(gm: torch.fx.GraphModule, sites: dict, ids) -> tuple:
    """The site ids among `ids` (`sites`: id -> Site) of the model's last GEMMs (`last_gemm_modules`)."""
    modules = last_gemm_modules(gm)
    return tuple(sid for sid in ids if sid in sites and sites[sid].module in modules)


def floor_prediction(sensitivity: dict, bf16_error: dict) -> float:
    """F_pred = sqrt(sum (s_i b_i)^2) over the sites with both."""
    return predicted(sensitivity[sid] * b for sid, b in bf16_error.items() if sid in sensitivity)


def draws_random_numbers(gm: torch.fx.GraphModule) -> bool:
    """Whether an ATen graph (or a body it calls) draws random numbers: dropout's mask, a
    rand; Inductor's own random ops take their seeds from one such op."""
    return any(isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags
               for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
               for node in module.graph.nodes if node.op == "call_function")


def measured_scale(budget: OutputBudget) -> float:
    """How many times its prediction the FP8 variant's output discrepancy measured (at
    least 1; 1 before it was measured). The sum in quadrature assumes independent site
    errors; on the H100 calibrated MaskNet measured 3.5x, Wukong 2.6x."""
    if budget.measured is None or not budget.predicted_after:
        return 1.0
    return max(1.0, budget.measured / budget.predicted_after)


# The measured noise floor runs the Dynamo graph eagerly twice: once in fp32 (the same function
# with every low-precision conversion and autocast region computing in fp32) and once in bf16
# (the model's own low-precision arithmetic; for a graph that has none, its conversions to
# fp32 made bf16 ones). Dtypes below fp32 that a graph may compute in:
LOW_PRECISION = (torch.bfloat16, torch.float16)
# Tensor methods that convert to a dtype they name, and the method that names each dtype.
_DTYPE_METHODS = {"bfloat16": torch.bfloat16, "half": torch.float16, "float": torch.float32}
_METHOD_OF_DTYPE = {dtype: name for name, dtype in _DTYPE_METHODS.items()}
# Tensor methods whose dtype argument is a conversion (not a factory's or a reduction's dtype).
_CONVERSIONS = {"to", "type"}


def _is_autocast_entry(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.amp.autocast_mode._enter_autocast


def _floating_attr(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[torch.Tensor]:
    """The floating tensor a get_attr node reads, else None."""
    value = gm
    for name in node.target.split("."):
        value = getattr(value, name, None)
    return value if isinstance(value, torch.Tensor) and value.is_floating_point() else None


def _dtype_constants(node: torch.fx.Node) -> list:
    found = []
    torch.fx.node.map_aggregate((node.args, node.kwargs),
                                lambda a: found.append(a) if isinstance(a, torch.dtype) else None)
    return found


def computes_in_low_precision(gm: torch.fx.GraphModule, args) -> bool:
    """Whether a Dynamo graph has low-precision arithmetic of its own (called on `args`): a
    bf16/fp16 floating input or attribute, a conversion to bf16/fp16, or an autocast region."""
    if any(isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype in LOW_PRECISION for a in args):
        return True
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _floating_attr(gm, node)
            if value is not None and value.dtype in LOW_PRECISION:
                return True
        elif _is_autocast_entry(node):
            if len(node.args) > 2 and node.args[2]:
                return True
        elif node.op == "call_method" and _DTYPE_METHODS.get(node.target) in LOW_PRECISION:
            return True
        elif node.op in ("call_method", "call_function") and any(d in LOW_PRECISION for d in _dtype_constants(node)):
            return True
    return False


# Methods that convert a tensor to integers (ids read from a float tensor, as deepctr-torch
# reads its features), and the ops through which values reach them unchanged (slices, views).
_INTEGER_METHODS = {"long", "int", "short", "byte", "char"}
_INDEXING = {"getitem", "__getitem__", "view", "reshape", "squeeze", "unsqueeze", "narrow", "select", "flatten",
             "contiguous", "split", "chunk", "unbind", "t", "transpose", "permute", "expand"}


def _integer_conversion(node: torch.fx.Node) -> bool:
    if node.op == "call_method" and node.target in _INTEGER_METHODS:
        return True
    dtypes = _dtype_constants(node) if _op_name(node) in _CONVERSIONS else []
    return bool(dtypes) and not any(d.is_floating_point or d.is_complex for d in dtypes)


def reads_ids_only(node: torch.fx.Node) -> bool:
    """Whether every use of `node`'s values goes, through slices and views only, into an
    integer conversion (`x[:, 3:7].long()`): they are ids, and rounding them would change them."""
    if _integer_conversion(node):
        return True
    return _op_name(node) in _INDEXING and bool(node.users) and all(map(reads_ids_only, node.users))


def _to_if_floating(value, dtype: torch.dtype):
    """`value` in `dtype` when it is a floating tensor, else as it is."""
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def precision_copy(gm: torch.fx.GraphModule, dtype: torch.dtype, convert: tuple = (),
                   conversions_only: bool = False, autocast_off: bool = False,
                   round_inputs: bool = False) -> torch.fx.GraphModule:
    """A copy of a Dynamo graph (the original is left as it is) in which every dtype of
    `convert` the graph names becomes `dtype`: conversions (`.to(torch.bfloat16)`,
    `.bfloat16()`, `.half()`, `.float()`) and, unless `conversions_only`, any op's dtype
    argument (factories, `softmax(dtype=)`); floating attributes it reads of a dtype in
    `convert` are converted at read. `autocast_off`: its autocast regions are disabled.
    `round_inputs`: each floating input is read in `dtype` too, except where its values are
    only ids (`reads_ids_only`: those uses read it as it is, exact). Floating attributes
    (and, with `round_inputs`, inputs) are read through a copy, so an eager run leaves
    buffers as they were."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    swap = lambda a: dtype if isinstance(a, torch.dtype) and a in convert else a  # noqa: E731
    if round_inputs:
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        for node in reversed(inputs):  # after the last input: placeholders stay first
            with graph.inserting_after(inputs[-1]):
                read = graph.call_function(_to_if_floating, (node, dtype))
            for user in [u for u in node.users if u is not read and not reads_ids_only(u)]:
                user.replace_input_with(node, read)
    for node in list(graph.nodes):
        if node.op == "get_attr":
            value = _floating_attr(gm, node)
            if value is None:
                continue
            with graph.inserting_after(node):
                read = graph.call_method("to", (node, swap(value.dtype)), {"copy": True})
            node.replace_all_uses_with(read, delete_user_cb=lambda user: user is not read)
        elif _is_autocast_entry(node):
            if autocast_off and len(node.args) > 2:
                node.args = (*node.args[:2], False, *node.args[3:])
        elif node.op == "call_method" and node.target in _DTYPE_METHODS:
            if _DTYPE_METHODS[node.target] in convert:
                node.target = _METHOD_OF_DTYPE[dtype]
        elif node.op in ("call_method", "call_function") and (not conversions_only or node.target in _CONVERSIONS):
            node.args = torch.fx.node.map_aggregate(node.args, swap)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
    return torch.fx.GraphModule(gm, graph)


def floor_graphs(gm: torch.fx.GraphModule, args) -> tuple:
    """(fp32 graph, bf16 graph, dtype for the bf16 run's floating inputs or None: as they
    are) of the measured noise floor. The fp32 graph computes the graph's function in fp32:
    its bf16/fp16 conversions made fp32 ones, autocast off, inputs in fp32. The bf16 graph
    is the model's own low-precision arithmetic where it has some (the graph as it is, on its
    own inputs); a graph without any runs in bf16: its conversions to fp32 (`.to(weight.dtype)`
    in an fp32 model) made bf16 ones, inputs read in bf16 but where they carry ids (a float
    tensor of ids and dense features, read by `.long()`: those reads stay exact). Both
    bf16 graphs take their inputs as they are (the dtype returned is None)."""
    high = precision_copy(gm, torch.float32, LOW_PRECISION, autocast_off=True)
    if computes_in_low_precision(gm, args):
        return high, precision_copy(gm, torch.float32), None
    return high, precision_copy(gm, torch.bfloat16, (torch.float32,), conversions_only=True, round_inputs=True), None


# Dynamo-graph ops whose output is a probability of a binary event, and those of a binary
# cross-entropy loss (on logits or on probabilities); ops a loss passes through on its way to
# the output (sums, weights, the mean of several heads' losses).
_SIGMOIDS = {torch.sigmoid, torch.special.expit, torch.nn.functional.sigmoid, "sigmoid", "sigmoid_"}
_BINARY_LOSSES = {torch.nn.functional.binary_cross_entropy_with_logits, torch.binary_cross_entropy_with_logits,
                  torch.nn.functional.binary_cross_entropy}
_LOSS_ARITHMETIC = {"add", "mul", "truediv", "div", "sum", "mean", "__add__", "__mul__", "__truediv__", "sub",
                    "__radd__", "__rmul__", "iadd", "imul", "stack", "cat"}


def _op_name(node: torch.fx.Node):
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return node.target if node.target in _SIGMOIDS | _BINARY_LOSSES else getattr(node.target, "__name__", "")
    return None


def _is_bce_loss(node: torch.fx.Node) -> bool:
    """A 0-d output reached from binary cross-entropies through loss arithmetic only."""
    stack, seen, found = [node], set(), False
    while stack:
        current = stack.pop()
        if current in seen or not isinstance(current, torch.fx.Node):
            continue
        seen.add(current)
        name = _op_name(current)
        if name in _BINARY_LOSSES:
            found = True
        elif name in _LOSS_ARITHMETIC:
            stack.extend(n for n in current.all_input_nodes)
        elif current.op not in ("get_attr", "placeholder") or current is node:
            return False  # something other than loss arithmetic shapes the output
    return found


_VIEWS = {"squeeze", "unsqueeze", "view", "reshape", "flatten", "float", "to", "contiguous"}


def _through_views(node: torch.fx.Node) -> torch.fx.Node:
    """The op a chain of views of `node` starts from (a head's `.squeeze(-1)`)."""
    while _op_name(node) in _VIEWS and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _under(node: torch.fx.Node, prefixes: tuple) -> bool:
    path = module_path(node)
    return any(path == p or path.startswith(p + ".") for p in prefixes)


# Dynamo-graph ops that are GEMMs (the sites' sources), for finding a model's last GEMMs.
_GEMM_OPS = {torch._C._nn.linear, torch.nn.functional.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm,
             torch.baddbmm, torch.einsum, operator.matmul}


def _is_gemm(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), torch.nn.Linear)
    return (node.op == "call_function" and node.target in _GEMM_OPS) or \
        (node.op == "call_method" and node.target in ("matmul", "mm", "bmm", "__matmul__"))


def last_gemm_modules(gm: torch.fx.GraphModule) -> set:
    """Module paths of a Dynamo graph's last GEMMs: those an output is reached from through
    no other GEMM (the model's prediction heads)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    stack, seen, found = list(output.all_input_nodes), set(), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_gemm(gm, node):
            found.add(node.target if node.op == "call_module" else module_path(node))
        else:
            stack.extend(node.all_input_nodes)
    return found


def head_kinds(gm: torch.fx.GraphModule, prefixes: tuple = ()) -> list:
    """Per output leaf of a Dynamo graph (as `float_leaf_mask` lists them): PROBABILITY for
    a sigmoid's output, LOSS for a 0-d binary cross-entropy loss, LOGIT for the output of a
    module under one of `prefixes` (`binary_outputs`), else None."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    kinds = []
    for leaf in torch.utils._pytree.tree_leaves(output.args[0]):
        value = leaf.meta.get("example_value") if isinstance(leaf, torch.fx.Node) else None
        kind = None
        if not isinstance(leaf, torch.fx.Node):
            pass
        elif _op_name(leaf) in _SIGMOIDS:
            kind = PROBABILITY
        elif isinstance(value, torch.Tensor) and value.dim() == 0 and _is_bce_loss(leaf):
            kind = LOSS
        elif prefixes and _under(_through_views(leaf), prefixes):
            kind = LOGIT
        kinds.append(kind)
    return kinds
