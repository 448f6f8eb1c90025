"""The synthetic VQA generator: deterministic per seed, held-out splits differ, every answer is right."""

import re

import numpy as np
import pytest

from vismmoe_kt.demo.vqa import COLOURS, IMAGE_SIZE, KINDS, QUESTION_TYPES, make_example, split_seed


def rederive(scene: dict) -> str:
    """The answer, worked out again from the scene description alone (independently of the generator's askers)."""
    shapes, text = scene["shapes"], scene["question"]["text"]
    if m := re.fullmatch(r"Is there a (\w+) (\w+)\?", text):
        return "yes" if any((s["colour"], s["kind"]) == m.groups() for s in shapes) else "no"
    if m := re.fullmatch(r"What colour is the (\w+)\?", text):
        (only,) = [s for s in shapes if s["kind"] == m.group(1)]  # the question is only asked of a unique kind
        return only["colour"]
    if m := re.fullmatch(r"How many (\w+)s are there\?", text):
        return str(sum(s["kind"] == m.group(1) for s in shapes))
    if m := re.fullmatch(r"Is the (\w+) (\w+) (left of|above) the (\w+) (\w+)\?", text):
        (a,) = [s for s in shapes if (s["colour"], s["kind"]) == m.group(1, 2)]
        (b,) = [s for s in shapes if (s["colour"], s["kind"]) == m.group(4, 5)]
        axis = "x" if m.group(3) == "left of" else "y"
        assert abs(a[axis] - b[axis]) >= 20, "a position question about shapes too close to call"
        return "yes" if a[axis] < b[axis] else "no"
    raise AssertionError(f"unrecognised question {text!r}")


def test_same_seed_same_examples_and_other_seeds_differ():
    first = [make_example(7, i) for i in range(6)]
    again = [make_example(7, i) for i in range(6)]
    for a, b in zip(first, again):
        assert a.describe() == b.describe()
        assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    other = [make_example(8, i) for i in range(6)]
    assert [e.describe() for e in first] != [e.describe() for e in other]
    assert split_seed("train") != split_seed("test") and split_seed("val") != split_seed("test")


@pytest.mark.parametrize("qtype", QUESTION_TYPES)
def test_every_answer_rederived_from_the_scene(qtype):
    answers = []
    for index in range(150):
        example = make_example(split_seed("test"), index, qtype)
        scene = example.describe()
        assert example.image.size == (IMAGE_SIZE, IMAGE_SIZE)
        assert 1 <= len(scene["shapes"]) <= 4
        assert len({(s["kind"], s["colour"]) for s in scene["shapes"]}) == len(scene["shapes"])
        assert all(s["kind"] in KINDS and s["colour"] in COLOURS for s in scene["shapes"])
        assert rederive(scene) == example.question.answer, scene
        answers.append(example.question.answer)
    if qtype in ("exist", "position"):  # yes/no questions are close to balanced: chance is 50%
        assert 0.35 < answers.count("yes") / len(answers) < 0.65


def test_existence_negatives_are_mostly_adversarial():
    """POPE-style: most "no" questions name a kind or a colour that is in the image."""
    near = total = 0
    for index in range(200):
        scene = make_example(3, index, "exist").describe()
        if scene["question"]["answer"] == "no":
            colour, kind = re.fullmatch(r"Is there a (\w+) (\w+)\?", scene["question"]["text"]).groups()
            total += 1
            near += any(s["kind"] == kind or s["colour"] == colour for s in scene["shapes"])
    assert total > 50 and near / total > 0.6


def test_shapes_are_drawn_in_their_colour():
    """The pixel at each shape's centre has the shape's colour (shapes do not overlap)."""
    for index in range(40):
        example = make_example(5, index)
        pixels = np.asarray(example.image)
        for shape in example.describe()["shapes"]:
            x, y = shape["x"], shape["y"] + (shape["radius"] // 4 if shape["kind"] == "triangle" else 0)
            assert tuple(pixels[y, x]) == COLOURS[shape["colour"]]


def test_unknown_split_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        split_seed("dev")
