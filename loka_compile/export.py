"""A serving artifact: the FP8 inference model as one AOTInductor package (`.pt2`).

    package = loka_compile.export_inference(model.eval(), (x,), "model.pt2", options={"plan": "plan.json"})
    print(package.report)
    # in the serving process, without loka:
    runner = torch._inductor.aoti_load_package("model.pt2")
    y = runner(x)

How: `torch.export` traces the model, and AOTInductor compiles the exported program with
the Inductor config patches of `backend="loka"` (`inductor_passes.inductor_patches`), so the same
post-grad passes find the sites, Dispatch decides each (a loaded plan's decisions and
static activation scales included) and `lower` writes each FP8 GEMM as casts plus the
provider's GEMM. In AOTInductor's graph the weights are constants (`get_attr`), not
graph inputs, so the `cached_weights` Mod finds nothing to cache; instead, right after
loka's passes, every cast computed from weights alone is evaluated once here
(`_fold_weight_casts`, Inductor's `ConstantFolder`) and stored in the package as
constants: the FP8 weight in the layout the GEMM reads and its scales. Nothing in the
package calls back into Python: providers are limited to ATen ones and no `loka::` op
may remain (the serving process never imports loka_compile).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from typing import Optional

import torch
from torch._inductor.constant_folding import ConstantFolder, replace_node_with_constant
from torch._inductor.custom_graph_pass import CustomGraphPass

from loka_compile.config import LokaConfig
from loka_compile.fallback import error_text, forget_rewrite, warn_fallback
from loka_compile.inductor_passes import LokaPostGradPass, inductor_patches, in_higher_order_op_body
from loka_compile.kernels import providers
from loka_compile.kernels.quantize import Fp8Format
from loka_compile.passes import Phase
from loka_compile.passes.find_sites import VIEW_LIKE
from loka_compile.passes.mods import cached_weights, fused_casts
from loka_compile.plan import Plan, load_plan, param_fingerprint
from loka_compile.report import Report
from loka_compile.state import GraphRecord, LokaState

log = logging.getLogger("loka")

# Providers whose GEMM is ATen ops only (`torch._scaled_mm`, or the emulation's
# dequantize + matmul), so AOTInductor compiles them into the package. loka's Triton GEMM
# is a `loka::` op: a package calling it would need loka_compile loaded to run.
SELF_CONTAINED_PROVIDERS = ("emulated", "scaled_mm_rowwise", "scaled_mm_tensorwise")
_DEFAULT_PROBE_STEPS = LokaConfig.__dataclass_fields__["probe_steps"].default
EXPORTED_WEIGHT = "cached weight (FP8 constant in the package, quantized at export)"

_FP8_DTYPES = frozenset(fmt.dtype for fmt in Fp8Format)
_export_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class InferencePackage:
    """What `export_inference` wrote: the package's path (also `os.fspath(package)`), the
    report of what went FP8, and whether the package takes any batch size."""

    path: str
    report: Report
    dynamic_batch: bool

    def __fspath__(self) -> str:
        return self.path


def export_inference(model: torch.nn.Module, example_inputs, path, *, options=None,
                     dynamic_batch: bool = True) -> InferencePackage:
    """Export `model` (in eval mode) for FP8 inference as an AOTInductor package at `path`
    (a `.pt2` file), loadable with `torch._inductor.aoti_load_package(path)` in a process
    that never imports loka_compile.

    example_inputs: the positional arguments of `model.forward` (a tensor, or a tuple of
        tensors and lists of tensors), on the device the package will run on.
    options: as for `backend="loka"` (a mapping or a LokaConfig); `{"plan": path}` takes a
        saved or calibrated plan's per-site decisions and static activation scales. The
        default probe window is left out (a package has no Probe; a LokaConfig whose
        `probe_steps` is the default counts as not asking for one). Not exportable
        (ValueError): a probe window asked for (`probe_steps` > 0 given in a mapping, or a
        LokaConfig's other than the default; calibrate first), `arch_mods`
        (apply `loka_compile.apply_arch_mods` to the model first), `fused_casts` off, and
        providers that are not ATen ops (`SELF_CONTAINED_PROVIDERS`).
    dynamic_batch: dim 0 of every tensor input left dynamic (torch.export's `Dim.AUTO`:
        a dim the model fixes is specialized, and `InferencePackage.dynamic_batch` says
        whether the first input's dim 0 stayed dynamic).

    Weights are quantized once, here: each FP8 site's weight and its scales are package
    constants in the layout the GEMM reads. If loka's passes fail and the `fallback`
    option is on (the default), the package is written without loka (high precision)
    and the report says why; with it off the error is raised."""
    config = _export_config(options)
    args = _check_arguments(model, example_inputs, path)
    path = os.fspath(path)
    params = list(model.named_parameters())
    device = next((t.device for _, t in params), None) or _first_tensor(args).device
    device_type = device.type
    plan = _plan(config, param_fingerprint(params), device_type)
    untimed = config.plan is None or any(e.fp8 and e.fp8_us is None for e in plan.sites.values())
    if config.speed_check and untimed and providers.has_fp8_hardware(device):
        # Dispatch learns that B is a cached weight from the graph's weight inputs; here the
        # weights are constants, so it cannot tell.
        log.warning("loka export: the speed check times each weight's FP8 cast as if it ran per call (the "
                    "package holds it precomputed), so it may keep small sites in bf16 that backend='loka' "
                    "puts in FP8; for the backend's decisions, export with its plan (options={'plan': path} "
                    "from loka_compile.save_plan of the model compiled with backend='loka'; a calibrated plan "
                    "leaves the speed check to the compile that loads it)")
    state = LokaState()  # the export's own: its graph runs no observers
    record = GraphRecord(name=f"export{next(_export_ids)}", config=config, store=state.store, plan=plan)
    state.add(record)
    dynamic_shapes = _batch_dims(args) if dynamic_batch else None
    with torch.no_grad():
        program = torch.export.export(model, args, dynamic_shapes=dynamic_shapes)
    batch_dynamic = _dim0_is_symbolic(program)
    if dynamic_batch and not batch_dynamic:
        log.warning("loka export: torch.export fixed the batch size at %d (the model specializes dim 0 of "
                    "its first input); the package takes that batch size only", _first_tensor(args).shape[0])
    loka_pass = _ExportPass(LokaPostGradPass(record, Phase.FP8, frozenset()),
                            fold=cached_weights.MOD.on(config.inactive_mods))
    try:
        written = torch._inductor.aoti_compile_and_package(
            program, package_path=path, inductor_configs=_patches(config, loka_pass))
    except Exception as error:
        if not config.fallback:
            raise
        why = f"export with loka failed: {error_text(error)}"
        warn_fallback(record, why)
        forget_rewrite(record, why)
        written = torch._inductor.aoti_compile_and_package(
            program, package_path=path, inductor_configs=_patches(config, None))
    report = Report(state.records)
    log.info("loka export %s: %s", written, report.summary())
    return InferencePackage(path=os.fspath(written), report=report, dynamic_batch=batch_dynamic)


def _export_config(options) -> LokaConfig:
    """The config, checked for what a package can hold, its providers limited to ATen ones,
    without a probe window."""
    config = LokaConfig.from_options(options)
    if isinstance(options, LokaConfig):
        asked = config.probe_steps != _DEFAULT_PROBE_STEPS and config.probe_steps
    else:
        asked = (options or {}).get("probe_steps", 0)
    if asked:
        raise ValueError("export_inference takes no probe window (probe_steps > 0): the package has no Probe. "
                         "Calibrate first (loka_compile.calibrate), save the plan and pass options={'plan': path}")
    if config.arch_mods:
        raise ValueError(f"export_inference does not apply arch_mods {list(config.arch_mods)}: apply them to the "
                         f"model first (loka_compile.apply_arch_mods(model, {list(config.arch_mods)}))")
    if not fused_casts.MOD.on(config.inactive_mods):
        raise ValueError("export_inference needs the fused_casts Mod: without it each cast is a loka:: op, which "
                         "a package loaded without loka_compile cannot run")
    chosen = config.providers or tuple(providers.names())
    usable = tuple(name for name in chosen if name in SELF_CONTAINED_PROVIDERS)
    if not usable:
        raise ValueError(f"export_inference runs FP8 GEMMs on providers {list(SELF_CONTAINED_PROVIDERS)} only "
                         f"(ATen ops, compiled into the package); options chose {list(chosen)}")
    dropped = sorted(set(chosen) - set(usable))
    if dropped:
        log.info("loka export: providers %s left out (loka:: ops a package without loka_compile cannot run)",
                 dropped)
    return dataclasses.replace(config, providers=usable, probe_steps=0)


def _check_arguments(model, example_inputs, path) -> tuple:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"export_inference exports an nn.Module, got {type(model).__name__}")
    if model.training:
        raise ValueError("export_inference exports the inference model: call model.eval() first "
                         "(in training mode dropout and batch norm would be exported as in training)")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(args, (tuple, list)) or _first_tensor(args) is None:
        raise ValueError("example_inputs must be a tensor or a tuple of model.forward's positional arguments "
                         f"holding at least one tensor, got {type(example_inputs).__name__}")
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path).endswith(".pt2"):
        raise ValueError(f"path must be a str or os.PathLike ending in .pt2 (an AOTInductor package), got {path!r}")
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(parent):
        raise ValueError(f"path {os.fspath(path)!r}: no such directory {parent!r}")
    return tuple(args)


def _first_tensor(args) -> Optional[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(args)
    return next((t for t in leaves if isinstance(t, torch.Tensor)), None)


def _plan(config: LokaConfig, fingerprint: dict, device_type: str) -> Plan:
    """The graph's plan: the loaded one (checked against the model) or a fresh one."""
    if config.plan is None:
        return Plan(params=fingerprint, device_type=device_type, recipe=config.recipe)
    loaded = load_plan(config.plan)
    loaded.check(fingerprint, device_type, config.recipe)  # ValueError naming what differs
    return dataclasses.replace(loaded, params=fingerprint)


def _batch_dims(args) -> tuple:
    """torch.export's dynamic_shapes for `args`: dim 0 of every tensor left to export."""
    return torch.utils._pytree.tree_map(
        lambda t: {0: torch.export.Dim.AUTO} if isinstance(t, torch.Tensor) and t.dim() else None, args)


def _dim0_is_symbolic(program) -> bool:
    inputs = [n for n in program.graph.nodes if n.op == "placeholder"
              and n.name in program.graph_signature.user_inputs]
    value = next((n.meta.get("val") for n in inputs if isinstance(n.meta.get("val"), torch.Tensor)
                  and n.meta["val"].dim()), None)
    return value is not None and isinstance(value.shape[0], torch.SymInt)


def _patches(config: LokaConfig, loka_pass) -> dict:
    patches = inductor_patches(config, loka_pass)
    # Multi-kernel picks a reduction variant when the graph first runs; a package has no
    # such first run in Python, and AOTInductor with it is untested here.
    patches.pop("triton.multi_kernel", None)
    if patches.pop("triton.cudagraphs", None):
        log.info("loka export: mode %r: CUDA graphs are left to the serving runtime (AOTInductor packages "
                 "hold none)", config.mode)
    return patches


class _ExportPass(CustomGraphPass):
    """loka's post-grad pass, then the folding of the weight casts it wrote. AOTInductor
    deep-copies its config; the pass stays one object, so that what it records reaches
    the caller's GraphRecord."""

    def __init__(self, loka_pass: LokaPostGradPass, fold: bool):
        self.loka_pass, self.fold = loka_pass, fold

    def __deepcopy__(self, memo):
        return self

    def __call__(self, graph: torch.fx.Graph) -> None:
        if in_higher_order_op_body():
            return  # loka leaves a torch.cond branch or a loop body as it is
        self.loka_pass(graph)
        if self.fold:
            folded = _fold_weight_casts(graph.owning_module)
            log.info("loka export: %d constants (FP8 weights and their scales) computed once, here", folded)
            for ctx in self.loka_pass.record.contexts.values():
                for site in ctx.sites:
                    if ctx.decisions[site.id].fp8:
                        for operand, producer in zip("ab", site.producers):
                            if producer.startswith("constant:"):
                                ctx.casts.setdefault(site.id, {})[operand] = EXPORTED_WEIGHT
        foreign = sorted({str(n.target) for n in graph.nodes if n.op == "call_function"
                          and getattr(n.target, "namespace", None) == "loka"})
        if foreign:
            raise RuntimeError(f"loka export: the graph still calls {foreign}, which a package loaded without "
                               f"loka_compile cannot run")

    def uuid(self) -> str:
        return f"{self.loka_pass.uuid()}|fold={self.fold}"


class _WeightCastFolder(ConstantFolder):
    """Inductor's constant folder, stopping at the dequantization of an FP8 constant (the
    emulated GEMM's), so that the FP8 weight, not its high-precision copy, is the
    constant: Inductor keeps int8 weights the same way."""

    def is_impure(self, node: torch.fx.Node) -> bool:
        source = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if node.target in VIEW_LIKE and source is not None:
            value, out = source.meta.get("val"), node.meta.get("val")
            if isinstance(value, torch.Tensor) and value.dtype in _FP8_DTYPES \
                    and isinstance(out, torch.Tensor) and out.dtype not in _FP8_DTYPES:
                return True
        return super().is_impure(node)


def _fold_weight_casts(gm: torch.fx.GraphModule) -> int:
    """Evaluate, once, every value computed from constants (the weights) by more than views
    and dtype casts that the rest of the graph reads, and make it a constant of `gm`: the
    FP8 casts of weights and their scales. A weight read only through views (a
    high-precision GEMM's) stays as it is. Returns how many constants were made."""
    folder = _WeightCastFolder(gm, skip_constructors=False)
    computable = set()    # values of constants alone, which the folder evaluates
    from_weights = set()  # values that read a constant
    only_views = set()    # constants, and views of them
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "get_attr":
            computable.add(node)
            from_weights.add(node)
            only_views.add(node)
            continue
        if node.op == "call_function" and not folder.is_impure(node) and all(n in computable for n in inputs):
            computable.add(node)
        if any(n in from_weights for n in inputs):
            from_weights.add(node)
            if node.target in VIEW_LIKE and len(inputs) == 1 and inputs[0] in only_views:
                only_views.add(node)
    with torch.utils._python_dispatch._disable_current_modes():
        folder.run()
    # The values the rest of the graph reads, each with the weights it is made from (taken
    # before any becomes a constant itself).
    frontier = {node: (value, tuple(n.target for n in _ancestors(node) if n.op == "get_attr"))
                for node, value in folder.node_replacements.items()
                if node in from_weights and node not in only_views
                and any(user not in computable for user in node.users)}
    made = {}  # (weights, layout) -> the values made from them
    for node, (value, weights) in frontier.items():
        same = made.setdefault((weights, value.shape, value.stride(), value.dtype), [])
        # A weight that two sites cast alike (a shared tower) is held once: Inductor keeps
        # one copy of constants that are the same tensor.
        shared = next((v for v in same if torch.equal(v, value)), None)
        if shared is None:
            same.append(value)
        value = shared if shared is not None else value
        base = weights[0].replace(".", "_") if len(weights) == 1 else node.name
        name = base + ("_fp8" if value.dtype in _FP8_DTYPES else "_fp8_scale")
        replace_node_with_constant(gm, node, value, name=_unique_attr(gm, name))
    for node in gm.graph.find_nodes(op="get_attr"):
        if not node.users:
            gm.graph.erase_node(node)
            if hasattr(gm, node.target):
                delattr(gm, node.target)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return len(frontier)


def _unique_attr(gm: torch.fx.GraphModule, base: str) -> str:
    name = base
    for i in itertools.count(1):
        if not hasattr(gm, name):
            return name
        name = f"{base}_{i}"


def _ancestors(node: torch.fx.Node) -> list:
    found, stack = {}, [node]
    while stack:
        current = stack.pop()
        for parent in current.all_input_nodes:
            if parent not in found:
                found[parent] = None
                stack.append(parent)
    return list(found)
