"""What vLLM imports in every worker (``nemo_gen.core.engine_args.WORKER_EXTENSION``): the
refit extension, and the registration of nemo_gen's weight-transfer backends (nemo_gen_shm,
nemo_gen_ipc). vLLM creates a worker's weight-transfer engine by name while loading the model,
after this module is imported, so registering here puts our backends in every worker's
registry in time. Kept apart from ``worker_ext`` so that ``vllm_backend``, which builds on the
extension's loaders, and the extension do not import each other.
"""

from __future__ import annotations

import nemo_gen.vllm_ext.vllm_backend  # noqa: F401  (registers the backends)
from nemo_gen.vllm_ext.worker_ext import NemoGenWorkerExtension

__all__ = ["NemoGenWorkerExtension"]
