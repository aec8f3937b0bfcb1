"""The disk tier's I/O layer (issue 28): ``DiskStore``, its run directory, its errors, its setup check.

Every round trip is compared bit for bit with the tensor written. Files go to pytest's ``tmp_path`` (ext4 here:
``O_DIRECT`` works) and every store is closed, so nothing is left behind.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from lightning_pstar import MemoryBudgetError, PatrickStarStrategy, PStarConfig
from lightning_pstar.runtime.aligned import ALIGNMENT, AlignedArena, align_up, aligned_empty
from lightning_pstar.runtime.disk import DiskIOError, DiskStore, check_disk_path
from lightning_pstar.runtime.run_directory import LOCK_NAME, RUN_PREFIX, RunDirectoryInUseError

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL_BLOCK = 16 << 10  # many blocks per tensor, so the block split and the threads are exercised


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskStore]:
    with DiskStore(tmp_path, threads=3, block_bytes=SMALL_BLOCK) as s:
        yield s


def _random(numel: int, dtype: torch.dtype, *, aligned: bool = False) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = aligned_empty(numel * itemsize) if aligned else torch.empty(numel * itemsize + 8, dtype=torch.uint8)[8:]
    raw.copy_(torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8))
    return raw.view(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _supports_direct(path: Path) -> bool:
    probe = path / ".direct-probe"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


# ---- round trips -------------------------------------------------------------------------------------------
SIZES = [1, 3, 1023, ALIGNMENT, SMALL_BLOCK + 7, 3 * SMALL_BLOCK // 4 + 1, 100_003]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
@pytest.mark.parametrize(("src_aligned", "out_aligned"), [(True, True), (False, False), (True, False), (False, True)])
def test_round_trip_is_bitwise(store: DiskStore, dtype: torch.dtype, src_aligned: bool, out_aligned: bool) -> None:
    for i, numel in enumerate(SIZES):
        src = _random(numel, dtype, aligned=src_aligned)
        store.write_sync(f"k{i}", src)
        out = _random(numel, dtype, aligned=out_aligned)  # garbage that must be overwritten
        store.read_sync(f"k{i}", out)
        assert _same_bits(src, out), (numel, dtype)
        nbytes = src.numel() * src.element_size()
        assert os.path.getsize(Path(store.path) / f"k{i}.pstar") == align_up(nbytes)
    assert store.bytes_on_disk == sum(align_up(n * store_itemsize(dtype)) for n in SIZES)


def store_itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def test_rewrite_of_a_key_replaces_its_bytes_and_shapes_are_fixed(store: DiskStore) -> None:
    first, second = torch.randn(5000), torch.randn(5000)
    store.write(first_key := "f0.master", first)
    store.write(first_key, second)  # issued without waiting: runs after the first write of the same key
    out = torch.empty(5000)
    store.read(first_key, out).result()
    assert _same_bits(out, second)
    with pytest.raises(ValueError, match=r"key 'f0.master' holds 5000 elements of torch.float32.*HINT"):
        store.write(first_key, torch.randn(4000))
    with pytest.raises(ValueError, match=r"holds 5000 elements of torch.float32, but `out` has 5000 of torch.bfloat16"):
        store.read(first_key, torch.empty(5000, dtype=torch.bfloat16))
    with pytest.raises(KeyError, match=r"no key 'missing'.*HINT"):
        store.read("missing", out)
    with pytest.raises(ValueError, match="contiguous"):
        store.write("t", torch.randn(8, 8).t())
    with pytest.raises(ValueError, match="letters, digits"):
        store.write("../escape", first)


def test_reserve_allocates_the_file_and_discard_removes_it(store: DiskStore) -> None:
    store.reserve("f1.exp_avg", 3000, torch.float32)
    path = Path(store.path) / "f1.exp_avg.pstar"
    assert path.stat().st_size == align_up(12000) and path.stat().st_blocks * 512 >= align_up(12000)
    store.reserve("f1.exp_avg", 3000, torch.float32)  # the same shape again: nothing happens
    src = torch.randn(3000)
    store.write_sync("f1.exp_avg", src)
    assert _same_bits(store.read_sync("f1.exp_avg", torch.empty(3000)), src)
    store.discard("f1.exp_avg")
    assert not path.exists() and store.keys() == []


# ---- concurrency -------------------------------------------------------------------------------------------
def test_concurrent_reads_and_writes_of_many_keys_from_many_threads(store: DiskStore) -> None:
    tensors = {f"f{i}.{kind}": torch.randn(20_000 + 37 * i) for i in range(6) for kind in ("master", "exp_avg")}
    futures = [store.write(key, t) for key, t in tensors.items()]  # all at once
    for f in futures:
        assert f.result() is None
    outs = {key: torch.empty_like(t) for key, t in tensors.items()}
    updated = {key: t + 1 for key, t in tensors.items()}
    errors: list[BaseException] = []

    def pipeline(keys: list[str]) -> None:  # read k, then write k's new value while reading the next key
        try:
            for key in keys:
                store.read(key, outs[key]).result()
                store.write(key, updated[key])
        except BaseException as err:  # noqa: B036 - reported below
            errors.append(err)

    keys = list(tensors)
    threads = [threading.Thread(target=pipeline, args=(keys[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    store.wait()
    for key in keys:
        assert _same_bits(outs[key], tensors[key]), key
        assert _same_bits(store.read_sync(key, torch.empty_like(outs[key])), updated[key]), key
    stats = store.stats()
    assert stats.writes == 2 * len(keys) and stats.reads == 2 * len(keys)
    assert stats.bytes_written == stats.bytes_read == 2 * sum(t.numel() * 4 for t in tensors.values())


def test_write_then_read_of_one_key_keeps_the_issue_order(store: DiskStore) -> None:
    values = [torch.full((50_000,), float(i)) for i in range(5)]
    outs = [torch.empty(50_000) for _ in values]
    futures = []
    for value, out in zip(values, outs, strict=True):  # nothing waited for: the per-key order alone orders them
        futures += [store.write("k", value), store.read("k", out)]
    for f in futures:
        f.result()
    for value, out in zip(values, outs, strict=True):
        assert _same_bits(value, out)


def test_the_step_pipeline_of_the_note_gives_the_serial_result(tmp_path: Path) -> None:
    """[Note: disk tier]'s pattern: read family k+1 while family k steps and k-1 is written back, on 3 buffers."""
    n, numel = 7, 40_000 + 3
    families = [torch.randn(numel) for _ in range(n)]
    expected = [f * 0.5 + 1 for f in families]  # the "optimizer step", in place on the family's buffer
    with DiskStore(tmp_path, threads=3, block_bytes=SMALL_BLOCK) as store:
        for k, f in enumerate(families):
            store.write(f"f{k}.master", f)
        store.wait()
        buf = [aligned_empty(numel * 4).view(torch.float32) for _ in range(3)]
        written: list[Future[None] | None] = [None, None, None]
        done: Future[None] | None = store.read("f0.master", buf[0])
        for k in range(n):
            nxt = None
            if k + 1 < n:
                previous = written[(k + 1) % 3]
                if previous is not None:
                    previous.result()
                nxt = store.read(f"f{k + 1}.master", buf[(k + 1) % 3])
            assert done is not None
            done.result()
            buf[k % 3].mul_(0.5).add_(1)
            written[k % 3] = store.write(f"f{k}.master", buf[k % 3])
            done = nxt
        store.wait()
        for k in range(n):
            assert _same_bits(store.read_sync(f"f{k}.master", torch.empty(numel)), expected[k]), k


