"""The request layer: requests over one executor, continuous batching, the serving loop.

- ``batcher``: requests, chunks and the ``Batcher`` (continuous batching, one execute() a step);
- ``serving``: the serving loop (a background thread owning one executor; requests from any thread);
- ``handle``: a request's handle (blocking / async iterator, future) and its ``Completion``;
- ``text``: incremental detokenization and stop strings;
- ``metrics``: the serving loop's counters and latency windows.

``runtime.generate`` is the simple embedding API over the same ``Batcher``.
"""
