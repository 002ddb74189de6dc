"""The one TCP reachability probe (onegpu.net) and the tracking store's check built on it."""
from __future__ import annotations

import socket

import pytest

from onegpu import net, tracking
from onegpu.errors import UserError


def test_unreachable_names_the_refused_address_and_accepts_a_listener(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert net.unreachable(f"http://127.0.0.1:{port}", 2.0) is None
    assert net.unreachable(f"http://127.0.0.1:{port}", 2.0) == f"127.0.0.1:{port}: Connection refused"
    with pytest.raises(UserError, match=f"cannot be reached \\(127.0.0.1:{port}: Connection refused, 2 s"):
        tracking.check_reachable(f"http://127.0.0.1:{port}", timeout_s=2.0)


def test_unreachable_goes_through_the_proxy_the_request_would_use(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert net.unreachable("http://store.invalid:5000", 2.0) == \
        f"127.0.0.1:{port} (the proxy for store.invalid): Connection refused"
