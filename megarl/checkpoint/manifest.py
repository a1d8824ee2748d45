"""A checkpoint directory's manifest: every file's size and SHA-256, written last. A directory without a complete
manifest is not a checkpoint; one whose files disagree with it is refused, naming the file.

Hashing is split over the ranks (file i is hashed by rank i mod world), so a large checkpoint's hashing time is
divided by the world size; the results are gathered to rank 0, which writes the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os

MANIFEST = "manifest.json"
_CHUNK = 16 << 20


class ManifestError(RuntimeError):
    """The directory's files disagree with its manifest (or it has none)."""


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(f for f in out if f != MANIFEST)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist  # here: only writing is collective (reading a manifest, as the pre-launch
    # checks do, loads no torch)

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gather(mine: dict) -> dict:
    rank, world = _rank_world()
    if world == 1:
        return mine
    import torch.distributed as dist  # here: see _rank_world

    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def write_manifest(root: str) -> dict:
    """Collective (or single-process): hash every file under ``root`` and write ``root/manifest.json`` (rank 0,
    atomically, last). Returns the manifest."""
    rank, world = _rank_world()
    files = _files(root)
    mine = {
        f: {"bytes": os.path.getsize(os.path.join(root, f)), "sha256": sha256(os.path.join(root, f))}
        for i, f in enumerate(files)
        if i % world == rank
    }
    manifest = {"files": dict(sorted(_gather(mine).items()))}
    if rank == 0:
        tmp = os.path.join(root, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, MANIFEST))
    return manifest


def read_manifest(root: str) -> dict:
    path = os.path.join(root, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        assert isinstance(files, dict) and all({"bytes", "sha256"} <= set(v) for v in files.values())
    except FileNotFoundError:
        raise ManifestError(
            f"{root} has no {MANIFEST}: the save did not finish (or this is not a checkpoint)"
        ) from None
    except (ValueError, KeyError, AssertionError, TypeError):
        raise ManifestError(f"{path} is damaged (not a manifest); the checkpoint cannot be trusted") from None
    return manifest


def verify_manifest(root: str, *, hashes: bool = True) -> None:
    """Collective (or single-process): check every listed file's size (always) and SHA-256 (``hashes``), and that
    none is missing; raises ManifestError naming the first bad file, on every rank."""
    rank, world = _rank_world()
    problems = {}
    try:
        files = read_manifest(root)["files"]
    except ManifestError as e:
        files, problems = {}, {"": str(e)}
    for i, (name, want) in enumerate(sorted(files.items())):
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            problems[name] = f"{path} is missing (listed in {MANIFEST})"
        elif os.path.getsize(path) != want["bytes"]:
            problems[name] = f"{path} has {os.path.getsize(path)} bytes, the manifest says {want['bytes']}"
        elif hashes and i % world == rank and sha256(path) != want["sha256"]:
            problems[name] = f"{path} does not match its SHA-256 in {MANIFEST} (the file is damaged)"
    problems = _gather(problems)
    if problems:
        first = sorted(problems)[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ManifestError(problems[first] + more)


def verify_file(root: str, name: str) -> None:
    """One file of checkpoint ``root`` against its manifest's SHA-256 (single process); ManifestError if it differs
    or is not listed."""
    want = read_manifest(root)["files"].get(name)
    path = os.path.join(root, name)
    if want is None:
        raise ManifestError(f"{path} is not listed in {os.path.join(root, MANIFEST)}")
    if sha256(path) != want["sha256"]:
        raise ManifestError(f"{path} does not match its SHA-256 in {MANIFEST} (the file is damaged)")
