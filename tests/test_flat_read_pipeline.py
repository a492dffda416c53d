"""The flat reader's read/verify pipeline (rollwise.model.flat_reader): readers hand chunks to hashers, and yet
every chunk is checked before any tensor is handed out, whatever the number of threads: a damaged chunk early
or late in the file is refused with exactly its tensors named, and an intact file reads back equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollwise.model.flat_format import CHUNK_ALIGN, DATA_FILE, write_flat
from rollwise.model.flat_reader import FlatCheckpointError, read_flat, read_index

PAGE_CHUNKS = CHUNK_ALIGN / 2**20  # one 4 KiB page per chunk
TENSORS = 24  # 24 chunks: more than any thread count below, so readers and hashers run out of step


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"w{i:02d}": torch.randn(1024, generator=g) for i in range(TENSORS)}  # 4 KiB each: one chunk each


def _flip(directory: Path, at: int) -> None:
    with (directory / DATA_FILE).open("r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


@pytest.mark.parametrize(("threads", "hashers"), [(1, None), (2, None), (5, None), (5, 1), (2, 2), (1, 3)])
def test_every_chunk_is_checked_before_anything_is_handed_out(tmp_path: Path, state, threads: int,
                                                              hashers: int | None):
    """Whatever the split of readers and hashers (the default: as many hashers as readers)."""
    write_flat(state, tmp_path, chunk_mb=PAGE_CHUNKS, fsync=False)
    intact = read_flat(tmp_path, threads=threads, hashers=hashers)
    assert all(torch.equal(intact.state[name], t) for name, t in state.items())

    index = read_index(tmp_path)
    last = len(index.checksums) - 1
    specs = {t.name: index.bucket_offsets[0] + t.offset for t in index.layout.tensors()}  # one bucket
    _flip(tmp_path, specs["w00"] + 5)  # in the first chunk read
    _flip(tmp_path, specs[f"w{TENSORS - 1:02d}"] + 4000)  # in the last chunk: read and hashed last
    with pytest.raises(FlatCheckpointError, match="checksum") as damaged:
        read_flat(tmp_path, threads=threads, hashers=hashers)
    assert damaged.value.chunks == [0, last]
    assert sorted(damaged.value.tensors) == ["w00", f"w{TENSORS - 1:02d}"]
    unchecked = read_flat(tmp_path, threads=threads, verify=False)  # the bytes really differ: only the checksums refuse
    assert not torch.equal(unchecked.state["w00"], state["w00"])
    assert torch.equal(unchecked.state["w12"], state["w12"])


def test_a_thread_count_below_one_is_refused(tmp_path: Path, state):
    write_flat(state, tmp_path, chunk_mb=PAGE_CHUNKS, fsync=False)
    with pytest.raises(ValueError, match="hashers"):
        read_flat(tmp_path, hashers=-1)
    with pytest.raises(ValueError, match="threads"):
        read_flat(tmp_path, threads=-2)
