"""Removing the temporary folder of a failed zarr write while zarr is still writing into it; the checks an output
path or folder gets before any work (a flag that is not a bool, a folder that is a file)."""

import asyncio
from pathlib import Path

import pytest
import zarr.core.sync

import vitcam_nb as vc
from vitcam_nb.core.outfiles import OutputFolder, check_output, remove_unfinished_folder


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


@pytest.mark.parametrize("flag", ["no", "False", 0, 1, None])
def test_an_overwrite_flag_that_is_not_a_bool_is_refused_and_the_file_kept(tmp_path, flag):
    mine = tmp_path / "report.html"
    mine.write_bytes(b"mine")
    with pytest.raises(vc.ArgumentTypeError, match=r"^overwrite: expected True or False, got "):
        check_output(mine, overwrite=flag, ours=lambda p: False, what="page")
    with pytest.raises(vc.ArgumentTypeError, match=r"^overwrite: expected True or False, got "):
        OutputFolder(tmp_path, ["report.html"], "test", overwrite=flag)
    assert mine.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_an_output_folder_that_is_a_file_is_refused_and_nothing_is_created(tmp_path):
    mine = tmp_path / "results"
    mine.write_bytes(b"mine")
    for overwrite in (False, True):
        with pytest.raises(vc.OutputExistsError, match=r"results is a file; the outputs are written into a folder"):
            OutputFolder(mine, ["a.csv"], "test", overwrite=overwrite)
    OutputFolder(tmp_path / "new" / "sub", ["a.csv"], "test")  # only checks: the folder is made by the writer
    assert mine.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.iterdir()) == ["results"]
