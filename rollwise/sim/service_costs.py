"""What the service's calls cost (rollwise.sim.service_loop.ServiceCosts): on this CPU, from a measurement; on an
H100, from the same roofline argument as rollwise/sim/configs/h100-7b.yaml.

CPU (`cpu_costs`): the level from `rollwise bench service`'s one-tenant arm (its asample and forward_backward p50
latencies, less the off-device latencies), the shape (what is fixed per call, what grows with the batch) from
the engine this machine's calibration measured (rollwise/sim/configs/cpu-reference-full.yaml, its linear fit).
The 2-, 4- and 8-tenant arms are not used: they are what the model is validated against.

H100 (`h100_costs`): weights read at 70% of HBM bandwidth, prefill at 50% MFU, training at 35% MFU, as
h100-7b.yaml states; derived for any dense model shape (`ModelShape`), so h100-7b.yaml's engine numbers come
out again for the 7B shape (tests/test_sim_service_tenants.py checks it). Kernel launches, which dominate a
135M model's calls, are an assumption stated below.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rollwise.sim.cost import CONFIG_DIR, CostModel, load_cost_file
from rollwise.sim.lora import AdapterCost
from rollwise.sim.service_loop import WORKER_POLL_MAX_S, ServiceCosts, ServiceWorkload

# Off the device, the same on both machines (assumptions; `rollwise bench service` cannot resolve them: they are
# under its p50-vs-mean noise at one tenant): a request is two loopback HTTP exchanges (submit, retrieve_future)
# ~2 ms each, a row insert and commit (SQLite WAL) ~2 ms, the API's FutureWatch tick 5 ms (half on average);
# the client's step (decode 16 samples, rewards, 16 Datums to protobuf) ~20 ms of Python.
RPC_S = 0.01
CLIENT_S = 0.02
STORE_S_PER_ROW = 0.002  # the worker's claim + result writes per row

H100_PEAK_FLOPS = 989e12  # dense BF16 (NVIDIA H100 SXM datasheet)
H100_HBM_BPS = 3.35e12
HBM_EFFICIENCY = 0.7  # h100-7b.yaml: weights read at 70% of peak bandwidth in decode
PREFILL_MFU = 0.5
TRAIN_MFU = 0.35
ENGINE_STEP_LAUNCH_S = 1e-3  # h100-7b.yaml: scheduler + launch per decode step (CUDA graphs)
KERNEL_LAUNCH_S = 5e-6  # eager PyTorch, per kernel (assumption: ~4-10 us on H100 hosts)
FB_KERNELS_PER_LAYER = 40  # base forward, recomputed forward, input-gradient backward (~12 + 12 + 16)
ADAPTER_KERNELS_PER_TARGET = 8  # per tenant and adapted projection: A, B matmuls forward (x2, recompute) + 4 backward
LORA_TARGETS = 7  # q, k, v, o, gate, up, down (the bench's tenants; train_unembed off)
OPTIM_S = 2e-3  # AdamW (foreach) over one adapter's few hundred tensors: launch-bound (assumption)
SAMPLE_CALL_S = 2e-3  # sample_many's Python around the engine steps on a GPU host (assumption)


class ModelShape(BaseModel):
    """A dense decoder's shape: what the roofline needs."""

    model_config = ConfigDict(extra="forbid")

    name: str
    params: float = Field(..., gt=0)
    layers: int = Field(..., ge=1)
    hidden: int = Field(..., ge=1)
    intermediate: int = Field(..., ge=1)
    kv_dim: int = Field(..., ge=1, description="KV heads x head dim")

    @property
    def weight_bytes(self) -> float:
        return 2 * self.params  # bf16

    def adapter_params(self, rank: int) -> int:
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        per_layer = (h + h) + (h + kv) + (h + kv) + (h + h) + 3 * (h + i)  # in + out of each target
        return rank * per_layer * self.layers


SMOLLM2_135M = ModelShape(name="SmolLM2-135M", params=134.5e6, layers=30, hidden=576, intermediate=1536,
                          kv_dim=3 * 64)  # the bundled model's config.json (the bench's model)
QWEN_7B = ModelShape(name="7B (Qwen2.5-7B shape)", params=7.6e9, layers=28, hidden=3584, intermediate=18944,
                     kv_dim=4 * 128)  # the shape h100-7b.yaml is derived for
SHAPES = {"smollm2-135m": SMOLLM2_135M, "7b": QWEN_7B}


def h100_engine(shape: ModelShape) -> CostModel:
    """h100-7b.yaml's engine derivation for any shape (decode reads the weights once a step; half the per-sequence
    compute hides under that read; prefill compute-bound; KV read per context token)."""
    bandwidth = H100_HBM_BPS * HBM_EFFICIENCY
    per_token_flops_s = 2 * shape.params / (H100_PEAK_FLOPS * PREFILL_MFU)
    kv_bytes = 2 * shape.layers * shape.kv_dim * 2
    return CostModel(name=f"h100-{shape.name}", step_overhead_s=shape.weight_bytes / bandwidth + ENGINE_STEP_LAUNCH_S,
                     prefill_s_per_token=per_token_flops_s, decode_s_per_seq=per_token_flops_s / 2,
                     decode_s_per_ctx_token=kv_bytes / bandwidth, max_num_seqs=1024)


