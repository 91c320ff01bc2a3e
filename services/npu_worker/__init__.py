"""The NPU worker: the shared worker service (services/worker) with the engine on an Ascend NPU
through torch_npu (an optional extra, imported guarded; without the CANN stack the worker exits
with a message naming what is missing). The device code is services/engine/device.py (NpuBackend)."""
