"""The config sections of supervised fine-tuning (`sft:`, `rollwise sft`) and on-policy distillation
(`train.teacher:`). rollwise.config puts them into the run config; they live here, beside the base every
section shares, so that config.py stays one page of sections and the code reading them imports no config.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollwise.types.config_section import ConfigSection


class SftConfig(ConfigSection):
    """`rollwise sft`: next-token loss on the assistant turns of chat conversations (rollwise.train.sft).
    The optimizer's other settings (adam_betas, weight_decay, grad_clip, compute_dtype, logprob chunking,
    gradient checkpointing) are train:'s, checkpoints follow checkpoint:, the model is model:."""

    data: str | None = Field(None, description="chat JSONL: one {\"messages\": [{\"role\", \"content\"}, ...]} per "
                             "line (OpenAI chat format), rendered with the model's chat template")
    eval_data: str | None = Field(None, description="held-out chat JSONL (default: held_out_fraction of data)")
    held_out_fraction: float = Field(0.1, ge=0, lt=1, description="share of data kept out of training for the "
                                     "held-out loss (seeded by seed:), when eval_data is not given")
    epochs: int = Field(1, ge=1, description="passes over the training conversations (when steps is 0)")
    steps: int = Field(0, ge=0, description="optimizer updates; 0: epochs x the packed rows / rows_per_step")
    lr: float = Field(1e-5, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    pack_tokens: int = Field(2048, ge=2, description="tokens in one packed row: conversations are laid end to end "
                             "(first fit, longest first), each attending only to itself, at its own positions; a "
                             "longer conversation is cut to this length")
    rows_per_step: int = Field(8, ge=1, description="packed rows per optimizer update")
    micro_batch_rows: int = Field(2, ge=1, description="packed rows per forward/backward (gradients accumulate)")
    eval_every: int = Field(0, ge=0, description="also measure the held-out loss every N steps (0: before and "
                            "after training only)")


class TeacherConfig(ConfigSection):
    """`train.teacher:` on-policy distillation (rollwise.control.teacher): the student samples, a teacher ENGINE
    scores the same token ids (Engine.score_tokens: one prefill, nothing sampled), and log p_teacher - log
    p_student on each sampled token (minus the per-token reverse KL) is that token's reward, trained through the
    per-token advantage path (rollwise.train.token_advantages)."""

    model: str | None = Field(None, description="the teacher: a model spec as model: takes (a local Hugging Face "
                              "directory, bundled:NAME, tiny:SEED), served by an engine in this process; its "
                              "tokenizer's vocabulary must be the student's. Give this or url")
    url: str | None = Field(None, description="an engine server already serving the teacher (`rollwise serve engine "
                            "--model TEACHER`), scored over POST /score; its tokenizer must be the student's")
    coefficient: float = Field(1.0, gt=0, description="the distillation reward's weight")
    mode: Literal["replace", "add"] = Field("replace", description="replace: the per-token distillation reward "
                                            "alone; add: the task reward added on each response's last token")
    engine: Literal["auto", "reference", "vllm"] = Field("auto", description="the in-process teacher engine's "
                                                         "backend (as engine.kind; vLLM scores at temperature 1 only)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("float32", description="the teacher engine's weights")
    max_num_seqs: int = Field(16, ge=1, description="the teacher engine's max_num_seqs (a vLLM teacher: sequences "
                              "it scores at once; the reference teacher scores without a KV cache and reserves none)")
    max_model_len: int | None = Field(None, ge=16, description="the teacher engine's max_model_len (default: "
                                      "engine.max_model_len, the longest sequence the student samples)")

    @model_validator(mode="after")
    def _one_teacher(self) -> TeacherConfig:
        if (self.model is None) == (self.url is None):
            raise ValueError("train.teacher: give exactly one of train.teacher.model (a teacher engine in this "
                             "process) and train.teacher.url (an engine server serving the teacher)")
        return self
