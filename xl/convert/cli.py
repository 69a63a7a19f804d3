"""The command line of ``python -m xl.convert SRC OUT``: a published Transformer-XL (Hugging Face layout, a folder
or a hub id), or a model that xl.export saved, into a run folder that xl.evaluate, xl.generate and
``train.py init_from=OUT`` read (:mod:`xl.convert`)."""

from __future__ import annotations

import argparse
import sys

from xl.convert import convert
from xl.convert.fetch import FetchError
from xl.convert.vocab import VocabularyError
from xl.convert.weights import ConversionError
from xl.hub.access import HubError
from xl.training.checkpoints.run_folder import RunFolderError
from xl.training.services.console import plain_text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m xl.convert", description=plain_text(__doc__))
    parser.add_argument("src", help="a folder with config.json, the weights and vocab.pkl, a folder xl.export "
                                    "wrote, or a hub id")
    parser.add_argument("out", help="the run folder to write (must not exist, or be empty)")
    args = parser.parse_args(argv)
    try:
        ckpt, settings = convert(args.src, args.out)
    except (ConversionError, VocabularyError, FetchError, HubError, RunFolderError) as err:
        sys.exit(f"error: {err}")
    print(f"wrote {ckpt}\n  read text with its tokenizer: {settings}\n"
          f"  fine-tune it: python train.py init_from={args.out} data=... {settings} (docs/sharing.md)")
