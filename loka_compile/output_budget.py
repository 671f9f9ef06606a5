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

While D exceeds the budget the site with the largest s_i e_i stays in high precision.
Backward sites (dgrad, wgrad) do not move the forward's outputs: only their per-site bound
applies. The backend runs the measurements (`budget_window.OutputBudgetWindow`); this module holds
the arithmetic and the record.

The noise floor F: the discrepancy the model's own bf16 arithmetic already has. Predicted
through the same sensitivities from each site's bf16 error b_i (the Probe measures the same
product with bf16 operands and output), F_pred = sqrt(sum_i (s_i b_i)^2) over every forward
site; for an fp32 model too, since it is defined against bf16. Measured, where the graph
allows, as the discrepancy of the graph run eagerly in bf16 from the same run in fp32
(which also holds the rounding of norms and activations). F = the larger. The relative
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
from typing import Optional

import torch

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
    """What `keep_within` kept and predicted."""

    kept: dict                  # site id -> detail
    before: float               # D over every site given
    after: float                # D over those left in FP8
    ne_before: dict = dataclasses.field(default_factory=dict)  # head name -> relative dNE, every site
    ne_after: dict = dataclasses.field(default_factory=dict)   # head name -> relative dNE, those left


def keep_within(sensitivity: dict, error: dict, budget: Optional[float], labels: Optional[dict] = None,
                scale: float = 1.0, heads: tuple = (), ne_budget: Optional[float] = None,
                budget_text: Optional[str] = None) -> Weighed:
    """The sites of `error` (those going FP8; `sensitivity` has each) kept in high
    precision until every budget holds: the predicted D within `budget` (None: D is not
    judged) and each binary head's predicted relative NE increase within `ne_budget`.
    Each budget's use is a sum of shares, (s e / budget)^2 or dNE / ne_budget; while one
    exceeds 1, the site with the largest share of the most exceeded one stays. `labels`:
    site id -> the scaling e was measured in; `scale`: a factor on every prediction
    (`measured_scale`); `budget_text`: how the discrepancy budget is named in details."""
    labels = labels or {}
    budget_text = budget_text or (f"max_output_error {budget:g}" if budget else "")
    contribution = {sid: scale * sensitivity[sid] * e for sid, e in error.items()}
    contribution = {sid: (c if c == c else math.inf) for sid, c in contribution.items()}  # NaN -> inf
    ne = {head.name: head.relative_increase(error, scale) for head in heads} if ne_budget else {}
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
    kept = {}
    used = uses()
    while left and used and max(used.values()) > 1:
        worst = max(used, key=used.get)
        label = lambda sid: f" ({labels[sid]})" if sid in labels else ""  # noqa: E731
        factor = f" x {scale:.2g} (the prediction's measured shortfall)" if scale != 1.0 else ""
        if worst == "D":
            sid = max(left, key=lambda s: contribution[s])
            d = predicted(contribution[s] for s in left)
            kept[sid] = (f"output budget: sensitivity {sensitivity[sid]:.3g} x rel. error {error[sid]:.3g}"
                         f"{label(sid)}{factor} = {contribution[sid]:.3g}, the largest share of a predicted output "
                         f"discrepancy {d:.3g} > {budget_text}")
        else:
            terms = ne[worst]
            sid = max(left, key=lambda s: terms[s])
            total = sum(terms[s] for s in left)
            kept[sid] = (f"output budget: {worst}: predicted relative NE increase {terms[sid]:.3g} from rel. error "
                         f"{error[sid]:.3g}{label(sid)}{factor}, the largest share of {total:.3g} > max_ne_increase "
                         f"{ne_budget:g}")
        left.discard(sid)
        used = uses()
    return Weighed(kept=kept, before=before, after=predicted(contribution[s] for s in left),
                   ne_before=ne_before, ne_after=totals())


def floor_prediction(sensitivity: dict, bf16_error: dict) -> float:
    """F_pred = sqrt(sum (s_i b_i)^2) over the sites with both."""
    return predicted(sensitivity[sid] * b for sid, b in bf16_error.items() if sid in sensitivity)


def measured_scale(budget: OutputBudget) -> float:
    """How many times its prediction the FP8 variant's output discrepancy measured (at
    least 1; 1 before it was measured). The sum in quadrature assumes independent site
    errors; on the H100 calibrated MaskNet measured 3.5x, Wukong 2.6x."""
    if budget.measured is None or not budget.predicted_after:
        return 1.0
    return max(1.0, budget.measured / budget.predicted_after)


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
