"""Train backends: ``torch`` (one process) and ``deepspeed`` (ZeRO 0-3), behind
``areal_sdk.train_backend.TrainBackend``. Registered by ``areal_sdk.backends.train.plugin``."""
