"""Test-only stand-in for ``sgl_kernel`` (SGLang's CUDA kernels; no CPU build exists for this machine).

SGLang's CPU path imports ``sgl_kernel`` at module level but, on CPUs without AMX, calls none of its
kernels (RMSNorm, SiLU-and-mul and rotary take their ``forward_native`` paths). Every attribute here is
a function that raises ``NotImplementedError`` naming itself, so a kernel that is called after all fails
loudly instead of computing something else. Never on ``sys.path`` outside the SGLang tests.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name} was called: the test stand-in has no kernels")

    kernel.__name__ = name
    return kernel
