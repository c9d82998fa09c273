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
__version__ = "0.1.0"
