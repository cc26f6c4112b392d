"""Tables and headings for people, on a terminal or into a pipe, never cut.

rich sizes its output to the terminal; into a pipe or a file it assumes 80 columns, where a
rule's title is cut with an ellipsis (``(22 tokens, 3 traine…``) and every table row wider than
80 columns wraps inside its cells.  :func:`console` gives such an output ``COLUMNS`` columns
when the environment sets it, else :data:`PIPE_WIDTH`, so that a table keeps one line per row
(a wider cell still wraps at its words, never cut), and :func:`heading` writes a rule's title as
one whole line there.
"""

from __future__ import annotations


from rich.console import Console

from pgs.runtime import process

#: Columns of output that goes to a pipe or a file (no terminal to measure).
PIPE_WIDTH = 200


def console(file=None, **kwargs) -> Console:
    """A ``rich`` console on ``file`` (None: stdout): the terminal's width on a terminal, else
    ``COLUMNS`` or :data:`PIPE_WIDTH`."""
    out = Console(file=file, **kwargs)
    if not out.is_terminal and not process.variable("COLUMNS"):
        out = Console(file=file, width=PIPE_WIDTH, **kwargs)
    return out


def heading(out: Console, title: str) -> None:
    """A rule with ``title`` on a terminal; one plain line ``── title ──`` elsewhere (never cut)."""
    if out.is_terminal:
        out.rule(title)
    else:
        out.print(f"── {title} ──", markup=False, highlight=False, soft_wrap=True)
