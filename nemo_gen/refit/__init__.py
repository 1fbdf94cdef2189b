"""Refit: push new weights into a running fleet. Sources (checkpoint directory, live tensors)
yield named tensors; the shared-memory transport stages them once per node; the worker
extension loads them inside each vLLM worker; ``GenerationFleet.refit`` runs the two phases."""
