"""The vision tower replayed per picture size (engine/vision_graph.py), through the CPU twin of a CUDA graph
(graphs: replay): the tower's own outputs to the bit for every picture, a capture per grid checked against the
eager run, the calls and the grids it leaves eager and why, outputs that a later picture does not overwrite."""

import gc
import weakref

import pytest
import torch
from torch.utils import _pytree
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

from vismmoe_kt.engine import vision_graph
from vismmoe_kt.engine.graphs import ReplayCapture
from vismmoe_kt.engine.vision_graph import MAX_GRIDS, GraphedVisionTower
from vismmoe_kt.models.qwen3_vl_moe import Qwen3VLMoeAdapter
from vismmoe_kt.vision.saliency import SaliencyRecorder

PATCH = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch


def tower(seed=0):
    config = Qwen3VLMoeVisionConfig(hidden_size=64, num_heads=4, depth=3, intermediate_size=96, out_hidden_size=48,
                                    num_position_embeddings=64, deepstack_visual_indexes=[0, 1], patch_size=4,
                                    temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen3VLMoeVisionModel(config).eval()


def picture(grid, seed):
    """(pixels, grid_thw) of images with these (t, h, w) patch grids, packed."""
    patches = sum(t * h * w for t, h, w in grid)
    return torch.randn(patches, PATCH, generator=torch.Generator().manual_seed(seed)), torch.tensor(grid)


def leaves(output):
    return _pytree.tree_flatten(output)[0]


def assert_same(got, want):
    assert type(got) is type(want)
    assert len(leaves(got)) == len(leaves(want)) == 4  # last hidden state, merged tokens, two deepstack features
    for g, w in zip(leaves(got), leaves(want)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def graphed(model, backend=ReplayCapture):
    replayed = GraphedVisionTower(model, Qwen3VLMoeAdapter(), backend)
    own = model.forward
    model.forward = replayed
    return replayed, own


def test_each_picture_gets_the_towers_own_outputs_and_a_grid_is_captured_once():
    model = tower()
    replayed, own = graphed(model)
    with torch.no_grad():
        grids = [[[1, 4, 6]], [[1, 4, 6]], [[1, 4, 6]], [[1, 2, 2], [1, 4, 4]], [[1, 2, 2], [1, 4, 4]]]
        for seed, grid in enumerate(grids):  # one size, then two images packed
            pixels, grid_thw = picture(grid, seed)
            assert_same(model(pixels, grid_thw=grid_thw, return_dict=True),
                        own(pixels, grid_thw=grid_thw, return_dict=True))
    stats = replayed.stats()
    assert stats["captures"] == 2 and stats["grids"] == 2     # one per picture size
    assert stats["replays"] == 3 and stats["eager_calls"] == 2  # each grid's first picture runs eagerly
    assert stats["check_failures"] == stats["capture_failures"] == 0 and "reason_eager" not in stats


def test_a_replays_outputs_are_its_own_not_the_graphs_buffers():
    model = tower()
    replayed, own = graphed(model)
    with torch.no_grad():
        model(*picture([[1, 4, 6]], 0)[:1], grid_thw=torch.tensor([[1, 4, 6]]), return_dict=True)  # the capture
        first_pixels, grid_thw = picture([[1, 4, 6]], 1)
        first = model(first_pixels, grid_thw=grid_thw, return_dict=True)
        kept = [t.clone() for t in leaves(first)]
        model(picture([[1, 4, 6]], 2)[0], grid_thw=grid_thw, return_dict=True)  # the next replay writes the buffers
    assert replayed.counters.replays == 2
    for now, then in zip(leaves(first), kept):
        torch.testing.assert_close(now, then, rtol=0, atol=0)


def test_a_size_captured_under_inference_mode_replays_under_no_grad_and_back():
    model = tower()
    replayed, own = graphed(model)
    for seed, mode in enumerate((torch.inference_mode, torch.no_grad, torch.inference_mode)):
        pixels, grid_thw = picture([[1, 4, 6]], seed)
        with mode():
            got = model(pixels, grid_thw=grid_thw, return_dict=True)
        with torch.no_grad():
            assert_same(got, own(pixels, grid_thw=grid_thw, return_dict=True))
    assert replayed.counters.replays == 2


def test_calls_a_replay_cannot_stand_for_run_the_tower_itself():
    model = tower()
    replayed, own = graphed(model)
    pixels, grid_thw = picture([[1, 4, 6]], 0)
    with torch.no_grad():
        model(pixels, grid_thw=grid_thw, return_dict=True)
        # a hook inside the tower whose owner does not say what it keeps: a replay would skip it
        seen = []
        handle = model.blocks[-1].attn.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
        model(pixels, grid_thw=grid_thw, return_dict=True)
        assert len(seen) == 1 and replayed.counters.replays == 0
        handle.remove()  # the hook leaves: replayed again
        model(pixels, grid_thw=grid_thw, return_dict=True)
        assert replayed.counters.replays == 1 and len(seen) == 1
        out = model(pixels, grid_thw=grid_thw, return_dict=True, output_hidden_states=True)  # more than the output
        assert out.hidden_states is not None and replayed.counters.replays == 1
    model(pixels, grid_thw=grid_thw, return_dict=True)  # gradients on
    assert replayed.counters.replays == 1 and replayed.counters.eager_calls == 4


def test_the_saliency_recorders_hook_is_replayed_with_the_tower_and_gives_each_pictures_own_saliency():
    model = tower()
    replayed, own = graphed(model)
    recorder = SaliencyRecorder(model.blocks[-1].attn, 2, Qwen3VLMoeAdapter().attention_received)
    grid = [[1, 4, 6]]
    with torch.no_grad():
        model(*picture(grid, 0)[:1], grid_thw=torch.tensor(grid), return_dict=True)  # captured without the hook
        recorder.enabled = True
        got, want = [], []
        for seed in (1, 2, 3):  # the grid captured again with the hook (its key names it), then replays
            pixels, grid_thw = picture(grid, seed)
            assert_same(model(pixels, grid_thw=grid_thw, return_dict=True),
                        own(pixels, grid_thw=grid_thw, return_dict=True))
            got.append(recorder.take())
            own(pixels, grid_thw=grid_thw, return_dict=True)  # the tower itself, the same hook
            want.append(recorder.take())
        assert recorder.take() is None  # taken once
    stats = replayed.stats()
    assert stats["captures"] == 2 and stats["replays"] == 2 and stats["eager_calls"] == 2
    assert stats["check_failures"] == stats["capture_failures"] == 0
    for g, w in zip(got, want):
        assert g.shape == (6,)  # 24 patches, merged by 2 x 2
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert not torch.equal(got[1], got[2])  # each picture its own, not the graph's buffers
    recorder.enabled = False  # the hook leaves: the grid captured without it serves again
    with torch.no_grad():
        model(*picture(grid, 4)[:1], grid_thw=torch.tensor(grid), return_dict=True)
    assert replayed.counters.replays == 3 and recorder.take() is None


class WrongReplay(ReplayCapture):
    """A capture whose replays write something else than the segment computes."""
    def capture(self, run):
        replay, outputs = super().capture(run)

        def wrong():
            replay()
            outputs[1].add_(1.0)
        return wrong, outputs


class BrokenCapture(ReplayCapture):
    def capture(self, run):
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("backend,counter,reason", [
    (WrongReplay, "check_failures", "differed from the eager tower"),
    (BrokenCapture, "capture_failures", "capture failed: RuntimeError")])
def test_a_grid_whose_capture_fails_or_differs_stays_eager_and_says_why(backend, counter, reason):
    model = tower()
    replayed, own = graphed(model, backend)
    with torch.no_grad():
        for seed in range(3):
            pixels, grid_thw = picture([[1, 4, 6]], seed)
            assert_same(model(pixels, grid_thw=grid_thw, return_dict=True),
                        own(pixels, grid_thw=grid_thw, return_dict=True))
    stats = replayed.stats()
    assert stats[counter] == 1 and reason in stats["reason_eager"]
    assert stats["replays"] == 0 and stats["eager_calls"] == 3 and stats["grids"] == 0


def test_at_most_max_grids_are_kept_the_oldest_going_first():
    model = tower()
    replayed, _ = graphed(model)
    sizes = [[[1, 2, 2 * (i + 1)]] for i in range(MAX_GRIDS + 1)]
    with torch.no_grad():
        for seed, grid in enumerate(sizes):
            model(*picture(grid, seed)[:1], grid_thw=torch.tensor(grid), return_dict=True)
        assert replayed.stats()["grids"] == MAX_GRIDS
        model(*picture(sizes[0], 9)[:1], grid_thw=torch.tensor(sizes[0]), return_dict=True)  # captured again
    assert replayed.counters.captures == MAX_GRIDS + 2 and replayed.counters.replays == 0


class FrozenCapture:
    """Like a CUDA graph, keeps nothing of the run it captured: the outputs of one run, a replay that calls nothing."""
    def capture(self, run):
        outputs = tuple(t.clone() for t in run())
        return (lambda: None), outputs


def test_a_grids_tensors_live_as_long_as_its_graph():
    """A CUDA graph reads the grid's tensors by address: they must outlive the capture, held by the grid."""
    model = tower()
    adapter = Qwen3VLMoeAdapter()
    made = []

    class Recording(Qwen3VLMoeAdapter):
        def vision_graph_inputs(self, vision_tower, grid_thw):
            inputs = adapter.vision_graph_inputs(vision_tower, grid_thw)
            made.extend(weakref.ref(t) for t in inputs.values() if isinstance(t, torch.Tensor))
            return inputs

    replayed = GraphedVisionTower(model, Recording(), FrozenCapture)
    model.forward = replayed
    with torch.no_grad():
        model(*picture([[1, 4, 6]], 0)[:1], grid_thw=torch.tensor([[1, 4, 6]]), return_dict=True)
    gc.collect()
    assert replayed.stats()["grids"] == 1 and len(made) == 4
    assert all(ref() is not None for ref in made)


def test_install_needs_graphs_and_a_family_whose_tower_takes_its_grid_tensors():
    class NoGrids(Qwen3VLMoeAdapter):
        def vision_tower_replayable(self):
            return False

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.visual = tower()

    assert vision_graph.install(Qwen3VLMoeAdapter(), Model(), "off") is None
    assert vision_graph.install(Qwen3VLMoeAdapter(), Model(), "auto") is None  # auto on the CPU: no graphs
    assert vision_graph.install(NoGrids(), Model(), "replay") is None
    model = Model()
    installed = vision_graph.install(Qwen3VLMoeAdapter(), model, "replay")
    assert installed is not None and model.model.visual.forward is installed
    assert vision_graph.install(Qwen3VLMoeAdapter(), model, "replay") is None  # not twice

    class Wrapper(torch.nn.Module):  # an operator a rule put around the tower, passing every call through
        is_injected_operator = True

        def __init__(self, orig_module):
            super().__init__()
            self.orig_module = orig_module

        def forward(self, *args, **kwargs):
            return self.orig_module(*args, **kwargs)

    model = Model()
    inner = model.model.visual
    model.model.visual = Wrapper(inner)
    installed = vision_graph.install(Qwen3VLMoeAdapter(), model, "replay")
    assert installed is not None and inner.forward is installed  # the tower inside, whose grid tensors it knows
    with torch.no_grad():
        for seed in range(2):
            pixels, grid_thw = picture([[1, 4, 6]], seed)
            model.model.visual(pixels, grid_thw=grid_thw, return_dict=True)
    assert installed.stats()["replays"] == 1
