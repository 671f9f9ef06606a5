"""Wukong's feature-axis linears written four ways, forward + backward under Inductor bf16:
what the `transposed_linear` Mod's layout saves, and its error against fp32.

    python -m benchmarks.transposed_linear [--batch 8192] [--layers 8] [--steps 15] [--out DIR]

Variants (the same weights): `zoo` (the layer as written), `horizontal` (fm_proj and lcb as one
linear of x^T, what loka's horizontal Mod makes), `left_multiply` (that linear as W @ x, batched
over the broadcast weight: what transposed_linear makes), `left_multiply_2d` (W @ x as one GEMM
over a permuted copy of x). Errors: output and all parameter gradients against an fp32 copy of the
zoo layers on the same inputs. GPU timings are device-event medians over fresh random inputs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.zoo.models import WukongLayer
from loka_compile.kernels.metrics import rel_error

PAPER = dict(n=64, d=160, n_fm=32, n_lc=32, k=24, mlp=[2048] * 3)
TINY = dict(n=8, d=16, n_fm=4, n_lc=4, k=4, mlp=[32])


def _fm(layer, fm, b):
    return layer.fm_mlp(layer.fm_norm(fm.flatten(1))).view(b, layer.n_fm, layer.d)


def _fused_weight(layer):
    return torch.cat([layer.fm_proj.weight, layer.lcb.weight], 0)


def zoo(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def horizontal(layers, x):
    for layer in layers:
        b, k = x.shape[0], layer.fm_proj.out_features
        y = F.linear(x.transpose(1, 2), _fused_weight(layer))          # [B, d, k + nL]
        fm_p, lcb = y[..., :k], y[..., k:].transpose(1, 2)
        x = layer.norm(torch.cat([_fm(layer, torch.bmm(x, fm_p), b), lcb], 1) + x)
    return x


def left_multiply(layers, x):
    for layer in layers:
        b, k = x.shape[0], layer.fm_proj.out_features
        w = _fused_weight(layer)
        y = torch.bmm(w.unsqueeze(0).expand(b, -1, -1), x)             # [B, k + nL, d]
        fm_p, lcb = y[:, :k].transpose(1, 2), y[:, k:]
        x = layer.norm(torch.cat([_fm(layer, torch.bmm(x, fm_p), b), lcb], 1) + x)
    return x


def left_multiply_2d(layers, x):
    for layer in layers:
        (b, n, d), k = x.shape, layer.fm_proj.out_features
        w = _fused_weight(layer)
        y = (w @ x.permute(1, 0, 2).reshape(n, b * d)).view(-1, b, d).permute(1, 0, 2)
        fm_p, lcb = y[:, :k].transpose(1, 2), y[:, k:]
        x = layer.norm(torch.cat([_fm(layer, torch.bmm(x, fm_p), b), lcb], 1) + x)
    return x


VARIANTS = {"zoo": zoo, "horizontal": horizontal, "left_multiply": left_multiply, "left_multiply_2d": left_multiply_2d}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--tiny", action="store_true", help="tiny layer sizes (CPU smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, sizes = ("cuda" if cuda else "cpu"), (TINY if args.tiny else PAPER)
    torch.manual_seed(0)
    layers = nn.ModuleList(WukongLayer(sizes["n"], sizes["d"], sizes["n_fm"], sizes["n_lc"], sizes["k"], sizes["mlp"])
                           for _ in range(args.layers)).to(device, torch.bfloat16)
    reference = copy.deepcopy(layers).float()
    shape = (args.batch, sizes["n"], sizes["d"])
    x0 = torch.randn(shape, device=device, dtype=torch.bfloat16)
    g0 = torch.randn(shape, device=device, dtype=torch.bfloat16)
    x32 = x0.float().requires_grad_(True)
    out32 = zoo(reference, x32)
    out32.backward(g0.float())
    ref_grads = torch.cat([p.grad.flatten() for p in reference.parameters()])

    def step(fn, x):
        for p in layers.parameters():
            p.grad = None
        out = fn(layers, x)
        out.backward(g0)
        return out

    results = {}
    for name, fn in VARIANTS.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn)
        out = step(compiled, x0.clone().requires_grad_(True))
        grads = torch.cat([p.grad.float().flatten() for p in layers.parameters()])
        errors = dict(out_err_vs_fp32=rel_error(out32.detach(), out.float()), grad_err_vs_fp32=rel_error(ref_grads, grads))
        times = []
        for _ in range(args.steps):
            x = torch.randn(shape, device=device, dtype=torch.bfloat16).requires_grad_(True)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(compiled, x)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                began = time.perf_counter()
                step(compiled, x)
                times.append((time.perf_counter() - began) * 1e3)
        results[name] = dict(ms=statistics.median(times), **errors)
        print(f"{name:18s} {results[name]['ms']:8.3f} ms  out err {errors['out_err_vs_fp32']:.2e}  "
              f"grad err {errors['grad_err_vs_fp32']:.2e}", flush=True)
    record = dict(batch=args.batch, layers=args.layers, sizes=sizes, device=torch.cuda.get_device_name() if cuda else "cpu",
                  torch=torch.__version__, results=results)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "transposed_linear_layers.json"), "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
