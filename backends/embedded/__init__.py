"""The embedded inference engine: continuous batching over a transformers model, with
per-token weight versions, live weight updates, and SGLang's native HTTP routes.

>>> from areal_sdk.backends.embedded import EmbeddedEngine
>>> engine = EmbeddedEngine.from_pretrained("smollm2-135m-instruct")
>>> out = await engine.generate(ids, SamplingParams(max_new_tokens=32))
"""

from areal_sdk.backends.embedded.engine import EmbeddedEngine, EngineConfig, EngineInputError
from areal_sdk.backends.embedded.request import StreamChunk

__all__ = ["EmbeddedEngine", "EngineConfig", "EngineInputError", "StreamChunk"]
