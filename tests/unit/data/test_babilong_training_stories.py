"""Settings that change how a BABILong-style model is trained and nothing it is scored on: word tokens with each
punctuation mark a word of its own (``data.tokenizer_kwargs.punctuation``), and training stories that keep every
question of the story in bAbI's format (``data.train_questions=all``) or, in qa1, ask about every actor at each
question's place (``every``), or once after all the facts about every actor (qa1) or object (qa2, qa3) (``end``),
and in qa2 and qa3 every actor who moved as well (``end_actors``) and who holds each object (``end_holders``)."""

from __future__ import annotations

import random

import pytest

from tests.helpers.babilong_solver import parse, solve
from xl.data import DataError
from xl.data.babilong.data import BabilongDataModule
from xl.data.babilong.generated import STREAM, encode_sample
from xl.data.babilong.samples import hide
from xl.data.babilong.tasks import GENERATORS
from xl.data.sources import StdlibSource
from xl.data.words import WordTokenizer


def test_punctuation_marks_are_words_of_their_own():
    tok = WordTokenizer(punctuation=True)
    tok.fit(["John went to the kitchen.\nQuestion: Where is John?\nkitchen\n"])
    assert tok.words("Where is John?\nkitchen\n") == ["Where", "is", "John", "?", "<eos>", "kitchen", "<eos>"]
    assert tok.words("the kitchen. John, Mary's") == ["the", "kitchen", ".", "John", ",", "Mary", "'", "s", "<eos>"]
    assert list(tok.encode("John?"))[:2] == list(tok.encode("John ?"))[:2] == [tok.encode("John")[0],
                                                                                   tok.encode("?")[0]]
    assert tok.unk_id not in tok.encode("Where is John? kitchen.")
    assert tok.decode(tok.encode("Where is John?\n")) == "Where is John ?\n"


def test_without_punctuation_words_are_split_on_whitespace_alone():
    tok = WordTokenizer()
    tok.fit(["John went to the kitchen.\n"])
    assert tok.words("John went to the kitchen.") == ["John", "went", "to", "the", "kitchen.", "<eos>"]
    assert "kitchen" not in tok.itos and "kitchen." in tok.itos


def test_the_punctuation_setting_is_kept_fingerprinted_and_checked(tmp_path):
    fitted = WordTokenizer(punctuation=True)
    fitted.fit(["a b. c?\n"])
    again = WordTokenizer.from_dict(fitted.to_dict())
    assert again.punctuation and again.itos == fitted.itos and again.key() == fitted.key()
    assert WordTokenizer().key() == "word(min_freq=1,max_size=None)"  # the cache keys of existing runs stay
    assert fitted.key() != WordTokenizer().key() and "punctuation" not in WordTokenizer().to_dict()
    with pytest.raises(DataError, match="punctuation must be true or false"):
        WordTokenizer(punctuation="yes")
    from xl.data.words import vocabulary_json

    path = tmp_path / "vocab.json"
    path.write_text(vocabulary_json(["<eos>", "<unk>", "a"]))
    with pytest.raises(DataError, match="data.tokenizer_file"):
        WordTokenizer(file=path, punctuation=True)


def test_a_shared_punctuation_vocabulary_reads_back_splitting_as_it_was_fitted(tmp_path):
    """xl.export writes a run's word vocabulary as a file that xl.convert, the hub and data.tokenizer_file read: a
    vocabulary fitted with punctuation marks as words says so in its file, and reads back giving the same ids."""
    from xl.hub.files import tokenizer_files

    fitted = WordTokenizer(punctuation=True)
    fitted.fit(["John went to the kitchen.\nQuestion: Where is John?\nkitchen\n"])
    (text,) = tokenizer_files(fitted)[1].values()
    (tmp_path / "vocab.json").write_text(text)
    read = WordTokenizer(file=tmp_path / "vocab.json")
    story = "John went to the kitchen.\nQuestion: Where is John?\n"
    assert read.punctuation and read.unk_id not in read.encode(story)
    assert list(read.encode(story)) == list(fitted.encode(story))
    assert WordTokenizer.from_dict(read.to_dict()).key() == read.key()
    # A vocabulary file written without the key (every file before it) keeps its text, so its fingerprint.
    plain = WordTokenizer()
    plain.fit(["a b c\n"])
    (plain_text,) = tokenizer_files(plain)[1].values()
    (tmp_path / "plain.json").write_text(plain_text)
    assert "punctuation" not in plain_text and not WordTokenizer(file=tmp_path / "plain.json").punctuation


