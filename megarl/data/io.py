"""Reading and writing prompt records (one dict per row) as JSON lines or parquet.

Both formats hold the same rows: a parquet struct column reads back as a dict and a list
column as a list, so ``reward_model.ground_truth`` and chat-message prompts survive either.
Unreadable input fails with the file (and line) named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

SUFFIXES = (".jsonl", ".parquet")


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".json":
        suffix = ".jsonl"  # a .json file is read as JSON lines (one object per line)
    if suffix not in SUFFIXES:
        raise ValueError(f"{str(path)!r}: unsupported data file type {path.suffix!r}; use .jsonl or .parquet")
    return suffix


def read_records(path: str | Path) -> list[dict]:
    """All rows of a ``.jsonl`` (``.json`` read as JSON lines) or ``.parquet`` file, as dicts."""
    path = Path(path)
    suffix = _suffix(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:
            raise ValueError(f"{str(path)!r}: not a readable parquet file ({type(exc).__name__}: {exc})") from exc
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg}); expected one JSON object per line") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def write_records(records: Iterable[dict], path: str | Path) -> int:
    """Write rows to ``.jsonl`` or ``.parquet`` (by suffix), creating parent folders; the row count."""
    path = Path(path)
    suffix = _suffix(path)
    records = list(records)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), tmp)
    else:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in records:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return len(records)


def get_field(row: dict, key: str):
    """``row[key]``, or the nested value for a dotted key (``"reward_model.ground_truth"``).

    A literal key containing dots wins over the nested reading. KeyError if absent.
    """
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value
