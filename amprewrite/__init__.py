"""amprewrite: automatic mixed precision for PyTorch as an FX graph rewrite.

``convert`` captures a model, decides per op which precision it computes in, and returns a
GraphModule whose ``.code`` shows every cast. The names below are the whole public surface;
each is documented in docs/. The folders name the concepts: ``capture/`` (model to
graph), ``policy/`` (which op runs in which precision), ``passes/`` (the graph rewrite),
``runtime/`` (what converted graphs call), ``graph/`` (node facts shared by the passes),
``audit/`` (what ran, in which dtype), ``training/`` (master weights, loss scaling, memory),
``precision/`` (error per op against an fp64 shadow; the fp32 search), ``htmlreport/`` (one
self-contained HTML page), ``cli/``, ``integrations/`` (bridges to the tools people train and
deploy with, each importing its tool: not imported here).
"""

from . import versions  # first: a torch outside the tested range warns before anything fails
from .audit.fp8 import Fp8Record
from .audit.grad_hist import GradHistogram
from .audit.lints import Lint, lint
from .audit.report import AuditReport, OpRecord, audit
from .compile_backend import AmpBackend, backend, compile
from .convert import convert
from .errors import AmpRewriteError, AutocastOverrideWarning, RecaptureWarning
from .explain import explain
from .htmlreport import html_report
from .policy.policy import Policy
from .precision.compare import GradError, NodeError, PrecisionReport, compare
from .precision.search import SearchResult, search
from .policy.registry import register_op, unregister_op
from .policy.tables import OpCategory
from .runtime.kept_copies import cache_weights, clear_weight_cache
from .training.master_weights import MasterWeights
from .training.memory import MemoryComparison, MemoryReport, compare_memory, memory_report
from .training.scaler_monitor import ScalerMonitor, StepRecord

__all__ = [
    # convert a model
    "convert", "Policy", "OpCategory", "register_op", "unregister_op", "AmpRewriteError",
    "RecaptureWarning", "AutocastOverrideWarning",
    "clear_weight_cache", "cache_weights",
    # models with graph breaks
    "compile", "backend", "AmpBackend",
    # see what it did
    "explain", "html_report", "lint", "Lint", "audit", "AuditReport", "OpRecord", "Fp8Record",
    "GradHistogram",
    # train
    "MasterWeights", "ScalerMonitor", "StepRecord",
    "memory_report", "compare_memory", "MemoryReport", "MemoryComparison",
    # which ops need fp32
    "compare", "PrecisionReport", "NodeError", "GradError", "search", "SearchResult",
]

__version__ = "0.1.0"
