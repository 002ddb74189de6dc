"""Write offline.html: DVC's plots page template with vega, vega-lite and vega-embed inlined.

DVC's own page loads those three scripts from a CDN, so without a network `dvc plots show/diff`
gives a blank page. .dvc/config names this template (``[plots] html_template = plots/offline.html``),
so every `dvc plots` command uses it; DVC replaces ``{plot_divs}`` (and ``{refresh_tag}``) and, as
the template has no ``{scripts}`` placeholder, adds no CDN script tags.

Regenerate (versions and licences: LICENSES.md beside this file)::

    cd /tmp && npm pack vega@5 vega-lite@5 vega-embed@6   # then unpack the three .tgz files
    python .dvc/plots/build_template.py VEGA.min.js VEGA_LITE.min.js VEGA_EMBED.min.js
"""
from __future__ import annotations

import sys
from pathlib import Path

HEAD = """<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
{refresh_tag}
<title>DVC plots (onegpu)</title>
<!-- vega, vega-lite and vega-embed are inlined below (BSD-3-Clause; .dvc/plots/LICENSES.md), so this
     page needs no network. Template: .dvc/plots/offline.html, named in .dvc/config. -->
<style>
  body { font-family: sans-serif; }
  table { border-spacing: 15px; }
</style>
"""
TAIL = """</head>
<body>
{plot_divs}
</body>
</html>
"""


def build(scripts: list[Path], out: Path) -> None:
    """Inline ``scripts`` (in order: vega, vega-lite, vega-embed) into the template at ``out``.

    Raises:
        ValueError: a script contains ``</script`` or one of DVC's placeholders, which would break the page.
    """
    parts = [HEAD]
    for path in scripts:
        text = path.read_text(encoding="utf8")
        for bad in ("</script", "{plot_divs}", "{scripts}", "{refresh_tag}"):
            if bad in text:
                raise ValueError(f"{path} contains {bad!r}: it cannot be inlined")
        parts.append(f"<!-- {path.name} -->\n<script>\n{text}\n</script>\n")
    parts.append(TAIL)
    out.write_text("".join(parts), encoding="utf8")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    build([Path(p) for p in sys.argv[1:]], Path(__file__).with_name("offline.html"))
