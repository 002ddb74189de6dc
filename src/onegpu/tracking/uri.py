"""Which store: the tracking URI, its checks, and how it is shown (credentials never are)."""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from onegpu import paths
from onegpu.errors import UserError
from onegpu.net import unreachable

SCHEMES = ("sqlite", "http", "https", "file", "postgresql", "mysql", "databricks", "")


def redact(text: str, uri: str | None = None) -> str:
    """``text`` with the password of ``uri`` replaced by ``***`` wherever ``uri``'s credentials appear in
    it (``user:PASSWORD@``); without ``uri``, ``text`` is the URI itself. For messages that quote a
    library's error (MLflow's name the request URL, credentials included): never show credentials."""
    try:
        password = urlparse(text if uri is None else uri).password
    except ValueError:
        return text
    if password:
        for form in {password, unquote(password)}:
            text = text.replace(f":{form}@", ":***@")
    return text


def check_uri(uri: str) -> None:
    """Refuse a tracking URI whose scheme MLflow cannot open here (one of :data:`SCHEMES` is needed)
    and a relative SQLite path.

    Raises:
        UserError: the scheme is unsupported, or a SQLite URI is not ``sqlite:///ABSOLUTE/PATH.db``.
    """
    scheme = urlparse(uri).scheme
    if scheme not in SCHEMES:
        raise UserError(f"MLFLOW_TRACKING_URI={redact(uri)!r} has an unsupported scheme {scheme!r}; "
                        "use sqlite:///ABSOLUTE/PATH.db, http(s)://HOST:PORT or leave it unset for "
                        "<project root>/mlflow.db")
    if scheme == "sqlite" and not uri.startswith("sqlite:///"):
        raise UserError(f"MLFLOW_TRACKING_URI={uri!r}: a SQLite URI is sqlite:///ABSOLUTE/PATH.db")


def check_reachable(uri: str, timeout_s: float = 5.0, note: str = "") -> None:
    """Fail fast when an http(s) tracking server does not accept a TCP connection.

    MLflow's REST client retries a refused or unroutable server with backoff for minutes before it
    raises; this opens one TCP connection (to the server, or to the proxy that would carry the
    request; :func:`onegpu.net.unreachable`) within ``timeout_s`` seconds instead. Other schemes are
    left alone. ``note`` is appended to the message of an unreachable server.

    Raises:
        UserError: the URI has no host or a bad port, or the host cannot be resolved, or refuses or
            does not answer the connection.
    """
    u = urlparse(uri)
    if u.scheme not in ("http", "https"):
        return
    try:
        host, port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
        reason = unreachable(uri, timeout_s) if host else None
    except ValueError as e:  # a port that is not a number or out of range
        raise UserError(f"MLFLOW_TRACKING_URI={redact(uri)!r} is malformed: {e}") from None
    if not host:
        raise UserError(f"MLFLOW_TRACKING_URI={redact(uri)!r} has no host; use http(s)://HOST:PORT")
    if reason:
        raise UserError(f"MLFLOW_TRACKING_URI={redact(uri)!r}: the tracking server cannot be reached "
                        f"({reason}, {timeout_s:g} s timeout); start it (mlflow server --host {host} "
                        f"--port {port}) or unset MLFLOW_TRACKING_URI to use <project root>/mlflow.db{note}")


def store_uri(root: Path, note: str = "") -> str:
    """The preamble of every command that opens the store: the project's tracking URI
    (:func:`onegpu.paths.tracking_uri`), checked (:func:`check_uri`) and, for a server, reachable
    (:func:`check_reachable`; ``note`` is added to its message). With a password in the URI, MLflow's
    run links are turned off (``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT``): they would show it.

    Raises:
        UserError: see :func:`check_uri` and :func:`check_reachable`.
    """
    uri = paths.tracking_uri(root)
    check_uri(uri)
    check_reachable(uri, note=note)
    if urlparse(uri).password:
        # MLflow prints "View run ... at: <tracking URI>/#/..." when a run ends on a server: with the
        # password in the URI (user:password@host) that would put it on the terminal and in DVC's logs.
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    return uri
