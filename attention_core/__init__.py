"""The small core every attention package builds on.

contract  the op contract's checks and dtype rules
combine   the one joint softmax (log-sum-exp combine of logit pieces)
blocks    padding, head-major layout and block/grid reshapes
registry  the op registry (name -> pure function and its plan parameters)

core depends on jax alone; the op packages (combiner, routing, yoso, baselines) depend on core, the models on
the op packages.
"""
