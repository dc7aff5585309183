"""The prefix cache's second tier: full KV blocks in files under `--kv-offload-dir`, keyed by their prefix hash.

Each model key (engine/kv_identity.py) has its own subdirectory, so one directory serves several models and a
file is never read into another model's cache. Writes run on a writer thread behind a bounded queue; the step
thread only hands it bytes (an evicted block, copied before its memory is reused) or views of blocks it keeps
referenced until the write is done (a save). The directory is bounded by `--kv-offload-bytes`: the least
recently used files go first, except those a named save keeps (`names/*.json`). A file that fails its checks on
read is removed and counts as a miss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from slotserve import faults
from slotserve.faults import FaultPoint
from slotserve.kv_cache import block_file
from slotserve.kv_cache.block_file import BlockFileError

logger = logging.getLogger("slotserve")

_NAMES = "names"
@dataclass
class DiskTierStats:
    hit_blocks: int = 0  # blocks read back into the memory tier
    bytes_read: int = 0
    bytes_written: int = 0
    files_written: int = 0
    corrupt_files: int = 0  # failed a check on read, removed
    write_errors: int = 0  # an OSError writing (a full disk): the block is not stored
    dropped_writes: int = 0  # evictions not written because the queue was full or the budget is all pinned
    evicted_files: int = 0  # removed to stay within --kv-offload-bytes


@dataclass
class BlockWrite:
    block_hash: int
    token_ids: tuple[int, ...]
    payload: Callable[[], bytes]  # called on the writer thread


@dataclass
class WriteJob:
    blocks: list[BlockWrite]
    done: Callable[[WriteJob], None] | None = None  # called on the writer thread once every block is stored
    name: str | None = None  # a named save: its manifest is written after its blocks
    token_ids: list[int] = field(default_factory=list)  # a named save's prompt, for a restore to run again
    block_size: int = 0
    written: int = 0  # blocks stored (now or before)
    leading: int = 0  # of those, the ones before the first that failed: the prefix a later request can read
    failed: int = 0
    queued_at: float = field(default_factory=time.monotonic)


class DiskTier:
    def __init__(self, root: str | os.PathLike, model_key: bytes, max_bytes: int, queue_blocks: int = 256,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.model_key = model_key
        self.dir = Path(root) / model_key.hex()
        self.names_dir = self.dir / _NAMES
        self.names_dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.stats = DiskTierStats()
        self._lock = threading.Lock()  # guards the index, `bytes_used` and `_pinned` (step thread and writer)
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file size, least recently used first
        self.bytes_used = 0
        self._pinned: dict[int, int] = {}  # hash -> how many named saves keep it
        self._scan()
        # Unbounded as a queue: evictions stop at `queue_blocks` (`offer`), saves are bounded by the blocks they hold.
        self._queue: queue.Queue[WriteJob | None] = queue.Queue()
        self.queue_blocks = queue_blocks
        self._on_error = on_error
        self.error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="KVDiskWriter", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        """Indexes the files a previous run left, oldest access first; removes its unfinished temporary files."""
        entries = []
        for path in self.dir.iterdir():
            if path.name.endswith(block_file.TMP_SUFFIX):
                path.unlink(missing_ok=True)  # a write a crash interrupted: never renamed, never read
            elif path.name.endswith(block_file.SUFFIX):
                try:
                    st = path.stat()
                    entries.append((st.st_mtime, int(path.name.removesuffix(block_file.SUFFIX), 16), st.st_size))
                except (OSError, ValueError):
                    continue
        for _, block_hash, size in sorted(entries):
            self._index[block_hash] = size
            self.bytes_used += size
        for manifest in self.manifests():
            self._pin(manifest["hashes"], 1)

    # ---- lookups (step thread) ------------------------------------------------------------------

    @property
    def num_files(self) -> int:
        return len(self._index)

    def contains(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    def read(self, block_hash: int, token_ids: tuple[int, ...]) -> bytes | None:
        """The payload of a stored block with exactly these tokens; None for a miss, a removed file or one that
        fails its checks (removed here, so it is never served)."""
        path = self.dir / block_file.file_name(block_hash)
        try:
            data = path.read_bytes()
        except OSError as e:  # removed by the budget meanwhile, or unreadable: a miss either way
            if not isinstance(e, FileNotFoundError):
                logger.warning("KV offload: reading %s failed: %s", path.name, e)
            self._forget(block_hash)
            return None
        try:
            stored = block_file.decode(data, self.model_key, block_hash)
        except BlockFileError as e:
            logger.warning("KV offload: %s: %s; removed", path.name, e)
            self.stats.corrupt_files += 1
            self._remove(block_hash)
            return None
        if stored.token_ids != token_ids:  # a hash collision: a miss, the file stays for its own prefix
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        with contextlib.suppress(OSError):  # removed meanwhile: the payload read is whole all the same
            os.utime(path)  # the access order survives a restart
        self.stats.hit_blocks += 1
        self.stats.bytes_read += len(data)
        return stored.payload

    # ---- writes ---------------------------------------------------------------------------------

    def offer(self, write: BlockWrite) -> bool:
        """Queues an evicted block for writing unless `queue_blocks` writes wait already (the step thread never
        waits on the disk; each queued eviction holds a copy of its block)."""
        if self._queue.qsize() >= self.queue_blocks or self.error is not None:
            self.stats.dropped_writes += 1
            return False
        self._queue.put(WriteJob([write]))
        return True

    def submit(self, job: WriteJob) -> None:
        """Queues a save (its blocks stay referenced until `job.done` releases them)."""
        self._queue.put(job)

    def flush(self) -> None:
        """Returns once everything queued so far is written (or dropped)."""
        if self.error is None:
            self._queue.join()

    def close(self, timeout: float = 30.0) -> None:
        """Writes what is queued, then stops the writer."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout)

    def _write_loop(self) -> None:
        try:
            while (job := self._queue.get()) is not None:
                self._run(job)
                self._queue.task_done()
        except Exception as e:  # a bug, not the disk: the engine must end, not wedge behind a dead writer
            logger.exception("KV offload: the writer failed")
            self.error = e
            if self._on_error is not None:
                self._on_error(e)

    def _run(self, job: WriteJob) -> None:
        hashes = [f"{w.block_hash:032x}" for w in job.blocks]
        if job.name is not None:  # from the start: the budget must not evict its own first blocks for its last
            self._pin(hashes, 1)
        for write in job.blocks:
            if self._store(write, pinned=job.name is not None):
                job.written += 1
                job.leading += not job.failed
            else:
                job.failed += 1
        if job.name is not None and not job.failed:
            try:
                self._write_manifest(job)
            except OSError as e:  # its blocks are stored, as unnamed ones; the save reports none
                logger.warning("KV offload: writing the manifest of %r failed: %s", job.name, e)
                self.stats.write_errors += 1
                job.failed += 1
        if job.name is not None and job.failed:
            self._pin(hashes, -1)
        if job.done is not None:
            job.done(job)

    def _store(self, write: BlockWrite, pinned: bool) -> bool:
        with self._lock:
            if write.block_hash in self._index:
                self._index.move_to_end(write.block_hash)
                return True
        data = block_file.encode(self.model_key, write.block_hash, write.token_ids, write.payload())
        if not self._make_room(len(data), must=pinned):
            self.stats.dropped_writes += 1
            return False
        path = self.dir / block_file.file_name(write.block_hash)
        faults.check(FaultPoint.KV_WRITE)
        if faults.fires(FaultPoint.KV_WRITE_STALL):
            path.with_name(f"{path.name}.{os.getpid()}{block_file.TMP_SUFFIX}").write_bytes(data[:len(data) // 2])
            time.sleep(faults.STALL_SECONDS)
        try:
            block_file.write_atomic(path, data)
        except OSError as e:
            logger.warning("KV offload: writing %s failed: %s", path.name, e)
            self.stats.write_errors += 1
            return False
        with self._lock:
            self._index[write.block_hash] = len(data)
            self.bytes_used += len(data)
        self.stats.bytes_written += len(data)
        self.stats.files_written += 1
        return True

    def _make_room(self, size: int, must: bool) -> bool:
        """Removes least recently used unpinned files until `size` more bytes fit the budget."""
        while True:
            with self._lock:
                if self.bytes_used + size <= self.max_bytes:
                    return True
                victim = next((h for h in self._index if h not in self._pinned), None)
            if victim is None:
                if must:
                    logger.warning("KV offload: named saves fill --kv-offload-bytes; a saved block is not stored")
                return False
            self._remove(victim)
            self.stats.evicted_files += 1

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.bytes_used -= size

    def _remove(self, block_hash: int) -> None:
        self._forget(block_hash)
        (self.dir / block_file.file_name(block_hash)).unlink(missing_ok=True)

    # ---- named saves ----------------------------------------------------------------------------

    def _pin(self, hashes: list[str], delta: int) -> None:
        with self._lock:
            for h in map(lambda x: int(x, 16), hashes):
                count = self._pinned.get(h, 0) + delta
                if count > 0:
                    self._pinned[h] = count
                else:
                    self._pinned.pop(h, None)

    def _write_manifest(self, job: WriteJob) -> None:
        """The save's name, after its blocks (pinned already); the blocks of the save it replaces are unpinned."""
        previous = self.manifest(job.name)
        hashes = [f"{w.block_hash:032x}" for w in job.blocks]
        with self._lock:
            size = sum(self._index.get(w.block_hash, 0) for w in job.blocks)
        manifest = {"name": job.name, "num_tokens": len(job.token_ids), "block_size": job.block_size,
                    "hashes": hashes, "bytes": size, "token_ids": job.token_ids, "created": time.time()}
        block_file.write_atomic(self._manifest_path(job.name), json.dumps(manifest).encode())
        if previous is not None:
            self._pin(previous["hashes"], -1)

    def _manifest_path(self, name: str) -> Path:
        return self.names_dir / f"{name}.json"

    def manifest(self, name: str) -> dict | None:
        try:
            return json.loads(self._manifest_path(name).read_text())
        except (OSError, ValueError):
            return None

    def manifests(self) -> list[dict]:
        found = []
        for path in sorted(self.names_dir.glob("*.json")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return found

    def delete_name(self, name: str) -> bool:
        """Forgets a named save; its blocks stay as ordinary cached files (evictable again)."""
        manifest = self.manifest(name)
        if manifest is None:
            return False
        self._manifest_path(name).unlink(missing_ok=True)
        self._pin(manifest["hashes"], -1)
        return True

    def snapshot(self) -> dict:
        s = self.stats
        return {"dir": str(self.dir), "files": self.num_files, "bytes_used": self.bytes_used,
                "max_bytes": self.max_bytes, "queued_writes": self._queue.qsize(),
                "names": sum(1 for _ in self.names_dir.glob("*.json")),
                "hit_blocks": s.hit_blocks, "bytes_read": s.bytes_read, "bytes_written": s.bytes_written,
                "files_written": s.files_written, "corrupt_files": s.corrupt_files, "write_errors": s.write_errors,
                "dropped_writes": s.dropped_writes, "evicted_files": s.evicted_files}
