"""What train.py, eval.py, sample.py and the scripts share: the experiment (model, mesh, shardings, jitted
steps), the optimizer, checkpoints and the checks before a workdir is trusted, config I/O, preemption, the
training loop, and the evaluation and sampling drivers. Entry points parse flags and call one function here.
"""
