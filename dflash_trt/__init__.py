"""dflash-trt: DFlash speculative decoding served from compiled engines.

The library lives in one namespace over the pipeline's folders:
``dflash_trt.export`` (export/), ``dflash_trt.engines`` (engines/),
``dflash_trt.runtime`` (runtime/) and ``dflash_trt.analysis`` (analysis/).
"""

__version__ = "0.1.0"
