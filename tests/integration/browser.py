"""Headless Chromium for tests: load a URL (or a local file), return its rendered DOM and text, the
network requests it made, and optionally a screenshot.

Uses the ``chromium`` command line only (Debian's ``chromium`` package; ``.ci/run`` installs it), so
tests need no browser driver: ``--dump-dom`` prints the DOM after ``--virtual-time-budget`` ms of page
time, ``--screenshot`` writes a PNG, and ``--log-net-log`` records every request in Chromium's NetLog.
Reused by the tests of ``onegpu ui`` and of the offline ``dvc plots`` page.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from tests import needs

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars"]


def chromium_path() -> str | None:
    """The Chromium (or Chrome) executable on PATH, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def require_chromium() -> str:
    """The Chromium executable; skips the test where none is installed, fails it under CI (``.ci/run``
    installs it: :mod:`tests.needs`)."""
    exe = chromium_path()
    if exe is None:
        needs.missing("no chromium on PATH (apt-get install -y chromium chromium-driver)")
    return exe


class _Text(HTMLParser):
    """The visible text of an HTML document, one line per text node (scripts and styles left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "noscript", "template"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("script", "style", "noscript", "template") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip and data.strip():
            self.parts.append(data.strip())


def dom_text(html: str) -> str:
    """The visible text of ``html``, text nodes joined by newlines."""
    parser = _Text()
    parser.feed(html)
    return "\n".join(parser.parts)


@dataclass
class Page:
    """What Chromium rendered: ``dom`` (HTML after scripts ran), ``text`` (its visible text, one text
    node per line), ``requests`` (every URL requested, in order) and ``screenshot`` (PNG path or None)."""
    dom: str
    text: str
    requests: list[str] = field(default_factory=list)
    screenshot: Path | None = None


def _net_log_urls(path: Path) -> list[str]:
    """URLs of the requests in a Chromium NetLog file (``--log-net-log``); tolerant of a log cut short."""
    try:
        raw = path.read_text(errors="replace")
    except OSError:
        return []
    try:
        events = json.loads(raw).get("events", [])
    except json.JSONDecodeError:  # Chromium killed before it closed the JSON
        raw = raw.rstrip().rstrip(",")
        try:
            events = json.loads(raw + "]}").get("events", [])
        except json.JSONDecodeError:
            return []
    urls = []
    for ev in events:
        url = (ev.get("params") or {}).get("url")
        if isinstance(url, str) and url not in urls:
            urls.append(url)
    return urls


def load(url: str | Path, screenshot: str | Path | None = None, window: tuple[int, int] = (1600, 1000),
         budget_ms: int = 25000, timeout_s: float = 120, offline: bool = False) -> Page:
    """Render ``url`` (an http(s) URL, or a local file path) in headless Chromium.

    ``budget_ms``: page time (virtual) Chromium gives scripts and requests before it dumps the DOM.
    ``screenshot``: also write a PNG of ``window`` (width, height) pixels there (a second load).
    ``offline``: route every request through a proxy that refuses connections (127.0.0.1:9), so any
    network fetch fails and the page shows only what it carries itself.
    Raises:
        AssertionError: Chromium failed or ran past ``timeout_s``.
    """
    exe = require_chromium()
    target = Path(url).resolve().as_uri() if isinstance(url, Path) or "://" not in str(url) else str(url)
    with tempfile.TemporaryDirectory(prefix="onegpu-chromium-") as tmp:
        net_log = Path(tmp) / "net.json"
        # A fresh profile per load: what a first visit shows (no remembered UI state).
        common = [exe, *FLAGS, f"--virtual-time-budget={budget_ms}", f"--window-size={window[0]},{window[1]}",
                  *(["--proxy-server=127.0.0.1:9"] if offline else [])]
        try:
            p = subprocess.run([*common, f"--user-data-dir={tmp}/dom", f"--log-net-log={net_log}", "--dump-dom",
                                target],
                               capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"chromium did not finish loading {target} in {timeout_s:g} s") from None
        if p.returncode != 0 or not p.stdout.strip():
            raise AssertionError(f"chromium exited {p.returncode} on {target}:\n{p.stderr[-3000:]}")
        page = Page(dom=p.stdout, text=dom_text(p.stdout), requests=_net_log_urls(net_log))
        if screenshot is not None:
            shot = Path(screenshot).resolve()
            subprocess.run([*common, f"--user-data-dir={tmp}/shot", f"--screenshot={shot}", target],
                           capture_output=True, timeout=timeout_s)
            page.screenshot = shot if shot.is_file() else None
    return page
