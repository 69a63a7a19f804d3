"""Corpus → token cache → ordered, never-shuffled Transformer-XL segments.

``sources`` says where text comes from, ``tokenizers`` turns it into ids, ``cache`` keeps the ids on disk,
``stream`` cuts them into per-rank rows and segments, and ``datamodule`` wires it all into Lightning.
"""

from xl.data import sources
from xl.data.datamodule import SegmentDataModule
from xl.data.errors import DataError
from xl.data.recall import RecallSource
from xl.data.stream import SegmentLoader, split_streams
from xl.data.tokenizers import make_tokenizer

__all__ = ["DataError", "RecallSource", "SegmentDataModule", "SegmentLoader", "make_tokenizer", "sources",
           "split_streams"]
