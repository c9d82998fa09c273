"""The layout of a converted module's code: what ``gm.code`` and ``gm.print_readable()`` show.

torch.fx emits one line per node, however long, and frees each value after its last use by
appending ``;  a = b = None``. :class:`CodeLayout` rewrites that text node by node (it runs
as the code generator's body transformer, so torch.fx's line-number map, which the auditor
reads, still maps every line to its node):

* **The weight read** is one statement, one name per line, each with what it holds::

      (emb_weight,    # f32[32, 16]
       fc_weight,     # f32[16, 16] or its kept bf16 copy
       fc_bias,       # f32[16] or its kept bf16 copy
      ) = self._amp_weights.fetch(cache=self._amp_weight_cache)

  in place of ``weights = _amp_weights.fetch(<every entry>)`` and a ``w = weights[i]`` line
  per weight (the entries are the table's own, :mod:`amprewrite.runtime.weight_table`). The
  names are not deleted after their last use: each is a tensor the module or its caches
  hold anyway.
* **A comment with dtype and shape** ends each line that produces a floating tensor,
  ``# bf16[s0, s1, 16]``, as ``print_readable`` annotates (symbolic sizes numbered in order
  of appearance, so that a listing does not change with torch's symbol numbering). A
  parameter cast says what it is: ``# bf16[16, 16] kept copy or autograd cast`` (without
  gradients, the weight read handed over the kept copy, which the cast returns as it is;
  with them, it is the cast autograd records), unlike an activation cast, which casts.
* **No line is longer than** :data:`WIDTH`: a long call is wrapped at its arguments, and the
  values freed after a node are deleted by ``del a, b`` on the same line where it fits, else
  on the next; a comment that does not fit goes above its statement.
* ``torch._C._nn.linear`` reads ``torch.nn.functional.linear`` (the same function), a slice
  ``x[..., 0:4]`` (not ``x[(Ellipsis, slice(0, 4, None))]``), and a call whose value is
  never used (``self._guards_fn(x)``) is not assigned.
"""

from __future__ import annotations

import operator
import re
import sys
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.fx.graph import dtype_abbrs

from ..runtime.weight_cache import CACHE_ATTR
from ..runtime.low_copies import LOW_COPIES_ATTR
from ..runtime.weight_table import LOW_COPY, WEIGHTS_ATTR, is_fetch
from .wrapping import wrap

__all__ = ["CodeLayout", "WIDTH", "tensor_dtype"]

WIDTH = 100
"""The longest line of generated code, the project's formatter width (indentation included)."""

_INDENT = 4  # torch.fx indents the body of ``forward`` by four spaces
_COUNTER = re.compile(r"^# COUNTER: (\d+)\n", re.MULTILINE)  # torch.fx's per-node marker
_FREED = re.compile(r"^(.*);  ((?:[A-Za-z_][A-Za-z0-9_]* = )+)None$", re.DOTALL)
_SYMBOL = re.compile(r"\bs(\d+)\b")
_HOLDERS = (WEIGHTS_ATTR, CACHE_ATTR, LOW_COPIES_ATTR)
_FUNCTIONAL = "torch._C._nn."


