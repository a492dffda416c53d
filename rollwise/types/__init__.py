"""The bottom layer: plain data every other layer passes around (DESIGN.md "Shape of the code").

- contracts: the three interfaces the training loop is written against (`RolloutBackend`, `Trainer`,
  `RolloutControl`); read it first: every other module here is a word they speak;
- generation: the engine contract's data (`GenerationRequest`, `SamplingParams`, `Completion`, `ModelInfo`,
  `EngineLoad`); task: `Problem` and the `Task` base; ledger: `RolloutLedger`, where every sample slot is;
- sample: `Sample` (a trajectory as the trainer receives it) and `group_samples`;
- routing: `RoutedExperts`, the experts an MoE engine routed each token to (a Completion's and a Sample's);
- compact: how a Sample stores its per-token data (int32 ids, float32 log-probs, run-length versions;
  list-like, not lists), so a controller can hold 100,000s of waiting samples;
- microbatch: how a train step cuts samples into micro-batches, and the tokens it computes (pure:
  the simulator's trainer model and the trainer share it);
- weights: the weight-update manifest, the expected-weights description and the refusal error
  (the transports and the receiver's logic stay in rollwise.sync);
- weight_checks: the rules every weight update is held to, whichever path brings it (names, shapes,
  dtypes, finite values, versions only forward); adapter_limits: an adapter's bounds, torch-free.
- checksum: a file's xxh3-64 (checkpoint manifests).
- bucket_layout: how a weight update's tensors are cut into aligned, checksummed buckets and its manifest
  built (the weight transports of rollwise.sync and the flat checkpoints of rollwise.model use it).
- config_section: the base of every run-config section, wherever it is defined (no unknown keys, finite
  numbers, no true/false for a number).
- model_shape: `ModelShape`, a decoder's layers, widths, heads and vocabulary read once from a Hugging Face
  config (the reference engine's ModelConfig and the FLOP counter's DenseModel both hold one).

Nothing here imports another rollwise package (only under TYPE_CHECKING, for annotations).
"""
