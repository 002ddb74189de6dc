"""Reading the rows of the Markdown tables the reports write (tabulate pads the cells)."""
from __future__ import annotations


def cells(line: str) -> list[str]:
    """The cells of one Markdown table line, stripped: ``| a  | b |`` -> ``["a", "b"]``."""
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def row(md: str, first: str) -> list[str]:
    """The cells of the first table row in ``md`` whose first cell starts with ``first``.

    Raises:
        StopIteration: no such row.
    """
    return next(cells(line) for line in md.splitlines()
                if line.startswith("|") and cells(line)[0].startswith(first))