@pytest.mark.parametrize("task,questions", [("qa1", "all"), ("qa2", "all"), ("qa3", "all"), ("qa1", "every"),
                                            ("qa1", "end"), ("qa2", "end"), ("qa3", "end"),
                                            ("qa2", "end_actors"), ("qa3", "end_actors"),
                                            ("qa2", "end_holders"), ("qa3", "end_holders")])
def test_a_story_that_keeps_its_questions_answers_each_from_the_facts_before_it(task, questions):
    rng = random.Random("kept")
    kept = 0
    for _ in range(200):
        story = GENERATORS[task](rng, questions)
        assert solve(list(story.facts), story.question) == story.answer
        last = 0
        for n, question, answer in story.asked:
            assert (last < n if questions == "all" else last <= n) and n <= len(story.facts)
            assert solve(list(story.facts[:n]), question) == answer
            last = n
        kept += len(story.asked)
    assert kept > (20 if (task, questions) == ("qa3", "end") else 100)  # qa3 seldom has a second object to ask about


def test_every_asks_about_each_actor_who_moved_at_each_question_s_place_once():
    rng = random.Random("every")
    for _ in range(200):
        story = GENERATORS["qa1"](rng, "every")
        points: dict[int, list[str]] = {}
        for n, question, _ in (*story.asked, (len(story.facts), story.question, story.answer)):
            points.setdefault(n, []).append(question.removeprefix("Where is ").removesuffix("?"))
        assert sorted(points) == list(range(2, len(story.facts) + 1, 2))
        for n, actors in points.items():
            moved = {fact.split()[0] for fact in story.facts[:n]}
            assert sorted(actors) == sorted(moved)


def test_end_asks_about_each_actor_who_moved_once_after_all_the_facts():
    """The facts before the questions are the story's whole, as in a test story: no earlier answer says where an
    actor was; the facts are those the story without its questions has."""
    rng, plain = random.Random("end"), random.Random("end")
    for _ in range(200):
        story, alone = GENERATORS["qa1"](rng, "end"), GENERATORS["qa1"](plain)
        assert story.facts == alone.facts
        plain.setstate(rng.getstate())  # "end" draws the order of its questions too
        assert all(n == len(story.facts) for n, _, _ in story.asked)
        asked = [q.removeprefix("Where is ").removesuffix("?") for _, q, _ in (*story.asked, (0, story.question, 0))]
        assert sorted(asked) == sorted({fact.split()[0] for fact in story.facts})


@pytest.mark.parametrize("task", ["qa2", "qa3"])
def test_end_asks_about_each_object_the_task_asks_about_once_after_all_the_facts(task):
    """qa2 and qa3: after the story's facts, a question about each object the story could have asked about there
    (each answered from the facts by the tests' own solver, above), none twice, the story's own last; the facts and
    the story's question are those of the story without the others."""
    rng, plain = random.Random("end"), random.Random("end")
    asked = 0
    for _ in range(200):
        story, alone = GENERATORS[task](rng, "end"), GENERATORS[task](plain)
        assert (story.facts, story.question, story.answer) == (alone.facts, alone.question, alone.answer)
        plain.setstate(rng.getstate())  # "end" draws the order of its questions too
        assert all(n == len(story.facts) for n, _, _ in story.asked)
        objects = [q.split(" the ")[1].split()[0].rstrip("?") for _, q, _ in (*story.asked, (0, story.question, 0))]
        assert len(set(objects)) == len(objects)
        assert all(o in " ".join(story.facts) for o in objects)
        asked += len(objects)
    assert asked > (1.5 if task == "qa2" else 1.1) * 200  # more than one question a story


