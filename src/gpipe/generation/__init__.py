"""Generation with a pipeline (library): what a causal language model cut by
:func:`gpipe.to_sequential` needs to decode with caches in its stages (``traced``), the choices of
the next tokens (greedy, beam search, sampling) and ``Pipeline.generate``.

It imports the library (``cache``, ``runtime``, ``sequential``, ``microbatch``), never the applications;
transformers only inside the functions that are given a Hugging Face model.
"""
