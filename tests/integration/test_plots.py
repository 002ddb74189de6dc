"""`dvc plots show/diff` pages work offline: the project's template (.dvc/plots/offline.html, named in
.dvc/config) inlines vega, so the page loads nothing from the network and the charts render."""
from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest

from . import browser
from .conftest import dvc, make_project

pytestmark = pytest.mark.slow


class _Refs(HTMLParser):
    """Every src/href attribute and every inline script's length."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.inline_scripts = 0

    def handle_starttag(self, tag, attrs):
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]
        self._in_script = tag == "script" and not dict(attrs).get("src")

    def handle_data(self, data):
        if getattr(self, "_in_script", False) and len(data) > 10_000:
            self.inline_scripts += 1
        self._in_script = False


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    """`dvc plots show` on a tiny project with the two plot files written by hand (no training needed)."""
    project = make_project(tmp_path_factory.mktemp("plots"))
    (project / "plots").mkdir()
    (project / "plots/train_steps.csv").write_text(
        "step,loss,grad_norm,samples_per_second,mem_peak_mib\n"
        + "".join(f"{s},{2.0 - 0.1 * s},{1.0},{40 + s % 3},{150 + s}\n" for s in range(1, 11)))
    (project / "plots/predictions.csv").write_text("actual,predicted\nsport,sport\nsport,tech\ntech,tech\n")
    dvc(project, "plots", "show")
    return project / "dvc_plots/index.html"


def test_plots_page_references_no_network_url(page):
    html = page.read_text()
    refs = _Refs()
    refs.feed(html)
    remote = [r for r in refs.refs if r.startswith(("http:", "https:", "//"))]
    assert remote == [], remote  # DVC's own page loads vega from cdn.jsdelivr.net
    assert "cdn.jsdelivr.net" not in html
    assert refs.inline_scripts == 3  # vega, vega-lite, vega-embed
    assert html.count("vegaEmbed('#") == 4  # loss, memory and speed per step, and the confusion matrix


def test_plots_page_renders_without_network(page):
    shown = browser.load(page, budget_ms=20000, offline=True)  # a proxy that refuses every connection
    # vega-embed draws each chart into a <canvas class="marks"> inside the plot's div.
    assert shown.dom.count('class="marks"') == 4, shown.dom[-2000:]
