"""What a capture read of the model's Python state: attributes, configs, which submodule sits where.

A capture runs the model's forward once and bakes into the graph everything that Python code
read along the way: a flag that picked a branch, a float that became a constant, the config
value that decided which outputs exist, the submodules it called. A converted module that is
to stay the model must know those reads, to tell at each call whether they still hold
(:mod:`amprewrite.capture.snapshot`).

:func:`recording_reads` records them. For the duration of the capture, each module of the model
is given a subclass of its own class (made once per class, with the same name, module and
qualified name) that overrides ``__getattribute__`` and ``__getattr__`` to note each read; the
modules' classes are put back on exit, errors included. Nothing of torch is changed and no
module of the model is left changed; ``type(m) is C`` does not hold *during* the capture,
``isinstance`` does. NB: the model must not be used from another thread while it is captured.

What is noted, per module of the model (objects the forward makes, such as the slice of a
``ModuleList``, are not the model's state and are not noted):

* an attribute found in the instance ``__dict__``, a submodule found in ``_modules``: where
  (:attr:`Reads.values`);
* an attribute found on the class (a method, a class-level default) or not found at all
  (``getattr(self, "x", None)``): that the instance does not hold one
  (:attr:`Reads.absent`), since setting it later would shadow it;
* the table of submodules read as a whole (iterating a ``ModuleList``): :attr:`Reads.walked`;
* a parameter or buffer read: its slot (:attr:`Reads.tensors`);
* its ``forward`` (looked up by each call of it): the instance's own, or the function its
  class provides, found in the class dicts along its method resolution order
  (:attr:`Reads.values` and :attr:`Reads.absent`, owned by the classes), so that a forward
  replaced on the instance or on its class after conversion is a change;
* a *config object* read from a module (an HF ``PretrainedConfig``, any dataclass instance,
  ``SimpleNamespace``, or an object with ``to_dict``): the whole object (:attr:`Reads.configs`),
  since the forward reads it through helpers the recording cannot see into.

``training`` is noted on the submodules only, and only where the converted module is a view of
the model (:mod:`amprewrite.module.tree`), whose flags are the model's: a graph captured with
``model.bn.eval()`` under a training root computes batch norm with running statistics, so
``bn.training`` is a value it read like any other (a submodule switched on its own,
``model.bn.eval()`` to freeze it, is then a change of state). The root's flag is the converted
module's mode (``gm.train()``/``gm.eval()``, :mod:`amprewrite.module.modes`), guarded apart;
the flags of a module's private copy (O3's low-precision twin) follow no one's switches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..graph.meta import CONVERTED_KEY
from .keywords import is_presented

__all__ = ["Reads", "recording_reads", "is_config", "restore_classes", "note_leaf_modules",
           "restore_writes", "note_forward"]

_MODULE_INTERNALS = frozenset(dir(nn.Module)) | frozenset(nn.Module().__dict__) | {"__dict__"}
"""Names that are torch's bookkeeping, not the model's state (``training``: see above)."""

_TENSOR_TABLES = ("_parameters", "_buffers")

TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"


Slot = tuple[Any, str, str]
"""``(owner, table, key)``: where a read looked: ``owner.__dict__`` (``table`` ``"__dict__"``)
or one of a module's tables (``"_modules"``, ``"_parameters"``, ``"_buffers"``)."""


def _own_modules(model: nn.Module) -> Iterator[nn.Module]:
    """``model.modules()``, but not below a converted module inside it: its submodules are its
    own model's (:mod:`amprewrite.module.tree`), whose state its own cache guards, and whose
    classes must stay as they are while that cache checks them at the call."""
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield module
        if module is not model and CONVERTED_KEY in getattr(module, "meta", {}):
            continue
        stack.extend(reversed([m for m in module._modules.values() if m is not None]))


