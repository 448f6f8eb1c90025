"""The scenes task (the routing-study model's): deterministic per (seed, index), splits disjoint, every answer
re-derived from the scene description alone, rendered digits and words where the scene says, the scorer."""

import re

import numpy as np
import pytest

from vismmoe_kt.demo import scenes
from vismmoe_kt.demo.vqa import Shape

SIZE = 160  # smaller than the model's 320 pixels: the same generator, faster tests


def rederive(scene: scenes.Scene, text: str, size: int = SIZE) -> str:
    """The answer worked out again from the scene (independently of the generator's askers)."""
    shapes, signs = scene.shapes, scene.signs

    def thing(name):  # "the red circle" / "the digit" -> (x, y); the question names exactly one
        if name in ("digit", "word"):
            (s,) = [s for s in signs if s.kind == name]
            return s.x, s.y
        colour, kind = name.split()
        (s,) = [s for s in shapes if (s.colour, s.kind) == (colour, kind)]
        return s.x, s.y

    if m := re.fullmatch(r"Is there a (\w+) (\w+)\?", text):
        return "yes" if any((s.colour, s.kind) == m.groups() for s in shapes) else "no"
    if m := re.fullmatch(r"What colour is the (\w+)\?", text):
        (only,) = [s for s in shapes if s.kind == m.group(1)]
        return only.colour
    if m := re.fullmatch(r"How many (\w+) shapes are there\?", text):
        return str(sum(s.colour == m.group(1) for s in shapes))
    if m := re.fullmatch(r"How many (\w+)s are there\?", text):
        return str(sum(s.kind == m.group(1) for s in shapes))
    if m := re.fullmatch(r"What (digit|word) is written in the image\?", text):
        (sign,) = [s for s in signs if s.kind == m.group(1)]
        return sign.text
    if m := re.fullmatch(r"Is the ([\w ]+?) on the left or the right\?", text):
        x, _ = thing(m.group(1))
        assert abs(x - size / 2) >= scenes.MIN_GAP
        return "left" if x < size / 2 else "right"
    if m := re.fullmatch(r"Is the ([\w ]+?) (left of|above) the ([\w ]+)\?", text):
        a, b = thing(m.group(1)), thing(m.group(3))
        axis = 0 if m.group(2) == "left of" else 1
        assert abs(a[axis] - b[axis]) >= scenes.MIN_GAP, "a position question about things too close to call"
        return "yes" if a[axis] < b[axis] else "no"
    raise AssertionError(f"unrecognised question {text!r}")


def test_same_seed_same_examples_and_other_seeds_differ():
    first = [scenes.make_example(7, i, size=SIZE) for i in range(5)]
    again = [scenes.make_example(7, i, size=SIZE) for i in range(5)]
    for a, b in zip(first, again):
        assert a.scene == b.scene and a.question == b.question
        assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    other = [scenes.make_example(8, i, size=SIZE) for i in range(5)]
    assert [e.scene for e in first] != [e.scene for e in other]


def test_train_and_heldout_splits_share_no_scene():
    train = {repr(scenes.make_scene(scenes.split_seed("train"), i, SIZE)[1]) for i in range(40)}
    test = {repr(scenes.make_scene(scenes.split_seed("test"), i, SIZE)[1]) for i in range(40)}
    assert len(train) == 40 and not train & test
    assert len({scenes.split_seed(s) for s in ("train", "val", "test")}) == 3


def test_every_answer_is_right_and_every_type_is_asked():
    asked = set()
    for index in range(60):
        example = scenes.make_example(1, index, size=SIZE)
        asked.add(example.question.type)
        assert rederive(example.scene, example.question.text) == example.question.answer, example.question
        rng, scene, _ = scenes.make_scene(1, index, SIZE)
        for question in scenes.questions_for_scene(scene, rng, SIZE):
            assert rederive(scene, question.text) == question.answer, question
    assert asked == set(scenes.QUESTION_TYPES)


