"""amprewrite: automatic mixed precision for PyTorch as an FX graph rewrite.

``convert`` captures a model, decides per op which precision it computes in, and returns a
GraphModule whose ``.code`` shows every cast.
"""

from ._convert import convert
from ._errors import AmpRewriteError
from ._registry import register_op, unregister_op
from ._tables import OpCategory
from .policy import Policy

__all__ = ["convert", "Policy", "OpCategory", "AmpRewriteError", "register_op", "unregister_op"]

# -- public API of feature modules (one import line and one __all__ line per module) --
from .audit import AuditReport, OpRecord, audit; from ._lints import Lint, lint; from ._grad_hist import GradHistogram; __all__ += ["audit", "AuditReport", "OpRecord", "lint", "Lint", "GradHistogram"]
from .training import MasterWeights, ScalerMonitor, StepRecord; __all__ += ["MasterWeights", "ScalerMonitor", "StepRecord"]
from ._backend import AmpBackend, backend, compile; from ._explain import explain; __all__ += ["AmpBackend", "backend", "compile", "explain"]
from ._weight_cache import clear_weight_cache; __all__ += ["clear_weight_cache"]
from ._memory import MemoryComparison, MemoryReport, compare_memory, memory_report; __all__ += ["memory_report", "compare_memory", "MemoryReport", "MemoryComparison"]
from ._compare import GradError, NodeError, PrecisionReport, compare; from ._search import SearchResult, search; __all__ += ["compare", "PrecisionReport", "NodeError", "GradError", "search", "SearchResult"]
__version__ = "0.1.0"
