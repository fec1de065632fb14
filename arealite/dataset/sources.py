"""Opening a user's dataset through `datasets`: a local file, a `save_to_disk` folder, a folder of
data files, or a hub id (with `name` / `split` / `data_files`); then renaming its columns to the
canonical ones (`columns: {prompt: question}`: canonical name -> the file's own name).

Every failure names the source and what was tried, so a typo in a YAML fails in preflight with a
message the user can act on, not as a stack trace from inside `datasets`.
"""

from __future__ import annotations

import os
from typing import Any

from arealite.dataset.common import DatasetFormatError

# Local file extensions -> the `datasets` builder that reads them.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HELD_OUT_SPLITS = ("test", "validation", "valid")


class DatasetNotFoundError(FileNotFoundError):
    """No dataset at `path` (the message lists what was tried)."""


def _load_file(path: str) -> Any:
    import datasets

    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_BUILDERS:
        raise DatasetFormatError(
            f"dataset file {path!r}: unsupported extension {ext!r}; use one of {sorted(FILE_BUILDERS)}"
        )
    with open(path, "rb") as f:
        if not f.read(4096).strip():
            raise DatasetFormatError(f"dataset file {path!r} is empty")
    builder = FILE_BUILDERS[ext]
    return datasets.load_dataset(builder, data_files=path, split="train", keep_in_memory=True)


def _load_from_disk(path: str, split: str) -> Any:
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DatasetNotFoundError(
                f"save_to_disk folder {path!r} has splits {sorted(ds)}, not {split!r}"
            )
        return ds[split]
    return ds


def open_source(
    path: str, split: str = "train", name: str | None = None, data_files: Any = None
) -> Any:
    """The raw rows of `path` as a `datasets.Dataset` (one split)."""
    import datasets

    if not path:
        raise DatasetNotFoundError("dataset path is empty: set train_dataset.path")
    if os.path.isfile(path):
        return _load_file(path)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(
            os.path.join(path, "state.json")
        ):
            return _load_from_disk(path, split)
    elif not _looks_like_hub_id(path):
        raise DatasetNotFoundError(
            f"dataset {path!r}: no such file or folder, and not a hub id (org/name)"
        )
    try:
        return datasets.load_dataset(path, name, split=split, data_files=data_files)
    except Exception as e:
        where = "folder of data files" if os.path.isdir(path) else "hub id"
        offline = " (HF_HUB_OFFLINE=1: only cached datasets load)" if _offline() else ""
        raise DatasetNotFoundError(
            f"dataset {path!r} ({where}, name={name!r}, split={split!r}, "
            f"data_files={data_files!r}) could not be loaded{offline}: {type(e).__name__}: {e}"
        ) from e


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"


def _looks_like_hub_id(path: str) -> bool:
    if os.path.splitext(path)[1].lower() in FILE_BUILDERS:
        return False  # a missing local file, not a hub id
    parts = path.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not path.startswith((".", "~"))


def map_columns(ds: Any, columns: dict[str, str] | None, source: str) -> Any:
    """Rename the file's columns to the canonical names (`columns`: canonical -> file's name)."""
    if not columns:
        return ds
    missing = {canon: own for canon, own in columns.items() if own not in ds.column_names}
    if missing:
        canon, own = next(iter(missing.items()))
        raise DatasetFormatError(
            f"{source}: columns.{canon}={own!r} but the data has no column {own!r} "
            f"(its columns: {ds.column_names})"
        )
    renames = {own: canon for canon, own in columns.items() if own != canon}
    clash = [c for c in renames.values() if c in ds.column_names and c not in renames]
    if clash:
        raise DatasetFormatError(
            f"{source}: mapping onto {clash[0]!r}, which the data already has as a column; "
            f"map that column away too (columns: {ds.column_names})"
        )
    return ds.rename_columns(renames)
