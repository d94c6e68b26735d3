"""Why a request's output ended: the executor's reasons (``sessions.Output.finish``) and the serving loop's
cancel. Plain strings in a module that imports nothing, so an HTTP front names them without loading the
runtime (torch)."""

STOP, LENGTH, CONTEXT = "stop", "length", "context"  # a stop token, max_new_tokens, the cache's context
CANCELLED = "cancelled"  # the request was cancelled (beside generate's stop / length / context)
