"""When loka cannot handle a graph: which errors are failures (and which are Dynamo steering
compilation), how a failure's reason reads, and what the graph's record keeps of it."""

from __future__ import annotations

import logging
import os
import traceback
from typing import Optional

import torch

from loka_compile.passes import Decision, Phase, Reason
from loka_compile.state import GraphRecord


log = logging.getLogger("loka")


def is_dynamo_control(error: Exception) -> bool:
    """Dynamo steers compilation with exceptions (restart analysis, skip frame); they
    are not failures and must reach Dynamo. (Inductor's own failures arrive wrapped in
    InductorError, also a Dynamo exception type, and are failures.)"""
    return isinstance(error, (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame))


def error_text(error: Exception) -> str:
    """"Type: message (at file:line in function)", the innermost frame, so that a
    fallback's reason says where the failure was; one line: the message's first (an error
    from compiled C++ code goes on with its C++ stack, frame by frame)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    message = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {message}{where}"


def warn_fallback(record: GraphRecord, why: str, whole_graph: bool = True) -> None:
    if whole_graph:
        record.fallback = why
    if not record.warned:
        record.warned = True
        log.warning("loka could not handle graph %s (%s); it runs through Inductor in high precision", record.name, why)


def forget_rewrite(record: GraphRecord, why: str, kind=None, phase: Optional[Phase] = None) -> None:
    """Rewritten graphs (of `kind`, of `phase`; None: all) that will not run: drop them
    from the record, and make every site their passes found run in high precision, saying why
    (`fall_back_sites`)."""
    def matches(key):
        return (kind is None or key[1] is kind) and (phase is None or key[0] is phase)

    for key in [key for key in record.graph_modules if matches(key)]:
        record.graph_modules.pop(key)
    for key, ctx in record.contexts.items():
        if matches(key):
            fall_back_sites(ctx, why)


def fall_back_sites(ctx, why: str) -> None:
    """Every site of a pass context whose graph runs without loka: a decided site's decision
    amended by "fallback" (the report lists the change), an undecided one given that decision."""
    for site in ctx.sites:
        if site.id in ctx.decisions:
            ctx.amend(site, "fallback", why, fp8=False, reason=Reason.GRAPH_FALLBACK, detail=why)
        else:
            ctx.decisions[site.id] = Decision(fp8=False, reason=Reason.GRAPH_FALLBACK, detail=why)
