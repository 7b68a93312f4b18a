"""refit's errors: one base, children by where a refit failed.

::

    RefitError
      ConfigError(ValueError)       a configuration value, flag, model config or topology file
        SpecError                   a parallelism spec string ("tp=2,pp=2") or its rank count
        ModelError                  an unknown preset or an unreadable model config
        TopologyError               a cluster topology file
      LayoutError(ValueError)       names, shapes, boxes; local tensors vs their layout
      PlanError(ValueError)         the two sides cannot be connected; plans disagree (digest)
      TransferError(RuntimeError)   something went wrong while bytes moved
        RefitAborted                a refit was abandoned (same message on every process)
        DeadlineExceeded(TimeoutError)
        ChecksumError               received bytes differ from the sent ones
        FanoutError                 a fan-out wave could not be completed
      DataError(RuntimeError)       the data plane (store, replay buffer, leader fetch)

User errors (``ConfigError``, ``LayoutError``, ``PlanError``) are what the CLI turns into one line and
exit status 2. Messages name the parameter, the side and rank, and both values.
"""

from __future__ import annotations


class RefitError(Exception):
    """Base of every error refit raises on purpose."""


class ConfigError(RefitError, ValueError):
    """A configuration value, command-line flag, model config or topology file is invalid."""


class SpecError(ConfigError):
    """A parallelism spec string is malformed or does not fit the ranks."""


class ModelError(ConfigError):
    """Unknown preset or unreadable model config."""


class TopologyError(ConfigError):
    """A cluster topology file is unreadable or holds an invalid value."""


class LayoutError(RefitError, ValueError):
    """A layout is inconsistent (mesh, placements, shapes or ranks), or a local tensor disagrees with it."""


class PlanError(RefitError, ValueError):
    """The two layouts cannot be connected (names, shapes, dtypes, coverage, budget), or two processes'
    plans disagree."""


class TransferError(RefitError, RuntimeError):
    """Something failed while a refit moved bytes (rendezvous, transport, peers)."""


class RefitAborted(TransferError):
    """A refit was abandoned; the message is the same on every process of it."""


class DeadlineExceeded(TransferError, TimeoutError):
    """A blocking step of a refit was still waiting when the refit's deadline passed."""


class ChecksumError(TransferError):
    """Checksums on: received bytes differ from what the sender sent."""


class FanoutError(TransferError):
    """A fan-out wave could not be completed (no live source holds the version, a coordinator timed out)."""


class DataError(RefitError, RuntimeError):
    """The data plane failed (store, replay buffer, leader fetch)."""


USER_ERRORS = (ConfigError, LayoutError, PlanError)
"""What the command line reports as one line with exit status 2 (bad input, not a failed run)."""
