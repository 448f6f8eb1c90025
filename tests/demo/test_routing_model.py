"""The routing-study model and its training script at the tiny spec on the CPU: the spec builds and runs forward,
training steps run and write a model directory, a checkpoint + --resume gives the uninterrupted run's losses,
the model rebuilds from a training directory, bad arguments are clear errors."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from vismmoe_kt.demo import scenes
from vismmoe_kt.models.bf16_experts import BF16_EXPERTS, use_bf16_experts
from vismmoe_kt.demo.routing_model import ROUTING_SPECS, build_routing_model, image_size, load_routing_model
from vismmoe_kt.demo.training import Labeller, question_chat
from vismmoe_kt.errors import LoadError

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_routing_model.py"
TINY = ["--spec", "routing-tiny", "--batch", "2", "--workers", "0", "--warmup", "2", "--threads", "1", "--no_progress"]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_routing_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_spec_is_the_issues_size():
    spec = ROUTING_SPECS["routing-12x64"]
    assert (spec.layers, spec.experts, spec.top_k, spec.hidden, spec.family) == (12, 64, 8, 512, "qwen3_vl_moe")


def test_the_tiny_spec_builds_and_answers_a_scene_forward():
    model, processor = build_routing_model("routing-tiny")
    example = scenes.make_example(1, 0, size=image_size(ROUTING_SPECS["routing-tiny"]))
    inputs, labels = Labeller(processor).labelled([example.image], [question_chat(example.question.text, "yes")])
    with torch.no_grad():
        output = model(**inputs, labels=labels, output_router_logits=True)
    assert output.logits.shape[:2] == inputs["input_ids"].shape
    assert torch.isfinite(output.loss) and float(output.aux_loss) > 0
    assert int((labels != -100).sum()) == len("yes") + 1  # the answer's bytes and <|im_end|>


def losses(out: Path) -> list[float]:
    return [c["loss"] for c in json.loads((out / "training.json").read_text())["curve"]]


def test_checkpoint_and_resume_give_the_uninterrupted_losses(script, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    script.main(TINY + ["--out", str(whole), "--steps", "4", "--eval_per_type", "1"])
    record = json.loads((whole / "training.json").read_text())
    assert [c["step"] for c in record["curve"]] == [1, 2, 3, 4]
    assert set(record["heldout"]["teacher_forced"]) == set(scenes.QUESTION_TYPES)
    # the picture's worth, watched at the checkpoint (the last step's) and measured at the end
    assert set(record["curve"][-1]["image_gain"]) == set(record["heldout"]["image_dependence"]) == set(scenes.QUESTION_TYPES)
    assert (whole / "config.json").is_file() and (whole / "model.safetensors").is_file()

    script.main(TINY + ["--out", str(split), "--steps", "2", "--eval_per_type", "0"])
    script.main(TINY + ["--out", str(split), "--steps", "4", "--eval_per_type", "0", "--resume"])
    assert losses(split) == losses(whole)
    assert json.loads((split / "training.json").read_text())["resumed_from"] == 2
    a, _, name = load_routing_model(whole)
    b, _, _ = load_routing_model(split, checkpoint=True)
    assert name == "routing-tiny"
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_stop_after_checkpoints_and_a_resume_at_the_last_step_evaluates(script, tmp_path, capsys):
    out = tmp_path / "cut"
    with pytest.raises(SystemExit) as stop:  # any positive limit has passed after the first step
        script.main(TINY + ["--out", str(out), "--steps", "3", "--eval_per_type", "0", "--stop_after", "1e-9"])
    assert stop.value.code == 3 and "stopped at step 1 of 3" in capsys.readouterr().out
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 1 and not (out / "training.json").exists()
    script.main(TINY + ["--out", str(out), "--steps", "1", "--eval_per_type", "1", "--resume"])
    assert "the checkpoint is at the last step (1): evaluating" in capsys.readouterr().out
    record = json.loads((out / "training.json").read_text())
    assert [c["step"] for c in record["curve"]] == [1] and record["resumed_from"] == 1
    assert set(record["heldout"]["teacher_forced"]) == set(scenes.QUESTION_TYPES) and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--batch", "-1"], "--batch must be at least 1"),
    (["--keep", "0.5,fast"], "--keep: expected comma-separated numbers"),
    (["--keep", "1.5"], "--keep ratios must be in"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--resume"], "--resume: no"),
    (["--stop_after", "0"], "--stop_after must be positive"),
    (["--pruned_per_type", "-1"], "--warmup, --simple_steps, --watch_per_type"),
    (["--simple_steps", "-5"], "--warmup, --simple_steps, --watch_per_type"),
    (["--watch_per_type", "-1"], "--watch_per_type and --profile_steps cannot be negative"),
    (["--profile_steps", "-1"], "--watch_per_type and --profile_steps cannot be negative"),
    (["--steps", "4", "--profile_steps", "2"], "--profile_steps 2: the run has 4 --steps"),
])
def test_bad_arguments_are_clear_errors(script, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        script.parse_args(TINY + ["--out", str(tmp_path / "run")] + flags)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_a_directory_without_training_is_a_clear_error(tmp_path):
    with pytest.raises(LoadError, match="no spec.json"):
        load_routing_model(tmp_path)
    (tmp_path / "spec.json").write_text('{"spec": "routing-tiny"}')
    with pytest.raises(LoadError, match="neither model.safetensors nor checkpoint.pt"):
        load_routing_model(tmp_path)


def test_pruned_evaluation_runs_the_vismmoe_rules_at_each_keep_ratio(script, tmp_path):
    out = tmp_path / "run"
    record = script.train(script.parse_args(TINY + ["--out", str(out), "--steps", "1", "--eval_per_type", "1",
                                                    "--pruned_eval", "--keep", "0.5", "--prune_layer", "1",
                                                    "--pruned_per_type", "2"]))
    by_keep = record["pruned"]["by_keep"]
    assert list(by_keep) == ["1.0", "0.5"]
    assert record["pruned"]["per_type"] == 2  # --pruned_per_type, not --eval_per_type's 1
    assert all(r["n"] == 2 * len(scenes.QUESTION_TYPES) and len(r["experts_per_layer_prefill"]) == 2
               for r in by_keep.values())


def test_bf16_autocast_trains_and_a_float32_checkpoint_does_not_resume_it(script, tmp_path, capsys):
    out = tmp_path / "bf16"
    script.main(TINY + ["--out", str(out), "--steps", "2", "--eval_per_type", "0", "--bf16"])
    record = json.loads((out / "training.json").read_text())
    assert record["autocast"] == "bfloat16" and all(torch.isfinite(torch.tensor(losses(out))))
    fp32 = tmp_path / "fp32"
    script.main(TINY + ["--out", str(fp32), "--steps", "2", "--eval_per_type", "0"])
    assert losses(fp32) != losses(out)  # the products ran in another precision
    with pytest.raises(SystemExit, match="trained with"):
        script.main(TINY + ["--out", str(fp32), "--steps", "3", "--eval_per_type", "0", "--resume", "--bf16"])


def test_bf16_experts_compute_in_bf16_and_train_the_float32_weights(tmp_path):
    """The products in BF16 (the output within BF16's rounding of float32's, yet not equal to it), the gradients on
    the float32 expert weights, and nothing of the switch in the saved config."""
    model, _ = build_routing_model("routing-tiny")
    experts = model.model.language_model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(12, experts.hidden_dim, generator=generator)
    index = torch.randint(0, experts.num_experts, (12, 2), generator=generator)
    weights = torch.rand(12, 2, generator=generator)
    reference = experts(x, index, weights).detach()
    use_bf16_experts(model)
    assert model.get_experts_implementation()["text_config"] == BF16_EXPERTS
    out = experts(x, index, weights)
    assert out.dtype == torch.float32 and not torch.equal(out, reference)
    torch.testing.assert_close(out.detach(), reference, rtol=0.05, atol=0.02 * float(reference.abs().max()))
    out.square().sum().backward()
    assert experts.gate_up_proj.grad.dtype == torch.float32 and experts.gate_up_proj.grad.abs().sum() > 0
    assert experts.down_proj.grad.abs().sum() > 0
    model.save_pretrained(str(tmp_path))  # a trained model loads with transformers' own experts
    assert BF16_EXPERTS not in (tmp_path / "config.json").read_text()


def test_profile_steps_report_the_steps_and_stop_without_a_checkpoint(script, tmp_path, capsys):
    out = tmp_path / "profiled"
    result = script.train(script.parse_args(TINY + ["--out", str(out), "--steps", "5", "--profile_steps", "2"]))
    report = (out / "profile.txt").read_text()
    assert report.startswith("2 profiled steps,") and "aten ops" in report and "by host time:" in report
    assert "aten::" in report and result["ms_per_step"] > 0
    assert not (out / "checkpoint.pt").exists() and not (out / "training.json").exists()
    assert "--profile_steps: wrote" in capsys.readouterr().out


def test_image_dependence_tells_answers_from_the_picture_from_answers_from_priors():
    """The trained demo model reads colours off its pictures: another scene's picture costs it loss on colour
    questions. With one question a type the other picture is its own: no gain, exactly."""
    from vismmoe_kt import load
    from vismmoe_kt.demo import vqa
    from vismmoe_kt.demo.tiny import demo_model_dir
    from vismmoe_kt.demo.training import Labeller, image_dependence

    model, processor = load(demo_model_dir(), None, generate_device="cpu", prefill_device="cpu", progress=False)
    labeller = Labeller(processor)
    watched = image_dependence(model, labeller, vqa.make_example, ["colour"], 8, vqa.SPLIT_SEEDS["val"])
    assert watched["colour"]["gain"] > 0.2 and watched["colour"]["other"] > watched["colour"]["own"]
    alone = image_dependence(model, labeller, vqa.make_example, ["colour"], 1, vqa.SPLIT_SEEDS["val"])
    assert alone["colour"]["gain"] == 0.0
