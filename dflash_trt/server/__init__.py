"""The OpenAI-compatible HTTP server over ``runtime.serving.engine.Engine`` (``dflash-trt serve``; the ``serve`` extra)."""
