"""How onegpu writes numbers and tables for people: bytes, times, ratios, and Markdown or plain-text tables
(through ``tabulate``). One module, so a MiB or a ratio reads the same in every report, terminal line and
benchmark. Every function takes None for "no value" and writes ``missing`` (``-`` unless told) for it.
Imports only the standard library and ``tabulate`` (itself stdlib only).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

MiB, GiB = 2**20, 2**30


def mib(n: float | None, unit: bool = True, missing: str = "-") -> str:
    """Bytes as whole MiB with thousands separators: ``1,234 MiB`` (``1,234`` without ``unit``)."""
    return missing if n is None else f"{n / MiB:,.0f}" + (" MiB" if unit else "")


def gib(n: float | None, missing: str = "-") -> str:
    """Bytes as GiB with two decimals: ``1.23 GiB``."""
    return missing if n is None else f"{n / GiB:.2f} GiB"


def size(n: float | None, missing: str = "-") -> str:
    """Bytes in the unit a person reads them in: :func:`mib` below 1 GiB, :func:`gib` from it."""
    return missing if n is None else gib(n) if n >= GiB else mib(n)


def ratio(x: float | None, missing: str = "-") -> str:
    """A ratio as ``1.23x``."""
    return missing if x is None else f"{x:.2f}x"


def num(x: float | None, fmt: str = ".1f", missing: str = "-") -> str:
    """A number in ``fmt``."""
    return missing if x is None else format(x, fmt)


def sci(x: float | None, missing: str = "-") -> str:
    """A difference in scientific notation (``1.23e-04``), ``0`` and ``inf`` as such."""
    if x is None:
        return missing
    if math.isinf(x):
        return "inf"
    return "0" if x == 0 else f"{x:.2e}"


def signed(x: float | None, missing: str = "-") -> str:
    """A signed difference with four decimals: ``+0.0123``."""
    return missing if x is None else f"{x:+.4f}"


def seconds(s: float | None, missing: str = "-") -> str:
    """Seconds, three decimals below 10 s and one above: ``0.615 s``, ``20.4 s``."""
    return missing if s is None else (f"{s:.3f} s" if s < 10 else f"{s:.1f} s")


def duration(s: float) -> str:
    """A time span for people: whole seconds below two minutes, minutes with one decimal above."""
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.0f} s"


def markdown_table(head: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A GitHub Markdown (pipe) table of ``rows`` under ``head``; cells are written as given (numbers
    already formatted; a ``|`` in a cell is escaped)."""
    from tabulate import tabulate
    cells = [[str(c).replace("|", "\\|") for c in r] for r in rows]
    return tabulate(cells, headers=list(head), tablefmt="github", disable_numparse=True)


def text_table(head: Sequence[str], rows: Iterable[Sequence], right: Sequence[int] = (),
               indent: str = "  ") -> list[str]:
    """A plain-text table as lines (tabulate's ``simple`` format: a header, a dash rule per column,
    columns two spaces apart), each line indented by ``indent``; columns in ``right`` right-aligned."""
    from tabulate import tabulate
    cells = [[str(c) for c in r] for r in rows]
    align = ["right" if j in right else "left" for j in range(len(head))]
    text = tabulate(cells, headers=list(head), tablefmt="simple", disable_numparse=True, colalign=align)
    return [(indent + line).rstrip() for line in text.splitlines()]
