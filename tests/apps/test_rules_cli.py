"""`vismmoe-kt rules list|show` and `--placement NAME` on the model-loading commands: the generated rules of
the checkpoint's family, the same as the checked-in rule file; errors name the choices."""

import re

import pytest
import yaml

from vismmoe_kt.apps.cli import main
from vismmoe_kt.demo.tiny import DEMO_SPEC, SPECS

QUESTION = "What colour is the square?"


def chat(*args):
    return ["chat", "--demo", "--greedy", "--max_new_tokens", "6", "--stats", *map(str, args)]


def test_rules_list_shows_every_family_and_its_placements(capsys):
    assert main(["rules", "list"]) == 0
    out = capsys.readouterr().out
    rows = dict(line.split(None, 1) for line in out.splitlines()[:6])
    assert rows["qwen3vl"].split() == ["vismmoe", "gpu", "offload", "lru", "hybrid", "kt-cpu", "realb", "ep"]
    assert rows["kimi-k25"].split() == ["vismmoe", "offload", "hybrid", "kt-cpu", "realb", "ep"]
    assert set(rows) == {"qwen3vl", "glm4v", "deepseek-ocr2", "kimi-k25", "ernie45vl", "llama4"}


@pytest.mark.parametrize("which,file", [(["--family", "llama4"], "llama4-realb.yaml"),
                                        (["--demo"], "qwen3vl-realb.yaml")])
def test_rules_show_prints_the_rule_file(which, file, capsys):
    assert main(["rules", "show", "--placement", "realb", *which]) == 0
    with open(f"optimize_rules/{file}", encoding="utf-8") as f:
        assert capsys.readouterr().out == f.read()


def test_rules_show_reads_the_family_from_the_checkpoint(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "ernie4_5_vl_moe"}')
    assert main(["rules", "show", "--placement", "offload", "--model_path", str(tmp_path)]) == 0
    rules = yaml.safe_load(capsys.readouterr().out)
    assert [r["replace"]["class"].rpartition(".")[2] for r in rules] == \
        ["VisDecoder", "VisExperts", "VisionExperts", "default"]


@pytest.mark.parametrize("args,message", [
    (["--placement", "fast", "--demo"], "error: unknown placement 'fast'; the placements: vismmoe, gpu, offload"),
    (["--placement", "lru", "--family", "kimi-k25"], "error: kimi-k25 has no lru placement .*; its placements: "
                                                     "vismmoe, offload, hybrid"),
    (["--placement", "lru", "--family", "qwen"], "error: unknown family 'qwen'; the families: qwen3vl, glm4v"),
])
def test_rules_show_errors_name_the_choices(args, message, capsys):
    assert main(["rules", "show", *args]) == 2
    assert re.search(message, capsys.readouterr().err)


def answer_and_operators(out):
    reply = out[: out.index("prompt eval count:")]
    return reply, re.findall(r"VisExperts x\d+:\s+policy=\w+, pinned_layers=\d+", out)


def test_chat_with_a_placement_answers_as_its_rule_file(image_file, capsys):
    assert main(chat("--image", image_file, "--prompt", QUESTION, "--placement", "lru")) == 0
    by_placement = answer_and_operators(capsys.readouterr().out)
    assert main(chat("--image", image_file, "--prompt", QUESTION, "--optimize_config_path",
                     "optimize_rules/qwen3vl-lru.yaml")) == 0
    by_file = answer_and_operators(capsys.readouterr().out)
    assert by_placement == by_file and by_placement[0].strip()
    assert re.fullmatch(rf"VisExperts x{SPECS[DEMO_SPEC].layers}:\s+policy=lru, pinned_layers=0", by_placement[1][0])


def test_set_applies_to_a_placement(capsys):
    assert main(chat("--prompt", "hi", "--placement", "offload", "--set", "expert_budget=7MiB")) == 0
    out = capsys.readouterr().out
    pinned = int(re.search(r"VisExperts x\d+:\s+policy=vismmoe, pinned_layers=(\d+)", out).group(1))
    assert pinned < SPECS[DEMO_SPEC].layers  # the 16GiB of the rules would pin every layer
    assert "--placement offload (qwen3vl)" in out  # the stats name the rules


def test_placement_and_a_rule_file_together_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(chat("--placement", "lru", "--optimize_config_path", "optimize_rules/qwen3vl-lru.yaml"))
    assert exit_.value.code == 2
    assert "error: argument --optimize_config_path: not allowed with argument --placement" in capsys.readouterr().err


def test_a_placement_the_checkpoint_family_lacks_fails_before_loading(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "kimi_k25"}')  # no weights: nothing may load
    assert main(["chat", "--model_path", str(tmp_path), "--prompt", "hi", "--placement", "gpu"]) == 2
    err = capsys.readouterr().err
    assert "error: --placement gpu: kimi-k25 has no gpu placement" in err and "its placements: vismmoe, offload" in err
