"""The demo model assembled into the cache by several processes at once (expert-parallel ranks start together):
each gets the finished model, whichever process's build lands first."""
import os

from vismmoe_kt.demo import tiny


def test_a_build_that_loses_the_race_to_another_process_returns_the_winners(tmp_path, monkeypatch):
    monkeypatch.setenv("VISMMOE_KT_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny, "save_demo_model", lambda out: (out / "model.safetensors").write_text("weights"))
    real_replace = os.replace

    def other_process_first(src, dst):  # another rank's build lands between this one's check and its move
        os.makedirs(dst)
        (tiny.Path(dst) / "model.safetensors").write_text("weights")
        (tiny.Path(dst) / ".complete").write_text("ok\n")
        real_replace(src, dst)  # a directory onto a non-empty one: OSError (ENOTEMPTY)

    monkeypatch.setattr(tiny.os, "replace", other_process_first)
    target = tiny.demo_model_dir()
    assert (target / ".complete").exists() and (target / "model.safetensors").read_text() == "weights"
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no staging directory left behind


def test_a_build_that_finds_the_model_finished_meanwhile_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VISMMOE_KT_CACHE", str(tmp_path))

    def build(out):  # while this process builds, another one finishes the target
        (out / "model.safetensors").write_text("mine")
        target = tmp_path / "models" / out.name.partition(".staging-")[0]
        target.mkdir()
        (target / "model.safetensors").write_text("theirs")
        (target / ".complete").write_text("ok\n")

    monkeypatch.setattr(tiny, "save_demo_model", build)
    target = tiny.demo_model_dir()
    assert (target / "model.safetensors").read_text() == "theirs"  # the finished model is not removed under readers
    assert [p.name for p in target.parent.iterdir()] == [target.name]
