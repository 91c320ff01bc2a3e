"""The GPU worker: the shared worker service (services/worker) with the engine on a CUDA device
(bf16 where supported, KV cache sized from free GPU memory, NVML utilization when nvidia-ml-py is
installed). The device code is services/engine/device.py (CudaBackend)."""
