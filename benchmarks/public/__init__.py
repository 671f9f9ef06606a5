"""Public-model suite: recommendation models as published libraries ship them
(deepctr-torch, torch-rechub), built at a size preset, with synthetic data in each
library's own input format and a learnable signal (benchmarks.zoo's teacher).

    from benchmarks.public import MODEL_NAMES, build
    bench = build("deepctr_torch.DeepFM", "tiny")
    inputs, labels = bench.batch(0)
    loss = bench.loss(bench.model(inputs), labels)

`python -m benchmarks.public.run --preset production --out DIR` benchmarks every model
(see benchmarks/public/run.py). Needs the `public` extra: pip install -e ".[public]".
"""

from .models import (MODEL_NAMES, PRESETS, REGISTRY, Entry, MissingLibrary, Preset, PublicBench, build,
                     library_versions)

__all__ = ["MODEL_NAMES", "PRESETS", "REGISTRY", "Entry", "MissingLibrary", "Preset", "PublicBench", "build",
           "library_versions"]
