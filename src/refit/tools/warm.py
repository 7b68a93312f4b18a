"""What ranks started by ``refit.tools.launch`` import late, imported once ahead of them.

``launch`` forks every rank from a forkserver that imports ``PRELOAD``; this module is the last entry. A rank that
reads a model's shapes (``refit.layout.models.param_shapes``) or builds one imports transformers and that
architecture's config and modeling modules, and the delta, checksum and FP8 kernels import triton where it is
installed: seconds of CPU a rank, paid again by every rank of every job. Imported here, each rank forks with them
loaded. Nothing here changes what a rank computes: a package that is missing is left for the rank to report.
"""

from __future__ import annotations

import contextlib

import torch

from refit.layout.models import PRESETS, build_model, load_config


def _warm() -> None:
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    with contextlib.suppress(ImportError):
        first = {p.model_type: name for name, p in reversed(PRESETS.items())}  # the first (tiniest) of each type
        for name in first.values():  # the architecture's config and modeling modules, through a model on meta
            build_model(load_config(name), torch.float32, device="meta", seed=None)


_warm()
