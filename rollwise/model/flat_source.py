"""A flat checkpoint (rollwise.model.flat_format) as a weight source: the `WeightUpdate` every engine's
`load_weights` takes (EngineWorker, the vLLM backend behind it, the Ray fleet, the pool's backend).

The flat file's index already is the update's manifest (its buckets, aliases and tensor specs), and the read
has checked every byte against the chunk checksums before any tensor exists, so the update is handed over as
an in-process one: views into the read buffer, no bucket checksums to compute again. The receiver still runs
every other check (names, shapes, dtypes, completeness, finite values, versions, tokenizer) before applying.
"""

from __future__ import annotations

from pathlib import Path

from rollwise.model.flat_reader import read_flat
from rollwise.types.weight_update import WeightUpdate


def flat_weight_update(directory: str | Path, version: int, tokenizer_fingerprint: str, *,
                       threads: int | None = None) -> WeightUpdate:
    """Read `directory`'s flat checkpoint as the update to `version` (FlatCheckpointError, naming the tensors,
    when a chunk is damaged or cut off: nothing is handed out)."""
    weights = read_flat(directory, threads=threads)
    layout = weights.index.layout
    manifest = layout.model_copy(update={
        "version": version, "tokenizer_fingerprint": tokenizer_fingerprint,
        "buckets": tuple(b.model_copy(update={"checksum": None}) for b in layout.buckets),  # verified by the read
    })
    return WeightUpdate(manifest, weights.state)
