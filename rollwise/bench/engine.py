"""Engine benchmark: HF `generate`, the reference engine, and (when installed) vLLM through our engine
contract and through its own `LLM.generate`, on the same requests, side by side.

Rollout lengths in RL are long-tailed. Static batching (HF generate: one batch per prompt with
num_return_sequences samples) keeps every row busy until the longest one is done, so short samples
pay for the long one as padding; continuous batching retires each sample at its own length and
refills the slot. Lengths are forced (ignore_eos / min_new_tokens) from a seeded lognormal so both
engines do the same useful work.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from rich.table import Table

from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.engine.vllm_backend import vllm_available

QUESTIONS = [
    "What is 17 * 23? Answer with the number only.",
    "Name three prime numbers greater than 50.",
    "Sort these words alphabetically: pear, apple, fig, banana.",
    "If a train travels 60 km in 45 minutes, what is its speed in km/h?",
    "Write a haiku about gradient descent.",
    "What is the capital of Australia?",
    "Solve for x: 3x + 7 = 22.",
    "Explain in one sentence why the sky is blue.",
]
SAMPLES_PER_PROMPT = 8
MAX_NUM_SEQS = 32


def _budgets(rng: np.random.Generator, count: int, median: int, sigma: float, cap: int) -> list[int]:
    raw = rng.lognormal(mean=math.log(median), sigma=sigma, size=count)
    return [int(b) for b in np.clip(np.round(raw), 1, cap)]


def _prompt_ids(tokenizer: Any, question: str) -> list[int]:
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    # transformers 5 returns a BatchEncoding here; older versions a plain list of ids.
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def _time_reference(model: Any, prompts: list[list[int]], budgets: list[list[int]], seed: int) -> float:
    max_len = max(len(p) for p in prompts) + max(max(b) for b in budgets) + 1
    engine = ReferenceEngine(model, max_num_seqs=MAX_NUM_SEQS, max_model_len=max_len, seed=seed)
    requests = _requests(prompts, budgets)
    engine.generate([GenerationRequest("warmup", prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))])
    start = time.perf_counter()
    completions = engine.generate(requests)
    seconds = time.perf_counter() - start
    assert sum(len(c.token_ids) for c in completions) == sum(map(sum, budgets))
    return seconds


@torch.inference_mode()
def _time_hf_generate(model: Any, prompts: list[list[int]], budgets: list[list[int]], pad_id: int) -> float:
    def run(prompt: list[int], new_tokens: int, samples: int) -> None:
        model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=True,
            temperature=1.0,
            top_k=None,
            top_p=1.0,
            num_return_sequences=samples,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # suppresses EOS: every row runs to the batch's longest budget
            pad_token_id=pad_id,
        )

    run(prompts[0], 2, 1)  # warm-up
    start = time.perf_counter()
    for prompt, prompt_budgets in zip(prompts, budgets):
        run(prompt, max(prompt_budgets), len(prompt_budgets))
    return time.perf_counter() - start


def _requests(prompts: list[list[int]], budgets: list[list[int]]) -> list[GenerationRequest]:
    # One sample per request: each sample has its own forced length.
    return [
        GenerationRequest(f"p{i}/s{j}", prompt, SamplingParams(max_tokens=b, temperature=1.0, ignore_eos=True, seed=j))
        for i, (prompt, prompt_budgets) in enumerate(zip(prompts, budgets))
        for j, b in enumerate(prompt_budgets)
    ]


def _time_vllm(model: Any, tokenizer: Any, prompts: list[list[int]], budgets: list[list[int]], seed: int) -> dict:
    """The same requests through vLLM both ways, in one process: our engine contract (VLLMEngine: one
    vLLM request per sample, token ids in/out, per-token logprobs and versions) and vLLM's own
    `LLM.generate` with the same engine settings. The ratio is what the contract costs.

    Only one in-process vLLM engine can live at a time, so the two cannot run side by side; they run
    in ABBA order (contract, native, native, contract), each on a fresh engine, and each side's two
    times are averaged, so a drift in machine load falls on both alike."""
    from rollwise.engine.vllm_backend import VLLMEngine

    max_len = max(len(p) for p in prompts) + max(max(b) for b in budgets) + 1
    requests = _requests(prompts, budgets)
    expected = sum(map(sum, budgets))

    def contract() -> float:
        ours = VLLMEngine(model, tokenizer, max_num_seqs=MAX_NUM_SEQS, max_model_len=max_len, seed=seed)
        try:
            ours.generate([GenerationRequest("warmup", prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))])
            start = time.perf_counter()
            completions = ours.generate(requests)
            seconds = time.perf_counter() - start
        finally:
            ours.close()
        assert sum(len(c.token_ids) for c in completions) == expected
        return seconds

    times: dict[str, list[float]] = {"contract": [], "native": []}
    with tempfile.TemporaryDirectory(prefix="rollwise-vllm-bench-") as model_dir:
        model.save_pretrained(model_dir)
        for side in ("contract", "native", "native", "contract"):
            times[side].append(contract() if side == "contract"
                               else _time_vllm_native(model_dir, requests, max_len, seed, expected))
    return {"contract_seconds": sum(times["contract"]) / 2, "native_seconds": sum(times["native"]) / 2,
            "contract_runs_s": times["contract"], "native_runs_s": times["native"]}


def _time_vllm_native(model_dir: str, requests: list[GenerationRequest], max_len: int, seed: int,
                      expected_tokens: int) -> float:
    from vllm import LLM
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
              max_num_seqs=MAX_NUM_SEQS, max_model_len=max_len, seed=seed, skip_tokenizer_init=True,
              block_size=32 if on_cpu else None, use_tqdm_on_load=False, disable_log_stats=True)
    native = [
        (TokensPrompt(prompt_token_ids=r.prompt_ids),
         VLLMSamplingParams(max_tokens=r.params.max_tokens, temperature=1.0, ignore_eos=True, seed=r.params.seed,
                            logprobs=0, detokenize=False))
        for r in requests
    ]
    llm.generate([native[0][0]], VLLMSamplingParams(max_tokens=2, ignore_eos=True, detokenize=False), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in native], [sp for _, sp in native], use_tqdm=False)
    native_seconds = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == expected_tokens
    llm.llm_engine.engine_core.shutdown()
    return native_seconds


def run_engine_bench(model: Any, tokenizer: Any, *, quick: bool, seed: int = 0, with_vllm: bool | None = None) -> dict:
    """Same prompts and forced long-tailed lengths through the ReferenceEngine and HF generate.

    quick: 4 prompts x 8 samples, budgets with median 24 capped at 64 (under a minute with
    SmolLM2-135M on 2 CPU cores); full: 8 prompts, median 48 capped at 192. with_vllm: also time vLLM
    through our contract and natively (default: when vLLM is installed).
    """
    num_prompts, median, cap = (4, 24, 64) if quick else (8, 48, 192)
    rng = np.random.default_rng(seed)
    prompts = [_prompt_ids(tokenizer, q) for q in QUESTIONS[:num_prompts]]
    budgets = [_budgets(rng, SAMPLES_PER_PROMPT, median, sigma=0.8, cap=cap) for _ in prompts]
    useful = sum(map(sum, budgets))
    padded = sum(SAMPLES_PER_PROMPT * max(b) for b in budgets)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    torch.manual_seed(seed)
    ref_seconds = _time_reference(model, prompts, budgets, seed)
    hf_seconds = _time_hf_generate(model, prompts, budgets, pad_id)
    reference = {"tokens": useful, "seconds": ref_seconds, "tok_per_s": useful / ref_seconds}
    vllm_result = None
    if with_vllm if with_vllm is not None else vllm_available():
        timed = _time_vllm(model, tokenizer, prompts, budgets, seed)
        vllm_result = {
            "contract": {"tokens": useful, "seconds": timed["contract_seconds"],
                         "tok_per_s": useful / timed["contract_seconds"]},
            "native": {"tokens": useful, "seconds": timed["native_seconds"],
                       "tok_per_s": useful / timed["native_seconds"]},
            "contract_vs_native": timed["native_seconds"] / timed["contract_seconds"],
            "runs_s": {"contract": timed["contract_runs_s"], "native": timed["native_runs_s"]},
        }
    hf = {
        "tokens": useful,
        "tokens_incl_padding": padded,
        "seconds": hf_seconds,
        "tok_per_s": useful / hf_seconds,
        "tok_per_s_incl_padding": padded / hf_seconds,
    }
    return {
        "config": {
            "quick": quick,
            "seed": seed,
            "prompts": num_prompts,
            "samples_per_prompt": SAMPLES_PER_PROMPT,
            "max_num_seqs": MAX_NUM_SEQS,
            "budget_median": median,
            "budget_cap": cap,
            "budgets": budgets,
            "torch_threads": torch.get_num_threads(),
        },
        "reference": reference,
        "hf_generate": hf,
        "vllm": vllm_result,
        "speedup": reference["tok_per_s"] / hf["tok_per_s"],
    }


def format_engine_bench(result: dict) -> Table:
    cfg = result["config"]
    table = Table(
        title=(
            f"Engine benchmark: {cfg['prompts']} prompts x {cfg['samples_per_prompt']} samples, "
            f"forced lengths median {cfg['budget_median']} / cap {cfg['budget_cap']}, "
            f"{cfg['torch_threads']} threads"
        )
    )
    for column in ("engine", "useful tokens", "tokens incl. padding", "seconds", "useful tok/s", "tok/s incl. padding"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    ref, hf = result["reference"], result["hf_generate"]
    rows = [
        # continuous batching generates no padding: every generated token is useful
        (f"reference ({cfg['max_num_seqs']} slots)", ref["tokens"], ref["tokens"], ref["seconds"]),
        ("HF generate", hf["tokens"], hf["tokens_incl_padding"], hf["seconds"]),
    ]
    if result.get("vllm"):
        v = result["vllm"]
        rows += [
            ("vLLM through our engine contract", v["contract"]["tokens"], v["contract"]["tokens"], v["contract"]["seconds"]),
            ("vLLM's own LLM.generate", v["native"]["tokens"], v["native"]["tokens"], v["native"]["seconds"]),
        ]
    for name, useful, total, seconds in rows:
        table.add_row(name, str(useful), str(total), f"{seconds:.2f}", f"{useful / seconds:.1f}", f"{total / seconds:.1f}")
    table.caption = (
        f"reference vs HF generate, useful tok/s: {result['speedup']:.2f}x (continuous batching vs one static "
        "batch per prompt)"
    )
    if result.get("vllm"):
        table.caption += (f"; vLLM through our contract = {result['vllm']['contract_vs_native']:.0%} of vLLM's own "
                          "LLM.generate throughput (goal >= 90%)")
    else:
        table.caption += "; vLLM not installed (pip install -e \".[cpu]\") so not measured"
    return table
