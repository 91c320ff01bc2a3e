"""The CPU worker: the shared worker service (services/worker) with the engine on torch CPU."""
