"""loka: a torch.compile backend for FP8 training and inference of large recommendation
models.

    compiled = torch.compile(model, backend="loka")          # no import needed
    compiled = torch.compile(model, backend="loka", options={"recipe": "rowwise"})
    print(loka_compile.report(compiled))
    loka_compile.save_plan(compiled, "plan.json")            # options={"plan": "plan.json"} loads it
    loka_compile.export_inference(model.eval(), (x,), "model.pt2")   # serve without loka
"""

import os as _os

# Installed, passes/ and kernels/ live inside this package; in a source checkout they sit
# beside it. Either way they import as loka_compile.passes and loka_compile.kernels.
_checkout_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "kernels")) and \
        _os.path.isfile(_os.path.join(_checkout_root, "kernels", "__init__.py")):
    __path__.append(_checkout_root)

from loka_compile.config import MODES, RECIPES, LokaConfig, Recipe
from loka_compile.passes import Reason, Role
from loka_compile.backend import loka_backend, reset
from loka_compile.state import LokaState, state_of
from loka_compile.report import Report, SiteRecord, plan_summary, plan_table, report, save_plan
from loka_compile.plan import Plan, load_plan
from loka_compile.calibrate import calibrate
from loka_compile.export import InferencePackage, export_inference
from loka_compile.modules import BlockNorm, apply_arch_mods
from loka_compile.comm import GradientComm, fp8_gradient_comm
from loka_compile.weight_gather import WeightGather, fp8_all_gather

__all__ = ["LokaConfig", "Recipe", "RECIPES", "MODES", "Reason", "Role", "loka_backend", "report", "Report",
           "SiteRecord", "reset", "LokaState", "state_of",
           "Plan", "save_plan", "load_plan", "plan_summary", "plan_table", "calibrate",
           "export_inference", "InferencePackage", "BlockNorm", "apply_arch_mods", "fp8_gradient_comm", "GradientComm",
           "fp8_all_gather", "WeightGather"]
__version__ = "0.1.0"