def beside(task: str, value: str, base: str, seed: str):
    """200 stories of ``data.train_questions=value``, each beside ``base``'s story drawn from the same state of the
    random stream: the same facts, question and answer, every question of ``base``'s asked too, at the same place
    with the same answer. Yields the story, its questions and ``base``'s, each ``{question: (facts before, answer)}``;
    then checks that qa1's stories are end's."""
    a, b = random.Random(seed), random.Random(seed)
    for _ in range(200):
        story, other = GENERATORS[task](a, value), GENERATORS[task](b, base)
        assert (story.facts, story.question, story.answer) == (other.facts, other.question, other.answer)
        b.setstate(a.getstate())
        asked = {q: (n, answer) for n, q, answer in story.asked}
        base_asked = {q: (n, answer) for n, q, answer in other.asked}
        assert len(asked) == len(story.asked) and base_asked.items() <= asked.items()
        yield story, asked, base_asked
    rng, plain = random.Random(3), random.Random(3)
    for _ in range(50):
        assert GENERATORS["qa1"](rng, value) == GENERATORS["qa1"](plain, "end")


@pytest.mark.parametrize("task", ["qa2", "qa3"])
def test_end_actors_asks_end_s_questions_and_about_each_actor_who_moved(task):
    """end_actors: the story, its question and its other objects' questions are end's; after them the same facts
    ask about every actor the facts move, once each, answered from the facts; only the order of the questions
    differs. qa1's stories are end's."""
    actors_asked = 0
    for story, asked, end in beside(task, "end_actors", "end", "actors"):
        people = {q.removeprefix("Where is ").removesuffix("?"): (n, answer) for q, (n, answer) in asked.items()
                  if q.startswith("Where is ") and not q.startswith("Where is the ")}
        assert set(people) == {e.actor for e in map(parse, story.facts) if e.kind == "move"}
        for person, (n, answer) in people.items():
            assert n == len(story.facts) and solve(list(story.facts), f"Where is {person}?") == answer
        assert len(asked) == len(end) + len(people)
        actors_asked += len(people)
    assert actors_asked > 2 * 200  # several actors a story


@pytest.mark.parametrize("task", ["qa2", "qa3"])
def test_end_holders_asks_end_actors_questions_and_who_holds_each_held_object(task):
    """end_holders: end_actors' story and questions, and after the facts "Who has the football?" about every object
    that someone holds there, once each, answered by the tests' solver (which tracks gets, gives and drops); only the
    order of the questions differs. qa1's stories are end's."""
    held = 0
    for story, asked, actors in beside(task, "end_holders", "end_actors", "holders"):
        holders = {q.removeprefix("Who has the ").removesuffix("?"): (n, answer) for q, (n, answer) in asked.items()
                   if q.startswith("Who has the ")}
        last = {e.thing: e.kind for e in map(parse, story.facts) if e.kind in ("get", "drop")}
        assert set(holders) == {o for o, kind in last.items() if kind == "get"}
        for obj, (n, answer) in holders.items():
            assert n == len(story.facts) and solve(list(story.facts), f"Who has the {obj}?") == answer
        assert len(asked) == len(actors) + len(holders)
        held += len(holders)
    assert held > 200  # about one held object a story


def test_a_shared_vocabulary_has_end_holders_words_and_keeps_every_other_id(tmp_path):
    """A curriculum's vocabulary is fitted on a stream of BABILong's questions: with end_holders it also holds the
    words only its training questions use ("Who", "has"), after the same words in the same order as end_actors'."""
    shared = {"length": 0, "tasks": ["qa1", "qa2"]}
    actors, holders = (data(tmp_path / q, train_samples=STREAM, train_questions=q, vocabulary=shared,
                            tokenizer_kwargs={"punctuation": True}) for q in ("end_actors", "end_holders"))
    assert "Who" not in actors.tokenizer.itos
    assert holders.tokenizer.itos == actors.tokenizer.itos + ["Who", "has"]
    texts = ["".join(text for text, _ in holders.source.stream.sample(0, j).pieces()) for j in range(40)]
    assert sum("Who has the" in text for text in texts) > 5
    assert all(holders.tokenizer.unk_id not in holders.tokenizer.encode(text) for text in texts)


@pytest.mark.parametrize("task,questions", [(t, q) for t in ("qa2", "qa3", "qa4", "qa5") for q in ("all", "every")]
                         + [(t, "end") for t in ("qa4", "qa5")])
