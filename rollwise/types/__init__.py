"""The bottom layer: plain data every other layer passes around (DESIGN.md "Shape of the code").

- sample: `Sample` (a trajectory as the trainer receives it) and `group_samples`;
- microbatch: how a train step cuts samples into micro-batches, and the tokens it computes (pure:
  the simulator's trainer model and the trainer share it);
- weights: the weight-update manifest, the expected-weights description and the refusal error
  (the transports and the receiver's logic stay in rollwise.sync).

Nothing here imports another rollwise package (only under TYPE_CHECKING, for annotations).
"""
