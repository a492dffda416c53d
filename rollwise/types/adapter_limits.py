"""The bounds a LoRA adapter is held to, without torch: the run config (rollwise.config's train.lora) refuses
what an adapter push would be refused for (rollwise.types.weights.AdapterSpec), before a run starts."""

# An adapter's alpha above this is no LoRA anyone trains (PEFT's defaults are 8-64): with rank 1 its scaling
# alone would overflow float16 activations. NaN, inf and 1e38 are refused by the same bound.
MAX_LORA_ALPHA = 65536.0
