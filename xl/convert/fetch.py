"""Where a conversion's source files come from: a local folder, or the Hugging Face hub where a network exists."""

from __future__ import annotations

from pathlib import Path

from xl.hub.access import HubError, check_hub, locate
from xl.hub.files import CONFIG, is_pretrained_config

HUB_FILES = (CONFIG, ("model.safetensors", "pytorch_model.bin"), ("vocab.pkl", "vocab.bin"))


class FetchError(ValueError):
    """The source cannot be found or downloaded; the message says what to fetch and where to put it."""


def by_hand(repo: str) -> str:
    return (f"download config.json, pytorch_model.bin (or model.safetensors) and vocab.pkl (or vocab.bin) (for a "
            f"model that xl saved, all its files) from https://huggingface.co/{repo}/tree/main into one folder, and "
            "give that folder as SRC")


def fetch(src: str) -> tuple[Path, str]:
    """The folder holding the source files, and a description of where they came from. For a hub id whose
    config.json this project wrote (:func:`xl.hub.is_pretrained_config`), only config.json is fetched here:
    :meth:`xl.hub.PretrainedXL.from_pretrained` fetches the rest."""
    try:
        path = locate(src, f"SRC={src}", "transfo-xl/transfo-xl-wt103")
        if path is not None:
            return path, f"folder {path.resolve()}"
        check_hub(f"SRC={src}", by_hand(src))
    except HubError as err:
        raise FetchError(str(err)) from None
    from huggingface_hub import hf_hub_download

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
        if choices == CONFIG and is_pretrained_config(folder / CONFIG):
            break
    return folder, f"hub {src}"
