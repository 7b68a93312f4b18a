"""Test-only: lets PyPI's ``torchvision`` import beside the CPU build of torch, in every process of an SGLang test.

torchvision's compiled ops do not load with this torch, and its Python side then fails on the missing
``torchvision::nms`` / ``torchvision::qnms`` op schemas. SGLang imports ``torchvision.transforms`` (never
these ops), so the schemas are declared, without kernels, just before torchvision is first imported.
Imported by ``sitecustomize`` (beside it), which Python runs at start-up in every process whose
``PYTHONPATH`` holds this directory (the SGLang test harness sets it for the engine it starts, and its
scheduler processes inherit it), and by the tests' ``conftest.py`` in the pytest process itself.
"""

from __future__ import annotations

import importlib.abc
import sys

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold, float scale, int zero_point) -> Tensor",
}


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    """Declares the schemas the first time ``torchvision`` is imported, then steps aside."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for schema in SCHEMAS.values():
            try:
                lib.define(schema)
            except RuntimeError:
                pass  # already declared
        _LIBS.append(lib)  # keep the fragment alive
        return None  # the normal finders import torchvision


_LIBS: list = []
sys.meta_path.insert(0, _DeclareTorchvisionOps())
