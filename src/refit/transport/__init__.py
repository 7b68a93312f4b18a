"""Transports: how bytes cross between processes (``p2p``: torch.distributed send/recv; ``ipc``: CUDA IPC
pulls), the control channel they agree through (``control``: the store), checksums and the run clock. They
know nothing of model names. ``nics`` picks RDMA NICs for a UCX/NIXL transport that is not built yet.
"""
