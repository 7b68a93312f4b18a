"""refit for SGLang: every SGLang TP rank receives only its shard of each HF tensor, by refit's plan.

* ``loader.load`` (``LOADER``) is SGLang's custom weight loader, run in every TP scheduler process: it
  joins the job through refit's signed store, learns its share from SGLang's live modules (``regions``)
  and receives into the live (fused) parameters, staged and committed atomically.
* ``trainer.RefitSGLangTrainer`` runs on every trainer rank; rank 0 drives SGLang through a ``client``
  (``client.EngineClient`` for an in-process ``sgl.Engine``, ``client.HTTPClient`` for ``launch_server``).

Importing this package does not import SGLang.
"""

from .loader import LOADER

__all__ = ["LOADER"]