class CodeLayout:
    """The body transformer of one code generation: ``nodes`` as torch.fx passes them,
    ``root_module`` (``"self"``) and ``weight_casts``, the parameter casts that the weight
    read hands a kept copy where no gradient is needed (:func:`~.codegen.recompile_with_bindings`).
    Call it on torch.fx's body (a list of strings with a ``# COUNTER: i`` line before each
    node's text); names are read through ``repr(node)``, which torch.fx points at its
    namespace while it generates code."""

    def __init__(self, nodes: Iterable[fx.Node], root_module: str,
                 weight_casts: frozenset[fx.Node], namespace: Any,
                 indexing: frozenset[fx.Node] = frozenset()) -> None:
        self.nodes = list(nodes)
        self.root = root_module
        self.weight_casts = weight_casts
        self.indexing = indexing
        self.namespace = namespace
        self.symbols: dict[str, str] = {}
        self.inlined: set[fx.Node] = set()  # holders written into the weight read
        self.items: dict[fx.Node, fx.Node] = {}  # weights[i] item -> its fetch
        for node in self.nodes:
            if is_fetch(node):
                self.items.update({u: node for u in node.users if _item_index(u) is not None})
                self.inlined.update(a for a in (node.args[0], *node.kwargs.values())
                                    if _inlinable(a, node))

    def __call__(self, body: list[str]) -> list[str]:
        parts = _COUNTER.split("".join(body))
        chunks = [(self.nodes[int(i)], int(i), chunk) for i, chunk in zip(parts[1::2], parts[2::2])]
        # NB: the weight read's items are not deleted after their last use either: each is a
        # tensor the module or its caches hold anyway (a parameter, a buffer, a kept copy).
        unbound = {repr(n) for n in (*self.inlined, *self.items.values(), *self.items)}
        freed_after: dict[fx.Node, list[str]] = {}  # a weight read: what its items free
        read = None
        for node, _, chunk in chunks:
            if is_fetch(node):
                read = node
            if is_fetch(node) or node in self.inlined or node in self.items:
                freed = [n for n in _split_freed(chunk)[1] if n not in unbound]
                if read is not None:
                    freed_after.setdefault(read, []).extend(freed)
        out = [parts[0]]
        for node, index, chunk in chunks:  # in order: symbols are numbered as they appear
            out.append(f"# COUNTER: {index}\n")
            if is_fetch(node):
                out.append(self._weight_read(node, freed_after.get(node, [])))
            elif node not in self.inlined and node not in self.items:
                out.append(self._node(node, chunk, unbound))
        return out

    # -- one node -------------------------------------------------------------------------
    def _node(self, node: fx.Node, chunk: str, unbound: set[str]) -> str:
        if not chunk.strip():
            return chunk
        lines = chunk.rstrip("\n").split("\n")
        statement, freed = _split_freed(lines[-1])
        freed = [n for n in freed if n not in unbound]
        name = repr(node)
        if name in freed and statement.startswith(f"{name} = ") and node.op != "placeholder":
            # A value nobody uses: the call alone (torch.fx assigns it and frees it at once).
            freed.remove(name)
            statement = statement[len(name) + 3:]
        if node.op == "call_function" and statement.find(f"= {_FUNCTIONAL}") >= 0:
            statement = _public_functional(statement, node)
        if node in self.indexing and statement.startswith(f"{name} = "):
            index = _index_text(node.args[1])
            if index is not None:
                statement = f"{name} = {repr(node.args[0])}[{index}]"
        comment = self._comment(node)
        return "".join(f"{line}\n" for line in lines[:-1]) + \
            _statement_lines(statement, comment, freed)

    def _comment(self, node: fx.Node) -> str:
        val = node.meta.get("val")
        text = self.tensor(val) if _floating(val) else ""
        if node in self.weight_casts:
            text += " kept copy or autograd cast"
        return text.strip()

    def tensor(self, val: torch.Tensor) -> str:
        """``bf16[s0, 16]``: dtype and shape, symbolic sizes numbered in order of appearance."""
        dims = ", ".join(_SYMBOL.sub(self._symbol, str(d)) for d in val.shape)
        return f"{tensor_dtype(val.dtype)}[{dims}]"

    def _symbol(self, match: re.Match) -> str:
        return self.symbols.setdefault(match.group(0), f"s{len(self.symbols)}")

    # -- the weight read -------------------------------------------------------------------
    def _weight_read(self, fetch: fx.Node, freed: list[str]) -> str:
        entries = fetch.args[1:]
        items: dict[int, fx.Node] = {}
        aliases = []  # a second read of one entry (two reads of one folded constant)
        for user in fetch.users:
            i = _item_index(user)
            if i is not None and i in items:
                aliases.append(f"{repr(user)} = {repr(items[i])}")
            elif i is not None:
                items[i] = user
        names, notes = [], []
        for i, entry in enumerate(entries):
            item = items.get(i)
            if item is None:  # an entry no node reads (its reader was removed)
                names.append(self.namespace.create_name("_unused", None))
                notes.append("")
                continue
            names.append(repr(item))
            val = item.meta.get("val")
            note = self.tensor(val) if _floating(val) else ""
            if len(entry) == 2:
                note += f" or its kept {tensor_dtype(entry[1])} copy"
            elif len(entry) == 3 and entry[2] == LOW_COPY:
                note += " stored copy (O2)"
            notes.append(note.strip())
        holder = self._operand(fetch.args[0])
        kwargs = ", ".join(f"{k}={self._operand(v)}" for k, v in fetch.kwargs.items())
        if not names:
            return f"{holder}.fetch({kwargs})\n"
        call = f") = {holder}.fetch({kwargs})"
        # The notes aligned, as far right as the longest note leaves room for.
        column = min(max(len(n) for n in names) + 2,  # "(" or " ", the name, ","
                     WIDTH - _INDENT - 4 - max(len(n) for n in notes))
        lines = []
        for k, (name, note) in enumerate(zip(names, notes)):
            line = ("(" if k == 0 else " ") + name + ","
            if note and len(line.ljust(column)) + 4 + len(note) > WIDTH - _INDENT:
                lines.append(f" # {note}")  # a name too long for its note: the note above
                lines.append(line)
            else:
                lines.append(f"{line.ljust(column)}  # {note}" if note else line)
        lines.append(call)
        lines += aliases
        if freed:
            lines += _wrapped_del(freed)
        return "".join(f"{line}\n" for line in lines)

    def _operand(self, arg: Any) -> str:
        if isinstance(arg, fx.Node) and arg in self.inlined:
            return f"{self.root}.{arg.target}"
        return repr(arg)


