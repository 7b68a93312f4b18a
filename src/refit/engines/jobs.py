"""What every engine adapter's trainer side needs to agree on a job: its secret and its id.

Engine-neutral (the vLLM and SGLang trainers both use it); imports no engine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refit.engines.vllm.common import RefitInitInfo
from refit.errors import ConfigError
from refit.transport import auth


def job_secret(info: RefitInitInfo) -> tuple[str, str]:
    """(secret, job_id) for the job's store, agreed by every trainer rank.

    The secret: ``info.secret`` if set, else ``REFIT_SECRET`` / ``REFIT_SECRET_FILE`` (then the workers
    read it from their own environment and it is not sent: ``""``), else a fresh one from rank 0. The
    job id: ``info.job_id`` if set, else fresh from rank 0. "From rank 0" with several trainer ranks
    means broadcast over the trainer's default process group, as bytes in a tensor (nothing is
    unpickled). Returns what the workers' init info carries; ``open_store`` resolves the same secret."""
    secret = info.secret or (None if auth.secret_from_env() is not None else "")
    need = [secret == "", not info.job_id]
    fresh = from_rank0(info, sum(need)) if any(need) else []
    if secret == "":
        secret = fresh.pop(0)
    return (secret or ""), (info.job_id or fresh.pop(0))


def from_rank0(info: RefitInitInfo, n: int) -> list[str]:
    """``n`` fresh random texts (64 hex characters each) made by trainer rank 0, the same on every rank."""
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
    if dist.get_rank() == 0:
        made = b"".join(auth.new_secret() for _ in range(n))
        buf.copy_(torch.frombuffer(bytearray(made), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    raw = bytes(buf.cpu().tolist())
    return [raw[64 * i : 64 * (i + 1)].decode() for i in range(n)]
