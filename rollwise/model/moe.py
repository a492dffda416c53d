"""Sparse upcycling: a dense Llama-architecture model -> a Mixtral mixture of experts with its language ability.

Build one from any supported dense model spec (bundled:NAME or a local Hugging Face directory):
`python -m rollwise.model.moe --model SPEC --out DIR`. The upcycling itself (each MLP copied into perturbed
experts, a near-uniform router; why Mixtral) is rollwise.model.upcycle's: a model in, a model out. This
module adds what needs a model spec, loading it (rollwise.model.loading builds the bundled upcycled MoEs
through rollwise.model.upcycle too).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rollwise.model.loading import load_model
from rollwise.model.upcycle import write_upcycled


def save_upcycled(dense_spec: str, out_dir: Path, num_experts: int = 4, top_k: int = 2, seed: int = 0,
                  noise: float = 0.01, drop: float = 0.0) -> Path:
    """Load a dense model spec, upcycle it and save a Hugging Face Mixtral directory (atomically)."""
    dense, tokenizer = load_model(dense_spec)
    return write_upcycled(dense, tokenizer, out_dir, num_experts=num_experts, top_k=top_k, seed=seed, noise=noise,
                          drop=drop)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollwise.model.moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="dense model spec: bundled:NAME or a local HF directory")
    parser.add_argument("--out", required=True, type=Path, help="where to write the Mixtral directory (must not exist)")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.01,
                        help="std of each expert weight's multiplicative perturbation (0.01: experts are near-copies)")
    parser.add_argument("--drop", type=float, default=0.0,
                        help="Drop-Upcycling: share of each expert's intermediate neurons re-drawn at random")
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"--out {args.out} exists; choose a new directory")
    print(save_upcycled(args.model, args.out, args.experts, args.top_k, args.seed, args.noise, args.drop))


if __name__ == "__main__":
    main()
