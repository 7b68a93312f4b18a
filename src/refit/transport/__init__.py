"""Transports: how bytes cross between processes. They know nothing of model names."""
