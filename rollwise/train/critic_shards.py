"""The critic's part of a sharded trainer's checkpoint (train.advantage=gae with trainer.world_size > 1, torchrun
or ray.trainer_ranks > 1), in the policy's form (rollwise.train.rank RankTrainer.save / load):

    critic/dcp/                      every rank's shard of the value model and of its optimizer state
                                     (torch.distributed.checkpoint, which reshards on load: any world size resumes)
    critic/value_model.safetensors   the full value model, gathered and written by rank 0

so the one-process trainer resumes a sharded checkpoint's critic too (rollwise.train.critic.Critic.load: the
weights from the safetensors, the optimizer from the shards), and a sharded rank resumes a one-process
checkpoint's (value_model.safetensors and optimizer.pt, each rank keeping its shard).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from rollwise.train.checkpoint import DCP_DIR, optimizer_state_by_name
from rollwise.train.critic import CRITIC_DIR, CRITIC_OPTIMIZER_FILE, VALUE_MODEL_FILE, Critic, critic_folder
from rollwise.train.critic_layers import write_marker


def save_critic_shards(critic: Critic, tmp: Path, rank: int) -> None:
    """Every rank calls it (the shards' save and the full gather are collectives); rank 0 writes the full model."""
    folder = tmp / CRITIC_DIR
    model_sd, optim_sd = get_state_dict(critic.model, critic.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder / DCP_DIR)
    full = get_model_state_dict(critic.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({name: t.contiguous() for name, t in full.items()}, str(folder / VALUE_MODEL_FILE))
        write_marker(folder, critic.cfg.gae.critic_trainable_layers)


def load_critic_shards(critic: Critic, ckpt: Path) -> None:
    """Every rank calls it: this rank's shard of the critic's weights and optimizer state from `ckpt/critic/`."""
    folder = critic_folder(ckpt, critic.cfg.gae.critic_trainable_layers)
    if (folder / DCP_DIR).exists():
        model_sd, optim_sd = get_state_dict(critic.model, critic.optimizer)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder / DCP_DIR)
        set_state_dict(critic.model, critic.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return
    # A one-process checkpoint: the full weights and optimizer.pt; each rank keeps its shard.
    set_model_state_dict(critic.model, load_file(folder / VALUE_MODEL_FILE),
                         options=StateDictOptions(full_state_dict=True))
    opt = torch.load(folder / CRITIC_OPTIMIZER_FILE, weights_only=False)
    set_optimizer_state_dict(critic.model, critic.optimizer, optimizer_state_by_name(critic.model, opt["optimizer"]),
                             options=StateDictOptions(full_state_dict=True))
