"""What both sides ask of the host they run on: the processes a fleet started (alive, exited,
killed past a deadline) and the GPU memory each process holds (NVML)."""
