"""BABILong's rule for an answer (compare_answers in booydar/babilong's babilong/metrics.py), on crafted outputs: the
first sentence, lower case, exactly the target among the task's labels once those the question names are set aside."""

from __future__ import annotations

import pytest

from xl.data.babilong.answers import first_sentence, is_correct
from xl.data.babilong.tasks import LABELS

WHERE = "Where is Mary?"
BEFORE = "Where was the football before the kitchen?"
GAVE = "Who gave the apple to Fred?"


@pytest.mark.parametrize("task,target,question,output,correct", [
    ("qa1", "bathroom", WHERE, "bathroom", True),
    ("qa1", "bathroom", WHERE, "Bathroom", True),  # lower case
    ("qa1", "bathroom", WHERE, "The most recent location of Mary is bathroom.", True),  # BABILong's own format
    ("qa1", "bathroom", WHERE, " the bathroom", True),
    ("qa1", "bathroom", WHERE, "bathrooms", True),  # labels are found as substrings
    ("qa1", "bathroom", WHERE, "kitchen", False),
    ("qa1", "bathroom", WHERE, "", False),
    ("qa1", "bathroom", WHERE, "kitchen or bathroom", False),  # two labels: not exactly the target
    ("qa1", "bathroom", WHERE, "bathroom. Before that, the kitchen", True),  # only the first sentence counts
    ("qa1", "bathroom", WHERE, "Mary was in the kitchen. Now: bathroom", False),
    ("qa1", "bathroom", WHERE, "bathroom<context>kitchen", True),  # cut before a marker
    ("qa1", "bathroom", WHERE, "<example>bathroom", False),
    ("qa3", "garden", BEFORE, "Before the kitchen the football was in the garden.", True),  # kitchen is named
    ("qa3", "garden", BEFORE, "garden, not the hallway", False),
    ("qa5", "Jeff", GAVE, "Jeff gave the apple to Fred", True),  # apple and Fred are named by the question
    ("qa5", "Jeff", GAVE, "jeff", True),
    ("qa5", "Jeff", GAVE, "Bill", False),
    ("qa5", "apple", "What did Jeff give to Fred?", "the apple", True),
])
def test_babilongs_rule(task, target, question, output, correct):
    assert is_correct(target, output, question, LABELS[task]) is correct


def test_the_first_sentence_is_lower_case_and_stops_at_the_first_full_stop():
    assert first_sentence("The Kitchen. The garden.") == "the kitchen"
    assert first_sentence("no full stop at all") == "no full stop at all"
