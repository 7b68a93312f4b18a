"""The SGLang tests' shims (``shims/``) in the pytest process itself, before anything imports SGLang."""

import faulthandler
import sys
from pathlib import Path

SHIMS = str(Path(__file__).resolve().parent / "shims")
if SHIMS not in sys.path:
    sys.path.insert(0, SHIMS)
import torchvision_ops  # noqa: E402, F401

# pytest's faulthandler plugin (on by default) writes to a copy of the captured stderr; with it on, the first
# engine died during start-up under fd capture in both runs tried, with it off it never did (cause not found)
faulthandler.disable()
