"""Where a conversion's source files come from: a local folder, or the Hugging Face hub where a network exists."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

HUB_FILES = ("config.json", ("model.safetensors", "pytorch_model.bin"), ("vocab.pkl", "vocab.bin"))


class FetchError(ValueError):
    """The source cannot be found or downloaded; the message says what to fetch and where to put it."""


def by_hand(repo: str) -> str:
    return (f"download config.json, pytorch_model.bin (or model.safetensors) and vocab.pkl (or vocab.bin) from "
            f"https://huggingface.co/{repo}/tree/main into one folder, and give that folder as SRC")


def fetch(src: str) -> tuple[Path, str]:
    """The folder holding the source files, and a description of where they came from."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path, f"folder {path.resolve()}"
    if path.exists() or src.count("/") != 1 or src.startswith((".", "/", "~")):
        raise FetchError(f"SRC={src} is neither a folder nor a hub id like transfo-xl/transfo-xl-wt103")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise FetchError(f"SRC={src} is a hub id but HF_HUB_OFFLINE is set; {by_hand(src)}")
    from huggingface_hub import constants, hf_hub_download

    host = urlparse(constants.ENDPOINT)
    try:  # the hub's client retries an unreachable host for half a minute; say at once that it cannot be reached
        socket.create_connection((host.hostname, host.port or 443), timeout=10).close()
    except OSError as err:
        raise FetchError(f"SRC={src} is a hub id but {host.hostname} cannot be reached ({err}); {by_hand(src)}") \
            from None

    folder = None
    for choices in HUB_FILES:
        errors = []
        for name in (choices,) if isinstance(choices, str) else choices:
            try:
                folder = Path(hf_hub_download(src, name)).parent
                break
            except Exception as err:  # offline, unknown repository, or a file this repository lacks
                errors.append(f"{name}: {type(err).__name__}")
        else:
            raise FetchError(f"SRC={src} could not be fetched from the hub ({'; '.join(errors)}); {by_hand(src)}")
    return folder, f"hub {src}"
