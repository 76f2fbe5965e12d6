"""What runs a step: partitioning the layers into stages, a stage's forward and backward with
re-materialization, the executor's action loop over a schedule, the planner that picks each step's
schedule, and the trace a step leaves.

Part of the library: imports torch, the primitives (``microbatch``, ``checkpoint``, ``rng``,
``batchnorm``, ``skip``, ``tied``, ``memory``), ``schedule`` and ``balance``; never the applications.
"""