def test_keeping_the_questions_draws_the_same_stories_where_it_needs_no_draws(task, questions):
    """Tasks other than qa1 keep their questions for all and every, and qa4 and qa5 their last alone for end."""
    a, b = random.Random(5), random.Random(5)
    for _ in range(50):
        kept, one = GENERATORS[task](a, questions), GENERATORS[task](b)
        assert (kept.facts, kept.question, kept.answer, one.asked) == (one.facts, one.question, one.answer, ())
        if questions == "end":
            assert kept.asked == ()


def test_a_kept_question_is_a_line_of_its_own_and_its_answer_a_piece_of_its_own():
    rng = random.Random(3)
    story = next(s for s in iter(lambda: GENERATORS["qa1"](rng, "all"), None) if len(s.asked) == 2)
    sample = hide(story, 0, None, len, rng)
    pieces = sample.pieces()
    (n1, q1, a1), (n2, q2, a2) = story.asked
    assert pieces == [(" ".join(story.facts[:n1]) + f"\nQuestion: {q1}\n", False), (f"{a1}\n", True),
                      (" ".join(story.facts[n1:n2]) + f"\nQuestion: {q2}\n", False), (f"{a2}\n", True),
                      (" ".join(story.facts[n2:]) + f"\nQuestion: {story.question}\n", False),
                      (f"{story.answer}\n", True)]
    assert sample.prompt == pieces[-2][0] and sample.answer == pieces[-1][0]
    tok = WordTokenizer(punctuation=True)
    tok.fit(text for text, _ in pieces)
    encoded = encode_sample(sample, tok)
    assert [tok.decode(encoded.ids[a:b]) for a, b in encoded.answers] == [f"{a1}\n", f"{a2}\n", f"{story.answer}\n"]
    assert encoded.answer_mask().sum() == 6


def data(tmp_path, **settings):
    values = {"tasks": ["qa1", "qa2"], "length": 0, "eval_samples": 20, "train_samples": 40, "seed": 0,
              "tokenizer": "word", "batch_size": 2, "tgt_len": 16, "cache_dir": str(tmp_path / "cache"), **settings}
    dm = BabilongDataModule(StdlibSource(), **values)
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("train_samples,questions,most", [(40, "all", 5), (STREAM, "all", 5), (STREAM, "every", 5),
                                                          (40, "every", 2), (STREAM, "end", 5),
                                                          (STREAM, "end_actors", 5), (STREAM, "end_holders", 5)])
def test_kept_questions_change_the_train_split_only_and_score_every_answer(tmp_path, train_samples, questions, most):
    last = data(tmp_path / "last", train_samples=train_samples)
    every = data(tmp_path / "all", train_samples=train_samples, train_questions=questions, train_most_questions=most)
    for split in ("val", "test"):
        assert list(last.source.samples(split)) == list(every.source.samples(split))
    assert last.cache.folder.name != every.cache.folder.name  # another cache, not only another folder
    batches = {name: [b for _, b in zip(range(30), dm.train_dataloader(), strict=False)]
               for name, dm in (("last", last), ("all", every))}
    scored = {name: sum(int((b[1] != -100).sum()) for b in got) for name, got in batches.items()}
    assert scored["all"] > 1.5 * scored["last"]
    again = data(tmp_path / "again", train_samples=train_samples, train_questions=questions,
                 train_most_questions=most)
    assert [[t.tolist() for t in b[:2]] for b in batches["all"][:10]] == [
        [t.tolist() for t in b[:2]] for _, b in zip(range(10), again.train_dataloader(), strict=False)]


