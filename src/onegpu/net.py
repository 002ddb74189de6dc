"""One TCP reachability probe, shared by the model hub check (:mod:`onegpu.models.loader`) and the tracking
server check (:mod:`onegpu.tracking.store`): both fail fast instead of sitting in a library's retries."""
from __future__ import annotations

import socket
import urllib.request
from urllib.parse import urlparse


def unreachable(url: str, timeout_s: float = 5.0) -> str | None:
    """Why ``url``'s host refuses or ignores a TCP connection within ``timeout_s`` seconds, or None when
    it accepts one.

    The connection goes to the proxy that would carry the request when the environment names one for
    the URL's scheme (``http_proxy``/``https_proxy``, not bypassed by ``no_proxy``), as ``requests``
    would. The reason names the address tried: ``"HOST:PORT: Connection refused"``, ``"HOST:PORT: no
    answer"``, or ``"... (the proxy for URL's host)"``.

    Raises:
        ValueError: the URL's port is not a number or is out of range.
    """
    u = urlparse(url)
    host, port = u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
    via = ""
    proxy = urllib.request.getproxies().get(u.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        pu = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        via = f" (the proxy for {host})"
        host, port = pu.hostname or "", pu.port or 80
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        reason = "no answer" if isinstance(e, socket.timeout) else (e.strerror or type(e).__name__)
        return f"{host}:{port}{via}: {reason}"
