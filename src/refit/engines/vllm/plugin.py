"""``vllm.general_plugins`` entry point: registers the ``refit`` weight-transfer backend."""


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    try:
        WeightTransferEngineFactory.register_engine("refit", "refit.engines.vllm.worker", "RefitWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass
    try:
        WeightTransferTrainerFactory.register_engine("refit", "refit.engines.vllm.trainer", "RefitTrainerEngine")
    except ValueError:
        pass