def tensor_dtype(dtype: torch.dtype) -> str:
    """torch.fx's short name of a dtype (``bf16``), as ``print_readable`` writes it."""
    return dtype_abbrs.get(dtype, str(dtype).replace("torch.", ""))


def _index_text(index: Any) -> str | None:
    """A tensor index as eager code writes it, ``..., 0:4`` for ``(Ellipsis, slice(0, 4,
    None))``, ``:, idx`` for ``(slice(None, None, None), idx)``; the end ``sys.maxsize`` is
    left out (``4:``: what Python passes for it). None for an index of other parts."""
    def bound(value: Any) -> str | None:
        if value is None:
            return ""
        if isinstance(value, fx.Node):
            return repr(value)
        return str(value) if type(value) is int else None

    parts = []
    for part in index if isinstance(index, tuple) else (index,):
        if part is Ellipsis:
            parts.append("...")
            continue
        if isinstance(part, fx.Node):  # a tensor index
            parts.append(repr(part))
            continue
        if not isinstance(part, slice):
            return None
        start, stop, step = bound(part.start), bound(part.stop), bound(part.step)
        if start is None or stop is None or step is None:
            return None
        stop = "" if part.stop == sys.maxsize else stop
        parts.append(f"{start}:{stop}" + (f":{step}" if step else ""))
    return ", ".join(parts) if parts else None


def _floating(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _item_index(node: fx.Node) -> int | None:
    if node.op == "call_function" and node.target is operator.getitem and \
            isinstance(node.args[1], int):
        return node.args[1]
    return None


def _inlinable(arg: Any, fetch: fx.Node) -> bool:
    """A holder (the table, the cast cache, O2's store) that only the weight read uses."""
    return isinstance(arg, fx.Node) and arg.op == "get_attr" and arg.target in _HOLDERS and \
        set(arg.users) == {fetch}


def _split_freed(text: str) -> tuple[str, list[str]]:
    """A line of torch.fx's code and the names it frees (``x = f(y);  y = None``)."""
    match = _FREED.match(text.rstrip("\n"))
    if match is None:
        return text.rstrip("\n"), []
    return match.group(1), match.group(2).split(" = ")[:-1]


def _public_functional(statement: str, node: fx.Node) -> str:
    """``torch._C._nn.linear(`` as ``torch.nn.functional.linear(``, where that is the same
    function."""
    target = node.target
    name = getattr(target, "__name__", None)
    if name is None or getattr(torch.nn.functional, name, None) is not target:
        return statement
    return statement.replace(f"= {_FUNCTIONAL}{name}(", f"= torch.nn.functional.{name}(", 1)


def _statement_lines(statement: str, comment: str, freed: list[str]) -> str:
    """One node's statement, wrapped to :data:`WIDTH`, its comment at the end of its last
    line and ``del`` of the freed names on that line where it fits, else on the next."""
    width = WIDTH - _INDENT
    note = f"  # {comment}" if comment else ""
    dels = f";  del {', '.join(freed)}" if freed else ""
    if len(statement) + len(dels) + len(note) <= width:
        return statement + dels + note + "\n"
    if len(statement) + len(note) <= width:
        return "".join(f"{line}\n" for line in [statement + note, *_wrapped_del(freed)])
    # Room for the comment on the last line; the value parenthesized on lines of its own
    # only where the statement alone is too long (else the comment goes above it).
    lines = wrap(statement, width, room=len(note), parenthesize=len(statement) > width)
    last = lines[-1]
    if len(last) + len(dels) + len(note) <= width:
        lines[-1] = last + dels + note
    else:
        if len(last) + len(note) <= width:
            lines[-1] = last + note
        elif note:
            lines.insert(0, note.strip())  # above a statement that cannot be broken
        if freed:
            lines += _wrapped_del(freed)
    return "".join(f"{line}\n" for line in lines)


def _wrapped_del(names: list[str]) -> list[str]:
    text = f"del {', '.join(names)}"
    if len(text) <= WIDTH - _INDENT:
        return [text]
    return wrap(f"del ({', '.join(names)})", WIDTH - _INDENT)
