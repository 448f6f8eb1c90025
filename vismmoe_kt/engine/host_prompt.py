"""A whole picture prompt's facts read on the host before its forward, so that nothing in the forward waits for the GPU.

transformers' forward of a Qwen3-VL picture prompt reads the device three times: it splits the vision tower's
output by sizes read back from the grid (queued after the tower, so the host idles through all of it), checks the
image tokens against the features by a count read back, and builds the M-RoPE positions from token types read back,
in many small device operations with the GPU idle. A prompt whose experts are all on the GPU is paced by the host's
launches, layer by layer, so each wait is lost twice: the GPU idles while the host waits, then waits for the host to
catch up. On an H100 a 448 px prompt's host sat through its 4.8 ms tower, then kept the GPU idle 1.9 ms before the
first layer.

Here the prompt's token ids, token types and grids are copied to the host once, before the forward (the GPU has
nothing of this prompt queued yet); the positions come from the model's own `get_rope_index` on those copies (the
adapter's `rope_index`), and the visual tokens' rows from the ids. Both go to the device without a wait (pinned
memory). The family adapter then builds the text model's inputs from them (`prompt_inputs`), and the text model's
forward (text_forward.py) takes the rows from the ModelPass instead of finding them on the device. The host then
issues the first layers while the GPU still runs the vision tower.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.model_pass import HostPrompt
from ..errors import InputError
from ..models import ModelAdapter

READ = ("input_ids", "mm_token_type_ids", "image_grid_thw")  # what the positions and rows are computed from


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, a host tensor copied without the host waiting: from pinned memory to a GPU (a pageable
    copy first waits for everything queued)."""
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def host_prompt(model: Any, adapter: ModelAdapter, inputs: dict[str, torch.Tensor]) -> HostPrompt | None:
    """The facts of a whole prompt of one sequence with pictures (and no video) whose family builds its text model's
    inputs itself (`prompt_inputs`), else None (the model's own forward runs). Raises InputError where the ids'
    image tokens do not match the pictures' grids."""
    if "pixel_values" not in inputs or "pixel_values_videos" in inputs or any(name not in inputs for name in READ) \
            or inputs["input_ids"].shape[0] != 1 or not adapter.builds_prompt_inputs:
        return None
    host = {name: inputs[name].cpu() for name in READ}
    config = model.config
    rows = torch.nonzero(adapter.image_token_mask(config, host["input_ids"][0]), as_tuple=True)[0]
    features = int((host["image_grid_thw"].prod(-1) // adapter.vision_merge_size(config) ** 2).sum())
    if features != rows.numel():
        raise InputError(f"the prompt has {rows.numel()} image tokens but its pictures' grids give {features} "
                         f"features: the processor's input ids and pixels do not belong together")
    positions, delta = adapter.rope_index(model, host)
    device = inputs["input_ids"].device
    return HostPrompt(visual_rows=to_device(rows, device), visual_tokens=rows.numel(),
                      position_ids=to_device(positions, device), rope_delta=int(delta.reshape(-1)[0]),
                      input_ids=host["input_ids"])
