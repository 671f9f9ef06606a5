"""Train a small Wukong recommendation model with loka on synthetic recsys data, then print
the held-out quality and loka's site report.

    python -m examples.quickstart                      # tiny Wukong, CPU or GPU
    python -m examples.quickstart --model dlrm_dcnv2 --recipe tensorwise --steps 50

On a CPU (or a GPU without FP8) the FP8 GEMMs are emulated: the same quantization, then
an fp32 matmul. On an H100 they run on cuBLASLt through torch._scaled_mm.
"""

from __future__ import annotations

import argparse
import logging

import torch

import loka_compile
from benchmarks.zoo.data import SyntheticRecsysData, quality_metrics
from benchmarks.zoo.models import MODEL_NAMES, build_model, to_dense_dtype


def main(argv=None) -> loka_compile.Report:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="wukong", choices=MODEL_NAMES)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--recipe", default="default", choices=sorted(loka_compile.RECIPES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mode", default="default", choices=loka_compile.MODES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")

    device = torch.device(args.device)
    model, spec = build_model(args.model, args.preset)
    model = model.to(device)
    if device.type == "cuda":
        to_dense_dtype(model, torch.bfloat16)  # FP8 replaces bf16 GEMMs; tables stay fp32
    compiled = torch.compile(model, backend="loka", options={"recipe": args.recipe, "mode": args.mode})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    train = SyntheticRecsysData(spec, seed=0).stream(args.batch, device)
    for step in range(args.steps):
        batch = next(train)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(compiled(*batch.model_inputs()).float().squeeze(-1), batch.labels.float())
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  train logloss {loss.item():.4f}")

    held_out = SyntheticRecsysData(spec, seed=1).stream(args.batch, device)
    with torch.no_grad():
        batches = [next(held_out) for _ in range(4)]
        logits = torch.cat([compiled(*b.model_inputs()).float().squeeze(-1) for b in batches])
        labels = torch.cat([b.labels for b in batches])
    metrics = quality_metrics(logits, labels)
    print("held-out: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    report = loka_compile.report(compiled)
    print(f"\nloka ({args.model}/{args.preset}, recipe {args.recipe}, {device.type}):")
    print(report)  # the overview; report.table() lists every site
    return report


if __name__ == "__main__":
    main()
