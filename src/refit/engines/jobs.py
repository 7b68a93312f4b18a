"""What every engine adapter's trainer side needs to agree on a job: its secret and its id.

Engine-neutral (the vLLM and SGLang trainers both use it); imports no engine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from refit.engines.vllm.common import RefitInitInfo
from refit.errors import ConfigError
from refit.transport import auth


def job_secret(
    info: RefitInitInfo, refusal: Callable[[str | None], ConfigError | None] | None = None
) -> tuple[str, str]:
    """(secret, job_id) for the job's store, agreed by every trainer rank.

    The secret: ``info.secret`` if set (sent to the workers in the init info as given), else
    ``REFIT_SECRET`` / ``REFIT_SECRET_FILE`` (then the workers read it from their own environment and it
    is not sent: ``""``), else a fresh one from rank 0. The job id: ``info.job_id`` if set, else fresh
    from rank 0. "From rank 0" with several trainer ranks means broadcast over the trainer's default
    process group, as bytes in a tensor (nothing is unpickled). ``refusal(chosen)`` (the adapter's rule,
    called on every rank with the secret chosen so far: ``""`` means one refit would make) returns why
    rank 0 must not start the job, or None; then rank 0 raises that ``ConfigError`` and the other ranks
    raise one too where they wait for rank 0's fresh values (else they would time out joining its store).
    Returns what the workers' init info carries; ``open_store`` resolves the same secret."""
    secret = info.secret or (None if auth.secret_from_env() is not None else "")
    refused = refusal(secret) if refusal is not None else None
    need = [secret == "", not info.job_id]
    if refused is not None and (info.n_trainer == 1 or not any(need)):
        raise refused
    fresh = from_rank0(info, sum(need), refuse=refused is not None) if any(need) else []
    if refused is not None:
        raise refused
    if secret == "":
        secret = fresh.pop(0)
    return (secret or ""), (info.job_id or fresh.pop(0))


def from_rank0(info: RefitInitInfo, n: int, refuse: bool = False) -> list[str]:
    """``n`` fresh random texts (64 hex characters each) made by trainer rank 0, the same on every rank.
    ``refuse`` (rank 0): send zero bytes instead, on which the other ranks raise ``ConfigError``."""
    if info.n_trainer == 1:
        return [auth.new_secret().decode() for _ in range(n)]
    if not dist.is_initialized() or dist.get_world_size() != info.n_trainer:
        raise ConfigError(
            f"{info.n_trainer} trainer ranks need one job secret and job id: set the init info's secret "
            "and .job_id (or REFIT_SECRET) on every rank, or initialize the trainer's default process group "
            "so rank 0 can share fresh ones"
        )
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    buf = torch.zeros(64 * n, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0 and not refuse:
        made = b"".join(auth.new_secret() for _ in range(n))
        buf.copy_(torch.frombuffer(bytearray(made), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    if refuse:
        return []  # rank 0 raises its own error
    raw = bytes(buf.cpu().tolist())
    if not any(raw):  # hex text is never zero bytes: rank 0 refused
        raise ConfigError("trainer rank 0 refused to start the job (its error says why)")
    return [raw[64 * i : 64 * (i + 1)].decode() for i in range(n)]
