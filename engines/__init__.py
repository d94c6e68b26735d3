"""Engines: the exported ONNX graphs compiled into checked TensorRT plans.

Modules, in pipeline order:

- ``sources``    which graphs to build: export directory -> ``GraphSource``s (file + contract IO)
- ``flavour``    ``tensorrt`` or ``tensorrt_rtx`` behind one class; only API differences branch
- ``build``      parse, refuse dropped tensors, profile the dynamic graphs, build; one typed error
- ``bindings``   engine IO as TensorRT reports it, compared with the contract
- ``engine_set`` ``engines.json``: plan and source hashes, flavour/version, targets, options, bindings
- ``probe``      the semantics probe: the set's own attention / KV-write / sampler constructions, its cases
- ``probe_reference``  the probe's numpy semantics and the comparison
- ``verdict``    run the probe on a GPU, the verdict, the refusal and its remedy
- ``calls``      one checker for TensorRT API calls (typed ``EngineError`` naming the call)
- ``execute``    one run of one engine over torch buffers (the probe's and selfcheck's)
- ``plan_reader`` a plan streamed into the runtime, hashed as it streams (one read)
- ``load``       check files + manifest (anywhere), then deserialize + check bindings + the probe's verdict (GPU)
- ``command``    ``dflash-trt build``
- ``selfcheck``  ``dflash-trt selfcheck``: every engine against ONNX Runtime on random inputs (GPU)
"""
