"""Where a model is (a folder or a hub id), and whether the Hugging Face hub can be reached: a hub call that cannot
succeed is refused at once, in one sentence, rather than after huggingface_hub's half a minute of retries."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError, LocalTokenNotFoundError
from huggingface_hub.utils import validate_repo_id

# What huggingface_hub raises for a repository or file it cannot give, an id it refuses, or a missing token.
HUB_ERRORS = (HfHubHTTPError, EntryNotFoundError, HFValidationError, LocalTokenNotFoundError)


class HubError(ValueError):
    """A model that cannot be saved, loaded or pushed as asked; the message says what to change."""


def locate(src: str, named: str | None = None, example: str = "org/name") -> Path | None:
    """The folder ``src`` names, or None where it is a hub id (``org/name``); refused where it is neither.
    ``named``: how the message names it (``SRC=…``; ``src`` itself by default)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if path.exists() or src.count("/") != 1 or src.startswith((".", "/", "~")):
        raise HubError(f"{named or src} is neither a folder nor a hub id like {example}")
    return None


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def check_hub(subject: str, advice: str) -> None:
    """Refuse at once a hub call that cannot succeed: offline mode, or an endpoint that does not answer
    (huggingface_hub would retry it for half a minute). ``subject`` names what needs the hub."""
    if offline():
        raise HubError(f"{subject} needs the Hugging Face hub but HF_HUB_OFFLINE is set; {advice}")
    host = urlparse(constants.ENDPOINT)
    try:
        port = host.port or (443 if host.scheme == "https" else 80)
        socket.create_connection((host.hostname, port), timeout=10).close()
    except OSError as err:
        raise HubError(f"{subject} needs the Hugging Face hub but {host.hostname} cannot be reached ({err}); "
                       f"{advice}") from None


def hub_failure(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else 'no detail'}"


def check_repo_id(repo_id: str, setting: str | None = None) -> None:
    """Refuse what is not a hub repository id (``org/name``); ``setting`` names it in the message."""
    try:
        validate_repo_id(repo_id)
        valid = repo_id.count("/") == 1
    except HFValidationError:
        valid = False
    if not valid:
        raise HubError(f"{f'{setting}=' if setting else ''}{repo_id} is not a hub repository id like org/name")
