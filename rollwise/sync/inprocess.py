"""In-process weight transport: the trainer and the engine share one process (the CPU default).

Other transports (torch.distributed broadcast, safetensors files) arrive with the engine-contract issue
and keep this signature: push the trainer's weights to the engines under a new policy version.
"""

from __future__ import annotations

from torch import nn


def push_weights(model: nn.Module, engines: list, version: int) -> None:
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    for engine in engines:
        engine.update_weights(state, version)