def test_a_filesystem_without_fallocate_gets_sparse_files(store: DiskStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    src = torch.randn(12_345)
    store.write_sync("sparse", src)
    assert _same_bits(store.read_sync("sparse", torch.empty(12_345)), src)


def test_stats_count_bytes_and_reset_per_iteration(store: DiskStore) -> None:
    src = torch.randn(100_000)
    store.write_sync("a", src)
    first = store.reset_iteration()
    assert first.bytes_written == 400_000 and first.writes == 1 and first.write_seconds > 0 and first.write_gbps > 0
    assert first.busy_seconds >= first.write_seconds - 1e-9
    assert store.staging_bytes == 3 * SMALL_BLOCK + ALIGNMENT
    store.read_sync("a", torch.empty(100_000))
    it = store.iteration_stats()
    assert it.bytes_written == 0 and it.bytes_read == 400_000 and it.reads == 1 and it.read_gbps > 0
    total = store.stats()
    assert total.bytes_written == 400_000 and total.bytes_read == 400_000


# ---- the run directory -------------------------------------------------------------------------------------
def test_second_store_on_the_same_run_directory_is_refused(tmp_path: Path) -> None:
    src = torch.randn(10)
    with DiskStore(tmp_path, run_name="shared") as first:
        first.write_sync("a", src)
        with pytest.raises(RunDirectoryInUseError, match=r"pstar-run-shared is in use by another run.*HINT"):
            DiskStore(tmp_path, run_name="shared")
        assert _same_bits(first.read_sync("a", torch.empty(10)), src), "the refused store touched nothing"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["pstar-run-shared"]
    with DiskStore(tmp_path, run_name="shared") as second:  # free again once the first run is gone
        assert second.keys() == []
    assert list(tmp_path.iterdir()) == []


def test_ranks_starting_at_once_on_one_disk_path_get_their_own_directories(tmp_path: Path) -> None:
    stores: list[DiskStore] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            stores.append(DiskStore(tmp_path, threads=1, block_bytes=ALIGNMENT))
        except BaseException as err:  # noqa: B036 - reported below
            errors.append(err)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len({s.path for s in stores}) == 8 and all(Path(s.path).is_dir() for s in stores)
    for i, s in enumerate(stores):
        s.write_sync("k", torch.full((10,), float(i)))
    for i, s in enumerate(stores):
        assert _same_bits(s.read_sync("k", torch.empty(10)), torch.full((10,), float(i)))
        s.close()
    assert list(tmp_path.iterdir()) == []


def test_close_removes_everything_and_runs_once(tmp_path: Path) -> None:
    s = DiskStore(tmp_path)
    s.write_sync("a", torch.randn(1000))
    run_dir = Path(s.path)
    assert run_dir.parent == tmp_path and run_dir.name.startswith(RUN_PREFIX) and (run_dir / LOCK_NAME).exists()
    s.close()
    s.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="closed store"):
        s.write("a", torch.randn(1000))


