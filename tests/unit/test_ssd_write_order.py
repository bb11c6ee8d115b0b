"""The order of a durable O_DIRECT write's last steps: the file is renamed into place
before its ``fsync`` (one journal commit per write where there were two), then its
directory is ``fsync``-ed (see :mod:`tieredkv.backends.ssd.writer`).

A process killed between the rename and the file's ``fsync`` leaves the segment whole
(every write had returned); a write whose file ``fsync`` fails after the rename takes the
renamed file back, at close if it cannot at once.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import anyio

from tests.faults import FaultInjector
from tests.segments import SegmentFactory, make_segment, read_back
from tieredkv import SSDTier
from tieredkv.backends.ssd import segment_file_name
from tieredkv.errors import TierIOError

CAPACITY = 64 << 20
REPO = Path(__file__).resolve().parents[2]

_KILLED_AT_FSYNC = textwrap.dedent(
    """
    import os, signal, stat, sys, types
    import anyio
    from tests.segments import make_segment, store
    from tieredkv import SSDTier
    from tieredkv.backends.ssd import writer

    class Os(types.ModuleType):  # the writer's os, but a file's fsync kills the process
        def __getattr__(self, name):
            return getattr(os, name)

        def fsync(self, fd):
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.kill(os.getpid(), signal.SIGKILL)
            os.fsync(fd)

    writer.os = Os("os")

    async def main():
        async with SSDTier(sys.argv[1], 64 << 20, direct_io=True) as tier:
            await store(tier, make_segment("s", 0, 3000, seed=5))

    anyio.run(main)
    """
)


async def test_killed_between_the_rename_and_the_fsync_leaves_the_segment_whole(
    ssd_dir: Path,
) -> None:
    """SIGKILL at the file's fsync (after the rename): the restarted tier finds the segment
    whole, byte for byte, and sets nothing aside."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    done = await anyio.run_process(
        [sys.executable, "-c", _KILLED_AT_FSYNC, str(ssd_dir)], cwd=REPO, env=env, check=False
    )
    assert done.returncode == -9, done.stderr.decode(errors="replace")
    s = make_segment("s", 0, 3000, seed=5)
    assert (ssd_dir / "segments" / segment_file_name(s.key)).exists()  # renamed first
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert tier.contains(s.key)
        assert await read_back(tier, s) == s.data
        assert tier.stats().corrupt == 0
        assert tier.set_aside("s") == ()
    assert list((ssd_dir / "quarantine").iterdir()) == []
    assert list((ssd_dir / "tmp").iterdir()) == []


async def test_a_failed_file_fsync_takes_the_renamed_file_back(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """The file's fsync fails after the rename, and so does the unlink of the renamed file:
    the write fails, the file stays only until the tier closes, and a restart does not find
    it; an earlier segment is untouched."""
    old, s = seg(session="s", seq=0, seed=6), seg(session="s", seq=1, seed=7)
    with FaultInjector() as faults:
        async with SSDTier(ssd_dir, CAPACITY, direct_io=True) as tier:
            assert tier.reserve(old.key, old.length)
            await tier.write(old.key, old.view)
            faults.fail_nth("fsync", faults.calls["fsync"] + 1)  # the file's
            faults.fail_nth("unlink", faults.calls["unlink"] + 2)  # after the tmp file's
            assert tier.reserve(s.key, s.length)
            try:
                await tier.write(s.key, s.view)
            except TierIOError:
                pass
            else:
                raise AssertionError("the write succeeded although its fsync failed")
            assert faults.injected == {"fsync": 1, "unlink": 1}
            assert not tier.contains(s.key)
            assert (ssd_dir / "segments" / segment_file_name(s.key)).exists()  # renamed
            tier.release(s.key)
    assert not (ssd_dir / "segments" / segment_file_name(s.key)).exists()
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert not tier.contains(s.key)
        assert await read_back(tier, old) == old.data
