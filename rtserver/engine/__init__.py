"""The local inference backend: sequences, the KV manager, the scheduler, the model runner and model
loading, behind the `InferenceBackend` seam of `backend.py` (docs/architecture.md). Imports nothing from
rtserver.tasks, rtserver.web or rtbench."""
