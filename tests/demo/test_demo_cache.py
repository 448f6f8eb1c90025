"""The demo model assembled into the cache by several processes at once (expert-parallel ranks start together):
one builds it, under a lock, and the others wait and get the finished model; no finished model is removed under
a reader, and no staging directory is left behind."""
import fcntl
import threading

from vismmoe_kt.demo import tiny


def test_builders_at_once_build_it_once(tmp_path, monkeypatch):
    monkeypatch.setenv("VISMMOE_KT_CACHE", str(tmp_path))
    builds, started = [], threading.Barrier(4)

    def build(out):
        builds.append(out)
        (out / "model.safetensors").write_text("weights")

    monkeypatch.setattr(tiny, "save_demo_model", build)
    results = []

    def rank():
        started.wait(timeout=10)
        results.append(tiny.demo_model_dir())

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(builds) == 1 and len(set(results)) == 1 and len(results) == 4
    target = results[0]
    assert (target / ".complete").exists() and (target / "model.safetensors").read_text() == "weights"
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, f"{target.name}.lock"])


def test_a_builder_waiting_for_the_lock_finds_the_model_finished_and_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VISMMOE_KT_CACHE", str(tmp_path))
    builds = []
    monkeypatch.setattr(tiny, "save_demo_model", lambda out: builds.append(out))
    target = tiny.cache_root() / "models" / f"{tiny.DEMO_SPEC}-{tiny.demo_weights_digest()}-v{tiny.FORMAT_VERSION}"
    target.parent.mkdir(parents=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:  # another process is building
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = []
        waiting = threading.Thread(target=lambda: results.append(tiny.demo_model_dir()))
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive() and not results  # it waits for the lock
        target.mkdir()  # the other process finishes
        (target / "model.safetensors").write_text("theirs")
        (target / ".complete").write_text("ok\n")
    waiting.join(timeout=30)
    assert results == [target] and not builds and (target / "model.safetensors").read_text() == "theirs"


def test_the_demo_directory_names_its_architecture_as_a_saved_checkpoint_does(tmp_path):
    """llama.cpp's convert_hf_to_gguf.py picks its converter by config.json's `architectures` (and fails without)."""
    import json

    tiny.save_demo_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    assert config["model_type"] == "qwen3_vl_moe"
    # the fused experts as published checkpoints store them, (E, H, 2I) and (E, I, H): llama.cpp's converter splits
    # gate_up along the last dim
    from safetensors import safe_open

    text = config["text_config"]
    experts, hidden, width = text["num_local_experts"], text["hidden_size"], text["moe_intermediate_size"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape() == [experts, hidden, 2 * width]
        assert f.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape() == [experts, width, hidden]
