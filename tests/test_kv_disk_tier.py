"""The KV disk tier alone: block files refuse every torn, flipped or foreign byte; the directory survives a new
process (a scan), removes what fails a check, keeps its byte budget by recency and keeps named saves."""

from __future__ import annotations

import os
import threading

import pytest

from slotserve.engine.protocol import check_save_name
from slotserve.kv_cache import block_file
from slotserve.kv_cache.block_file import BlockFileError
from slotserve.kv_cache.disk_tier import BlockWrite, DiskTier, WriteJob

KEY = bytes(range(16))
TOKENS = tuple(range(16))


def _payload(i: int, size: int = 4096) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


def _write(tier: DiskTier, i: int, size: int = 4096, name: str | None = None) -> WriteJob:
    done = threading.Event()
    job = WriteJob([BlockWrite(1000 + i, TOKENS, lambda: _payload(i, size))], done=lambda _: done.set(), name=name,
                   token_ids=list(TOKENS), block_size=16)
    tier.submit(job)
    assert done.wait(10)
    return job


def test_a_block_file_round_trips_and_refuses_every_damage():
    data = block_file.encode(KEY, 42, TOKENS, _payload(1))
    stored = block_file.decode(data, KEY, 42)
    assert stored.token_ids == TOKENS and stored.payload == _payload(1)
    with pytest.raises(BlockFileError, match="another model"):
        block_file.decode(data, bytes(16), 42)
    with pytest.raises(BlockFileError, match="another block"):
        block_file.decode(data, KEY, 43)
    for cut in (0, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(BlockFileError):
            block_file.decode(data[:cut], KEY, 42)
    for at in (0, 12, 60, 100, len(data) // 2, len(data) - 1):  # header, tokens, payload, checksum
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        with pytest.raises(BlockFileError):
            block_file.decode(bytes(flipped), KEY, 42)


def test_blocks_outlive_the_tier_and_damaged_files_are_removed_not_served(tmp_path):
    tier = DiskTier(tmp_path, KEY, 1 << 30)
    for i in range(4):
        _write(tier, i)
    tier.close()
    files = sorted(tier.dir.glob(f"*{block_file.SUFFIX}"))
    assert len(files) == 4 and tier.stats.files_written == 4
    truncated, flipped = tier.dir / block_file.file_name(1001), tier.dir / block_file.file_name(1002)
    truncated.write_bytes(truncated.read_bytes()[:100])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    (tier.dir / f"{block_file.file_name(1009)}.123{block_file.TMP_SUFFIX}").write_bytes(b"torn")

    again = DiskTier(tmp_path, KEY, 1 << 30)
    assert not list(again.dir.glob(f"*{block_file.TMP_SUFFIX}"))  # a crashed write's leftover is gone
    assert again.num_files == 4
    assert again.read(1000, TOKENS) == _payload(0) and again.read(1003, TOKENS) == _payload(3)
    assert again.read(1001, TOKENS) is None and again.read(1002, TOKENS) is None
    assert not truncated.exists() and not flipped.exists()
    assert again.stats.corrupt_files == 2 and again.num_files == 2
    assert again.read(1000, tuple(range(1, 17))) is None  # other tokens under the hash: a miss, the file stays
    assert again.contains(1000)
    again.close()


def test_another_model_key_sees_none_of_the_files(tmp_path):
    tier = DiskTier(tmp_path, KEY, 1 << 30)
    _write(tier, 0)
    tier.close()
    other = DiskTier(tmp_path, bytes(16), 1 << 30)
    assert other.num_files == 0 and other.read(1000, TOKENS) is None
    other.close()


def test_the_budget_removes_the_least_recently_used_but_never_a_named_save(tmp_path):
    size = len(block_file.encode(KEY, 0, TOKENS, _payload(0)))
    tier = DiskTier(tmp_path, KEY, 3 * size)
    _write(tier, 0, name="kept")
    _write(tier, 1)
    _write(tier, 2)
    assert tier.read(1001, TOKENS) is not None  # 1001 is now more recent than 1002
    _write(tier, 3)
    assert tier.contains(1000) and tier.contains(1001) and not tier.contains(1002) and tier.contains(1003)
    assert tier.bytes_used <= 3 * size and tier.stats.evicted_files == 1
    assert tier.manifest("kept")["token_ids"] == list(TOKENS)
    tier.close()
    again = DiskTier(tmp_path, KEY, 3 * size)  # the pins come back from the manifest
    _write(again, 4)
    _write(again, 5)
    assert again.contains(1000)
    assert again.delete_name("kept")
    _write(again, 6)
    assert not again.contains(1000)
    again.close()


def test_a_named_save_past_the_budget_keeps_its_first_blocks_and_no_name(tmp_path):
    size = len(block_file.encode(KEY, 0, TOKENS, _payload(0)))
    tier = DiskTier(tmp_path, KEY, 2 * size)
    done = threading.Event()
    job = WriteJob([BlockWrite(2000 + i, TOKENS, lambda i=i: _payload(i)) for i in range(3)],
                   done=lambda _: done.set(), name="big", token_ids=list(TOKENS), block_size=16)
    tier.submit(job)
    assert done.wait(10)
    assert (job.written, job.leading, job.failed) == (2, 2, 1)
    assert tier.contains(2000) and tier.contains(2001) and tier.manifest("big") is None
    _write(tier, 9)  # not pinned any more: the budget may take them again
    assert tier.contains(1009) and tier.num_files == 2
    tier.close()


def test_a_full_queue_drops_evictions_instead_of_waiting(tmp_path):
    tier = DiskTier(tmp_path, KEY, 1 << 30, queue_blocks=2)
    gate = threading.Event()
    tier.submit(WriteJob([BlockWrite(1, TOKENS, lambda: gate.wait(10) and _payload(1))]))
    taken = [tier.offer(BlockWrite(10 + i, TOKENS, lambda: _payload(2))) for i in range(5)]
    gate.set()
    tier.close()
    assert taken.count(False) >= 3 and tier.stats.dropped_writes == taken.count(False)


def test_a_writer_that_fails_reports_it(tmp_path):
    errors = []
    tier = DiskTier(tmp_path, KEY, 1 << 30, on_error=errors.append)

    def broken() -> bytes:
        raise RuntimeError("a bug")

    tier.submit(WriteJob([BlockWrite(1, TOKENS, broken)]))
    tier.close()
    assert isinstance(tier.error, RuntimeError) and errors == [tier.error]
    assert not tier.offer(BlockWrite(2, TOKENS, lambda: b""))


def test_a_failed_write_is_counted_and_leaves_no_file(tmp_path):
    tier = DiskTier(tmp_path, KEY, 1 << 30)
    # A directory where the temporary file goes: the open fails with an OSError, as on a full disk.
    (tier.dir / f"{block_file.file_name(1000)}.{os.getpid()}{block_file.TMP_SUFFIX}").mkdir()
    job = _write(tier, 0)
    tier.close()
    assert job.failed == 1 and tier.stats.write_errors == 1 and tier.error is None
    assert not tier.contains(1000) and not (tier.dir / block_file.file_name(1000)).exists()


@pytest.mark.parametrize("bad", ["", ".hidden", "a/b", "../up", "x" * 129, "sp ace"])
def test_save_names_are_plain_file_names(bad):
    with pytest.raises(ValueError, match=r"^name:"):
        check_save_name(bad)
    assert check_save_name("system-prompt_v1.2") == "system-prompt_v1.2"
