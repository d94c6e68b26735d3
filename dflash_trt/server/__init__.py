"""The OpenAI-compatible HTTP server over ``runtime.engine.Engine`` (``dflash-trt serve``; the ``serve`` extra)."""
