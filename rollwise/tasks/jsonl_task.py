"""Tasks from a JSONL file: one JSON object per line with a prompt and a reference answer.

The verifier is a normalized exact match (rollwise.tasks.answer_format.answers_match): surrounding
whitespace and case are ignored, and two plain numbers compare by value ("5" == "5.0"); or, with
`verifier: math_verify`, math-verify's equivalence (rollwise.tasks.math_equal).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from rollwise.tasks.answer_format import answers_match
from rollwise.types.task import Problem, Split, Task, check_split, question_digest


def read_jsonl(path: str | Path, prompt_key: str, answer_key: str) -> list[tuple[int, str, str, dict[str, Any]]]:
    """(line number, prompt, answer, other fields) per non-blank line; errors name file:line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"JSONL task file {path} is a directory, not a file" if path.is_dir()
                         else f"JSONL task file not found: {path}")
    rows = []
    with path.open("rb") as f:
        for line_no, raw_line in enumerate(f, start=1):
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as exc:  # a binary file, or another encoding
                raise ValueError(f"{path}:{line_no}: not UTF-8 text (byte 0x{raw_line[exc.start]:02x} at column "
                                 f"{exc.start + 1}): a JSONL task file holds one JSON object per line, in UTF-8") from None
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            for key in (prompt_key, answer_key):
                if key not in obj:
                    raise ValueError(f"{where}: missing key {key!r} (keys present: {sorted(obj)})")
            prompt, answer = obj[prompt_key], obj[answer_key]
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{where}: {prompt_key!r} must be a non-empty string, got {prompt!r}")
            if isinstance(answer, (dict, list)) or answer is None:
                raise ValueError(f"{where}: {answer_key!r} must be a string or number, got {answer!r}")
            answer = answer if isinstance(answer, str) else json.dumps(answer)  # 5 -> "5", true -> "true"
            extra = {k: v for k, v in obj.items() if k not in (prompt_key, answer_key)}
            rows.append((line_no, prompt, answer, extra))
    if not rows:
        raise ValueError(f"JSONL task file {path} has no records")
    return rows


class JsonlTask(Task):
    """Problems from JSONL. Eval split: `eval_path` if given, else a seeded `eval_fraction` of the file."""

    def __init__(
        self,
        path: str | Path,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        eval_fraction: float = 0.1,
        eval_path: str | Path | None = None,
        seed: int = 0,
        name: str | None = None,
        train_size: int | None = None,
        eval_size: int | None = None,
        verifier: str = "exact",
    ) -> None:
        if verifier not in ("exact", "math_verify"):
            raise ValueError(f"verifier must be 'exact' or 'math_verify', got {verifier!r}")
        self.verifier = verifier
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        self.path = Path(path)
        self.name = name or self.path.stem
        self.seed = seed
        rows = self._dedupe(read_jsonl(self.path, prompt_key, answer_key))
        if eval_path is not None:
            train_rows = rows
            train_questions = {r[1] for r in rows}
            # Disjoint by question text: an eval item that also appears in train is dropped.
            eval_rows = [
                r for r in self._dedupe(read_jsonl(eval_path, prompt_key, answer_key)) if r[1] not in train_questions
            ]
            eval_source = Path(eval_path)
        else:
            order = list(range(len(rows)))
            random.Random(seed).shuffle(order)
            n_eval = math.ceil(len(rows) * eval_fraction) if eval_fraction > 0 and len(rows) > 1 else 0
            n_eval = min(n_eval, len(rows) - 1)  # always leave something to train on
            eval_rows = [rows[i] for i in sorted(order[:n_eval])]
            train_rows = [rows[i] for i in sorted(order[n_eval:])]
            eval_source = self.path
        if train_size is not None:
            train_rows = train_rows[:train_size]
        if eval_size is not None:
            eval_rows = eval_rows[:eval_size]
        self._splits: dict[str, list[Problem]] = {
            "train": [self._problem(r, "train", self.path) for r in train_rows],
            "eval": [self._problem(r, "eval", eval_source) for r in eval_rows],
        }

    @staticmethod
    def _dedupe(rows: list[tuple[int, str, str, dict[str, Any]]]) -> list[tuple[int, str, str, dict[str, Any]]]:
        # Duplicate questions would leak between splits; keep the first occurrence.
        seen: set[str] = set()
        out = []
        for row in rows:
            if row[1] not in seen:
                seen.add(row[1])
                out.append(row)
        return out

    def _problem(self, row: tuple[int, str, str, dict[str, Any]], split: Split, source: Path) -> Problem:
        line_no, question, answer, extra = row
        return Problem(
            # Content-addressed, so ids survive reordering or appending lines to the file.
            id=f"{self.name}/{split}/{question_digest(question)}",
            question=question,
            answer=answer,
            metadata={**extra, "source": "jsonl", "file": str(source), "line": line_no},
        )

    def problems(self, split: Split) -> list[Problem]:
        return list(self._splits[check_split(split)])

    def score_answer(self, problem: Problem, extracted_answer: str) -> float:
        if self.verifier == "math_verify":
            from rollwise.tasks.math_equal import math_equal  # math-verify loads lazily

            return 1.0 if math_equal(extracted_answer, problem.answer) else 0.0
        return 1.0 if answers_match(extracted_answer, problem.answer) else 0.0

    def __repr__(self) -> str:
        return f"JsonlTask(name={self.name!r}, path={str(self.path)!r}, seed={self.seed})"