def test_scenes_are_crowded_with_textured_backgrounds_and_signs():
    drawn = [scenes.make_scene(0, i, SIZE)[1] for i in range(40)]
    assert {s.background for s in drawn} == set(scenes.BACKGROUNDS)
    assert max(len(s.shapes) for s in drawn) >= 6 and min(len(s.shapes) for s in drawn) >= 2
    assert all(any(sign.kind == "digit" for sign in s.signs) for s in drawn)
    assert any(any(sign.kind == "word" for sign in s.signs) for s in drawn)
    # the count of a kind is the number of drawn shapes of that kind, repeats included
    assert any(len({(t.kind, t.colour) for t in s.shapes}) < len(s.shapes) for s in drawn)


def test_the_read_question_answers_the_digit_drawn_on_the_sign():
    """A scene built by hand: the digit is the read question's answer, and the sign's pixels differ from a
    scene with another digit only inside the sign."""
    def scene(digit):
        sign = scenes.Sign("digit", digit, 80, 80, 14, 17, 24)
        return scenes.Scene((Shape("circle", "red", 10, 30, 30),), (sign,), "gradient")

    seven, three = scene("7"), scene("3")
    assert scenes.read_question(seven, np.random.default_rng(0)).answer == "7"
    a = np.asarray(scenes.render(seven, np.random.default_rng(0), SIZE)).astype(int)
    b = np.asarray(scenes.render(three, np.random.default_rng(0), SIZE)).astype(int)
    differ = np.argwhere((a != b).any(-1))
    assert len(differ) > 20  # the digit is drawn
    assert differ[:, 0].min() >= 80 - 17 and differ[:, 0].max() <= 80 + 17
    assert differ[:, 1].min() >= 80 - 14 and differ[:, 1].max() <= 80 + 14


def test_count_question_counts_the_drawn_shapes_of_a_kind():
    shapes = (Shape("star", "red", 8, 20, 20), Shape("star", "red", 8, 60, 20), Shape("star", "blue", 8, 100, 20),
              Shape("circle", "red", 8, 20, 100))
    scene = scenes.Scene(shapes, (), "noise")
    counts = {scenes.count_question(scene, np.random.default_rng(s)).text: scenes.count_question(scene, np.random.default_rng(s)).answer
              for s in range(40)}
    assert counts["How many stars are there?"] == "3"
    assert counts["How many red shapes are there?"] == "3"
    assert counts["How many blue shapes are there?"] == "1"


def test_normalise_and_score():
    assert scenes.normalise(" Three. ") == "3" and scenes.normalise("Yes") == "yes"
    result = scenes.score([("count", "three", "3"), ("count", "4", "3"), ("read", "Cat.", "cat")])
    assert result["n"] == 3 and result["accuracy"] == pytest.approx(2 / 3)
    assert result["per_type"] == {"count": 0.5, "read": 1.0}


def test_unknown_question_type_and_background_are_clear_errors():
    with pytest.raises(ValueError, match="unknown question type 'colours'"):
        scenes.make_example(0, 0, "colours")
    with pytest.raises(ValueError, match="unknown background"):
        scenes.background("plaid", np.random.default_rng(0))


def test_a_curriculums_simple_scenes_hold_fewer_things_and_the_default_ones_are_unchanged():
    """`simple` (train_routing_model --simple_steps): 1-3 large shapes and no sign; the default draw is the same
    generator's as before the option, so splits and checkpoints keep their scenes."""
    simple = [scenes.make_scene(0, i, SIZE, simple=True)[1] for i in range(40)]
    assert all(1 <= len(s.shapes) <= 3 and not s.signs for s in simple)
    assert min(shape.radius for s in simple for shape in s.shapes) >= SIZE // 9
    assert {len(s.shapes) for s in simple} == {1, 2, 3}
    full = [scenes.make_scene(0, i, SIZE)[1] for i in range(40)]
    assert max(len(s.shapes) for s in full) > 3 and any(len(s.signs) == 2 for s in full)
    assert all(scenes.make_scene(0, i, SIZE, simple=False)[1] == full[i] for i in range(5))
    for scene in simple[:10]:  # every question a simple scene asks is answered by the scene alone
        rng = np.random.default_rng(0)
        for question in scenes.questions_for_scene(scene, rng, SIZE):
            assert rederive(scene, question.text) == scenes.normalise(question.answer), question
