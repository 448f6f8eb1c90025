"""The predictor's visual summary h_v at serving time equals the one its training traces hold.

Training (`vismmoe-kt calibrate`) records the mean embedding of the kept visual tokens as the vision
tower produced them; serving must feed the predictor the same quantity, also when visual tokens are
pruned after the prefix (it once took the hidden states at the prune layer: cosine 0.69 to training's).
"""

import torch

from conftest import make_image
from vismmoe_kt import load
from vismmoe_kt.apps.calibrate import record_traces
from vismmoe_kt.predictor.traces import read_trace


def test_visual_summary_at_serving_equals_training(tiny_dir, tmp_path):
    model, processor = load(tiny_dir, "optimize_rules/qwen3vl.yaml", keep_ratio=0.5, prune_layer=1,
                            generate_device="cpu", prefill_device="cpu", progress=False)
    runtime = model.vismmoe.context.offload_runtime
    paths = record_traces(model, processor, [(make_image(160, 128, seed=3), "Describe the image.")], tmp_path, 2,
                          progress=False)
    assert model.vismmoe.context.pruning.keep is not None  # the request was pruned
    trained = read_trace(paths[0])[0]["visual"].float()
    served = runtime.visual_summary.float()
    assert trained.abs().sum() > 0
    cosine = torch.nn.functional.cosine_similarity(trained, served, dim=0)
    assert cosine > 0.999, float(cosine)
    torch.testing.assert_close(served, trained, rtol=2e-3, atol=2e-3)  # fp16 in the trace
