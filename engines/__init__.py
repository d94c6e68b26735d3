"""Engines: the exported ONNX graphs compiled into checked TensorRT plans.

Modules, in pipeline order:

- ``sources``    which graphs to build: export directory -> ``GraphSource``s (file + contract IO)
- ``flavour``    ``tensorrt`` or ``tensorrt_rtx`` behind one class; only API differences branch
- ``build``      parse, refuse dropped tensors, profile the dynamic graphs, build; one typed error
- ``bindings``   engine IO as TensorRT reports it, compared with the contract
- ``engine_set`` ``engines.json``: plan and source hashes, flavour/version, targets, options, bindings
- ``load``       check files + manifest (anywhere), then deserialize + check bindings (needs a GPU)
- ``command``    ``dflash-trt build``
- ``selfcheck``  ``dflash-trt selfcheck``: every engine against ONNX Runtime on random inputs (GPU)
"""
