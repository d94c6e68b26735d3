"""The training recipe of the embedded default pair (and of a draft for any target).

A stage of its own, ahead of export: it writes the HF-format checkpoints
``dflash_trt.export`` reads.

Stages, one module each: ``corpus`` (Python sources → train/held-out files),
``tokenizer`` (byte-level BPE), ``forward`` (whole-sequence training forwards
over the cache-path modules of ``export.target`` / ``export.draft``),
``loop`` (AdamW + cosine, wall-time guard, progress and logs), ``target``
(a small Qwen3), ``draft`` (DFlash, docs/design.md §1 Training), ``regenerate``
(target-written training text for the draft), ``evaluate``
(held-out loss, τ with the reference decoder) and ``command`` (the
``dflash-trt train`` subcommands).
"""
