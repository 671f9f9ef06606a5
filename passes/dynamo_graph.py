"""Helpers for Mods that rewrite the Dynamo graph (torch-level IR, before AOTAutograd): how a
call's arguments, module path, weights and example values are read and kept up to date."""

from __future__ import annotations

import collections
import dataclasses
import logging
import operator

import torch
import torch.nn.functional as F

from .find_sites import clean_module_path
from .rewrite import all_or_nothing

LINEARS = {torch._C._nn.linear, F.linear, torch.ops.aten.linear, torch.ops.aten.linear.default}

log = logging.getLogger("loka.passes")

# Where a node came from: find_sites reads its module path, logs and Inductor's provenance its stack trace.
PROVENANCE = ("nn_module_stack", "stack_trace")


@dataclasses.dataclass
class Rewrites:
    """What a Dynamo-graph Mod did to one graph and the bodies of its higher-order ops."""

    rewritten: int = 0
    declined: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # reason -> matches
    modules: list = dataclasses.field(default_factory=list)   # the rewritten matches' module paths

    def add(self, other: "Rewrites") -> None:
        """Count what `other` (a body graph's record) did as done here too."""
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if isinstance(mine, collections.Counter):
                mine.update(theirs)
            elif isinstance(mine, list):
                mine.extend(theirs)
            else:
                setattr(self, field.name, mine + theirs)


def copy_provenance(source: torch.fx.Node, nodes) -> None:
    """`nodes`, which replace `source`, carry its module path and stack trace."""
    kept = {key: source.meta[key] for key in PROVENANCE if key in source.meta}
    for node in nodes:
        node.meta.update(kept)


def arg(node: torch.fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _clean(path: str) -> str:
    # Dynamo's "L['self'].blocks[0].mask[0]" -> "blocks.0.mask.0" (find_sites reads it again
    # through its own cleaner, which leaves a clean path as it is).
    return clean_module_path(path)


def module_stack(node: torch.fx.Node) -> dict:
    return dict(node.meta.get("nn_module_stack") or {})


def example_value(node):
    """The example tensor Dynamo recorded for a node (None for a non-node)."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


def module_of(node: torch.fx.Node) -> str:
    stack = module_stack(node)
    return _clean(list(stack.values())[-1][0]) if stack else ""


def tensor_of(gm, node, inputs: dict):
    """The real or example tensor behind a weight/bias node, and whether it counts as a
    weight: an nn.Parameter graph input, or a get_attr."""
    if node.op == "get_attr":
        try:
            return fetch_attr(gm, node.target), True
        except AttributeError:
            return None, False
    if node.op == "placeholder":
        value = inputs.get(node, node.meta.get("example_value", node.meta.get("val")))
        return value, isinstance(value, torch.nn.Parameter)
    return None, False


def graph_inputs(gm: torch.fx.GraphModule, example_inputs) -> dict:
    """placeholder -> the example input it receives (`example_inputs` in placeholder order)."""
    return dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))


def value_of(gm, node, inputs: dict):
    """The tensor a node stands for: a get_attr's real one, a placeholder's example input, else
    its example value; None for a non-node."""
    if not isinstance(node, torch.fx.Node):
        return None
    tensor = tensor_of(gm, node, inputs)[0]
    return example_value(node) if tensor is None else tensor


def fetch_attr(gm, target: str):
    obj = gm
    for name in target.split("."):
        obj = getattr(obj, name)
    return obj


def excluded(module: str, exclude_modules) -> bool:
    return any(module == p or module.startswith(p + ".") for p in exclude_modules)


def fake_mode(nodes):
    for node in nodes:
        mode = getattr(node.meta.get("example_value"), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def set_example_values(gm, nodes, mode) -> None:
    """Dynamo's `example_value` metadata for the new nodes, computed on fake tensors (a
    get_attr's from the tensor it names in `gm`)."""
    if mode is None:
        return
    value = lambda a: a.meta["example_value"] if isinstance(a, torch.fx.Node) else a  # noqa: E731
    with mode:
        for node in nodes:
            if node.op == "get_attr":
                real = fetch_attr(gm, node.target)
                node.meta["example_value"] = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype,
                                                                 device=real.device)
                continue
            if not all("example_value" in a.meta for a in node.all_input_nodes):
                return
            args = torch.fx.node.map_aggregate(node.args, value)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
            if node.op == "call_method":
                node.meta["example_value"] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                node.meta["example_value"] = node.target(*args, **kwargs)


IN_PLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}

# torch functions that may return a view of their input (call_method users are followed anyway)
MAY_ALIAS = {"view", "reshape", "flatten", "unflatten", "transpose", "permute", "t", "squeeze", "unsqueeze",
             "narrow", "select", "split", "chunk", "unbind", "expand", "movedim", "moveaxis", "swapaxes", "swapdims",
             "diagonal", "as_strided", "view_as", "contiguous", "detach", "alias", "split_with_sizes",
             "unsafe_split", "unsafe_split_with_sizes", "tensor_split", "unfold"}


