"""Which GEMM shapes torch._scaled_mm (cuBLASLt) rejects, per scaling, on this GPU.

Dispatch no longer trusts that a provider runs at every shape (a rowwise Wukong site raised
CUBLAS_STATUS_NOT_SUPPORTED at M=64 on the H100); this sweep records where it does not.

    python3 -m benchmarks.scaled_mm_support --out /tmp/support.json
"""

import argparse
import itertools
import json

import torch

from loka_compile.kernels.scaled_gemm import cast_operand, GemmSpec, gemm_quantized
from loka_compile.kernels.quantize import Fp8Format, Scaling


def _runs(m, k, n, scaling, bias, fast_accum):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    spec = GemmSpec(scaling, Fp8Format.E4M3, Fp8Format.E4M3, f"scaled_mm_{scaling.value}", torch.bfloat16,
                    fast_accum=fast_accum)
    a_q, a_s = cast_operand(a, "a", spec)
    b_q, b_s = cast_operand(b, "b", spec)
    try:
        gemm_quantized(a_q, a_s, b_q, b_s, torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None,
                       spec)
        torch.cuda.synchronize()
        return "ok"
    except RuntimeError as error:
        return str(error).splitlines()[0][:120]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for scaling, m, (k, n), bias, fast in itertools.product(
            (Scaling.ROWWISE, Scaling.TENSORWISE), (1, 16, 64, 512, 8192),
            ((10240, 1024), (1024, 256), (2048, 2048), (160, 2048), (3456, 1024), (256, 16)),
            (False, True), (False, True)):
        rows.append(dict(scaling=scaling.value, m=m, k=k, n=n, bias=bias, fast_accum=fast,
                         result=_runs(m, k, n, scaling, bias, fast)))
    failures = [r for r in rows if r["result"] != "ok"]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: {len(failures)} of {len(rows)} shapes rejected")
    for r in failures:
        print(f"  {r['scaling']:10s} M={r['m']:5d} K={r['k']:5d} N={r['n']:5d} bias={r['bias']!s:5s} "
              f"fast_accum={r['fast_accum']!s:5s}: {r['result']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
