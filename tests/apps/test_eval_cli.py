"""`vismmoe-kt eval`: synthetic split and folder task on the demo model, JSON output, clear errors."""

import json
import re

import pytest

from vismmoe_kt.apps.cli import main
from vismmoe_kt.demo.vqa import QUESTION_TYPES, make_example

RULES = "optimize_rules/qwen3vl-gpu.yaml"


def test_eval_synthetic_split_writes_json(tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = main(["eval", "--demo", "--optimize_config_path", RULES, "--task", "synthetic-vqa", "--split", "test",
               "--limit", "8", "--output", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["task"] == "synthetic-vqa" and result["split"] == "test" and result["n"] == 8
    assert set(result["per_type"]) == set(QUESTION_TYPES)
    assert all(entry["n"] == 2 for entry in result["per_type"].values())  # types cycle
    assert result["correct"] == sum(item["correct"] for item in result["items"])
    assert len(result["experts_per_layer_prefill"]) == 4
    assert all(4 <= n <= 32 for n in result["experts_per_layer_prefill"])  # top-4 of 32 experts
    printed = capsys.readouterr().out
    assert f"accuracy {result['accuracy']:.3f}" in printed and f"wrote {out}" in printed


def test_eval_folder_task_reads_pope_style_questions(tmp_path):
    """A local benchmark folder: POPE's keys (text, label, category), images relative to the folder."""
    data = tmp_path / "bench"
    (data / "images").mkdir(parents=True)
    lines = []
    for index in range(3):
        example = make_example(11, index, "exist")
        example.image.save(data / "images" / f"{index}.png")
        lines.append(json.dumps({"image": f"images/{index}.png", "text": example.question.text,
                                 "label": example.question.answer, "category": "adversarial"}))
    (data / "questions.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "folder.json"
    assert main(["eval", "--demo", "--task", "folder", "--data", str(data), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["n"] == 3 and list(result["per_type"]) == ["adversarial"]
    assert [item["question"] for item in result["items"]] == [json.loads(line)["text"] for line in lines]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("case,message", [
    ("folder_without_data", r"--task folder needs --data DIR"),
    ("no_questions_file", r"--data .*: no questions.jsonl in it"),
    ("bad_json_line", r"questions.jsonl, line 2: not JSON"),
    ("missing_answer", r"questions.jsonl, line 1: needs \"image\""),
    ("missing_image", r"questions.jsonl, line 1: image .*nope.png: no such file"),
    ("bad_split", r"--split: unknown split 'dev'"),
    ("bad_type", r"--types: unknown question type\(s\) shape"),
    ("bad_limit", r"--limit must be at least 1"),
    ("output_dir_missing", r"--output .*: its directory does not exist"),
])
def test_bad_eval_input_is_a_clear_error(tmp_path, capsys, case, message):
    data = tmp_path / "data"
    good_line = json.dumps({"image": "nope.png", "question": "Is there a cat?", "answer": "no"})
    folder = lambda text: ["--task", "folder", "--data", str(write(data / "questions.jsonl", text).parent)]  # noqa: E731
    args = {
        "folder_without_data": lambda: ["--task", "folder"],
        "no_questions_file": lambda: ["--task", "folder", "--data", str(tmp_path)],
        "bad_json_line": lambda: folder("\n{oops\n"),
        "missing_answer": lambda: folder('{"image": "a.png"}\n'),
        "missing_image": lambda: folder(good_line + "\n"),
        "bad_split": lambda: ["--split", "dev"],
        "bad_type": lambda: ["--types", "exist,shape"],
        "bad_limit": lambda: ["--limit", "0"],
        "output_dir_missing": lambda: ["--output", str(tmp_path / "no" / "such" / "r.json")],
    }[case]()
    assert main(["eval", "--demo", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(message, err), err


def test_eval_scenes_task_asks_the_routing_models_questions(tmp_path, capsys):
    """--task scenes: the scenes task's question types, cycled; a bad type names the scenes task's types."""
    from vismmoe_kt.demo import scenes

    out = tmp_path / "scenes.json"
    assert main(["eval", "--demo", "--task", "scenes", "--split", "val", "--limit", "5", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["task"] == "scenes" and set(result["per_type"]) == set(scenes.QUESTION_TYPES)
    assert result["items"][4]["question"] == scenes.make_example(1, 4, "read").question.text
    capsys.readouterr()
    assert main(["eval", "--demo", "--task", "scenes", "--types", "colour,shape"]) == 2
    assert "unknown question type(s) shape; choose from exist, colour, count, position, read" in capsys.readouterr().err
