"""`rollwise model flatten SRC DST`: write a loading-optimised (flat) checkpoint; rollwise/cli.py hands the
arguments over. Its own parser, like `rollwise serve pool` and `rollwise sim`."""

from __future__ import annotations

import argparse
import math
import time

from rollwise.model.flat_format import DEFAULT_CHUNK_MB, INDEX_FILE

DESCRIPTION = (
    "Write DST as a loading-optimised copy of the model SRC: its config and tokenizer files, and every weight in "
    f"one flat data file (model.flat) with an index ({INDEX_FILE}: name -> offset, shape, dtype; tied weights "
    "once; an xxh3 checksum per chunk). Anything that takes a model directory takes DST: `rollwise train "
    "model=DST`, `rollwise serve --model DST`, POST /update_weights_from_disk {path: DST}. It loads by parallel "
    "reads into one buffer whose views are the weights (no deserialisation, no copy); a damaged or truncated "
    "chunk is refused naming its tensors. SRC: a Hugging Face directory of *.safetensors, a rollwise checkpoint "
    "(RUN/checkpoints/step_N), bundled:NAME, or tiny:SEED / tiny-moe:SEED."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollwise model flatten", description=DESCRIPTION,
                                epilog="example: rollwise model flatten bundled:smollm2-135m-instruct ~/smollm2-flat "
                                       "&& rollwise serve --model ~/smollm2-flat")
    p.add_argument("src", metavar="SRC", help="the model to convert (see above)")
    p.add_argument("dst", metavar="DST", help="the flat directory to write (created; not SRC)")
    p.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB, metavar="MB",
                   help="the read and checksum unit: the data file's chunks, read in parallel and each "
                        "checked by its xxh3 (default: %(default)s)")
    return p


def main(argv: list[str]) -> int:
    if argv[:1] != ["flatten"]:
        print("usage: rollwise model flatten SRC DST [--chunk-mb MB]  (`rollwise model flatten -h` for help)")
        return 2
    args = build_parser().parse_args(argv[1:])
    from rollwise.model.flat_model import flatten_directory, flatten_model
    from rollwise.model.loading import TINY_MOE_PREFIX, TINY_PREFIX, load_model, resolve_model_path

    start = time.perf_counter()
    try:
        if not (math.isfinite(args.chunk_mb) and args.chunk_mb > 0):
            raise ValueError(f"--chunk-mb must be a positive number of MiB, got {args.chunk_mb}")
        if args.src.startswith((TINY_PREFIX, TINY_MOE_PREFIX)):  # built in code: no directory to copy from
            model, tokenizer = load_model(args.src)
            index = flatten_model(model, args.dst, chunk_mb=args.chunk_mb)
            tokenizer.save_pretrained(args.dst)
        else:
            index = flatten_directory(resolve_model_path(args.src), args.dst, chunk_mb=args.chunk_mb)
    except (ValueError, OSError) as exc:
        print(f"error: {' '.join(str(exc).split())}")
        return 2
    layout = index.layout
    print(f"wrote {args.dst}: {sum(len(b.tensors) for b in layout.buckets)} tensors "
          f"(+{len(layout.aliases)} aliases), {layout.total_bytes / 1e6:.1f} MB in {len(index.checksums)} checksummed "
          f"chunks, "
          f"{time.perf_counter() - start:.1f} s")
    return 0