def h100_costs(shape: ModelShape, workload: ServiceWorkload) -> ServiceCosts:
    bandwidth = H100_HBM_BPS * HBM_EFFICIENCY
    adapter_bytes = 2 * shape.adapter_params(workload.lora_rank)
    # AdapterCost's push: 0.05 s for a 7B rank-16 adapter (~40 MB bf16), scaled by the adapter's bytes
    push_s = AdapterCost().adapter_push_s * adapter_bytes / 40e6
    return ServiceCosts(
        name=f"H100 roofline, {shape.name}", engine=h100_engine(shape), sample_call_s=SAMPLE_CALL_S,
        fb_call_s=shape.layers * FB_KERNELS_PER_LAYER * KERNEL_LAUNCH_S,
        fb_per_tenant_s=shape.layers * LORA_TARGETS * ADAPTER_KERNELS_PER_TARGET * KERNEL_LAUNCH_S,
        # LoRA: no base-weight gradients: forward 2N, recomputed forward 2N, input gradients 2N per token
        fb_s_per_token=6 * shape.params / (H100_PEAK_FLOPS * TRAIN_MFU),
        fb_memory_s=3 * shape.weight_bytes / bandwidth, optim_s=OPTIM_S, push_s=push_s, session_s=1e-3,
        store_s_per_row=STORE_S_PER_ROW, rpc_s=RPC_S, client_s=CLIENT_S,
        sources=["NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3",
                 "rollwise/sim/configs/h100-7b.yaml: efficiencies (70% HBM, 50% prefill MFU, 35% training MFU)"],
        assumptions=[f"eager kernel launch {KERNEL_LAUNCH_S * 1e6:.0f} us; forward_backward launches "
                     f"{FB_KERNELS_PER_LAYER} base kernels a layer per call and {ADAPTER_KERNELS_PER_TARGET} per "
                     "adapted projection per tenant (multi_lora applies each tenant's adapter on its own rows)",
                     "LoRA forward_backward: 6N FLOP per token (forward, recomputed forward, input gradients), "
                     "at least 3 reads of the base weights a call",
                     f"adapter push {AdapterCost().adapter_push_s} s per 40 MB (rollwise.sim.lora.AdapterCost)",
                     f"off-device per request {RPC_S * 1e3:.0f} ms, client per step {CLIENT_S * 1e3:.0f} ms, store "
                     f"{STORE_S_PER_ROW * 1e3:.0f} ms a row: as on the CPU"])


class MeasuredArm(BaseModel):
    """What the model reads of one arm of `rollwise bench service --json` (its `arms` entries)."""

    model_config = ConfigDict(extra="ignore")

    tenants: int = Field(..., ge=1)
    mean_step_s: float = Field(..., gt=0)
    asample_p50_s: float = Field(..., gt=0)
    forward_backward_p50_s: float = Field(..., gt=0)


def cpu_costs(one_tenant: MeasuredArm, workload: ServiceWorkload) -> ServiceCosts:
    """This CPU, levelled on the measured one-tenant arm (`rollwise bench service`'s arms[0])."""
    calibrated, _ = load_cost_file(CONFIG_DIR / "cpu-reference-full.yaml")
    # the linear fit (the by-batch table stops at 32 sequences; 8 tenants sample 128 at once)
    shape = calibrated.model_copy(update={"decode_s_by_batch": {}, "max_num_seqs": 1024})
    # a result waits on the idle worker's poll (~half its 50 ms cap) and the off-device round trip
    off_device = RPC_S + WORKER_POLL_MAX_S / 2 + 2 * STORE_S_PER_ROW
    bare = ServiceCosts(name="shape", engine=shape)
    scale = (one_tenant.asample_p50_s - off_device) / bare.sample_s(workload.groups, workload)
    engine = shape.model_copy(update={k: getattr(shape, k) * scale for k in
                                      ("step_overhead_s", "prefill_s_per_token", "decode_s_per_seq")})
    fb = one_tenant.forward_backward_p50_s - off_device
    return ServiceCosts(
        name="this CPU (levelled on the 1-tenant arm)", engine=engine,
        fb_s_per_token=fb / workload.train_tokens_per_step,  # compute-bound: FLOPs per token, batched or not
        optim_s=0.02, push_s=0.02, session_s=1e-3, store_s_per_row=STORE_S_PER_ROW, rpc_s=RPC_S, client_s=CLIENT_S,
        sources=["docs/bench/service.json arms[0]: asample and forward_backward p50",
                 "rollwise/sim/configs/cpu-reference-full.yaml: the engine's fixed vs per-token split "
                 f"(scaled x{scale:.2f} to the measured asample)"],
        assumptions=["forward_backward linear in trained tokens, nothing fixed per call (2 cores, compute-bound)",
                     "optim_step and the adapter push 20 ms each (LoRA-sized; under the measurement's noise)",
                     "the tenants' client processes do not take cores from the worker (they do, on 2 cores)"])
