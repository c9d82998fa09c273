"""Breaking one line of generated Python into lines of at most a given width, without
rewriting it: between the arguments of its calls, lists and tuples, continuation lines
aligned under the first argument (or indented by four where that is far right), else its
value in parentheses on the next line (:mod:`.layout` lays converted code out with it)::

    linear = torch.nn.functional.linear(layer_norm_bf16, blocks_0_qkv_weight_bf16,
                                        blocks_0_qkv_bias_bf16)
"""

from __future__ import annotations

import ast
import io
import tokenize

__all__ = ["wrap", "wrap_def"]


def wrap(statement: str, width: int, room: int = 0, parenthesize: bool = True) -> list[str]:
    """``statement`` (one line of Python) as lines of at most ``width`` characters where it
    can be, the last leaving ``room`` more: broken between the arguments of its calls, lists
    and tuples, continuation lines aligned under the first argument (or, where that is far
    right, indented by four), else (``parenthesize``) its value in parentheses on the next
    line. Text is never rewritten, only broken; a statement that cannot be parsed stays one
    line."""
    if len(statement) + room <= width or not statement.isascii():
        return [statement]
    try:
        tree = ast.parse(statement)
    except SyntaxError:
        return [statement]
    if len(tree.body) != 1:
        return [statement]
    stmt = tree.body[0]
    value: ast.AST | None = None
    if isinstance(stmt, (ast.Assign, ast.Expr, ast.Return)):
        value = stmt.value
    elif isinstance(stmt, ast.Delete) and len(stmt.targets) == 1:
        value = stmt.targets[0]
    if value is None or value.end_col_offset != len(statement):  # type: ignore[attr-defined]
        return [statement]
    prefix = statement[:value.col_offset]  # type: ignore[attr-defined]
    lines = _layout(statement, value, len(prefix), width, 0, room)
    lines = [prefix + lines[0], *lines[1:]]
    if parenthesize and prefix.strip() and _overflow(lines, width, room):
        # ``name = (`` and the value on the lines after, indented by four
        inner = _layout(statement, value, 4, width, 4, room + 1)
        parenthesized = [prefix + "(", "    " + inner[0], *inner[1:]]
        parenthesized[-1] += ")"
        if _overflow(parenthesized, width, room) < _overflow(lines, width, room):
            return parenthesized
    return lines


def _overflow(lines: list[str], width: int, room: int) -> int:
    """How many characters ``lines`` run past ``width`` (the last past ``width - room``)."""
    return sum(max(0, len(line) - width) for line in lines[:-1]) + \
        max(0, len(lines[-1]) + room - width)


def _parts(src: str, node: ast.AST) -> tuple[str, list[ast.AST], str] | None:
    """A breakable expression as its head up to the opening bracket, its elements and the
    text after the last one (``)``, ``,)``); None where it cannot be broken."""
    start, end = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
    if isinstance(node, ast.Call):
        children: list[ast.AST] = [*node.args, *node.keywords]
        opening = src.index("(", node.func.end_col_offset)  # type: ignore[attr-defined]
    elif isinstance(node, (ast.List, ast.Tuple)) and src[start] in "([":
        children, opening = list(node.elts), start
    elif isinstance(node, ast.Subscript):
        children = [node.slice]
        opening = src.index("[", node.value.end_col_offset)  # type: ignore[attr-defined]
    else:
        return None
    if not children:
        return None
    children.sort(key=lambda c: c.col_offset)  # type: ignore[attr-defined]
    last = children[-1].end_col_offset  # type: ignore[attr-defined]
    return src[start:opening + 1], children, src[last:end]


def _layout(src: str, node: ast.AST, column: int, width: int, indent: int,
            room: int = 0) -> list[str]:
    """``node``'s text starting at ``column``, its last line leaving ``room``: the first line
    without its indentation, the next ones with theirs (``indent``: that of the enclosing
    continuation lines). Elements aligned under the first, or, where that runs past
    ``width`` or starts far right, on lines of their own indented by four."""
    text = src[node.col_offset:node.end_col_offset]  # type: ignore[attr-defined]
    parts = _parts(src, node) if column + len(text) + room > width else None
    if parts is None:
        return [text]
    head = parts[0]
    aligned = column + len(head)
    if aligned > width // 2 and aligned > indent + 8:
        return _fill(src, parts, column, width, indent, room, hanging=True)
    lines = _fill(src, parts, column, width, indent, room, hanging=False)
    if aligned > indent + 4 and _overflow([" " * column + lines[0], *lines[1:]], width, room):
        hanging = _fill(src, parts, column, width, indent, room, hanging=True)
        if _overflow([" " * column + hanging[0], *hanging[1:]], width, room) < \
                _overflow([" " * column + lines[0], *lines[1:]], width, room):
            return hanging
    return lines


def _fill(src: str, parts: tuple[str, list[ast.AST], str], column: int, width: int,
          indent: int, room: int, hanging: bool) -> list[str]:
    """The elements of ``parts`` (:func:`_parts`) filled into lines after the head: aligned
    under the first, or (``hanging``) from a line of their own indented by four."""
    head, children, tail = parts
    inner = column + len(head)
    lines: list[str] = []
    current, offset = head, column  # the line being filled, and the column it starts at
    if hanging:
        inner = indent + 4
        lines.append(head)
        current, offset = " " * inner, 0
    for k, child in enumerate(children):
        last = k == len(children) - 1
        end, after = (tail, room) if last else (",", 0)
        fresh = current == head or not current.strip()
        sep = "" if fresh else " "
        col = offset + len(current) + len(sep)
        piece = _layout(src, child, col, width - len(end), inner, after)
        if len(piece) == 1 and col + len(piece[0]) + len(end) + after <= width:
            current += sep + piece[0] + end
            continue
        if not fresh:  # the element starts a line of its own
            lines.append(current)
            current, offset = " " * inner, 0
            piece = _layout(src, child, inner, width - len(end), inner, after)
        current += piece[0]
        if len(piece) > 1:
            lines.append(current)
            lines += piece[1:-1]
            current, offset = piece[-1], 0
        current += end
    lines.append(current)
    return lines


def wrap_def(line: str, width: int) -> list[str]:
    """A function's first line, ``def forward(self, a, b):``, as lines of at most ``width``
    characters where it can be: the parameters filled in, continuation lines aligned under
    the first. Text is never rewritten; a line that cannot be read stays as it is."""
    if len(line) <= width or not line.startswith("def ") or not line.isascii():
        return [line]
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, SyntaxError):
        return [line]
    depth, cuts, close = 0, [], None  # the commas between parameters, the closing bracket
    for token in tokens:
        if token.type != tokenize.OP:
            continue
        if token.string in "([{":
            depth += 1
        elif token.string in ")]}":
            depth -= 1
            if depth == 0 and close is None:
                close = token.start[1]
        elif token.string == "," and depth == 1 and close is None:
            cuts.append(token.start[1])
    if close is None or not cuts:
        return [line]
    start = line.index("(") + 1
    params = [line[a:b].strip() for a, b in zip([start] + [c + 1 for c in cuts], [*cuts, close])]
    params = [p for p in params if p]  # a trailing comma
    lines, current = [], line[:start]
    for k, param in enumerate(params):
        piece = param + ("," if k < len(params) - 1 else line[close:])
        if k == 0 or len(current) + 1 + len(piece) <= width:
            current += ("" if k == 0 else " ") + piece
        else:
            lines.append(current)
            current = " " * start + piece
    lines.append(current)
    return lines
