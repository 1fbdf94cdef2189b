"""What runs inside vLLM's own processes: the worker extension that loads refits in place, the
direct load and its copy plan, nemo_gen's weight-transfer backends registered with vLLM (worker
and trainer side), the shared-memory staging and the CUDA IPC transport they read from."""
