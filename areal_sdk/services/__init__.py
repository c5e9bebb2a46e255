"""The run's services (engine servers, gateway, rollout workers, trainer) and their
supervision: the ``processes`` placement runs each as a process of its own, watched within a
bound (``health.py``)."""
