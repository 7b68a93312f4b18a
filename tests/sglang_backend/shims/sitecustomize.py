"""Test-only: runs at start-up in every process whose ``PYTHONPATH`` holds this directory (``torchvision_ops``)."""

import torchvision_ops  # noqa: F401
