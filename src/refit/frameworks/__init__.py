"""Adapters for the RL frameworks that drive refit: verl's checkpoint engine (``verl``) and TRL's GRPO weight
sync (``trl``).

Each module imports its framework at import time and is imported by nobody in the library: the core knows
nothing of verl or TRL. ``refit.frameworks.verl`` registers the ``refit`` backend in verl's
``CheckpointEngineRegistry`` when it is imported (verl imports it through
``checkpoint_engine.custom_backend_module``); ``refit.frameworks.trl`` gives GRPO a ``rollout_func`` that
generates with vLLM and syncs the weights with refit.
"""
