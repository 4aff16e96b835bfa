"""Tensor parallelism: one model over several devices, one process per rank (docs/tensor_parallel.md).

group.py     the ranks' process groups and the collectives the model and the engine use
sharding.py  which heads, rows and vocabulary entries a rank holds; slicing checkpoint tensors
layers.py    row-parallel linear, vocab-parallel embedding and logits
model.py     the Llama-family decoder over those layers
step_input.py  what rank 0 tells the other ranks each step, and their mirror of its requests
worker.py    a rank's model runner and the loop of a rank other than 0
executor.py  rank 0: starts the other ranks, sends each step's inputs, turns a failed rank
             into an error
every_rank.py  one function run whole on every rank (`bench decode` above size 1)
"""
