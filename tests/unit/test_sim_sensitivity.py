"""The sensitivity sweep: supported rates per setting, and its command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tieredkv.sim import sensitivity as sens


def test_supported_rates_follow_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sens, "AXES", {"host_gb": (1.0, 400.0)})
    monkeypatch.setattr(sens, "RATES", (20.0, 40.0, 80.0))
    monkeypatch.setattr(sens, "SYSTEMS", ("flashgen", "ideal"))
    result = sens.sensitivity(["host_gb"], minutes=8, workers=1)
    tp = result.throughput["host_gb"]
    assert set(tp) == {"1.0", "400.0"}
    assert 20 < tp["1.0"]["flashgen"] < tp["400.0"]["flashgen"] == 80  # 1 GB: SSD-bound
    assert tp["1.0"]["ideal"] == tp["400.0"]["ideal"] == 80  # the ideal has no host limit
    text = sens.render(result, "cmd")
    assert "| host memory (GB) | flashgen | ideal | bidaw / best baseline |" in text
    assert "| 400.0 | >= 80 | >= 80 | - |" in text  # no bidaw run: no ratio


def test_the_command_refuses_unknown_axes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        sens.main(["--axes", "gpu_colour", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2
    assert "--axes takes ssd_gbps" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="unknown axes"):
        sens.sensitivity(["gpu_colour"])
