"""The command line of ``python -m xl.convert SRC OUT``: a published Transformer-XL (Hugging Face layout, a folder
or a hub id) into a run folder that xl.evaluate, xl.generate and ``train.py init_from=OUT`` read (:mod:`xl.convert`)."""

from __future__ import annotations

import argparse
import sys

from xl.convert import convert
from xl.convert.fetch import FetchError
from xl.convert.vocab import VocabularyError
from xl.convert.weights import ConversionError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m xl.convert", description=__doc__)
    parser.add_argument("src", help="a folder with config.json, the weights and vocab.pkl, or a hub id")
    parser.add_argument("out", help="the run folder to write (must not exist, or be empty)")
    args = parser.parse_args(argv)
    try:
        ckpt = convert(args.src, args.out)
    except (ConversionError, VocabularyError, FetchError) as err:
        sys.exit(f"error: {err}")
    print(f"wrote {ckpt} and its word vocabulary {args.out}/vocab.json\n"
          f"  read text with it: data.tokenizer=word data.tokenizer_file={args.out}/vocab.json (docs/pretrained.md)")

