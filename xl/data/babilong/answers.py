"""BABILong's rule for a model's answer (``compare_answers`` in booydar/babilong, ``babilong/metrics.py``).

The output is lower-cased and cut at its first ``.`` (its first sentence), and before ``<context>`` or ``<example>``
(a model that starts writing examples); the task's labels (:data:`xl.data.babilong.tasks.LABELS`) found in what is left,
less those the question itself names (a label in the question is never the answer), must be exactly the target.
So "Mary is in the bathroom." is right for "bathroom", "bathroom or kitchen" is wrong, and for "Where was the
football before the kitchen?" the kitchen in the output does not count. Labels are found as substrings, as
BABILong finds them. BABILong also cuts at ``Question`` after lower-casing, which never matches: left out here.
"""

from __future__ import annotations

from collections.abc import Iterable

MARKERS = ("<context>", "<example>")


def first_sentence(output: str) -> str:
    """What BABILong reads of an output: lower case, up to the first full stop and any marker."""
    text = output.lower().split(".")[0]
    for marker in MARKERS:
        text = text.split(marker)[0]
    return text


def is_correct(target: str, output: str, question: str, labels: Iterable[str]) -> bool:
    """Whether ``output`` answers ``question`` with ``target`` by BABILong's rule."""
    labels = {label.lower() for label in labels}
    named = {label for label in labels if label in question.lower()}
    text = first_sentence(output)
    return {label for label in labels if label in text} - named == {target.lower()}
