"""What each side holds: meshes, tensor and model layouts, boxes (``tensors``); parallelism specs (``spec``);
HF parameter naming (``hf_names``); sharding rules from a spec (``rules``); engine layouts with the engines' padding
and replicated KV heads (``engines``); EPLB engines' physical expert slots (``eplb``); model presets and configs
(``models``).

Only ``tensors`` is re-exported here; import the others from their modules.
"""

from refit.layout.tensors import (
    LAYOUT_FORMAT,
    Box,
    LayoutError,
    Mesh,
    ModelLayout,
    TensorLayout,
    box_contains,
    box_intersect,
    box_is_contiguous,
    box_numel,
    box_relative,
    box_runs_whole,
    box_shape,
    box_slices,
    chunk_range,
    full_box,
    parse_placement,
    placement_str,
    split_box,
)

__all__ = [
    "LAYOUT_FORMAT",
    "Box",
    "LayoutError",
    "Mesh",
    "ModelLayout",
    "TensorLayout",
    "box_contains",
    "box_intersect",
    "box_is_contiguous",
    "box_numel",
    "box_relative",
    "box_runs_whole",
    "box_shape",
    "box_slices",
    "chunk_range",
    "full_box",
    "parse_placement",
    "placement_str",
    "split_box",
]
