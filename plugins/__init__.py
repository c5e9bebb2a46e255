"""Built-in plugins: one module per agent-framework adapter, plus built-in rewards.

Installed as ``areal_sdk.plugins`` and loaded through the ``areal_sdk`` entry-point group.
"""