class Reads:
    """The reads of one capture, each place once (keyed by the owner's identity)."""

    def __init__(self, model: nn.Module, flags: bool = False) -> None:
        self.owners: dict[int, nn.Module] = {id(m): m for m in _own_modules(model)}
        self.flags = flags
        """Whether the submodules' ``training`` reads are noted (module docstring)."""
        self.root = model
        self.values: dict[tuple[int, str, str], Slot] = {}
        """Found: an attribute in ``__dict__``, a submodule in ``_modules``."""
        self.absent: dict[tuple[int, str, str], Slot] = {}
        """Looked for and not found there (a class attribute, a method, a missing name)."""
        self.walked: dict[int, nn.Module] = {}
        """Containers (``ModuleList``...) whose ``_modules`` was read as a whole (iterated,
        counted, sliced), and modules whose ``_modules`` the model's own code read."""
        self.tensors: dict[tuple[int, str, str], Slot] = {}
        """Parameter and buffer slots read."""
        self.configs: dict[int, object] = {}
        self.written: dict[tuple[int, str], tuple[nn.Module, str, Any, Any]] = {}
        """Attributes the forward set on the model's modules: ``(module, name, value
        before, value after)`` (see :func:`restore_writes`)."""

    def blind(self, model: nn.Module) -> bool:
        """Whether the recording saw nothing of a model that has state to read: a sign that
        the capture ran the forward on objects other than the model's (a future torch
        copying the model before tracing), which would leave changes unseen."""
        has_state = len(self.owners) > 1 or next(model.parameters(), None) is not None
        return has_state and not (self.values or self.tensors or self.absent or self.walked)

    def found(self, owner: object, table: str, key: str, value: Any) -> None:
        self.values.setdefault((id(owner), table, key), (owner, table, key))
        if is_config(value):
            self.configs.setdefault(id(value), value)

    def missing(self, owner: object, table: str, key: str) -> None:
        self.absent.setdefault((id(owner), table, key), (owner, table, key))


_active: list[Reads] = []


def is_config(value: Any) -> bool:
    """A plain object holding settings, read through helpers: watched whole."""
    if isinstance(value, (nn.Module, type)) or not hasattr(value, "__dict__"):
        return False
    return (dataclasses.is_dataclass(value) or isinstance(value, types.SimpleNamespace)
            or callable(getattr(type(value), "to_dict", None)))


def _note_getattribute(module: nn.Module, name: str, value: Any) -> None:
    reads = _active[-1]
    if id(module) not in reads.owners:
        return  # an object the forward made (a ModuleList slice), not the model's
    if name == "forward":
        note_forward(reads, module)
        return
    if name in _MODULE_INTERNALS or name.startswith("__"):
        if name == "training" and reads.flags and module is not reads.root:
            reads.found(module, "__dict__", name, value)
        elif name == "_modules" and (isinstance(module, _CONTAINERS) or _read_by_model_code()):
            reads.walked.setdefault(id(module), module)
        return
    if name in object.__getattribute__(module, "__dict__"):
        reads.found(module, "__dict__", name, value)
    elif not _is_data_descriptor(type(module), name):
        reads.missing(module, "__dict__", name)  # an instance value would shadow the class's


def note_forward(reads: Reads, module: nn.Module) -> None:
    """``module.forward`` looked up (its call): the instance's own, or else the function its
    class's method resolution finds, and that no class before it defines one (a forward set
    on the instance, or on its class or a base, after conversion, is another forward)."""
    own = object.__getattribute__(module, "__dict__")
    if "forward" in own:
        if not is_presented(own["forward"]):  # not the model's: the capture's own
            reads.found(module, "__dict__", "forward", own["forward"])
        return
    reads.missing(module, "__dict__", "forward")
    cls = type(module)
    for klass in _ORIGINAL.get(cls, cls).__mro__:
        if "forward" in vars(klass):
            reads.found(klass, "__dict__", "forward", vars(klass)["forward"])
            return
        reads.missing(klass, "__dict__", "forward")


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _read_by_model_code() -> bool:
    """Whether the ``_modules`` read being noted comes from code outside torch (the model's
    own, ``for child in self._modules.values()``), not from torch's bookkeeping
    (``named_parameters`` and the like, which the capture itself calls on every module)."""
    frame = sys._getframe(3)  # _note_getattribute <- __getattribute__ <- the reader
    return frame is not None and not frame.f_code.co_filename.startswith(TORCH_DIR)


def _note_getattr(module: nn.Module, name: str, value: Any, found: bool) -> None:
    reads = _active[-1]
    if id(module) not in reads.owners or name.startswith("__"):
        return
    own = object.__getattribute__(module, "__dict__")
    if found:
        for table in _TENSOR_TABLES:
            if name in own.get(table, ()):
                reads.tensors.setdefault((id(module), table, name), (module, table, name))
                return
        if name in own.get("_modules", ()):
            reads.found(module, "_modules", name, value)
        elif name in own:  # a class's own __getattr__ that found it in the instance dict
            reads.found(module, "__dict__", name, value)
        return
    # Not found: a submodule, tensor or attribute set later under that name would be read.
    for table in ("_modules", *_TENSOR_TABLES):
        if table in own:
            reads.missing(module, table, name)


_MISSING = object()


def _note_setattr(module: nn.Module, name: str, value: Any) -> None:
    reads = _active[-1]
    if id(module) not in reads.owners or name in _MODULE_INTERNALS or name.startswith("__"):
        return
    own = object.__getattribute__(module, "__dict__")
    if any(name in own.get(t, ()) for t in ("_parameters", "_buffers", "_modules")):
        return  # a tensor or submodule: torch.export records buffer updates itself
    key = (id(module), name)
    before = reads.written[key][2] if key in reads.written else own.get(name, _MISSING)
    reads.written[key] = (module, name, before, value)


