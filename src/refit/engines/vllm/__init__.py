"""refit as a vLLM weight-transfer backend (``weight_transfer_config={"backend": "refit"}``).

* ``worker.RefitWeightTransferEngine`` runs inside every vLLM worker.
* ``trainer.RefitTrainerEngine`` runs on every trainer rank.
* ``regions`` derives, from vLLM's own modules, which box of each HF tensor a
  worker's loaders read (its TP share), so only that box travels.
* ``plugin.register`` is the ``vllm.general_plugins`` entry point.
* ``extension.RefitWorkerExtension`` (``worker_extension_cls``) adds worker methods the
  driver calls by name (``collective_rpc("refit_stats")``): nothing refit sends is pickled.
"""
