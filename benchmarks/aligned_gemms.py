"""High-precision GEMMs off the alignment, compiled by Inductor as it pads them on its own and as
`force_shape_pad` pads them (what loka patched in before the `aligned_gemms` Mod decided per site),
with the form the Mod now picks for each.

    python -m benchmarks.aligned_gemms --out DIR            # CUDA
    python -m benchmarks.aligned_gemms --tiny --out DIR     # CPU smoke run (nothing is padded on CPU)

Cases, at the public suite's production sizes (batch 8192): deepctr-torch MMoE's batched gate
products (`softmax(gate).unsqueeze(1) @ expert_outs`, 4 experts of 1024, forward and the
gradient by the gate), its gate logits (N = 4), a mat-vec product with K above the alignment
(12), torch-rechub DCNv2's 1-wide head over its 3341 + 1024 features and that head's input
gradient (K = 1), and HSTU-style attention bmms over 65 positions (the case the Mod was
measured on). Each case's operands have the layouts its graph gives them (the gate gradient
reads expert_outs transposed). Timings: `loka_compile.speed._time_calls_us` (medians of CUDA-event timed CUDA-graph
replays), the two forms of a case in the same run on the same fresh random operands; the forms'
outputs are compared (zero padding changes only the summation order).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
from pathlib import Path
from typing import Callable

import torch
from tabulate import tabulate

from loka_compile.kernels.metrics import rel_error
from loka_compile.passes.mods.aligned_gemms import alignment_padding
from loka_compile.speed import _time_calls_us


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    make: Callable  # (scale, device) -> operands, each in the layout its graph gives it
    note: str


def _bf16(*shape, device):
    return torch.randn(*shape, device=device).to(torch.bfloat16)


def cases(batch: int, experts: int, width: int, heads: int, positions: int, head_dim: int,
          head_in: int) -> list:
    b, e, d = batch, experts, width
    bh, p, h = batch * heads, positions, head_dim
    return [
        Case("mmoe_gate_forward", torch.bmm,
             lambda dev: (_bf16(b, 1, e, device=dev), _bf16(b, e, d, device=dev)),
             f"[{b}, 1, {e}] @ [{b}, {e}, {d}]"),
        Case("mmoe_gate_gradient", torch.bmm,
             lambda dev: (_bf16(b, 1, d, device=dev), _bf16(b, e, d, device=dev).transpose(1, 2)),
             f"[{b}, 1, {d}] @ expert_outs^T [{b}, {d}, {e}]"),
        Case("gate_logits", torch.mm,
             lambda dev: (_bf16(b, d, device=dev), _bf16(e, d, device=dev).t()),
             f"[{b}, {d}] @ W^T [{d}, {e}]"),
        Case("matvec_k12", torch.bmm,
             lambda dev: (_bf16(b, 1, 12, device=dev), _bf16(b, 12, d, device=dev)),
             f"[{b}, 1, 12] @ [{b}, 12, {d}]"),
        Case("head_forward", torch.mm,
             lambda dev: (_bf16(b, head_in, device=dev), _bf16(1, head_in, device=dev).t()),
             f"[{b}, {head_in}] @ w^T [{head_in}, 1]"),
        Case("head_input_gradient", torch.mm,
             lambda dev: (_bf16(b, 1, device=dev), _bf16(1, head_in, device=dev)),
             f"[{b}, 1] @ w [1, {head_in}]"),
        Case("attention_scores", torch.bmm,
             lambda dev: (_bf16(bh, p, h, device=dev), _bf16(bh, p, h, device=dev).transpose(1, 2)),
             f"[{bh}, {p}, {h}] @ [{bh}, {h}, {p}]"),
        Case("attention_values", torch.bmm,
             lambda dev: (_bf16(bh, p, p, device=dev), _bf16(bh, p, h, device=dev)),
             f"[{bh}, {p}, {p}] @ [{bh}, {p}, {h}]"),
    ]


def mod_choice(case: Case, operands) -> str:
    """What the aligned_gemms Mod does with this GEMM: "padded" or the reason it declines."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(case.fn, tracing_mode="fake")(*operands).graph
    (node,) = [n for n in graph.nodes if n.op == "call_function" and n.target in
               (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)]
    pads, why = alignment_padding(node)
    return f"padded {pads}" if any(pads) else why


def compiled(case: Case, force: bool):
    """The case's op compiled by Inductor with `force_shape_pad` as given (compiled at its
    first call, inside the patch)."""
    fn = torch.compile(lambda a, b: case.fn(a, b), dynamic=False)

    def run(*args):
        with torch._inductor.config.patch(force_shape_pad=force):
            return fn(*args)
    return run


def measure(case: Case, device: torch.device) -> dict:
    operands = case.make(device)
    own, forced = compiled(case, False), compiled(case, True)
    out_own, out_forced = own(*operands), forced(*operands)  # compiles
    us_own = _time_calls_us(lambda: own(*operands), device)
    us_forced = _time_calls_us(lambda: forced(*operands), device)
    choice = mod_choice(case, operands)
    return {"case": case.name, "gemm": case.note, "inductor_us": us_own, "forced_pad_us": us_forced,
            "forced_pad_x": us_forced / us_own, "aligned_gemms": choice,
            "loka_us": us_forced if choice.startswith("padded") else us_own,
            "forms_rel_error": rel_error(out_forced.float(), out_own.float())}


def table(rows: list) -> str:
    body = [[r["case"], r["gemm"], f"{r['inductor_us']:.1f}", f"{r['forced_pad_us']:.1f}",
             f"{r['forced_pad_x']:.2f}x", r["aligned_gemms"], f"{r['forms_rel_error']:.1e}"] for r in rows]
    return tabulate(body, headers=["case", "GEMM", "Inductor us", "force_shape_pad us", "forced / Inductor",
                                   "aligned_gemms does", "rel. diff"], tablefmt="github")


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sizes = dict(batch=64, experts=4, width=32, heads=1, positions=65, head_dim=16, head_in=109) if args.tiny else \
        dict(batch=8192, experts=4, width=1024, heads=2, positions=65, head_dim=64, head_in=4365)
    rows = [measure(case, device) for case in cases(**sizes)]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    env = {"device": name, "torch": torch.__version__, "date": _dt.date.today().isoformat(), "sizes": sizes,
           "timing": "median of CUDA-event timed CUDA-graph replays (loka_compile.speed)" if device.type == "cuda"
           else "median wall time per call (CPU: Inductor pads nothing, both forms are one)"}
    tag = next((t for t in ("H200", "H100", "B200", "A100") if t in name), "cpu" if device.type == "cpu" else "gpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{env['date']}_{tag}_aligned_gemms"
    stem.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    text = (f"# High-precision GEMMs off the alignment: Inductor's own padding vs force_shape_pad\n\n"
            f"{name}, torch {torch.__version__}, {env['date']}; {env['timing']}.\n\n{table(rows)}\n")
    stem.with_suffix(".md").write_text(text)
    print(text)
    return stem.with_suffix(".json")


if __name__ == "__main__":
    main()