def restore_writes(reads: Reads, model: nn.Module) -> list[str]:
    """Put back what the captured forward changed on the model's modules (a capture leaves
    the model as it was; an attribute it set where there was none is kept, as a first eager
    call would leave it); return the Python values it changed, named by path
    (``steps: 0 -> 1``): a graph cannot repeat such a write at each call."""
    path = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    changed = []
    for module, name, before, after in reads.written.values():
        if before is _MISSING:
            continue  # set once, on the first run (a library's "hooks installed" flag): kept
        object.__getattribute__(module, "__dict__")[name] = before
        if isinstance(after, (bool, int, float, str)) and (
                type(before) is not type(after) or before != after):
            where = f"{path.get(id(module), '?')}.{name}".lstrip(".")
            changed.append(f"{where}: {before!r} -> {after!r}")
    return changed


def _is_data_descriptor(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            attr = klass.__dict__[name]
            return hasattr(type(attr), "__set__") or hasattr(type(attr), "__delete__")
    return False


_RECORDING: dict[type, type] = {}
"""Original class -> its recording subclass (made once, kept: classes live as long anyway)."""
_ORIGINAL: dict[type, type] = {}
"""Recording subclass -> the original class."""


def _recording_class(cls: type) -> type:
    sub = _RECORDING.get(cls)
    if sub is not None:
        return sub
    # NB: the parent's methods are looked up at each call, not once here: the symbolic tracer
    # replaces nn.Module.__getattr__ while it traces (to hand out proxies for parameters).

    def __getattribute__(self: nn.Module, name: str) -> Any:
        value = cls.__getattribute__(self, name)
        if _active:
            _note_getattribute(self, name, value)
        return value

    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        if _active:
            _note_setattr(self, name, value)
        cls.__setattr__(self, name, value)

    namespace: dict[str, Any] = {"__slots__": (), "__getattribute__": __getattribute__,
                                 "__setattr__": __setattr__,
                                 "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    if hasattr(cls, "__getattr__"):
        def __getattr__(self: nn.Module, name: str) -> Any:
            try:
                value = cls.__getattr__(self, name)  # type: ignore[attr-defined]
            except AttributeError:
                if _active:
                    _note_getattr(self, name, None, found=False)
                raise
            if _active:
                _note_getattr(self, name, value, found=True)
            return value

        namespace["__getattr__"] = __getattr__
    sub = type(cls)(cls.__name__, (cls,), namespace)
    _RECORDING[cls] = sub
    _ORIGINAL[sub] = cls
    return sub


def restore_classes(root: nn.Module) -> None:
    """Put back the original class of any module under ``root`` that a capture copied while
    it was being recorded (``copy.copy`` of a module keeps its class)."""
    for module in root.modules():
        original = _ORIGINAL.get(type(module))
        if original is not None:
            object.__setattr__(module, "__class__", original)


def _restore_classes(swapped: list[tuple[nn.Module, type]]) -> None:
    for module, cls in swapped:
        object.__setattr__(module, "__class__", cls)


@contextlib.contextmanager
def recording_reads(model: nn.Module, flags: bool = False) -> Iterator[Reads]:
    """Note what the code run inside the block reads of ``model`` (module docstring);
    ``flags``: its submodules' ``training`` flags too.

    A module whose class cannot take a subclass (``__class__`` assignment refused) is not
    recorded; its reads are then unseen, which the snapshot says (``unwatched``)."""
    reads = Reads(model, flags)
    swapped: list[tuple[nn.Module, type]] = []
    try:
        for module in reads.owners.values():
            cls = type(module)
            if cls in _ORIGINAL:
                continue  # recorded already by an enclosing capture
            try:
                object.__setattr__(module, "__class__", _recording_class(cls))
            except TypeError:
                continue
            swapped.append((module, cls))
        _active.append(reads)
        yield reads
    finally:
        if _active and _active[-1] is reads:
            _active.pop()
        _restore_classes(swapped)


def note_leaf_modules(reads: Reads, model: nn.Module, gm: torch.fx.GraphModule) -> None:
    """The symbolic capture keeps some layers whole (``self.drop(x)`` calls a copy of the
    model's ``Dropout``), so their forward runs at each call and reads their attributes then:
    note each such layer's whole state as read (its copy holds the values it had)."""
    for node in gm.graph.find_nodes(op="call_module"):
        try:
            module = model.get_submodule(str(node.target))
        except AttributeError:
            continue
        for name, value in module.__dict__.items():
            if name not in _MODULE_INTERNALS and not name.startswith("__"):
                reads.found(module, "__dict__", name, value)
