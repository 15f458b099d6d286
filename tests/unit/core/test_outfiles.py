"""Removing the temporary folder of a failed zarr write while zarr is still writing into it."""

import asyncio
from pathlib import Path

import zarr.core.sync

from vitcam_nb.core.outfiles import remove_unfinished_folder


def _start_late_chunk_write(folder: Path) -> None:
    """Leave a task on zarr's loop that writes one more chunk file into ``folder`` a moment later, as zarr's
    other chunk writes go on after the first one failed."""

    async def late_write() -> None:
        await asyncio.sleep(0.3)
        (folder / "a" / "c").mkdir(parents=True, exist_ok=True)
        (folder / "a" / "c" / "0").write_bytes(b"chunk")

    async def start() -> None:
        asyncio.ensure_future(late_write())

    zarr.core.sync.sync(start())


def test_the_folder_is_removed_after_zarrs_pending_writes_end(tmp_path):
    folder = tmp_path / ".t.zarr.tmp-1"
    folder.mkdir()
    _start_late_chunk_write(folder)
    remove_unfinished_folder(folder)
    # the late write has ended (no task is left) and did not bring the folder back
    assert zarr.core.sync.sync(_other_tasks()) == 0
    assert list(tmp_path.iterdir()) == []


async def _other_tasks() -> int:
    return len(asyncio.all_tasks() - {asyncio.current_task()})


def test_a_folder_no_write_is_pending_for_is_removed(tmp_path):
    folder = tmp_path / ".t.zarr.tmp-2"
    (folder / "x").mkdir(parents=True)
    remove_unfinished_folder(folder)
    assert not folder.exists()