def _name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def _may_alias_input(node: torch.fx.Node) -> bool:
    return node.op == "call_method" or node.target is operator.getitem or _name(node) in MAY_ALIAS


def written_or_returned(node: torch.fx.Node) -> tuple[bool, bool]:
    """(whether node's value, or a value that may alias it (views, getitem, in-place results),
    is written in place in the graph: `mul_`, `x[i] = v`, `inplace=True`, `out=`, a module
    call; whether one leaves the graph, as an output the caller may write)."""
    written = returned = False
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            name = _name(user)
            if user.op == "output":
                returned = True
                continue
            if user.op == "call_module" or user.target in IN_PLACE_OPERATORS \
                    or (name.endswith("_") and not name.endswith("__")) or user.kwargs.get("inplace") is True \
                    or user.kwargs.get("out") is current:
                written = True
            if _may_alias_input(user):
                stack.append(user)
    return written, returned


# Prefixes of the calls Dynamo writes into a graph where a context manager switches grad mode,
# autocast, inference mode, forward-mode AD, functorch nesting or saved-tensor hooks
# (`torch._C._set_grad_enabled`, `torch.amp._enter_autocast` / `_exit_autocast`, ...): each starts
# a region whose ops run under other global state than the ones before it.
_STATE_CHANGE_PREFIXES = ("_set_", "_enter_", "_exit_", "_grad_increment", "_grad_decrement", "_jvp_increment",
                          "_jvp_decrement", "_saved_tensors_hooks_")


def _changes_state(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload) \
        and _name(node).startswith(_STATE_CHANGE_PREFIXES)


def state_regions(graph: torch.fx.Graph) -> dict:
    """node -> the index of its state region: nodes of one index run under one grad mode and one
    autocast state (no `with torch.no_grad()`, `torch.autocast(...)` or other context manager
    boundary between them). A rewrite that merges computations, or moves one to another node's
    place, keeps within one region: a linear moved out of `no_grad` would pass gradients eager
    does not, one moved out of autocast would compute in another dtype."""
    region, regions = 0, {}
    for node in graph.nodes:
        if _changes_state(node):
            region += 1
        regions[node] = region
    return regions


def alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage `node` may share, followed up through views and getitems."""
    while _may_alias_input(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def called_module(gm: torch.fx.GraphModule, node: torch.fx.Node, kind: type):
    """The submodule of type `kind` that call_module `node` calls, else None."""
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if isinstance(module, kind) else None


def module_parameter(gm: torch.fx.GraphModule, node: torch.fx.Node, name: str):
    """A get_attr node for parameter `name` of the module that call_module `node` calls."""
    if getattr(gm.get_submodule(node.target), name) is None:
        return None
    with gm.graph.inserting_before(node):
        return gm.graph.get_attr(f"{node.target}.{name}")


def replace_call(gm: torch.fx.GraphModule, node: torch.fx.Node, target, args, kwargs) -> None:
    """`node` replaced by a call of `target`, keeping its metadata."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args, kwargs)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def matches_to_rewrite(gm: torch.fx.GraphModule, example_inputs, mod_name: str, match, decline_reason,
                       declined, exclude_modules=()) -> list:
    """(module path, match) for each node of `gm` that `match(gm, node, inputs)` recognizes (a
    record with `.module`), unless its module is excluded or `decline_reason(gm, match, inputs)`
    names a reason; each decline is counted in `declined` and logged at debug level. `inputs`:
    placeholder -> its example input (what tells a Parameter)."""
    inputs = graph_inputs(gm, example_inputs)
    todo = []
    for node in list(gm.graph.nodes):
        found = match(gm, node, inputs)
        if found is None:
            continue
        reason = "excluded_module" if excluded(found.module, exclude_modules) else decline_reason(gm, found, inputs)
        if reason is not None:
            declined[reason] += 1
            log.debug("%s: %s (%s) declined: %s", mod_name, node.name, found.module or "<root>", reason)
            continue
        todo.append((found.module, found))
    return todo


def rewrite_matches(gm: torch.fx.GraphModule, example_inputs, mod_name: str, match, decline_reason, rewrite,
                    exclude_modules=(), becomes: str = "rewritten") -> Rewrites:
    """A Dynamo-graph Mod's driver: each higher-order op's body graph (an activation-checkpointed
    region is one) rewritten the same way, then each match of `gm`'s own graph that
    `matches_to_rewrite` keeps rewritten by `rewrite(gm, match)` (a record with `.node`), all or
    nothing; each rewrite logged at debug level as "`becomes`"."""
    result = Rewrites()
    todo = matches_to_rewrite(gm, example_inputs, mod_name, match, decline_reason, result.declined, exclude_modules)
    for _, body in gm.named_children():
        if isinstance(body, torch.fx.GraphModule):
            result.add(rewrite_matches(body, (), mod_name, match, decline_reason, rewrite, exclude_modules, becomes))
    if not todo:
        return result
    with all_or_nothing(gm):
        for module, found in todo:
            rewrite(gm, found)
            result.rewritten += 1
            result.modules.append(module)
            log.debug("%s: %s (%s) %s", mod_name, found.node.name, module or "<root>", becomes)
    return result
