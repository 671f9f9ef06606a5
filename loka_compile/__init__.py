"""loka: a torch.compile backend for FP8 training and inference of large recommendation
models.

    compiled = torch.compile(model, backend="loka")          # no import needed
    compiled = torch.compile(model, backend="loka", options={"recipe": "rowwise"})
    print(loka_compile.report(compiled))
"""

from loka_compile.config import MODES, RECIPES, LokaConfig, Recipe
from loka_compile.passes import Reason, Role
from loka_compile.backend import loka_backend, reset
from loka_compile.report import Report, SiteRecord, report

__all__ = ["LokaConfig", "Recipe", "RECIPES", "MODES", "Reason", "Role", "loka_backend", "report", "Report",
           "SiteRecord", "reset"]
__version__ = "0.1.0"
