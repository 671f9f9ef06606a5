"""Public-model suite: recommendation models as published libraries ship them
(deepctr-torch, torch-rechub), built at a size preset, with synthetic data in each
library's own input format and a learnable signal (benchmarks.zoo's teacher).

Models that no library ships are written here in the public style (written_here.py:
Wukong, MaskNet serial and parallel, from their papers, not copied from any repository)
and are marked so: named `public_style.*`, library "written-here", `Entry.origin` ==
WRITTEN_HERE. They are not library models; results should say which rows are which.

    from benchmarks.public import MODEL_NAMES, build
    bench = build("deepctr_torch.DeepFM", "tiny")
    inputs, labels = bench.batch(0)
    loss = bench.loss(bench.model(inputs), labels)

`python -m benchmarks.public.run --preset production --out DIR` benchmarks every model
(see benchmarks/public/run.py); `python -m benchmarks.public.coverage` audits which GEMM
FLOPs loka sees and puts in FP8 (coverage.py). Needs the `public` extra: pip install -e ".[public]".
"""

from .models import (LIBRARY, MODEL_NAMES, PRESETS, REGISTRY, WRITTEN_HERE, Entry, MissingLibrary, Preset,
                     PublicBench, build, library_versions)

__all__ = ["MODEL_NAMES", "PRESETS", "REGISTRY", "LIBRARY", "WRITTEN_HERE", "Entry", "MissingLibrary", "Preset",
           "PublicBench", "build", "library_versions"]