def test_end_at_a_length_asks_every_question_after_the_hidden_facts_and_scores_each(tmp_path):
    """data.train_questions=end at data.length above 0: the facts hidden in background as in BABILong's samples,
    then every question in turn, each answered from all the facts; val and test keep one question at the end."""
    from itertools import islice

    last = data(tmp_path / "last", tasks=["qa1"], length=300, train_samples=STREAM)
    end = data(tmp_path / "end", tasks=["qa1"], length=300, train_samples=STREAM, train_questions="end")
    for split in ("val", "test"):
        assert list(last.source.samples(split)) == list(end.source.samples(split))
    asked = 0
    for sample in islice(end.source.samples("train"), 40):
        story, pieces = sample.story, sample.pieces()
        context = pieces[0][0].removesuffix(f"Question: {story.asked[0][1]}\n") if story.asked else sample.context
        at = 0
        for fact in story.facts:  # each fact in order (index raises if one is missing)
            at = context.index(fact, at) + len(fact)
        assert 250 < len(end.tokenizer.encode(context)) <= 300  # hidden in background
        questions = [*story.asked, (len(story.facts), story.question, story.answer)]
        assert [text for text, _ in pieces[1:]] == [t for _, q, a in questions
                                                   for t in (f"Question: {q}\n", f"{a}\n")][1:]
        assert all(solve(list(story.facts), q) == a for _, q, a in questions)
        asked += len(questions)
    assert asked > 100  # about every actor who moved: three on average
    batches = {name: [b for _, b in zip(range(20), dm.train_dataloader(), strict=False)]
               for name, dm in (("last", last), ("end", end))}
    scored = {name: sum(int((b[1] != -100).sum()) for b in got) for name, got in batches.items()}
    assert scored["end"] > 2 * scored["last"]


def test_val_most_questions_caps_the_validation_stories_alone(tmp_path):
    """A validation story of qa1 cut at its first question is two moves long; test keeps BABILong's whole stories and
    training is unchanged; the cache is another."""
    whole = data(tmp_path / "whole", tasks=["qa1"])
    short = data(tmp_path / "short", tasks=["qa1"], val_most_questions=1)
    assert {len(s.story.facts) for s in short.source.samples("val")} == {2}
    assert max(len(s.story.facts) for s in whole.source.samples("val")) > 2
    assert list(short.source.samples("test")) == list(whole.source.samples("test"))
    assert list(short.source.samples("train")) == list(whole.source.samples("train"))
    assert short.cache.folder.name != whole.cache.folder.name


def test_questions_between_the_facts_are_written_at_length_0_only():
    for settings, message in (({"length": "1k", "train_questions": "all"}, "data.length=0"),
                              ({"length": "1k", "train_questions": "every"}, "data.length=0"),
                              ({"length": 0, "train_questions": "some"}, "data.train_questions"),
                              ({"length": 0, "train_most_questions": 11}, "data.train_most_questions"),
                              ({"length": 0, "train_most_questions": True}, "data.train_most_questions"),
                              ({"length": 0, "train_most_questions": 0}, "data.train_most_questions"),
                              ({"length": 0, "val_most_questions": 0}, "data.val_most_questions")):
        with pytest.raises(DataError, match=message) as err:
            BabilongDataModule(StdlibSource(), tasks=["qa1"], **settings)
        assert "\n" not in str(err.value) and len(str(err.value)) < 200


def test_training_stories_may_run_longer_than_the_test_s(tmp_path):
    """data.train_most_questions above bAbI's 5: qa1's training stories run to up to 2 x 8 moves (a test story's 10 at
    most), cut at each k from 1 to 8; val and test are unchanged; the cache is another."""
    whole = data(tmp_path / "whole", tasks=["qa1"], train_samples=200)
    longer = data(tmp_path / "longer", tasks=["qa1"], train_samples=200, train_most_questions=8)
    assert {len(s.story.facts) for s in longer.source.samples("train")} == set(range(2, 17, 2))
    assert max(len(s.story.facts) for s in whole.source.samples("train")) == 10
    for split in ("val", "test"):
        assert list(longer.source.samples(split)) == list(whole.source.samples(split))
    assert longer.cache.folder.name != whole.cache.folder.name


def test_two_questions_in_a_row_leave_no_empty_line():
    rng = random.Random(7)
    story = next(s for s in iter(lambda: GENERATORS["qa1"](rng, "every"), None) if len(s.facts) == 2 and s.asked)
    text = "".join(text for text, _ in hide(story, 0, None, len, rng).pieces())
    assert "\n\n" not in text and text.count("Question: ") == len(story.asked) + 1


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3", "qa5"])
def test_a_training_story_runs_to_at_most_its_most_questions(task):
    rng = random.Random("most")
    for most in (1, 2):
        for _ in range(100):
            story = GENERATORS[task](rng, "all", most)
            assert len(story.asked) < most
            if task == "qa1":
                assert len(story.facts) <= 2 * most
    one = [GENERATORS["qa1"](random.Random(k), "last", 1) for k in range(50)]
    assert {len(s.facts) for s in one} == {2}
