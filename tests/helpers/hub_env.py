"""The Hugging Face hub as a test wants it: offline (``HF_HUB_OFFLINE`` set) or online but out of reach, whatever the
environment the suite runs in says. huggingface_hub reads ``HF_HUB_OFFLINE`` once, at import, into its constants; a
test sets or clears both."""

from __future__ import annotations

import socket


def closed_port() -> int:
    """A local port that nothing listens on: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hub_offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)


def hub_online(monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)


def hub_unreachable(monkeypatch) -> None:
    """Online, with the hub's endpoint a local port that refuses connections."""
    hub_online(monkeypatch)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{closed_port()}")
