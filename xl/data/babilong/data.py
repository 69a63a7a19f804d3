"""``data=babilong``: BABILong-style samples as the documents of a training corpus.

``python train.py data=babilong data.tasks=[qa1,qa2] data.length=2k`` trains on samples of the tasks in turn (qa1,
qa2, qa1, ...), each one document: with ``memory.doc_boundaries=reset`` (the default) the memory starts empty at
every sample, as BABILong reads each one. ``data.loss=answer`` (the default) scores only the answer's tokens (the
targets of every other position are the loss's ignore index, so the metrics, and ``results.json``'s ``scored``,
count the answers alone); ``all`` scores every token, context included. ``data.train_samples=stream`` makes the
train split while training, an endless stream of new samples (:mod:`xl.data.babilong.generated`); val and test
stay in the token cache.

Lengths count the model's own tokens, so the samples depend on the tokenizer: byte, char and word tokens are
counted as the tokenizer will give them before it has seen any text; a subword vocabulary must be read from
``data.tokenizer_file`` (one fitted on the samples would not exist before their lengths are known).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from xl.data.babilong.background import MAX_UNIT_TOKENS, Sentences
from xl.data.babilong.generated import (
    STREAM,
    VOCABULARY_ROW,
    VOCABULARY_SAMPLES,
    GeneratedLoader,
    SampleStream,
    encode_sample,
)
from xl.data.babilong.lengths import parse_length
from xl.data.babilong.samples import Sample, samples
from xl.data.babilong.tasks import (
    MOST_QUESTIONS,
    QUESTION_WORDS,
    QUESTIONS,
    QUESTIONS_PER_STORY,
    SUPPORTS,
    TASKS,
    is_most_questions,
    is_train_support,
)
from xl.data.datamodule import SegmentDataModule
from xl.data.errors import DataError
from xl.data.sources import Piece, Source
from xl.data.stream import SegmentLoader
from xl.data.tokenizers import SubwordTokenizer, Tokenizer, make_tokenizer

LOSSES = ("answer", "all")

VERSION = 1  # of the samples' layout and generator: a change gets new token caches


def token_counter(tokenizer: Tokenizer) -> Callable[[str], int]:
    """How many tokens ``tokenizer`` gives a text inside a longer one: counted before a line end, so that a piece
    that ends inside a line does not count the end-of-line symbol the word tokenizer closes a text with. Byte, char
    and word tokenizers count before they are fitted; a subword one must be fitted or read from a file."""
    line_end = len(tokenizer.encode("\n"))
    return lambda text: len(tokenizer.encode(text + "\n")) - line_end


def check_tasks(tasks: Sequence[str], setting: str = "data.tasks") -> list[str]:
    tasks = [tasks] if isinstance(tasks, str) else [str(t) for t in tasks]
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        raise DataError(f"{setting} must be a list of {', '.join(TASKS)}, got {tasks!r}")
    return tasks


class BabilongSource:
    """The samples of ``tasks`` at ``length`` tokens (counted by ``count``), ``sizes[split]`` per split, as a data
    source: each sample one document, its answer a piece of its own marked as the answer (``(False, text, True)``).
    With ``stream`` the train split is made while training; the cache's train split then holds what its vocabulary
    is fitted on: the first ``VOCABULARY_SAMPLES`` samples of a row no loader reads, and the background pool as one
    document, of ``stream`` or of ``vocabulary`` (another stream, which a curriculum's stages share)."""

    def __init__(self, background: Source, tasks: Sequence[str], length: int, sizes: dict[str, int], seed: int,
                 count: Callable[[str], int], tokenizer_key: str, stream: SampleStream | None = None,
                 vocabulary: SampleStream | None = None, questions: str = "last",
                 most: int = QUESTIONS_PER_STORY, val_most: int = QUESTIONS_PER_STORY,
                 supports: dict[str, list[str]] | None = None) -> None:
        self.background, self.tasks, self.length = background, list(tasks), length
        self.sizes, self.seed, self.count, self.tokenizer_key = sizes, seed, count, tokenizer_key
        self.stream, self.fitted_on, self.questions = stream, vocabulary or stream, questions
        self.most, self.val_most, self.supports = most, val_most, supports or {}

    def identity(self) -> str:
        stream = None if self.stream is None else [VOCABULARY_SAMPLES, self.fitted_on.pool_tokens]
        if self.stream is not None and self.fitted_on is not self.stream:
            stream += [self.fitted_on.length, self.fitted_on.tasks]
        spec = json.dumps([VERSION, self.tasks, self.length, self.sizes, self.seed, self.background.identity(),
                           self.tokenizer_key, MAX_UNIT_TOKENS, *([stream] if stream else []),
                           *([f"train questions: {self.questions}"] if self.questions != "last" else []),
                           *([f"train questions up to: {self.most}"] if self.most != QUESTIONS_PER_STORY else []),
                           *([f"val questions up to: {self.val_most}"]
                             if self.val_most != QUESTIONS_PER_STORY else []),
                           *([f"train support: {self.supports}"] if self.supports else [])])
        return "babilong-" + hashlib.sha256(spec.encode()).hexdigest()[:16]

    def setting(self, split: str) -> str:
        size = "endless" if self.stream is not None and split == "train" else self.sizes[split]
        return (f"data=babilong ({split} split: {size} samples of {'+'.join(self.tasks)} at "
                f"{self.length} tokens, background {self.background.setting(split)})")

    def samples(self, split: str) -> Iterator[Sample]:
        """The split's samples, the tasks in turn, the background read once in order across them."""
        if self.stream is not None and split == "train":
            yield from (self.fitted_on.sample(VOCABULARY_ROW, j) for j in range(VOCABULARY_SAMPLES))
            return
        background = Sentences(self.background, split, self.count)
        questions, most = {"train": (self.questions, self.most), "val": ("last", self.val_most)}.get(
            split, ("last", QUESTIONS_PER_STORY))
        supports = self.supports if split == "train" else None
        streams = [samples(task, self.length, split, self.seed, background, self.count, questions, most, supports)
                   for task in self.tasks]
        for i in range(self.sizes[split]):
            yield next(streams[i % len(streams)])

    def texts(self, split: str) -> Iterator[str]:
        """The split's text; train's is what the vocabulary is fitted on, and ends with the words of the run's
        training questions that BABILong's lack, so that a vocabulary fitted on a curriculum's shared stream has
        them (seen once there, they come last in a word vocabulary: every other word keeps its id)."""
        yield from ("".join(text for text, _ in s.pieces()) for s in self.samples(split))
        if self.stream is not None and split == "train":
            yield from self.fitted_on.pool_texts()
        if split == "train" and self.questions in QUESTION_WORDS:
            yield " ".join(QUESTION_WORDS[self.questions]) + "\n"

    def documents(self, split: str) -> Iterator[Piece]:
        for sample in self.samples(split):
            for k, (text, is_answer) in enumerate(sample.pieces()):
                yield (False, text, True) if is_answer else (k == 0, text)
        if self.stream is not None and split == "train" and self.fitted_on.pool is not None:
            yield True, "".join(self.fitted_on.pool_texts())


class BabilongDataModule(SegmentDataModule):
    """The data group ``data=babilong``: :class:`BabilongSource` over ``background``, read as any corpus is
    (``xl.data.SegmentDataModule``'s settings), with the answer-only loss of ``loss=answer``. ``vocabulary``
    (``{"length": ..., "tasks": [...]}``, with ``train_samples=stream``): fit a char or word vocabulary on the
    stream of those settings instead of this module's own, so that modules of other lengths share one vocabulary
    (:mod:`xl.training.loop.curriculum`)."""

    def __init__(self, background: Source, tasks: Sequence[str] = ("qa1",), length: int | str = "1k",
                 train_samples: int | str = 2000, eval_samples: int = 200, seed: int = 0, loss: str = "answer",
                 vocabulary: dict[str, Any] | None = None, train_questions: str = "last",
                 train_most_questions: int = QUESTIONS_PER_STORY, val_most_questions: int = QUESTIONS_PER_STORY,
                 train_support: dict[str, list[str]] | None = None, **kwargs: Any) -> None:
        tasks = check_tasks(tasks)
        try:
            tokens = parse_length(length)
        except ValueError as err:
            raise DataError(f"data.length: {err}") from None
        for key, value in (("train_samples", train_samples), ("eval_samples", eval_samples)):
            if (not isinstance(value, int) or value < 1) and not (key == "train_samples" and value == STREAM):
                more = f" or {STREAM}" if key == "train_samples" else ""
                raise DataError(f"data.{key} must be a whole number >= 1{more}, got {value!r}")
        if loss not in LOSSES:
            raise DataError(f"data.loss must be answer (the answer's tokens only) or all (every token), got {loss!r}")
        if train_questions not in QUESTIONS:
            raise DataError("data.train_questions must be last (one per training story), all (each of the story), "
                            "every (qa1), end (each actor or object, after the facts), end_actors or end_holders, "
                            f"got {train_questions!r}")
        questions = train_questions
        for key, most in (("train_most_questions", train_most_questions), ("val_most_questions", val_most_questions)):
            if not is_most_questions(most):
                raise DataError(f"data.{key} must be a whole number from 1 to {MOST_QUESTIONS}, got {most!r}")
        if train_support is not None and not is_train_support(train_support):
            raise DataError(f"data.train_support must map tasks to lists of what their answers follow from "
                            f"(qa2: {', '.join(repr(k) for k in SUPPORTS['qa2'])}), got {train_support!r}")
        # in one order, so that the same kinds given in another order name the same token cache
        supports = {str(t): sorted(str(k) for k in kinds) for t, kinds in sorted((train_support or {}).items())}
        if questions in ("all", "every") and tokens != 0:
            raise DataError(f"data.train_questions={questions} writes questions between a story's facts at "
                            "data.length=0 only; set data.length=0, or data.train_questions=last or end")
        if kwargs.get("doc_sep") is not None:
            raise DataError("data.doc_sep does not apply to data=babilong, whose samples are its documents; "
                            "set data.doc_sep=null")
        tokenizer = make_tokenizer(kwargs.get("tokenizer", "byte"), kwargs.get("tokenizer_file"),
                                   **dict(kwargs.get("tokenizer_kwargs") or {}))
        if isinstance(tokenizer, SubwordTokenizer) and "file_sha256" not in tokenizer.settings:
            raise DataError(f"data=babilong counts lengths in the model's tokens, which a {tokenizer.name} "
                            "vocabulary fitted on the samples cannot give before they exist; set data.tokenizer_file "
                            "to a tokenizer.json, or data.tokenizer=byte, char or word")
        sizes = {"train": train_samples, "val": eval_samples, "test": eval_samples}
        count = token_counter(tokenizer)
        self.stream = (SampleStream(background, tasks, tokens, seed, count, questions=questions,
                                    most=train_most_questions, supports=supports)
                       if train_samples == STREAM else None)
        fitted_on = None
        if self.stream is not None:
            sizes["train"] = VOCABULARY_SAMPLES
            if vocabulary is not None:
                fitted_on = SampleStream(background, check_tasks(vocabulary["tasks"]),
                                         parse_length(vocabulary["length"]), seed, count)
        source = BabilongSource(background, tasks, tokens, sizes, seed, count, tokenizer.key(), self.stream,
                                fitted_on, questions, train_most_questions, val_most_questions, supports)
        super().__init__(source, **kwargs)
        self.loss = loss

    def _make_loader(self, split: str) -> SegmentLoader | GeneratedLoader:
        """The cached split's loader, or for a stream's train split one that makes its samples as it reads them,
        encoded with the cache's fitted tokenizer."""
        if split != "train" or self.stream is None:
            return super()._make_loader(split)
        world_size, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        tokenizer, stream = self.cache.tokenizer, self.stream
        return GeneratedLoader(lambda row, j: encode_sample(stream.sample(row, j), tokenizer), self.batch_size,
                               self.tgt_len, rank, world_size, scored=self.loss == "answer")

    @property
    def scored(self) -> str:
        return "answer tokens only" if self.loss == "answer" else "every token"

    def scored_spans(self, split: str) -> np.ndarray | None:
        if self.loss == "all":
            return None
        spans = self.cache.answers.get(split)
        if spans is None:
            raise DataError(f"the token cache {self.cache.folder} has no answer positions; delete that folder")
        return spans
