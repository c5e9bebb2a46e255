"""Built-in backends: inference engines, train backends and weight-sync methods.

Installed as ``areal_sdk.backends``; each registers itself through a plugin module.
"""