def test_an_exception_in_a_with_block_still_removes_the_directory(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError):
        with DiskStore(tmp_path) as s:
            s.write("a", torch.randn(1000))
            _ = 1 / 0
    assert list(tmp_path.iterdir()) == []


def _make_dead_run(root: Path, name: str, files: dict[str, bytes], *, lock: bool = True) -> Path:
    path = root / f"{RUN_PREFIX}{name}"
    path.mkdir()
    if lock:
        (path / LOCK_NAME).touch()
    for file, data in files.items():
        (path / file).write_bytes(data)
    return path


def test_stale_directories_of_dead_runs_are_named_and_only_own_files_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dead = _make_dead_run(tmp_path, "dead", {"f0.master.pstar": b"x" * 100, "f0.exp_avg.pstar": b"y"})
    no_lock = _make_dead_run(tmp_path, "nolock", {"f1.master.pstar": b"z"}, lock=False)
    mixed = _make_dead_run(tmp_path, "mixed", {"f2.master.pstar": b"z", "notes.txt": b"mine"})
    live = _make_dead_run(tmp_path, "live", {"f3.master.pstar": b"w"})
    other = tmp_path / "not-a-run"
    other.mkdir()
    (other / "f4.master.pstar").write_bytes(b"v")
    (tmp_path / f"{RUN_PREFIX}afile").write_bytes(b"a file with the prefix, not a directory")
    starting = tmp_path / f".{RUN_PREFIX}starting.0a1b.tmp"  # a run being created right now: its lock looks free
    starting.mkdir()
    (starting / LOCK_NAME).touch()
    crashed = tmp_path / f".{RUN_PREFIX}crashed.0a1b.tmp"  # one killed while being created, long ago
    crashed.mkdir()
    (crashed / LOCK_NAME).touch()
    os.utime(crashed, (0, 0))
    held = os.open(live / LOCK_NAME, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live run (flock conflicts across open files)
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_pstar.runtime.run_directory"):
            with DiskStore(tmp_path) as s:
                mine = Path(s.path)
        assert not dead.exists() and not no_lock.exists()
        assert sorted(p.name for p in mixed.iterdir()) == ["notes.txt"], "the foreign file stays, own files go"
        assert sorted(p.name for p in live.iterdir()) == ["f3.master.pstar", LOCK_NAME], "a live run is untouched"
        assert (other / "f4.master.pstar").exists() and (tmp_path / f"{RUN_PREFIX}afile").exists()
        assert not mine.exists()
        assert starting.exists() and not crashed.exists()
        text = caplog.text
        assert (
            f"Removed the stale disk-tier directory {dead} of a run that is no longer alive (2 data files, 101 bytes)"
            in text
        )
        assert str(no_lock) in text and "left it: it holds files the disk tier did not create: ['notes.txt']" in text
        assert str(live) not in text
    finally:
        os.close(held)


_CHILD = """
import os, signal, sys, torch
from lightning_pstar.runtime.disk import DiskStore
store = DiskStore(sys.argv[1], run_name=sys.argv[2])
store.write_sync("f0.master", torch.randn(10_000))
print(store.path, flush=True)
if sys.argv[3] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _child(root: Path, name: str, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root), name, mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(child: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = child.communicate(timeout=300)
    return child.returncode, out, err


@pytest.mark.slow  # two child interpreters import Lightning: 10-30 s on 2 busy cores
def test_killed_run_leaves_a_stale_directory_the_next_run_removes_and_exit_removes_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # both children at once, each under a root of its own (a DiskStore removes the stale directories of its
    # root: the exiting child must not be the run that removes the killed child's)
    killed_root, exited_root = tmp_path / "killed", tmp_path / "exited"
    killed_root.mkdir()
    exited_root.mkdir()
    killed, exited = _child(killed_root, "killed", "kill"), _child(exited_root, "exited", "exit")
    code, out, err = _finish(killed)
    assert code == -9, err
    left = Path(out.strip())
    assert (left / "f0.master.pstar").exists(), "SIGKILL runs no clean-up"
    with caplog.at_level(logging.WARNING, logger="lightning_pstar.runtime.run_directory"):
        with DiskStore(killed_root):
            assert not left.exists()
    assert f"Removed the stale disk-tier directory {left}" in caplog.text
    code, out, err = _finish(exited)  # left without close(): the interpreter's exit removes it
    assert code == 0, err
    assert out.strip().endswith("pstar-run-exited")
    assert list(killed_root.iterdir()) == [] and list(exited_root.iterdir()) == []


# ---- buffered fallback -------------------------------------------------------------------------------------
def _refuse_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def fake_open(path: str, flags: int, mode: int = 0o777, **kw: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", fake_open)


def test_a_filesystem_that_refuses_o_direct_falls_back_to_buffered_io_and_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _refuse_direct(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="lightning_pstar.runtime.disk"):
        with DiskStore(tmp_path, block_bytes=SMALL_BLOCK) as s:
            tensors = {f"k{i}": _random(30_001 + i, torch.bfloat16) for i in range(3)}
            for key, t in tensors.items():
                s.write_sync(key, t)
            for key, t in tensors.items():
                assert _same_bits(s.read_sync(key, torch.empty_like(t)), t)
            assert s.direct is False
    assert caplog.text.count("refuses O_DIRECT") == 1, caplog.text


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_dev_shm_round_trip_says_once_if_it_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="pstar-test-"))
    try:
        direct = _supports_direct(root)  # tmpfs accepts O_DIRECT since Linux 6.6
        with caplog.at_level(logging.WARNING, logger="lightning_pstar.runtime.disk"):
            with DiskStore(root, block_bytes=SMALL_BLOCK) as s:
                for i in range(3):
                    t = _random(10_007, torch.float32)
                    s.write_sync(f"k{i}", t)
                    assert _same_bits(s.read_sync(f"k{i}", torch.empty_like(t)), t)
        assert caplog.text.count("refuses O_DIRECT") == (0 if direct else 1), caplog.text
        assert list(root.iterdir()) == []
    finally:
        os.rmdir(root)


# ---- errors ------------------------------------------------------------------------------------------------
def test_a_full_disk_mid_run_names_the_path_and_leaves_earlier_files_intact(
    store: DiskStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = torch.randn(30_000)
    store.write_sync("f0.master", kept)
    store.reserve("f1.master", 30_000, torch.float32)

    def full(fd: int, buffers: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(DiskIOError) as info:
        store.write("f1.master", torch.randn(30_000)).result()
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert f"{store.path}/f1.master.pstar" in message and "write of" in message and "bytes at offset" in message
    assert "No space left on device" in message and "HINT: the filesystem is full" in message
    monkeypatch.undo()
    assert _same_bits(store.read_sync("f0.master", torch.empty(30_000)), kept)
    with pytest.raises(
        DiskIOError,
        match=r"cannot read .*f1.master.pstar: its last write failed \(No space left on device, errno 28\). HINT",
    ):
        store.read("f1.master", torch.empty(30_000)).result()
    again = torch.randn(30_000)
    store.write_sync("f1.master", again)  # a later good write makes it readable again
    assert _same_bits(store.read_sync("f1.master", torch.empty(30_000)), again)


def test_a_full_disk_when_a_key_is_created_raises_at_once_and_leaves_no_file(
    store: DiskStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DiskIOError, match=r"allocate of 40,960 bytes at offset 0 of .*f9.master.pstar.*HINT"):
        store.write("f9.master", torch.randn(10_000))
    assert store.keys() == [] and not (Path(store.path) / "f9.master.pstar").exists()


def test_a_short_read_names_the_path_and_the_byte_counts(store: DiskStore) -> None:
    store.write_sync("f0.master", torch.randn(100_000))
    os.truncate(Path(store.path) / "f0.master.pstar", 8192)  # another process cut the file
    with pytest.raises(DiskIOError) as info:
        store.read("f0.master", torch.empty(100_000)).result()
    assert info.value.errno == errno.EIO
    # whichever block fails first is reported: the first (8,192 of its 16,384 bytes are left) or a later one (0)
    pattern = r"read of 16,384 bytes at offset ([\d,]+) of .*f0.master.pstar failed after ([\d,]+) bytes: short read:"
    match = re.search(pattern + r" got \2 of 16,384 bytes\. HINT: ", str(info.value))
    assert match is not None, str(info.value)
    assert (match.group(1), match.group(2)) == ("0", "8,192") or match.group(2) == "0", str(info.value)


def test_a_real_full_filesystem_is_reported_naming_the_path(small_filesystem: Path) -> None:
    with DiskStore(small_filesystem, threads=2, block_bytes=SMALL_BLOCK) as s:
        s.write_sync("small", torch.randn(1000))
        with pytest.raises(DiskIOError, match=r"of .*big.pstar failed.*HINT: the filesystem is full"):
            s.write("big", torch.randn(1 << 20))
        assert s.read_sync("small", torch.empty(1000)) is not None


def test_the_disk_budget_refuses_a_key_past_it(tmp_path: Path) -> None:
    with DiskStore(tmp_path, limit_bytes=3 * ALIGNMENT) as s:
        s.write_sync("a", torch.randn(2 * ALIGNMENT // 4))
        with pytest.raises(MemoryBudgetError, match=r"needs 8,192 bytes .* 8,192 of the disk budget of 12,288.*HINT"):
            s.write("b", torch.randn(2 * ALIGNMENT // 4))


# ---- the page cache ----------------------------------------------------------------------------------------
def _cached_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Cached line in /proc/meminfo")


def test_direct_io_does_not_grow_the_page_cache(tmp_path: Path) -> None:
    if not _supports_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    size = 256 << 20
    src = aligned_empty(size)
    src.fill_(7)
    with DiskStore(tmp_path, threads=4, block_bytes=8 << 20) as s:
        before = _cached_bytes()
        s.write_sync("big", src)
        s.read_sync("big", src)
        growth = _cached_bytes() - before
    # other processes on the machine move Cached too: a buffered write would add the whole 256 MiB
    assert growth < size // 4, f"page cache grew by {growth / 2**20:.0f} MiB for a {size >> 20} MiB direct write"


# ---- aligned buffers ---------------------------------------------------------------------------------------
def test_aligned_buffers_and_the_arena() -> None:
    for nbytes in (0, 1, 4095, 4096, 12_345):
        t = aligned_empty(nbytes)
        assert t.dtype == torch.uint8 and t.numel() == nbytes and t.data_ptr() % ALIGNMENT == 0
    arena = AlignedArena(2 * ALIGNMENT, 3)
    indices = [arena.acquire() for _ in range(3)]
    assert sorted(indices) == [0, 1, 2] and all(arena.block(i).data_ptr() % ALIGNMENT == 0 for i in indices)
    arena.release(indices[0])
    assert arena.acquire() == indices[0]
    assert not arena.registered
    with pytest.raises(ValueError, match="multiple of 4096"):
        AlignedArena(1000, 1)


# ---- the setup check and the options -----------------------------------------------------------------------
def test_check_disk_path_refuses_with_the_path_and_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"`disk_path` '.*nowhere' does not exist. HINT"):
        check_disk_path(tmp_path / "nowhere", 1, None)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match=r"`disk_path` '.*file' is not a directory. HINT"):
        check_disk_path(tmp_path / "file", 1, None)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert 0 < check_disk_path(tmp_path, 1, None) <= free
    assert check_disk_path(tmp_path, 1000, 4096) == 4096
    with pytest.raises(MemoryBudgetError, match=r"needs 5,000 bytes on disk, but the disk budget is 4,096 .*HINT"):
        check_disk_path(tmp_path, 5000, 4096)
    with pytest.raises(MemoryBudgetError, match=r"needs [\d,]+ bytes on disk, but only [\d,]+ bytes are free.*HINT"):
        check_disk_path(tmp_path, free + (1 << 40), free + (2 << 40))
    with pytest.raises(MemoryBudgetError, match=r"the disk budget is [\d,]+ bytes \(0.8 of its free space"):
        check_disk_path(tmp_path, free, None)
    with pytest.raises(ValueError, match=r"`disk_path` is unset but the plan puts 10 bytes on disk"):
        check_disk_path(None, 10, None)
    _refuse_writes(monkeypatch)
    with pytest.raises(ValueError, match=r"`disk_path` '.*' is not writable \(Read-only file system\). HINT"):
        check_disk_path(tmp_path, 1, None)
    assert [p.name for p in tmp_path.iterdir()] == ["file"], "the probe leaves nothing"


def _refuse_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(path: str, flags: int, mode: int = 0o777, **kw: object) -> int:
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(os, "open", read_only)


def test_disk_options_flow_from_the_strategy_keywords_and_are_validated(tmp_path: Path) -> None:
    strategy = PatrickStarStrategy(disk_path=tmp_path, disk_memory_limit="2GiB")
    assert strategy.config.memory.disk_path == str(tmp_path) and strategy.config.memory.disk_limit_bytes == 2 << 30
    cfg = PStarConfig.from_mapping({"memory": {"disk_path": str(tmp_path), "disk_limit": "1GiB"}})
    assert cfg.memory.disk_path == str(tmp_path) and cfg.memory.disk_limit_bytes == 1 << 30
    assert PStarConfig().memory.disk_path is None and PStarConfig().memory.disk_limit is None
    with pytest.raises(ValueError, match=r"`disk_memory_limit` must be positive, got 0"):
        PatrickStarStrategy(disk_path=tmp_path, disk_memory_limit=0)
    with pytest.raises(ValueError, match=r"`disk_path` must be None \(no disk tier\) or a directory path"):
        PatrickStarStrategy(disk_path="")
    with pytest.warns(UserWarning, match=r"`memory.disk_limit` \(`disk_memory_limit`, '1GiB'\) is ignored"):
        PatrickStarStrategy(disk_memory_limit="1GiB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PatrickStarStrategy(disk_path=tmp_path)


class _FakeCudart:
    """Records cudaHostRegister/Unregister calls: the CPU-visible part of the CUDA arena path."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - cudart's name
        self.calls.append(("register", ptr, size))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - cudart's name
        self.calls.append(("unregister", ptr, 0))
        return 0


def test_a_cuda_store_registers_its_staging_arena_once_and_unregisters_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with DiskStore(tmp_path, device="cuda", threads=2, block_bytes=SMALL_BLOCK) as s:
        assert s._arena.registered
        ((kind, ptr, size),) = fake.calls
        assert kind == "register" and ptr % ALIGNMENT == 0 and size == 2 * SMALL_BLOCK
        src = torch.randn(10_001)
        s.write_sync("k", src)
        assert _same_bits(s.read_sync("k", torch.empty(10_001)), src)
    assert fake.calls[1:] == [("unregister", ptr, 0)]
    failing = _FakeCudart(code=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: failing)
    with caplog.at_level(logging.WARNING, logger="lightning_pstar.runtime.aligned"):
        arena = AlignedArena(SMALL_BLOCK, 1, pin=True)
    assert not arena.registered and "cudaHostRegister of the 16384-byte disk staging arena failed" in caplog.text
    arena.close()
    assert [c[0] for c in failing.calls] == ["register"], "nothing to unregister"
    with DiskStore(tmp_path, device="cpu", threads=1, block_bytes=SMALL_BLOCK) as s:
        assert not s._arena.registered  # a CPU run never pins


# ---- CUDA --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_store_registers_its_arena_and_round_trips_device_tensors(tmp_path: Path) -> None:
    with DiskStore(tmp_path, device="cuda", threads=2, block_bytes=SMALL_BLOCK) as s:
        assert s._arena.registered
        src = torch.randn(100_003, device="cuda").to(torch.bfloat16)
        s.write_sync("dev", src)
        out = torch.empty_like(src)
        s.read_sync("dev", out)
        assert _same_bits(out.cpu(), src.cpu())
        host = _random(70_001, torch.float32, aligned=True)
        s.write_sync("host", host)
        assert _same_bits(s.read_sync("host", torch.empty(70_001)), host)
    assert list(tmp_path.iterdir()) == []
