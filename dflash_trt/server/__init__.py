"""The OpenAI-compatible HTTP server over ``runtime.serving.loop.ServingLoop`` (``dflash-trt serve``; the ``serve`` extra)."""
